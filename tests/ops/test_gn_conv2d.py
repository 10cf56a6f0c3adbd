"""ldmopt.ops.gn_conv2d: the fused GroupNorm -> conv (Triton interpreter) against the unfused PyTorch composition.

Rule: against an fp64 reference, the error is at most 2x PyTorch's own unfused computation in the same dtype.
Shapes are tiny (the interpreter runs ~1 s per (3, 40, 9, 9) -> 72 conv); odd channel counts and spatial sizes.
"""

import pytest
import torch
import torch.nn.functional as F
from ldmopt.kernels import gn_conv2d as kernels

import ldmopt
from ldmopt.ops import gn_conv2d as op_module
from ldmopt.ops.gn_conv2d import gn_silu_conv2d
from tests.tolerances import assert_close, assert_within_torch_error

DTYPES = [torch.float32, torch.float16]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _resample(t, mode):
    if mode == "up":
        return F.interpolate(t, scale_factor=2.0, mode="nearest")
    return F.avg_pool2d(t, 2, 2) if mode == "down" else t


def _compose(x, gw, gb, groups, w, b, stride, padding, resample="none", temb=None, residual=None, res_rs="none",
             shortcut=None, sc_rs="none", scale=1.0, eps=1e-5):  # fmt: skip
    """The unfused computation, in whatever dtype the inputs have (fp64: reference; fp16: PyTorch's own error)."""
    a = x if gw is None and groups is None else F.silu(F.group_norm(x, groups, gw, gb, eps))
    y = F.conv2d(_resample(a, resample), w, b, stride, padding)
    if temb is not None:
        y = y + temb[:, :, None, None]
    if shortcut is not None:
        y = y + F.conv2d(_resample(shortcut[0], sc_rs), shortcut[1], shortcut[2])
    if residual is not None:
        y = y + _resample(residual, res_rs)
    return y / scale


def _inputs(n, c, h, w, c_out, k, dtype, groups=4):
    x = _cl(torch.randn(n, c, h, w, dtype=torch.float64) * 1.3 + 0.4).to(dtype)
    gw = (torch.randn(c, dtype=torch.float64) * 0.5 + 1.0).to(dtype)  # non-trivial affine
    gb = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype)
    wt = (torch.randn(c_out, c, k, k, dtype=torch.float64) / (c * k * k) ** 0.5).to(dtype)
    b = (torch.randn(c_out, dtype=torch.float64) * 0.3).to(dtype)
    return x, gw, gb, groups, wt, b


def _check(out, args, kwargs, name):
    """out vs fp64 and fp-lowp runs of the composition."""
    ref = _compose(*[a.double() if torch.is_tensor(a) else a for a in args], **_double(kwargs))
    lowp = _compose(*args, **kwargs)
    assert out.shape == ref.shape and out.dtype == lowp.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(out, ref, lowp, name)


def _double(kwargs):
    out = {}
    for k, v in kwargs.items():
        if torch.is_tensor(v):
            v = v.double()
        elif isinstance(v, tuple):
            v = tuple(t.double() if torch.is_tensor(t) else t for t in v)
        out[k] = v
    return out


CONV_CASES = [
    # (kernel, stride, padding, resample): every combination the Triton kernel serves
    (3, 1, 1, "none"),
    (3, 2, 1, "none"),  # strided 3x3 (downsampler conv)
    (3, 1, 0, "none"),
    (3, 2, 0, "none"),
    (1, 1, 0, "none"),
    (1, 2, 0, "none"),
    (3, 1, 1, "up"),  # nearest 2x upsample folded into the loader
    (3, 1, 1, "down"),  # 2x2 average pool folded into the loader
    (1, 1, 0, "up"),
    (1, 1, 0, "down"),
]


@pytest.mark.parametrize("k,stride,padding,resample", CONV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_matches_composition(k, stride, padding, resample, dtype):
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 20, k, dtype)  # 3 channels per group, odd H and W
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, stride, padding, resample=resample)
    _check(y, (x, gw, gb, groups, w, b, stride, padding, resample), {}, f"{k}x{k}/s{stride}/p{padding}/{resample}")


@pytest.mark.parametrize("resample", ["none", "up", "down"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_temb_shortcut_residual_scale(resample, dtype):
    x, gw, gb, groups, w, b = _inputs(3, 8, 5, 7, 12, 3, dtype)
    oh, ow = {"up": (10, 14), "down": (2, 3)}.get(resample, (5, 7))
    temb = torch.randn(3, 12, dtype=dtype)
    residual = _cl(torch.randn(3, 12, oh, ow, dtype=dtype))
    shortcut = (x, torch.randn(12, 8, 1, 1, dtype=dtype) * 0.3, torch.randn(12, dtype=dtype))
    kwargs = dict(resample=resample, temb=temb, residual=residual, shortcut=shortcut, sc_rs=resample, scale=1.7)
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1, resample=resample, temb=temb, residual=residual,
                           shortcut=shortcut, shortcut_resample=resample, output_scale=1.7)  # fmt: skip
    _check(y, (x, gw, gb, groups, w, b, 1, 1), kwargs, f"epilogue {resample}")


@pytest.mark.parametrize("res_rs", ["up", "down"])
def test_resampled_identity_residual(res_rs):
    x, gw, gb, groups, w, b = _inputs(2, 8, 6, 4, 8, 3, torch.float32)
    residual = _cl(torch.randn(2, 8, *((3, 2) if res_rs == "up" else (13, 9))))  # odd sizes: the pool drops a row
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, residual=residual, residual_resample=res_rs)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), dict(residual=residual, res_rs=res_rs), f"residual {res_rs}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_conv_without_normalisation(dtype):
    x, _, _, _, w, b = _inputs(2, 8, 7, 6, 12, 3, dtype)
    w = _cl(w)  # a channels-last model's weights: used as they are
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, None, None, 0, 0.0, w, b, 2, 1, normalize=False)
    _check(y, (x, None, None, None, w, b, 2, 1), {}, "plain strided conv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_statistics_match_group_norm_of_output(dtype):
    # 81 rows (two M-tiles of the interpreter's 64) and 136 output channels (two N-tiles of 128), 17 per group.
    x, gw, gb, groups, w, b = _inputs(3, 8, 9, 9, 136, 1, dtype)
    with ldmopt.use_backend("triton"):
        y, (mean, rstd) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 0, out_stats=(8, 1e-6))
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (3, 8)
    yg = y.double().reshape(3, 8, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")
    # Each call gets a fresh zeroed workspace (no state between calls), and a second call gives the same statistics.
    ws, counters = kernels._stats_workspace(x.device, 3, 136)
    assert ws.shape == (3 * 136 * 2,) and counters.shape == (3,) and not ws.any() and not counters.any()
    with ldmopt.use_backend("triton"):
        _, (mean2, rstd2) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 0, out_stats=(8, 1e-6))
    torch.testing.assert_close(mean2, mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rstd2, rstd, rtol=1e-6, atol=1e-7)


def test_output_statistics_under_deterministic_algorithms(triton_launches):
    """The epilogue's fp64 atomic sums depend on the order tiles finish; with torch.use_deterministic_algorithms the
    statistics come from a statistics pass over the output (fixed order), and are still those of the output."""
    x, gw, gb, groups, w, b = _inputs(2, 8, 9, 7, 40, 3, torch.float32)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with ldmopt.use_backend("triton"):
            y, (mean, rstd) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, out_stats=(8, 1e-6))
    finally:
        torch.use_deterministic_algorithms(was)
    stats_pass = ["_group_norm_fwd_partial_kernel", "_group_norm_fwd_finalize_kernel"]  # the input's, the output's
    assert triton_launches == [*stats_pass, "_gn_conv2d_fwd_kernel", *stats_pass], triton_launches
    yg = y.double().reshape(2, 8, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")
    triton_launches.clear()
    with ldmopt.use_backend("triton"):  # by default the epilogue sums them: no statistics pass after the conv
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, out_stats=(8, 1e-6))
    assert triton_launches[-1] == "_gn_conv2d_fwd_kernel" and len(triton_launches) == 3, triton_launches


def test_output_statistics_no_cancellation():
    # Output mean 40, spread ~0.01: sums of squares in fp32 would lose the variance entirely.
    x, gw, gb, groups, w, b = _inputs(2, 8, 9, 7, 16, 3, torch.float32)
    w = w * 0.01
    b = torch.full((16,), 40.0)
    with ldmopt.use_backend("triton"):
        y, (_, rstd) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, out_stats=(4, 1e-10))
    expect = torch.rsqrt(y.double().reshape(2, 4, -1).var(-1, unbiased=False) + 1e-10)
    torch.testing.assert_close(rstd.double(), expect, rtol=1e-3, atol=0)


def test_int64_row_offsets(monkeypatch):
    # The int64 indexing used for images of more than 2^31 elements, forced on a small one.
    monkeypatch.setattr(kernels, "INT64_INDEX_FROM", 0)
    x, gw, gb, groups, w, b = _inputs(2, 8, 5, 4, 12, 3, torch.float32)
    residual = _cl(torch.randn(2, 12, 10, 8))
    shortcut = (_cl(torch.randn(2, 4, 10, 8)), torch.randn(12, 4, 1, 1), None)
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, resample="up", residual=residual, shortcut=shortcut)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), dict(resample="up", residual=residual, shortcut=shortcut), "int64")


def test_given_statistics_equal_computed_ones():
    x, gw, gb, groups, w, b = _inputs(2, 12, 5, 5, 8, 3, torch.float32)
    with ldmopt.use_backend("triton"):
        mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5)
        y1 = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, stats=(mean, rstd))
        y2 = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b)
    xg = x.double().reshape(2, groups, -1)
    assert_close(mean, xg.mean(-1), torch.float32, "input mean")
    assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), torch.float32, "input rstd")
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


def test_backward_reads_statistics_views_by_their_strides():
    """Statistics a caller hands in may be views (the column halves of one [N, 2G] buffer): backward's GroupNorm
    kernels read them by index, so the gradients must equal those from contiguous copies."""
    x, gw, gb, groups, w, b = _inputs(2, 12, 5, 5, 8, 3, torch.float32)
    dy = _cl(torch.randn(2, 8, 5, 5))
    with ldmopt.use_backend("triton"):
        packed = torch.cat(torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5), dim=1)
        grads = []
        views = (packed[:, :groups], packed[:, groups:])
        for stats in (views, tuple(t.contiguous() for t in views)):
            leaves = [t.detach().clone().requires_grad_() for t in (x, gw, gb)]
            y = gn_silu_conv2d(leaves[0], leaves[1], leaves[2], groups, 1e-5, w, b, stats=stats)
            grads.append(torch.autograd.grad(y, leaves, dy))
    assert not packed[:, :groups].is_contiguous()
    for name, strided, contiguous in zip(("dx", "dgn_weight", "dgn_bias"), grads[0], grads[1]):
        torch.testing.assert_close(strided, contiguous, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("resample", ["none", "up", "down"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_autograd_of_composition(resample, dtype):
    x, gw, gb, groups, w, b = _inputs(2, 8, 5, 7, 12, 3, dtype)
    oh, ow = {"up": (10, 14), "down": (2, 3)}.get(resample, (5, 7))
    temb = torch.randn(2, 12, dtype=dtype)
    residual = _cl(torch.randn(2, 12, oh, ow, dtype=dtype))
    sx = _cl(torch.randn(2, 6, 5, 7, dtype=dtype))
    sw, sb = torch.randn(12, 6, 1, 1, dtype=dtype) * 0.3, torch.randn(12, dtype=dtype)
    leaves = [x, gw, gb, w, b, temb, residual, sx, sw, sb]
    dy = _cl(torch.randn(2, 12, oh, ow, dtype=dtype))

    def run(ts, fused):
        x, gw, gb, w, b, temb, residual, sx, sw, sb = ts
        if fused:
            with ldmopt.use_backend("triton"):
                return gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1, resample=resample, temb=temb,
                                      residual=residual, shortcut=(sx, sw, sb), shortcut_resample=resample,
                                      output_scale=1.3)  # fmt: skip
        return _compose(x, gw, gb, groups, w, b, 1, 1, resample, temb, residual, "none", (sx, sw, sb), resample, 1.3)

    grads = {}
    for name, cast in (("ours", None), ("ref", torch.float64), ("lowp", None)):
        ts = [(t.detach().to(cast) if cast else t.detach().clone()).requires_grad_() for t in leaves]
        run(ts, name == "ours").backward(dy.to(cast or dtype))
        grads[name] = [t.grad for t in ts]
    assert grads["ours"][0].is_contiguous(memory_format=torch.channels_last)
    names = ("dx", "dgn_weight", "dgn_bias", "dweight", "dbias", "dtemb", "dresidual", "dshortcut_x", "dsw", "dsb")
    for name, ours, ref, lowp in zip(names, grads["ours"], grads["ref"], grads["lowp"]):
        assert ours.dtype == dtype and ours.shape == ref.shape, name
        assert_within_torch_error(ours, ref, lowp, f"{name} {resample} {dtype}")


def test_gradcheck_reference_fp64():
    x, gw, gb, groups, w, b = _inputs(2, 4, 4, 5, 3, 3, torch.float64, groups=2)
    temb = torch.randn(2, 3, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (x, gw, gb, w, b, temb)]

    def fn(x, gw, gb, w, b, t):
        return gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1, resample="down", temb=t)

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_nchw_input_falls_back_with_reason_and_forced_triton_raises():
    x, gw, gb, groups, w, b = _inputs(2, 8, 5, 5, 4, 3, torch.float32)
    x = x.contiguous()
    op_module.fallback_reasons.clear()
    y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b)
    assert any("not channels-last" in r for (_, _, r) in op_module.fallback_reasons)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), {}, "reference backend on NCHW")
    forced = pytest.raises(ldmopt.BackendUnavailableError, match=r"'triton' was forced.*not channels-last")
    with forced, ldmopt.use_backend("triton"):
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b)


def test_unsupported_kernel_size_runs_reference():
    x, gw, gb, groups, _, b = _inputs(1, 8, 6, 6, 4, 3, torch.float32)
    w = torch.randn(4, 8, 5, 5) * 0.1
    op_module.fallback_reasons.clear()
    y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 2)
    reason = "kernel 5x5: the triton kernel serves 1x1, 3x3 and 3x1 (temporal)"
    assert ("gn_conv2d", "triton", reason) in op_module.fallback_reasons
    _check(y, (x, gw, gb, groups, w, b, 1, 2), {}, "5x5 reference")


def _bad(**over):
    x, gw, gb, groups, w, b = _inputs(2, 8, 5, 5, 4, 3, torch.float32)
    args = dict(x=x, gn_weight=gw, gn_bias=gb, num_groups=groups, eps=1e-5, conv_weight=w, conv_bias=b)
    kwargs = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return lambda: gn_silu_conv2d(**args, **kwargs)


@pytest.mark.parametrize(
    "call,match",
    [
        (_bad(x=torch.randn(2, 8, 5)), "x must have 4 dims"),
        (_bad(conv_weight=torch.randn(4, 4, 3, 3)), "grouped convolutions are not supported"),
        (_bad(num_groups=3), "num_groups=3 must be a positive int dividing C=8"),
        (_bad(gn_weight=torch.randn(7)), r"gn_weight must have shape \(8,\)"),
        (_bad(temb=torch.randn(2, 5)), r"temb must have shape \(2, 4\) or, per output row, \(2, 4, 5\)"),
        (_bad(gate=torch.randn(2, 4)), r"gate must have shape \(2,\) or, per output row, \(2, 5\); got \(2, 4\)"),
        (_bad(padding=(1,)), r"padding must be a non-negative int or a pair of them, got \(1,\)"),
        (_bad(resample="bilinear"), "resample='bilinear' is not supported"),
        (_bad(residual=torch.randn(2, 4, 3, 3)), "residual of shape"),
        (_bad(out_stats=(3, 1e-5)), "out_stats groups=3 must be a positive int dividing C_out=4"),
        (_bad(stats=(torch.zeros(2, 3), torch.ones(2, 3))), r"stats\[0\] \(mean\) must have shape \(2, 4\)"),
        (_bad(activation="gelu"), "activation='gelu' is not supported"),
        (_bad(stride=0), "stride must be a positive int, got 0"),
        (_bad(num_groups=True), "num_groups=True must be a positive int"),
        (_bad(eps=float("nan")), "eps must be a finite non-negative"),
        (_bad(out_stats=(2, -1.0)), "eps must be a finite non-negative"),
        (_bad(stats=(torch.zeros(2, 4),)), r"stats must be a \(mean, rstd\) pair"),
        (_bad(stats=(torch.zeros(2, 4, device="meta"), torch.ones(2, 4))), r"stats\[0\] \(mean\) is on meta"),
        (_bad(stats=(torch.zeros(2, 4), torch.ones(2, 4, device="meta"))), r"stats\[1\] \(rstd\) is on meta"),
        (_bad(out_stats=4), r"out_stats must be a \(groups, eps\) pair for the next GroupNorm, got 4"),
        (_bad(out_stats=(4,)), r"out_stats must be a \(groups, eps\) pair"),
        (_bad(conv_weight=torch.randn(4, 8, 3, 3, device="meta")), "conv_weight is on meta"),
        (_bad(conv_weight=torch.randn(4, 8, 3, 3, dtype=torch.float64)), "conv_weight dtype torch.float64 differs"),
        (_bad(conv_bias=torch.randn(4, dtype=torch.float16)), "conv_bias dtype torch.float16 differs"),
        (
            _bad(shortcut=(torch.randn(2, 8, 5, 5), torch.randn(4, 8, 1, 1).half(), None)),
            "shortcut_weight dtype torch.float16 differs",
        ),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_opcheck():
    x, gw, gb, groups, w, b = _inputs(2, 4, 3, 5, 6, 3, torch.float32, groups=2)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5)
    temb = torch.randn(2, 6)
    args = (x.requires_grad_(), mean, rstd, gw, gb, w.requires_grad_(), b, temb, None, None, None, None, None,
            groups, "silu", 1, [1, 1], "down", "none", "none", 1.0, 3, 1e-5)  # fmt: skip
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d_stats, (x.detach(), groups, 1e-5))


def test_torch_compile_fullgraph():
    # aot_eager here; tests/nn/test_resnet_block.py compiles the same ops with inductor.
    torch._dynamo.reset()
    x, gw, gb, groups, w, b = _inputs(2, 4, 5, 3, 6, 3, torch.float32, groups=2)
    x.requires_grad_()
    w2 = torch.randn(4, 6, 3, 3) * 0.2

    def fn(x):
        # conv1 hands its output statistics to conv2's GroupNorm (no affine), as in a resnet block
        y, stats = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, out_stats=(3, 1e-5))
        return gn_silu_conv2d(y, None, None, 3, 1e-5, w2, None, stats=stats, residual=x)

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    eager = fn(x)
    eager.sum().backward()
    assert_close(out, eager.detach().double(), torch.float32, "compiled forward")
    assert_close(grad, x.grad.double(), torch.float32, "compiled backward")


@pytest.mark.parametrize("resample", ["up", "down"])
def test_inductor_dynamic_shapes_training_step(resample):
    """A compiled training step with dynamic shapes, as a patched up/down block trains under torch.compile: the
    gradient of the folded 2x upsampling used to be aten's upsample_nearest2d_backward, which inductor could not
    lower with symbolic sizes ('FloorDiv' object cannot be interpreted as an integer)."""
    torch._dynamo.reset()
    w, b = torch.randn(7, 12, 3, 3, requires_grad=True), torch.randn(7, requires_grad=True)

    def fn(x):
        return gn_silu_conv2d(x, None, None, 3, 1e-5, w, b, normalize=False, resample=resample)

    compiled = torch.compile(fn, backend="inductor", dynamic=True, fullgraph=True)
    for width in (10, 12):
        x = _cl(torch.randn(2, 12, 6, width)).requires_grad_()
        with torch._inductor.config.patch(fx_graph_cache=False):  # lower it here, not from an earlier run's cache
            out = compiled(x)
            out.sum().backward()
        grads = [t.grad.clone() for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        eager = fn(x)
        eager.sum().backward()
        assert_close(out, eager.detach().double(), torch.float32, f"compiled forward, width {width}")
        for got, t in zip(grads, (x, w, b)):
            assert_close(got, t.grad.double(), torch.float32, f"compiled backward, width {width}")
        for t in (x, w, b):
            t.grad = None


def test_weights_edited_in_place_and_strided_vectors_are_honoured():
    # No hidden weight cache: an NCHW-layout weight edited through .data (as LoRA fusing does) is read afresh, and
    # strided per-channel vectors (a GroupNorm weight viewed with stride 2) are read correctly.
    x = torch.randn(2, 8, 7, 7).to(memory_format=torch.channels_last)
    w = torch.randn(12, 8, 3, 3)
    gw, gb = torch.randn(16)[::2], torch.randn(8)
    outputs = []
    for _ in range(2):
        with ldmopt.use_backend("triton"):
            y = gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, None, 1, 1)
        ref = F.conv2d(F.silu(F.group_norm(x.double(), 4, gw.double(), gb.double(), 1e-5)), w.double(), padding=1)
        assert_close(y, ref, torch.float32, "conv after weight edit")
        outputs.append(y)
        w.data += 1.0
    assert not torch.allclose(outputs[0], outputs[1])


def test_cropped_input_falls_back_instead_of_raising():
    x = torch.randn(2, 8, 9, 9).to(memory_format=torch.channels_last)[:, :, 1:, 1:]  # spatial dims do not flatten
    gw, gb, w = torch.randn(8), torch.randn(8), torch.randn(12, 8, 3, 3)
    y = gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, None, 1, 1)
    ref = F.conv2d(F.silu(F.group_norm(x.double(), 4, gw.double(), gb.double(), 1e-5)), w.double(), padding=1)
    assert_close(y, ref, torch.float32, "cropped input")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(output_scale=0.0), "output_scale=0.0"),
        (dict(output_scale=float("nan")), "output_scale=nan"),
        (dict(temb=torch.randn(2, 12, device="meta")), "temb is on meta but the input is on cpu"),
    ],
)
def test_bad_epilogue_arguments(kwargs, match):
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=match):
        gn_silu_conv2d(x, torch.randn(8), torch.randn(8), 4, 1e-5, torch.randn(12, 8, 3, 3), None, 1, 1, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("weight_format", [torch.contiguous_format, torch.channels_last])
def test_weight_gradients_keep_the_weights_strides(backend, weight_format):
    """The convolution backward returns the input's memory format; a 1x1 shortcut weight's gradient came back
    channels-last for a contiguous weight (equal but for size-1 dims), which DDP's buckets warn about and copy."""
    x = torch.randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(6, 8, 3, 3).contiguous(memory_format=weight_format).requires_grad_()
    sw = torch.randn(6, 8, 1, 1).contiguous(memory_format=weight_format).requires_grad_()
    gw, gb, b = torch.randn(8) * 0.5 + 1, torch.randn(8) * 0.5, torch.randn(6)
    with ldmopt.use_backend(backend):
        y = gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 1, shortcut=(x, sw, None))
    y.backward(torch.randn_like(y))
    assert w.grad.stride() == w.stride() and sw.grad.stride() == sw.stride(), (w.grad.stride(), sw.grad.stride())
