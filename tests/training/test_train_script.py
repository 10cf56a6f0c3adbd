"""examples/train_ldm.py end to end on CPU with a tiny UNet on 16x16 shapes (reference backend, so it is quick).

- torchrun --nproc_per_node 2 (gloo): both ranks end bit-identical, the loss goes down;
- that run's mid-way checkpoint resumed on ONE process continues with the same losses (per-sample noise makes the
  global batch independent of the process count), up to float summation order;
- resume on the same process count is bit-exact (weights, EMA, optimizer, GradScaler, schedule, data position);
- every feature flag runs: bf16/fp16 autocast, gradient checkpointing, channels-last, grad accumulation, image
  folder, DDPM/DDIM sample grids, TensorBoard, the profiling window, save_pretrained;
- resume takes the checkpoint's arguments unless given explicitly (model-defining ones must match), and switches
  mixed precision either way; nonsensical values are refused up front;
- --save-final writes the wrapper's label embeddings next to the model, and final/ reloads to the same outputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ldm.py"
# Tiny model, tiny images, reference backend; every run is deterministic from --seed.
BASE = [
    "--model", "unet-tiny", "--resolution", "16", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "0",
    "--log-every", "1", "--no-progress", "--sample-every", "0", "--no-save-final", "--backend", "torch",
    "--device", "cpu", "--num-shapes", "512",
]  # fmt: skip


def _train_module():
    spec = importlib.util.spec_from_file_location("train_ldm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_ldm():
    return _train_module()


def _losses(summary: dict) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in summary["history"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What a gloo rank prints when a C++ worker thread is still joinable as the process ends (std::terminate, SIGABRT):
#: a PyTorch teardown race (pytorch/pytorch#179291, #190489), seen once in CI after a run whose training went through.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(script_args: list[str], output_dir: Path, env: dict[str, str] | None = None) -> None:
    """``torchrun --nproc_per_node 2 SCRIPT *script_args --output-dir output_dir`` on CPU (gloo), asserting that it
    succeeded. A run killed by the gloo teardown abort alone (no rank raised) is run once more, on a new port into an
    emptied ``output_dir``; any other failure, or the abort twice, fails. Python's fault handler is on, so an abort
    prints every thread's Python stack."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    for attempt in (1, 2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(_free_port()), str(SCRIPT), *script_args, "--output-dir", str(output_dir),
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        teardown_abort = GLOO_TEARDOWN_ABORT in proc.stderr and "]: Traceback" not in proc.stderr  # "[rank0]: ..."
        if proc.returncode == 0 or not teardown_abort or attempt == 2:
            break
        print(f"torchrun attempt 1 ended in the gloo teardown abort; running again. Its stderr:\n{proc.stderr[-6000:]}")
        shutil.rmtree(output_dir)  # the logs append: the second run starts from an empty folder
        output_dir.mkdir()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """6 steps on 2 gloo ranks, checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("ddp")
    args = [*BASE, "--max-steps", "6", "--save-every", "3", "--keep-last", "0"]
    run_torchrun(args, out, env={"LDMOPT_BACKEND": "torch"})
    return out, json.loads((out / "summary.json").read_text())


def test_torchrun_two_ranks_stay_identical_and_learn(ddp_run):
    out, summary = ddp_run
    assert summary["world_size"] == 2
    assert summary["ranks_in_sync"], summary["param_digests"]
    losses = list(_losses(summary).values())
    assert len(losses) == 6
    assert sum(losses[-2:]) < sum(losses[:2]) * 0.95, losses
    assert summary["patch"]["patched"] > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003.pt", "step-00000006.pt"]
    # rank 0 alone logs: one line per step
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_two_rank_checkpoint_resumes_on_one_process(ddp_run, train_ldm, tmp_path):
    out, summary = ddp_run
    resumed = train_ldm.main(
        [*BASE, "--max-steps", "6", "--save-every", "6", "--output-dir", str(tmp_path),
         "--resume", str(out / "checkpoints" / "step-00000003.pt")]
    )  # fmt: skip
    assert resumed["world_size"] == 1
    ours, theirs = _losses(resumed), _losses(summary)
    assert sorted(ours) == [4, 5, 6]
    for step in ours:  # same samples and noise; only the order of float sums differs
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), (step, ours, theirs)
    a = torch.load(out / "checkpoints" / "step-00000006.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "checkpoints" / "step-00000006.pt", weights_only=False)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-3, msg=lambda m, k=key: f"{k}: {m}")


def test_two_rank_resume_inside_a_log_window_logs_the_same_loss(tmp_path):
    # A checkpoint between two logs keeps each rank's partial sum: restored as the ranks' mean, the mean over ranks
    # at the next log rounded differently (a few ulps) from the straight run's.
    args = [*BASE, "--max-steps", "5", "--log-every", "5", "--save-every", "3", "--keep-last", "0"]
    env = {"LDMOPT_BACKEND": "torch"}
    run_torchrun(args, tmp_path / "a", env=env)
    run_torchrun([*args, "--resume", str(tmp_path / "a" / "checkpoints" / "step-00000003.pt")], tmp_path / "b", env=env)
    straight, resumed = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("a", "b"))
    assert list(_losses(straight)) == [5]
    assert _losses(resumed) == _losses(straight)  # to the bit
    assert resumed["param_digests"] == straight["param_digests"]


def _resumes_exactly_from_step_2(train_ldm, tmp_path, extra: list[str]) -> None:
    """A 4-step run and the same run resumed from its step-2 checkpoint: steps 3-4 and the weights bit for bit."""
    straight = train_ldm.main([*BASE, *extra, "--output-dir", str(tmp_path / "a")])
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000002.pt"
    resumed = train_ldm.main([*BASE, *extra, "--output-dir", str(tmp_path / "b"), "--resume", str(ckpt)])
    assert _losses(resumed) == {k: v for k, v in _losses(straight).items() if k > 2}
    assert resumed["param_digests"] == straight["param_digests"]


def test_resume_is_bit_exact(train_ldm, tmp_path):
    """fp16 autocast + GradScaler, grad accumulation, EMA, cosine schedule: resuming a 4-step run from its step-2
    checkpoint reproduces steps 3-4 bit for bit."""
    # --log-every 3: the checkpoint at step 2 is mid-window; the resumed run's step-3 log still means steps 1-3.
    extra = ["--mixed-precision", "fp16", "--grad-accum", "2", "--lr-scheduler", "cosine", "--warmup-steps", "1",
             "--ema-decay", "0.9", "--max-steps", "4", "--save-every", "2", "--keep-last", "0",
             "--log-every", "3"]  # fmt: skip
    _resumes_exactly_from_step_2(train_ldm, tmp_path, extra)
    a = torch.load(tmp_path / "a" / "checkpoints" / "step-00000004.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoints" / "step-00000004.pt", weights_only=False)
    for name, shadow in a["ema"]["shadow"].items():
        assert torch.equal(shadow, b["ema"]["shadow"][name]), name
    assert a["scaler"] == b["scaler"] and a["lr_scheduler"]["last_epoch"] == b["lr_scheduler"]["last_epoch"]


def test_resume_is_bit_exact_where_statistics_are_handed_over(train_ldm, tmp_path):
    """SVD's fused blocks hand GroupNorm statistics on from their second call (equal to a statistics pass only to
    rounding): a resumed run's first step must take the path the uninterrupted run's third step took."""
    extra = ["--model", "svd", "--tiny", "--resolution", "32", "--frames", "2", "--batch-size", "2",
             "--num-shapes", "16", "--cond-drop", "0.5", "--max-steps", "4", "--save-every", "2",
             "--keep-last", "0"]  # fmt: skip
    _resumes_exactly_from_step_2(train_ldm, tmp_path, extra)


def test_logged_loss_is_the_mean_over_the_log_window(train_ldm, tmp_path):
    every_step = train_ldm.main([*BASE, "--max-steps", "5", "--output-dir", str(tmp_path / "a")])
    windows = train_ldm.main([*BASE, "--max-steps", "5", "--log-every", "2", "--output-dir", str(tmp_path / "b")])
    per_step = _losses(every_step)
    assert sorted(_losses(windows)) == [2, 4, 5]  # the last, partial window is logged at the end too
    expected = {2: (per_step[1] + per_step[2]) / 2, 4: (per_step[3] + per_step[4]) / 2, 5: per_step[5]}
    assert _losses(windows) == pytest.approx(expected, rel=1e-6)


def test_features_image_folder_bf16_checkpointing_samples_tensorboard_profile(train_ldm, tmp_path):
    data = tmp_path / "images"
    for cls, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (data / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20 + i, 18), colour).save(data / cls / f"{i}.png")
    out = tmp_path / "run"
    summary = train_ldm.main(
        [*BASE, "--data", str(data), "--hflip", "--batch-size", "4", "--max-steps", "3", "--mixed-precision",
         "bf16", "--gradient-checkpointing", "--channels-last", "--report-to", "tensorboard", "--sample-every", "3",
         "--sampler", "ddpm", "--sample-steps", "3", "--num-sample-images", "4", "--save-final",
         "--profile-wait", "0", "--profile-warmup", "1", "--profile-active", "1", "--output-dir", str(out)]
    )  # fmt: skip
    assert summary["step"] == 3 and all(torch.isfinite(torch.tensor(list(_losses(summary).values()))))
    with Image.open(out / "samples" / "step-00000003.png") as grid:
        assert grid.size == (2 + 2 * 18, 2 + 2 * 18)
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert "convolution" in (out / "profile" / "categories.txt").read_text()
    assert (out / "profile" / "trace.json").exists()
    from diffusers import UNet2DConditionModel

    reloaded = UNet2DConditionModel.from_pretrained(out / "final")
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_unfused_and_ddim_run(train_ldm, tmp_path):
    summary = train_ldm.main(
        [*BASE, "--no-fused", "--max-steps", "1", "--sample-every", "1", "--sample-steps", "2",
         "--num-sample-images", "2", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert summary["patch"] is None and (tmp_path / "samples" / "step-00000001.png").exists()


def _tiny_vae(path: Path) -> Path:
    from diffusers import AutoencoderKL

    AutoencoderKL(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4, layers_per_block=1,
                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  sample_size=16).save_pretrained(path)  # fmt: skip
    return path


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--model", "sd15", "--resolution", "32", "--vae", "VAE"], id="sd15-vae-latents"),
        pytest.param(["--model", "sdxl", "--resolution", "32", "--latent-factor", "2"], id="sdxl-patch-latents"),
        pytest.param(["--model", "dit", "--resolution", "16", "--latent-factor", "2"], id="dit-class-labels"),
        pytest.param(["--model", "unet2d-small", "--resolution", "8"], id="unet2d-class-embeds"),
    ],
)
def test_zoo_models_train_and_sample(train_ldm, tmp_path, argv):
    """Tiny zoo models: latent space (a VAE from a local folder, or the patch stand-in), SDXL's pooled text and size
    conditioning, DiT's class labels and learned-variance output; the built-in UNet2DModel's class embeddings."""
    argv = [str(_tiny_vae(tmp_path / "vae")) if a == "VAE" else a for a in argv]
    summary = train_ldm.main(
        [*BASE, *argv, "--tiny", "--batch-size", "2", "--max-steps", "1", "--sample-every", "1", "--sample-steps",
         "2", "--num-sample-images", "2", "--output-dir", str(tmp_path / "run")]
    )  # fmt: skip
    assert summary["patch"]["patched"] > 0 and len(summary["history"]) == 1
    assert (tmp_path / "run" / "samples" / "step-00000001.png").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--batch-size", "6", "--grad-accum", "4"], "must be divisible"),
        (["--model", "sd15-vae"], "not a denoiser"),
        (["--model", "no-such-model"], "unknown"),
        (["--data", "/nonexistent/folder"], "is not a folder"),
        (["--log-every", "0"], "--log-every must be positive, got 0"),
        (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
        (["--sample-every", "-5"], "--sample-every must be >= 0, got -5"),
        (["--keep-last", "-2"], "--keep-last must be >= 0, got -2"),
        (["--sample-every", "1", "--num-sample-images", "0"], "--num-sample-images must be positive, got 0"),
        (["--sample-every", "1", "--sample-steps", "0"], "--sample-steps must be positive, got 0"),
        (["--sample-every", "1", "--sample-steps", "2000"], "--sample-steps 2000 exceeds --num-train-timesteps"),
        (["--num-train-timesteps", "0"], "--num-train-timesteps must be positive, got 0"),
        (["--resolution", "0"], "--resolution must be positive, got 0"),
        (["--num-shapes", "-1"], "--num-shapes must be positive, got -1"),
        (["--lr", "-0.1"], "--lr must be >= 0, got -0.1"),
        (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
        (["--ema-decay", "1.0"], r"--ema-decay must be in \[0, 1\), got 1.0"),
        (["--cond-drop", "1.5"], r"--cond-drop must be in \[0, 1\], got 1.5"),
        (["--num-workers", "-1"], "--num-workers must be >= 0, got -1"),
        (["--profile-active", "-1"], "--profile-active must be >= 0, got -1"),
        (["--data", "/nonexistent/images"], "--data '/nonexistent/images' is not a folder"),
        (["--resume", "/nonexistent/step-1.pt"], "--resume /nonexistent/step-1.pt: no such checkpoint file"),
        (["--resume", "/"], "--resume /: the folder holds no checkpoint"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--model", "unet2d-small", "--resolution", "30"], "do not halve evenly .* multiple of"),
        (["--guidance-scale", "nan"], "--guidance-scale must be finite, got nan"),
        (["--vae", "sd15vae"], "--vae 'sd15vae' is neither a folder holding a diffusers AutoencoderKL nor .*sd15-vae"),
        (["--output-dir", "/dev/null/run"], "--output-dir '/dev/null/run': /dev/null exists and is not a folder"),
        (["--output-dir", "/proc/ldmopt-run"], "--output-dir '/proc/ldmopt-run' cannot be created"),
        (["--backend", "cuda"], r"--backend cuda: ldmopt\.\w+: backend 'cuda' was forced but cannot run these inputs"),
    ],
)
def test_bad_arguments_have_clear_messages(train_ldm, tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):  # a message, not a traceback
        train_ldm.main([*BASE, "--max-steps", "1", "--output-dir", str(tmp_path), *argv])


def test_flags_this_run_has_no_use_for_are_noted(train_ldm, tmp_path, capsys):
    train_ldm.main(
        [*BASE, "--max-steps", "1", "--output-dir", str(tmp_path), "--tiny", "--latent-factor", "4", "--hflip"]
    )
    out = capsys.readouterr().out
    assert "note: --hflip flips the images of an image folder (--data)" in out
    assert "note: --tiny is for zoo models; the built-in unet-tiny is used as defined" in out
    assert "note: --latent-factor is for zoo models" in out


def test_wandb_missing_is_a_clear_message(train_ldm, tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(SystemExit, match="pip install wandb"):
        train_ldm.main([*BASE, "--max-steps", "1", "--report-to", "wandb", "--output-dir", str(tmp_path)])


def test_profile_window_without_ldmopt_profiler(train_ldm, tmp_path, monkeypatch):
    """Without ldmopt.profiler the window still runs, writing torch.profiler's operator table instead."""
    monkeypatch.setitem(sys.modules, "ldmopt.profiler", None)  # makes `from ldmopt.profiler import ...` fail
    summary = train_ldm.main(
        [*BASE, "--max-steps", "3", "--profile-wait", "0", "--profile-warmup", "1", "--profile-active", "1",
         "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert summary["step"] == 3
    assert "torch.profiler table" in (tmp_path / "profile" / "ops.txt").read_text()


# ------------------------------------------------------------------------------------------------ resume arguments

# Everything --resume needs besides the checkpoint: where it is and what this machine runs on.
RESUME = ["--backend", "torch", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """2 steps in bf16 (checkpoint at step 2) and the same run straight to 4 steps."""
    train_ldm = _train_module()
    base = tmp_path_factory.mktemp("bf16")
    extra = ["--mixed-precision", "bf16", "--ema-decay", "0.9", "--cond-drop", "0.2"]
    straight = train_ldm.main([*BASE, *extra, "--max-steps", "4", "--output-dir", str(base / "straight")])
    train_ldm.main([*BASE, *extra, "--max-steps", "2", "--output-dir", str(base / "half")])
    return base / "half", straight


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "checkpoints", dst / "checkpoints")
    return dst


def test_resume_auto_continues_with_the_checkpoint_args(bf16_run, train_ldm, tmp_path, capsys):
    """The README's `--resume auto` without the original flags continues the same run (bf16, tiny UNet, cond-drop,
    EMA...): bit-identical to the run that went straight through; a longer --max-steps is an override with a note."""
    half, straight = bf16_run
    out = _copy_run(half, tmp_path / "run")
    capsys.readouterr()
    resumed = train_ldm.main([*RESUME, "--resume", "auto", "--output-dir", str(out), "--max-steps", "4"])
    printed = capsys.readouterr().out
    assert "--max-steps 4 overrides the checkpoint's 2" in printed, printed
    assert _losses(resumed) == {k: v for k, v in _losses(straight).items() if k > 2}
    assert resumed["param_digests"] == straight["param_digests"]
    saved = torch.load(out / "checkpoints" / "step-00000004.pt", weights_only=False)["args"]
    assert saved["mixed_precision"] == "bf16" and saved["model"] == "unet-tiny" and saved["max_steps"] == 4
    assert saved["output_dir"] == str(out) and saved["resume"] == "auto"
    train_ldm.main([*RESUME, "--resume", "auto", "--output-dir", str(out)])  # done: says so, not just a full bar
    assert "already at step 4, --max-steps 4: nothing to train" in capsys.readouterr().out
    for folder in (out, out / "checkpoints"):  # a run's folder: its newest checkpoint
        train_ldm.main([*RESUME, "--resume", str(folder), "--output-dir", str(out)])
        assert f"resumed from {out / 'checkpoints' / 'step-00000004.pt'} at step 4" in capsys.readouterr().out
    # An earlier checkpoint with nothing to train: the later run's checkpoints and metrics stay as they are.
    metrics = (out / "metrics.jsonl").read_text()
    train_ldm.main([*RESUME, "--resume", str(out / "checkpoints" / "step-00000002.pt"), "--output-dir", str(out)])
    assert "nothing to train" in capsys.readouterr().out
    assert (out / "checkpoints" / "step-00000004.pt").is_file() and (out / "metrics.jsonl").read_text() == metrics


def test_resume_overrides_take_effect(bf16_run, train_ldm, tmp_path, capsys):
    """Explicit --lr/--weight-decay/--mixed-precision on resume are used (the optimizer's saved values do not win)."""
    half, _ = bf16_run
    ckpt = half / "checkpoints" / "step-00000002.pt"
    capsys.readouterr()
    train_ldm.main(
        [*RESUME, "--resume", str(ckpt), "--output-dir", str(tmp_path), "--max-steps", "3", "--lr", "5e-4",
         "--weight-decay", "0.05", "--mixed-precision", "no"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "--lr 0.0005 overrides the checkpoint's 0.001" in printed, printed
    assert "--mixed-precision no overrides the checkpoint's bf16" in printed, printed
    state = torch.load(tmp_path / "checkpoints" / "step-00000003.pt", weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 5e-4 and group["initial_lr"] == 5e-4 and group["weight_decay"] == 0.05
    assert state["args"]["mixed_precision"] == "no" and state["args"]["lr"] == 5e-4


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "unet2d-small"], "--model: the checkpoint has 'unet-tiny', the command line 'unet2d-small'"),
        (["--resolution", "8"], "--resolution: the checkpoint has 16, the command line 8"),
        (["--prediction-type", "v_prediction"], "--prediction-type: the checkpoint has 'epsilon'"),
        (["--seed", "1"], "--seed: the checkpoint has 0, the command line 1"),
    ],
)
def test_resume_refuses_to_change_what_defines_the_run(bf16_run, train_ldm, tmp_path, argv, match):
    half, _ = bf16_run
    with pytest.raises(SystemExit, match=match):
        train_ldm.main([*RESUME, "--resume", str(half / "checkpoints" / "step-00000002.pt"), "--output-dir",
                        str(tmp_path), "--max-steps", "3", *argv])  # fmt: skip


def test_resume_of_a_checkpoint_without_args(bf16_run, train_ldm, tmp_path):
    """Checkpoints written before the args were saved still resume, from the command line's arguments."""
    half, straight = bf16_run
    state = torch.load(half / "checkpoints" / "step-00000002.pt", weights_only=False)
    del state["args"]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    extra = ["--mixed-precision", "bf16", "--ema-decay", "0.9", "--cond-drop", "0.2", "--max-steps", "4"]
    resumed = train_ldm.main([*BASE, *extra, "--output-dir", str(tmp_path / "run"), "--resume", str(old)])
    assert _losses(resumed) == {k: v for k, v in _losses(straight).items() if k > 2}


def test_old_checkpoint_keeps_its_lr_and_weight_decay_unless_given(train_ldm, tmp_path):
    """Without saved arguments the command line's defaults are not the run's values: the optimizer's saved lr and
    weight decay stay, and an explicit one still overrides."""
    base = list(BASE)
    i = base.index("--lr")
    del base[i : i + 2]
    train_ldm.main([*base, "--lr", "5e-4", "--weight-decay", "0.1", "--lr-scheduler", "constant", "--max-steps", "1",
                    "--output-dir", str(tmp_path / "a")])  # fmt: skip
    state = torch.load(tmp_path / "a" / "checkpoints" / "step-00000001.pt", weights_only=False)
    del state["args"]
    torch.save(state, tmp_path / "old.pt")

    def resumed_groups(out: str, *extra: str) -> dict:
        argv = [*base, "--lr-scheduler", "constant", "--max-steps", "2", "--output-dir", str(tmp_path / out),
                "--resume", str(tmp_path / "old.pt"), *extra]  # fmt: skip
        train_ldm.main(argv)
        group = torch.load(tmp_path / out / "checkpoints" / "step-00000002.pt", weights_only=False)
        return {k: group["optimizer"]["param_groups"][0][k] for k in ("lr", "weight_decay")}

    assert resumed_groups("b") == {"lr": 5e-4, "weight_decay": 0.1}
    assert resumed_groups("c", "--lr", "2e-4") == {"lr": 2e-4, "weight_decay": 0.1}


def test_switches_can_be_turned_off_and_the_ema_on_when_resuming(train_ldm, tmp_path, capsys):
    first = ["--gradient-checkpointing", "--ema-decay", "0", "--max-steps", "1", "--output-dir", str(tmp_path)]
    train_ldm.main([*BASE, *first])
    capsys.readouterr()
    argv = [*BASE, "--resume", "auto", "--output-dir", str(tmp_path), "--max-steps", "2",
            "--no-gradient-checkpointing", "--ema-decay", "0.9"]  # fmt: skip
    assert train_ldm.main(argv)["step"] == 2
    out = capsys.readouterr().out
    assert "--no-gradient-checkpointing overrides the checkpoint's --gradient-checkpointing" in out
    assert "the EMA starts from the resumed weights" in out
    state = torch.load(tmp_path / "checkpoints" / "step-00000002.pt", weights_only=False)
    assert state["args"]["gradient_checkpointing"] is False and state["ema"] is not None


@pytest.mark.parametrize("saved, resumed", [("no", "fp16"), ("fp16", "bf16"), ("fp16", "no")])
def test_resume_switches_mixed_precision(train_ldm, tmp_path, capsys, saved, resumed):
    """A checkpoint without GradScaler state (fp32/bf16) resumed in fp16 starts a fresh scaler; an fp16 one resumed
    without fp16 leaves its scaler state unused."""
    first = train_ldm.main([*BASE, "--mixed-precision", saved, "--max-steps", "1", "--output-dir", str(tmp_path)])
    assert first["step"] == 1
    capsys.readouterr()
    second = train_ldm.main(
        [*BASE, "--resume", "auto", "--output-dir", str(tmp_path), "--max-steps", "2", "--mixed-precision", resumed]
    )  # fmt: skip
    assert second["step"] == 2 and all(torch.isfinite(torch.tensor(list(_losses(second).values()))))
    assert "GradScaler" in capsys.readouterr().out
    scaler = torch.load(tmp_path / "checkpoints" / "step-00000002.pt", weights_only=False)["scaler"]
    assert (scaler["scale"] > 0) if resumed == "fp16" else scaler == {}


SDXL = ["--model", "sdxl", "--tiny", "--resolution", "32", "--latent-factor", "2", "--batch-size", "2"]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([], id="unet-tiny-tokens"),
        pytest.param(SDXL, id="sdxl-tokens-pooled"),
    ],
)
def test_save_final_round_trips_with_the_conditioning(train_ldm, tmp_path, argv):
    """final/ = the EMA model (save_pretrained) + the wrapper's label embeddings (conditioning.safetensors) +
    denoiser.json; reloaded into a fresh Denoiser it answers exactly like the EMA weights of the last checkpoint."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    out = tmp_path / "run"
    train_ldm.main([*BASE, *argv, "--ema-decay", "0.5", "--max-steps", "2", "--save-final", "--output-dir", str(out)])
    final = out / "final"
    meta = json.loads((final / "denoiser.json").read_text())
    assert meta["model"] == (argv[1] if argv else "unet-tiny")
    assert meta["num_classes"] == 16 and meta["diffusers_class"] == "UNet2DConditionModel"
    # latents are not clipped to [-1, 1] when sampling (pixels would be)
    assert json.loads((final / "scheduler_config.json").read_text())["clip_sample"] is (meta["latent_factor"] == 1)

    # In memory: the denoiser of the last checkpoint with its EMA weights applied.
    state = torch.load(out / "checkpoints" / "step-00000002.pt", weights_only=False)
    model_mod, families = importlib.import_module("_train_model"), importlib.import_module("_train_families")
    factor = meta["latent_factor"]
    ref, _, channels = model_mod.build_denoiser(meta["model"], 16, meta["resolution"], factor, meta["tiny"], None)
    ref.load_state_dict(state["model"])
    ref.load_state_dict(state["ema"]["shadow"], strict=False)
    assert not torch.equal(state["model"]["tokens.weight"], state["ema"]["shadow"]["tokens.weight"])

    # From disk, by hand: diffusers for the model, the conditioning file for the wrapper.
    model = UNet2DConditionModel.from_pretrained(final)
    fresh = families.make_denoiser(model, meta["num_classes"], meta["resolution"])
    conditioning = load_file(final / "conditioning.safetensors")
    assert "tokens.weight" in conditioning and ("pooled.weight" in conditioning) == bool(argv)
    missing, unexpected = fresh.load_state_dict(conditioning, strict=False)
    assert not unexpected and all(k.startswith("model.") for k in missing)
    # ...and with the script's helper.
    helper = model_mod.load_final(final)

    side = meta["resolution"] // factor
    x = torch.randn(3, channels, side, side)
    t, labels = torch.tensor([5, 500, 999]), torch.tensor([0, 7, 16])  # 16: the null label
    with torch.no_grad():
        expected = ref.eval()(x, t, labels)
        assert torch.equal(fresh.eval()(x, t, labels), expected)
        assert torch.equal(helper.eval()(x, t, labels), expected)


def test_resume_with_another_batch_size_reads_on_in_the_same_epoch(train_ldm, tmp_path, monkeypatch):
    """Half of epoch 0 at batch size 8, resumed at 16: the second run reads exactly the other half of epoch 0."""
    samples = sys.modules["_train_data"].DiffusionSamples
    drawn: list[tuple[int, int]] = []
    read = samples.__getitem__
    monkeypatch.setattr(samples, "__getitem__", lambda self, key: drawn.append(key) or read(self, key))
    small = [*BASE, "--num-shapes", "64", "--save-every", "4", "--keep-last", "0"]
    train_ldm.main([*small, "--max-steps", "4", "--output-dir", str(tmp_path / "a")])
    first, drawn[:] = list(drawn), []
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000004.pt"
    summary = train_ldm.main([*small, "--batch-size", "16", "--max-steps", "6", "--resume", str(ckpt),
                              "--output-dir", str(tmp_path / "b")])  # fmt: skip
    assert summary["step"] == 6 and [h["epoch"] for h in summary["history"]] == [0, 0]
    assert {epoch for epoch, _ in first + drawn} == {0}
    assert sorted(index for _, index in first + drawn) == list(range(64))  # every sample once
    saved = torch.load(tmp_path / "b" / "checkpoints" / "step-00000006.pt", weights_only=False)
    assert (saved["epoch"], saved["samples_into_epoch"]) == (0, 64)


def test_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(train_ldm, tmp_path, capsys):
    """A fork from step 2 into the same folder: the abandoned run's steps 4 and 6 go to a superseded-* folder, so
    --keep-last keeps the new run's checkpoints and --resume auto picks the new run's last one."""
    out = tmp_path / "run"
    common = [*BASE, "--num-shapes", "64", "--output-dir", str(out)]
    train_ldm.main([*common, "--max-steps", "6", "--save-every", "2", "--keep-last", "3"])
    fork = out / "checkpoints" / "step-00000002.pt"
    shutil.copy(fork, tmp_path / "fork.pt")  # --keep-last rotates it away during the new run
    capsys.readouterr()
    train_ldm.main([*common, "--resume", str(tmp_path / "fork.pt"), "--lr", "1e-4", "--max-steps", "5",
                    "--save-every", "1", "--keep-last", "3"])  # fmt: skip
    assert "moved to" in capsys.readouterr().out
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-00000003.pt", "step-00000004.pt", "step-00000005.pt"]
    assert all(torch.load(out / "checkpoints" / name, weights_only=False)["args"]["lr"] == 1e-4 for name in kept)
    (aside,) = (out / "checkpoints").glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000004.pt", "step-00000006.pt"]
    resumed = train_ldm.main([*common, "--resume", "auto", "--max-steps", "6", "--save-every", "0"])
    assert resumed["step"] == 6 and len(resumed["history"]) == 1


def test_resume_is_bit_exact_with_dropout(train_ldm, tmp_path):
    """ModelScope's tiny UNet has dropout: its masks come from torch's global RNG, which a resume restores; the
    DataLoader's own generator keeps iter() from drawing from it where the uninterrupted run did not."""
    extra = ["--model", "modelscope", "--tiny", "--frames", "4", "--latent-factor", "2", "--batch-size", "2",
             "--num-shapes", "64", "--max-steps", "4", "--save-every", "2", "--keep-last", "0"]  # fmt: skip
    _resumes_exactly_from_step_2(train_ldm, tmp_path, extra)


def test_a_resume_that_fails_its_checks_sets_nothing_aside_and_metrics_are_not_repeated(train_ldm, tmp_path):
    out = tmp_path / "run"
    common = [*BASE, "--num-shapes", "64", "--output-dir", str(out)]
    train_ldm.main([*common, "--max-steps", "4", "--save-every", "2", "--keep-last", "0"])
    fork = str(out / "checkpoints" / "step-00000002.pt")
    with pytest.raises(SystemExit):  # a check after the checkpoint is read: nothing trained, nothing moved
        train_ldm.main([*common, "--resume", fork, "--batch-size", "512", "--max-steps", "4"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002.pt", "step-00000004.pt"]
    train_ldm.main([*common, "--resume", fork, "--max-steps", "5", "--lr", "1e-4"])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # the forked-off run's steps 3 and 4 are dropped, not repeated


def test_not_a_checkpoint_is_a_clear_message(train_ldm, tmp_path):
    bogus = tmp_path / "step-00000001.pt"
    bogus.write_text("not a checkpoint")
    with pytest.raises(SystemExit, match="not a checkpoint this script can read"):
        train_ldm.main([*BASE, "--max-steps", "1", "--output-dir", str(tmp_path / "o"), "--resume", str(bogus)])
    torch.save({"weights": torch.zeros(1)}, bogus)
    with pytest.raises(SystemExit, match=r"not a checkpoint of examples/train_ldm\.py"):
        train_ldm.main([*BASE, "--max-steps", "1", "--output-dir", str(tmp_path / "o"), "--resume", str(bogus)])


def test_resume_with_other_classes_in_the_data_folder_is_a_clear_message(train_ldm, tmp_path):
    data = tmp_path / "images"
    for cls in ("red", "blue"):
        (data / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (18, 18), (200, 30, 30) if cls == "red" else (30, 30, 200)).save(data / cls / f"{i}.png")
    out = tmp_path / "run"
    args = [*BASE, "--data", str(data), "--batch-size", "4", "--save-every", "1", "--output-dir", str(out)]
    train_ldm.main([*args, "--max-steps", "1"])
    (data / "green").mkdir()
    Image.new("RGB", (18, 18), (30, 200, 30)).save(data / "green" / "0.png")
    with pytest.raises(SystemExit, match=r"trained on the classes \['blue', 'red'\] \(2\); --data holds .*'green'"):
        train_ldm.main([*args, "--max-steps", "2", "--resume", "auto"])
