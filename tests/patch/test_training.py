"""Patched models in training: gradients match the stock model's; dropout with p > 0 keeps the stock path."""

import pytest
import torch

import ldmopt
from tests.patch import models
from tests.patch.helpers import output_tensor
from tests.patch.test_families import channels_last


def _grads(model, kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # DiT's label embedding drops class labels at random in train mode
    loss = output_tensor(model(**kwargs)).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["sd15", "dit", "animatediff"])
def test_gradients_match_stock(family):
    model = models.BUILDERS[family]().train()
    kwargs = channels_last(model, models.inputs(family, model, batch=2))
    loss_ref, ref = _grads(model, kwargs)
    report = ldmopt.patch(model, training=True)
    assert report.total > 0 and not report.skipped
    with ldmopt.use_backend("torch"):
        loss, got = _grads(model, kwargs)
    if family == "sd15":  # channels-last end to end: every ResnetBlock2D ran fused, forward and backward
        assert not [r for r in report.fallbacks() if r.startswith("ResnetBlock2D")], report.fallbacks()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    assert got.keys() == ref.keys()
    for name, g in got.items():
        scale = ref[name].abs().max().item()
        err = (g - ref[name]).abs().max().item()
        assert err <= 1e-4 + 1e-3 * scale, f"{family} grad {name}: error {err:.3e}, max |grad| {scale:.3e}"


def test_dropout_in_training():
    unet = models.sd15_unet().train()
    block = unet.down_blocks[0].resnets[0]
    block.dropout.p = 0.1
    # training=True: a fused path that would skip the dropout is left stock, with the reason.
    report = ldmopt.patch(unet, training=True)
    (skip,) = [s for s in report.skipped if s.rule == "resnet"]
    assert skip.name == "down_blocks.0.resnets.0" and "dropout with p=0.1" in skip.reasons[0]
    ldmopt.unpatch(unet)
    # Default (inference) patching fuses it; a call in train mode still takes the stock path, and says so.
    unet = unet.to(memory_format=torch.channels_last)
    report = ldmopt.patch(unet)
    assert "down_blocks.0.resnets.0" in {r.name for r in report.replaced if r.rule == "resnet"}
    kwargs = channels_last(unet, models.inputs("sd15", unet))
    with torch.no_grad(), ldmopt.use_backend("torch"):
        unet(**kwargs)
    assert any("dropout p=0.1 in training mode" in r for r in report.fallbacks()), report.fallbacks()
