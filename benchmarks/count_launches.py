"""Triton launches, statistics passes and fused op calls per denoiser step of a zoo model, counted on the CPU.

The model is built from its embedded config with random weights, patched, and run in the Triton interpreter with
every launch stubbed (it returns at once, so outputs are garbage but the counts are exact), under torch.no_grad as
pipelines run it: three steps, the first teaching the statistics hand-overs, the last one counted. No GPU; what the
launches cost in time is for a GPU run. Full-size models take several GB of host memory at fp16.
    python benchmarks/count_launches.py sd15 [--resolution 64] [--frames 4] [--dtype fp16] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported: the stub is the interpreter's

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import ldmopt
from benchmarks.profile_host import stubbed_launches

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: the kernel launched once per statistics pass of its own: the finalize of the split GroupNorm statistics (after one
#: partials launch per input part), the LayerNorm row statistics
STATISTICS_PASSES = {"group_norm": "_group_norm_fwd_finalize_kernel", "layer_norm": "_row_stats_kernel"}


def count_step(name: str, resolution: int, frames: int | None, dtype: torch.dtype, tiny: bool) -> dict:
    """{"launches": Counter by kernel, "op_calls": {op: calls}, "handovers": {consumer: calls}} of one step."""
    from ldmopt.configs import build_model, example_inputs

    model = build_model(name, device="cpu", dtype=dtype, tiny=tiny, frames=frames)
    for p in model.parameters():
        if p.dim() == 4:
            p.data = p.data.to(memory_format=torch.channels_last)
    inputs = example_inputs(model, resolution=resolution, frames=frames)
    kwargs = {
        k: v.to(memory_format=torch.channels_last) if isinstance(v, torch.Tensor) and v.dim() == 4 else v
        for k, v in inputs.kwargs.items()
    }
    report = ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("triton"), stubbed_launches() as launches:
        for _ in range(3):
            launches.clear()
            calls_before = {op: sum(n.values()) for op, n in report.backends().items()}
            handed_before = report.handovers()
            getattr(model, inputs.method)(**kwargs)
    calls = {op: sum(n.values()) - calls_before.get(op, 0) for op, n in report.backends().items()}
    handed = {k: n - handed_before.get(k, 0) for k, n in report.handovers().items()}
    return {
        "launches": Counter(launches),
        "op_calls": {op: n for op, n in calls.items() if n},
        "handovers": {k: n for k, n in handed.items() if n},
    }


def summary(name: str, counts: dict) -> str:
    launches = counts["launches"]
    passes = ", ".join(f"{norm} {launches[kernel]}" for norm, kernel in STATISTICS_PASSES.items())
    lines = [
        f"{name}: {sum(launches.values())} Triton launches, {sum(counts['op_calls'].values())} fused op calls a step; "
        f"statistics passes: {passes}",
        "  launches: " + ", ".join(f"{k} {n}" for k, n in launches.most_common()),
        "  handed over: " + (", ".join(f"{k} {n}" for k, n in counts["handovers"].items()) or "none"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a zoo name (ldmopt.configs.names())")
    parser.add_argument("--resolution", type=int, default=None, help="pixels (default: the zoo's for --tiny, else 64)")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny config instead of the real one")
    args = parser.parse_args(argv)
    resolution = args.resolution or (None if args.tiny else 64)
    counts = count_step(args.model, resolution, args.frames, DTYPES[args.dtype], args.tiny)
    print(summary(f"{args.model} {args.dtype}" + (" tiny" if args.tiny else f" {resolution}px"), counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
