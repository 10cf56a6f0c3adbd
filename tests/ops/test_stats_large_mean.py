"""GroupNorm statistics of fp32 inputs whose mean dwarfs their spread (|mean| / std = 1e5): the Triton statistics
kernels run Welford's update on values shifted by each channel's first value, and the conv epilogue takes each tile's
moments by the corrected two-pass formula. A mean rounded in fp32 is off by d, which would add n * d^2 to the sum of
squares and bias rstd low (2e-3 to 2e-2 relative here without the shift or the correction; 2.4e-3 for unshifted
per-element Welford accumulators).

Bounds: a few times what the kernels reach now; the fp32 storage of the mean (ulp(1e3) = 6e-5) limits them, as it
limits PyTorch's own fp32 GPU kernels."""

import torch
import torch.nn.functional as F

import ldmopt
from ldmopt import ops
from ldmopt.ops.gn_conv2d_stats import gn_conv2d_stats


def _exact_rstd(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    var = x.double().reshape(x.shape[0], groups, -1).var(-1, unbiased=False)
    return torch.rsqrt(var + eps)


def _relative(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return ((actual.double() - exact) / exact).abs().max().item()


def test_group_norm_statistics_of_a_large_mean():
    torch.manual_seed(0)
    x = 1e3 + 1e-2 * torch.randn(2, 64, 8, 8)
    with ldmopt.use_backend("triton"):
        _y, _mean, rstd = torch.ops.ldmopt.group_norm_fwd(x, None, None, 32, 1e-12, "")
        _stats_mean, stats_rstd = gn_conv2d_stats(x, 32, 1e-12)
    exact = _exact_rstd(x, 32, 1e-12)
    assert _relative(rstd, exact) < 1e-3
    assert _relative(stats_rstd, exact) < 1e-3


def test_fused_conv_output_statistics_of_a_large_mean():
    # A conv whose bias dwarfs its output's spread: the epilogue's per-tile statistics of the stored output.
    torch.manual_seed(0)
    x = torch.randn(1, 64, 16, 16).to(memory_format=torch.channels_last)
    weight = torch.randn(64, 64, 1, 1) * 1e-3 / 8
    bias = torch.full((64,), 1e3)
    with ldmopt.use_backend("triton"):
        y, (_mean, rstd) = ops.gn_silu_conv2d(x, None, None, 32, 1e-6, weight, bias, 1, 0, out_stats=(32, 1e-6))
    # 3e-3 while each tile's corrected mean was rounded to fp32 before the fp64 sums; 5e-5 with it added in fp64.
    assert _relative(rstd, _exact_rstd(y, 32, 1e-6)) < 5e-4
    torch.testing.assert_close(y, F.conv2d(F.silu(F.group_norm(x, 32, eps=1e-6)), weight, bias), rtol=0, atol=2e-4)
