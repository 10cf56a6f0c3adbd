"""ldmopt.tune(by="rule"): whole run() calls timed with each rule group's sites alone patched (training's way); the
timings are replaced with a table per configuration, so that the decisions are deterministic."""

from __future__ import annotations

import pytest

import ldmopt

from . import models
from .helpers import assert_same_snapshot, output_tensor, snapshot
from .test_tune import _fake_wall, _patched_keys, _run, _unet


def test_by_rule_keeps_the_rules_whose_sites_alone_made_run_faster(monkeypatch):
    unet = _unet()
    before = snapshot(unet)
    gains = {"resnet": 0.2, "residual_block": 0.1}
    configurations = _fake_wall(monkeypatch, unet, lambda patched: 10.0 - sum(gains.get(g, -0.5) for g in patched))
    report = ldmopt.tune(unet, _run(unet), by="rule")
    tuning = report.tuning
    assert {g.rules for g in tuning.groups if g.kept} == {"resnet", "residual_block"}
    assert {s.rules for s in tuning.kept} == {("resnet",), ("residual_block",)}
    assert _patched_keys(unet) == {(s.model, s.name) for s in tuning.kept}
    assert tuning.stock_ms == 10000.0 and tuning.tuned_ms == pytest.approx(9700.0)
    # stock, every site, each group alone, the two faster groups together
    assert len(configurations) == 2 + len(tuning.groups) + 1 and tuning.rounds == len(configurations) - 1
    geglu = next(s for s in report.skipped if s.rule == "geglu")
    assert (
        "with only its rule's 4 sites patched (geglu), run() took 10500.000 ms against 10000.000 ms stock"
        in (geglu.reasons[0])
    )
    assert "rules (patched alone)" in str(report)
    ldmopt.unpatch(unet)
    assert_same_snapshot(before, snapshot(unet))


def test_by_rule_keeps_the_best_rule_alone_when_the_faster_ones_clash(monkeypatch):
    unet = _unet()

    def seconds(patched):
        if patched == {"resnet"}:
            return 9.0
        if patched == {"residual_block"}:
            return 9.5
        return 10.0 if not patched else 11.0  # together (or everything): slower

    _fake_wall(monkeypatch, unet, seconds)
    report = ldmopt.tune(unet, _run(unet), by="rule")
    assert {g.rules for g in report.tuning.groups if g.kept} == {"resnet"}
    block = next(s for s in report.skipped if s.rule == "residual_block")
    assert "but the faster rules together took 11000.000 ms, more than resnet alone (9000.000 ms)" in block.reasons[0]
    ldmopt.unpatch(unet)


def test_by_rule_keeps_every_rule_when_they_pay_only_together(monkeypatch):
    """Each group alone slower, every site patched faster (a resnet hands its statistics to the next norm): all kept."""
    unet = _unet()
    _fake_wall(monkeypatch, unet, lambda patched: 10.0 if not patched else 9.0 if len(patched) > 1 else 10.5)
    report = ldmopt.tune(unet, _run(unet), by="rule")
    tuning = report.tuning
    assert all(g.kept for g in tuning.groups) and len(tuning.kept) == len(tuning.sites)
    assert tuning.tuned_ms == tuning.all_patched_ms == 9000.0 and not tuning.left_stock
    assert _patched_keys(unet) == {(s.model, s.name) for s in tuning.sites}
    ldmopt.unpatch(unet)


def test_by_rule_leaves_the_model_stock_when_the_choice_is_no_faster(monkeypatch):
    """min_speedup below 1 lets a slower group through; the whole call must still beat stock."""
    unet = _unet()
    before = snapshot(unet)
    _fake_wall(monkeypatch, unet, lambda patched: 10.5 if patched else 10.0)
    report = ldmopt.tune(unet, _run(unet), by="rule", min_speedup=0.5)
    assert report.tuning.left_stock and not report.tuning.kept and not ldmopt.is_patched(unet)
    assert all("10500.000 ms per run() call against 10000.000 ms stock" in s.reasons[0] for s in report.skipped
               if s.reasons[0].startswith("tune:"))  # fmt: skip
    assert "every site left stock" in str(report)
    assert_same_snapshot(before, snapshot(unet))


def test_training_tunes_whole_steps_by_rule():
    """A real training step on the CPU (forward, loss, backward), timed for real: the model ends patched at exactly
    the chosen rules' sites, and unpatch restores it."""
    unet = models.sd15_unet().train()
    kwargs = models.inputs("sd15", unet)
    before = snapshot(unet)

    def step():
        with ldmopt.use_backend("torch"):
            loss = output_tensor(unet(**kwargs)).square().mean()
        loss.backward()
        unet.zero_grad(set_to_none=True)

    with pytest.raises(ValueError, match="by='site' times forward passes only"):
        ldmopt.tune(unet, step, training=True, by="site")
    with pytest.raises(ValueError, match="by='sites' is not supported"):
        ldmopt.tune(unet, step, by="sites")
    report = ldmopt.tune(unet, step, training=True, warmup=1, repeats=1)
    tuning = report.tuning
    assert tuning.timer == "whole run() calls, a configuration per rule" and tuning.groups
    chosen = {g.rules for g in tuning.groups if g.kept}
    assert {(s.model, s.name) for s in tuning.sites if "+".join(s.rules) in chosen} == _patched_keys(unet)
    ldmopt.unpatch(unet)
    assert_same_snapshot(before, snapshot(unet))
