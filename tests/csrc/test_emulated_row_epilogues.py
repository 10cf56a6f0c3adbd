"""ldmopt._C's row kernels of the "cublas" GEMM placement, run on CPU by the fiber emulator against fp64 references:
the LayerNorm applied from known statistics (layer_norm_apply_cuda) and the linear epilogue after the GEMM
(linear_epilogue_cuda: activation or GEGLU's product, gate, residual, clamp, the next LayerNorm's statistics)."""

import pytest
import torch
import torch.nn.functional as F

from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(37, 72), (5, 320), (3, 1152), (9, 8), (1, 1), (4, 257)]


def _pack(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


def _assert_one_rounding(actual, ref64, name):
    """Within the error of the fp64 result rounded once to actual's dtype (what the kernel's fp32 math then a single
    rounding gives), by tests/tolerances.py's rule."""
    assert_within_torch_error(actual, ref64, ref64.float().to(actual.dtype), name)


# ------------------------------------------------------------------------------------------------ LayerNorm apply


def _layer_norm_reference(x, stats, weight, bias, positions, position_rows):
    h = (x.double() - stats[0].double()[:, None]) * stats[1].double()[:, None]
    if weight is not None:
        h = h * weight.double()
    if bias is not None:
        h = h + bias.double()
    if positions is not None:
        rows = torch.arange(x.shape[0]) // position_rows % positions.shape[0]
        h = h + positions.double()[rows]
    return h


@pytest.mark.parametrize("m,c", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_apply(emu, m, c, dtype):
    """Rows far from zero mean with their own statistics, weight and bias in another dtype than x (fp32 parameters
    of a 16-bit model), a row stride wider than the row, and the packed path where the widths allow it."""
    wide = (torch.randn(m, c + 24, dtype=torch.float64) * 0.7 + 30.0 * torch.randn(m, 1, dtype=torch.float64)).to(dtype)
    x = wide[:, :c]
    var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
    stats = torch.stack([mean, torch.rsqrt(var + 1e-6)]).float()
    weight, bias = torch.randn(c) * 0.5 + 1.0, torch.randn(c, dtype=dtype)
    for x_in in (x, x.contiguous()):
        h = emu.layer_norm_apply(x_in, stats, weight, bias)
        _assert_one_rounding(h, _layer_norm_reference(x_in, stats, weight, bias, None, 1), f"h {m}x{c} {dtype}")
    packed = c % _pack(dtype) == 0
    assert emu.last_plan["vec"] == (_pack(dtype) if packed else 1)
    h = emu.layer_norm_apply(x.contiguous(), stats, None, None)
    _assert_one_rounding(h, _layer_norm_reference(x, stats, None, None, None, 1), "no affine")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_layer_norm_apply_with_positions(emu, dtype):
    """AnimateDiff's sinusoidal table added after the norm: row m reads table row (m // position_rows) % P, from a
    table slice with a row stride of its own; and the scalar path on a misaligned x."""
    m, c, p, rows_per = 3 * 2 * 5, 40, 7, 2  # (batch x pixels) sequences of 5 frames... rows grouped by 2
    x = torch.randn(m, c, dtype=torch.float64).to(dtype)
    stats = torch.stack([torch.randn(m), torch.rand(m) + 0.5]).float()
    table = torch.randn(p, c + 8, dtype=torch.float64).to(dtype)[:, :c]
    weight, bias = torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)
    ref = _layer_norm_reference(x, stats, weight, bias, table, rows_per)
    _assert_one_rounding(emu.layer_norm_apply(x, stats, weight, bias, table, rows_per), ref, "positions")
    assert emu.last_plan["vec"] == _pack(dtype)
    _assert_one_rounding(
        emu.layer_norm_apply(emulator.misaligned(x), stats, weight, bias, table, rows_per), ref, "scalar"
    )
    assert emu.last_plan["vec"] == 1


def test_layer_norm_apply_of_no_rows_launches_nothing(emu):
    h = emu.layer_norm_apply(torch.randn(0, 24), torch.empty(2, 0), None, None)
    assert h.shape == (0, 24)


# ------------------------------------------------------------------------------------------------ linear epilogue

ACTIVATIONS = {
    None: lambda t: t,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _epilogue_reference(z, activation, gate, residual, glu, saturate, dtype):
    zd = z.double()
    if glu:
        n = z.shape[1] // 2
        out = zd[:, :n] * F.gelu(zd[:, n:])
    else:
        out = ACTIVATIONS[activation](zd)
    if gate is not None:
        out = out * gate.double().repeat_interleave(z.shape[0] // gate.shape[0], dim=0)
    if residual is not None:
        out = out + residual.double().reshape(out.shape)
    if saturate:
        big = torch.finfo(dtype).max
        out = out.clamp(-big, big)
    return out


def _row_stats(y):
    var, mean = torch.var_mean(y.double(), dim=1, unbiased=False)
    return mean, torch.rsqrt(var + 1e-5)


def _operands(m, n, dtype, gate_rows, residual_3d, glu=False):
    z = (torch.randn(m, 2 * n if glu else n, dtype=torch.float64) * 2.0).to(dtype)
    gate = (torch.randn(gate_rows, 3 * n, dtype=torch.float64).to(dtype)[:, n : 2 * n]) if gate_rows else None
    residual = (torch.randn(m, n, dtype=torch.float64) * 3.0 + 5.0).to(dtype)
    if residual_3d:  # [B', T', N] with a sample stride wider than its rows (a slice of a longer token sequence)
        t = m // residual_3d
        residual = torch.cat([residual.reshape(residual_3d, t, n), torch.randn(residual_3d, 2, n, dtype=dtype)], 1)
        residual = residual[:, :t]
    return z, gate, residual


@pytest.mark.parametrize("m,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
def test_linear_epilogue_activation_gate_residual_stats(emu, m, n, dtype, activation):
    """residual + gate[m // T] * act(z), the output rows' LayerNorm statistics from the values as stored; the gate
    a column slice of a wider modulation (DiT's emb.chunk), one gate row per sample."""
    gate_rows = 1 if m == 1 else next(b for b in (3, 5, 9, 37, 1) if m % b == 0)
    z, gate, residual = _operands(m, n, dtype, gate_rows, residual_3d=0)
    y, stats = emu.linear_epilogue(z, activation, gate, residual, stats=True)
    ref = _epilogue_reference(z, activation, gate, residual, False, False, dtype)
    _assert_one_rounding(y, ref, f"y {activation} {m}x{n} {dtype}")
    mean, rstd = _row_stats(y)
    assert_close(stats[0], mean, torch.float32, "mean")
    assert_close(stats[1], rstd, torch.float32, "rstd")
    y, none = emu.linear_epilogue(z, activation)
    assert none is None
    _assert_one_rounding(y, _epilogue_reference(z, activation, None, None, False, False, dtype), "act alone")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_epilogue_geglu(emu, dtype):
    """GEGLU: the value half times GELU (erf) of the gate half, from a [M, 2N] GEMM output; packed and scalar."""
    z, _, _ = _operands(37, 72, dtype, 0, 0, glu=True)
    ref = _epilogue_reference(z, "gelu", None, None, True, False, dtype)
    y, _ = emu.linear_epilogue(z, "gelu", glu=True)
    _assert_one_rounding(y, ref, "geglu")
    assert y.shape == (37, 72) and emu.last_plan["vec"] == _pack(dtype)
    y, _ = emu.linear_epilogue(emulator.misaligned(z), "gelu", glu=True)
    _assert_one_rounding(y, ref, "geglu scalar")
    assert emu.last_plan["vec"] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_linear_epilogue_3d_residual_in_place_and_saturation(emu, dtype):
    """A [B', T', N] residual whose samples are further apart than their rows, written in place into z (as the cuBLAS
    GEMM's output is); Flux's clamp: huge values stop at the dtype's largest finite one, NaN stays NaN."""
    m, n = 12, 64
    z, gate, residual = _operands(m, n, dtype, 3, residual_3d=3)
    zc = z.clone()
    y, stats = emu.linear_epilogue(zc, "gelu_tanh", gate, residual, y=zc, stats=True)
    assert y.data_ptr() == zc.data_ptr()
    _assert_one_rounding(y, _epilogue_reference(z, "gelu_tanh", gate, residual, False, False, dtype), "in place")
    assert_close(stats[0], _row_stats(y)[0], torch.float32, "mean")
    big = torch.finfo(dtype).max
    z[0, 0], z[1, 1], z[2, 2] = big, -big, float("nan")
    residual[0, 0, 0], residual[0, 1, 1] = big / 2, -big / 2  # sums past the largest finite value
    ref = _epilogue_reference(z, None, None, residual, False, True, dtype)
    y, stats = emu.linear_epilogue(z, None, None, residual, saturate=True, stats=True)
    assert y[0, 0] == big and y[1, 1] == -big and y[2, 2].isnan()
    finite = torch.ones(m, dtype=torch.bool)
    finite[2] = False
    _assert_one_rounding(y[finite], ref[finite], "saturated")
    assert stats[:, 2].isnan().all() and not stats[:, finite].isnan().any()
    y, _ = emu.linear_epilogue(z, None, None, residual)
    assert y[0, 0].isinf(), "without saturate the sum overflows to inf, as the unclamped rounding does"


def test_linear_epilogue_statistics_only(emu):
    """write=False: only z's row statistics (a producer handing the next norm its statistics), z untouched."""
    z = torch.randn(9, 40, dtype=torch.float16) * 0.3 + 20.0
    before = z.clone()
    _, stats = emu.linear_epilogue(z, None, stats=True, write=False)
    assert torch.equal(z, before)
    mean, rstd = _row_stats(z)
    assert_close(stats[0], mean, torch.float32, "mean")
    assert_close(stats[1], rstd, torch.float32, "rstd")


def test_linear_epilogue_of_no_rows_launches_nothing(emu):
    y, stats = emu.linear_epilogue(torch.randn(0, 24), "gelu", stats=True)
    assert y.shape == (0, 24) and stats.shape == (2, 0)
