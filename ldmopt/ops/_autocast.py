"""torch.autocast for custom ops: cast the operands as the unfused aten op would, before the op sees them."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def autocast_operands(x: Tensor, *others: Tensor | None) -> tuple[Tensor | None, ...]:
    """The operands cast as F.linear / F.conv2d cast them under torch.autocast (floating, non-fp64 tensors to the
    autocast dtype); unchanged outside autocast. The casts are ordinary differentiable ops, so fp32 master weights
    get fp32 gradients as with the unfused module."""
    device = x.device.type
    if not autocast_enabled(device):
        return (x, *others)
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t

    return tuple(cast(t) for t in (x, *others))


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled for devices that have autocast (it raises for meta tensors: the cost model's).
    cuda and cpu skip torch.amp.is_autocast_available: dynamo in torch 2.11 (the GPU image's) cannot trace it (a graph
    break under fullgraph=True)."""
    if device_type in ("cuda", "cpu"):
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """torch.autocast(device_type, enabled=False) where autocast is on; nothing otherwise (no cost, no meta error)."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
