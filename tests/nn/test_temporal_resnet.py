"""ldmopt.nn.temporal_resnet and its patch rules against diffusers' own SpatioTemporalResBlock (SVD) and
TemporalConvLayer (UNet3D), Triton interpreter.

Rule: against diffusers' block run in fp64, the fused block's error is at most 2x the error diffusers itself makes in
the same dtype. Random weights with non-trivial GroupNorm affine and blend factor; odd frame counts and sizes; an
image-only frame (SVD's ``image_only_indicator``) in the batch.
"""

import copy

import pytest
import torch

import ldmopt
from ldmopt.nn import child_check, temporal_resnet
from ldmopt.nn.temporal_resnet import fused_spatiotemporal_forward, fused_temporal_conv_forward
from tests.tolerances import assert_close, assert_within_torch_error

resnet_mod = pytest.importorskip("diffusers.models.resnet")

DTYPES = [torch.float32, torch.float16]
BATCH, FRAMES, H, W = 2, 3, 5, 3
C = 96  # diffusers' temporal resnet has 32 groups: 3 channels each


def _randomize(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("mix_factor"):
                p.normal_(0.0, 1.0)
            elif ("norm" in name and name.endswith("weight")) or ".0.weight" in name:
                p.normal_(1.0, 0.4)  # GroupNorm scale (named norm*, or element 0 of a TemporalConvLayer stage)
            else:
                p.normal_(0.0, 0.3)
    return module.eval()


def _svd_block(strategy="learned_with_images", temb=True, switch=False):
    block = resnet_mod.SpatioTemporalResBlock(
        C, C, temb_channels=16 if temb else None, eps=1e-6, merge_factor=0.3, merge_strategy=strategy,
        switch_spatial_to_temporal_mix=switch,
    )  # fmt: skip
    return _randomize(block)


def _svd_inputs(dtype, temb=True):
    x = torch.randn(BATCH * FRAMES, C, H, W, dtype=torch.float64).to(dtype)
    t = torch.randn(BATCH * FRAMES, 16, dtype=torch.float64).to(dtype) if temb else None
    indicator = torch.zeros(BATCH, FRAMES)
    indicator[1, 0] = 1.0  # an image-only frame: alpha = 1 there
    return x.contiguous(memory_format=torch.channels_last), t, indicator


def _stock(block, dtype, *args):
    ref = copy.deepcopy(block).to(dtype)
    with torch.no_grad():
        return ref(*[a.to(dtype) if (torch.is_tensor(a) and a.is_floating_point() and a.dim() > 2) or (
            torch.is_tensor(a) and a.dim() == 2 and a.shape[1] == 16) else a for a in args])  # fmt: skip


@pytest.mark.parametrize(
    "strategy,temb,switch", [("learned_with_images", True, False), ("learned", False, True), ("fixed", True, False)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_spatiotemporal_block_matches_diffusers(strategy, temb, switch, dtype):
    block = _svd_block(strategy, temb, switch)
    x, t, indicator = _svd_inputs(dtype, temb)
    ref = _stock(block, torch.float64, x.double(), None if t is None else t.double(), indicator)
    # fp16: diffusers' block in fp32 math (CPU has no fp16 Conv3d) on the weights rounded to fp16 as ours are, so that
    # PyTorch's error counts the weights' rounding too (with fp32 weights it did not, and seed 226861244 failed).
    lowp = _stock(block, dtype, x, t, indicator) if dtype == torch.float32 else (
        _stock(copy.deepcopy(block).to(dtype), torch.float32, x.float(), None if t is None else t.float(),
               indicator).to(dtype)
    )  # fmt: skip
    ours_block = copy.deepcopy(block).to(dtype)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = fused_spatiotemporal_forward(ours_block, x, t, indicator)
    assert out.shape == ref.shape and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(out, ref, lowp, f"SpatioTemporalResBlock {strategy} {dtype}")


def test_spatiotemporal_backward_matches_diffusers_with_blend_factor_gradient():
    block = _svd_block()
    block.train()  # dropout p=0: the fused path still runs
    x, t, indicator = _svd_inputs(torch.float32)
    dy = torch.randn(BATCH * FRAMES, C, H, W)
    grads, blended = {}, {}
    for name in ("ours", "ref", "lowp"):
        b = copy.deepcopy(block).to(torch.float64 if name == "ref" else torch.float32)
        xi = (x.double() if name == "ref" else x.clone()).requires_grad_()
        ti = (t.double() if name == "ref" else t.clone()).requires_grad_()
        if name == "ours":
            with ldmopt.use_backend("triton"):
                out = fused_spatiotemporal_forward(b, xi, ti, indicator)
        else:
            # The fp64 run's blend inputs (batch, channels, frames, H, W) size the blend factor's rounding below.
            b.time_mixer.register_forward_pre_hook(
                lambda m, args, kwargs, tag=name: blended.update({tag: (kwargs["x_spatial"], kwargs["x_temporal"])}),
                with_kwargs=True,
            )
            out = b(xi, ti, indicator)
        out.backward(dy.to(out.dtype))
        grads[name] = {"x": xi.grad, "temb": ti.grad, **{k: p.grad for k, p in b.named_parameters()}}
    assert grads["ours"]["time_mixer.mix_factor"].abs().item() > 0
    for key, ref in grads["ref"].items():
        if key == "time_mixer.mix_factor":
            # sigmoid'(m) * sum(dy * (spatial - temporal)) over the whole output, with heavy cancellation (terms'
            # magnitudes sum to hundreds of times the result): PyTorch's own error on it is luck of the summation
            # order (seen: 4 ulps on one seed, 47 ulps of ours on another). Bound it the way a dot product's forward
            # error is bounded: eps times the sum of the terms' magnitudes, fp32 errors in both blend inputs included.
            spatial, temporal = blended["ref"]
            dy_blend = dy.double().reshape(BATCH, FRAMES, C, H, W).permute(0, 2, 1, 3, 4)
            sigmoid = torch.sigmoid(block.time_mixer.mix_factor.detach().double())
            magnitude = (sigmoid * (1 - sigmoid) * (dy_blend.abs() * (spatial.abs() + temporal.abs())).sum()).item()
            error = (grads["ours"][key].double() - ref).abs().item()
            assert error <= torch.finfo(torch.float32).eps * magnitude, (error, ref.item(), magnitude)
            continue
        assert_within_torch_error(grads["ours"][key], ref, grads["lowp"][key], f"d{key}")


def _temporal_conv_layer():
    layer = _randomize(resnet_mod.TemporalConvLayer(C, C, norm_num_groups=12))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_temporal_conv_layer_matches_diffusers(dtype):
    layer = _temporal_conv_layer()
    x = torch.randn(BATCH * FRAMES, C, H, W, dtype=torch.float64)
    with torch.no_grad():
        ref = copy.deepcopy(layer).double()(x, FRAMES)
        lowp = copy.deepcopy(layer).float()(x.float(), FRAMES).to(dtype)
        xin = x.to(dtype).contiguous(memory_format=torch.channels_last)
        with ldmopt.use_backend("triton"):
            out = fused_temporal_conv_forward(copy.deepcopy(layer).to(dtype), xin, FRAMES)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype
    assert_within_torch_error(out, ref, lowp, f"TemporalConvLayer {dtype}")


def test_temporal_conv_layer_gradients_match_diffusers():
    layer = _temporal_conv_layer().train()
    x = torch.randn(BATCH * FRAMES, C, H, W).contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    grads = {}
    for name in ("ours", "ref", "lowp"):
        mod = copy.deepcopy(layer).to(torch.float64 if name == "ref" else torch.float32)
        xi = (x.double() if name == "ref" else x.clone()).requires_grad_()
        with ldmopt.use_backend("triton"):
            out = fused_temporal_conv_forward(mod, xi, FRAMES) if name == "ours" else mod(xi, FRAMES)
        out.backward(dy.to(out.dtype))
        grads[name] = {"x": xi.grad, **{k: p.grad for k, p in mod.named_parameters()}}
    for key, ref in grads["ref"].items():
        assert_within_torch_error(grads["ours"][key], ref, grads["lowp"][key], f"d{key}")


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_temporal_conv_weights_are_read_as_views(layout):
    # The (3, 1, 1) Conv3d weights go to the 2-D conv as views whose backward is a view too (a select's backward
    # would zero-fill and copy each weight's gradient), and each gradient arrives in its weight's own layout (strides
    # of size-1 dims aside, as AccumulateGrad's layout contract has it: no copy into the weight's layout).
    from benchmarks.count_backward_ops import OpCounter

    layer = _temporal_conv_layer().train()
    for conv in (layer.conv1[-1], layer.conv2[-1], layer.conv3[-1], layer.conv4[-1]):
        conv.weight.data = conv.weight.data.contiguous(memory_format=layout)
    x = torch.randn(BATCH * FRAMES, C, H, W).contiguous(memory_format=torch.channels_last).requires_grad_()
    with ldmopt.use_backend("torch"):
        out = fused_temporal_conv_forward(layer, x, FRAMES)
    counter = OpCounter()
    with counter:
        out.backward(torch.randn_like(out))
    assert counter.counts["aten.select_backward"] == 0, counter.counts
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        significant = [(g, s) for g, s, n in zip(p.grad.stride(), p.stride(), p.shape) if n > 1]
        assert all(g == s for g, s in significant), (name, p.grad.stride(), p.stride())


def test_patch_reports_and_unpatch_restores():
    model = torch.nn.ModuleDict({"res": _svd_block(), "conv": _temporal_conv_layer()})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = ldmopt.patch(model)
    assert report.counts() == {"resnet": 1, "spatiotemporal_resnet": 1, "temporal_conv": 1}
    assert set(model.state_dict()) == set(state)
    x, t, indicator = _svd_inputs(torch.float32)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = model["res"](x, t, indicator)
        out2 = model["conv"](out, FRAMES)
    assert not child_check.fallback_reasons, child_check.fallback_reasons
    assert not report.layout_copies()
    ldmopt.unpatch(model)
    assert type(model["res"]) is resnet_mod.SpatioTemporalResBlock
    assert type(model["conv"]) is resnet_mod.TemporalConvLayer
    with torch.no_grad():
        ref = model["res"](x, t, indicator)
        ref2 = model["conv"](ref, FRAMES)
    assert_close(out, ref.double(), torch.float32, "patched block")
    assert_close(out2, ref2.double(), torch.float32, "patched temporal conv")


def test_runtime_fallbacks_are_counted_and_match_diffusers():
    block = _svd_block()
    x, t, indicator = _svd_inputs(torch.float32)
    child_check.fallback_reasons.clear()
    # fp64 input, fp32 weights: diffusers' forward runs, and raises as it does unpatched.
    with torch.no_grad(), pytest.raises(RuntimeError, match="dtype"):
        fused_spatiotemporal_forward(block, x.double(), t.double(), indicator)
    assert any("input dtype torch.float64 differs" in r for r in child_check.fallback_reasons)
    layer = resnet_mod.TemporalConvLayer(C, C, dropout=0.1, norm_num_groups=12).train()
    x = torch.randn(BATCH * FRAMES, C, H, W).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.manual_seed(0)
        out = fused_temporal_conv_forward(layer, x, FRAMES)
        torch.manual_seed(0)
        assert torch.equal(out, layer(x, FRAMES))
    assert child_check.fallback_reasons["TemporalConvLayer ran the stock path: dropout p=0.1 in training mode"] == 3
    layer = _temporal_conv_layer()
    temporal_resnet.layout_conversions.clear()
    nchw = torch.randn(BATCH * FRAMES, C, H, W)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = fused_temporal_conv_forward(layer, nchw, FRAMES)
        ref = layer(nchw, FRAMES)
    assert temporal_resnet.layout_conversions["TemporalConvLayer: NCHW input converted to channels-last"] == 1
    assert_close(out, ref.double(), torch.float32, "converted input")


def test_unfusable_blocks_are_skipped_with_reasons():
    block = _svd_block()
    block.time_mixer.register_forward_hook(lambda *a: None)
    layer = _temporal_conv_layer()
    layer.conv2[3] = torch.nn.Conv3d(C, C, (3, 3, 3), padding=(1, 1, 1))
    report = ldmopt.patch(torch.nn.ModuleDict({"res": block, "conv": layer}))
    reasons = {s.rule: " ".join(s.reasons) for s in report.skipped}
    assert "time_mixer" in reasons["spatiotemporal_resnet"] and "hook" in reasons["spatiotemporal_resnet"]
    assert "conv2[-1] has (kernel, stride, padding" in reasons["temporal_conv"]


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    block = _svd_block()
    ldmopt.patch(block)
    x, t, indicator = _svd_inputs(torch.float32)
    with torch.no_grad():
        eager = block(x, t, indicator)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, t, indicator)
    assert_close(compiled, eager.double(), torch.float32, "compiled")


@pytest.mark.parametrize("shape", [(1, FRAMES), (FRAMES,)], ids=["1xF", "F"])
def test_broadcast_image_only_indicator_blends_as_diffusers(shape):
    block = _svd_block()
    x, t, _ = _svd_inputs(torch.float32)
    indicator = torch.zeros(shape)
    indicator.view(-1)[-1] = 1.0
    with torch.no_grad():
        ref = block(x, t, indicator)
        with ldmopt.use_backend("torch"):
            out = fused_spatiotemporal_forward(block, x, t, indicator)
    assert_close(out, ref.double(), torch.float32, f"indicator {shape}")


def test_indicator_that_does_not_broadcast_runs_diffusers_and_raises_as_it_does():
    block = _svd_block()
    x, t, _ = _svd_inputs(torch.float32)
    indicator = torch.zeros(BATCH + 1, FRAMES)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), pytest.raises(RuntimeError):
        fused_spatiotemporal_forward(block, x, t, indicator)
    assert any("does not broadcast" in r for r in child_check.fallback_reasons), child_check.fallback_reasons


def test_hooked_temporal_nonlinearity_keeps_the_block_stock():
    block = _svd_block()
    block.temporal_res_block.nonlinearity.register_forward_hook(lambda *a: None)
    report = ldmopt.patch(block)
    assert "spatiotemporal_resnet" not in report.counts()
    reasons = " ".join(r for s in report.skipped if s.rule == "spatiotemporal_resnet" for r in s.reasons)
    assert "temporal_res_block.nonlinearity" in reasons and "hook" in reasons, reasons


@pytest.mark.parametrize("which", ["svd", "unet3d"])
def test_autocast_adds_the_residual_in_its_own_dtype(which):
    """Under autocast diffusers blends (SVD) or adds the identity (UNet3D) in fp32 (fp32 + bf16 -> fp32): so does
    the fused path, instead of rounding the residual to bf16 in the epilogue. A large residual makes it plain."""
    if which == "svd":
        block = _svd_block()
        x, t, indicator = _svd_inputs(torch.float32)
        x, args = x * 20, (t, indicator)
        fused = fused_spatiotemporal_forward
    else:
        block = _temporal_conv_layer()
        x = (torch.randn(BATCH * FRAMES, C, H, W) * 20).contiguous(memory_format=torch.channels_last)
        args, fused = (FRAMES,), fused_temporal_conv_forward
    with torch.no_grad():
        exact = copy.deepcopy(block).double()(x.double(), *[a.double() if torch.is_tensor(a) else a for a in args])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stock = block(x, *args)
            with ldmopt.use_backend("torch"):
                out = fused(block, x, *args)
    assert out.dtype == stock.dtype == torch.float32
    stock_error = (stock.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * stock_error, which
