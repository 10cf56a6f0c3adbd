"""ldmopt.patch's ``up_block_skip`` rule: UNet up blocks hand their resnets (hidden, skip) instead of the
concatenation, which the fused resnet reads in place. Tiny random-weight SD1.5 / SDXL / AnimateDiff / ModelScope /
SVD UNets, Triton interpreter, against the stock model; the concatenation must not be dispatched at all."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ldmopt
from ldmopt.nn import child_check
from ldmopt.nn import resnet as R
from ldmopt.patch.rules_up_block import UpBlockSkipRule
from tests.patch import models
from tests.patch.helpers import (
    ATOL_TRITON,
    RTOL_TRITON,
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
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


class _Concatenations(TorchDispatchMode):
    """Records the shapes of the 4-D (and 5-D) tensors aten.cat writes."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat and out.dim() >= 4:
            self.shapes.append(tuple(out.shape))
        return out


def _model_and_inputs(family: str):
    model = FAMILIES[family]().eval()
    kwargs = models.inputs(family, model, batch=1, frames=2) if family in VIDEO else models.inputs(family, model)
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
        with ldmopt.use_backend("triton"), _Concatenations() as cats:
            out = output_tensor(model(**kwargs))
    fallbacks = {**R.fallback_reasons, **child_check.fallback_reasons}
    assert not fallbacks, fallbacks
    assert cats.shapes == [], f"concatenations written: {cats.shapes}"
    assert_outputs_close(out, expected, ATOL_TRITON, RTOL_TRITON, family)
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


def test_stock_unet_concatenates_in_every_up_resnet():
    # The dispatch check above can fail: the stock model writes one concatenation per up-block resnet.
    model, kwargs = _model_and_inputs("sd15")
    with torch.no_grad(), _Concatenations() as cats:
        model(**kwargs)
    assert len(cats.shapes) == sum(len(b.resnets) for b in model.up_blocks)


def test_unfused_or_hooked_resnet_gets_the_concatenation():
    model, kwargs = _model_and_inputs("sd15")
    with torch.no_grad():
        expected = output_tensor(model(**kwargs))
    # The first up block's resnets stay stock (filtered out); a hook on one resnet of the second block after patching.
    ldmopt.patch(model, filter_fn=lambda m, name: not name.startswith("up_blocks.0.resnets"))
    seen = []
    handle = model.up_blocks[1].resnets[0].register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    with torch.no_grad(), ldmopt.use_backend("triton"), _Concatenations() as cats:
        out = output_tensor(model(**kwargs))
    handle.remove()
    stock_resnets = len(model.up_blocks[0].resnets) + 1
    assert len(cats.shapes) == stock_resnets, cats.shapes
    assert seen and seen[0] == model.up_blocks[1].resnets[0].conv1.in_channels  # the hook saw the concatenation
    assert_outputs_close(out, expected, ATOL_TRITON, RTOL_TRITON, "partly stock")
    ldmopt.unpatch(model)


def test_freeu_and_deprecated_scale_match_stock():
    model, kwargs = _model_and_inputs("sd15")
    model.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    with torch.no_grad():
        expected = output_tensor(model(**kwargs))
        ldmopt.patch(model)
        with ldmopt.use_backend("triton"):
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
