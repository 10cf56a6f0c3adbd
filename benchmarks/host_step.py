"""Host time of a whole denoiser step, stock and patched, measured on the CPU with nothing computed that a GPU would.

A GPU with ldmopt._C runs a patched step's passes as C++ op calls and Triton launches, and at SD-class sizes on an
H200 a step is host-bound (2026-12-04: stock SD1.5 22.1 ms eager against 10.1 ms as a CUDA graph), so what ldmopt's
Python costs per step decides whether patching pays in eager mode. This script builds the zoo's tiny config (the
real model's module structure, few channels, so the stock step's own CPU compute is small), patches it with the
placements a GPU would choose (``count_launches.as_gpu_with_extension``: C++ ops stood in for, Triton launches
stubbed), and reports, under torch.no_grad after warm-up steps:

- ms per step, stock and patched (fastest of ``--steps``), on this CPU; the stock step's small CPU compute included,
  the patched step's cuDNN/cuBLAS stand-ins (F.conv2d, F.linear) computing on the CPU too;
- Python function calls (and C calls made from Python) per step, counted with ``sys.setprofile``: a count that does
  not depend on the machine's load.

No GPU; not a speed of any kernel. ``--profile N`` prints cProfile's top N functions of the patched step.
    python benchmarks/host_step.py sd15 [dit animatediff ...] [--resolution 32] [--steps 30]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported: the stub is the interpreter's

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

import ldmopt
from benchmarks.count_launches import as_gpu_with_extension, channels_last_step
from benchmarks.profile_host import stubbed_launches


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _conv2d_standin(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    kh, kw = weight.shape[2:]
    oh = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    layout = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return x.new_empty((x.shape[0], weight.shape[0], oh, ow)).contiguous(memory_format=layout)


_COMPUTE_STANDINS = {
    "conv2d": _conv2d_standin,
    "linear": lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])),
    "scaled_dot_product_attention": lambda query, key, value, *args, **kwargs: query.new_empty(
        (*query.shape[:-1], value.shape[-1])
    ),
}


@contextlib.contextmanager
def stubbed_compute():
    """F.conv2d, F.linear and F.scaled_dot_product_attention return uninitialised outputs of the right shape and
    layout at once, in the stock and the patched step alike: what remains is host time (ldmopt's and torch's Python,
    aten dispatch of the small ops), as a GPU's launches would leave it."""
    saved = {name: getattr(F, name) for name in _COMPUTE_STANDINS}
    for name, standin in _COMPUTE_STANDINS.items():
        setattr(F, name, standin)
    try:
        yield
    finally:
        for name, stock in saved.items():
            setattr(F, name, stock)


def _step_fn(name: str, resolution: int | None, frames: int | None):
    torch.manual_seed(0)
    model, method, kwargs = channels_last_step(name, resolution, frames, torch.float32, tiny=True)
    forward = getattr(model, method)
    return model, lambda: forward(**kwargs)


def fastest_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def python_calls(step) -> int:
    """Python calls and C calls from Python during one ``step()``."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def measure(name: str, resolution: int | None, frames: int | None, steps: int, profile_top: int = 0,
            stub_compute: bool = False, profile_sort: str = "tottime") -> dict:  # fmt: skip
    model, step = _step_fn(name, resolution, frames)
    with torch.no_grad(), stubbed_compute() if stub_compute else contextlib.nullcontext():
        for _ in range(3):
            step()
        stock_ms, stock_calls = fastest_ms(step, steps), python_calls(step)
    report = ldmopt.patch(model)
    compute = stubbed_compute() if stub_compute else contextlib.nullcontext()
    with torch.no_grad(), ldmopt.use_backend("auto"), stubbed_launches(), as_gpu_with_extension(), compute:
        for _ in range(3):  # the first calls set up the statistics hand-overs
            step()
        patched_ms, patched_calls = fastest_ms(step, steps), python_calls(step)
        profile = ""
        if profile_top:
            profiler = cProfile.Profile()
            profiler.runcall(step)
            out = pstats.Stats(profiler, stream=(buffer := _Buffer())).sort_stats(profile_sort)
            out.print_stats(profile_top)
            profile = buffer.text
    return {
        "model": name,
        "modules": len(report.replaced),
        "stock_ms": stock_ms,
        "patched_ms": patched_ms,
        "stock_calls": stock_calls,
        "patched_calls": patched_calls,
        "profile": profile,
    }


class _Buffer:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s


def table(rows: list[dict]) -> str:
    lines = [
        "| model (tiny) | modules patched | stock ms/step | patched ms/step | ratio | stock calls/step | "
        "patched calls/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['modules']} | {r['stock_ms']:.1f} | {r['patched_ms']:.1f} | "
            f"{r['patched_ms'] / r['stock_ms']:.2f}x | {r['stock_calls']} | {r['patched_calls']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="zoo names (ldmopt.configs.names())")
    parser.add_argument("--resolution", type=int, default=None, help="pixels (default: the zoo's tiny one)")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's top N of a patched step")
    parser.add_argument(
        "--profile-sort",
        default="tottime",
        choices=("tottime", "cumulative", "ncalls"),
        help="the order of --profile's list (default: time in the function itself)",
    )
    parser.add_argument(
        "--stub-compute", action="store_true", help="convolutions, GEMMs and attention return at once (host time only)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # steadier times: the small CPU convs and GEMMs run on one thread in both steps
    rows = []
    for name in args.models:
        row = measure(
            name, args.resolution, args.frames, args.steps, args.profile, args.stub_compute, args.profile_sort
        )
        if row["profile"]:
            print(f"== {name}, patched step\n{row['profile']}")
        rows.append(row)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
