"""ldmopt._C's adaLN modulation forward (adaln_modulate_cuda), run on CPU by the fiber emulator against fp64
references: the residual sum (plain or gated) rounded as stored, LayerNorm without affine over it, the per-sample
modulation, the stored sum and the row statistics."""

import pytest
import torch
import torch.nn.functional as F

from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (rows M, channels C, samples B): DiT / PixArt widths, Flux's, odd widths, one sample, one row per sample
SHAPES = [(37, 72, 1), (8, 40, 2), (12, 1152, 3), (6, 8, 6), (5, 257, 5), (4, 3072, 2)]
MODES = ["plain", "residual", "gated"]


def _pack(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


def _modulation(b, c, dtype, param_dtype):
    """scale and shift as column chunks of one [B, 6C] modulation (DiT's emb.chunk(6, dim=1)), in param_dtype."""
    emb = (torch.randn(b, 6 * c, dtype=torch.float64) * 0.3).to(param_dtype)
    return emb[:, c : 2 * c], emb[:, 4 * c : 5 * c], emb[:, 5 * c :]


def _rows(m, c, dtype, wide):
    """[M, C] rows far from zero mean; ``wide``: a column slice of wider rows (a row stride of C + 24)."""
    full = torch.randn(m, c + 24, dtype=torch.float64) * 0.8 + 20.0 * torch.randn(m, 1, dtype=torch.float64)
    return full.to(dtype)[:, :c] if wide else full[:, :c].to(dtype).contiguous()


def _reference(x, scale, shift, residual, gate, eps):
    """(s as stored in x's dtype, y in fp64 from it, mean, rstd of s)."""
    tokens = x.shape[0] // scale.shape[0]

    def per_row(t):
        return t.double().repeat_interleave(tokens, dim=0)

    if residual is None:
        s = x
    elif gate is None:
        s = (x.double() + residual.double()).to(x.dtype)
    else:
        s = (residual.double() + per_row(gate) * x.double()).to(x.dtype)
    var, mean = torch.var_mean(s.double(), dim=1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    y = (s.double() - mean[:, None]) * rstd[:, None] * (1.0 + per_row(scale)) + per_row(shift)
    return s, y, mean, rstd


def _unfused(s, scale, shift, eps):
    """diffusers' ``norm(s) * (1 + scale[:, None]) + shift[:, None]`` in s's dtype: the error PyTorch makes itself."""
    tokens = s.shape[0] // scale.shape[0]
    scale, shift = (t.to(s.dtype).repeat_interleave(tokens, dim=0) for t in (scale, shift))
    return F.layer_norm(s, (s.shape[1],), eps=eps) * (1 + scale) + shift


@pytest.mark.parametrize("m,c,b", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_adaln_modulate(emu, m, c, b, dtype, mode):
    """y = layer_norm(s) * (1 + scale[b]) + shift[b] with s = x, x + residual or residual + gate[b] * x; fp32
    modulation parameters for 16-bit rows (a model's fp32 time embedding), rows sliced from wider ones, the sum and
    the statistics stored when asked."""
    eps = 1e-6
    x = _rows(m, c, dtype, wide=True)
    residual = None if mode == "plain" else _rows(m, c, dtype, wide=False)
    scale, shift, gate = _modulation(b, c, dtype, torch.float32)
    gate = gate if mode == "gated" else None
    stored = residual is not None
    y, s, mean, rstd = emu.adaln_modulate(x, scale, shift, residual, gate, eps, store_sum=stored, save=True)
    s_ref, y_ref, mean_ref, rstd_ref = _reference(x, scale, shift, residual, gate, eps)
    if stored:
        # the sum within one rounding of the exact one (the gated product-sum is one fused multiply-add, as Triton's)
        assert_within_torch_error(s, s_ref.double(), s_ref, f"s {mode} {m}x{c} {dtype}")
        # the rest from the sum as the kernel stored it: an ulp of s more or less is not the normalisation's error
        _, y_ref, mean_ref, rstd_ref = _reference(s, scale, shift, None, None, eps)
        s_ref = s
    assert_within_torch_error(y, y_ref, _unfused(s_ref, scale, shift, eps), f"y {mode} {m}x{c} {dtype}")
    assert_close(mean, mean_ref, torch.float32, "mean")
    assert_close(rstd, rstd_ref, torch.float32, "rstd")
    packed = c % _pack(dtype) == 0  # the rows' strides (C + 24, C) are multiples of the pack exactly when C is
    assert emu.last_plan["vec"] == (_pack(dtype) if packed else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_modulate_parameters_in_the_rows_dtype_and_nothing_saved(emu, dtype):
    """scale, shift and gate in x's own dtype, one row per sample (PixArt's per-row table read as [M, C]), neither the
    sum nor the statistics asked for."""
    m, c = 9, 64
    x, residual = _rows(m, c, dtype, wide=False), _rows(m, c, dtype, wide=False)
    scale, shift, gate = _modulation(m, c, dtype, dtype)
    y, s, mean, rstd = emu.adaln_modulate(x, scale, shift, residual, gate, 1e-5)
    assert s.numel() == mean.numel() == rstd.numel() == 0
    s_ref, y_ref, _, _ = _reference(x, scale, shift, residual, gate, 1e-5)
    assert_within_torch_error(y, y_ref, _unfused(s_ref, scale, shift, 1e-5), f"y {dtype}")


def test_adaln_modulate_unaligned_rows_take_the_scalar_path(emu):
    x = emulator.misaligned(_rows(6, 64, torch.float16, wide=False))
    scale, shift, _ = _modulation(2, 64, torch.float16, torch.float32)
    y, _, _, _ = emu.adaln_modulate(x, scale, shift)
    assert emu.last_plan["vec"] == 1
    _, y_ref, _, _ = _reference(x, scale, shift, None, None, 1e-6)
    assert_within_torch_error(y, y_ref, _unfused(x, scale, shift, 1e-6), "unaligned y")


@pytest.mark.parametrize("c", [24, 77, 320])
@pytest.mark.parametrize("value", [1000.1, 0.1])
def test_adaln_modulate_of_constant_rows_is_exact(emu, c, value):
    # Welford's running mean stays a constant row's value exactly: variance 0, an output of shift alone, as stock
    # (the Triton kernels' two-pass mean needed a residual correction for this: tests/ops/test_degenerate_statistics).
    x = torch.full((3, c), value)
    scale, shift = torch.randn(1, c), torch.randn(1, c)
    y, _, mean, _ = emu.adaln_modulate(x, scale, shift, eps=1e-12, save=True)
    torch.testing.assert_close(mean, torch.full_like(mean, value), rtol=0, atol=0)
    torch.testing.assert_close(y, shift.expand(3, c), rtol=0, atol=0)


def test_adaln_modulate_keeps_nan(emu):
    """A NaN in a row makes its statistics and its outputs NaN (no clamp turns it into a finite value)."""
    x = _rows(4, 16, torch.float32, wide=False)
    x[1, 3] = float("nan")
    scale, shift, _ = _modulation(2, 16, torch.float32, torch.float32)
    y, _, mean, rstd = emu.adaln_modulate(x, scale, shift, save=True)
    assert torch.isnan(y[1]).all() and torch.isnan(mean[1]) and torch.isnan(rstd[1])
    assert not torch.isnan(y[[0, 2, 3]]).any()


@pytest.mark.parametrize("c", [72, 1152])
@pytest.mark.parametrize("magnitude", [2e19, 1e30])
def test_adaln_modulate_of_huge_rows_stays_finite(emu, c, magnitude):
    """Rows of |x| ~ 1e19-1e30 in fp32 (their squares overflow): lanes that hold no element of a narrow row (C under
    32 packs) must take the others' statistics as they are, not merge them into NaN; y is shift, as the other
    backends give, and every lane normalises with the one saved pair."""
    x = (torch.randn(4, c, dtype=torch.float64) * magnitude).float()
    scale, shift, _ = _modulation(2, c, torch.float32, torch.float32)
    y, _, mean, rstd = emu.adaln_modulate(x, scale, shift, save=True)
    assert torch.isfinite(y).all() and torch.isfinite(mean).all(), y
    expect = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    expect = expect * (1 + scale.double().repeat_interleave(2, 0)) + shift.double().repeat_interleave(2, 0)
    assert_close(y, expect, torch.float32, "y from the saved statistics")


def test_gate_with_its_own_row_stride(emu):
    """scale and shift as column chunks of one [B, 6C] modulation (row stride 6C) and the gate a [B, C] tensor of its
    own (row stride C), as a gate computed apart from the embedding: each read with its own row stride."""
    m, c, b, eps = 12, 40, 3, 1e-6
    x, residual = _rows(m, c, torch.float32, wide=False), _rows(m, c, torch.float32, wide=False)
    scale, shift, _ = _modulation(b, c, torch.float32, torch.float32)
    gate = torch.randn(b, c, dtype=torch.float64).float()
    y, *_ = emu.adaln_modulate(x, scale, shift, residual, gate, eps)
    s_ref, y_ref, _, _ = _reference(x, scale, shift, residual, gate, eps)
    assert_within_torch_error(y, y_ref, _unfused(s_ref, scale, shift, eps), "gate with its own row stride")
