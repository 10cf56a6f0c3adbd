"""ldmopt.tune: patches exactly the sites measured faster, says why for the others, and can be undone like patch.

Most tests replace the measurements (``measure``, ``wall_time``) with a table of times per site and configuration,
so that the decisions are deterministic; the timer itself is tested with a fake clock and fake CUDA events, and one
test runs the real timer end to end."""

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
tune_timer = importlib.import_module("ldmopt.patch.tune_timer")
tune_sites = importlib.import_module("ldmopt.patch.tune_sites")


def _unet():
    return models.sd15_unet().eval()


def _run(model, family="sd15"):
    kwargs = models.inputs(family, model)

    def run():  # the reference backend: the interpreter's kernels are tested elsewhere, this is about the choice
        with torch.no_grad(), ldmopt.use_backend("torch"):
            return model(**kwargs)

    return run


def _patched_keys(pipe_or_model) -> set:
    return {s.key for s in tune_sites.patched_sites(pipe_or_model)} if ldmopt.is_patched(pipe_or_model) else set()


def _fake_measure(monkeypatch, pipe_or_model, cost, *, wall=None, calls=None, call_run=False):
    """Replace the measurements: ``cost(key, rules, patched_keys)`` gives a site's seconds in the current
    configuration, ``wall(patched_keys, site_seconds)`` the run() call's (default: their sum)."""
    configurations = []
    sites = {}

    def seconds_now():
        patched = _patched_keys(pipe_or_model)
        seconds = {key: cost(key, rules, patched) for key, rules in sites.items()}
        return patched, seconds

    def measure(run, targets, devices, *, warmup, repeats, whole):
        if call_run:
            run()
        if not sites:  # the first measurement: every site patched
            sites.update((s.key, tuple(r for r, _ in s.rules)) for s in tune_sites.patched_sites(pipe_or_model))
        patched, seconds = seconds_now()
        configurations.append(patched)
        counts = {key: (calls(key, patched) if calls else 1) for key in sites}
        total = wall(patched, seconds) if wall else sum(seconds.values())
        return tune_timer.Measurement(seconds, counts, total, cuda=False, cpu=True)

    def wall_time(run, devices, *, warmup, repeats, graph=False):
        patched, seconds = seconds_now()
        return wall(patched, seconds) if wall else sum(seconds.values())

    monkeypatch.setattr(tune_module, "measure", measure)
    monkeypatch.setattr(tune_module, "wall_time", wall_time)
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
    per_rule = tuning.kept_per_rule()
    assert per_rule["residual_block"] == (len(kept), len(kept)) and per_rule["resnet"][0] == 0
    assert f"residual_block {len(kept)}/{len(kept)}" in text

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
    assert report.tuning.tuned_ms == 10000.0 and report.tuning.stock_ms == 9000.0
    assert "every site left stock" in str(report)


def test_sites_that_pay_only_together_are_kept_together(monkeypatch):
    """Each fused site slower on its own (its epilogue sums statistics its neighbour saves), every site patched
    faster as a whole: the whole call, timed with every site patched, keeps them all."""
    unet = _unet()
    ldmopt.patch(unet)
    every = {s.key for s in tune_sites.patched_sites(unet)}
    ldmopt.unpatch(unet)

    def wall(patched, seconds):
        return 1.0 if patched == every else 10.0 if not patched else sum(seconds.values())

    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 2.0 if key in patched else 1.0, wall=wall)
    report = ldmopt.tune(unet, _run(unet))
    tuning = report.tuning
    assert _patched_keys(unet) == every and {(s.model, s.name) for s in tuning.kept} == every
    assert tuning.tuned_ms == 1000.0 and tuning.stock_ms == 10000.0 and not tuning.left_stock
    assert all(s.why.startswith("kept: no site was faster on its own, but every site patched") for s in tuning.kept)
    assert all(s.tuned_ms == s.fused_ms == 2000.0 for s in tuning.kept)  # the first measurement's configuration
    assert tuning.rounds == 2  # every site patched, with hooks and without
    assert not [s for s in report.skipped if s.reasons[0].startswith("tune:")]
    ldmopt.unpatch(unet)
    # the resnets faster only beside every other site: dropped in round 2, and then every site patched, not the
    # dropped resnets' configuration, is what stock is weighed against
    resnets = {key for key in every if ".resnets." in key[1]}

    def resnets_with_all(key, rules, patched):
        return 1.0 if key not in patched else 0.5 if key in resnets and patched == every else 2.0

    def stale(patched, seconds):
        return 8.0 if patched == every else 7.0 if patched == resnets else 10.0

    _fake_measure(monkeypatch, unet, resnets_with_all, wall=stale)
    report = ldmopt.tune(unet, _run(unet))
    assert _patched_keys(unet) == every and report.tuning.tuned_ms == 8000.0
    ldmopt.unpatch(unet)
    # every site patched faster with hooks, but not without them: the sites faster on their own stay, alone
    resnets = {key for key in every if "resnets" in key[1] and "upsamplers" not in key[1]}

    def hooked(patched, seconds):
        return 0.5 if patched == every else 1.0 if patched and patched <= resnets else 10.0

    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), wall=hooked)
    hooked_wall_time, every_timed = tune_module.wall_time, []

    def hook_free(run, devices, *, warmup, repeats, graph=False):
        if _patched_keys(unet) == every:
            every_timed.append(True)
            return 3.0
        return hooked_wall_time(run, devices, warmup=warmup, repeats=repeats)

    monkeypatch.setattr(tune_module, "wall_time", hook_free)
    report = ldmopt.tune(unet, _run(unet))
    assert every_timed == [True]  # measured, and slower than the resnets alone
    assert {s.rules for s in report.tuning.kept} == {("resnet",)} and report.tuning.tuned_ms == 1000.0
    ldmopt.unpatch(unet)


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
            assert site.why == "tune: run() never called it on the stock model, so it was not measured"
            assert site.stock_ms is None
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


def test_families_may_be_any_iterable(monkeypatch):
    unet = _unet()
    _fake_measure(monkeypatch, unet, lambda key, rules, patched: 0.5 if key in patched else 1.0)
    report = ldmopt.tune(unet, _run(unet), families=(f for f in ["gn_conv", "feed_forward"]))
    assert report.tuning.kept and len(report.replaced) == len(report.tuning.sites)
    assert {r.family for r in report.replaced} == {"gn_conv", "feed_forward"}
    ldmopt.unpatch(unet)


def test_a_component_inside_another_counts_its_sites_once(monkeypatch):
    unet = _unet()
    pipe = types.SimpleNamespace(components={"blocks": unet.down_blocks, "unet": unet})
    _fake_measure(monkeypatch, pipe, lambda key, rules, patched: 0.5 if key in patched else 1.0)
    report = ldmopt.tune(pipe, _run(unet))
    assert all(len(s.rules) == 1 for s in report.tuning.sites), [s.rules for s in report.tuning.sites]
    assert len(report.replaced) == len(report.tuning.sites)
    ldmopt.unpatch(pipe)


def test_a_child_swap_site_at_the_root_encloses_only_its_slots():
    unet = _unet()
    ldmopt.patch(unet)
    sites = tune_sites.patched_sites(unet)
    ldmopt.unpatch(unet)
    parents = tune_sites.enclosing_sites(sites)
    assert parents[("", "mid_block.resnets.0")] is None
    geglu = next(key for key in parents if key[1].endswith("ff.net.0"))
    assert parents[geglu] == (geglu[0], geglu[1].removesuffix(".ff.net.0"))


def test_sites_are_timed_where_their_rules_edit():
    """A rule that swaps children of a whole model (the GroupNorm + SiLU output head) is timed at those slots, not
    as everything else the model does; a rule on the module itself is timed as the module."""
    unet = _unet()
    ldmopt.patch(unet)
    targets = {s.key[1]: s.targets for s in tune_sites.patched_sites(unet)}
    ldmopt.unpatch(unet)
    assert targets[""] == ["conv_norm_out", "conv_act"]
    geglu = next(name for name in targets if name.endswith("ff.net.0"))
    assert targets[geglu] == [geglu] and targets["mid_block.resnets.0"] == ["mid_block.resnets.0"]


def test_a_model_without_sites_is_left_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    calls = []
    report = ldmopt.tune(model, lambda: calls.append(1))
    assert not calls and not ldmopt.is_patched(model) and report.replaced == []
    assert str(report.tuning) == "ldmopt.tune: patch fuses no module of this model: nothing to tune"


def test_backend_counts_start_after_tune(monkeypatch):
    unet = _unet()
    run = _run(unet)
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), call_run=True)
    report = ldmopt.tune(unet, run)
    assert report.tuning.kept and report.backends() == {} and report.fallbacks() == {}
    run()
    assert report.backends()["gn_conv2d"] == {"torch": 2 * len(report.tuning.kept)}
    ldmopt.unpatch(unet)


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


def test_a_model_on_meta_is_refused():
    # Calls on meta run no kernel: tune "kept" most sites on Python's time, and the choice said "cpu".
    unet = _unet().to("meta")
    with pytest.raises(ValueError, match=r"UNet2DConditionModel has parameters on the meta device.*ldmopt\.analyze"):
        ldmopt.tune(unet, lambda: None)
    assert not ldmopt.is_patched(unet)


def test_an_already_patched_model_is_refused():
    unet = _unet()
    ldmopt.patch(unet)
    with pytest.raises(ldmopt.patch.PatchError, match="already patched"):
        ldmopt.tune(unet, lambda: None)
    ldmopt.unpatch(unet)


def _geglu_in_its_block(key, patched):
    """Calls of a site per run(): a GEGLU runs inside its transformer block's fused forward (not as a module)."""
    if key[1].endswith(".ff.net.0"):
        return 0 if (key[0], key[1].removesuffix(".ff.net.0")) in patched else 1
    return 1


def test_a_site_freed_in_the_last_round_is_not_kept_unchecked(monkeypatch):
    unet = _unet()

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        if rules == ("residual_block",):  # faster only beside the resnets, which are slower: drops in round 2
            return 0.5 if any(".resnets." in name for _, name in patched) else 2.0
        return 0.5 if rules == ("geglu",) else 2.0

    _fake_measure(monkeypatch, unet, cost, calls=_geglu_in_its_block)
    report = ldmopt.tune(unet, _run(unet), rounds=2)
    gegl = [s for s in report.tuning.sites if s.rules == ("geglu",)]
    assert gegl and not any(s.kept for s in gegl)
    assert all(s.why.endswith("fused forward, which dropped out in the last round") for s in gegl)
    assert not ldmopt.is_patched(unet)


@pytest.mark.parametrize("block", ["faster", "slower", "faster beside the resnets"])
def test_a_site_run_inside_its_parents_fused_forward_follows_it(monkeypatch, block):
    """A nested site the patched model does not call as a module (its parent's fused forward does its work) is
    decided with the parent; with the parent left stock it is measured on its own in the next round."""
    unet = _unet()
    run = _run(unet)

    def cost(key, rules, patched):
        if key not in patched:
            return 1.0
        if rules == ("residual_block",):
            resnets = any(".resnets." in name for _, name in patched)
            return 0.5 if block == "faster" or (block != "slower" and resnets) else 2.0
        return 0.5 if rules == ("geglu",) else 2.0

    configurations = _fake_measure(monkeypatch, unet, cost, calls=_geglu_in_its_block)
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


def test_a_site_run_in_place_two_levels_down_follows_the_parent_it_ran_in(monkeypatch):
    """transformer2d_in's fused forward runs its block in place, the block's runs its GEGLU in place. The container
    is rejected; in the next round the GEGLU still runs inside its block, which then drops out in the last checking
    round: the GEGLU, never measured on its own, must not stay kept on an earlier round's word."""
    unet = _unet()

    def container_of(name):
        return name.rsplit(".transformer_blocks.", 1)[0] if ".transformer_blocks." in name else None

    def calls(key, patched):
        label, name = key
        if name.endswith(".ff.net.0"):
            block = name.removesuffix(".ff.net.0")
            return 0 if (label, block) in patched or (label, container_of(block)) in patched else 1
        if name.endswith(".transformer_blocks.0") and (label, container_of(name)) in patched:
            return 0
        return 1

    def cost(key, rules, patched):  # only the resnets are faster fused
        return 1.0 if key not in patched else 0.5 if rules == ("resnet",) else 2.0

    _fake_measure(monkeypatch, unet, cost, calls=calls, wall=lambda patched, seconds: 1.0 if patched else 2.0)
    report = ldmopt.tune(unet, _run(unet), rounds=2)
    gegl = [s for s in report.tuning.sites if s.rules == ("geglu",)]
    assert gegl and not any(s.kept for s in gegl), [(s.name, s.why) for s in gegl if s.kept]
    for s in gegl:
        block = s.name.removesuffix(".ff.net.0")
        assert s.why == f"tune: measured only within {block}'s fused forward, which dropped out in the last round"
    assert {s.rules for s in report.tuning.kept} == {("resnet",)}
    ldmopt.unpatch(unet)


def test_cli_tunes_a_zoo_model(tmp_path, capsys):
    import json

    from ldmopt.cli import main
    from ldmopt.patch import FAMILIES

    path, choice = tmp_path / "out" / "tuning.json", tmp_path / "choice.json"
    argv = ["tune", "sd15", "--tiny", "--warmup", "1", "--repeats", "1", "--json", str(path)]
    with ldmopt.use_backend("torch"):
        assert main([*argv, "--save-choice", str(choice)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ldmopt.tune (time.perf_counter; median of 1 calls after 1 warm-up")
    data = json.loads(path.read_text())
    assert data["model"] == "sd15" and data["timer"] == "time.perf_counter" and data["sites"]
    assert (data["resolution"], data["batch"]) == ([128, 128], 2)  # what ran: the tiny zoo defaults, not null
    assert {"resnet", "residual_block"} <= {rule for site in data["sites"] for rule in site["rules"]}
    saved = json.loads(choice.read_text())
    assert saved["format"] == "ldmopt.tune choice" and len(saved["sites"]) == len(data["sites"])
    assert [s["kept"] for s in saved["sites"]] == [s["kept"] for s in data["sites"]]
    # Refused while parsing in the flags' names; the API's messages name min_speedup= and families
    for flag, value, supported in [
        ("--min-speedup", "0", "expected a finite number > 0, got '0'"),
        ("--min-speedup", "inf", "expected a finite number > 0, got 'inf'"),
        ("--families", "gn_conv,resnet", f"unknown 'resnet'; expected a comma list of {', '.join(FAMILIES)}"),
        ("--families", ",", "no family in ','; expected a comma list of "),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["tune", "sd15", "--tiny", flag, value])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"ldmopt tune: error: argument {flag}: {supported}" in err, err
        assert "min_speedup" not in err and "ldmopt.patch" not in err, err


def test_cli_json_with_nothing_to_tune_is_strict_json(tmp_path):
    import json

    from ldmopt.cli import main

    path = tmp_path / "tuning.json"
    assert main(["tune", "sd15", "--tiny", "--families", "svd_attn2", "--json", str(path)]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} is no JSON number")

    data = json.loads(path.read_text(), parse_constant=refuse)  # a bare NaN was written for the untimed figures
    assert data["sites"] == [] and data["stock_ms"] is None and data["tuned_ms"] is None


def _fake_wall(monkeypatch, pipe_or_model, seconds_of):
    """Replace the whole-call timing: ``seconds_of(rules_patched)`` from the set of rule groups now patched."""
    groups = []

    def wall_time(run, devices, *, warmup, repeats, graph=False):
        patched = {"+".join(r for r, _ in s.rules) for s in tune_sites.patched_sites(pipe_or_model)}
        patched = patched if ldmopt.is_patched(pipe_or_model) else set()
        groups.append(frozenset(patched))
        return seconds_of(patched)

    monkeypatch.setattr(tune_module, "measure", None)  # by rule: no per-site timing
    monkeypatch.setattr(importlib.import_module("ldmopt.patch.tune_rules"), "wall_time", wall_time)
    return groups
