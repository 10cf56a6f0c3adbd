"""Aten ops one training step's backward dispatches, stock model versus ``ldmopt.patch(model, training=True)``.

On a GPU every small aten op in backward is a kernel launch plus host time. This counts them on the CPU: the patched
model runs its Triton backend in the interpreter with every launch stubbed (returns at once, values are garbage,
which is fine for counting), so what is counted is exactly what ldmopt's own Python issues around its kernels.
Ops inside ldmopt's custom ops (their output allocations, casts) are counted too, under the custom op's name.
    python benchmarks/count_backward_ops.py [--model sd15] [--backend triton] [--res 8] [--where _to_copy,zeros]
``--where`` lists, per op name given, the ldmopt source lines that issued it (patched run). The default model is the
zoo's tiny SD1.5 (the embedded sd15_unet.json with a few channels), fp32, channels-last, batch 1, 8x8 latents; the
counts depend on the block structure, not on the channel counts. The totals count every aten op that is not a view
or an allocation as one launch (a lower bound: PyTorch's convolution or GroupNorm backward launches several), plus
the Triton launches. CPU-only: with ``--dtype float16`` the fused conv's
backward runs PyTorch's convolution backward in fp32 on CPU tensors (``_conv_backward``), three casts per call that
a GPU does not make (``--where _to_copy`` shows them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / ldmopt's kernels are imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.profile_host import stubbed_launches

ROOT = str(Path(__file__).resolve().parent.parent)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name (overload dropped); ops inside ldmopt's custom ops are counted as well.

    ``where``: op names whose call sites (the innermost ldmopt/kernels frame) are recorded in ``sites``.
    """

    def __init__(self, where: set[str] = frozenset()):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if name in self.where:
            self.sites[name][_site()] += 1
        if namespace == "ldmopt":
            self.counts[f"{namespace}.{name}"] += 1
            # its implementation, as the eager fast path (ldmopt.ops._dispatch.call) runs it when no mode is active,
            # with its own ops (allocations, casts, launches' outputs) counted under this mode
            impl = custom_ops.OPDEFS[f"ldmopt::{name}"]._init_fn
            with self:
                return impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        # aten.to reaches the mode (inside a custom op's implementation) also where it returns its input: no copy
        self.counts[f"{namespace}.{name}" + (" (no copy)" if name == "to" and out is args[0] else "")] += 1
        return out


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(ROOT) and "/benchmarks/" not in frame.filename:
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno} {frame.line}"
    return "(torch / diffusers)"


#: Aten ops that launch no kernel: views, metadata and allocations (host time only).
_VIEWS_AND_ALLOCATIONS = [
    "empty", "empty_like", "new_empty", "empty_strided", "view", "_unsafe_view", "reshape", "select", "slice", "alias",
    "unsqueeze", "squeeze", "permute", "transpose", "t", "expand", "detach", "as_strided", "split", "split_with_sizes",
    "chunk", "unbind", "unflatten",
]  # fmt: skip
NO_LAUNCH = frozenset(f"aten.{name}" for name in [*_VIEWS_AND_ALLOCATIONS, "to (no copy)"])


def launching(counts: dict[str, int]) -> int:
    """Aten ops in ``counts`` that launch a kernel on a GPU (not views, metadata or allocations)."""
    return sum(v for k, v in counts.items() if k.startswith("aten.") and k not in NO_LAUNCH)


def _aten(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k.startswith("aten."))


def format_counts(stock: dict[str, int], patched: dict[str, int], triton_launches: int) -> str:
    """Per op: stock, patched and the difference, most added first; then totals and device launches."""
    lines = [f"{'op':40s} {'stock':>7s} {'patched':>8s} {'diff':>6s}"]
    for name in sorted(set(stock) | set(patched), key=lambda n: (-(patched.get(n, 0) - stock.get(n, 0)), n)):
        s, p = stock.get(name, 0), patched.get(name, 0)
        lines.append(f"{name:40s} {s:7d} {p:8d} {p - s:+6d}")
    rows = (
        ("aten ops", _aten(stock), _aten(patched)),
        ("aten ops that launch kernels (>= 1 each)", launching(stock), launching(patched)),
        ("+ Triton launches", 0, triton_launches),
        ("= kernel launches, at least", launching(stock), launching(patched) + triton_launches),
    )
    lines += [f"{label:40s} {s:7d} {p:8d} {p - s:+6d}" for label, s, p in rows]
    return "\n".join(lines)


def build(model_name: str, res: int, dtype: torch.dtype = torch.float32):
    from ldmopt import configs

    model = configs.build_model(model_name, tiny=True, device="cpu", dtype=dtype).train()
    model = model.to(memory_format=torch.channels_last)
    inputs = configs.example_inputs(model, resolution=res * configs.VAE_SCALE, batch=1)
    kwargs = {**inputs.kwargs, "return_dict": False}
    if kwargs["sample"].dim() == 4:
        kwargs["sample"] = kwargs["sample"].contiguous(memory_format=torch.channels_last)
    return model, kwargs


def count_backward(model, kwargs, where=frozenset()) -> OpCounter:
    """Forward outside the counter, then ``loss.backward()`` inside it."""
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)[0]
    loss = out.float().square().mean()
    counter = OpCounter(where)
    with counter:
        loss.backward()
    return counter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--backend", default="triton", choices=["triton", "torch"])
    parser.add_argument("--res", type=int, default=8, help="latent height and width")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"], help="model and inputs")
    parser.add_argument("--where", default="", help="comma-separated op names whose ldmopt call sites to list")
    args = parser.parse_args(argv)
    import ldmopt

    torch.manual_seed(0)
    stock, kwargs = build(args.model, args.res, getattr(torch, args.dtype))
    patched = copy.deepcopy(stock)
    report = ldmopt.patch(patched, training=True)
    where = {w for w in args.where.split(",") if w}
    stock_counts = count_backward(stock, kwargs).counts
    launches_ctx = stubbed_launches() if args.backend == "triton" else contextlib.nullcontext([])
    with ldmopt.use_backend(args.backend), launches_ctx as launches:
        count_backward(patched, kwargs)  # first call: autotuning and caches outside the count
        launches.clear()
        counter = count_backward(patched, kwargs, where)
    print(f"model {args.model} (tiny, {args.dtype}, channels-last, batch 1, {args.res}x{args.res} latents)")
    print(f"backends that ran: {report.backends()}")
    if report.fallbacks():
        print(f"fallbacks: {report.fallbacks()}")
    print(format_counts(stock_counts, counter.counts, len(launches)))
    for name, sites in counter.sites.items():
        print(f"\n== {name} call sites (patched backward)")
        for site, n in sites.most_common():
            print(f"{n:5d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
