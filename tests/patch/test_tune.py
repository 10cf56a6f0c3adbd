"""ldmopt.tune: patches exactly the sites measured faster, says why for the others, and can be undone like patch.

Most tests replace the measurement (``_measure``) with a table of times per site and configuration, so that the
decisions are deterministic; the timer itself is tested with a fake clock and fake CUDA events, and one test runs the
real timer end to end."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from torch import nn

import ldmopt

from . import models
from .helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot

tune_module = importlib.import_module("ldmopt.patch.tune")


def _unet():
    return models.sd15_unet().eval()


def _run(model, family="sd15"):
    kwargs = models.inputs(family, model)

    def run():  # the reference backend: the interpreter's kernels are tested elsewhere, this is about the choice
        with torch.no_grad(), ldmopt.use_backend("torch"):
            return model(**kwargs)

    return run


def _patched_keys(pipe_or_model) -> set:
    return {s.key for s in tune_module._sites(pipe_or_model)} if ldmopt.is_patched(pipe_or_model) else set()


def _fake_measure(monkeypatch, pipe_or_model, cost, *, wall=None, calls=None, call_run=False):
    """Replace the measurement: ``cost(key, rules, patched_keys)`` gives a site's seconds in the current
    configuration, ``wall(patched_keys, site_seconds)`` the run() call's (default: their sum)."""
    configurations = []

    def measure(run, sites, modules, *, warmup, repeats, cuda, whole):
        if call_run:
            run()
        patched = _patched_keys(pipe_or_model)
        configurations.append(patched)
        rules = {s.key: tuple(r for r, _ in s.rules) for s in sites}
        seconds = {key: cost(key, rules[key], patched) for key in rules}
        counts = {key: (calls(key, patched) if calls else 1) for key in rules}
        total = wall(patched, seconds) if wall else sum(seconds.values())
        return tune_module._Measurement(seconds, counts, total)

    monkeypatch.setattr(tune_module, "_measure", measure)
    return configurations


def _fused_faster_for(*faster_rules):
    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        return 0.5 if set(rules) & set(faster_rules) else 2.0

    return cost


def test_keeps_exactly_the_sites_measured_faster(monkeypatch):
    unet = _unet()
    run = _run(unet)
    before = snapshot(unet)
    stock_out = output_tensor(run())
    configurations = _fake_measure(monkeypatch, unet, _fused_faster_for("residual_block"))
    report = ldmopt.tune(unet, run)

    tuning = report.tuning
    kept = {(s.model, s.name) for s in tuning.kept}
    assert kept and all(s.rules == ("residual_block",) for s in tuning.kept)
    assert _patched_keys(unet) == kept, "the model must end patched at exactly the kept sites"
    assert {(r.model, r.name) for r in report.replaced} == kept
    assert report.counts() == {"residual_block": len(kept)}
    # every other site is listed as left stock, with the times that decided it
    rejected = {(s.model, s.name): s for s in report.skipped if s.reasons[0].startswith("tune:")}
    assert set(rejected) == {(s.model, s.name) for s in tuning.sites} - kept
    resnet = next(s for key, s in rejected.items() if s.rule == "resnet")
    assert resnet.reasons == ("tune: fused 2000.000 ms vs stock 1000.000 ms per run() call: no faster",)
    # stock, every site patched, then the kept sites: no site dropped out, so one refinement round
    assert len(configurations) == 3 and configurations[0] == {(s.model, s.name) for s in tuning.sites}
    assert configurations[1] == set() and configurations[2] == kept
    assert tuning.rounds == 2 and not tuning.left_stock
    assert tuning.tuned_ms < tuning.stock_ms < tuning.all_patched_ms
    text = str(report)
    assert "ldmopt.tune (time.perf_counter" in text and f"{len(kept)} of {len(tuning.sites)} sites kept" in text

    assert_outputs_close(output_tensor(run()), stock_out)
    assert ldmopt.unpatch(unet) == len(kept)
    assert_same_snapshot(before, snapshot(unet))


def test_drops_a_site_that_was_faster_only_beside_patched_neighbours(monkeypatch):
    unet = _unet()
    run = _run(unet)

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        if rules == ("residual_block",):  # fast only while the resnets hand it their statistics
            resnets = any(".resnets." in name for _, name in patched)
            return 0.5 if resnets else 1.5
        return 2.0

    configurations = _fake_measure(monkeypatch, unet, cost)
    report = ldmopt.tune(unet, run)
    assert not ldmopt.is_patched(unet) and report.replaced == [] and report.tuning.kept == []
    assert len(configurations) == 3  # every site, stock, the residual blocks alone (then none is left)
    dropped = [s for s in report.tuning.sites if s.rules == ("residual_block",)]
    assert dropped and all(s.tuned_ms == 1500.0 for s in dropped)
    assert all("1500.000 ms with the slower sites stock (round 2)" in s.why for s in dropped)
    assert report.converted_weights == {}, "the weights the first patch converted were restored"


def test_rounds_one_measures_the_kept_sites_once_and_drops_nothing(monkeypatch):
    unet = _unet()
    run = _run(unet)

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        return 0.5 if len(patched) > 4 else 1.5  # faster only with every site patched

    _fake_measure(monkeypatch, unet, cost, wall=lambda patched, seconds: 1.0 if patched else 100.0)
    report = ldmopt.tune(unet, run, rounds=1)
    assert report.tuning.rounds == 2 and len(report.tuning.kept) == len(report.tuning.sites)
    ldmopt.unpatch(unet)


def test_leaves_the_model_stock_when_the_whole_call_is_not_faster(monkeypatch):
    unet = _unet()
    run = _run(unet)
    before = snapshot(unet)
    _fake_measure(
        monkeypatch, unet, _fused_faster_for("resnet"), wall=lambda patched, seconds: 10.0 if patched else 9.0
    )
    report = ldmopt.tune(unet, run)
    assert report.tuning.left_stock and report.tuning.kept == [] and report.replaced == []
    assert not ldmopt.is_patched(unet)
    assert_same_snapshot(before, snapshot(unet))
    resnets = [s for s in report.skipped if s.rule == "resnet"]
    assert resnets and all("10000.000 ms per run() call against 9000.000 ms stock" in s.reasons[0] for s in resnets)
    assert "every site left stock" in str(report)


def test_min_speedup_is_the_bar_for_sites_and_for_the_whole_call(monkeypatch):
    unet = _unet()
    run = _run(unet)
    # resnets 0.5 s fused against 1.0 s stock (2x); the whole call 2x too
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), wall=lambda patched, seconds: 1.0 if patched else 2.0)
    report = ldmopt.tune(unet, run, min_speedup=2.5)
    assert report.tuning.kept == [] and not ldmopt.is_patched(unet)
    report = ldmopt.tune(unet, run, min_speedup=1.5)
    assert {s.rules for s in report.tuning.kept} == {("resnet",)}
    ldmopt.unpatch(unet)


def test_sites_run_never_calls_stay_stock(monkeypatch):
    unet = _unet()
    run = _run(unet)

    def calls(key, patched):
        return 0 if key[1].startswith("up_blocks") else 1

    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 0.5 if key in patched else 1.0, calls=calls)
    report = ldmopt.tune(unet, run)
    for site in report.tuning.sites:
        assert site.kept == (not site.name.startswith("up_blocks")), site
        if not site.kept:
            assert site.why == "tune: run() never called it, so it was not measured" and site.stock_ms is None
    ldmopt.unpatch(unet)


def test_user_filter_and_families_are_honoured(monkeypatch):
    unet = _unet()
    run = _run(unet)
    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 0.5 if key in patched else 1.0)
    report = ldmopt.tune(unet, run, families=("gn_conv",), filter_fn=lambda m, name: "mid_block" not in name)
    sites = report.tuning.sites
    assert sites and all(s.kept and "mid_block" not in s.name for s in sites)
    assert {r.family for r in report.replaced} == {"gn_conv"}
    excluded = [s for s in report.skipped if s.by_user]
    assert excluded and all(s.reasons == ("excluded by filter_fn",) for s in excluded)
    ldmopt.unpatch(unet)


def test_a_pipeline_is_tuned_per_component(monkeypatch):
    unet, vae = _unet(), models.vae().eval()
    pipe = types.SimpleNamespace(components={"unet": unet, "vae": vae})
    run_unet = _run(unet)
    run_vae = _run(vae, "vae")

    def run():
        run_unet()
        run_vae()

    _fake_measure(
        monkeypatch, pipe, lambda key, rules, patched: (0.5 if key[0] == "vae" else 2.0) if key in patched else 1.0
    )
    report = ldmopt.tune(pipe, run)
    assert {s.model for s in report.tuning.kept} == {"vae"}
    assert ldmopt.is_patched(vae) and not ldmopt.is_patched(unet)
    assert report.converted_weights and set(report.converted_weights) == {"vae"}
    ldmopt.unpatch(pipe)
    assert not ldmopt.is_patched(pipe)


@pytest.mark.parametrize("phase", [0, 1, 2])
def test_run_that_raises_leaves_the_model_stock(monkeypatch, phase):
    unet = _unet()
    run = _run(unet)
    before = snapshot(unet)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) > phase:
            raise RuntimeError("out of memory (simulated)")
        run()

    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), call_run=True)
    with pytest.raises(RuntimeError, match="simulated"):
        ldmopt.tune(unet, failing)
    assert not ldmopt.is_patched(unet)
    assert_same_snapshot(before, snapshot(unet))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(repeats=0), "repeats=0 is not supported; expected an int >= 1"),
        (dict(warmup=-1), "warmup=-1"),
        (dict(rounds=1.5), "rounds=1.5"),
        (dict(min_speedup=0), "min_speedup=0 is not supported"),
        (dict(min_speedup=float("inf")), "expected a finite number"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    unet = _unet()
    with pytest.raises(ValueError, match=message):
        ldmopt.tune(unet, lambda: None, **kwargs)
    with pytest.raises(TypeError, match="run must be a callable"):
        ldmopt.tune(unet, None)
    assert not ldmopt.is_patched(unet)


def test_an_already_patched_model_is_refused():
    unet = _unet()
    ldmopt.patch(unet)
    with pytest.raises(ldmopt.patch.PatchError, match="already patched"):
        ldmopt.tune(unet, lambda: None)
    ldmopt.unpatch(unet)


# ------------------------------------------------------------------------------------------------ the timer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Costly(nn.Module):
    def __init__(self, clock, seconds, inner=None):
        super().__init__()
        self.clock, self.seconds, self.inner = clock, seconds, inner

    def forward(self, x):
        self.clock.now += self.seconds
        return self.inner(x) if self.inner is not None else x


def _toy_sites(clock):
    inner = _Costly(clock, 3.0)
    outer = _Costly(clock, 5.0, inner)
    root = nn.Sequential(outer)
    sites = [
        tune_module._Site(("", "0"), outer, [("outer_rule", "f")]),
        tune_module._Site(("", "0.inner"), inner, [("inner_rule", "f")]),
    ]
    return root, sites


def test_site_times_exclude_the_sites_nested_in_them(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tune_module, "time", clock)
    root, sites = _toy_sites(clock)
    runs = []

    def run():
        runs.append(1)
        root(torch.ones(1))
        clock.now += 100.0  # outside every site

    measured = tune_module._measure(run, sites, {}, warmup=2, repeats=3, cuda=False, whole=frozenset())
    assert len(runs) == 5
    assert measured.site_s == {("", "0"): 5.0, ("", "0.inner"): 3.0}
    assert measured.calls == {("", "0"): 1, ("", "0.inner"): 1} and measured.wall_s == 108.0
    whole = tune_module._measure(run, sites, {}, warmup=0, repeats=1, cuda=False, whole=frozenset({("", "0.inner")}))
    assert whole.site_s[("", "0")] == 8.0, "a site run within its parent's fused forward counts in the parent's time"
    assert not sites[0].module._forward_hooks and not sites[0].module._forward_pre_hooks, "hooks removed"


def test_cuda_timer_uses_events_on_the_stream(monkeypatch):
    clock = _Clock()
    root, sites = _toy_sites(clock)

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock.now

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report

    synchronized = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(1))
    measured = tune_module._measure(
        lambda: root(torch.ones(1)), sites, {}, warmup=1, repeats=2, cuda=True, whole=frozenset()
    )
    assert measured.site_s == {("", "0"): 5.0, ("", "0.inner"): 3.0}
    assert len(synchronized) == 4  # around each timed call


def test_real_timer_end_to_end():
    """The real measurement on the CPU: with a bar every fused site clears, tune patches what patch would."""
    unet = _unet()
    run = _run(unet)
    stock_out = output_tensor(run())
    plain = ldmopt.patch(unet)
    ldmopt.unpatch(unet)
    report = ldmopt.tune(unet, run, warmup=1, repeats=1, min_speedup=1e-9)
    tuning = report.tuning
    assert tuning.timer == "time.perf_counter" and not tuning.left_stock
    assert all(s.calls >= 1 and s.stock_ms > 0 and s.kept for s in tuning.sites)
    assert report.counts() == plain.counts() and _patched_keys(unet) == {(s.model, s.name) for s in tuning.sites}
    assert_outputs_close(output_tensor(run()), stock_out)
    ldmopt.unpatch(unet)


@pytest.mark.parametrize("block", ["faster", "slower", "faster beside the resnets"])
def test_a_site_run_inside_its_parents_fused_forward_follows_it(monkeypatch, block):
    """A nested site the patched model does not call as a module (its parent's fused forward does its work) is
    decided with the parent; with the parent left stock it is measured on its own in the next round."""
    unet = _unet()
    run = _run(unet)

    def calls(key, patched):
        if key[1].endswith(".ff.net.0"):
            return 0 if (key[0], key[1].removesuffix(".ff.net.0")) in patched else 1
        return 1

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        if rules == ("residual_block",):
            resnets = any(".resnets." in name for _, name in patched)
            return 0.5 if block == "faster" or (block != "slower" and resnets) else 2.0
        return 0.5 if rules == ("geglu",) else 2.0

    configurations = _fake_measure(monkeypatch, unet, cost, calls=calls)
    report = ldmopt.tune(unet, run)
    kept = {s.name: s for s in report.tuning.kept}
    gegl = [s for s in report.tuning.sites if s.rules == ("geglu",)]
    assert gegl and all(s.kept for s in gegl)
    for s in gegl:
        parent = s.name.removesuffix(".ff.net.0")
        if block == "faster":
            assert parent in kept and s.why == f"kept with {parent}, whose fused forward runs it in place"
            assert s.tuned_ms is None
        else:
            assert parent not in kept and s.why == f"measured on its own, {parent} being stock"
            assert s.tuned_ms == 500.0
    # every site, stock, the kept ones (and again without the blocks that dropped out)
    assert len(configurations) == (4 if block == "faster beside the resnets" else 3)
    ldmopt.unpatch(unet)


def test_cli_tunes_a_zoo_model(tmp_path, capsys):
    import json

    from ldmopt.cli import main

    path = tmp_path / "out" / "tuning.json"
    with ldmopt.use_backend("torch"):
        assert main(["tune", "sd15", "--tiny", "--warmup", "1", "--repeats", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ldmopt.tune (time.perf_counter; median of 1 calls after 1 warm-up")
    data = json.loads(path.read_text())
    assert data["model"] == "sd15" and data["timer"] == "time.perf_counter" and data["sites"]
    assert {"resnet", "residual_block"} <= {rule for site in data["sites"] for rule in site["rules"]}
    assert main(["tune", "sd15", "--tiny", "--min-speedup", "0"]) == 2
    assert capsys.readouterr().err.startswith("ldmopt.tune: min_speedup=0.0 is not supported")
