"""torch.func transforms and forward-mode AD through the fused ops: each op then runs its reference composition of
PyTorch ops (custom ops take no forward-mode rule, and their autograd does not run under functorch's transforms),
so jvp (consistency-model and MeanFlow training), jacfwd, grad/vjp, vmap (per-sample gradients) and hessian give the
derivatives of the op itself.

References are independent of ldmopt's reference code: central finite differences in fp64, stock PyTorch functions,
and reverse-mode autograd through the custom op (its hand-written backward)."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from ldmopt import ops
from tests.ops.op_cases import op_cases

CASES = list(op_cases())
IDS = [c[0] for c in CASES]


def _directional_difference(fn, inputs, tangents, h=1e-6):
    """(fn(x + h t) - fn(x - h t)) / 2h in fp64: error O(h^2) plus rounding ~1e-16/h."""
    plus = fn([x + h * t for x, t in zip(inputs, tangents)])
    minus = fn([x - h * t for x, t in zip(inputs, tangents)])
    return (plus - minus) / (2 * h)


def _assert_relative(actual, expected, bound, what):
    err = (actual - expected).abs().max().item() / expected.abs().max().item()
    assert err <= bound, f"{what}: relative error {err:.2e} > {bound:.0e}"


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=IDS)
def test_jvp_and_dual_tensors_give_the_directional_derivative(name, fn, inputs):
    tangents = [torch.randn_like(t) for t in inputs]
    y, jvp = torch.func.jvp(lambda *a: fn(list(a)), tuple(inputs), tuple(tangents))
    torch.testing.assert_close(y, fn(inputs), rtol=1e-12, atol=1e-12)
    _assert_relative(jvp, _directional_difference(fn, inputs, tangents), 1e-7, f"{name}: jvp vs finite difference")
    with fwAD.dual_level():
        dual = fn([fwAD.make_dual(x, t) for x, t in zip(inputs, tangents)])
        tangent = fwAD.unpack_dual(dual).tangent
    assert tangent is not None, f"{name}: the tangent was dropped"
    torch.testing.assert_close(tangent, jvp, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=IDS)
def test_func_grad_matches_the_ops_own_backward(name, fn, inputs):
    def loss(*a):
        return fn(list(a)).pow(2).sum()

    grads = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    loss(*leaves).backward()  # the custom op's autograd: its hand-written backward
    for i, (a, leaf) in enumerate(zip(grads, leaves, strict=True)):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-10, atol=1e-12, msg=f"{name}: gradient of input {i}")


def test_per_sample_gradients_with_vmap_of_grad():
    # The classic torch.func recipe (vmap over grad): one weight gradient per sample, against a loop of backward calls.
    x = torch.randn(4, 5, 12, dtype=torch.float64)
    w, b = torch.randn(7, 12, dtype=torch.float64), torch.randn(7, dtype=torch.float64)

    def loss(weight, sample):
        return ops.linear(sample[None], weight, b, activation="gelu").square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
    for i in range(x.shape[0]):
        leaf = w.clone().requires_grad_()
        loss(leaf, x[i]).backward()
        torch.testing.assert_close(per_sample[i], leaf.grad, rtol=1e-10, atol=1e-12)


def test_hessian_matches_stock_group_norm():
    # Second order (double reverse inside torch.func) against PyTorch's own GroupNorm.
    x = torch.randn(1, 6, 2, 2, dtype=torch.float64)
    w, b = 1 + torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def energy(fn):
        return lambda t: fn(t).sin().sum()

    fused = torch.func.hessian(energy(lambda t: ops.group_norm(t, 3, w, b, activation="silu")))(x)
    stock = torch.func.hessian(energy(lambda t: F.silu(F.group_norm(t, 3, w, b))))(x)
    torch.testing.assert_close(fused, stock, rtol=1e-9, atol=1e-11)


def test_transforms_run_the_reference_composition_even_when_a_backend_is_forced():
    x, w = torch.randn(2, 8, 3, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    before = ops.backend_counts[("group_norm", "torch")]
    with ops.use_backend("torch"):
        torch.func.jvp(lambda t: ops.group_norm(t, 2, w), (x,), (torch.randn_like(x),))
    assert ops.backend_counts[("group_norm", "torch")] == before + 1


def test_a_dual_level_without_tangents_keeps_the_custom_op():
    x, w = torch.randn(2, 8, 3, 3), torch.randn(8)
    with fwAD.dual_level():
        y = ops.group_norm(x.requires_grad_(), 2, w)
    assert "group_norm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=IDS)
def test_double_backward_raises_a_clear_error_and_first_order_grads_stay_right(name, fn, inputs):
    # The backwards are hand-written from saved tensors: a second derivative through them would be wrong (a saved
    # forward output is a constant to them) or fail with PyTorch's "register_autograd" message.
    def grads(create_graph):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(leaves).pow(2).sum(), leaves, create_graph=create_graph)

    linked, plain = grads(True), grads(False)
    for a, b in zip(linked, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match=r"double backward.*torch\.func\.grad"):
        sum(g.sum() for g in linked).backward()


def test_gradient_penalty_through_torch_func_grad_matches_stock_double_backward():
    # The documented way to a second derivative (an R1-style penalty): the inner gradient by torch.func.grad, the
    # outer by .backward(), against PyTorch's own modules differentiated twice.
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    w, b = (torch.nn.Parameter(1 + torch.randn(8, dtype=torch.float64)) for _ in "wb")
    conv = torch.nn.Parameter(torch.randn(3, 8, 3, 3, dtype=torch.float64))

    def fused(t):
        return ops.gn_silu_conv2d(t, w, b, 4, 1e-5, conv, None, padding=1).square().sum()

    def stock(t):
        return F.conv2d(F.silu(F.group_norm(t, 4, w, b)), conv, padding=1).square().sum()

    penalty = torch.func.grad(fused)(x).square().sum()
    got = torch.autograd.grad(penalty, [w, b, conv])
    leaf = x.clone().requires_grad_()
    (inner,) = torch.autograd.grad(stock(leaf), leaf, create_graph=True)
    expected = torch.autograd.grad(inner.square().sum(), [w, b, conv])
    for name, g, e in zip(("gn weight", "gn bias", "conv weight"), got, expected, strict=True):
        _assert_relative(g, e, 1e-12, f"penalty gradient of the {name}")


def test_transforms_inside_torch_compile_run_the_reference_composition_or_say_why_not():
    # Traced, the custom op would take the tangent as zero without a word: the composition runs eagerly instead
    # (a graph break), and fullgraph=True names the reason.
    x, w = torch.randn(2, 8, 4, 4), torch.randn(8)
    tangent = torch.randn_like(x)

    def tangent_of(norm):
        return lambda t: torch.func.jvp(lambda a: norm(a), (t,), (tangent,))[1]

    expected = tangent_of(lambda a: F.silu(F.group_norm(a, 2, w)))(x)
    torch._dynamo.reset()
    got = torch.compile(tangent_of(lambda a: ops.group_norm(a, 2, w, activation="silu")))(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="reference composition eagerly"):
        torch.compile(tangent_of(lambda a: ops.group_norm(a, 2, w)), fullgraph=True)(x)


def test_double_backward_of_a_plain_linear_is_exact():
    # Without an activation or gate the backward is PyTorch ops on saved inputs: torch.autograd.functional.jvp (the
    # double-backward trick) and hvp stay exact, also for a two-part input.
    x, tail = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    w, b = torch.randn(7, 12, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    v = (torch.randn_like(x), torch.randn_like(tail))

    def fused(a, c):
        return ops.linear((a, c), w, b).sin()

    def stock(a, c):
        return F.linear(torch.cat([a, c], -1), w, b).sin()

    for transform in (torch.autograd.functional.jvp, torch.autograd.functional.hvp):
        target = (lambda f: lambda a, c: f(a, c).sum()) if transform is torch.autograd.functional.hvp else None
        got = transform(target(fused) if target else fused, (x, tail), v)[1]
        want = transform(target(stock) if target else stock, (x, tail), v)[1]
        for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=IDS)
def test_vmap_over_the_first_input_matches_a_loop(name, fn, inputs):
    batch = torch.stack([inputs[0], torch.randn_like(inputs[0])])
    mapped = torch.func.vmap(lambda first: fn([first, *inputs[1:]]))(batch)
    for i in range(2):
        torch.testing.assert_close(mapped[i], fn([batch[i], *inputs[1:]]), rtol=1e-12, atol=1e-12, msg=name)


def test_transforms_on_meta_tensors_infer_shapes():
    # Shape inference through torch.func on meta tensors: the reference composition ran with autocast switched off,
    # and torch.autocast raises for the meta device.
    x, w, b = (torch.empty(*shape, device="meta") for shape in ((3, 2, 8, 4, 4), (8,), (8,)))
    assert torch.func.vmap(lambda t: ops.group_norm(t, 4, w, b, 1e-5))(x).shape == x.shape
    rows, weight = torch.empty(3, 2, 32, 4, device="meta"), torch.empty(8, 4, device="meta")
    assert torch.func.vmap(lambda t: ops.geglu(t, weight))(rows).shape == (3, 2, 32, 4)
    _, tangent = torch.func.jvp(lambda t: ops.group_norm(t, 4), (x[0],), (torch.empty_like(x[0]),))
    assert tangent.shape == x[0].shape and tangent.device.type == "meta"
