"""Where the host time of one fused call goes: cProfile over repeated calls of each bench_host_overhead case.

bench_host_overhead gives microseconds per call; this splits them by Python function (ldmopt's dispatch, Triton's
launcher, torch) so that a host-bound op shows what to cut. Run on a GPU:
    python benchmarks/profile_host.py [--calls 300] [--top 14] [--case NAME ...]
Without one, ``--device cpu --stub-launches`` times what is ldmopt's own: the ops run their Triton backend in the
interpreter with every launch returning at once, so a call's time is its dispatch, checks, allocations and launch
arithmetic (and the autotuner's key lookup), not Triton's launcher or any kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import bench_host_overhead as B


@contextlib.contextmanager
def stubbed_launches():
    """Every Triton launch (in the CPU interpreter) returns at once; yields the names of the kernels launched."""
    from triton.runtime import interpreter

    launches = []
    stock = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: launches.append(self.fn.__name__)
    try:
        yield launches
    finally:
        interpreter.InterpretedFunction.run = stock


def profile_case(name: str, calls: int, top: int, device: str, stub_launches: bool = False) -> str:
    fused, unfused = B.CASES[name]
    tensors = B._tensors(torch.float16) if device == "cuda" else _cpu_tensors()
    lines = [f"== {name}"]
    with torch.inference_mode(), stubbed_launches() if stub_launches else contextlib.nullcontext() as launches:
        for label, fn in (("ldmopt", fused), ("eager", unfused)):  # bench_host_overhead's timing, its first call
            # compiling and autotuning outside the windows
            if label == "ldmopt" and stub_launches:
                label = "ldmopt (launches stubbed)"
            lines.append(f"{label}: {B.us_per_call(lambda fn=fn: fn(tensors)).median_ms * 1e3:.1f} us/call")
            if launches:
                per_call = len(launches) / (1 + B.WINDOWS * B.CALLS)
                lines[-1] += f", {per_call:g} launches/call"
                launches.clear()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fused(tensors)
        profiler.disable()
    entries = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, ncalls, tottime, cumtime, callers)
    lines.append("  tottime us/call  cumtime us/call  calls/call  function")
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in sorted(entries.items(), key=lambda e: -e[1][2])[:top]:
        where = f"{func} ({Path(file).name}:{line})" if file != "~" else func
        lines.append(
            f"  {tottime / calls * 1e6:14.1f}  {cumtime / calls * 1e6:15.1f}  {ncalls / calls:10.1f}  {where[:90]}"
        )
    return "\n".join(lines)


def _cpu_tensors():
    B.DEVICE = "cpu"
    return B._tensors(torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--case", action="append", choices=list(B.CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--stub-launches", action="store_true", help="CPU only: Triton launches return at once (ldmopt's own host time)"
    )
    args = parser.parse_args(argv)
    if args.stub_launches:
        if args.device != "cpu":
            parser.error("--stub-launches runs the Triton backend in the CPU interpreter: use it with --device cpu")
        os.environ["TRITON_INTERPRET"] = "1"  # before the first op call imports the kernels
    for name in args.case or list(B.CASES):
        try:
            print(profile_case(name, args.calls, args.top, args.device, args.stub_launches), flush=True)
        except Exception as exc:  # one case that cannot run must not hide the others
            print(f"== {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
