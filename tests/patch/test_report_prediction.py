"""What the patch report says at patch time: patched modules whose fused path will run stock on every call because a
child it reads in place is a PEFT/LoRA layer loaded before patch (``PatchReport.partly_stock``), and which of the
requested families matched anything (``matched_families`` / ``unmatched_families``)."""

import re

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt.patch import PatchError
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor

peft = pytest.importorskip("peft")

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
#: The motion modules' attention projections only, as an AnimateDiff motion LoRA targets them.
MOTION_ATTENTION = r".*motion_modules.*\.(to_q|to_k|to_v|to_out\.0)"


def _run(model, kwargs):
    with torch.no_grad(), ldmopt.use_backend("torch"):
        return output_tensor(model(**kwargs))


def _with_lora(model, targets):
    model.add_adapter(peft.LoraConfig(r=4, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # peft starts B at zero, a no-op update
    return model


def _observed_children(report) -> set[str]:
    """The children named by the per-call fall-backs counted since patch ("<where> ran the stock path: <child> is a
    peft...", where the temporal attention path calls its module "attn")."""
    found = set()
    for reason in report.fallbacks():
        match = re.search(r"ran the stock path: (\S+) is a peft", reason)
        if match:
            found.add(match[1].removeprefix("attn."))
    return found


def _assert_predicted(report, observed: set[str]) -> None:
    """Every child the calls fell back for was named at patch time."""
    predicted = " ".join(part for r in report.partly_stock for part in r.stock_parts)
    assert observed, report.fallbacks()
    assert all(child in predicted for child in observed), (observed, predicted)


def test_lora_before_patch_on_sd15_blocks_is_reported_at_patch_time():
    unet = _with_lora(models.sd15_unet().eval(), ATTENTION)
    x = models.inputs("sd15", unet)
    ref = _run(unet, x)
    keys = list(unet.state_dict())
    report = ldmopt.patch(unet)
    blocks = {n for n, m in unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"}
    # Patched (the feed-forward's epilogue and norm3 in its projection still fuse), each named with its LoRA children.
    assert {r.name for r in report.partly_stock} == blocks
    assert {r.rule for r in report.partly_stock} == {"residual_block"}
    assert not [s for s in report.skipped if s.rule == "residual_block"], report.skipped
    for entry in report.partly_stock:
        (why,) = entry.stock_parts  # one reason: the LoRA children named together, once
        for child in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0"):
            assert child in why, why
        assert "PEFT/LoRA layers (Linear)" in why
        assert "attn2.to_k" not in why  # attn2's keys read the text context, not a norm: nothing fused to lose
    text = str(report)
    assert f"{report.total} modules patched ({len(blocks)} with parts that run stock on every call)" in text, text
    assert "patched, but parts run stock on every call" in text and "[residual_block]: attn1.to_q" in text, text
    assert_outputs_close(_run(unet, x), ref, name="sd15 + LoRA before patch")
    _assert_predicted(report, _observed_children(report))
    ldmopt.unpatch(unet)
    assert list(unet.state_dict()) == keys and not ldmopt.is_patched(unet)
    assert torch.equal(_run(unet, x), ref)


def test_motion_lora_before_patch_names_the_motion_modules():
    model = _with_lora(models.animatediff().eval(), MOTION_ATTENTION)
    x = models.inputs("animatediff", model)
    ref = _run(model, x)
    report = ldmopt.patch(model)
    motion = {n for n, m in model.named_modules() if type(m).__name__ == "AnimateDiffTransformer3D"}
    assert len(motion) == 7
    # The spatial blocks have no LoRA: only the motion modules run parts stock.
    assert {r.name for r in report.partly_stock} == motion
    assert {r.rule for r in report.partly_stock} == {"temporal_container"}
    for entry in report.partly_stock:
        (why,) = entry.stock_parts
        assert "transformer_blocks.0.attn1.to_q" in why and "transformer_blocks.0.attn2.to_out.0" in why, why
        assert "PEFT/LoRA layers" in why
    text = str(report)
    assert "(7 with parts that run stock on every call)" in text and "[temporal_container]" in text, text
    assert_outputs_close(_run(model, x), ref, name="animatediff + motion LoRA before patch")
    _assert_predicted(report, _observed_children(report))
    ldmopt.unpatch(model)
    assert torch.equal(_run(model, x), ref)


def test_lora_after_patch_is_left_to_the_per_call_counts():
    unet = models.sd15_unet().eval()
    x = models.inputs("sd15", unet)
    report = ldmopt.patch(unet)
    assert report.partly_stock == [] and "run stock on every call" not in str(report)
    _with_lora(unet, ATTENTION)
    _run(unet, x)
    assert _observed_children(report) >= {"attn1.to_out.0", "attn2.to_out.0"}, report.fallbacks()
    ldmopt.unpatch(unet)
    assert not ldmopt.is_patched(unet)


def test_families_that_matched_nothing_are_said():
    unet = models.sd15_unet().eval()
    report = ldmopt.patch(unet, families=("temporal_attention",))
    assert report.families == ("temporal_attention",)  # what was asked, as before
    assert report.matched_families == () and report.unmatched_families == ("temporal_attention",)
    assert "families: temporal_attention (requested; none matched a module here)" in str(report), str(report)
    ldmopt.unpatch(unet)

    report = ldmopt.patch(unet, families=("residual", "temporal_layout"))
    assert report.matched_families == ("residual",) and report.unmatched_families == ("temporal_layout",)
    assert "families: residual (matched nothing here: temporal_layout)" in str(report), str(report)
    again = ldmopt.patch(unet, families=("residual", "temporal_layout"))
    assert again.total == 0 and again.matched_families == ("residual",)  # already patched counts as matched
    ldmopt.unpatch(unet)

    # Matched, but every module left stock: matched (the reasons are in skipped), not "nothing here".
    report = ldmopt.patch(unet, families=("residual",), filter_fn=lambda m, name: False)
    assert report.total == 0 and report.matched_families == ("residual",)
    assert str(report).splitlines()[0].endswith("families: residual"), str(report)
    assert "excluded by filter_fn" in str(report)


def test_lora_on_proj_out_names_the_transformer2d_models():
    # Transformer2DModel's proj_out takes the residual add in its epilogue; a LoRA on it costs that part per call.
    unet = _with_lora(models.sd15_unet().eval(), ["proj_out"])
    x = models.inputs("sd15", unet)
    ref = _run(unet, x)
    report = ldmopt.patch(unet)
    transformers = {n for n, m in unet.named_modules() if type(m).__name__ == "Transformer2DModel"}
    assert {r.name for r in report.partly_stock} == transformers
    assert {r.rule for r in report.partly_stock} == {"transformer2d_in"}
    assert {r.stock_parts for r in report.partly_stock} == {("proj_out is a PEFT/LoRA layer (Conv2d)",)}  # 1x1 conv
    assert_outputs_close(_run(unet, x), ref, name="sd15 + proj_out LoRA before patch")
    _assert_predicted(report, _observed_children(report))
    ldmopt.unpatch(unet)
    assert torch.equal(_run(unet, x), ref)


def test_a_temporal_processor_running_stock_is_in_the_report():
    # The processors' own counters reach report.fallbacks(): a call with an attention mask runs the stock processor.
    model = models.animatediff().eval()
    report = ldmopt.patch(model, families=("temporal_attention",))
    attn = next(m for name, m in model.named_modules() if "motion" in name and name.endswith("attn1"))
    x = torch.randn(6, 3, attn.to_q.in_features)
    with torch.no_grad():
        attn(x, attention_mask=torch.zeros(6, 1, 3))
        attn(x, attention_mask=torch.zeros(6, 1, 3))
    assert report.fallbacks()["TemporalAttnProcessor ran the stock processor: attention mask"] == 2
    assert "x2     TemporalAttnProcessor ran the stock processor: attention mask" in str(report)


def test_strict_refuses_a_model_whose_fused_modules_would_run_parts_stock():
    unet = _with_lora(models.sd15_unet().eval(), ATTENTION)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    blocks = {n for n, m in unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"}
    with pytest.raises(PatchError, match=rf"{len(blocks)} fused modules would run parts stock") as raised:
        ldmopt.patch(unet, strict=True)
    message = str(raised.value)
    assert all(f"  {name} [residual_block]: " in message for name in blocks), message
    assert "PEFT/LoRA layers" in message
    assert not ldmopt.is_patched(unet)  # refused before anything changed
    assert all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())
    # The same LoRA on a model with no fused module reading it: strict passes.
    assert ldmopt.patch(unet, strict=True, families=("gn_conv",)).replaced
