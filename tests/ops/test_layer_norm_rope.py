"""ldmopt.ops.layer_norm_rope: the row kernel centring each row (a LayerNorm, affine), then the rotation, against
F.layer_norm and an explicit rotation in fp64, forward and backward (the bias is added before the rotation, so its
gradient is the turned-back one)."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops import layer_norm_rope
from tests.tolerances import assert_close, assert_compiled_matches_eager, assert_within_torch_error


def _rotate(y, cos, sin):
    """Flux/CogVideoX's "real" rotation of y [B, S, H, D] by tables [S, D]: y * cos + (-y[2i+1], y[2i]) * sin."""
    pairs = y.unflatten(-1, (-1, 2))
    partner = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    return y * cos[None, :, None].to(y.dtype) + partner * sin[None, :, None].to(y.dtype)


def _reference(x, weight, bias, tables=None, eps=1e-6):
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _rotate(y, *tables) if tables is not None else y


SHAPES = [(2, 7, 3, 24), (1, 5, 2, 40), (3, 13, 1, 72)]  # [B, S, H, D]: odd S, D not a power of two


def _inputs(shape, dtype):
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.7).to(dtype)  # off zero mean: the centring matters
    d = shape[-1]
    weight = (1 + 0.5 * torch.randn(d, dtype=torch.float64)).to(dtype)
    bias = (0.4 * torch.randn(d, dtype=torch.float64)).to(dtype)
    theta = torch.randn(shape[1], d // 2, dtype=torch.float64) * 3
    tables = tuple(t.repeat_interleave(2, -1).float() for t in (theta.cos(), theta.sin()))
    return x, weight, bias, tables


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward(shape, dtype, rope, backend):
    x, weight, bias, tables = _inputs(shape, dtype)
    kw = dict(rope=tables, rope_layout="elements", rope_dim=-3) if rope else {}
    with ldmopt.use_backend(backend):
        y = layer_norm_rope(x, weight, bias, eps=1e-6, **kw)
    assert y.dtype == dtype and y.shape == x.shape
    exact = _reference(*(t.double() for t in (x, weight, bias)), tuple(t.double() for t in tables) if rope else None)
    normed = F.layer_norm(x.float(), (shape[-1],), weight.float(), bias.float(), 1e-6).to(dtype)  # as diffusers
    lowp = _rotate(normed.float(), *tables).to(dtype) if rope else normed
    assert_within_torch_error(y, exact, lowp, f"layer_norm_rope {shape} {dtype} rope={rope}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_matches_autograd(shape, rope, backend):
    x, weight, bias, tables = _inputs(shape, torch.float32)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    kw = dict(rope=tables, rope_layout="elements", rope_dim=-3) if rope else {}
    with ldmopt.use_backend(backend):
        y = layer_norm_rope(*leaves, eps=1e-6, **kw)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y * dy).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _reference(*ref_leaves, tuple(t.double() for t in tables) if rope else None)
    expect = torch.autograd.grad((ref * dy.double()).sum(), ref_leaves)
    for name, g, e in zip(("dx", "dweight", "dbias"), got, expect):
        assert_close(g, e, torch.float32, f"{backend} {name} {shape} rope={rope}")


def test_gradcheck_reference_path_and_opcheck():
    x = torch.randn(2, 3, 2, 8, dtype=torch.float64) + 0.5
    weight, bias = torch.randn(8, dtype=torch.float64) + 1, torch.randn(8, dtype=torch.float64)
    cos, sin = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    with ldmopt.use_backend("torch"):
        fn = lambda *t: layer_norm_rope(*t, rope=(cos, sin), rope_layout="elements", rope_dim=-3)
        assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (x, weight, bias)])
    x2, w, b = torch.randn(12, 8) + 0.5, torch.randn(8), torch.randn(8)
    c32, s32 = cos.float(), sin.float()
    args = (x2, w, b, 1e-6, torch.float32, True, c32, s32, 2, False, True)  # rows of 2 heads; center
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_fwd, args)
    _, stats = torch.ops.ldmopt.rms_norm_fwd(*args)
    assert stats.shape == (2, 12)
    torch.library.opcheck(
        torch.ops.ldmopt.rms_norm_bwd, (torch.randn(12, 8), x2, stats, w, c32, s32, 2, False, True, True)
    )


def test_compiles_fullgraph():
    x, weight, bias, tables = _inputs((2, 5, 3, 16), torch.float32)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    kw = dict(rope=tables, rope_layout="elements", rope_dim=-3)
    assert_compiled_matches_eager(lambda a, w, b: layer_norm_rope(a, w, b, eps=1e-6, **kw) * 2, leaves)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: layer_norm_rope(torch.randn(4, 8), torch.randn(6)), r"weight must have shape \(8,\)"),
        (lambda: layer_norm_rope(torch.randn(4, 8), None, torch.randn(6)), r"bias must have shape \(8,\)"),
        (lambda: layer_norm_rope(torch.randn(4, 8), eps=-1.0), "eps must be a finite non-negative float"),
        (lambda: layer_norm_rope(torch.randn(2, 5, 8), rope=(torch.ones(5, 8), torch.ones(5, 8))), "rope_layout"),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_partial_affine_forward_and_backward(affine):
    """No weight and/or no bias (CogView3-Plus's norms have neither): the kernel's other constexpr variants."""
    x, weight, bias, tables = _inputs((2, 5, 3, 24), torch.float32)
    weight = weight if affine == "weight" else None
    bias = bias if affine == "bias" else None
    leaves = [t.requires_grad_() for t in (x, weight, bias) if t is not None]
    with ldmopt.use_backend("triton"):
        y = layer_norm_rope(x, weight, bias, eps=1e-6, rope=tables, rope_layout="elements", rope_dim=-3)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y * dy).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    args = iter(ref_leaves)
    ref_x = next(args)
    ref_w = next(args) if weight is not None else None
    ref_b = next(args) if bias is not None else None
    ref = _reference(ref_x, ref_w, ref_b, tuple(t.double() for t in tables))
    assert_close(y, ref, torch.float32, f"{affine} forward")
    expect = torch.autograd.grad((ref * dy.double()).sum(), ref_leaves)
    for g, e in zip(got, expect):
        assert_close(g, e, torch.float32, f"{affine} grads")
