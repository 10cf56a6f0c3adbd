"""Triton launches, statistics passes and fused op calls per denoiser step of a zoo model, counted on the CPU.

The model is built from its embedded config with random weights, patched, and run in the Triton interpreter with
every launch stubbed (it returns at once, so outputs are garbage but the counts are exact), under torch.no_grad as
pipelines run it: three steps, the first teaching the statistics hand-overs, the last one counted. No GPU; what the
launches cost in time is for a GPU run. Full-size models take several GB of host memory at fp16.
    python benchmarks/count_launches.py sd15 [--resolution 64] [--frames 4] [--dtype fp16] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
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


#: ldmopt._C's ops (csrc/ops.cpp) -> a stand-in returning outputs of the right shapes at once
def _stats(x, groups):
    return x.new_empty(x.shape[0], groups, dtype=torch.float32), x.new_empty(x.shape[0], groups, dtype=torch.float32)


_CPP_STANDINS = {
    "group_norm_fwd_cuda": lambda x, w, b, g, eps, act: (torch.empty_like(x), *_stats(x, g)),
    "group_norm_stats_cuda": lambda x, g, eps, tail=None: _stats(x, g),
    "group_norm_stats_from_sums_cuda": lambda sums, tail, g, eps, count, frames: _stats(sums[::frames], g),
    "group_norm_apply_cuda": lambda x, mean, rstd, w, b, g, act, tail=None: x.new_empty(
        (x.shape[0], x.shape[1] + (0 if tail is None else tail.shape[1]), *x.shape[2:])
    ).contiguous(memory_format=torch.channels_last),
    "adaln_modulate_cuda": lambda x, scale, shift, res, gate, eps, store_sum, save: (
        x.new_empty(x.shape), x.new_empty(x.shape if store_sum else (0,)),
        *[x.new_empty((x.shape[0],) if save else (0,), dtype=torch.float32)] * 2),
    "layer_norm_stats_cuda": lambda x, eps: x.new_empty(2, x.shape[0], dtype=torch.float32),
    "layer_norm_apply_cuda": lambda x, stats, w, b, pos, rows: x.new_empty(x.shape),
    "linear_epilogue_cuda": lambda *args: None,
    "conv_epilogue_cuda": lambda z, sc, res, temb, gate, inv, write, g, sums, eps: (
        *_stats(z, g), z.new_empty(z.shape[0], z.shape[1] if sums else 0, 2, dtype=torch.float64)),
    "temporal_attention_fwd_cuda": lambda q, k, v, scale: torch.empty_like(q),
    "temporal_attention_fwd_out_cuda": lambda q, k, v, scale, out: None,
}  # fmt: skip


def meta_copies(args) -> list:
    """``args`` with each tensor as a meta tensor of the same shape, strides, offset and dtype; tensors sharing
    storage share it here too (the C++ checks refuse overlapping outputs)."""
    bases: dict[int, torch.Tensor] = {}
    copies = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            copies.append(a)
            continue
        storage = a.untyped_storage()
        base = bases.setdefault(storage.data_ptr(), torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta"))
        copies.append(base.view(a.dtype).as_strided(a.shape, a.stride(), a.storage_offset()))
    return copies


def checked_by_cpp(op: str, standin: Callable) -> Callable:
    """``standin`` run after ldmopt._C's own op ``op`` has accepted the arguments: its Meta kernel runs the C++
    argument checks (dtypes, strides, layouts, sizes) on meta copies. A stand-in more permissive than the C++ op
    would hide a call Python routes to the cuda backend that a GPU refuses. Without the built extension, the
    stand-in alone."""
    from ldmopt import _env

    _env.cuda_extension_status()  # loads ldmopt._C where it is built
    real = getattr(getattr(torch.ops.ldmopt, op, None), "default", None)

    def run(*args):
        if real is not None:
            real(*meta_copies(args))
        return standin(*args)

    return run


@contextlib.contextmanager
def as_gpu_with_extension(checked: bool = False) -> Iterator[Counter]:
    """Placements as for CUDA tensors, ldmopt._C's backends accepting CPU tensors, their ops stubbed; yields the
    count of C++ op calls by op. ``checked``: each call is first checked by the C++ op's argument checks
    (:func:`checked_by_cpp`; host_step.py, which times the host, leaves them out)."""
    import importlib

    from ldmopt.ops import gn_conv2d_prologue, linear_cublas

    calls: Counter = Counter()
    cuda = torch.device("cuda")
    patches = []

    def patch(obj, attr, value):
        patches.append((obj, attr, getattr(obj, attr, None)))
        setattr(obj, attr, value)

    for name in ("adaln_modulate", "conv_epilogue", "gn_conv2d_stats", "group_norm", "group_norm_apply",
                 "group_norm_sums", "layer_norm_apply", "layer_norm_linear", "linear_epilogue",
                 "temporal_attention"):  # fmt: skip
        patch(importlib.import_module(f"ldmopt.ops.{name}"), "cuda_extension_refusals", lambda *args: [])
    for op, standin in _CPP_STANDINS.items():
        counted = checked_by_cpp(op, standin) if checked else standin
        patch(torch.ops.ldmopt, op, lambda *a, _op=op, _f=counted: calls.update([_op]) or _f(*a))
    gemm, conv = linear_cublas.gemm_placement, gn_conv2d_prologue.choose_placement
    patch(linear_cublas, "gemm_placement", lambda device, blend=False: gemm(cuda, blend))
    patch(importlib.import_module("ldmopt.ops.linear"), "gemm_placement", linear_cublas.gemm_placement)
    patch(importlib.import_module("ldmopt.ops.gn_conv2d"), "choose_placement",
          lambda device, *args, **kwargs: conv(cuda, *args, **kwargs))  # fmt: skip
    patch(linear_cublas, "TANH_GELU_DEVICES", ("cuda", "cpu"))  # cuBLASLt's GELU epilogue: no pass
    # an H100/H200's opt-in shared memory per block (the temporal attention's CUDA plan reads it per device)
    patch(importlib.import_module("ldmopt.ops.temporal_attention"), "smem_optin_limit", lambda index: 232448)
    try:
        yield calls
    finally:
        for obj, attr, value in reversed(patches):
            setattr(obj, attr, value)


def channels_last_step(name: str, resolution: int | None, frames: int | None, dtype: torch.dtype,
                       tiny: bool) -> tuple[torch.nn.Module, str, dict]:  # fmt: skip
    """(model, the method a step calls, its keyword arguments) of a zoo model on the CPU, its 4-D weights and inputs
    channels-last (5-D weights of video models stay as they are)."""
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
    return model, inputs.method, kwargs


def count_step(name: str, resolution: int, frames: int | None, dtype: torch.dtype, tiny: bool,
               as_gpu: bool = False) -> dict:  # fmt: skip
    """{"launches": Counter by kernel, "op_calls": {op: calls}, "handovers": {consumer: calls}, "cpp_calls": Counter
    by C++ op (``as_gpu``)} of one step."""
    model, method, kwargs = channels_last_step(name, resolution, frames, dtype, tiny)
    report = ldmopt.patch(model)
    gpu = as_gpu_with_extension(checked=True) if as_gpu else contextlib.nullcontext(Counter())
    backend = ldmopt.use_backend("auto" if as_gpu else "triton")
    with torch.no_grad(), backend, stubbed_launches() as launches, gpu as cpp_calls:
        for _ in range(3):
            launches.clear()
            cpp_calls.clear()
            calls_before = {op: sum(n.values()) for op, n in report.backends().items()}
            handed_before = report.handovers()
            getattr(model, method)(**kwargs)
    calls = {op: sum(n.values()) - calls_before.get(op, 0) for op, n in report.backends().items()}
    handed = {k: n - handed_before.get(k, 0) for k, n in report.handovers().items()}
    return {
        "launches": Counter(launches),
        "op_calls": {op: n for op, n in calls.items() if n},
        "handovers": {k: n for k, n in handed.items() if n},
        "cpp_calls": Counter(cpp_calls),
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
    cpp = counts.get("cpp_calls")
    if cpp:
        listed = ", ".join(f"{k} {n}" for k, n in cpp.most_common())
        lines.append(f"  ldmopt._C op calls: {sum(cpp.values())}: {listed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a zoo name (ldmopt.configs.names())")
    parser.add_argument("--resolution", type=int, default=None, help="pixels (default: the zoo's for --tiny, else 64)")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny config instead of the real one")
    parser.add_argument(
        "--as-gpu", action="store_true", help="what a GPU with ldmopt._C launches: its placements, C++ ops stood in for"
    )
    args = parser.parse_args(argv)
    resolution = args.resolution or (None if args.tiny else 64)
    counts = count_step(args.model, resolution, args.frames, DTYPES[args.dtype], args.tiny, args.as_gpu)
    label = f"{args.model} {args.dtype}" + (" tiny" if args.tiny else f" {resolution}px")
    print(summary(label + (" as-gpu" if args.as_gpu else ""), counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
