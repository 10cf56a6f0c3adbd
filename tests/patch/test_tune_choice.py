"""ldmopt.patch_tuned: what tune chose, saved and applied to an identical model without measuring, exactly; refused
for another model; undone like patch."""

from __future__ import annotations

import importlib
import json
import types
import warnings

import pytest
import torch

import ldmopt
from ldmopt.patch import PatchError

from . import models
from .helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot
from .test_tune import _fake_measure, _fake_wall, _fused_faster_for, _patched_keys, _run, _unet


def _tuned_choice(monkeypatch, *faster_rules, **kwargs):
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for(*faster_rules))
    report = ldmopt.tune(unet, _run(unet), **kwargs)
    ldmopt.unpatch(unet)
    return report


def test_a_saved_choice_patches_an_identical_model_exactly(monkeypatch, tmp_path):
    report = _tuned_choice(monkeypatch, "residual_block", "resnet")
    kept = {(s.model, s.name) for s in report.tuning.kept}
    assert kept and len(kept) < len(report.tuning.sites)
    path = report.tuning.save(tmp_path / "sub" / "choice.json")
    saved = json.loads(path.read_text())
    assert saved["format"] == "ldmopt.tune choice" and saved["version"] == 1 and saved["training"] is False
    assert saved["measured_on"]["device"] == "cpu" and saved["measured_on"]["torch"] == torch.__version__
    assert {(s["model"], s["name"]) for s in saved["sites"] if s["kept"]} == kept

    other = _unet()  # another process's copy: its own weights, never measured
    torch.manual_seed(1)
    for p in other.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    run = _run(other)
    before, stock_out = snapshot(other), output_tensor(run())
    applied = ldmopt.patch_tuned(other, path)
    assert _patched_keys(other) == kept
    assert {(r.model, r.name) for r in applied.replaced} == kept
    # every other site is reported with the reason tune recorded for it
    recorded = {(s.model, s.name): s.why for s in report.tuning.sites if not s.kept}
    skipped = {(s.model, s.name): s.reasons[0] for s in applied.skipped if (s.model, s.name) in recorded}
    assert skipped == recorded and all(why.startswith("tune: fused") for why in skipped.values())
    assert applied.converted_weights == report.converted_weights  # the same patch options
    assert_outputs_close(output_tensor(run()), stock_out)
    assert ldmopt.unpatch(other) == len(kept)
    assert_same_snapshot(before, snapshot(other))
    # the Tuning itself, the report and the dict serve as well
    for source in (report, report.tuning, saved):
        assert _patched_keys(other) == set()
        ldmopt.patch_tuned(other, source)
        assert _patched_keys(other) == kept
        ldmopt.unpatch(other)


def test_a_model_without_sites_saves_strict_json(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    report = ldmopt.tune(model, lambda: model(torch.randn(2, 4)))
    path = report.tuning.save(tmp_path / "choice.json")
    saved = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in {path}"))
    assert saved["sites"] == [] and saved["stock_ms"] is None
    assert ldmopt.patch_tuned(model, path).replaced == [] and not ldmopt.is_patched(model)


def test_the_weight_layout_follows_the_choice_unless_given(monkeypatch):
    report = _tuned_choice(monkeypatch, "resnet", channels_last_weights=False)
    unet = _unet()
    applied = ldmopt.patch_tuned(unet, report)
    assert applied.converted_weights == {} and applied.kept_weights  # as tune patched: left contiguous
    ldmopt.unpatch(unet)
    applied = ldmopt.patch_tuned(unet, report, channels_last_weights=True)
    assert applied.converted_weights
    ldmopt.unpatch(unet)


def test_a_choice_left_stock_patches_nothing_and_says_why(monkeypatch):
    unet = _unet()
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"), wall=lambda patched, s: 10.0 if patched else 9.0)
    choice = ldmopt.tune(unet, _run(unet)).tuning.choice()
    assert not any(s["kept"] for s in choice["sites"])
    before = snapshot(unet)
    applied = ldmopt.patch_tuned(unet, choice)
    assert not ldmopt.is_patched(unet) and applied.replaced == [] and applied.converted_weights == {}
    assert_same_snapshot(before, snapshot(unet))
    resnets = [s for s in applied.skipped if s.rule == "resnet"]
    assert resnets and all("against 9000.000 ms stock, so every site was left stock" in s.reasons[0] for s in resnets)


def test_a_choice_for_one_model_applies_to_it_inside_a_pipeline_and_back(monkeypatch):
    report = _tuned_choice(monkeypatch, "resnet")
    kept = {s.name for s in report.tuning.kept}
    unet = _unet()
    # a pipeline's other components (a text encoder: nothing to patch) do not make its one patched model ambiguous
    pipe = types.SimpleNamespace(components={"unet": unet, "text_encoder": torch.nn.Linear(4, 4), "scheduler": None})
    ldmopt.patch_tuned(pipe, report)
    assert _patched_keys(pipe) == {("unet", name) for name in kept}
    ldmopt.unpatch(pipe)
    _fake_measure(monkeypatch, pipe, _fused_faster_for("resnet"))
    made_on_pipe = ldmopt.tune(pipe, _run(unet)).tuning.choice()
    ldmopt.unpatch(pipe)
    assert {s["model"] for s in made_on_pipe["sites"]} == {"unet"}
    ldmopt.patch_tuned(unet, made_on_pipe)
    assert {name for _, name in _patched_keys(unet)} == kept
    ldmopt.unpatch(unet)
    # two models with sites: a choice for one of them is not guessed onto either
    two = types.SimpleNamespace(components={"unet": unet, "vae": models.vae().eval()})
    with pytest.raises(PatchError, match="names 25 site"):
        ldmopt.patch_tuned(two, report)
    assert not ldmopt.is_patched(two)


def test_a_choice_made_with_a_filter_needs_that_filter(monkeypatch):
    unet = _unet()

    def no_up_blocks(module, name):
        return "up_blocks" not in name

    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"))
    report = ldmopt.tune(unet, _run(unet), filter_fn=no_up_blocks, families="gn_conv")
    ldmopt.unpatch(unet)
    choice = report.tuning.choice()
    assert choice["filtered"] is True and choice["families"] == ["gn_conv"]  # a string is one family, as for patch
    kept = {(s.model, s.name) for s in report.tuning.kept}
    assert kept and not any("up_blocks" in name for _, name in kept)
    with pytest.raises(PatchError, match=r"made by a tune call with a filter_fn.*pass the same filter_fn"):
        ldmopt.patch_tuned(unet, choice)
    applied = ldmopt.patch_tuned(unet, choice, filter_fn=no_up_blocks)
    assert _patched_keys(unet) == kept
    assert any(s.by_user and "up_blocks" in s.name for s in applied.skipped)  # the filter's own exclusions
    ldmopt.unpatch(unet)


def test_another_model_is_refused_and_left_stock(monkeypatch):
    choice = _tuned_choice(monkeypatch, "resnet").tuning.choice()
    vae = models.vae().eval()
    before = snapshot(vae)
    with pytest.raises(PatchError, match=r"the choice names \d+ site\(s\) this model's patch does not find .*tune it"):
        ldmopt.patch_tuned(vae, choice)
    assert not ldmopt.is_patched(vae)
    assert_same_snapshot(before, snapshot(vae))
    unet = _unet()
    changed = json.loads(json.dumps(choice))
    changed["sites"][0]["rules"] = ["some_rule_renamed"]
    with pytest.raises(PatchError, match=r"1 site\(s\) have other rules now"):
        ldmopt.patch_tuned(unet, changed)
    fewer = {**choice, "sites": choice["sites"][1:]}
    with pytest.raises(PatchError, match=r"this model's patch finds 1 site\(s\) the choice does not name"):
        ldmopt.patch_tuned(unet, fewer)
    assert not ldmopt.is_patched(unet)


def test_the_callers_filter_leaves_chosen_sites_stock(monkeypatch):
    report = _tuned_choice(monkeypatch, "resnet")
    kept = sorted(s.name for s in report.tuning.kept)
    unet = _unet()
    applied = ldmopt.patch_tuned(unet, report, filter_fn=lambda module, name: name != kept[0])
    assert {name for _, name in _patched_keys(unet)} == set(kept[1:])
    excluded = [s for s in applied.skipped if s.name == kept[0]]
    assert excluded and all(s.by_user for s in excluded)
    assert {s.reasons for s in excluded} == {("excluded by filter_fn (the tuning choice kept it)",)}
    ldmopt.unpatch(unet)


def test_a_training_choice_patches_for_training(monkeypatch):
    unet = _unet()
    gains = {"resnet": 0.2}
    _fake_wall(monkeypatch, unet, lambda patched: 10.0 - sum(gains.get(g, -0.5) for g in patched))
    report = ldmopt.tune(unet, _run(unet), training=True, families=["gn_conv", "residual"])
    choice = report.tuning.choice()
    assert choice["training"] is True and choice["families"] == ["gn_conv", "residual"]
    ldmopt.unpatch(unet)
    applied = ldmopt.patch_tuned(unet, choice)
    assert _patched_keys(unet) == {(s.model, s.name) for s in report.tuning.kept}
    # training=True leaves the conv weights' layout (FSDP refuses channels-last parameters), as tune's patch did
    assert applied.kept_weights and not applied.converted_weights
    assert "training" in applied.kept_weights_reason
    ldmopt.unpatch(unet)


_SITE = {"model": "", "name": "down_blocks.0.resnets.0", "rules": ["resnet"], "kept": True, "why": ""}
_CHOICE = {"format": "ldmopt.tune choice", "version": 1, "families": None, "training": False, "sites": [_SITE]}


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        (42, TypeError, "choice must be a Tuning, the report of ldmopt.tune.*got int"),
        ({"format": "other"}, ValueError, "format='other' version=None; supported: format='ldmopt.tune choice'"),
        ({"format": "ldmopt.tune choice", "version": 1, "sites": [{"model": 1}]}, ValueError, r"choice\['sites'\]"),
        ({**_CHOICE, "sites": [_SITE, _SITE]}, ValueError, "names down_blocks.0.resnets.0 more than once"),
        ({**_CHOICE, "families": "gn_conv"}, ValueError, r"choice\['families'\]='gn_conv'; expected null or a list"),
        ({**_CHOICE, "training": "false"}, ValueError, r"choice\['training'\]='false'; expected true or false"),
        ({**_CHOICE, "measured_on": "H100"}, ValueError, r"choice\['measured_on'\]='H100'; expected an object"),
        ({**_CHOICE, "measured_on": {"device": 7}}, ValueError, r"choice\['measured_on'\]=\{'device': 7\}"),
        ({**_CHOICE, "channels_last_weights": 1}, ValueError, r"choice\['channels_last_weights'\]=1; expected null"),
        ("/no/such/choice.json", ValueError, "choice='/no/such/choice.json' could not be read"),
    ],
)
def test_bad_choices_are_named(source, error, message):
    unet = _unet()
    with pytest.raises(error, match=message):
        ldmopt.patch_tuned(unet, source)
    assert not ldmopt.is_patched(unet)


def test_a_patch_report_or_a_patched_model_is_refused(monkeypatch):
    unet = _unet()
    report = ldmopt.patch(unet)
    with pytest.raises(ValueError, match=r"the report of ldmopt\.patch, not of ldmopt\.tune"):
        ldmopt.patch_tuned(unet, report)
    choice = _tuned_choice(monkeypatch, "resnet")
    with pytest.raises(PatchError, match="already patched"):
        ldmopt.patch_tuned(unet, choice)
    ldmopt.unpatch(unet)


def test_cli_tunes_a_training_step_for_patch_tuned(tmp_path, capsys):
    from ldmopt.cli import main

    path = tmp_path / "training.json"
    argv = ["tune", "sd15", "--tiny", "--training", "--warmup", "0", "--repeats", "1", "--save-choice", str(path)]
    with ldmopt.use_backend("torch"):
        assert main(argv) == 0
    assert capsys.readouterr().out.startswith("ldmopt.tune (whole run() calls, a configuration per rule")
    choice = json.loads(path.read_text())
    assert choice["training"] is True and choice["sites"]
    from ldmopt import configs

    unet = configs.build_model("sd15", device="cpu", dtype=torch.float32, tiny=True).train()
    ldmopt.patch_tuned(unet, path, training=True)  # the zoo model train_ldm.py trains: the same sites
    assert _patched_keys(unet) == {(s["model"], s["name"]) for s in choice["sites"] if s["kept"]}
    ldmopt.unpatch(unet)
    with pytest.raises(PatchError, match="made for training"):
        ldmopt.patch_tuned(unet, path, training=False)
    assert main([*argv[:4], "--by", "site"]) == 2
    assert "--training times whole training steps rule by rule" in capsys.readouterr().err


def test_a_choice_measured_on_another_gpu_is_applied_with_a_warning(monkeypatch):
    choice = _tuned_choice(monkeypatch, "resnet").tuning.choice()
    unet = _unet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured here (the CPU): nothing to say
        ldmopt.patch_tuned(unet, choice)
        ldmopt.unpatch(unet)
        # a GPU's choice applied before the model moves there (or to one offloaded to the CPU): nothing either
        ldmopt.patch_tuned(unet, {**choice, "measured_on": {"device": "NVIDIA H200"}})
        ldmopt.unpatch(unet)
    tune_module = importlib.import_module("ldmopt.patch.tune")
    monkeypatch.setattr(tune_module, "_cuda_devices", lambda pipe: {torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    with pytest.warns(RuntimeWarning, match="measured on NVIDIA H200; this model is on NVIDIA H100 80GB HBM3"):
        ldmopt.patch_tuned(unet, {**choice, "measured_on": {"device": "NVIDIA H200"}})
    assert _patched_keys(unet) == {(s["model"], s["name"]) for s in choice["sites"] if s["kept"]}
    ldmopt.unpatch(unet)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ldmopt.patch_tuned(unet, {**choice, "measured_on": {"device": "NVIDIA H100 80GB HBM3"}})
    ldmopt.unpatch(unet)


def test_a_choice_measured_at_another_precision_is_applied_with_a_warning(monkeypatch):
    """The choice records the parameters' dtypes; applied to a model of another precision it still patches the same
    sites, with a warning. A choice saved without the field (older ldmopt) says nothing; a bad field is refused."""
    report = _tuned_choice(monkeypatch, "resnet")
    choice = report.tuning.choice()
    assert choice["measured_on"]["dtype"] == "float32"
    unet = _unet().double()
    with pytest.warns(RuntimeWarning, match="measured with float32 parameters; this model's are float64"):
        ldmopt.patch_tuned(unet, choice)
    assert _patched_keys(unet) == {(s["model"], s["name"]) for s in choice["sites"] if s["kept"]}
    ldmopt.unpatch(unet)
    older = {**choice, "measured_on": {k: v for k, v in choice["measured_on"].items() if k != "dtype"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ldmopt.patch_tuned(unet, older)
    ldmopt.unpatch(unet)
    with pytest.raises(ValueError, match=r"choice\['measured_on'\]"):
        ldmopt.patch_tuned(unet, {**choice, "measured_on": {**choice["measured_on"], "dtype": 16}})
    assert not ldmopt.is_patched(unet)
