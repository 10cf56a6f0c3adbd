"""Normalisation statistics at their edges, against stock PyTorch: constant rows and groups (variance exactly 0) and
a NaN inside a row or group.

A constant fp32 row's mean computed as sum / count rounds away from its value (1000.1 * 320 / 320 misses it by
6e-5), and a two-pass variance then reads that rounding as spread: with eps 1e-12 the normalised output was +-1 where
F.layer_norm gives 0 (0.06 at eps 1e-6). The kernels correct the first mean by its residual (kernels/_common.py
``row_moments``; the GroupNorm finalize likewise). A NaN must leave rstd NaN, as stock's does: ``tl.maximum(var, 0)``
returned 0 for a NaN variance, so rstd was 1 / sqrt(eps)."""

import pytest
import torch
import torch.nn.functional as F
from ldmopt.kernels.group_norm import group_norm_stats

import ldmopt
from ldmopt import ops
from ldmopt.ops.group_norm_sums import group_norm_stats_from_sums

# Values whose fp32 sums are inexact over these counts (the rounding the kernels must not read as variance).
VALUES = (1000.1, 0.1, -37.3)
EPSES = (1e-12, 1e-6)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("eps", EPSES)
@pytest.mark.parametrize("width", (24, 77, 320))
def test_layer_norm_of_constant_rows_is_zero(value, eps, width):
    x = torch.full((3, width), value)
    zero = torch.zeros(3, width)
    eye = torch.eye(width)
    with ldmopt.use_backend("triton"):
        outputs = {
            "adaln_modulate": ops.adaln_modulate(x, zero, zero, eps=eps),
            "adaln_modulate(residual)": ops.adaln_modulate(x - 1.0, zero, zero, residual=torch.ones(3, width), eps=eps),
            "layer_norm_rope": ops.layer_norm_rope(x, None, None, eps),
            "layer_norm_linear": ops.layer_norm_linear(x, None, None, eye, None, eps=eps),
        }
        stats = ops.layer_norm_stats(x, eps)
    assert F.layer_norm(x, (width,), eps=eps).abs().max() == 0  # what stock gives
    for name, y in outputs.items():
        assert y.abs().max().item() < 1e-6, f"{name}: max |y| = {y.abs().max().item():.3g} for a constant row"
    torch.testing.assert_close(stats[0], x[:, 0], rtol=0, atol=0)  # the mean is the row's value
    # and the variance exactly 0: rstd is 1/sqrt(eps) (the outputs above are 0 whatever rstd is; gradients are not)
    torch.testing.assert_close(stats[1], torch.full((3,), eps**-0.5), rtol=1e-6, atol=0)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("eps", EPSES)
@pytest.mark.parametrize("shape, groups", [((1, 8, 3, 3), 2), ((2, 12, 5, 7), 4), ((1, 6, 16, 16), 2)])
def test_group_norm_of_constant_groups_is_zero(value, eps, shape, groups):
    x = _channels_last(torch.full(shape, value))
    c = shape[1]
    identity = _channels_last(torch.eye(c).reshape(c, c, 1, 1))
    with ldmopt.use_backend("triton"):
        outputs = {
            "group_norm": ops.group_norm(x, groups, None, None, eps),
            "group_norm(contiguous)": ops.group_norm(x.contiguous(), groups, None, None, eps),
            "gn_silu_conv2d": ops.gn_silu_conv2d(x, None, None, groups, eps, identity, None, 1, 0, activation=None),
        }
        mean, rstd = group_norm_stats(x, groups, eps)
    assert F.group_norm(x.contiguous(), groups, eps=eps).abs().max() == 0
    for name, y in outputs.items():
        assert y.abs().max().item() < 1e-6, f"{name}: max |y| = {y.abs().max().item():.3g} for constant groups"
    torch.testing.assert_close(mean, torch.full_like(mean, value), rtol=0, atol=0)
    torch.testing.assert_close(rstd, torch.full_like(rstd, eps**-0.5), rtol=1e-6, atol=0)


def test_group_norm_of_constant_groups_with_affine_matches_stock():
    # With an affine the output is the bias: within stock's own error of it (stock's scale/shift rounding).
    torch.manual_seed(0)
    x = _channels_last(torch.full((1, 8, 3, 3), 1000.1))
    weight, bias = 1 + 0.1 * torch.randn(8), 0.1 * torch.randn(8)
    identity = _channels_last(torch.eye(8).reshape(8, 8, 1, 1))
    exact = bias.double().reshape(1, 8, 1, 1).expand(x.shape)
    stock_error = (F.group_norm(x.contiguous(), 2, weight, bias, 1e-6).double() - exact).abs().max().item()
    with ldmopt.use_backend("triton"):
        y = ops.gn_silu_conv2d(x, weight, bias, 2, 1e-6, identity, None, 1, 0, activation=None)
    assert (y.double() - exact).abs().max().item() <= 2 * stock_error + 1e-6


def test_nan_keeps_rstd_nan():
    # Stock: a group or row holding a NaN has a NaN variance, so a NaN rstd; the other groups and rows are unaffected.
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 3)
    x[0, 1, 1, 1] = float("nan")
    _, _, stock_rstd = torch.native_group_norm(x, None, None, 2, 8, 9, 4, 1e-5)
    _, rstd = group_norm_stats(x, 4, 1e-5)
    torch.testing.assert_close(rstd, stock_rstd.reshape(rstd.shape), equal_nan=True)
    assert rstd[0, 0].isnan() and not rstd[1].isnan().any()

    sums = torch.randn(2, 8, 2, dtype=torch.float64).abs()
    sums[1, 5, 1] = float("nan")
    with ldmopt.use_backend("triton"):
        _, sums_rstd = group_norm_stats_from_sums(sums, 4, 1e-5, 9)
    assert sums_rstd[1, 2].isnan() and not sums_rstd[0].isnan().any()

    image = _channels_last(torch.randn(2, 8, 3, 3))
    image[0, 1, 1, 1] = float("nan")  # through the 1x1 conv: every output channel of that pixel, image 0 only
    with ldmopt.use_backend("triton"):
        _, (_, conv_rstd) = ops.gn_silu_conv2d(
            image, None, None, 4, 1e-5, _channels_last(torch.randn(8, 8, 1, 1)), None, 1, 0, out_stats=(4, 1e-5)
        )
    assert conv_rstd[0].isnan().all() and not conv_rstd[1].isnan().any()

    rows = torch.randn(3, 8)
    rows[1, 2] = float("nan")
    with ldmopt.use_backend("triton"):
        _, row_stats = ops.linear(rows, torch.randn(6, 8), None, next_norm_eps=1e-5)
    assert row_stats[1, 1].isnan() and not row_stats[1, [0, 2]].isnan().any()
