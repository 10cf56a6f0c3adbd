"""What the fused ops keep for backward when part of their inputs is frozen (LoRA, ControlNet or guidance training
through a frozen model: the modulation, gates, weights and the text stream need no gradient). The unfused
compositions keep no activation a frozen input's gradient alone would need, and neither may the fused ops: each
case asserts that the activation only a frozen input's gradient needs is not among the saved tensors."""

import torch

import ldmopt
from ldmopt import ops


def _saved_storages(fn) -> set[int]:
    kept: set[int] = set()

    def pack(t):
        kept.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ldmopt.use_backend("torch"):
        fn()
    return kept


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_adaln_gated_residual_with_a_frozen_gate_keeps_no_x():
    x = torch.randn(2, 9, 24, requires_grad=True)  # the attention output
    residual = torch.randn(2, 9, 24, requires_grad=True)
    gate, scale, shift = torch.randn(2, 24), torch.randn(2, 24), torch.randn(2, 24)  # frozen temb projection
    saved = _saved_storages(lambda: ops.adaln_modulate(x, scale, shift, residual=residual, gate=gate))
    assert _ptr(x) not in saved  # d x = ds * gate; only d gate needs x
    # Gradients still those of the composition.
    with ldmopt.use_backend("torch"):
        out = ops.adaln_modulate(x, scale, shift, residual=residual, gate=gate)
    dy = torch.randn_like(out)
    dx, dres = torch.autograd.grad(out, (x, residual), dy)
    s = residual + gate[:, None] * x
    ref = torch.nn.functional.layer_norm(s, (24,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    rdx, rdres = torch.autograd.grad(ref, (x, residual), dy)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dres, rdres, rtol=1e-5, atol=1e-5)


def test_joint_rms_norm_keeps_no_frozen_part():
    head = torch.randn(1, 7, 2, 16)  # the text stream from a frozen context embedder
    tail = torch.randn(1, 11, 2, 16, requires_grad=True)
    weights = (torch.randn(16), torch.randn(16))
    saved = _saved_storages(lambda: ops.rms_norm((head, tail), weights, eps=1e-6, cat_dim=1))
    assert _ptr(head) not in saved and _ptr(tail) in saved
    with ldmopt.use_backend("torch"):
        out = ops.rms_norm((head, tail), weights, eps=1e-6, cat_dim=1)
    dy = torch.randn_like(out)
    (dtail,) = torch.autograd.grad(out, (tail,), dy)
    ref = torch.nn.functional.rms_norm(tail, (16,), weights[1], eps=1e-6)
    (rdtail,) = torch.autograd.grad(ref, (tail,), dy[:, 7:])
    torch.testing.assert_close(dtail, rdtail, rtol=1e-5, atol=1e-5)


def test_blended_linear_with_frozen_weight_and_mix_keeps_no_inputs():
    x, x_tail = torch.randn(4, 5, 24, requires_grad=True), torch.randn(4, 5, 24, requires_grad=True)
    weight, mix = torch.randn(16, 24), torch.rand(4)
    saved = _saved_storages(lambda: ops.linear((x, x_tail), weight, mix=mix))
    assert _ptr(x) not in saved and _ptr(x_tail) not in saved  # dx = mix dA, dx_tail = (1 - mix) dA
    with ldmopt.use_backend("torch"):
        out = ops.linear((x, x_tail), weight, mix=mix)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, x_tail), dy)
    m = mix[:, None, None]
    ref = torch.nn.functional.linear(m * x + (1 - m) * x_tail, weight)
    for got, want in zip(grads, torch.autograd.grad(ref, (x, x_tail), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_residual_gradient_alone_keeps_no_input():
    x = torch.randn(6, 24)  # frozen input, frozen layer: only the residual stream needs its gradient
    weight, bias = torch.randn(16, 24), torch.randn(16)
    residual = torch.randn(6, 16, requires_grad=True)
    saved = _saved_storages(lambda: ops.linear(x, weight, bias, activation="gelu", residual=residual))
    assert _ptr(x) not in saved
