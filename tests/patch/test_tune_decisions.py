"""What ldmopt.tune and ldmopt.patch_tuned decide and report (tune.py, tune_choice.py, tune_timer.py): ties,
the hook-free whole-call figures, per-site bookkeeping, the choice's round trip, patch_tuned's refusals and the
timer's medians. The measurements are replaced with tables (test_tune's fakes) or a fake clock (test_tune_timer's)."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt.patch import PatchError

from . import models
from .test_tune import _fake_measure, _fused_faster_for, _geglu_in_its_block, _patched_keys, _run, _unet, tune_module
from .test_tune_timer import _Clock, _Costly, _toy, tune_timer


def _hook_free(monkeypatch, model, patched_s, stock_s, calls=None):
    """The hook-free whole-call timing: ``patched_s`` with any site patched, ``stock_s`` without."""

    def wall_time(run, devices, *, warmup, repeats, graph=False):
        if calls is not None:
            calls.append(_patched_keys(model))
        return patched_s if _patched_keys(model) else stock_s

    monkeypatch.setattr(tune_module, "wall_time", wall_time)


def _resnets_slower_and_blocks_fast_beside_them(key, rules, patched):
    """Residual blocks faster only while the resnets (slower) are patched beside them: they drop out in round 2."""
    if key not in patched:
        return 1.0
    if rules == ("residual_block",):
        return 0.5 if any(".resnets." in name for _, name in patched) else 1.5
    return 2.0


# ------------------------------------------------------------------------------------------------ tune: decisions


def test_a_site_no_faster_than_stock_is_not_kept(monkeypatch):
    """A site whose fused time equals its stock time does not pay: only sites strictly faster are kept."""
    unet = _unet()

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        return 0.5 if rules == ("residual_block",) else 1.0  # every other site: a tie

    _fake_measure(monkeypatch, unet, cost, wall=lambda patched, seconds: 1.0 if patched else 2.0)
    report = ldmopt.tune(unet, _run(unet))
    assert {s.rules for s in report.tuning.kept} == {("residual_block",)}
    resnet = next(s for s in report.tuning.sites if s.rules == ("resnet",))
    assert resnet.why == "tune: fused 1000.000 ms vs stock 1000.000 ms per run() call: no faster"
    ldmopt.unpatch(unet)


def test_a_tuned_call_that_only_ties_stock_is_left_stock(monkeypatch):
    """The tuned model must be faster than stock as a whole: a tie leaves every site stock, and the report of the
    stock model keeps no weight-layout reason of the first patch."""
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"))
    _hook_free(monkeypatch, unet, 2.0, 2.0)
    report = ldmopt.tune(unet, _run(unet), channels_last_weights=False)
    assert report.tuning.left_stock and report.tuning.kept == [] and not ldmopt.is_patched(unet)
    assert report.kept_weights == {} and report.kept_weights_reason == ""


def test_every_site_patched_must_beat_the_choice_not_tie_it(monkeypatch):
    """Every site patched is kept over the sites faster on their own only when its whole call is faster still."""
    unet = _unet()

    def hooked(patched, seconds):  # every site patched faster than the resnets alone, hooks attached
        return 0.5 if len(patched) > 10 else 1.0 if patched else 2.0

    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), wall=hooked)
    whole_calls = []
    _hook_free(monkeypatch, unet, 1.0, 2.0, whole_calls)  # without hooks: the resnets alone and every site, 1.0 s
    report = ldmopt.tune(unet, _run(unet))
    assert len(whole_calls) == 3 and len(whole_calls[1]) == len(report.tuning.sites)  # every site was timed
    assert {s.rules for s in report.tuning.kept} == {("resnet",)} and report.tuning.tuned_ms == 1000.0
    assert all(s.why == "" for s in report.tuning.kept)
    ldmopt.unpatch(unet)


def test_no_extra_whole_call_when_the_choice_already_is_every_site(monkeypatch):
    """With every site kept on its own, a noisy hooked measurement never adds an 'every site patched' round."""
    unet = _unet()
    hooked = iter([1.0, 2.0, 1.5])  # every site patched, stock, the kept (every) sites again
    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 0.5 if key in patched else 1.0,
                  wall=lambda patched, seconds: next(hooked))  # fmt: skip
    whole_calls = []
    _hook_free(monkeypatch, unet, 1.0, 2.0, whole_calls)
    tuning = ldmopt.tune(unet, _run(unet)).tuning
    assert len(tuning.kept) == len(tuning.sites) and tuning.rounds == 2
    assert len(whole_calls) == 2 and all(s.why == "" for s in tuning.kept)  # tuned, then stock
    ldmopt.unpatch(unet)


def test_a_site_kept_on_an_earlier_rounds_word_says_so(monkeypatch):
    """rounds=1: the last measurement is the tuned one and checks nothing; a kept site slower there stays kept, with
    that round's time and a reason saying so."""
    unet = _unet()
    _fake_measure(monkeypatch, unet, _resnets_slower_and_blocks_fast_beside_them,
                  wall=lambda patched, seconds: 1.0 if patched else 2.0)  # fmt: skip
    report = ldmopt.tune(unet, _run(unet), rounds=1)
    blocks = [s for s in report.tuning.sites if s.rules == ("residual_block",)]
    assert blocks and all(s.kept and s.tuned_ms == 1500.0 for s in blocks)
    assert {s.why for s in blocks} == {"kept: faster in an earlier round; the last (tuned) measurement checks nothing"}
    ldmopt.unpatch(unet)


def test_a_site_not_called_with_every_site_patched_is_not_measured(monkeypatch):
    """A site run() calls stock but not with every site patched (and not inside an enclosing site) is not timed
    fused: it stays stock, whatever its table says."""
    unet = _unet()
    absent = ("", "mid_block.resnets.1")
    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 0.5 if key in patched else 1.0,
                  calls=lambda key, patched: 0 if key == absent and key in patched else 1,
                  wall=lambda patched, seconds: 1.0 if patched else 2.0)  # fmt: skip
    report = ldmopt.tune(unet, _run(unet))
    site = next(s for s in report.tuning.sites if (s.model, s.name) == absent)
    assert not site.kept and site.why == "tune: run() did not call it with every site patched, so it was not measured"
    assert absent not in _patched_keys(unet) and len(report.tuning.kept) == len(report.tuning.sites) - 1
    ldmopt.unpatch(unet)


def test_sites_run_in_place_are_timed_with_their_enclosing_site_and_counted_as_stock_calls(monkeypatch):
    """GEGLUs that the fused blocks run in place are passed to the timer as ``whole`` for every later configuration
    (their time stays in the block's, as it did fused); a site's ``calls`` are the stock model's calls."""
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for("residual_block", "geglu"), calls=_geglu_in_its_block)
    fake, wholes = tune_module.measure, []

    def measure(run, targets, devices, *, warmup, repeats, whole):
        wholes.append(whole)
        return fake(run, targets, devices, warmup=warmup, repeats=repeats, whole=whole)

    monkeypatch.setattr(tune_module, "measure", measure)
    report = ldmopt.tune(unet, _run(unet))
    geglus = frozenset((s.model, s.name) for s in report.tuning.sites if s.rules == ("geglu",))
    assert geglus and wholes[0] == frozenset() and wholes[1:] == [geglus] * (len(wholes) - 1)
    assert all(s.calls == 1 for s in report.tuning.sites)
    ldmopt.unpatch(unet)


def test_a_site_run_in_place_two_levels_down_follows_the_site_it_ran_in(monkeypatch):
    """Every container (transformer2d_in) faster in round 1 runs its block and the block's GEGLU in place; in round
    2 the containers drop out: in that last checking round the GEGLUs ran inside them (not in their blocks, which
    were never called), so they drop out with them, unchecked."""
    unet = _unet()

    def container(name):
        return name.rsplit(".transformer_blocks.", 1)[0] if ".transformer_blocks." in name else None

    def calls(key, patched):
        label, name = key
        if name.endswith(".ff.net.0"):
            block = name.removesuffix(".ff.net.0")
            return 0 if (label, block) in patched or (label, container(block)) in patched else 1
        if name.endswith(".transformer_blocks.0") and (label, container(name)) in patched:
            return 0
        return 1

    def cost(key, rules, patched):  # the containers fast only beside the resnets, which are slower
        if key not in patched:
            return 1.0
        return 0.5 if rules == ("transformer2d_in",) and any(".resnets." in n for _, n in patched) else 2.0

    _fake_measure(monkeypatch, unet, cost, calls=calls)
    report = ldmopt.tune(unet, _run(unet), rounds=2)
    gegl = [s for s in report.tuning.sites if s.rules == ("geglu",)]
    assert gegl and not any(s.kept for s in gegl)
    for s in gegl:
        outer = container(s.name)
        assert s.why == f"tune: measured only within {outer}'s fused forward, which dropped out in the last round"
    assert not ldmopt.is_patched(unet)


def test_stock_and_tuned_figures_are_the_hook_free_ones(monkeypatch):
    """Tuning.stock_ms and tuned_ms come from the hook-free whole calls, all_patched_ms from the first (hooked)
    measurement; the choice records the same two figures, each under its own name."""
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"))  # hooked: the sum of the sites' seconds
    _hook_free(monkeypatch, unet, 1.0, 3.0)
    tuning = ldmopt.tune(unet, _run(unet)).tuning
    ldmopt.unpatch(unet)
    assert (tuning.stock_ms, tuning.tuned_ms) == (3000.0, 1000.0)
    assert tuning.all_patched_ms == 1000.0 * sum(0.5 if s.rules == ("resnet",) else 2.0 for s in tuning.sites)
    choice = tuning.choice()
    assert (choice["stock_ms"], choice["tuned_ms"]) == (3000.0, 1000.0)


class _Watch(torch.overrides.TorchFunctionMode):
    """A torch function mode from outside torch (as PAG's): fused attention processors fall back under it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_model_left_stock_reports_no_fallbacks_of_the_undone_patch(monkeypatch):
    """The processors the first patch installed (and tune's calls ran, falling back) are gone from a model left
    stock: its report counts no fall-backs."""
    model = models.svd().eval()  # its temporal and single-key attention: processors that count fall-backs
    run = _run(model, "svd")

    def watched():
        with _Watch():
            return run()

    _fake_measure(monkeypatch, model, lambda key, rules, patched: 2.0 if key in patched else 1.0, call_run=True)
    report = ldmopt.tune(model, watched)
    assert not ldmopt.is_patched(model) and report.tuning.kept == []
    assert report.fallbacks() == {}


# ------------------------------------------------------------------------------------------------ the choice


def _flux_choice(monkeypatch):
    flux = models.flux().eval()
    _fake_measure(monkeypatch, flux, lambda key, rules, patched: 0.5 if key in patched else 1.0)
    report = ldmopt.tune(flux, _run(flux, "flux"))
    ldmopt.unpatch(flux)
    return flux, report


def test_a_site_with_several_rules_round_trips_all_of_them(monkeypatch, tmp_path):
    """Flux's single block is one site of two rules: the saved choice names both, and patch_tuned applies both."""
    flux, report = _flux_choice(monkeypatch)
    path = report.tuning.save(tmp_path / "choice.json")
    single = next(s for s in json.loads(path.read_text())["sites"] if s["name"] == "single_transformer_blocks.0")
    assert single["rules"] == ["flux_single_gated", "flux_mlp"] and single["kept"]
    applied = ldmopt.patch_tuned(flux, path)
    rules = {r.rule for r in applied.replaced if r.name == "single_transformer_blocks.0"}
    assert rules == {"flux_single_gated", "flux_mlp"}
    ldmopt.unpatch(flux)


def test_the_callers_filter_speaks_for_each_rule_of_a_kept_site(monkeypatch):
    """A caller's filter that rejects a child one rule of a kept site fuses leaves that rule off, and the report
    lists it as the caller's exclusion (as patch does); the site's other rule is still applied."""
    flux, report = _flux_choice(monkeypatch)
    applied = ldmopt.patch_tuned(flux, report, filter_fn=lambda module, name: not name.endswith(".proj_mlp"))
    rules = {r.rule for r in applied.replaced if r.name == "single_transformer_blocks.0"}
    assert rules == {"flux_single_gated"}
    (skipped,) = [s for s in applied.skipped if s.name == "single_transformer_blocks.0"]
    assert skipped.rule == "flux_mlp" and skipped.by_user and "excluded by filter_fn" in skipped.reasons[0], skipped
    assert isinstance(flux.single_transformer_blocks[0].proj_mlp, nn.Linear)
    ldmopt.unpatch(flux)


def _choice(monkeypatch):
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"))
    choice = ldmopt.tune(unet, _run(unet)).tuning.choice()
    ldmopt.unpatch(unet)
    return unet, choice


def test_patch_tuned_refuses_another_version_and_a_kept_that_is_no_flag(monkeypatch):
    """A choice of another format version, or whose ``kept`` is not true/false ("false" is truthy), is refused."""
    unet, choice = _choice(monkeypatch)
    with pytest.raises(ValueError, match="version=2; supported"):
        ldmopt.patch_tuned(unet, {**choice, "version": 2})
    sites = [{**s, "kept": "false"} if i == 0 else s for i, s in enumerate(choice["sites"])]
    with pytest.raises(ValueError, match=r"choice\['sites'\] must be a list"):
        ldmopt.patch_tuned(unet, {**choice, "sites": sites})
    assert not ldmopt.is_patched(unet)


def test_training_true_refuses_a_choice_timed_on_forward_passes(monkeypatch):
    """patch_tuned(training=True) refuses an inference choice (README: 'refuses a choice timed on forward
    passes'), leaving the model stock; training=False accepts it."""
    unet, choice = _choice(monkeypatch)
    with pytest.raises(PatchError, match=r"training=True, but the choice was made for inference"):
        ldmopt.patch_tuned(unet, choice, training=True)
    assert not ldmopt.is_patched(unet)
    ldmopt.patch_tuned(unet, choice, training=False)
    assert _patched_keys(unet) == {(s["model"], s["name"]) for s in choice["sites"] if s["kept"]}
    ldmopt.unpatch(unet)


def test_a_choice_measured_on_the_cpu_applies_to_a_gpu_model_silently(monkeypatch):
    """Only GPU against GPU warns: a choice that says "cpu" (an offloaded model's tune by rule) says nothing."""
    unet, choice = _choice(monkeypatch)
    assert choice["measured_on"]["device"] == "cpu"
    monkeypatch.setattr(tune_module, "_cuda_devices", lambda pipe: {torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ldmopt.patch_tuned(unet, choice)
    ldmopt.unpatch(unet)


# ------------------------------------------------------------------------------------------------ the timer


class _Varying(nn.Module):
    """Each call takes the next of ``seconds`` on the fake clock."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, itertools.cycle(seconds)

    def forward(self, x):
        self.clock.now += next(self.seconds)
        return x


def test_sites_and_whole_calls_are_medians_of_the_repeats(monkeypatch):
    """measure: a site's time and the run() call's are medians of ``repeats`` calls (not their minimum or mean);
    wall_time: the median too."""
    clock = _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    site = _Varying(clock, [1.0, 5.0, 2.0])

    def run():
        site(torch.ones(1))
        clock.now += 10.0

    measured = tune_timer.measure(run, {("", "s"): [site]}, set(), warmup=0, repeats=3, whole=frozenset())
    assert measured.site_s == {("", "s"): 2.0} and measured.wall_s == 12.0
    assert tune_timer.wall_time(run, set(), warmup=0, repeats=3) == 12.0


def test_a_site_time_is_never_negative(monkeypatch):
    """A nested site on a GPU whose events measured more than the host-timed site around it took: the outer site's
    exclusive time is 0, not negative (which would make it look faster than any stock time)."""
    clock, gpu = _Clock(), _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    inner = _Costly(gpu, 5.0)
    outer = _Costly(clock, 1.0, inner)

    class Event:
        def __init__(self, enable_timing=False, external=False):
            self.at = None

        def record(self, stream):
            self.at = gpu.now

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(tune_timer, "work_device", lambda m, a, k: torch.device("cuda" if m is inner else "cpu", 0))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: None)
    targets = {("", "outer"): [outer], ("", "inner"): [inner]}
    measured = tune_timer.measure(lambda: outer(torch.ones(1)), targets, set(), warmup=0, repeats=1, whole=frozenset())
    assert measured.site_s == {("", "outer"): 0.0, ("", "inner"): 5.0}


def _fake_graph_api(monkeypatch, device, replays):
    def fake_capture(run, warmup, on, before_capture=None):
        for _ in range(max(warmup, 1)):
            run()
        if before_capture:
            before_capture()
        run()  # captured: the hooks fire once; a replay runs no Python
        return lambda: replays.append(1)

    class Event:
        def __init__(self, enable_timing=False, external=False):
            self.at = 0.0

        def record(self, stream):
            pass

        def elapsed_time(self, end):
            return 1.0

    monkeypatch.setattr(tune_timer, "capture", fake_capture)
    monkeypatch.setattr(tune_timer, "work_device", lambda module, args, kwargs: device)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: None)


def test_a_graphed_measurement_says_it_used_cuda_events(monkeypatch):
    """measure_graphed times with CUDA events only: Measurement.cuda (tune's timer name comes from it)."""
    device, replays = torch.device("cuda", 0), []
    _fake_graph_api(monkeypatch, device, replays)
    outer, targets = _toy(_Clock())
    measured = tune_timer.measure_graphed(
        lambda: outer(torch.ones(1)), targets, {device}, warmup=0, repeats=2, whole=frozenset()
    )
    assert measured.cuda and not measured.cpu and len(replays) == 2


def test_graphed_whole_calls_run_no_eager_call_outside_the_capture(monkeypatch):
    """wall_time(graph=True): the warm-up calls are the capture's; the timed calls are replays, none eager."""
    device, replays, runs = torch.device("cuda", 0), [], []
    _fake_graph_api(monkeypatch, device, replays)
    tune_timer.wall_time(lambda: runs.append(1), {device}, warmup=3, repeats=2, graph=True)
    assert len(runs) == 3 + 1 and len(replays) == 2  # the capture's warm-up and captured call; then replays
