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


@pytest.mark.parametrize("change", ["freeu", "lora"])
def test_compile_fullgraph_with_gradient_checkpointing_and_counted_fallbacks(change):
    """A fall-back or layout copy counted inside a gradient-checkpointed block (FreeU hands the up blocks NCHW skips;
    LoRA on the attention projections makes them run stock) must not break torch.compile(fullgraph=True): Dynamo
    cannot replay Python side effects there, so compiled calls do not count."""
    from diffusers import UNet2DConditionModel

    torch._dynamo.reset()
    config = dict(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
    )  # fmt: skip
    unet = UNet2DConditionModel(**config).train().to(memory_format=torch.channels_last)
    if change == "freeu":
        unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    else:
        peft = pytest.importorskip("peft")
        unet.requires_grad_(False)
        unet.add_adapter(peft.LoraConfig(r=4, init_lora_weights="gaussian", target_modules=["to_q", "to_out.0"]))
    unet.enable_gradient_checkpointing()
    x, t, context = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 5, 32)
    ldmopt.patch(unet, training=True)
    with ldmopt.use_backend("torch"):
        eager = unet(x, t, context).sample
        compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")(x, t, context).sample
        compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
