"""ldmopt.ops.adaln_modulate with ``gate``: the gated residual add ``s = residual + gate[b] * x`` (fp32, rounded to
the residual's dtype) before the norm, as Wan's blocks compute ``(h.float() + attn_output * gate).type_as(h)``."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.adaln_modulate import adaln_modulate
from tests.tolerances import assert_close, assert_within_torch_error

CASES = [
    # (x shape, per-sample modulation shape): C=72 and C=40 are not powers of two
    ((3, 13, 72), (3, 1, 72)),  # Wan 2.1: (B, 1, C) chunks of scale_shift_table + temb
    ((2, 9, 40), (2, 40)),
    ((37, 40), (37, 40)),  # Wan 2.2 TI2V: one vector per token, rows flattened
]


def _make(x_shape, s_shape, x_dtype, stream_dtype, mod_dtype=torch.float32):
    x = (torch.randn(x_shape, dtype=torch.float64) * 1.5 + 0.3).to(x_dtype)
    residual = (torch.randn(x_shape, dtype=torch.float64) + 0.5).to(stream_dtype)
    gate = (torch.randn(s_shape, dtype=torch.float64) * 0.8).to(mod_dtype)
    scale = (torch.randn(s_shape, dtype=torch.float64) * 0.5).to(mod_dtype)
    shift = torch.randn(s_shape, dtype=torch.float64).to(mod_dtype)
    return x, residual, gate, scale, shift


def _bcast(t, x):
    return t[:, None] if x.dim() == 3 and t.dim() == 2 else t


def _wan_reference(x, residual, gate, scale, shift, eps, compute=torch.float32):
    """What Wan's block does: the gated add in fp32 rounded to the stream dtype, then norm(s.float()) * (1 + scale)
    + shift rounded to the stream dtype (compute=float64 gives the exact result of the rounded sum)."""
    s = (residual.to(compute) + x.to(compute) * _bcast(gate, x).to(compute)).to(residual.dtype)
    normed = F.layer_norm(s.to(compute), s.shape[-1:], eps=eps)
    return normed * (1 + _bcast(scale, x).to(compute)) + _bcast(shift, x).to(compute), s


@pytest.mark.parametrize("x_shape,s_shape", CASES)
@pytest.mark.parametrize(
    "x_dtype,stream_dtype,mod_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float16, torch.float16, torch.float32),  # Wan: half stream, fp32 modulation and gate
        (torch.float16, torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gated_forward(x_shape, s_shape, x_dtype, stream_dtype, mod_dtype, backend):
    x, residual, gate, scale, shift = _make(x_shape, s_shape, x_dtype, stream_dtype, mod_dtype)
    with ldmopt.use_backend(backend):
        y, s = adaln_modulate(x, scale, shift, residual=residual, gate=gate, eps=1e-6, return_residual=True)
    assert y.dtype == s.dtype == stream_dtype and y.shape == x.shape
    exact, s_ref = _wan_reference(x, residual, gate, scale, shift, 1e-6, torch.float64)
    lowp, _ = _wan_reference(x, residual, gate, scale, shift, 1e-6)
    # The sum: one fp32 product and add rounded once to the stream dtype, as Wan's add; at most one ulp apart.
    assert_close(s, s_ref.double(), stream_dtype, f"gated sum {x_shape}")
    assert_within_torch_error(y, exact, lowp.to(stream_dtype), f"gated y {x_shape} {stream_dtype}")


@pytest.mark.parametrize("x_shape,s_shape", [*CASES[:2], ((5, 24), (5, 24))])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gated_backward_matches_autograd(x_shape, s_shape, backend):
    x, residual, gate, scale, shift = _make(x_shape, s_shape, torch.float32, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, residual, gate, scale, shift)]
    with ldmopt.use_backend(backend):
        y, s = adaln_modulate(leaves[0], leaves[3], leaves[4], residual=leaves[1], gate=leaves[2], return_residual=True)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    got = torch.autograd.grad((y * dy).sum() + (s * ds).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (x, residual, gate, scale, shift)]
    y_ref, s_ref = _wan_reference(*ref_leaves[:2], ref_leaves[2], ref_leaves[3], ref_leaves[4], 1e-6, torch.float64)
    expect = torch.autograd.grad((y_ref * dy.double()).sum() + (s_ref * ds.double()).sum(), ref_leaves)
    for name, g, e in zip(("dx", "dresidual", "dgate", "dscale", "dshift"), got, expect):
        assert g.dtype == torch.float32 and g.shape == e.shape, name
        assert_close(g, e, torch.float32, f"{backend} {name} {x_shape}")


def test_gated_half_stream_backward_dtypes():
    """fp16 stream and x with fp32 modulation: each gradient comes back in its input's dtype."""
    x, residual, gate, scale, shift = _make((2, 7, 40), (2, 1, 40), torch.float16, torch.float16)
    leaves = [t.clone().requires_grad_() for t in (x, residual, gate, scale, shift)]
    with ldmopt.use_backend("triton"):
        y = adaln_modulate(leaves[0], leaves[3], leaves[4], residual=leaves[1], gate=leaves[2])
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y.float() * dy.float()).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (x, residual, gate, scale, shift)]
    y_ref, _ = _wan_reference(*ref_leaves, 1e-6, torch.float64)
    expect = torch.autograd.grad((y_ref * dy.double()).sum(), ref_leaves)
    for name, g, e, leaf in zip(("dx", "dresidual", "dgate", "dscale", "dshift"), got, expect, leaves):
        assert g.dtype == leaf.dtype, name
        # fp16 gradients of a normalised row: compare to the fp64 chain within fp16 tolerance of the row's scale.
        torch.testing.assert_close(g.double(), e, atol=2e-2 * e.abs().max().item(), rtol=2e-2, msg=name)


def test_gradcheck_reference_path():
    x, residual, gate, scale, shift = _make((2, 3, 6), (2, 6), torch.float64, torch.float64, torch.float64)
    leaves = [t.requires_grad_() for t in (x, residual, gate, scale, shift)]

    def fn(x, residual, gate, scale, shift):
        return adaln_modulate(x, scale, shift, residual=residual, gate=gate, return_residual=True)

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, leaves)


def test_opcheck_with_gate():
    x, residual, gate, scale, shift = _make((10, 24), (2, 24), torch.float32, torch.float32)
    gate.requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_fwd, (x, scale, shift, residual, gate, 1e-6, True, True))
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_fwd, (x, scale, shift, residual, gate, 1e-6, False, False))
    _, s, mean, rstd = torch.ops.ldmopt.adaln_modulate_fwd(x, scale, shift, residual, gate.detach(), 1e-6, True, True)
    dy = torch.randn(10, 24)
    args = (dy, s, mean, rstd, scale, torch.randn(10, 24), x, gate.detach())
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_bwd, args)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_opcheck_with_a_stream_in_another_dtype(backend):
    # fp32 attention output, fp16 stream: without store_sum the placeholder sum is in the stream's dtype on every
    # backend, as the fake declares (the reference returned it in x's)
    x, residual, gate, scale, shift = _make((10, 24), (2, 24), torch.float32, torch.float16)
    with ldmopt.use_backend(backend):
        for store_sum in (False, True):
            args = (x, scale, shift, residual, gate, 1e-6, store_sum, False)
            torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_fwd, args)
            assert torch.ops.ldmopt.adaln_modulate_fwd(*args)[1].dtype == torch.float16


def test_compile_fullgraph_with_gate():
    torch._dynamo.reset()
    x, residual, gate, scale, shift = (
        t.requires_grad_() for t in _make((2, 5, 24), (2, 1, 24), torch.float32, torch.float32)
    )

    def fn(x, residual, gate):
        y, s = adaln_modulate(x, scale, shift, residual=residual, gate=gate, return_residual=True)
        return y * s

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, residual, gate)
    got = torch.autograd.grad(out.sum(), (x, residual, gate))
    expect_out = fn(x, residual, gate)
    expect = torch.autograd.grad(expect_out.sum(), (x, residual, gate))
    assert_close(out, expect_out.detach().double(), torch.float32, "compiled gated forward")
    for name, g, e in zip(("dx", "dresidual", "dgate"), got, expect):
        assert_close(g, e.double(), torch.float32, f"compiled {name}")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gate=torch.randn(2, 8)), "gate needs a residual"),
        (dict(gate=torch.randn(3, 8), residual=torch.randn(2, 4, 8)), r"gate must have shape \(2, 8\)"),
    ],
)
def test_bad_gate_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adaln_modulate(torch.randn(2, 4, 8), torch.randn(2, 8), torch.randn(2, 8), **kwargs)


def test_wide_fp32_gated_backward_is_refused_by_triton_with_a_reason():
    """fp32 rows past MAX_GATED_FP32_BWD_C would spill registers in the gated backward (the AOT gate compiles the
    widest accepted row): Triton refuses them and the reference backend runs, saying why."""
    from ldmopt.kernels.adaln_modulate import MAX_GATED_FP32_BWD_C

    from ldmopt.ops.adaln_modulate import _triton_refuse_bwd

    def reasons(c, dtype):
        s, dy = torch.randn(4, c, dtype=dtype), torch.randn(4, c, dtype=dtype)
        scale, gate = torch.randn(2, c, dtype=dtype), torch.randn(2, c, dtype=dtype)
        mean, rstd = torch.zeros(4), torch.ones(4)
        return _triton_refuse_bwd(dy, s, mean, rstd, scale, None, s, gate)

    assert reasons(MAX_GATED_FP32_BWD_C, torch.float32) == []
    assert reasons(MAX_GATED_FP32_BWD_C + 8, torch.float16) == []
    (reason,) = reasons(MAX_GATED_FP32_BWD_C + 8, torch.float32)
    assert f"C={MAX_GATED_FP32_BWD_C + 8}" in reason and "register budget" in reason


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_far_from_zero_and_a_gate_with_its_own_stride(gated, backend):
    # Rows offset by about 20 (an fp16 ulp of 1/64 there): the norm reads the sum as rounded to fp16, as stock's add
    # leaves it. scale and shift are chunks of one [B, 2C] embedding (row stride 2C), the gate a [B, C] tensor of its
    # own (row stride C): each is read with its own strides.
    b, t, c = 3, 5, 72
    x = (0.1 * torch.randn(b, t, c, dtype=torch.float64)).half()
    offsets = 20 * torch.randn(b, t, 1, dtype=torch.float64)
    residual = (0.8 * torch.randn(b, t, c, dtype=torch.float64) + offsets).half()
    emb = 0.5 * torch.randn(b, 2 * c)
    scale, shift = emb[:, :c], emb[:, c:]
    gate = 1.0 + 0.5 * torch.randn(b, c) if gated else None
    with ldmopt.use_backend(backend):
        y = adaln_modulate(x, scale, shift, residual=residual, gate=gate, eps=1e-6)
    as_gate = gate if gated else torch.ones(b, c)  # residual + 1 * x in fp32, rounded once: stock's fp16 add
    exact, _ = _wan_reference(x, residual, as_gate, scale, shift, 1e-6, torch.float64)
    lowp, _ = _wan_reference(x, residual, as_gate, scale, shift, 1e-6)
    assert_within_torch_error(y, exact, lowp.half(), f"rows far from zero, gated={gated}")
