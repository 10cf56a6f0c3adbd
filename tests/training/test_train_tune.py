"""examples/train_ldm.py --tune / --tune-choice on CPU: the fused rules are chosen by timing training steps before
training (ldmopt.tune(training=True)), saved, applied again without measuring, and agreed on by every rank."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from .test_train_script import BASE, ROOT, _train_module, run_torchrun


@pytest.fixture
def train_utils(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("_train_utils")


def test_tune_saves_a_choice_that_a_later_run_applies(tmp_path):
    train_ldm = _train_module()
    tuned = train_ldm.main([*BASE, "--max-steps", "1", "--tune", "--output-dir", str(tmp_path / "a")])
    choice_path = tmp_path / "a" / "tune_choice.json"
    choice = json.loads(choice_path.read_text())
    kept = [s for s in choice["sites"] if s["kept"]]
    assert choice["training"] is True and choice["measured_on"]["device"] == "cpu"
    assert tuned["patch"]["tuning"]["sites"] == len(choice["sites"]) > 0
    assert len(tuned["patch"]["tuning"]["kept"]) == len(kept)
    assert tuned["patch"]["patched"] == sum(len(s["rules"]) for s in kept)
    assert len(tuned["history"]) == 1 and tuned["patched_in_sync"]

    applied = train_ldm.main(
        [*BASE, "--max-steps", "1", "--tune-choice", str(choice_path), "--output-dir", str(tmp_path / "b")]
    )
    assert applied["patch"]["patched"] == tuned["patch"]["patched"] and applied["patch"]["tuning"] is None
    assert not (tmp_path / "b" / "tune_choice.json").exists()
    # the tuning's steps draw no random numbers the training would: the same first loss as a run given the choice
    assert applied["history"][0]["loss"] == tuned["history"][0]["loss"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--no-fused", "--tune"], "--tune chooses what --fused patches; it needs --fused"),
        (["--no-fused", "--tune-choice", "x.json"], "--tune-choice chooses what --fused patches"),
        (["--tune", "--tune-choice", "x.json"], "give one of them"),
    ],
)
def test_bad_tune_arguments(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        _train_module().main([*BASE, "--max-steps", "1", "--output-dir", str(tmp_path), *argv])


def test_torchrun_ranks_patch_what_rank_0_chose(tmp_path):
    run_torchrun([*BASE, "--max-steps", "2", "--tune"], tmp_path, env={"LDMOPT_BACKEND": "torch"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["patched_in_sync"] and summary["ranks_in_sync"]
    assert summary["patch"]["tuning"]["sites"] > 0 and (tmp_path / "tune_choice.json").exists()


def test_a_rank_whose_own_measurement_differs_applies_rank_0s_choice(train_utils, tmp_path, monkeypatch, capsys):
    """Rank 1 measured differently (timings are noisy): it patches rank 0's choice, keeping its own table."""
    import ldmopt

    from ..patch import models
    from ..patch.test_tune import _fake_wall, _patched_keys

    unet = models.sd15_unet().train()
    kwargs = models.inputs("sd15", unet)

    def step():
        with ldmopt.use_backend("torch"):
            unet(**kwargs).sample.square().mean().backward()
        unet.zero_grad(set_to_none=True)

    _fake_wall(monkeypatch, unet, lambda patched: 10.0 - 0.2 * ("resnet" in patched) - 0.1 * ("geglu" in patched))
    rank0 = ldmopt.tune(unet, step, training=True).tuning.choice()  # rank 0's: resnets and GEGLUs
    ldmopt.unpatch(unet)
    _fake_wall(monkeypatch, unet, lambda patched: 10.0 - 0.2 * ("residual_block" in patched))

    def broadcast(objects, src, device=None):
        assert src == 0 and objects[0] is None  # rank 1 sends nothing
        objects[0] = rank0

    monkeypatch.setattr(train_utils.dist, "broadcast_object_list", broadcast)
    info = train_utils.DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    report = train_utils.tune_patch(unet, step, info, None, tmp_path / "choice.json")
    wanted = {(s["model"], s["name"]) for s in rank0["sites"] if s["kept"]}
    assert wanted and _patched_keys(unet) == wanted
    assert {s.rules for s in report.tuning.kept} == {("residual_block",)}  # its own measurement, for the record
    assert "rank 1: applied rank 0's tuning choice" in capsys.readouterr().out
    assert not (tmp_path / "choice.json").exists()  # rank 0 saves it
    ldmopt.unpatch(unet)
