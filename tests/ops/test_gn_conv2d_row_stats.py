"""gn_silu_conv2d(..., next_norm_eps=): the convolution's epilogue also sums the LayerNorm statistics of its output's
pixel rows (the token array a transformer's proj_in hands its first block's norm1), as ops.linear's does for its rows.

The statistics must be ``layer_norm_stats`` of the stored y itself, for any tiling: rows in several row tiles per image
(the second one partial), channels in several column tiles, images after the first (whose rows must not spill into
the next image's), 3x3 convs as well as 1x1, both placements of the GroupNorm, and two-part inputs.
"""

import pytest
import torch

import ldmopt
from ldmopt.ops.gn_conv2d import gn_silu_conv2d, pixel_rows
from ldmopt.ops.layer_norm_linear import layer_norm_stats
from tests.tolerances import assert_close

DTYPES = [torch.float32, torch.float16]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _inputs(n, c, h, w, c_out, k, dtype, groups=4):
    x = _cl(torch.randn(n, c, h, w, dtype=torch.float64) * 1.3 + 0.4).to(dtype)
    gw = (torch.randn(c, dtype=torch.float64) * 0.5 + 1.0).to(dtype)
    gb = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype)
    wt = _cl(torch.randn(c_out, c, k, k, dtype=torch.float64) / (c * k * k) ** 0.5).to(dtype)
    b = (torch.randn(c_out, dtype=torch.float64) * 0.3 + 0.2).to(dtype)
    return x, gw, gb, groups, wt, b


def _expected(y: torch.Tensor, eps: float) -> torch.Tensor:
    """[2, M] fp64: each pixel's mean and 1 / sqrt(var + eps) over its channels, of y as stored."""
    rows = y.double().permute(0, 2, 3, 1).reshape(-1, y.shape[1])
    return torch.stack([rows.mean(1), torch.rsqrt(rows.var(1, unbiased=False) + eps)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "shape",
    [
        # (N, C_in, H, W, C_out, k): 99 pixels = two row tiles of the interpreter's 64 (the second partial), 200
        # output channels = two column tiles of 128, three images
        (3, 40, 9, 11, 200, 1),
        (2, 24, 7, 5, 72, 3),  # a 3x3 conv, one tile of each kind
    ],
    ids=["1x1 tiles", "3x3"],
)
def test_statistics_are_those_of_the_stored_output(dtype, backend, shape):
    n, c, h, w, c_out, k = shape
    x, gw, gb, groups, wt, b = _inputs(n, c, h, w, c_out, k, dtype)
    with ldmopt.use_backend(backend):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, k // 2, activation=None, next_norm_eps=1e-6)
        plain = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, k // 2, activation=None)
    assert stats.shape == (2, n * h * w) and stats.dtype == torch.float32
    assert_close(stats, _expected(y, 1e-6), torch.float32, f"{backend} {dtype} row statistics")
    torch.testing.assert_close(y, plain, rtol=0, atol=0)  # the epilogue only adds the sums
    # what the LayerNorm-in-loads GEMMs would otherwise compute, from the same rows
    assert_close(stats, layer_norm_stats(pixel_rows(y), 1e-6), torch.float32, "vs layer_norm_stats")


@pytest.mark.parametrize("placement", ["loader", "staged"])
def test_both_placements_and_two_part_input(placement, monkeypatch):
    from ldmopt.ops import gn_conv2d_prologue as prologue

    monkeypatch.setenv(prologue.ENV, placement)
    x, gw, gb, groups, wt, b = _inputs(2, 40, 5, 9, 136, 1, torch.float16)
    head, tail = _cl(x[:, :24]), _cl(x[:, 24:])
    with ldmopt.use_backend("triton"):
        y, stats = gn_silu_conv2d((head, tail), gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-5)
    with ldmopt.use_backend("torch"):
        y_ref, stats_ref = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-5)
    assert_close(y, y_ref, torch.float16, "y")
    assert_close(stats, _expected(y, 1e-5), torch.float32, "row statistics")
    assert_close(stats_ref, _expected(y_ref, 1e-5), torch.float32, "reference row statistics")


def test_no_cancellation_for_rows_far_from_zero(triton_launches):
    # Every pixel's channels near 1000 with a spread ~1 (fp16 steps of 0.5 there): E[y^2] - E[y]^2 in fp32 would be
    # off by ~6% of the variance.
    x, gw, gb, groups, wt, b = _inputs(2, 8, 9, 7, 144, 1, torch.float16)
    b = torch.full((144,), 1000.0, dtype=torch.float16)
    with ldmopt.use_backend("triton"):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt * 2, b, 1, 0, next_norm_eps=1e-10)
    assert triton_launches[-1] == "_gn_conv2d_fwd_kernel", triton_launches  # the epilogue's sums
    torch.testing.assert_close(stats[1].double(), _expected(y, 1e-10)[1], rtol=1e-3, atol=0)


def test_under_deterministic_algorithms_a_statistics_pass(triton_launches):
    x, gw, gb, groups, wt, b = _inputs(2, 8, 5, 7, 40, 1, torch.float16)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with ldmopt.use_backend("triton"):
            y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-6)
    finally:
        torch.use_deterministic_algorithms(was)
    assert triton_launches[-1] == "_row_stats_kernel", triton_launches  # a fixed-order pass over y, after the conv
    assert_close(stats, _expected(y, 1e-6), torch.float32, "row statistics")
    triton_launches.clear()
    with ldmopt.use_backend("triton"):
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-6)
    assert "_row_stats_kernel" not in triton_launches and triton_launches[-1] == "_gn_conv2d_fwd_kernel"
    triton_launches.clear()
    with ldmopt.use_backend("triton"):  # fp32 operands: a statistics pass too (the epilogue would spill on sm_80)
        _, stats = gn_silu_conv2d(x.float(), gw.float(), gb.float(), groups, 1e-5, wt.float(), b.float(), 1, 0,
                                  next_norm_eps=1e-6)  # fmt: skip
    assert triton_launches[-1] == "_row_stats_kernel", triton_launches


def test_gradients_flow_through_y_and_not_the_statistics():
    x, gw, gb, groups, wt, b = _inputs(2, 8, 5, 3, 12, 1, torch.float64)
    for t in (x, gw, gb, wt, b):
        t.requires_grad_()
    with ldmopt.use_backend("torch"):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-5)
        assert not stats.requires_grad and stats.dtype == torch.float64
        grads = torch.autograd.grad((y * y.detach().cos()).sum(), (x, gw, gb, wt, b))
        plain = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0)
        expect = torch.autograd.grad((plain * plain.detach().cos()).sum(), (x, gw, gb, wt, b))
    for got, want, name in zip(grads, expect, ("x", "gn_weight", "gn_bias", "weight", "bias")):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(next_norm_eps=1e-5, out_stats=(2, 1e-5)), "out_stats .GroupNorm. and next_norm_eps .LayerNorm."),
        (dict(next_norm_eps=-1.0), "next_norm_eps must be a finite non-negative float, got -1.0"),
        (dict(next_norm_eps=float("nan")), "next_norm_eps must be a finite non-negative float, got nan"),
    ],
)
def test_bad_arguments(kwargs, match):
    x, gw, gb, groups, wt, b = _inputs(2, 8, 3, 3, 4, 1, torch.float32)
    with pytest.raises(ValueError, match=match):
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, **kwargs)


def test_op_refuses_both_kinds_of_output_statistics():
    x, *_, wt, b = _inputs(2, 8, 3, 3, 4, 1, torch.float32)
    args = (x, None, None, None, None, wt, b, None, None, None, None, None, None, 0, "", 1, [0, 0], "none", "none",
            "none", 1.0, 2, 1e-5, None, None, "conv", True)  # fmt: skip
    with pytest.raises(ValueError, match="out_layer_norm with out_groups=2"):
        torch.ops.ldmopt.gn_conv2d(*args)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_opcheck(backend):
    x, gw, gb, groups, wt, b = _inputs(2, 4, 3, 5, 6, 1, torch.float32, groups=2)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5)
    args = (x.requires_grad_(), mean, rstd, gw, gb, wt.requires_grad_(), b, None, None, None, None, None, None,
            groups, "", 1, [0, 0], "none", "none", "none", 1.0, 0, 1e-6, None, None, "matmul", True)  # fmt: skip
    with ldmopt.use_backend(backend):
        torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, gw, gb, groups, wt, b = _inputs(2, 4, 5, 3, 6, 1, torch.float32, groups=2)
    x.requires_grad_()

    def fn(x):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, wt, b, 1, 0, next_norm_eps=1e-5)
        return y * stats[1].view(2, 5, 3)[:, None]  # the rows' rstd, broadcast over channels

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    eager = fn(x)
    eager.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(grad, x.grad)
