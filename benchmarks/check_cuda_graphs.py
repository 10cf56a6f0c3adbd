"""GPU check of ``ldmopt.cuda_graphs``: a denoiser replayed as CUDA graphs gives what it gives eagerly.

For each case a zoo model (random weights, fp16, channels-last) runs ``CALLS`` calls eagerly, each with fresh
inputs (latents, timestep, conditioning), then the same calls through ``ldmopt.cuda_graphs``: one capture, a replay
per call; and ldmopt.demo's tiny patched StableDiffusionPipeline runs ``CALLS`` denoising steps with and without its
UNet graphed. Prints a check_gpu.py-style line per case: the max relative error of each call's output against the eager
one, and PASS/FAIL; a case whose calls did not all replay (an eager call, a second capture) is an ERROR line naming
the reasons ``str(graphs)`` gives. Exits 1 on any failure. Run: python benchmarks/check_cuda_graphs.py
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("LDMOPT_POISON_OUTPUTS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ldmopt
from ldmopt import configs

DEVICE = "cuda"  # tests/test_check_scripts_dry_run.py runs it on the CPU with the zoo's tiny configs
TINY = False
DTYPE = torch.float16
CALLS = 3
BOUND = 5e-3  # fp16, as check_gpu.py; eager and replay run the same kernels, so the error is normally 0
#: case -> (zoo name, resolution, batch, patched); "pipeline": ldmopt.demo's tiny StableDiffusionPipeline, patched,
#: whose own loop calls the UNet (scheduler timesteps, classifier-free guidance), images compared
CASES = {
    "sd15-256-patched": ("sd15", 256, 2, True),
    "sd15-256-stock": ("sd15", 256, 2, False),
    "dit-256-patched": ("dit", 256, 2, True),
    # ldmopt's temporal attention kernels autotune during the warm-up calls, before the capture
    "animatediff-256x8-patched": ("animatediff", 256, 1, True),
    "tiny-sd-pipeline": ("pipeline", None, 2, True),
}
FRAMES = 8  # the video cases


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _model(zoo: str, resolution: int, batch: int):
    torch.manual_seed(0)
    frames = FRAMES if configs.get(zoo).is_video else None
    model = configs.build_model(zoo, device=DEVICE, dtype=DTYPE, tiny=TINY, frames=frames).eval()
    model = model.to(memory_format=torch.channels_last)
    calls = []
    for seed in range(CALLS):  # fresh inputs per call: a replay that read stale buffers differs
        torch.manual_seed(seed + 1)
        inputs = configs.example_inputs(model, resolution=None if TINY else resolution, frames=frames, batch=batch)
        kwargs = dict(inputs.kwargs)
        t = kwargs["timestep"]  # the zoo's inputs fix it at 999
        new = torch.randint_like(t, 1, 999) if not t.is_floating_point() else torch.rand_like(t) * 999
        # A batch of timesteps as DiT-class pipelines pass it: one value expanded (a stride-0 view)
        kwargs["timestep"] = new[:1].expand(t.shape[0]) if t.dim() == 1 else new
        calls.append(kwargs)
    return model, calls


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def run_pipeline() -> tuple[list[float], str]:
    """The tiny patched pipeline's images with its UNet graphed against its eager images (CALLS denoising steps: one
    capture, then a replay per step)."""
    from ldmopt.demo import build_tiny_sd_pipeline, run_sd

    pipe = build_tiny_sd_pipeline(DEVICE, DTYPE, seed=0)
    ldmopt.patch(pipe)
    try:
        run_sd(pipe, steps=CALLS, seed=1)  # settle first-call state, as the model cases do
        eager, _ = run_sd(pipe, steps=CALLS, seed=1)
        graphs = ldmopt.cuda_graphs(pipe)
        try:
            graphed, _ = run_sd(pipe, steps=CALLS, seed=1)
        finally:
            wrapper = graphs.wrappers["unet"]
            problems = wrapper.captures != 1 or wrapper.replays != CALLS or bool(wrapper.eager_calls)
            summary = " | ".join(str(graphs).splitlines())
            graphs.remove()
    finally:
        ldmopt.unpatch(pipe)
    return [rel_err(graphed, eager)], summary if problems else ""


def run_case(name: str) -> tuple[list[float], str]:
    """Errors of the graphed calls' outputs against the eager ones, and what did not replay ("" when all did)."""
    zoo, resolution, batch, patched = CASES[name]
    if zoo == "pipeline":
        return run_pipeline()
    model, calls = _model(zoo, resolution, batch)
    call = model
    if patched:
        ldmopt.patch(model)
    with torch.no_grad():
        for _ in range(2):  # settle first-call state (statistics hand-overs) before the references
            call(**calls[0])
        eager = [_output(call(**kw)).clone() for kw in calls]
        graphs = ldmopt.cuda_graphs(model)
        try:
            graphed = [_output(call(**kw)) for kw in calls]
        finally:
            summary = str(graphs)
            wrapper = next(iter(graphs.wrappers.values()))
            problems = wrapper.captures != 1 or wrapper.replays != CALLS or bool(wrapper.eager_calls)
            graphs.remove()
    if patched:
        ldmopt.unpatch(model)
    return [rel_err(g, e) for g, e in zip(graphed, eager)], (" | ".join(summary.splitlines()) if problems else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="only these cases")
    args = parser.parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("check_cuda_graphs: no CUDA device; nothing to check")
        return 0
    failures = 0
    for name in CASES:
        if args.only and name not in args.only:
            continue
        try:
            errs, problems = run_case(name)
        except Exception as exc:
            failures += 1
            print(f"cuda_graphs ERROR {name}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            print(traceback.format_exc())
            continue
        if problems:
            failures += 1
            print(f"cuda_graphs ERROR {name}: not every call replayed: {problems[:300]}")
            continue
        ok = all(e <= BOUND for e in errs)  # NaN compares False
        failures += not ok
        errs_text = " ".join(f"{e:.2e}" for e in errs)
        status = "PASS" if ok else "FAIL"
        print(f"{'cuda_graphs':<22} {name:<22} {str(DTYPE)[6:]:<9} {'graph':<14} {errs_text:<40} {status}")
    print(f"check_cuda_graphs: {'all passed' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
