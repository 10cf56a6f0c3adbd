"""Plumbing for examples/train_ldm.py: process group, RNG states, checkpoints, metric logging and the profiling
window."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK): NCCL on GPUs, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistInfo(rank, world, local, dev)


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """``obj`` from every rank (a list of one when not distributed)."""
    if info.world_size == 1:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def mean_over_ranks(value: torch.Tensor, info: DistInfo) -> float:
    if info.world_size > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.device.type == "cuda" else dist.ReduceOp.SUM)
        if value.device.type != "cuda":  # gloo has no AVG
            value /= info.world_size
    return float(value)


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(
            p.detach()
            .cpu()
            .clone(memory_format=torch.contiguous_format)
            .reshape(-1)
            .view(torch.uint8)
            .numpy()
            .tobytes()
        )
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ checkpoints


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step:08d}.pt"


def latest_checkpoint(out_dir: Path, sub: str = "checkpoints") -> Path | None:
    found = sorted((out_dir / sub).glob("step-*.pt"))
    return found[-1] if found else None


def set_aside_newer_checkpoints(out_dir: Path, step: int) -> Path | None:
    """Move the checkpoints of ``out_dir`` past ``step`` into a ``superseded-*`` sub-folder; return it (None if none).

    Resuming from an earlier checkpoint forks the run: left in place, the abandoned run's later checkpoints would
    outrank the new run's in --keep-last rotation and in --resume auto, which both go by step number.
    """
    steps = {p: p.stem.removeprefix("step-") for p in (out_dir / "checkpoints").glob("step-*.pt")}
    newer = [p for p, digits in steps.items() if digits.isdigit() and int(digits) > step]
    if not newer:
        return None
    aside = out_dir / "checkpoints" / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step:08d}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in newer:
        os.replace(path, aside / path.name)
    return aside


def save_checkpoint(path: Path, state: dict, keep_last: int) -> None:
    """Atomic write (temporary file, then rename), then delete all but the newest ``keep_last`` checkpoints."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    if keep_last > 0:
        for old in sorted(path.parent.glob("step-*.pt"))[:-keep_last]:
            old.unlink()


def load_checkpoint(path: Path) -> dict:
    """A checkpoint this script saved; anything else is a clear error naming the file, not an unpickling traceback."""
    try:
        # Our own file: RNG states hold numpy arrays and tuples, which the weights-only unpickler refuses.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # pickle, zip and I/O errors alike
        why = f"{type(exc).__name__}: {exc}"
        raise SystemExit(f"--resume {path}: not a checkpoint this script can read ({why})") from exc
    if not isinstance(state, dict) or not {"model", "step", "rng"} <= set(state):
        raise SystemExit(f"--resume {path}: not a checkpoint of examples/train_ldm.py (no model, step and rng entries)")
    return state


# ------------------------------------------------------------------------------------------------ logging


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl record (an unreadable line counts as past every step: dropped on a resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricLogger:
    """Rank 0 writes metrics to ``metrics.jsonl`` and, if asked, TensorBoard or Weights & Biases (imported only
    then, with a clear message when the package is missing). Other ranks log nothing."""

    def __init__(
        self, report_to: str, out_dir: Path, config: dict, enabled: bool, run_name: str, resumed_at: int | None = None
    ) -> None:
        self.enabled, self.kind, self.backend = enabled, report_to, None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        if resumed_at is not None and path.exists():
            # Records past the resumed step are the forked-off (or crashed) run's: the steps are trained again.
            kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= resumed_at]
            path.write_text("".join(kept))
        self.jsonl = path.open("a")
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit(
                    f"--report-to tensorboard needs the tensorboard package: pip install tensorboard ({exc})"
                ) from exc
            # purge_step: TensorBoard hides the events this log holds from that step on (the forked-off run's).
            purge = None if resumed_at is None else resumed_at + 1
            self.backend = SummaryWriter(log_dir=str(out_dir / "tensorboard" / run_name), purge_step=purge)
            self.backend.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
        elif report_to == "wandb":
            try:
                import wandb
            except ImportError as exc:
                raise SystemExit(f"--report-to wandb needs the wandb package: pip install wandb ({exc})") from exc
            self.backend = wandb.init(project="ldmopt-train", name=run_name, config=config, dir=str(out_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.jsonl.flush()
        if self.kind == "tensorboard":
            for k, v in metrics.items():
                self.backend.add_scalar(k, v, step)
        elif self.kind == "wandb":
            self.backend.log(metrics, step=step)

    def image(self, step: int, tag: str, path: Path) -> None:
        if not self.enabled or self.backend is None:
            return
        from PIL import Image

        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
        if self.kind == "tensorboard":
            self.backend.add_image(tag, arr, step, dataformats="HWC")
        else:
            import wandb

            self.backend.log({tag: wandb.Image(arr)}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl.close()
        if self.kind == "tensorboard":
            self.backend.close()
        elif self.kind == "wandb":
            self.backend.finish()


# ------------------------------------------------------------------------------------------------ profiling


def restore_optimization(state: dict, args, given: set[str] | None, is_main: bool, optimizer, lr_scheduler, scaler,
                         ema, resume_path) -> None:  # fmt: skip
    """Load the optimizer, schedule, GradScaler and EMA state of a checkpoint, keeping an explicit --lr and
    --weight-decay (``given``: the arguments given on the command line; None counts all of them as given)."""
    # How this run steps (fused/foreach: fused AdamW on GPUs only), not how the checkpoint's run did.
    how = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, kept in zip(optimizer.param_groups, how):
        group.update(kept)
    # a checkpoint saved with --channels-last and resumed without it (or the reverse): moments in the other layout
    import ldmopt

    ldmopt.match_optimizer_layout(optimizer)
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    # The saved optimizer and schedule carry their own lr and weight decay, which would silently win over an
    # explicit --lr/--weight-decay: reapply ours (the same values, and the same lr, when nothing was overridden).
    # A checkpoint without saved arguments keeps its own unless they are given: the defaults are not its values.
    keeps_saved = state.get("args") is None and given is not None
    if not (keeps_saved and "lr" not in given):
        lr_scheduler.base_lrs = [args.lr] * len(optimizer.param_groups)
        for group, lr_lambda in zip(optimizer.param_groups, lr_scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = args.lr, args.lr * lr_lambda(lr_scheduler.last_epoch)
    if not (keeps_saved and "weight_decay" not in given):
        for group in optimizer.param_groups:
            group["weight_decay"] = args.weight_decay
    # A disabled GradScaler saves {}, which an enabled one refuses: mixed precision may change on resume.
    saved_scaler = state.get("scaler") or {}
    if scaler.is_enabled() and saved_scaler:
        scaler.load_state_dict(saved_scaler)
    elif scaler.is_enabled() and is_main:
        print("note: the checkpoint has no GradScaler state (not trained in fp16): fp16 starts a fresh scaler")
    elif saved_scaler and is_main:
        print(f"note: --mixed-precision {args.mixed_precision}: the checkpoint's fp16 GradScaler state is unused")
    if ema is not None:
        if state.get("ema") is None:  # EMA switched on mid-run: it starts from the resumed weights
            if is_main:
                print(f"note: {resume_path} has no EMA state; the EMA starts from the resumed weights", flush=True)
        else:
            ema.load_state_dict(state["ema"])


def tune_patch(model: torch.nn.Module, step: Callable[[], None], info: DistInfo, choice: str | dict | None,
               save_to: Path) -> tuple[Any, dict]:  # fmt: skip
    """Patch ``model`` with the fused rules that make ``step`` (a training step) faster, on every rank alike; returns
    (the rank's PatchReport, the choice patched).

    With ``choice`` (a saved choice's path, or the dict a checkpoint kept), ``ldmopt.patch_tuned`` applies it without
    measuring. Otherwise every rank times the step with and without each rule (``ldmopt.tune(training=True)``, on
    its own GPU, at the same time) and rank 0's choice is applied everywhere: ranks that patch differently would run
    different kernels on the same replica. Rank 0 saves that choice to ``save_to``.
    """
    import ldmopt

    if choice is not None:
        label = f"--tune-choice {choice}" if isinstance(choice, str) else "the checkpoint's tuning choice"
        try:
            loaded = json.loads(Path(choice).read_text()) if isinstance(choice, str) else choice
            return ldmopt.patch_tuned(model, loaded, training=True), loaded
        except (OSError, json.JSONDecodeError, ValueError, ldmopt.patch.PatchError) as error:
            raise SystemExit(f"{label}: {error}") from None
    devices = [info.device] if info.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the measured steps draw no numbers the training would
        report = ldmopt.tune(model, step, training=True)
    chosen = report.tuning.choice()
    if info.world_size > 1:
        shared = [chosen if info.is_main else None]
        dist.broadcast_object_list(shared, src=0, device=info.device if info.device.type == "cuda" else None)
        if _kept_sites(shared[0]) != _kept_sites(chosen):
            tuning = report.tuning
            ldmopt.unpatch(model)
            report = ldmopt.patch_tuned(model, shared[0], training=True)
            report.tuning = tuning  # this rank's measurements, though rank 0's choice is patched
            print(f"rank {info.rank}: applied rank 0's tuning choice in place of its own", flush=True)
        chosen = shared[0]
    if info.is_main:  # rank 0's own choice
        report.tuning.save(save_to)
    return report, chosen


def _kept_sites(choice: dict) -> list[tuple[str, str]]:
    return sorted((s["model"], s["name"]) for s in choice["sites"] if s["kept"])


def describe_first_step(report, device: torch.device) -> None:
    """What ldmopt ran in the first training step (``report``: ldmopt.patch's), printed once by rank 0."""
    print(f"ldmopt backends in the first step: {report.backends()}", flush=True)
    if report.fallbacks() and device.type == "cpu":  # expected there: the kernels serve GPUs
        print(f"ldmopt: on the CPU the reference path runs ldmopt's ops ({sum(report.fallbacks().values())} "
              "unfused calls in the first step)", flush=True)  # fmt: skip
    elif report.fallbacks():
        print(f"ldmopt: calls that took the stock or reference path: {report.fallbacks()}", flush=True)
    if report.layout_copies():
        print(f"ldmopt: inputs copied to channels-last: {report.layout_copies()}", flush=True)


def profile_window(
    run_step: Callable[[], None],
    wait: int,
    warmup: int,
    active: int,
    out_dir: Path,
    model: torch.nn.Module,
    write: bool,
) -> dict[str, float]:
    """Run ``wait + warmup + active`` training steps under the profiler; return ``{"profile/<category>": share}``.

    With ``ldmopt.profiler``, device time (CPU operator time without a GPU) is split by category (convolution,
    linear, attention spatial/cross/temporal, normalization, elementwise, layout, ldmopt kernels, other) and rank 0
    writes ``categories.txt``, ``categories.json`` and ``trace.json`` to ``out_dir``. Without it, torch.profiler's
    operator table goes to ``ops.txt``.
    """
    try:
        from ldmopt.profiler import profile
    except ImportError as exc:
        return _torch_profiler_window(run_step, wait, warmup, active, out_dir, write, reason=str(exc))
    result = profile(run_step, wait=wait, warmup=warmup, steps=active, training=True, modules={"model": model})
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "categories.txt").write_text(result.table() + "\n")
        (out_dir / "categories.json").write_text(json.dumps(result.to_dict(), indent=2, default=str))
        result.export_chrome_trace(str(out_dir / "trace.json"))
        print(result.table(), flush=True)
    return {f"profile/{k}": v for k, v in result.shares().items()}


def _torch_profiler_window(run_step, wait, warmup, active, out_dir: Path, write: bool, reason: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1)) as prof:
        for _ in range(wait + warmup + active):
            run_step()
            prof.step()
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (out_dir / "ops.txt").write_text(f"ldmopt.profiler unavailable ({reason}); torch.profiler table:\n{table}\n")
        print(f"ldmopt.profiler unavailable ({reason}); torch.profiler operator table in {out_dir / 'ops.txt'}")
    return {}
