"""Where the host time of one fused call goes: cProfile over repeated calls of each bench_host_overhead case.

bench_host_overhead gives microseconds per call; this splits them by Python function (ldmopt's dispatch, Triton's
launcher, torch) so that a host-bound op shows what to cut. Run on a GPU:
    python benchmarks/profile_host.py [--calls 300] [--top 14] [--case NAME ...]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import bench_host_overhead as B


def profile_case(name: str, calls: int, top: int, device: str) -> str:
    fused, unfused = B.CASES[name]
    tensors = B._tensors(torch.float16) if device == "cuda" else _cpu_tensors()
    lines = [f"== {name}"]
    with torch.inference_mode():
        for label, fn in (("ldmopt", fused), ("eager", unfused)):  # bench_host_overhead's timing, its first call
            # compiling and autotuning outside the windows
            lines.append(f"{label}: {B.us_per_call(lambda fn=fn: fn(tensors)).median_ms * 1e3:.1f} us/call")
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
    args = parser.parse_args(argv)
    for name in args.case or list(B.CASES):
        try:
            print(profile_case(name, args.calls, args.top, args.device), flush=True)
        except Exception as exc:  # one case that cannot run must not hide the others
            print(f"== {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
