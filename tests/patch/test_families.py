"""Every family ldmopt.patch covers: tiny random-weight model, patched vs stock output, report counts, exact unpatch.

Reference tests use the zoo's tiny models (``ldmopt.configs.build_model(name, tiny=True)``: the real config with a
few channels) in channels-last, so the ResnetBlock2D and GroupNorm->conv paths run fused, on the reference backend
(``use_backend("torch")``). Interpreter tests run the Triton kernels on even smaller models (tests/patch/models.py)
for SD-UNet, DiT and AnimateDiff. Tolerances: tests/patch/helpers.py.
"""

import pytest
import torch

import ldmopt
from ldmopt.configs import build_model, example_inputs
from tests.patch import models
from tests.patch.helpers import (
    ATOL_TRITON,
    RTOL_TRITON,
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
)

UNET = dict(
    geglu=10,
    group_norm_silu=1,
    resnet=14,
    residual_block=10,
    transformer2d_in=10,
    up_block_skip=4,
    upsample_conv=3,
    downsample_conv=3,
)
SVD = dict(geglu=30, group_norm_silu=1, resnet=14, spatiotemporal_in=10, spatiotemporal_resnet=14, svd_attn2=10,
           up_block_skip=4, upsample_conv=3, downsample_conv=3)  # fmt: skip
SVD["residual_block"] = 10
SVD["svd_temporal_block"] = 10
SDXL = dict(geglu=11, group_norm_silu=1, resnet=11, residual_block=11, transformer2d_in=7, up_block_skip=3)
SDXL["upsample_conv"] = SDXL["downsample_conv"] = 2
FLUX = dict(adaln_continuous=1, adaln_zero=2, adaln_zero_single=2, flux_mlp=2, flux_single_gated=2, gelu=2)
# Modules replaced per rule, and modules left stock, on each zoo tiny model.
EXPECTED = {
    "sd15": (UNET, 0),
    "sd21": (UNET, 0),
    "sdxl": (SDXL, 0),
    # The decoder's ResnetBlock2D have time_embedding_norm="group" and no temb: fused like "default".
    "sd15-vae": (dict(group_norm=2, group_norm_silu=2, resnet=16, upsample_conv=3), 0),
    "dit": (dict(adaln_block=2, adaln_zero=2, gelu=2), 0),
    "pixart-alpha": (dict(adaln_block=2, gelu=2), 0),
    "sd3": (dict(adaln_continuous=2, adaln_zero=3, gelu=3, joint_block=2), 0),
    "flux": (dict(FLUX, joint_block=1, flux_qk_norm_rope=3), 0),
    # Video: the temporal containers/blocks run whole in (B, F, N, C) order (their attention modules are claimed
    # by temporal_container / svd_temporal_block, so temporal_attention installs no processor there; a container's
    # GroupNorm is read in proj_in's loads, so the group_norm rule leaves it alone).
    "animatediff": (dict(UNET, geglu=23, temporal_container=13), 0),
    "svd": (SVD, 0),
    "modelscope": (dict(UNET, geglu=21, temporal_conv=14, temporal_container=11), 0),
    "latte": (dict(adaln_block=2, gelu=4, latte_temporal=1), 0),
    "wan2.1-1.3b": (dict(gelu=2, wan_block=2, wan_qk_norm_rope=2), 0),
}
#: Families none of whose ResnetBlock2D may fall back to diffusers' forward.
ALL_RESNETS_FUSED = {"sd15", "sd21", "sdxl", "sd15-vae", "animatediff", "svd", "modelscope"}
VIDEO = {"animatediff", "svd", "modelscope"}  # Latte is small; its frame count is fixed at build


def channels_last(model, kwargs):
    for p in model.parameters():
        if p.dim() == 4:
            p.data = p.data.to(memory_format=torch.channels_last)
    return {
        k: v.to(memory_format=torch.channels_last) if isinstance(v, torch.Tensor) and v.dim() == 4 else v
        for k, v in kwargs.items()
    }


def _zoo(name):
    model = build_model(name, tiny=True, device="cpu", dtype=torch.float32)
    if name.endswith("vae"):  # encoder and decoder: the whole autoencoder
        return model, lambda **kw: model(**kw).sample, {"sample": torch.randn(1, 3, 32, 32)}
    # The default tiny resolution keeps every UNet level at least 2x2 (a 1x1 GroupNorm group of one channel has zero
    # variance, which amplifies rounding); 2 frames keep the video UNets fast.
    # SVD's context is one image-embedding token (the tiny default is a 7-token text context).
    tokens = 1 if name.startswith("svd") else None
    inputs = example_inputs(model, frames=2 if name in VIDEO else None, text_tokens=tokens)
    return model, model, inputs.kwargs


def _run(fn, kwargs):
    with torch.no_grad():
        return output_tensor(fn(**kwargs))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_family_reference_backend(name):
    model, fn, kwargs = _zoo(name)
    kwargs = channels_last(model, kwargs)
    ref = _run(fn, kwargs)
    before = snapshot(model)
    report = ldmopt.patch(model)
    counts, n_skipped = EXPECTED[name]
    assert report.counts() == counts
    assert len(report.skipped) == n_skipped
    with ldmopt.use_backend("torch"):
        out = _run(fn, kwargs)
    assert_outputs_close(out, ref, name=name)
    assert not [r for r in report.fallbacks() if "processor" in r], report.fallbacks()
    if name in ALL_RESNETS_FUSED:
        assert not [r for r in report.fallbacks() if r.startswith("ResnetBlock2D")], report.fallbacks()
    # Channels-last in, channels-last all the way: no patched module copies its input to another layout (the
    # video containers keep channels-last on the way out; diffusers' own hand NCHW tensors on).
    assert not report.layout_copies(), report.layout_copies()
    assert ldmopt.unpatch(model) == report.total
    assert_same_snapshot(before, snapshot(model))
    assert torch.equal(_run(fn, kwargs), ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,backend",
    [
        ("sd15", "triton"),
        ("dit", "triton"),
        # The motion modules run in token order and keep channels-last: every op takes its Triton kernel.
        ("animatediff", "triton"),
    ],
)
def test_family_triton_interpreter(family, backend):
    model = models.BUILDERS[family]().eval()
    kwargs = channels_last(model, models.inputs(family, model, batch=1, frames=2))
    ref = _run(model, kwargs)
    report = ldmopt.patch(model)
    with ldmopt.use_backend(backend):
        out = _run(model, kwargs)
    assert_outputs_close(out, ref, ATOL_TRITON, RTOL_TRITON, name=f"{family} triton")
    ran = report.backends()
    # Every fused op ran its Triton kernel (in the interpreter) at least once.
    assert ran and all(per.get("triton", 0) > 0 for per in ran.values()), ran
    if backend == "triton":
        assert all(set(per) == {"triton"} for per in ran.values()), ran


def test_sd35_dual_attention_joint_block():
    # SD3.5's dual-attention blocks (a second self-attention in the image stream; norm1 is SD35AdaLayerNormZeroX).
    model = models.sd35().eval()
    kwargs = models.inputs("sd3", model)
    ref = _run(model, kwargs)
    report = ldmopt.patch(model)
    # rms_norm: the query/key norms (rms_norm qk_norm) of the joint and the second attention of both blocks.
    assert report.counts() == dict(adaln_continuous=2, adaln_zero=2, gelu=3, joint_block=2, rms_norm=10)
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(model, kwargs), ref, name="sd3.5")


@pytest.mark.parametrize("name,processors", [("animatediff", 26), ("svd", 10), ("modelscope", 22)])
def test_temporal_attention_alone_the_measured_video_recommendation(name, processors):
    # The README's advice for video models (the processor alone measured fastest on an H200, 2026-12-04): only the
    # temporal attention modules (both attn1 and attn2 of a motion block) get ldmopt's processor; the rest stays stock.
    model, fn, kwargs = _zoo(name)
    ref = _run(fn, kwargs)
    before = snapshot(model)
    report = ldmopt.patch(model, families=("temporal_attention",))
    assert report.families == ("temporal_attention",)
    assert report.counts() == {"temporal_attention": processors}, report.counts()
    with ldmopt.use_backend("torch"):
        out = _run(fn, kwargs)
    assert_outputs_close(out, ref, name=name)
    assert not [r for r in report.fallbacks() if "processor" in r], report.fallbacks()
    assert ldmopt.unpatch(model) == report.total
    assert_same_snapshot(before, snapshot(model))
