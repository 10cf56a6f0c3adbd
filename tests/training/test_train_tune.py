"""examples/train_ldm.py --tune / --tune-choice on CPU: the fused rules are chosen by timing training steps before
training (ldmopt.tune(training=True)), saved, applied again without measuring, and agreed on by every rank."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from .test_train_script import BASE, RESUME, ROOT, _train_module, run_torchrun


@pytest.fixture
def train_utils(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("_train_utils")


@pytest.fixture
def resnets_pay(monkeypatch):
    """In-process runs: ldmopt.tune's whole-step timings say that a step is faster exactly when the resnets are
    patched (deterministic and instant; the torchrun test times for real)."""
    import ldmopt

    tune_rules = importlib.import_module("ldmopt.patch.tune_rules")
    sites_of = importlib.import_module("ldmopt.patch.tune_sites").patched_sites
    tune_by_rule, tuned = tune_rules.tune_by_rule, []

    def wall_time(run, devices, *, warmup, repeats, graph=False):
        model = tuned[-1]
        patched = {"+".join(r for r, _ in s.rules) for s in sites_of(model)} if ldmopt.is_patched(model) else set()
        return 1.0 - 0.1 * ("resnet" in patched) + 0.1 * len(patched - {"resnet"})

    def by_rule(job):
        tuned.append(job.pipe_or_model)
        return tune_by_rule(job)

    monkeypatch.setattr(tune_rules, "wall_time", wall_time)
    monkeypatch.setattr(tune_rules, "tune_by_rule", by_rule)
    return tuned


def _kept_modules(choice: dict) -> list[str]:
    """What a patch of the kept sites replaces, as summary.json lists it ("name:rule")."""
    return sorted(f"{s['name']}:{rule}" for s in choice["sites"] if s["kept"] for rule in s["rules"])


def test_tune_saves_a_choice_that_a_later_run_applies(tmp_path, resnets_pay):
    train_ldm = _train_module()
    tuned = train_ldm.main([*BASE, "--max-steps", "1", "--tune", "--output-dir", str(tmp_path / "a")])
    choice_path = tmp_path / "a" / "tune_choice.json"
    choice = json.loads(choice_path.read_text())
    assert choice["training"] is True and choice["measured_on"]["device"] == "cpu"
    assert tuned["patch"]["tuning"]["sites"] == len(choice["sites"]) > 0
    assert tuned["patch"]["modules"] == _kept_modules(choice) and tuned["patch"]["modules"]
    assert all(m.endswith(":resnet") for m in tuned["patch"]["modules"]) and len(resnets_pay) == 1
    assert len(tuned["history"]) == 1 and tuned["patched_in_sync"]

    applied = train_ldm.main(
        [*BASE, "--max-steps", "1", "--tune-choice", str(choice_path), "--output-dir", str(tmp_path / "b")]
    )
    assert applied["patch"]["modules"] == tuned["patch"]["modules"] and applied["patch"]["tuning"] is None
    assert not (tmp_path / "b" / "tune_choice.json").exists()
    # the tuning's steps draw no random numbers the training would: the same first loss as a run given the choice
    assert applied["history"][0]["loss"] == tuned["history"][0]["loss"]

    # an inference choice (forward passes only) is refused for training, as is another model's
    resnets = tmp_path / "inference.json"
    resnets.write_text(json.dumps({**choice, "training": False}))
    with pytest.raises(SystemExit, match=r"--tune-choice .*inference.json: .*made for inference"):
        train_ldm.main([*BASE, "--max-steps", "1", "--tune-choice", str(resnets), "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"the choice names .* site"):
        train_ldm.main([*BASE, "--model", "unet-small", "--max-steps", "1", "--tune-choice", str(choice_path),
                        "--output-dir", str(tmp_path)])  # fmt: skip


def test_a_resumed_tuned_run_keeps_its_choice(tmp_path, capsys, resnets_pay):
    train_ldm = _train_module()
    args = [*BASE, "--max-steps", "2", "--save-every", "1", "--keep-last", "0"]
    straight = train_ldm.main([*args, "--tune", "--output-dir", str(tmp_path / "a")])
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-00000001.pt")
    capsys.readouterr()
    resumed = train_ldm.main([*args, "--output-dir", str(tmp_path / "b"), "--resume", ckpt])
    assert "resuming with the tuning choice the checkpoint trained with" in capsys.readouterr().out
    assert resumed["patch"]["modules"] == straight["patch"]["modules"]  # not measured again: the same kernels
    assert len(resnets_pay) == 1
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"] if h["step"] == 2]
    assert not (tmp_path / "b" / "tune_choice.json").exists()
    # --no-fused drops what the checkpoint tuned with; a --tune-choice given now wins over the inherited --tune
    unfused = train_ldm.main([*args, "--no-fused", "--output-dir", str(tmp_path / "c"), "--resume", ckpt])
    assert unfused["patch"] is None
    again = train_ldm.main([*args, "--output-dir", str(tmp_path / "d"), "--resume", ckpt,
                            "--tune-choice", str(tmp_path / "a" / "tune_choice.json")])  # fmt: skip
    assert again["patch"]["modules"] == straight["patch"]["modules"]


def test_a_run_given_a_choice_file_resumes_with_tune_or_no_tune(tmp_path, resnets_pay):
    """The --tune-choice path a checkpoint's run was given is not a choice given now: --tune measures again, and
    --no-tune patches everything, without reading that file (moved away here) again."""
    train_ldm = _train_module()
    train_ldm.main([*BASE, "--max-steps", "1", "--tune", "--output-dir", str(tmp_path / "a")])
    choice_path = tmp_path / "choice.json"
    (tmp_path / "a" / "tune_choice.json").rename(choice_path)
    run = tmp_path / "b"
    train_ldm.main([*BASE, "--max-steps", "1", "--save-every", "1", "--tune-choice", str(choice_path),
                    "--output-dir", str(run)])  # fmt: skip
    choice_path.rename(tmp_path / "gone.json")
    measured = train_ldm.main(["--resume", "auto", *RESUME, "--output-dir", str(run), "--max-steps", "2", "--tune"])
    assert measured["patch"]["tuning"] is not None and len(resnets_pay) == 2
    everything = train_ldm.main(["--resume", "auto", *RESUME, "--output-dir", str(run), "--max-steps", "3",
                                 "--no-tune"])  # fmt: skip
    assert everything["patch"]["tuning"] is None
    assert len(everything["patch"]["modules"]) > len(measured["patch"]["modules"])


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
    assert summary["patch"]["tuning"]["sites"] > 0
    assert summary["patch"]["modules"] == _kept_modules(json.loads((tmp_path / "tune_choice.json").read_text()))


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
    report, applied = train_utils.tune_patch(unet, step, info, None, tmp_path / "choice.json")
    assert applied is rank0
    wanted = {(s["model"], s["name"]) for s in rank0["sites"] if s["kept"]}
    assert wanted and _patched_keys(unet) == wanted
    assert {s.rules for s in report.tuning.kept} == {("residual_block",)}  # its own measurement, for the record
    assert "rank 1: applied rank 0's tuning choice" in capsys.readouterr().out
    assert not (tmp_path / "choice.json").exists()  # rank 0 saves it
    ldmopt.unpatch(unet)
