"""Per-channel sums from the conv's epilogue (``gn_silu_conv2d(out_channel_sums=True)``) and the GroupNorm statistics
finalised from them (``ldmopt::group_norm_stats_from_sums``), for one tensor or the concatenation of two.

The sums must be those of the stored output for any tiling (rows in several tiles, the last partial; channels in
several column tiles; several images), alone or beside the per-group statistics; the statistics from them must be
those of the concatenation, with groups straddling the two parts.
"""

import pytest
import torch

import ldmopt
from ldmopt.ops.gn_conv2d import channel_sums_torch, gn_silu_conv2d
from ldmopt.ops.group_norm_sums import group_norm_stats_from_sums
from tests.tolerances import assert_close

BACKENDS = ["triton", "torch"]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _expected_stats(t: torch.Tensor, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 per-(n, group) mean and rstd of t as stored: the independent reference."""
    var, mean = torch.var_mean(t.double().reshape(t.shape[0], groups, -1), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _expected_sums(y: torch.Tensor) -> torch.Tensor:
    values = y.double().flatten(2)
    return torch.stack([values.sum(2), values.square().sum(2)], dim=2)


def _conv_inputs(n, c, h, w, c_out, k, dtype):
    x = _cl(torch.randn(n, c, h, w, dtype=torch.float64) * 1.1 + 0.3).to(dtype)
    gw = (torch.randn(c, dtype=torch.float64) * 0.5 + 1.0).to(dtype)
    gb = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype)
    wt = _cl(torch.randn(c_out, c, k, k, dtype=torch.float64) / (c * k * k) ** 0.5).to(dtype)
    b = (torch.randn(c_out, dtype=torch.float64) * 0.3 + 0.7).to(dtype)  # a mean away from zero
    return x, gw, gb, wt, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_stats", [False, True], ids=["sums alone", "beside out_stats"])
def test_conv_epilogue_sums_are_those_of_the_stored_output(dtype, backend, with_stats):
    # 99 pixels: two row tiles of the interpreter's 64, the second partial; 200 channels: two column tiles; 3 images
    n, c, h, w, c_out = 3, 40, 9, 11, 200
    x, gw, gb, wt, b = _conv_inputs(n, c, h, w, c_out, 1, dtype)
    out_stats = (8, 1e-6) if with_stats else None
    with ldmopt.use_backend(backend):
        out = gn_silu_conv2d(x, gw, gb, 5, 1e-5, wt, b, 1, 0, out_stats=out_stats, out_channel_sums=True)
        plain = gn_silu_conv2d(x, gw, gb, 5, 1e-5, wt, b, 1, 0)
    y, sums = out[0], out[-1]
    assert sums.shape == (n, c_out, 2) and sums.dtype == torch.float64
    torch.testing.assert_close(y, plain, rtol=0, atol=0)  # the epilogue only adds the sums
    # Each tile sums its columns in fp32 (centred, with the rounding of its mean corrected), the tiles add in fp64:
    # fp32-level error relative to the channel's sum of squares, which bounds |sum| too (Cauchy-Schwarz, per row)
    expected = _expected_sums(y)
    scale = expected[..., 1:].expand_as(expected) * (y.shape[2] * y.shape[3]) ** 0.5
    assert ((sums - expected).abs() <= 1e-6 * scale).all(), (sums - expected).abs().max()
    if with_stats:
        mean, rstd = out[1]
        expected = _expected_stats(y, 8, 1e-6)
        assert_close(mean, expected[0], torch.float32, f"{backend} mean")
        assert_close(rstd, expected[1], torch.float32, f"{backend} rstd")


def test_deterministic_algorithms_sum_the_channels_in_a_pass_after_the_conv():
    x, gw, gb, wt, b = _conv_inputs(2, 24, 7, 5, 72, 3, torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        with ldmopt.use_backend("triton"):
            y, sums = gn_silu_conv2d(x, gw, gb, 4, 1e-5, wt, b, 1, 1, out_channel_sums=True)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(sums, _expected_sums(y), rtol=1e-12, atol=1e-12)  # fp64 sums in another order


def test_channel_sums_and_layer_norm_row_statistics_exclude_each_other():
    x, gw, gb, wt, b = _conv_inputs(2, 24, 7, 5, 72, 1, torch.float16)
    with pytest.raises(ValueError, match="out_channel_sums and next_norm_eps"):
        gn_silu_conv2d(x, gw, gb, 4, 1e-5, wt, b, 1, 0, next_norm_eps=1e-6, out_channel_sums=True)
    args = (x, None, None, None, None, wt, b, None, None, None, None, None, None, 0, "", 1, [0, 0], "none", "none",
            "none", 1.0, 0, 1e-6, None, None, "conv", True, True)  # fmt: skip
    with pytest.raises(ValueError, match="out_layer_norm with out_channel_sums"):
        torch.ops.ldmopt.gn_conv2d(*args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "parts",
    [
        # (C_head, C_tail, groups): groups of 4 straddle the parts at channel 10; groups of 6 at 15; one part
        (10, 14, 6),
        (15, 9, 4),
        (24, 0, 8),
        (7, 0, 1),
    ],
    ids=["straddling 4", "straddling 6", "one part", "one group"],
)
def test_statistics_from_sums_are_those_of_the_concatenation(backend, parts):
    c_head, c_tail, groups = parts
    head = torch.randn(3, c_head, 5, 7) * 2.0 + 0.5
    tail = torch.randn(3, c_tail, 5, 7) * 0.7 - 1.5 if c_tail else None
    both = head if tail is None else torch.cat([head, tail], 1)
    tail_sums = None if tail is None else channel_sums_torch(tail)
    with ldmopt.use_backend(backend):
        mean, rstd = group_norm_stats_from_sums(channel_sums_torch(head), groups, 1e-5, 35, tail_sums)
    expected = _expected_stats(both, groups, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (3, groups)
    assert_close(mean, expected[0], torch.float32, f"{backend} mean")
    assert_close(rstd, expected[1], torch.float32, f"{backend} rstd")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("two_part", [False, True], ids=["one part", "two parts"])
def test_statistics_of_videos_add_their_frames_sums(backend, two_part):
    # 2 videos of 3 frames; each group spans (C/G, F, H, W) of its video, as a 5-D GroupNorm's does
    frames, head = 3, torch.randn(6, 10, 4, 5) * 1.3 + 0.2
    tail = torch.randn(6, 14, 4, 5) - 0.8 if two_part else None
    both = head if tail is None else torch.cat([head, tail], 1)
    tail_sums = None if tail is None else channel_sums_torch(tail)
    with ldmopt.use_backend(backend):
        mean, rstd = group_norm_stats_from_sums(channel_sums_torch(head), 2, 1e-5, 20, tail_sums, frames)
    videos = both.reshape(2, frames, *both.shape[1:]).transpose(1, 2)  # (B, C, F, H, W)
    expected = _expected_stats(videos, 2, 1e-5)
    assert mean.shape == (2, 2)
    assert_close(mean, expected[0], torch.float32, f"{backend} mean")
    assert_close(rstd, expected[1], torch.float32, f"{backend} rstd")


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_from_sums_of_values_far_from_zero(backend):
    # |mean| / std = 1000: E[x^2] - mean^2 in fp64 keeps about 10 digits of the variance
    head = torch.randn(2, 12, 6, 6, dtype=torch.float64) + 1000.0
    tail = torch.randn(2, 4, 6, 6, dtype=torch.float64) * 3.0 + 1000.0
    with ldmopt.use_backend(backend):
        mean, rstd = group_norm_stats_from_sums(channel_sums_torch(head), 4, 1e-6, 36, channel_sums_torch(tail))
    expected = _expected_stats(torch.cat([head, tail], 1), 4, 1e-6)
    torch.testing.assert_close(mean.double(), expected[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd.double(), expected[1], rtol=1e-5, atol=0)


def _sums(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).abs()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((_sums(2, 8, 2), 3, 1e-5, 4), "num_groups=3 must be a positive divisor of the 8 channels"),
        ((_sums(2, 8, 2, dtype=torch.float32), 4, 1e-5, 4), r"sums must be \[N, C, 2\] float64.*float32"),
        ((_sums(2, 8, 3), 4, 1e-5, 4), r"sums must be \[N, C, 2\] float64.*\(2, 8, 3\)"),
        ((_sums(2, 8, 2), 4, 1e-5, 0), "count=0"),
        ((_sums(2, 8, 2), 4, 1e-5, 4, _sums(3, 8, 2)), r"sums_tail \(3 images"),
        ((_sums(4, 8, 2), 4, 1e-5, 4, None, 3), "frames=3 must be a positive divisor of the 4 images"),
    ],
    ids=["groups", "dtype", "pairs", "count", "tail batch", "frames"],
)
def test_bad_sums_are_refused_with_the_argument_named(args, match):
    with pytest.raises(ValueError, match=match):
        group_norm_stats_from_sums(*args)


def test_opcheck_and_compile():
    head, tail = channel_sums_torch(torch.randn(2, 10, 3, 3)), channel_sums_torch(torch.randn(2, 14, 3, 3))
    torch.library.opcheck(torch.ops.ldmopt.group_norm_stats_from_sums, (head, 6, 1e-5, 9, tail))
    torch.library.opcheck(torch.ops.ldmopt.group_norm_stats_from_sums, (head, 5, 1e-5, 9))
    torch.library.opcheck(torch.ops.ldmopt.group_norm_stats_from_sums, (head, 6, 1e-5, 9, tail, 2))
    x, gw, gb, wt, b = _conv_inputs(2, 12, 5, 5, 16, 3, torch.float32)
    torch.library.opcheck(
        torch.ops.ldmopt.gn_conv2d,
        (x, None, None, None, None, wt, b, None, None, None, None, None, None, 0, "", 1, [1, 1], "none", "none",
         "none", 1.0, 0, 0.0, None, None, "conv", False, True),
    )  # fmt: skip

    def stats_of_concat(h, t):
        return group_norm_stats_from_sums(h, 6, 1e-5, 9, t)

    def conv_with_sums(inp):
        return gn_silu_conv2d(inp, gw, gb, 4, 1e-5, wt, b, 1, 1, out_stats=(4, 1e-5), out_channel_sums=True)

    for fn, args in ((stats_of_concat, (head, tail)), (conv_with_sums, (x,))):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
        torch.testing.assert_close(compiled, fn(*args))


def test_sums_take_no_gradient_and_the_output_keeps_its_own():
    x, gw, gb, wt, b = _conv_inputs(2, 12, 5, 5, 16, 3, torch.float64)
    x.requires_grad_(True)
    with ldmopt.use_backend("torch"):
        y, sums = gn_silu_conv2d(x, gw, gb, 4, 1e-5, wt, b, 1, 1, out_channel_sums=True)
    assert not sums.requires_grad
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
