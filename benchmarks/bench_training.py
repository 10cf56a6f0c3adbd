"""Training step (forward + backward + AdamW step) of SD1.5- and SDXL-size UNets with random weights.

Providers: ``eager`` (stock diffusers), ``compile`` (torch.compile, default inductor mode: max-autotune on a training
graph of this size compiles for tens of minutes), ``ldmopt`` (``ldmopt.patch(model, training=True)``),
``ldmopt+compile`` and ``ldmopt-tuned`` (``ldmopt.tune(model, step, training=True)``: only the rules whose fused
layers made this very step faster; its choice goes to ``<results>/training_tuning_<case>.choice.json``). All run
bf16 autocast over fp32 master weights, channels-last, fused AdamW, MSE against a random target. Per provider: step
time (median of do_bench), images/s, peak memory above the resident model and optimizer
state (harness.peak_memory), TFLOP/s from the analytic forward count x 3 (ldmopt.profiler.analyze), the fused
modules that fell back to the stock forward, and the profiler's category split of one step, written to
``<results>/training_profile.md`` (before = eager, after = ldmopt).

Batch: the largest of BATCHES[case] with which the eager step fits in memory (LDMOPT_BENCH_TRAIN_BATCH=<n> forces
one), the same for every provider. Quick mode (LDMOPT_BENCH_QUICK=1): SD1.5 only, batch 16, eager and ldmopt. One
test per (model, provider), so each fits the per-test timeout (compiling a training graph takes minutes). Targets on
an H200: ldmopt >= 1.2x eager step throughput and >= 15% lower peak memory.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os

import pytest
import torch

import ldmopt
from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
CASES = {"sd15": 512} if QUICK else {"sd15": 512, "sdxl": 1024}  # zoo name -> resolution (latents 8x smaller)
BATCHES = {"sd15": (64, 48, 32, 16, 8), "sdxl": (16, 12, 8, 4, 2)}
PROVIDERS = ("eager", "ldmopt") if QUICK else ("eager", "compile", "ldmopt", "ldmopt+compile", "ldmopt-tuned")
_EAGER_PEAK: dict[str, int] = {}  # case -> eager peak memory, for the other providers' notes
# Compiling a training graph outlasts run_gpu.sh's 300 s per-test timeout (pytest-timeout, when installed).
_LONG = pytest.mark.timeout(1200) if importlib.util.find_spec("pytest_timeout") else pytest.mark.slow


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


class TrainStep:
    """One model, its optimizer and a fixed batch; ``step()`` runs forward + backward + AdamW."""

    def __init__(
        self, name: str, resolution: int, batch: int, provider: str, device: str = "cuda", tiny: bool = False
    ) -> None:
        from ldmopt import configs

        self.model = configs.build_model(name, device=device, dtype=torch.float32, tiny=tiny).train()
        self.model.to(memory_format=torch.channels_last)
        patched = provider.startswith("ldmopt") and provider != "ldmopt-tuned"  # tuned below, by timing step()
        self.report = ldmopt.patch(self.model, training=True) if patched else None
        self.runner = harness.compiled(self.model, mode=None) if provider.endswith("compile") else self.model
        inputs = configs.example_inputs(self.model, resolution=resolution, batch=batch, dtype=torch.float32)
        self.kwargs = dict(inputs.kwargs)
        self.kwargs["sample"] = self.kwargs["sample"].contiguous(memory_format=torch.channels_last)
        self.kwargs["timestep"] = torch.randint(0, 1000, (batch,), device=device)
        self.target = torch.randn_like(self.kwargs["sample"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=device == "cuda")
        self.device = device
        if provider == "ldmopt-tuned":  # whole steps, optimizer included, per rule group: the tuning costs ~100 steps
            self.report = ldmopt.tune(self.model, self.step, training=True, warmup=1, repeats=3)

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            out = self.runner(**self.kwargs)[0]
        loss = torch.nn.functional.mse_loss(out.float(), self.target)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _fits(name: str, batch: int) -> bool:
    runner = None
    try:
        runner = TrainStep(name, CASES[name], batch, "eager")
        runner.step()
        runner.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        runner = None
        _free()


@functools.cache
def _batch(name: str) -> int:
    forced = os.environ.get("LDMOPT_BENCH_TRAIN_BATCH")
    if forced or QUICK:
        return int(forced or 16)
    for batch in BATCHES[name]:
        if _fits(name, batch):
            return batch
    pytest.skip(f"{name}: even batch {BATCHES[name][-1]} does not fit in GPU memory")


def _profile_split(runner: TrainStep, title: str) -> str:
    prof = ldmopt.profile(runner.step, wait=1, warmup=1, steps=1, training=True, modules={"unet": runner.model})
    path = harness.RESULTS_DIR / "training_profile.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"\n## {title}\n\n```\n{prof.table()}\n```\n")
    shares = sorted(prof.shares().items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares)


@_LONG
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name", list(CASES))
def bench_training_step(name, provider, bench_recorder):
    from ldmopt.profiler import analyze

    batch = _batch(name)
    resolution = CASES[name]
    flops = 3 * analyze(name, resolution=resolution, batch=batch, dtype=torch.bfloat16).total_flops
    case = f"{name}-{resolution}px-b{batch}"
    runner, timing, peak, note = None, None, None, ""
    try:
        runner = TrainStep(name, resolution, batch, provider)
        runner.step()  # compiles, allocates optimizer state
        runner.step()
        peak = harness.peak_memory(runner.step)
        timing = harness.time_fn(runner.step, warmup=1000, rep=3000)
        note = f"{batch * 1000 / timing.median_ms:.1f} img/s"
        if provider == "eager":
            _EAGER_PEAK[case] = peak
        elif case in _EAGER_PEAK:
            note += f", peak mem {100 * (peak - _EAGER_PEAK[case]) / _EAGER_PEAK[case]:+.0f}% vs eager"
        if runner.report is not None and runner.report.tuning is not None:
            tuning = runner.report.tuning
            note += f"; tuned: kept {tuning.kept_per_rule_text()}"
            tuning.save(harness.RESULTS_DIR / f"training_tuning_{case}.choice.json")
        if runner.report is not None and runner.report.fallbacks():
            note += f"; fell back: {runner.report.fallbacks()}"
        if provider in ("eager", "ldmopt"):
            note += "; top: " + _profile_split(runner, f"{case} {provider} (bf16 autocast training step)")
    except torch.OutOfMemoryError:
        note = "out of memory"
    except Exception as exc:  # a provider that cannot run is recorded, not fatal
        note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
    finally:
        runner = None
        _free()
    bench_recorder.record(op="train_step", case=case, dtype="bf16", mode="fwd+bwd+adamw", provider=provider,
                          timing=timing, flops=flops, peak_mem=peak, note=note)  # fmt: skip
