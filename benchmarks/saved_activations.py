"""Activation memory of a training step, counted exactly and without a GPU: the bytes autograd keeps for backward.

A full-size model is built on the meta device (no weights in memory, no compute) and run forward with gradients,
stock and then patched with ``ldmopt.patch(model, training=True)``; a saved-tensors hook records every tensor saved
for backward, counted once per storage, parameters and buffers left out. At the end of the forward pass all of them
are alive at once: it is the activation part of a training step's peak memory (what bench_training.py measures on a
GPU as peak memory above the resident model and optimizer state), less the transient workspaces and the allocator's
caching that only a GPU run shows.

Attention is counted as FlashAttention keeps it (q, k, v, the output and the fp32 log-sum-exp per query), what
PyTorch's flash and cuDNN SDPA backends save on a GPU; on the meta device SDPA would take the math path, which saves
the full attention matrix. The weights are bf16 (pure bf16 training): under autocast over fp32 master weights each
op would also keep a bf16 copy of its weight, in both the stock and the patched model. On the meta device the patched
UNets' up blocks concatenate [hidden, skip] once for their fused resnets (on a GPU the fused conv reads the two parts
where they lie), so their patched figure is an upper bound.

    python benchmarks/saved_activations.py [MODEL ...] [--resolution R] [--batch B] [--frames F] [--by-site]

MODEL: zoo names (``ldmopt models``); by default SD1.5 at 512 px, batch 8. ``--by-site`` splits the bytes by the
diffusers or ldmopt function that saved them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

import ldmopt
from ldmopt import configs
from ldmopt.nn.child_check import observer


class _FlashSaves(torch.autograd.Function):
    """SDPA's output with what FlashAttention saves for backward (no backward: the count needs the forward only)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)  # q's strides: (B, H, T, D) over a (B, T, H * D) buffer, as flash returns it
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("saved_activations counts a forward pass only")


@contextlib.contextmanager
def flash_attention_saves() -> Iterator[None]:
    """F.scaled_dot_product_attention replaced, for the count, by an op saving what FlashAttention saves."""
    stock = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):  # PyTorch's parameter names: some callers pass them by keyword
        return _FlashSaves.apply(query, key, value)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = stock


def _site() -> str:
    """The innermost diffusers or ldmopt function on the stack (ldmopt's dispatch plumbing skipped)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/diffusers/" in path or ("/ldmopt/" in path and not path.endswith(("_dispatch.py", "_autocast.py"))):
            return f"{Path(path).name}:{frame.name}"
    return "other"


def saved_bytes(model: torch.nn.Module, inputs, by_site: bool = False) -> tuple[int, Counter]:
    """(bytes saved for backward by one forward pass of ``model`` on ``inputs`` (configs.ModelInputs), bytes per
    saving site when ``by_site``): each storage once, the model's parameters and buffers left out."""
    resident = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in resident and storage._cdata not in saved:
            saved[storage._cdata] = (storage.nbytes(), _site() if by_site else "")
        return t

    call = model if inputs.method == "forward" else getattr(model, inputs.method)
    # Marked as observers (they only watch): ldmopt's own saved-tensor hooks then still run inside them.
    hooks = observer(pack), observer(lambda t: t)
    with flash_attention_saves(), torch.autograd.graph.saved_tensors_hooks(*hooks):
        call(**inputs.kwargs)
    sites: Counter = Counter()
    for nbytes, site in saved.values():
        sites[site] += nbytes
    return sum(sites.values()), sites


def compare(name: str, resolution: int | None, batch: int, frames: int | None, by_site: bool = False,
            tiny: bool = False, device: str = "meta") -> dict:  # fmt: skip
    """Saved bytes of the stock and the patched model (bf16, channels-last, training mode)."""
    model = configs.build_model(name, device=device, dtype=torch.bfloat16, frames=frames, tiny=tiny)
    with contextlib.suppress(Exception):  # models without conv layers ignore the format
        model = model.to(memory_format=torch.channels_last)
    model.train()
    kwargs = {} if tiny else {"resolution": resolution, "frames": frames}
    inputs = configs.example_inputs(model, batch=batch, **kwargs)
    stock, stock_sites = saved_bytes(model, inputs, by_site)
    report = ldmopt.patch(model, training=True)
    patched, patched_sites = saved_bytes(model, inputs, by_site)
    ldmopt.unpatch(model)
    return {"stock": stock, "patched": patched, "patched_modules": report.total,
            "stock_sites": stock_sites, "patched_sites": patched_sites}  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["sd15"])
    parser.add_argument("--resolution", type=int, default=None, help="pixels (the model's default when omitted)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--by-site", action="store_true")
    args = parser.parse_args(argv)
    print("| model | batch | stock | patched | less |")
    print("|---|---|---|---|---|")
    for name in args.models:
        r = compare(name, args.resolution, args.batch, args.frames, args.by_site)
        less = 100 * (1 - r["patched"] / r["stock"]) if r["stock"] else 0.0
        print(f"| {name} ({r['patched_modules']} modules patched) | {args.batch} | {_gib(r['stock'])} | "
              f"{_gib(r['patched'])} | {less:.0f}% |")  # fmt: skip
        for label in ("stock", "patched") if args.by_site else ():
            print(f"  {label}:")
            for site, nbytes in r[f"{label}_sites"].most_common(12):
                print(f"    {_gib(nbytes):>10}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
