"""GroupNorm statistics for ldmopt.ops.gn_conv2d: the custom op ``ldmopt::gn_conv2d_stats`` (per-(n, group) mean and
rstd of an input, or of a two-part input ``cat([x, x_tail], 1)`` without the concatenation), and what both ops share:
the two-part input checks and the record of automatic fall-backs to the reference backend.

Backends: cuda (ldmopt._C's GroupNorm statistics passes, when the extension is built: one C++ op call for the two
launches; a one-part contiguous or channels-last x, or two channels-last parts read in place), triton
(kernels/group_norm.py's Welford passes) and torch, the reference (fp32 statistics; fp64 for fp64).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import spatial_dims_flatten
from ._dispatch import Backend, BackendTable, cuda_extension_refusals, register_eager, triton_refusals
from .group_norm import cuda_shape_refusals

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cat(head: Tensor | None, tail: Tensor | None) -> Tensor | None:
    """The channel concatenation a two-part input stands for (the reference path and backward materialise it),
    channels-last where both parts are: torch.cat keeps that layout only when every part suggests it, and a part of
    one channel suggests the contiguous one (the fused kernels backward runs read channels-last input only)."""
    if tail is None:
        return head
    joint = torch.cat([head, tail], dim=1)
    cl = torch.channels_last
    if joint.dim() == 4 and head.is_contiguous(memory_format=cl) and tail.is_contiguous(memory_format=cl):
        return joint.contiguous(memory_format=cl)  # a no-op unless a one-channel part made cat choose otherwise
    return joint


def same_but_channels(head: Tensor, tail: Tensor) -> bool:
    """Whether two tensors' shapes can be concatenated along channels (dim 1): same rank, batch and spatial size."""
    return head.dim() == tail.dim() and head.shape[0] == tail.shape[0] and head.shape[2:] == tail.shape[2:]


def _check_tail(name: str, head: Tensor | None, tail: Tensor | None) -> None:
    """The ops' own check (they are callable through torch.ops): a tail must match its head but in channels, or the
    kernels would index past it."""
    if tail is None:
        return
    if head is None or not same_but_channels(head, tail):
        shape = None if head is None else tuple(head.shape)
        raise ValueError(
            f"{name} of shape {tuple(tail.shape)} must match the first part {shape} in every dim but channels (1)"
        )
    if tail.dtype != head.dtype or tail.device != head.device:
        raise ValueError(f"{name} ({tail.dtype}, {tail.device}) must have the first part's dtype and device")


def _stats_torch(x, num_groups, eps, x_tail=None):
    x = _cat(x, x_tail)
    var, mean = torch.var_mean(x.to(_stats_dtype(x)).reshape(x.shape[0], num_groups, -1), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _stats_triton(x, num_groups, eps, x_tail=None):
    # kernels/group_norm.py's Welford partial + finalize passes (two launches; three for a two-part x)
    from ldmopt.kernels.group_norm import group_norm_stats

    return group_norm_stats(x, num_groups, eps, x_tail)


def _stats_triton_refuse(x: Tensor, x_tail: Tensor | None = None) -> list[str]:
    reasons = triton_refusals(x, x_tail, dtypes=_TRITON_DTYPES)
    for name, t in (("x", x), ("x_tail", x_tail)):
        if t is not None and not spatial_dims_flatten(t):
            reasons.append(f"{name} strides {t.stride()}: its spatial dims do not flatten into one strided axis")
    return reasons


def _stats_cuda(x, num_groups, eps, x_tail=None):
    if x_tail is None:
        return torch.ops.ldmopt.group_norm_stats_cuda(x, num_groups, eps)
    return torch.ops.ldmopt.group_norm_stats_cuda(x, num_groups, eps, x_tail)


def cuda_one_part_refusals(symbol: str, x: Tensor, x_tail: Tensor | None, *others: Tensor | None) -> list[str]:
    """What the cuda backends of the GroupNorm parts (statistics, normalisation) refuse first: the extension or its
    op ``symbol`` missing, tensors off CUDA, a two-part input (the kernels read one tensor), a dtype they do not
    serve. Empty when only the op's own layout checks are left."""
    reasons = cuda_extension_refusals(symbol, x, x_tail, *others)
    if reasons:
        return reasons
    if any(t is not None and t.device != x.device for t in (x_tail, *others)):
        reasons.append("tensors on more than one device")
    if x_tail is not None:
        reasons.append("a two-part input (x_tail): the CUDA kernels read one tensor")
    if x.dtype not in _TRITON_DTYPES:
        reasons.append(f"x dtype {x.dtype} (the CUDA kernels serve fp32/fp16/bf16)")
    return reasons


def _dense_channels_last(t: Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and t.numel() > 0


def cuda_two_part_refusals(symbol: str, x: Tensor, x_tail: Tensor, *others: Tensor | None) -> list[str]:
    """What the C++ ops ``symbol`` check of two parts (beyond what the op itself checked: their shapes agree but in
    channels): one device, one dtype they serve, both parts dense channels-last 4-D tensors."""
    reasons = cuda_extension_refusals(symbol, x, x_tail, *others)
    if reasons:
        return reasons
    if any(t is not None and t.device != x.device for t in (x_tail, *others)):
        reasons.append("tensors on more than one device")
    if x.dtype not in _TRITON_DTYPES or x_tail.dtype != x.dtype:
        reasons.append(f"parts of dtypes {x.dtype} and {x_tail.dtype} (the CUDA kernel serves one of fp32/fp16/bf16)")
    for name, t in (("x", x), ("x_tail", x_tail)):
        if not _dense_channels_last(t):
            reasons.append(f"{name} of shape {tuple(t.shape)}, strides {t.stride()} is not a dense channels-last 4-D "
                           "tensor")  # fmt: skip
    return reasons


def _stats_cuda_refuse(x: Tensor, x_tail: Tensor | None = None) -> list[str]:
    if x_tail is not None:  # an up block's (hidden, skip): the parts read in place, channels-last
        return cuda_two_part_refusals("group_norm_stats_cuda", x, x_tail)
    return cuda_one_part_refusals("group_norm_stats_cuda", x, x_tail) or cuda_shape_refusals(x)


STATS = BackendTable(
    "gn_conv2d_stats",
    [
        Backend("cuda", _stats_cuda, lambda x, groups, eps, x_tail=None: _stats_cuda_refuse(x, x_tail)),
        Backend("triton", _stats_triton, lambda x, groups, eps, x_tail=None: _stats_triton_refuse(x, x_tail)),
        Backend("torch", _stats_torch),
    ],
)


@torch.library.custom_op("ldmopt::gn_conv2d_stats", mutates_args=())
def gn_conv2d_stats(x: Tensor, num_groups: int, eps: float, x_tail: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(mean, rstd) [N, G] of x (or of ``cat([x, x_tail], 1)``) in fp32 (fp64 for fp64 x); not differentiable
    (gn_conv2d's backward accounts for it)."""
    _check_tail("x_tail", x, x_tail)
    mean, rstd = STATS(x, num_groups, eps, x_tail)
    return mean, rstd


register_eager(gn_conv2d_stats)


@gn_conv2d_stats.register_fake
def _(x, num_groups, eps, x_tail=None):
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
    return stats, torch.empty_like(stats)
