"""The "cudnn" placement of the fused conv (ldmopt/ops/gn_conv2d_prologue.py): GroupNorm + SiLU in a staged Triton
pass, the convolution by PyTorch (cuDNN on GPUs, its CPU convolution here), and the epilogue as a Triton pass of its
own (kernels/conv_epilogue.py). Against the unfused composition in fp64 and in the inputs' dtype, on the cases the
loader and staged placements are tested on; and the launches it makes.
"""

import pytest
import torch

import ldmopt
from ldmopt.ops import gn_conv2d_prologue as prologue
from ldmopt.ops.gn_conv2d import channel_sums_torch, gn_silu_conv2d, pixel_rows
from tests.ops.test_gn_conv2d import CONV_CASES, DTYPES, _check, _cl, _inputs
from tests.ops.test_gn_conv2d_parts import _block_params, _compose, _parts
from tests.ops.test_gn_conv2d_temporal import _as_5d, _compose_5d, _d, _frames, _params, _video_view
from tests.tolerances import assert_close, assert_compiled_matches_eager, assert_within_torch_error

CUDA = torch.device("cuda")  # a device object: nothing is queried


@pytest.fixture
def cudnn(monkeypatch):
    monkeypatch.setenv(prologue.ENV, "cudnn")
    prologue.placement_counts.clear()


@pytest.mark.parametrize(
    "kernel,c_out,stride,resample,normalize,expect",
    [
        ((3, 3), 320, 1, "none", True, "cudnn"),  # SD resnet conv: 9 taps x 3 channel tiles
        ((3, 1), 64, 1, "none", True, "cudnn"),  # temporal conv: 3 taps
        ((3, 3), 128, 2, "none", True, "loader"),  # 9/4 taps: the loader normalises each element about twice
        ((1, 1), 256, 1, "none", True, "loader"),  # proj_in after GroupNorm, 2 channel tiles
        ((3, 3), 320, 2, "none", False, "cudnn"),  # a downsampler's plain conv
        ((1, 1), 320, 1, "none", False, "cudnn"),  # a plain 1x1 conv (not a Linear: see the next test)
    ],
)
def test_auto_policy_on_a_gpu(kernel, c_out, stride, resample, normalize, expect, monkeypatch):
    monkeypatch.delenv(prologue.ENV, raising=False)
    assert prologue.choose_placement(CUDA, kernel, c_out, stride, resample, normalize) == expect


def test_the_interpreter_keeps_the_triton_conv_unless_told(monkeypatch):
    monkeypatch.delenv(prologue.ENV, raising=False)
    assert prologue.choose_placement(torch.device("cpu"), (3, 3), 320, 1, "none", False) == "loader"
    monkeypatch.setenv(prologue.ENV, "staged")  # the Triton plain conv on a GPU too
    assert prologue.choose_placement(CUDA, (3, 3), 320, 2, "none", False) == "staged"


@pytest.mark.parametrize("k,stride,padding,resample", CONV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cudnn_conv_matches_composition(k, stride, padding, resample, dtype, cudnn, triton_launches):
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 20, k, dtype)  # 3 channels per group, odd H and W
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, stride, padding, resample=resample)
    _check(y, (x, gw, gb, groups, w, b, stride, padding, resample), {}, f"cudnn {k}x{k}/s{stride}/{resample}")
    assert prologue.placement_counts == {"cudnn": 1}
    # statistics, the normalisation pass; the conv is PyTorch's, and with nothing to add no epilogue runs
    assert triton_launches[-1] == "_group_norm_fwd_apply_kernel" and "_gn_conv2d_fwd_kernel" not in triton_launches


@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_and_output_statistics(dtype, cudnn, triton_launches):
    x, gw, gb, groups, w, b = _inputs(3, 8, 5, 7, 12, 3, dtype)
    temb = torch.randn(3, 12, dtype=dtype)
    residual = _cl(torch.randn(3, 12, 5, 7, dtype=dtype))
    shortcut = (x, torch.randn(12, 8, 1, 1, dtype=dtype) * 0.3, torch.randn(12, dtype=dtype))
    with ldmopt.use_backend("triton"):
        y, (mean, rstd) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, temb=temb, residual=residual,
                                         shortcut=shortcut, output_scale=1.7, out_stats=(4, 1e-6))  # fmt: skip
    _check(y, (x, gw, gb, groups, w, b, 1, 1), dict(temb=temb, residual=residual, shortcut=shortcut, scale=1.7),
           "cudnn epilogue")  # fmt: skip
    yg = y.double().reshape(3, 4, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")
    assert triton_launches[-2:] == ["_group_norm_fwd_apply_kernel", "_conv_epilogue_kernel"]


@pytest.mark.parametrize("resample", ["none", "up"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_part_input_and_shortcut(resample, dtype, cudnn):
    head, tail = _parts(3, 7, 9, 5, 7, dtype)  # 16 channels in 4 groups: the second group spans both parts
    gw, gb, w, b, sw, sb = _block_params(16, 11, dtype)
    temb = torch.randn(3, 11, dtype=dtype)
    args = (head, tail, gw, gb, 4, w, b, resample, temb, sw, sb, 1.25)
    with ldmopt.use_backend("triton"):
        out = gn_silu_conv2d((head, tail), gw, gb, 4, 1e-5, w, b, 1, 1, resample=resample, temb=temb,
                             shortcut=((head, tail), sw, sb), output_scale=1.25,
                             shortcut_resample=resample)  # fmt: skip
    ref = _compose(*[a.double() if torch.is_tensor(a) else a for a in args])
    assert_within_torch_error(out, ref, _compose(*args), f"cudnn parts {resample} {dtype}")
    assert prologue.placement_counts == {"cudnn": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_temporal_conv_with_frame_temb_gate_and_residual(dtype, cudnn):
    batch, frames, c, c_out, h, w = 2, 5, 9, 9, 3, 5
    view = _video_view(_frames(batch, frames, c, h, w, dtype), batch)  # (video, C, frame, pixel), strided
    gw, gb, w3, b = _params(c, c_out, dtype)
    temb = torch.randn(batch, frames, c_out, dtype=dtype).transpose(1, 2)
    gate = torch.rand(batch, frames)
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (1, 0), temb=temb, gate=gate, residual=view)
    x5 = _as_5d(view, h, w)
    ref = _compose_5d(x5.double(), _d(gw), _d(gb), 3, _d(w3), _d(b), 1, temb=_d(temb), gate=gate.double()) + _d(x5)
    lowp = _compose_5d(x5.float(), gw.float(), gb.float(), 3, w3.float(), b.float(), 1, temb=temb.float(), gate=gate)
    assert_within_torch_error(_as_5d(y, h, w), ref, (lowp + x5.float()).to(dtype), f"cudnn temporal {dtype}")
    assert prologue.placement_counts == {"cudnn": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_conv_statistics_only_reads_and_keeps_the_output(dtype, cudnn, triton_launches):
    """A producer asked only for sums (a downsampler): PyTorch's conv output is returned as it is, and one read-only
    epilogue pass sums it."""
    x = _cl(torch.randn(2, 8, 9, 7, dtype=torch.float64) + 0.5).to(dtype)
    w = (torch.randn(10, 8, 3, 3, dtype=torch.float64) * 0.2).to(dtype)
    b = torch.randn(10, dtype=dtype)
    triton_launches.clear()
    with ldmopt.use_backend("triton"):
        y, (mean, rstd), sums = gn_silu_conv2d(x, None, None, 0, 0.0, w, b, 2, 1, normalize=False,
                                               out_stats=(5, 1e-5), out_channel_sums=True)  # fmt: skip
    expect = torch.nn.functional.conv2d(x, w, b, 2, 1)
    torch.testing.assert_close(y, expect, rtol=0, atol=0)  # the conv's own output, not rewritten
    assert triton_launches == ["_conv_epilogue_kernel"]
    assert_close(sums, channel_sums_torch(y), torch.float32, "channel sums")
    yg = y.double().reshape(2, 5, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-5), torch.float32, "rstd")


@pytest.mark.parametrize("dtype", [torch.float16])
def test_layer_norm_row_statistics_of_a_projection(dtype, cudnn):
    x, gw, gb, groups, w, b = _inputs(2, 12, 5, 9, 40, 1, dtype)
    with ldmopt.use_backend("triton"):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 0, activation=None, next_norm_eps=1e-6)
    rows = pixel_rows(y).double()
    assert_close(stats[0], rows.mean(1), torch.float32, "row means")
    assert_close(stats[1], torch.rsqrt(rows.var(1, unbiased=False) + 1e-6), torch.float32, "row rstd")


def test_cudnn_and_loader_agree_through_backward(monkeypatch):
    """The placement changes only the forward: gradients come from the same recomputation."""
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 12, 3, torch.float32)  # C_out = C: x is also the residual
    temb = torch.randn(2, 12)
    results = {}
    for placement in ("loader", "cudnn"):
        monkeypatch.setenv(prologue.ENV, placement)
        leaves = [t.clone().requires_grad_() for t in (x, gw, gb, w, b, temb)]
        with ldmopt.use_backend("triton"):
            y = gn_silu_conv2d(*leaves[:3], groups, 1e-5, *leaves[3:5], temb=leaves[5], residual=leaves[0])
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results[placement] = (y.detach(), [t.grad for t in leaves])
    (y_l, g_l), (y_c, g_c) = results["loader"], results["cudnn"]
    torch.testing.assert_close(y_c, y_l, rtol=1e-5, atol=1e-5)
    for a, c in zip(g_c, g_l):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_over_several_tiles_with_broadcast_temb_and_nchw_residual(dtype, cudnn):
    """136 channels of 9 x 9 pixels: 2 column and 3 row tiles per image (the last partial), so the per-image arrival
    counter and the cross-tile sums run; a temb of stride 0 over the batch and an NCHW residual read by strides."""
    x, gw, gb, groups, w, b = _inputs(2, 16, 9, 9, 136, 3, dtype)
    temb = torch.randn(1, 136, dtype=dtype).expand(2, -1)
    residual = torch.randn(2, 136, 9, 9, dtype=dtype)  # NCHW
    with ldmopt.use_backend("triton"):
        y, (mean, rstd), sums = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, temb=temb, residual=residual,
                                               output_scale=1.3, out_stats=(8, 1e-6),
                                               out_channel_sums=True)  # fmt: skip
    _check(y, (x, gw, gb, groups, w, b, 1, 1), dict(temb=temb, residual=residual, scale=1.3), "cudnn tiles")
    yg = y.double().reshape(2, 8, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")
    expect = channel_sums_torch(y)
    torch.testing.assert_close(sums, expect, rtol=1e-5, atol=1e-5 * expect[..., 1].abs().max().item())
    assert prologue.placement_counts == {"cudnn": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_statistics_over_several_tiles(dtype, cudnn, triton_launches):
    """A projection's LayerNorm statistics per pixel, summed across 2 column tiles (fp32 too: the epilogue pass has
    no spill to avoid)."""
    x, gw, gb, groups, w, b = _inputs(2, 12, 9, 9, 136, 1, dtype)
    with ldmopt.use_backend("triton"):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 0, activation=None, next_norm_eps=1e-6)
    assert "_conv_epilogue_kernel" in triton_launches and "_row_stats_kernel" not in triton_launches
    rows = pixel_rows(y).double()
    assert_close(stats[0], rows.mean(1), torch.float32, "row means")
    assert_close(stats[1], torch.rsqrt(rows.var(1, unbiased=False) + 1e-6), torch.float32, "row rstd")


def test_a_linear_read_as_a_pointwise_conv_with_its_residual(cudnn):
    # (auto keeps such a conv in the Triton kernel; forced here, as LDMOPT_GN_CONV_PROLOGUE=cudnn would)
    """fp32_precision="matmul": the conv is nn.Linear's GEMM over the channels-last rows, then the residual pass."""
    tokens = _cl(torch.randn(2, 24, 5, 7))
    w, b = torch.randn(20, 24, 1, 1) * 0.2, torch.randn(20)
    residual = _cl(torch.randn(2, 20, 5, 7))
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(tokens, None, None, 0, 0.0, w, b, 1, 0, normalize=False, activation=None,
                           residual=residual, fp32_precision="matmul")  # fmt: skip
    expect = torch.nn.functional.conv2d(tokens.double(), w.double(), b.double()) + residual.double()
    assert_close(y, expect, torch.float32, "linear as conv")
    assert prologue.placement_counts == {"cudnn": 1}


def test_auto_places_a_plain_linear_as_the_fused_gemm_is_placed(monkeypatch):
    """proj_out switches between the fused GEMM and a 1x1 conv, so the conv must round as the GEMM does: where the
    GEMM is cuBLAS's with an epilogue pass (auto on GPUs), the "cudnn" placement (F.linear, then the pass); where it
    is the Triton GEMM (forced, or deterministic mode without a cuBLAS workspace), the Triton kernel."""
    from ldmopt.ops import linear_cublas

    def placement(normalize=False):
        return prologue.choose_placement(CUDA, (1, 1), 320, 1, "none", normalize=normalize, linear=True)

    monkeypatch.delenv(prologue.ENV, raising=False)
    monkeypatch.delenv(linear_cublas.ENV, raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert placement() == "cudnn"
    assert placement(normalize=True) == "cudnn"  # by the recompute rule (R = 3)
    monkeypatch.setenv(linear_cublas.ENV, "triton")
    assert placement() == "loader"
    monkeypatch.delenv(linear_cublas.ENV)
    torch.use_deterministic_algorithms(True)
    try:
        assert placement() == "loader"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        assert placement() == "cudnn"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_linear_as_a_pointwise_conv_rounds_as_the_cublas_gemm(dtype, cudnn, monkeypatch):
    """With the GPUs' placements (cuBLAS's GEMM and its epilogue pass; "cudnn" for the 1x1 conv) proj_out's two
    forms give the same bits: ops.linear with the residual, and the conv over the tokens' channels-last view."""
    from ldmopt.ops import linear, linear_cublas

    monkeypatch.setenv(linear_cublas.ENV, "cublas")
    n, c_in, c, h, w = 2, 24, 20, 5, 7
    tokens = torch.randn(n, h * w, c_in, dtype=dtype)
    weight, bias = (torch.randn(c, c_in) * 0.2).to(dtype), torch.randn(c, dtype=dtype)
    residual = _cl(torch.randn(n, c, h, w, dtype=dtype))
    with ldmopt.use_backend("triton"):
        as_gemm = linear(tokens, weight, bias, residual=residual.permute(0, 2, 3, 1).reshape(n, h * w, c))
        as_conv = gn_silu_conv2d(tokens.view(n, h, w, c_in).permute(0, 3, 1, 2), None, None, 0, 0.0,
                                 weight[:, :, None, None], bias, 1, 0, normalize=False, activation=None,
                                 residual=residual, fp32_precision="matmul", out_stats=(4, 1e-6))  # fmt: skip
    assert prologue.placement_counts == {"cudnn": 1}
    torch.testing.assert_close(as_conv[0].permute(0, 2, 3, 1).reshape(n, h * w, c), as_gemm, rtol=0, atol=0)


def test_deterministic_mode_sums_after_the_conv_in_a_fixed_order(cudnn, triton_launches):
    x, gw, gb, groups, w, b = _inputs(2, 16, 9, 9, 136, 3, torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        with ldmopt.use_backend("triton"):
            y, (mean, _rstd), sums = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, out_stats=(8, 1e-6),
                                                    out_channel_sums=True)  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(False)
    assert "_conv_epilogue_kernel" not in triton_launches  # no atomics: nothing to add, statistics passes after
    torch.testing.assert_close(sums, channel_sums_torch(y), rtol=0, atol=0)
    yg = y.double().reshape(2, 8, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")


def test_two_part_shortcut_without_bias_as_two_gemms(cudnn):
    head, tail = _parts(2, 7, 9, 5, 7, torch.float16)
    gw, gb, w, b, sw, _ = _block_params(16, 11, torch.float16)
    temb = torch.randn(2, 11, dtype=torch.float16)
    args = (head, tail, gw, gb, 4, w, b, "none", temb, sw, None, 1.0)
    with ldmopt.use_backend("triton"):
        out = gn_silu_conv2d((head, tail), gw, gb, 4, 1e-5, w, b, 1, 1, temb=temb, shortcut=((head, tail), sw, None))
    ref = _compose(*[a.double() if torch.is_tensor(a) else a for a in args])
    assert_within_torch_error(out, ref, _compose(*args), "cudnn parts, shortcut without bias")


def test_opcheck_and_compile_fullgraph(cudnn):
    """The op's fake, autograd and schema hold under this placement too, and a compiled graph runs it as eager does."""
    x, gw, gb, groups, w, b = _inputs(2, 4, 5, 3, 6, 3, torch.float32, groups=2)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5)
    temb, residual = torch.randn(2, 6), _cl(torch.randn(2, 6, 5, 3))
    args = (x.clone().requires_grad_(), mean, rstd, gw, gb, w.clone().requires_grad_(), b, temb, residual, None, None,
            None, None, groups, "silu", 1, [1, 1], "none", "none", "none", 1.3, 3, 1e-5)  # fmt: skip
    with ldmopt.use_backend("triton"):
        torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)
    assert prologue.placement_counts["cudnn"] > 0

    def fn(x):
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, temb=temb, out_stats=(3, 1e-5))
        return gn_silu_conv2d(y, None, None, 3, 1e-5, w.new_ones(6, 6, 3, 3) * 0.1, None, stats=stats, residual=y)

    with ldmopt.use_backend("triton"):
        assert_compiled_matches_eager(fn, [x.clone().requires_grad_()])
