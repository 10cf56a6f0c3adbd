"""The GPUs' placements with ldmopt._C's passes, end to end on the CPU: under "cublas", ops.linear, ops.geglu, the
linear with the next norm's statistics and the LayerNorm GEMMs run PyTorch's GEMM, then their passes through the cuda
backends of ``linear_epilogue`` and ``layer_norm_apply``; under "cudnn", the fused convs take their GroupNorm
statistics and apply it through the cuda backends of ``gn_conv2d_stats`` and ``group_norm_apply`` (an up block's two
parts too), run PyTorch's conv, then the cuda backend of ``conv_epilogue``. The C++ ops are stood in for by the
fiber emulator running the same kernels (tests/csrc/emulator.py). So the Python wiring (argument order, in-place
writes, the statistics buffers, the refusals that let the C++ ops run) is checked against the unfused modules and a
whole stock UNet, as a GPU would run it."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks.count_launches import checked_by_cpp
from ldmopt import _env, ops
from ldmopt.ops import conv_epilogue as conv_module
from ldmopt.ops import gn_conv2d_prologue, linear_cublas
from ldmopt.ops import gn_conv2d_stats as gn_stats_module
from ldmopt.ops import layer_norm_apply as apply_module
from ldmopt.ops import linear_epilogue as epilogue_module
from ldmopt.ops._dispatch import backend_counts
from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

adaln_module = importlib.import_module("ldmopt.ops.adaln_modulate")  # (ldmopt.ops.adaln_modulate is the function)
pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))


@pytest.mark.skipif(not _env.cuda_extension_status()[0], reason="ldmopt._C is not built")
def test_the_standins_refuse_what_the_cpp_op_refuses():
    x = torch.randn(2, 16, 3, 3)[:, ::2]  # channels strided: neither contiguous nor channels-last
    standin = checked_by_cpp("group_norm_stats_cuda", lambda *args: pytest.fail("the stand-in ran"))
    with pytest.raises(RuntimeError, match="contiguous or channels-last"):
        standin(x, 2, 1e-5)


@pytest.fixture
def emulated_cuda(emu, monkeypatch):
    """The cuda backends of the two passes accept CPU tensors and run the emulated kernels; the GEMM placement is
    "cublas" and the conv placement "cudnn" (on CPU, PyTorch's GEMM and conv). Yields a function returning the (op,
    backend) calls counted since."""

    def linear_epilogue_cuda(z, y, gate, residual, stats, activation, glu, saturate, write, eps):
        _, got = emu.linear_epilogue(z, activation or None, gate, residual, glu=glu, saturate=saturate,
                                     y=y if write else None, stats=stats is not None, eps=eps, write=write)  # fmt: skip
        if stats is not None:
            stats.copy_(got)

    def layer_norm_apply_cuda(x, stats, weight, bias, positions, position_rows):
        return emu.layer_norm_apply(x, stats, weight, bias, positions, position_rows)

    def conv_epilogue_cuda(z, shortcut, residual, temb, gate, inv_scale, write, groups, channel_sums, eps):
        return emu.conv_epilogue(z, shortcut, residual, temb, gate, inv_scale=inv_scale, write=write, groups=groups,
                                 channel_sums=channel_sums, eps=eps)  # fmt: skip

    def group_norm_apply_cuda(x, mean, rstd, weight, bias, groups, activation, x_tail=None):
        if x_tail is None:
            return emu.group_norm_apply(x, mean, rstd, weight, bias, groups, activation)
        return emu.group_norm_apply_parts(x, x_tail, mean, rstd, weight, bias, groups, activation)

    def group_norm_stats_cuda(x, groups, eps, x_tail=None):
        if x_tail is None:
            return emu.group_norm_stats(x, groups, eps)
        return emu.group_norm_stats_parts(x, x_tail, groups, eps)

    # group_norm_apply's cuda refusals are gn_conv2d_stats' (cuda_one_part_refusals, cuda_two_part_refusals)
    for module in (epilogue_module, apply_module, conv_module, gn_stats_module, adaln_module):
        monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])
    standins = {
        "adaln_modulate_cuda": emu.adaln_modulate,
        "group_norm_apply_cuda": group_norm_apply_cuda,
        "group_norm_stats_cuda": group_norm_stats_cuda,
        "linear_epilogue_cuda": linear_epilogue_cuda,
        "layer_norm_apply_cuda": layer_norm_apply_cuda,
        "conv_epilogue_cuda": conv_epilogue_cuda,
    }
    for name, standin in standins.items():
        monkeypatch.setattr(torch.ops.ldmopt, name, checked_by_cpp(name, standin), raising=False)
    before = dict(backend_counts)
    with linear_cublas.forced("cublas"), gn_conv2d_prologue.forced("cudnn"), ldmopt.use_backend("auto"):
        yield lambda: {k: v - before.get(k, 0) for k, v in backend_counts.items() if v != before.get(k, 0)}


def _inputs(m, k, n, dtype):
    x = torch.randn(2, m, k, dtype=torch.float64).to(dtype)
    w = (torch.randn(n, k, dtype=torch.float64) * k**-0.5).to(dtype)
    b = (torch.randn(n, dtype=torch.float64) * 0.5).to(dtype)
    return x, w, b


def _check(y, reference, inputs, name):
    assert_within_torch_error(y, reference(*[t.double() for t in inputs]), reference(*inputs), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_linear_gelu_tanh_gated_residual_and_geglu(emulated_cuda, dtype):
    x, w, b = _inputs(37, 40, 72, dtype)
    gate = torch.randn(2, 72, dtype=dtype)
    residual = torch.randn(2, 37, 72, dtype=dtype)
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="gelu_tanh", gate=gate, residual=residual)
        _check(y, lambda x, w, b, g, r: r + g[:, None] * F.gelu(F.linear(x, w, b), approximate="tanh"),
               (x, w, b, gate, residual), "gated residual")  # fmt: skip
        wg, bg = torch.cat([w, w.flip(0)]), torch.cat([b, b.flip(0)])
        y = ops.geglu(x, wg, bg)
        _check(y, lambda x, w, b: (lambda h, g: h * F.gelu(g))(*F.linear(x, w, b).chunk(2, -1)), (x, wg, bg), "geglu")
    assert emulated_cuda() == {("linear", "triton"): 1, ("geglu", "triton"): 1, ("linear_epilogue", "cuda"): 2}


def test_linear_with_the_next_norms_statistics(emulated_cuda):
    x, w, b = _inputs(15, 40, 24, torch.float16)
    residual = torch.randn(2, 15, 24, dtype=torch.float16)
    with torch.no_grad():
        y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=1e-5)
        y_alone, stats_alone = ops.linear(x, w, b, next_norm_eps=1e-6)  # only reads the GEMM's output
    for out, st, eps in ((y, stats, 1e-5), (y_alone, stats_alone, 1e-6)):
        rows = out.double().reshape(-1, 24)
        assert_close(st[0], rows.mean(1), torch.float32, "mean")
        assert_close(st[1], torch.rsqrt(rows.var(1, unbiased=False) + eps), torch.float32, "rstd")
    torch.testing.assert_close(y_alone, F.linear(x, w, b), rtol=0, atol=0)
    assert emulated_cuda()[("linear_epilogue", "cuda")] == 2


@pytest.mark.parametrize("act", [None, "gelu", "geglu"])
def test_layer_norm_gemms_apply_the_norm_through_the_cuda_kernel(emulated_cuda, act):
    """tests/ops/test_linear_cublas.py's check of the LayerNorm GEMMs, with the norm applied by the C++ kernel."""
    from tests.ops.test_linear_cublas import test_layer_norm_gemms_apply_the_norm_first as same_check

    linear_cublas.placement_counts.clear()
    same_check(linear_cublas.placement_counts, act, torch.float16)
    assert emulated_cuda()[("layer_norm_apply", "cuda")] == 1
    assert emulated_cuda().get(("linear_epilogue", "cuda"), 0) == (act is not None)


def test_inputs_the_cuda_kernels_refuse_take_the_triton_pass(emulated_cuda):
    """A residual in another dtype than the GEMM output (fp32 stream, fp16 GEMM) goes to the Triton pass, with the
    output promoted as PyTorch promotes it."""
    x, w, b = _inputs(9, 40, 24, torch.float16)
    residual = torch.randn(2, 9, 24)
    with torch.no_grad():
        y = ops.linear(x, w, b, residual=residual)
    assert y.dtype == torch.float32
    _check(y, lambda x, w, b, r: r + F.linear(x, w, b), (x, w, b, residual), "promoted")
    assert emulated_cuda() == {("linear", "triton"): 1, ("linear_epilogue", "triton"): 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_convs_through_the_cuda_epilogue(emulated_cuda, dtype):
    """A resnet's conv1 (temb, the next GroupNorm's statistics) and conv2 (1x1 shortcut, output scale, channel sums)
    through ops.gn_silu_conv2d: PyTorch's conv, then the emulated C++ pass, against the unfused composition."""
    n, c_in, c_out, h, w = 2, 40, 72, 9, 7
    x = _cl(torch.randn(n, c_in, h, w, dtype=torch.float64).to(dtype))
    gw, gb = (torch.rand(c_in) + 0.5).to(dtype), (torch.randn(c_in) * 0.3).to(dtype)
    cw = _cl((torch.randn(c_out, c_in, 3, 3, dtype=torch.float64) / (9 * c_in) ** 0.5).to(dtype))
    cb, temb = torch.randn(c_out).to(dtype), torch.randn(n, c_out).to(dtype)

    def conv1(x, gw, gb, cw, cb, temb):
        return F.conv2d(F.silu(F.group_norm(x, 8, gw, gb, 1e-5)), cw, cb, padding=1) + temb[:, :, None, None]

    with torch.no_grad():
        y, (mean, rstd) = ops.gn_silu_conv2d(x, gw, gb, 8, 1e-5, cw, cb, temb=temb, out_stats=(8, 1e-6))
        _check(y, conv1, (x, gw, gb, cw, cb, temb), "conv1")
        var, m = torch.var_mean(y.double().reshape(n, 8, -1), dim=2, unbiased=False)
        assert_close(mean, m, torch.float32, "mean")
        assert_close(rstd, torch.rsqrt(var + 1e-6), torch.float32, "rstd")
        sw, sb = (torch.randn(c_out, c_in, 1, 1) / c_in**0.5).to(dtype), torch.randn(c_out).to(dtype)
        cw2 = _cl((torch.randn(c_out, c_out, 3, 3, dtype=torch.float64) / (9 * c_out) ** 0.5).to(dtype))
        gw2, gb2 = (torch.rand(c_out) + 0.5).to(dtype), (torch.randn(c_out) * 0.3).to(dtype)
        y2 = ops.gn_silu_conv2d(y, gw2, gb2, 8, 1e-5, cw2, cb, shortcut=(x, sw, sb), output_scale=1.5)

        def conv2(y, gw2, gb2, cw2, cb, x, sw, sb):
            h = F.conv2d(F.silu(F.group_norm(y, 8, gw2, gb2, 1e-5)), cw2, cb, padding=1)
            return (F.conv2d(x, sw, sb) + h) / 1.5

        _check(y2, conv2, (y, gw2, gb2, cw2, cb, x, sw, sb), "conv2")
    assert emulated_cuda()[("conv_epilogue", "cuda")] == 2


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def test_whole_sd_unet_through_the_cuda_passes_matches_stock(emulated_cuda):
    """The zoo's tiny SD1.5 UNet, patched, channels-last, as a GPU runs it by default: every fused conv through
    cuDNN's place and the C++ conv epilogue, every fused GEMM through the C++ linear passes; against the stock UNet."""
    from ldmopt.configs import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model("sd15", device="cpu", dtype=torch.float32, tiny=True).to(memory_format=torch.channels_last)
    inputs = example_inputs(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # zero-initialised output projections too
        stock = model(**inputs.kwargs)[0]
        ldmopt.patch(model)
        for _ in range(2):  # the second call hands statistics between blocks
            fused = model(**inputs.kwargs)[0]
    rel = ((fused - stock).abs().max() / stock.abs().max()).item()
    assert rel < 1e-4, rel
    calls = emulated_cuda()
    assert calls[("conv_epilogue", "cuda")] > 0 and calls[("linear_epilogue", "cuda")] > 0, calls
    assert calls[("layer_norm_apply", "cuda")] > 0, calls
    # the staged GroupNorms, the up blocks' (hidden, skip) pairs read in two parts
    assert calls[("group_norm_apply", "cuda")] > 0 and ("group_norm_apply", "triton") not in calls, calls


def test_whole_svd_unet_through_the_cuda_passes_matches_stock(emulated_cuda):
    """The zoo's tiny SVD UNet: its temporal convs hand the epilogue a time embedding and an fp32 blend gate per frame,
    which the C++ pass now applies (they took the Triton pass before); against the stock UNet."""
    from ldmopt.configs import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model("svd", device="cpu", dtype=torch.float32, tiny=True, frames=3)
    inputs = example_inputs(model, frames=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        stock = model(**inputs.kwargs)[0]
        report = ldmopt.patch(model)
        assert report.counts().get("spatiotemporal_resnet", 0) > 0, report
        for _ in range(2):
            fused = model(**inputs.kwargs)[0]
    rel = ((fused - stock).abs().max() / stock.abs().max()).item()
    assert rel < 1e-4, rel
    calls = emulated_cuda()
    assert ("conv_epilogue", "triton") not in calls and calls[("conv_epilogue", "cuda")] > 0, calls


def test_whole_dit_through_the_cuda_passes_matches_stock(emulated_cuda):
    """The zoo's tiny DiT, patched, as a GPU with ldmopt._C runs it: every adaLN norm through the C++ modulation
    kernel, every fused GEMM through cuBLAS's place and the C++ linear epilogue; against the stock model."""
    from ldmopt.configs import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model("dit", device="cpu", dtype=torch.float32, tiny=True)
    inputs = example_inputs(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the zero-initialised adaLN modulation and output layers too
        stock = model(**inputs.kwargs)[0]
        ldmopt.patch(model)
        fused = model(**inputs.kwargs)[0]
    rel = ((fused - stock).abs().max() / stock.abs().max()).item()
    assert rel < 1e-4, rel
    calls = emulated_cuda()
    assert calls[("adaln_modulate", "cuda")] > 0 and ("adaln_modulate", "triton") not in calls, calls
    assert calls[("linear_epilogue", "cuda")] > 0, calls


@pytest.mark.parametrize("gated", [False, True], ids=["residual", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_adaln_gradients_through_the_cuda_forward(emulated_cuda, gated, dtype):
    """Training through the adaLN norm whose forward ran ldmopt._C's kernel (emulated): what its autograd saves (the
    stored sum, the row statistics) gives the gradients of x, the residual and the modulation the reference's
    autograd gives."""
    from ldmopt.ops.adaln_modulate import adaln_modulate

    b, t, c = 2, 5, 40
    x0, res0 = (torch.randn(b, t, c, dtype=torch.float64).to(dtype) for _ in range(2))
    emb0 = torch.randn(b, 3 * c, dtype=torch.float64) * 0.3
    dy = torch.randn(b, t, c, dtype=torch.float64)
    grads = {}
    for backend in ("auto", "torch"):
        x, res, emb = (v.clone().requires_grad_() for v in (x0, res0, emb0))
        scale, shift, gate = emb.float().chunk(3, dim=1)
        with ldmopt.use_backend(backend):
            y, s = adaln_modulate(x, scale, shift, residual=res, gate=gate if gated else None, return_residual=True)
            ((y.double() * dy).sum() + s.double().sum()).backward()
        grads[backend] = (y, x.grad, res.grad, emb.grad)
    assert emulated_cuda()[("adaln_modulate", "cuda")] == 1  # the auto pass's forward ran the C++ kernel
    for name, got, expect in zip(("y", "dx", "dresidual", "demb"), grads["auto"], grads["torch"]):
        assert_close(got, expect.to(got.dtype), dtype if got.dtype != torch.float64 else torch.float32, name)
