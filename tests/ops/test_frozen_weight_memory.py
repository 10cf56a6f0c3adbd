"""A frozen layer whose input needs a gradient (adapter or ControlNet training through a frozen base model) saves no
copy of its [M, K] input for backward, as F.linear does not; gradients stay exact in every combination."""

import pytest
import torch
import torch.nn.functional as F

from ldmopt import ops


def _saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _stock_linear(x, w, b, tail, activation, gate, residual):
    z = F.linear(x if tail is None else torch.cat([x, tail], -1), w, b)
    z = {None: z, "gelu": F.gelu(z) if activation else z}[activation]
    if gate is not None:
        z = z * gate[:, None, :]
    return z if residual is None else z + residual


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_linear_with_a_frozen_weight_saves_no_input(activation, tail, gated):
    g = torch.Generator().manual_seed(3)

    def r(*s, grad=False):
        return torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(grad)

    k = 6 if tail else 12
    x, w, b = r(2, 5, k, grad=True), r(7, 12), r(7)
    x_tail = r(2, 5, 6, grad=True) if tail else None
    gate, residual = (r(2, 7), r(2, 5, 7, grad=True)) if gated else (None, None)
    parts = x if x_tail is None else (x, x_tail)
    y, shapes = _saved_shapes(lambda: ops.linear(parts, w, b, activation=activation, gate=gate, residual=residual))
    assert (10, k) not in shapes and (10, 6) not in shapes, f"the input was saved: {shapes}"
    expected = _stock_linear(x, w, b, x_tail, activation, gate, residual)
    dy = torch.randn_like(y)
    leaves = [t for t in (x, x_tail, residual) if t is not None]
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(expected, leaves, dy)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_only_the_residual_needs_a_gradient():
    x, w = torch.randn(10, 12), torch.randn(7, 12)
    residual = torch.randn(10, 7, requires_grad=True)
    y = ops.linear(x, w, activation="gelu", residual=residual)
    (dres,) = torch.autograd.grad(y, residual, torch.ones_like(y))
    torch.testing.assert_close(dres, torch.ones_like(residual), rtol=0, atol=0)


def test_geglu_with_a_frozen_weight_saves_no_input():
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(14, 12, dtype=torch.float64), torch.randn(14, dtype=torch.float64)
    y, shapes = _saved_shapes(lambda: ops.geglu(x, w, b))
    assert (10, 12) not in shapes, f"the input was saved: {shapes}"
    h, gate = F.linear(x, w, b).chunk(2, -1)
    dy = torch.randn_like(y)
    torch.testing.assert_close(
        torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(h * F.gelu(gate), x, dy)[0], rtol=1e-12, atol=1e-12
    )
