"""ldmopt.patch's ``up_block_skip`` rule: UNet up blocks hand their resnets (hidden, skip) instead of the
concatenation, which the fused resnet reads in place. Tiny random-weight SD1.5 / SDXL / AnimateDiff / ModelScope /
SVD UNets, the fused convs' Triton kernels in the interpreter (the reference backend for every other op), against
the stock model; the concatenation must not be dispatched at all."""

from __future__ import annotations

import pytest
import torch

import ldmopt
from ldmopt.nn import child_check
from ldmopt.nn import resnet as R
from ldmopt.patch.rules_up_block import UpBlockSkipRule
from tests.patch import models
from tests.patch.helpers import (
    ATOL_TRITON,
    RTOL_TRITON,
    DispatchedOps,
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
    triton_only_for,
)
from tests.patch.test_families import channels_last

FAMILIES = {
    "sd15": models.sd15_unet,
    "sdxl": models.sdxl_unet,
    "animatediff": models.animatediff,
    "modelscope": models.modelscope,
    "svd": models.svd,
}
VIDEO = {"animatediff", "modelscope", "svd"}  # 5-D samples go in as they are


def _model_and_inputs(family: str):
    model = FAMILIES[family]().eval()
    # one sample (two frames): every fused conv runs in the interpreter
    frames = {"frames": 2} if family in VIDEO else {}
    kwargs = models.inputs(family, model, batch=1, **frames)
    return model, channels_last(model, kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_up_blocks_match_stock_without_concatenating(family):
    model, kwargs = _model_and_inputs(family)
    before = snapshot(model)
    with torch.no_grad():
        expected = output_tensor(model(**kwargs))
        report = ldmopt.patch(model)
        assert report.counts().get("up_block_skip") == 2, report
        R.fallback_reasons.clear()
        child_check.fallback_reasons.clear()
        with triton_only_for("gn_silu_conv2d"), DispatchedOps() as ops:
            out = output_tensor(model(**kwargs))
    fallbacks = {**R.fallback_reasons, **child_check.fallback_reasons}
    assert not fallbacks, fallbacks
    assert ops.shapes("aten.cat", 4) == [], ops.shapes("aten.cat", 4)
    assert_outputs_close(out, expected, ATOL_TRITON, RTOL_TRITON, family)
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


def test_stock_unet_concatenates_in_every_up_resnet():
    # The dispatch check above can fail: the stock model writes one concatenation per up-block resnet.
    model, kwargs = _model_and_inputs("sd15")
    with torch.no_grad(), DispatchedOps() as ops:
        model(**kwargs)
    assert len(ops.shapes("aten.cat", 4)) == sum(len(b.resnets) for b in model.up_blocks)


def test_unfused_or_hooked_resnet_gets_the_concatenation():
    model, kwargs = _model_and_inputs("sd15")
    with torch.no_grad():
        expected = output_tensor(model(**kwargs))
    # The first up block's resnets stay stock (filtered out); a hook on one resnet of the second block after patching.
    ldmopt.patch(model, filter_fn=lambda m, name: not name.startswith("up_blocks.0.resnets"))
    seen = []
    handle = model.up_blocks[1].resnets[0].register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    with torch.no_grad(), triton_only_for("gn_silu_conv2d"), DispatchedOps() as ops:
        out = output_tensor(model(**kwargs))
    handle.remove()
    stock_resnets = len(model.up_blocks[0].resnets) + 1
    assert len(ops.shapes("aten.cat", 4)) == stock_resnets, ops.shapes("aten.cat", 4)
    assert seen and seen[0] == model.up_blocks[1].resnets[0].conv1.in_channels  # the hook saw the concatenation
    assert_outputs_close(out, expected, ATOL_TRITON, RTOL_TRITON, "partly stock")
    ldmopt.unpatch(model)


def test_freeu_and_deprecated_scale_match_stock():
    model, kwargs = _model_and_inputs("sd15")
    model.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    with torch.no_grad():
        expected = output_tensor(model(**kwargs))
        ldmopt.patch(model)
        with triton_only_for("gn_silu_conv2d"):
            out = output_tensor(model(**kwargs))
    assert_outputs_close(out, expected, ATOL_TRITON, RTOL_TRITON, "FreeU")
    block = model.up_blocks[0]
    hidden = torch.randn(2, 64, 4, 4).contiguous(memory_format=torch.channels_last)
    skips = tuple(torch.randn(2, c, 4, 4) for c in (32, 64))
    with torch.no_grad(), pytest.warns(FutureWarning, match="scale"):
        block(hidden, skips, None, None, scale=1.0)  # diffusers' own forward deprecates the argument
    ldmopt.unpatch(model)


def test_training_gradients_match_stock_with_gradient_checkpointing():
    model, kwargs = _model_and_inputs("sd15")
    model.train()
    model.enable_gradient_checkpointing()
    params = dict(model.named_parameters())

    def grads():
        model.zero_grad(set_to_none=True)
        output_tensor(model(**kwargs)).square().mean().backward()
        return {n: p.grad.clone() for n, p in params.items() if p.grad is not None}

    expected = grads()
    ldmopt.patch(model, training=True)
    with ldmopt.use_backend("torch"):
        ours = grads()
    assert ours.keys() == expected.keys()
    for name, g in expected.items():
        err = (ours[name] - g).abs().max().item()
        assert err <= 1e-4 + 1e-4 * g.abs().max().item(), f"{name}: {err:.3e}"
    ldmopt.unpatch(model)


def test_subclass_overriding_forward_is_skipped_with_reason():
    from diffusers.models.unets.unet_2d_blocks import UpBlock2D

    class MyUpBlock(UpBlock2D):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    block = MyUpBlock(in_channels=16, prev_output_channel=16, out_channels=16, temb_channels=8, num_layers=1,
                      resnet_groups=4)  # fmt: skip
    from ldmopt.patch.rule import Site

    site = Site("up", block, None, None)
    rule = UpBlockSkipRule()
    assert rule.targets()  # this diffusers has the classes
    assert UpBlock2D in rule.targets() and type(block) not in rule.targets()  # the table keys exact classes
    reasons = rule.reasons(site)
    assert len(reasons) == 1 and reasons[0].endswith("MyUpBlock overrides UpBlock2D.forward"), reasons


def test_motion_blocks_call_their_children_by_keyword_as_diffusers_does():
    # Hooks that read kwargs see the calls diffusers makes: the resnet (fall-back path: hooked), attention, upsampler.
    model, kwargs = _model_and_inputs("animatediff")
    block = model.up_blocks[0]
    seen = []

    def record(module, args, kw):
        seen.append((type(module).__name__, len(args), sorted(kw)))

    def run():
        seen.clear()
        handles = [m.register_forward_pre_hook(record, with_kwargs=True)
                   for m in (block.resnets[0], block.upsamplers[0], model.up_blocks[1].attentions[0])]  # fmt: skip
        with torch.no_grad(), ldmopt.use_backend("torch"):
            model(**kwargs)
        for h in handles:
            h.remove()
        return list(seen)

    stock_calls = run()
    ldmopt.patch(model)
    assert run() == stock_calls and stock_calls
    ldmopt.unpatch(model)


def test_up_block_whose_resnets_cannot_fuse_stays_stock_with_reason():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(**{**models.TINY_UNET, "resnet_time_scale_shift": "scale_shift"})
    report = ldmopt.patch(model)
    assert "up_block_skip" not in report.counts()
    reasons = [s.reasons for s in report.skipped if s.rule == "up_block_skip"]
    assert len(reasons) == len(model.up_blocks) and all("none of its resnets can run fused" in r[0] for r in reasons)
    ldmopt.unpatch(model)


def test_motion_blocks_under_gradient_checkpointing_pass_the_resnet_positionally():
    # diffusers' checkpointed call is _gradient_checkpointing_func(resnet, hidden_states, temb): positional.
    model, kwargs = _model_and_inputs("animatediff")
    model.train()
    model.enable_gradient_checkpointing()
    seen = []
    resnet = model.up_blocks[0].resnets[0]

    def run():
        seen.clear()
        handle = resnet.register_forward_pre_hook(lambda m, a, kw: seen.append((len(a), sorted(kw))), with_kwargs=True)
        with ldmopt.use_backend("torch"):
            output_tensor(model(**kwargs)).sum().backward()
        handle.remove()
        return list(seen)

    stock_calls = run()
    ldmopt.patch(model, training=True)
    assert run() == stock_calls and stock_calls[0] == (2, [])
    ldmopt.unpatch(model)


def test_reference_backend_concatenates_once_per_resnet():
    # Where the kernels cannot read the pair (here: the torch backend forced), the resnet concatenates once, as
    # stock does, instead of once per op (statistics, conv1, shortcut).
    model, kwargs = _model_and_inputs("sd15")
    ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("torch"), DispatchedOps() as ops:
        model(**kwargs)
    assert len(ops.shapes("aten.cat", 4)) == sum(len(b.resnets) for b in model.up_blocks)
    ldmopt.unpatch(model)
