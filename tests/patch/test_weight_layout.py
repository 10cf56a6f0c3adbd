"""patch(channels_last_weights=...): the convs whose weights the fused forwards read get channels-last weights (same
Parameters, values and keys), reported, and unpatch gives the contiguous ones back; stock convs keep theirs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ldmopt

from . import models
from .helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot, triton_only_for


def _spatial_convs(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.weight[0, 0].numel() > 1
    }


def _fused_read(model: nn.Module) -> dict[str, nn.Module]:
    """The spatial convs of the tiny UNets the fused forwards read: the resnets', the upsamplers' and the
    downsamplers' (whose fused conv runs once a GroupNorm asks for its output's statistics; conv_in and conv_out stay
    stock convolutions)."""
    parts = (".resnets.", ".upsamplers.", ".downsamplers.")
    return {n: m for n, m in _spatial_convs(model).items() if any(part in n for part in parts)}


def _stock_convs(model: nn.Module) -> dict[str, nn.Module]:
    fused = _fused_read(model)
    return {n: m for n, m in _spatial_convs(model).items() if n not in fused}


def _channels_last(weight: torch.Tensor) -> bool:
    fmt = torch.channels_last if weight.dim() == 4 else torch.channels_last_3d
    return weight.is_contiguous(memory_format=fmt) and not weight.is_contiguous()


def _unet():
    return models.sd15_unet().eval()


def test_inference_patch_converts_spatial_conv_weights_and_unpatch_restores_them():
    torch.manual_seed(0)
    model = _unet()
    inputs = models.inputs("sd15", model)
    with torch.no_grad():
        expected = output_tensor(model(**inputs)).clone()
    before = snapshot(model)
    params = {n: p for n, p in model.named_parameters()}
    one_by_one = {n: p.stride() for n, p in params.items() if p.dim() == 4 and p[0, 0].numel() == 1}
    assert one_by_one, "the tiny UNet has 1x1 convs (shortcuts, proj_in/out)"

    report = ldmopt.patch(model)

    convs = _fused_read(model)
    assert convs and all(_channels_last(m.weight) for m in convs.values())
    stock = _stock_convs(model)
    assert {"conv_in", "conv_out"} <= set(stock) and all(m.weight.is_contiguous() for m in stock.values())
    assert {n: params[n].stride() for n in one_by_one} == one_by_one  # 1x1 kernels are channels-last already
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    size = sum(m.weight.numel() * 4 for m in convs.values())
    assert report.converted_weights == {"": (len(convs), size)} and not report.kept_weights
    assert "conv weights made channels-last" in str(report)
    with torch.no_grad(), triton_only_for("gn_silu_conv2d"):  # the kernels that read the weights
        assert_outputs_close(output_tensor(model(**inputs)), expected, name="patched, channels-last weights")

    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))
    assert all(m.weight.is_contiguous() for m in _spatial_convs(model).values())


@pytest.mark.parametrize(
    "kwargs, reason",
    [(dict(training=True), "training=True"), (dict(channels_last_weights=False), "channels_last_weights=False")],
)
def test_training_default_and_false_keep_the_layout_and_say_so(kwargs, reason):
    model = _unet()
    before = {n: p.stride() for n, p in model.named_parameters()}
    report = ldmopt.patch(model, **kwargs)
    assert {n: p.stride() for n, p in model.named_parameters()} == before
    assert not report.converted_weights
    assert report.kept_weights[""][0] == len(_fused_read(model))
    text = str(report)
    assert f"conv weights left contiguous ({reason})" in text and "channels_last_weights=True" in text
    ldmopt.unpatch(model)
    assert {n: p.stride() for n, p in model.named_parameters()} == before


def test_training_patch_converts_when_asked_and_still_matches_stock_gradients():
    torch.manual_seed(1)
    stock, fused = _unet().train(), None
    fused = copy.deepcopy(stock)
    report = ldmopt.patch(fused, training=True, channels_last_weights=True)
    assert report.converted_weights and all(_channels_last(m.weight) for m in _fused_read(fused).values())
    inputs = models.inputs("sd15", stock)
    output_tensor(stock(**inputs)).square().mean().backward()
    with triton_only_for("gn_silu_conv2d"):
        output_tensor(fused(**inputs)).square().mean().backward()
    stock_params = dict(stock.named_parameters())
    for name, p in fused.named_parameters():
        expected = stock_params[name].grad
        assert p.grad is not None and p.grad.stride() == p.stride(), name  # the weight's own layout (DDP buckets)
        assert_outputs_close(p.grad, expected, atol=2e-4, rtol=2e-3, name=name)


@pytest.mark.parametrize("when", ["patch", "unpatch"])
def test_optimizer_state_made_before_a_layout_change_is_matched_to_it(when):
    # Optimizer state made before patch (or, patched channels-last, before unpatch) keeps the old strides, and fused
    # AdamW would then update the wrong elements without an error; match_optimizer_layout re-lays the moments out.
    torch.manual_seed(2)
    model = _unet().train()
    if when == "unpatch":
        ldmopt.patch(model, training=True, channels_last_weights=True)
    fused_adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    fused_adamw.step()
    if when == "patch":
        ldmopt.patch(model, training=True, channels_last_weights=True)
    else:
        ldmopt.unpatch(model)
    moved = [p for p in model.parameters() if fused_adamw.state[p]["exp_avg"].stride() != p.stride()]
    assert moved, "the layout change left every moment's strides matching"
    assert ldmopt.match_optimizer_layout(fused_adamw) == 2 * len(moved)  # exp_avg and exp_avg_sq
    assert ldmopt.match_optimizer_layout(fused_adamw) == 0

    by_position = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    by_position.load_state_dict(copy.deepcopy(fused_adamw.state_dict()))
    by_position.param_groups[0].update(fused=None, foreach=True)  # the loaded groups said fused=True
    values = {p: p.detach().clone() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    fused_adamw.step()
    stepped = {p: p.detach().clone() for p in model.parameters()}
    with torch.no_grad():
        for p, v in values.items():
            p.copy_(v)
    by_position.step()
    for p in moved:
        torch.testing.assert_close(stepped[p], p.detach(), rtol=1e-5, atol=1e-6)


def test_models_without_fused_convolutions_keep_their_layout():
    model = _unet()
    before = {n: p.stride() for n, p in model.named_parameters()}
    report = ldmopt.patch(model, families=("feed_forward", "temporal_attention", "residual"))
    assert report.total > 0
    assert {n: p.stride() for n, p in model.named_parameters()} == before
    assert not report.converted_weights and not report.kept_weights
    assert "conv weights" not in str(report)


def test_already_channels_last_model_is_left_as_it_is():
    model = _unet().to(memory_format=torch.channels_last)
    before = {n: p.stride() for n, p in model.named_parameters()}
    report = ldmopt.patch(model, training=True)
    assert not report.converted_weights and not report.kept_weights
    ldmopt.unpatch(model)
    assert {n: p.stride() for n, p in model.named_parameters()} == before  # the user's layout stays theirs


def test_filter_fn_excluded_block_keeps_its_layout():
    model = _unet()
    excluded = "down_blocks.0.resnets.0"
    report = ldmopt.patch(model, filter_fn=lambda module, name: name != excluded)
    assert model.down_blocks[0].resnets[0].conv1.weight.is_contiguous()
    assert _channels_last(model.down_blocks[1].resnets[0].conv1.weight)
    assert report.converted_weights[""][0] == len(_fused_read(model)) - 2


def test_unpatch_leaves_a_weight_the_user_re_laid_out_and_a_copy_restores_its_own():
    model = _unet()
    ldmopt.patch(model)
    conv1 = model.down_blocks[0].resnets[0].conv1
    copied = copy.deepcopy(model)
    # The user's own choice while patched: a weight made channels-last by other means (here: different strides)
    conv1.weight.data = conv1.weight.data.permute(0, 3, 2, 1).contiguous().permute(0, 3, 2, 1)
    user_strides = conv1.weight.stride()
    ldmopt.unpatch(model)
    assert conv1.weight.stride() == user_strides
    assert model.down_blocks[0].resnets[0].conv2.weight.is_contiguous()
    # The copy's records point at the copy's convs: unpatching it restores those, not the original's
    model2 = copy.deepcopy(copied)
    ldmopt.unpatch(copied)
    assert all(m.weight.is_contiguous() for m in _spatial_convs(copied).values())
    assert all(_channels_last(m.weight) for m in _fused_read(model2).values())


class _Resnets(nn.Module):
    """Only ResnetBlock2D modules: every spatial conv is one the fused forwards read (the 1x1 shortcut is neither
    converted nor a witness), so no stock conv tells whether the user converted the model meanwhile."""

    def __init__(self):
        super().__init__()
        from diffusers.models.resnet import ResnetBlock2D

        self.first = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=None, groups=4)
        self.second = ResnetBlock2D(in_channels=16, out_channels=16, temb_channels=None, groups=4)

    def forward(self, x):
        return self.second(self.first(x, None), None)


def test_unpatch_restores_the_layout_of_a_model_whose_every_conv_was_converted():
    model = _Resnets().eval()
    assert len(_spatial_convs(model)) == 4  # conv1 and conv2 of each
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.converted_weights[""][0] == 4
    assert all(_channels_last(m.weight) for m in _spatial_convs(model).values())
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))  # strides included
    assert all(m.weight.is_contiguous() for m in _spatial_convs(model).values())


def test_a_model_converted_to_channels_last_while_patched_stays_so_after_unpatch():
    # model.to(memory_format=channels_last) after patch changes only the stock convs (ours already are): their change
    # says what the user asked for, so unpatch leaves every weight channels-last instead of undoing half the request.
    model = _unet()
    ldmopt.patch(model)
    model.to(memory_format=torch.channels_last)
    ldmopt.unpatch(model)
    assert all(_channels_last(m.weight) for m in _spatial_convs(model).values())
    # Only part of the stock convs converted: not the whole model, so patch's conversion is undone as before.
    model = _unet()
    ldmopt.patch(model)
    model.conv_in.to(memory_format=torch.channels_last)
    ldmopt.unpatch(model)
    assert _channels_last(model.conv_in.weight) and not _channels_last(model.conv_out.weight)
    assert all(m.weight.is_contiguous() for m in _fused_read(model).values())


def test_conv3d_temporal_weights_become_channels_last_3d_and_the_output_is_unchanged():
    torch.manual_seed(2)
    model = models.modelscope().eval()
    inputs = models.inputs("modelscope", model, batch=1, frames=2)  # small: the interpreter runs every fused conv
    with torch.no_grad():
        expected = output_tensor(model(**inputs)).clone()
    before = snapshot(model)
    ldmopt.patch(model)
    conv3d = [m for m in _spatial_convs(model).values() if isinstance(m, nn.Conv3d)]
    assert conv3d and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in conv3d)
    with torch.no_grad(), triton_only_for("gn_silu_conv2d"):
        assert_outputs_close(output_tensor(model(**inputs)), expected, name="UNet3D, channels-last weights")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


def test_the_op_copies_a_weight_in_another_layout_to_channels_last_and_counts_it(monkeypatch):
    from ldmopt.kernels import gn_conv2d as kernels

    from ldmopt.ops import gn_conv2d as op

    seen = []
    launcher = kernels.gn_conv2d_fwd
    monkeypatch.setattr(kernels, "gn_conv2d_fwd", lambda x, m, r, gw, gb, w, *a: seen.append(w.stride()) or launcher(
        x, m, r, gw, gb, w, *a))  # fmt: skip
    x = torch.randn(2, 12, 5, 7).contiguous(memory_format=torch.channels_last)
    gw, gb, w, b = torch.rand(12) + 0.5, torch.randn(12), torch.randn(10, 12, 3, 3) * 0.2, torch.randn(10)
    results = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        before = sum(op.layout_conversions.values())
        with ldmopt.use_backend("triton"):
            results[layout] = op.gn_silu_conv2d(x, gw, gb, 4, 1e-5, w.contiguous(memory_format=layout), b, 1, 1)
        assert sum(op.layout_conversions.values()) - before == (1 if layout == torch.contiguous_format else 0)
    assert seen and all(strides[1] == 1 for strides in seen)  # the kernel always reads unit-stride input channels
    assert torch.equal(results[torch.contiguous_format], results[torch.channels_last])


def test_a_training_patch_reports_the_weight_copies_its_contiguous_weights_cost():
    model = _unet().train()
    report = ldmopt.patch(model, training=True)
    with triton_only_for("gn_silu_conv2d"):
        output_tensor(model(**models.inputs("sd15", model, batch=1))).sum().backward()
    copies = {k: n for k, n in report.layout_copies().items() if k.startswith("fused conv: conv weight")}
    assert copies and "copied their input or weight to channels-last" in str(report)
    ldmopt.unpatch(model)
    report = ldmopt.patch(model, training=True, channels_last_weights=True)
    with triton_only_for("gn_silu_conv2d"):
        output_tensor(model(**models.inputs("sd15", model, batch=1))).sum().backward()
    assert not any(k.startswith("fused conv: conv weight") for k in report.layout_copies())


def test_a_second_patch_converts_what_the_first_left():
    model = _unet().train()
    assert ldmopt.patch(model, training=True).kept_weights
    report = ldmopt.patch(model, training=True, channels_last_weights=True)
    assert report.total == 0 and report.converted_weights[""][0] == len(_fused_read(model))
    assert all(_channels_last(m.weight) for m in _fused_read(model).values())
    assert not ldmopt.patch(model).converted_weights  # nothing left to convert
    ldmopt.unpatch(model)
    assert all(m.weight.is_contiguous() for m in _spatial_convs(model).values())


def test_a_conversion_that_fails_halfway_leaves_the_model_as_it_was(monkeypatch):
    from ldmopt.patch import weight_layout

    model = _unet()
    before = snapshot(model)
    formats, calls = dict(weight_layout._FORMATS), []

    class Failing(dict):
        def __getitem__(self, rank):
            calls.append(rank)
            if len(calls) == 4:
                raise torch.OutOfMemoryError("no memory for the fourth weight")
            return formats[rank]

    monkeypatch.setattr(weight_layout, "_FORMATS", Failing(formats))
    with pytest.raises(torch.OutOfMemoryError):
        ldmopt.patch(model)
    assert len(calls) == 4 and not ldmopt.is_patched(model)
    assert_same_snapshot(before, snapshot(model))  # strides included: the three converted weights are back


def test_lora_layers_loaded_before_patch_keep_their_layout():
    pytest.importorskip("peft")
    from peft import LoraConfig

    model = _unet()
    model.add_adapter(LoraConfig(r=4, target_modules=["conv1", "conv2", "to_q"]))
    report = ldmopt.patch(model)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n and p.dim() == 4}
    assert lora and all(p.is_contiguous() for p in lora.values())  # safetensors can save the adapter
    assert any(s.reasons and "PEFT" in " ".join(s.reasons) for s in report.skipped)


def test_a_contiguous_temporal_weight_is_copied_for_the_kernel_and_autocast_casts_into_channels_last():
    from ldmopt.ops import gn_conv2d as op

    x = torch.randn(2, 12, 5, 3).contiguous(memory_format=torch.channels_last)  # (video, channel, frame, pixel)
    conv3d = torch.randn(10, 12, 3, 1, 1) * 0.2  # a temporal Conv3d's weight, as the fused temporal convs take it
    w = conv3d.squeeze(-1)
    before = sum(op.layout_conversions.values())
    with ldmopt.use_backend("triton"):
        strided = op.gn_silu_conv2d(x, None, None, 4, 1e-5, w, None, 1, (1, 0))
        copied = op.gn_silu_conv2d(x, None, None, 4, 1e-5, w.contiguous(memory_format=torch.channels_last), None, 1,
                                   (1, 0))  # fmt: skip
    assert sum(op.layout_conversions.values()) - before == 1
    assert torch.equal(strided, copied)
    # Under autocast the fp32 weight's cast lands in channels-last at once: no second copy
    master = w.clone().requires_grad_()
    before = sum(op.layout_conversions.values())
    with torch.autocast("cpu", torch.bfloat16), ldmopt.use_backend("torch"):
        y = op.gn_silu_conv2d(x, None, None, 4, 1e-5, master, None, 1, (1, 0))
    y.float().sum().backward()
    assert sum(op.layout_conversions.values()) == before
    assert y.dtype == torch.bfloat16 and master.grad.dtype == torch.float32 and master.grad.stride() == master.stride()
