"""The analytic cost model of a training step: backward FLOPs by formula, attribution of backward operators to their
modules, one record per fused attention/RMSNorm backward, a steady-state AdamW update, the forward left as in
inference."""

import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from torch import nn

from ldmopt import configs
from ldmopt.profiler import analyze
from ldmopt.profiler import categories as C
from ldmopt.profiler.cli import configure_analyze, run_analyze


class ToyDenoiser(nn.Module):
    """conv -> GroupNorm -> SiLU -> conv -> self-attention over pixels -> linear: every kind of backward."""

    def __init__(self, channels: int = 12, heads: int = 3, head_dim: int = 4) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        self.norm = nn.GroupNorm(3, channels)
        self.conv_mid = nn.Conv2d(channels, channels, 3, padding=1)
        self.attn = Attention(query_dim=channels, heads=heads, dim_head=head_dim)
        self.proj = nn.Linear(channels, 3)

    def forward(self, x):
        h = self.conv_mid(F.silu(self.norm(self.conv_in(x))))
        b, _, height, width = h.shape
        tokens = self.attn(h.flatten(2).transpose(1, 2))
        return self.proj(tokens).transpose(1, 2).reshape(b, 3, height, width)


def _toy_inputs():
    return (torch.randn(2, 3, 7, 9),)


def _records(a, phase, **where):
    return [r for r in a.records if r.phase == phase and all(getattr(r, k) == v for k, v in where.items())]


def test_backward_flops_follow_the_formulas_and_land_on_their_modules():
    a = analyze(ToyDenoiser(), inputs=_toy_inputs(), dtype="fp32", training=True, check_flops=True)
    assert set(a.phases) == {"forward", "backward", "optimizer"}
    phases = [r.phase for r in a.records]
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    assert a.flop_counter_total == a.flops_of(*C.CATEGORIES, phase="forward")

    # The first conv's input (the latents) needs no gradient: its backward is the weight gradient alone.
    for path, factor in (("conv_in", 1), ("conv_mid", 2)):
        (fwd,) = _records(a, "forward", path=path, name="aten::convolution")
        (bwd,) = _records(a, "backward", path=path, name="aten::convolution_backward")
        assert bwd.flops == factor * fwd.flops and bwd.category == C.CONV

    (attn,) = _records(a, "forward", name="attention")
    (attn_bwd,) = _records(a, "backward", name="attention_backward")
    assert attn_bwd.flops == 5 * attn.flops // 2  # head dims equal: 5 matmuls against 2
    assert attn_bwd.category == attn.category == C.ATTN_SPATIAL and attn_bwd.path == "attn"
    assert attn_bwd.out_bytes == 3 * attn.out_bytes  # dq, dk, dv, each the size of the output here

    # Every projection needs both gradients (its input comes from trained layers): twice the forward FLOPs.
    assert a.flops_of(C.LINEAR, phase="backward") == 2 * a.flops_of(C.LINEAR, phase="forward")
    assert _records(a, "backward", name="aten::native_group_norm_backward")[0].path == "norm"
    assert {r.path for r in _records(a, "backward", category=C.LINEAR)} == {
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "proj"
    }  # fmt: skip


def test_step_has_no_artefacts_of_the_recording():
    a = analyze(ToyDenoiser(), inputs=_toy_inputs(), dtype="fp32", training=True)
    names = Counter(r.name for r in a.records)
    # AccumulateGrad takes each gradient as it is (a copy would mean the recorder held a reference), the moments
    # exist before the counted update (a steady-state step), and the CPU step counters are host work.
    assert not [r for r in a.records if r.phase == "backward" and r.name == "aten::copy_"]
    assert names["aten::zeros_like"] == 0 and names["aten::_local_scalar_dense"] == 0
    optimizer = _records(a, "optimizer")
    assert optimizer and all(r.category == C.ELEMENTWISE and r.name.startswith("aten::_foreach_") for r in optimizer)
    param_bytes = sum(p.numel() * 4 for p in ToyDenoiser().parameters())
    # AdamW reads parameter, gradient and both moments and writes three of them, at the very least.
    assert sum(r.bytes for r in optimizer) >= 7 * param_bytes


def test_frozen_parameters_drop_their_gradients_and_updates():
    full = analyze(ToyDenoiser(), inputs=_toy_inputs(), dtype="fp32", training=True)
    model = ToyDenoiser()
    model.conv_in.requires_grad_(False)
    model.attn.requires_grad_(False)
    frozen = analyze(model, inputs=_toy_inputs(), dtype="fp32", training=True)
    assert not _records(frozen, "backward", path="conv_in")
    (mid,) = _records(frozen, "backward", path="conv_mid", name="aten::convolution_backward")
    assert mid.flops == _records(full, "backward", path="conv_mid", name="aten::convolution_backward")[0].flops
    assert frozen.phase_time_s("optimizer") < full.phase_time_s("optimizer")
    # The attention's input still needs its gradient (the convolutions below train): its backward stays.
    assert _records(frozen, "backward", name="attention_backward")

    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        analyze(model, inputs=_toy_inputs(), dtype="fp32", training=True)


def test_forward_phase_is_the_inference_analysis():
    inference = analyze("sd15", tiny=True)
    step = analyze("sd15", tiny=True, training=True)
    # The same operators in the same order, then the loss (casts and mse_loss).
    forward = _records(step, "forward")
    n = len(inference.records)
    assert [(r.name, r.flops, r.bytes, r.path) for r in forward[:n]] == [
        (r.name, r.flops, r.bytes, r.path) for r in inference.records
    ]
    assert {r.name for r in forward[n:]} == {"aten::_to_copy", "aten::mse_loss"}
    assert step.flops_of(*C.CATEGORIES, phase="forward") == inference.total_flops
    assert {k: (v.count, v.bytes_saved) for k, v in step.fusions.items()} == {
        k: (v.count, v.bytes_saved) for k, v in inference.fusions.items()
    }
    backward = step.flops_of(*C.CATEGORIES, phase="backward")
    assert 1.9 * inference.total_flops < backward < 2.2 * inference.total_flops
    assert step.time_s == pytest.approx(sum(step.phase_time_s(p) for p in ("forward", "backward", "optimizer")))
    shares = step.step_shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert sum(step.shares("time", phase="backward").values()) == pytest.approx(1.0)


def test_temporal_and_rms_norm_backwards_are_one_record_each():
    video = analyze("animatediff", tiny=True, training=True)
    temporal = _records(video, "backward", name="attention_backward", category=C.ATTN_TEMPORAL)
    assert len(temporal) == len(_records(video, "forward", name="attention", category=C.ATTN_TEMPORAL)) > 0
    assert all(r.temporal for r in temporal)

    flux = analyze("flux", tiny=True, training=True)
    forward = _records(flux, "forward", name="aten::_fused_rms_norm")
    backward = _records(flux, "backward", name="aten::_fused_rms_norm_backward")
    assert len(backward) == len(forward) > 0
    assert all(r.category == C.NORM for r in backward)


def test_a_meta_model_is_left_as_it_was():
    model = configs.build_model("sd15", tiny=True, device="meta", dtype=torch.float16).eval()
    analyze(model, training=True)
    assert not any(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_cli_prints_the_phase_table_and_writes_phases(tmp_path, capsys):
    parser = argparse_parser()
    out = tmp_path / "a.json"
    args = parser.parse_args(["sd15", "--tiny", "--training", "--json", str(out)])
    assert run_analyze(args) == 0
    text = capsys.readouterr().out
    assert "training step by phase" in text and "FLOPs per training step" in text
    data = json.loads(out.read_text())
    assert data["training"] is True and set(data["phases"]) == {"forward", "backward", "optimizer"}


def argparse_parser():
    import argparse

    parser = argparse.ArgumentParser()
    configure_analyze(parser)
    return parser


def test_the_model_and_recorder_are_freed_after_a_training_count():
    import gc
    import weakref

    model = ToyDenoiser().to("meta")
    ref = weakref.ref(model)
    analyze(model, inputs=_toy_inputs(), dtype="fp32", training=True)
    del model
    gc.collect()
    assert ref() is None  # no cycle through the attention's recorded backward keeps it alive


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * grad * x


class _SquareModule(nn.Module):
    def forward(self, x):
        return _Square.apply(x)


class _TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.a = _SquareModule()
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(self.a(self.lin(x)) + 1.0)


def test_a_custom_functions_backward_lands_on_its_module():
    a = analyze(_TwoStages(), inputs=(torch.randn(4, 6),), dtype="fp32", training=True)
    assert {r.path for r in _records(a, "backward", name="aten::mul")} == {"a"}


class _GuidedByItsOwnGradient(nn.Module):
    """A forward that differentiates (energy / guidance style): its autograd ops are forward work."""

    def __init__(self):
        super().__init__()
        self.energy = nn.Linear(6, 1)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(self.energy(x).sum(), x, create_graph=True)
        return x + grad


@pytest.mark.parametrize("training", [False, True])
def test_a_forward_that_calls_autograd_stays_forward(training):
    a = analyze(_GuidedByItsOwnGradient(), inputs=(torch.randn(4, 6),), dtype="fp32", training=training)
    assert {r.phase for r in a.records} == ({"forward", "backward", "optimizer"} if training else {"forward"})
    assert _records(a, "forward", category=C.LINEAR)


class _LearnedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(8, 24)
        self.rel = nn.Parameter(torch.randn(2, 5, 5))

    def forward(self, x):
        q, k, v = self.to_qkv(x).view(x.shape[0], 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel)


def test_a_learned_attention_bias_gets_its_gradient_and_update():
    a = analyze(_LearnedBias(), inputs=(torch.randn(3, 5, 8),), dtype="fp32", training=True)
    (attn_bwd,) = _records(a, "backward", name="attention_backward")
    (fwd,) = _records(a, "forward", name="attention")
    q_bytes = fwd.in_bytes[0]
    assert attn_bwd.out_bytes == 3 * q_bytes + 2 * 5 * 5 * 4  # dq, dk, dv and the bias's gradient
    without = analyze(_LearnedBias().requires_grad_(True), inputs=(torch.randn(3, 5, 8),), dtype="fp32",
                      training=True)  # fmt: skip
    frozen = _LearnedBias()
    frozen.rel.requires_grad_(False)
    less = analyze(frozen, inputs=(torch.randn(3, 5, 8),), dtype="fp32", training=True)
    updated = [sum(r.bytes for r in _records(x, "optimizer")) for x in (less, without)]
    assert updated[0] + 4 * 50 * 4 <= updated[1]  # at least the bias, its gradient and its moments, read or written


def test_gradient_checkpointing_is_off_for_the_count_and_restored():
    model = configs.build_model("sd15", tiny=True, device="meta", dtype=torch.float16)
    model.enable_gradient_checkpointing()
    a = analyze(model, training=True)
    assert any("gradient checkpointing" in note for note in a.notes)
    assert model.is_gradient_checkpointing
    assert a.flops_of(*C.CATEGORIES, phase="backward") == analyze("sd15", tiny=True, training=True).flops_of(
        *C.CATEGORIES, phase="backward"
    )


@pytest.mark.parametrize("name", configs.names())
def test_a_patched_model_counts_the_stock_models_flops(name):
    # ldmopt's ops counted by the formulas of the operators they replace: the same work, whatever the fusion.
    stock = analyze(name, tiny=True)
    patched = analyze(name, tiny=True, patched=True)
    assert patched.categories[C.LDMOPT].ops > 0 or name.endswith("vae")
    if name.startswith("svd"):  # the single-key attention shortcut skips attn2's queries and attention
        assert 0.5 * stock.total_flops < patched.total_flops < stock.total_flops
    else:
        assert patched.total_flops == stock.total_flops
    assert any("ldmopt.patch leaves it" in note for note in patched.notes)


@pytest.mark.parametrize("name", ["sd15", "dit", "animatediff"])
def test_the_patched_models_recording_agrees_with_the_fusion_rules(name):
    # Two independent projections of the patched model: the fusion rules on the stock recording, and the recording
    # of the model as ldmopt patches it.
    stock = analyze(name, placement="triton")  # what the patched ops run on meta (not cuda)
    patched = analyze(name, patched=True)
    assert patched.time_s == pytest.approx(stock.patched_time_s, rel=0.05)
    assert patched.time_s < 0.9 * stock.time_s


def test_a_patched_training_step_is_counted_forward_and_backward():
    stock = analyze("sd15", tiny=True, training=True)
    patched = analyze("sd15", tiny=True, training=True, patched=True)
    for phase in ("forward", "backward"):
        assert patched.flops_of(*C.CATEGORIES, phase=phase) == stock.flops_of(*C.CATEGORIES, phase=phase)
    assert _records(patched, "backward", category=C.LDMOPT)  # the fused ops' own backward kernels
    assert patched.phase_time_s("backward") < stock.phase_time_s("backward")
