"""ldmopt.patch with what else a diffusers user does to a model: torch.compile(fullgraph=True), PEFT LoRA adapters,
fused QKV projections (fuse before or after patching, unfuse), Transformer2D inner widths other than its input's."""

import contextlib

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import ldmopt
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, assert_same_snapshot, snapshot

from .test_patch_api import _run


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_compile_fullgraph_patched_unet(backend):
    """Also with the backend chosen automatically: the up blocks' fused resnets ask in traced Python code whether
    Triton can run, which once imported triton under Dynamo (an import cannot be traced)."""
    unet = models.sd15_unet().eval().to(memory_format=torch.channels_last)
    x = models.inputs("sd15", unet, batch=1)  # one image: the "auto" case runs every kernel in the interpreter
    x["sample"] = x["sample"].to(memory_format=torch.channels_last)
    ref = _run(unet, x)
    report = ldmopt.patch(unet)
    assert report.counts()["resnet"] > 0
    torch._dynamo.reset()
    # aot_eager traces the whole graph as inductor does (fullgraph=True fails on any graph break) without the C++
    # compile; the custom ops stay opaque nodes.
    compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")
    with ldmopt.use_backend(backend) if backend != "auto" else contextlib.nullcontext():
        out = _run(compiled, x)
    assert_outputs_close(out, ref, name="compiled")
    # The fused paths ran, inside the compiled graph (on the CPU the automatic choice is the interpreted Triton).
    assert not [r for r in report.fallbacks() if "ran the reference backend" not in r], report.fallbacks()
    calls = 2 * report.counts()["resnet"] + report.counts()["transformer2d_in"] + report.counts()["upsample_conv"]
    assert sum(report.backends()["gn_conv2d"].values()) == calls
    if backend == "torch":
        assert report.backends()["gn_conv2d"] == {"torch": calls}


def test_a_compiled_patched_unet_is_not_retraced_by_repeated_or_eager_calls():
    # Traced code read the thread's pending statistics offer before seeing it was being traced: an eager call of the
    # same model (validation, another pipeline), which leaves an offer, then failed the compiled graph's guard.
    unet = models.sd15_unet().eval().to(memory_format=torch.channels_last)
    x = models.inputs("sd15", unet, batch=1)
    x["sample"] = x["sample"].to(memory_format=torch.channels_last)
    ldmopt.patch(unet)
    graphs = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(unet, fullgraph=True, backend=graphs)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        for call in (compiled, compiled, unet, compiled, unet, compiled):
            _run(call, x)
    assert graphs.frame_count == 1


@pytest.mark.parametrize("family", ["animatediff", "dit"])
def test_compile_fullgraph_temporal_and_adaln(family):
    # Token-order temporal containers (AnimateDiff) and class-swapped adaLN blocks (DiT) trace without graph breaks.
    model = models.BUILDERS[family]().eval()
    x = models.inputs(family, model)
    ref = _run(model, x)
    report = ldmopt.patch(model)
    assert report.counts().get("temporal_container" if family == "animatediff" else "adaln_block")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(compiled, x), ref, name=f"compiled {family}")
    assert not [r for r in report.fallbacks() if "processor" in r or "diffusers' forward" in r], report.fallbacks()


def test_lora_unet_patched_keeps_lora():
    from peft import LoraConfig

    unet = models.sd15_unet().eval()
    unet.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "proj"]))
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # non-zero so the LoRA changes the output
    x = models.inputs("sd15", unet)
    ref = _run(unet, x)
    unet.disable_adapters()
    without = _run(unet, x)
    unet.enable_adapters()
    assert (ref - without).abs().max() > 1e-3
    report = ldmopt.patch(unet)
    assert report.total > 0
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(unet, x), ref, name="lora")
    # Rules that would bypass a LoRA layer leave that module stock and say why; the rest still apply.
    lora_rules = {s.rule for s in report.skipped if any("PEFT/LoRA" in r or "LoraLayer" in r for r in s.reasons)}
    assert lora_rules == {"resnet", "geglu"}, report.skipped
    # Once each: the generic guard names the LoRA child, and the rule does not restate it in other words.
    for skipped in report.skipped:
        if any("PEFT/LoRA layer" in r for r in skipped.reasons):
            assert all("PEFT/LoRA layer" in r for r in skipped.reasons), skipped
            assert len(set(skipped.reasons)) == len(skipped.reasons), skipped
    assert report.counts()["group_norm"] > 0  # resnet norms, now not claimed by the resnet rule
    ldmopt.unpatch(unet)
    assert torch.equal(_run(unet, x), ref)


@pytest.mark.parametrize("order", ["fuse_then_patch", "patch_then_fuse"])
def test_fuse_qkv_projections_interplay(order):
    # AnimateDiff: spatial attention, and motion modules that ldmopt runs in token order (reading a fused to_qkv).
    unet = models.animatediff().eval()
    x = models.inputs("animatediff", unet)
    ref = _run(unet, x)
    if order == "fuse_then_patch":
        unet.fuse_qkv_projections()
        before = snapshot(unet)
        report = ldmopt.patch(unet)
        assert report.counts()["temporal_container"] == 7
    else:
        before = snapshot(unet)
        report = ldmopt.patch(unet)
        unet.fuse_qkv_projections()  # replaces every processor, ldmopt's included
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(unet, x), ref, name=order)
    # Fused or not, the motion modules ran in token order on the temporal kernel every call.
    assert not [r for r in report.fallbacks() if "diffusers' forward" in r or "processor" in r], report.fallbacks()
    assert report.backends()["temporal_attention"] == {"torch": 14}
    if order == "patch_then_fuse":
        unet.unfuse_qkv_projections()
    ldmopt.unpatch(unet)
    after = snapshot(unet)
    if order == "fuse_then_patch":
        assert_same_snapshot(before, after)
    else:  # the projections stay fused (diffusers keeps to_qkv), the processors are the stock ones again
        assert after["processors"] == before["processors"]
    assert torch.allclose(_run(unet, x), ref, atol=1e-5)


def test_patch_after_unfuse_reads_the_unfused_projections():
    # unfuse_qkv_projections restores the stock processors but leaves fused_projections and to_qkv: after a weight
    # change (a training step) only to_q/to_k/to_v are current, and the motion modules in token order must read them.
    unet = models.animatediff().eval()
    x = models.inputs("animatediff", unet)
    unet.fuse_qkv_projections()
    unet.unfuse_qkv_projections()
    with torch.no_grad():
        for name, module in unet.named_modules():
            if name.endswith("attn1.to_q"):
                module.weight.mul_(1.5)
    ref = _run(unet, x)
    report = ldmopt.patch(unet)
    assert report.counts()["temporal_container"] == 7
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(unet, x), ref, name="after unfuse")
    assert report.backends()["temporal_attention"] == {"torch": 14}
    ldmopt.unpatch(unet)


@pytest.mark.parametrize("linear_projection", [False, True])
def test_transformer2d_inner_dim_other_than_in_channels(linear_projection):
    # proj_in maps 32 channels to 2 heads x 8 = 16: diffusers reshapes proj_out's output (32 channels) with the
    # *input* channel count in the linear-projection case, which the fused proj_in path must return likewise.
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    model = Transformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=32,
        norm_num_groups=8,
        cross_attention_dim=24,
        use_linear_projection=linear_projection,
    ).eval()
    x = {"hidden_states": torch.randn(2, 32, 5, 3), "encoder_hidden_states": torch.randn(2, 4, 24)}
    ref = _run(model, x)
    report = ldmopt.patch(model)
    assert report.counts()["transformer2d_in"] == 1
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(model, x), ref, name=f"linear_projection={linear_projection}")
