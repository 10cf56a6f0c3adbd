"""``ldmopt::group_norm_apply``: ``act(group_norm(x))`` from statistics already known, channels-last in x's dtype.

What the fused convolution's staged placement writes before a plain conv (gn_conv2d_prologue.py), and what its backward
recomputes as the conv's input for PyTorch's convolution backward. Internal: it has no autograd (callers use it
without gradients: a staged forward inside the fused conv op, whose own autograd covers it, and a backward), so it is
not exported from ``ldmopt.ops``.

Backends: cuda (ldmopt._C's GroupNorm elementwise pass, when the extension is built: one C++ op call, whose host
time is a fraction of a Triton launch's; a channels-last x, or two channels-last parts), triton (kernels/group_norm.py's
apply kernel: one elementwise pass per part, fp32 math) and torch, the reference (the unfused composition in fp32;
fp64 for fp64), all rounding the result to x's dtype as an unfused model stores its activation. A two-part input
``x_tail`` stands for ``cat([x, x_tail], 1)`` (a UNet up block's hidden state and skip): the cuda backend reads each
output channel from the part it lies in, the triton backend writes each part's channels of one output, the
reference concatenates first. "Host time a fraction": on the H200's host (2026-12-04, benchmarks/RESULTS.md) a
GroupNorm+SiLU call through ldmopt._C took 64 us, the single-launch Triton ops 113-142 us.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import (
    Backend,
    BackendTable,
    backend_counts,
    register_eager,
    triton_refusals,
)
from .gn_conv2d_stats import (
    _TRITON_DTYPES,
    _cat,
    _check_tail,
    _stats_dtype,
    cuda_one_part_refusals,
    cuda_two_part_refusals,
)


def normalize_reference(x: Tensor, mean: Tensor, rstd: Tensor, gw: Tensor | None, gb: Tensor | None, groups: int,
                        act: str | None) -> Tensor:  # fmt: skip
    """act((x - mean) * rstd * gw + gb) in the statistics dtype (fp32; fp64 for fp64), per (n, group) statistics."""
    n, c = x.shape[:2]
    cd = _stats_dtype(x)
    shape = (n, groups, c // groups, *x.shape[2:])
    z = (x.to(cd).reshape(shape) - mean.to(cd).reshape(n, groups, 1, 1, 1)) * rstd.to(cd).reshape(n, groups, 1, 1, 1)
    z = z.reshape(x.shape)
    if gw is not None:
        z = z * gw.to(cd)[:, None, None]
    if gb is not None:
        z = z + gb.to(cd)[:, None, None]
    return F.silu(z) if act == "silu" else z


def _apply_torch(x, mean, rstd, gw, gb, groups, act, x_tail=None):
    x = _cat(x, x_tail)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    return y.copy_(normalize_reference(x, mean, rstd, gw, gb, groups, act or None))


def apply_triton(x, mean, rstd, gw, gb, groups, act, x_tail=None):
    """The triton backend, also what the fused conv's staged placement runs (inside its own triton backend): one
    launch of kernels/group_norm.py's apply kernel per part, each writing its channels of one channels-last buffer."""
    from ldmopt.kernels._common import new_output
    from ldmopt.kernels.group_norm import group_norm_apply as launch_apply

    n, c_head, h, w = x.shape
    c_in = c_head + (0 if x_tail is None else x_tail.shape[1])
    out = new_output((n, c_in, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    launch_apply(out[:, :c_head], x, mean, rstd, gw, gb, groups, act or None, 0, c_in)
    if x_tail is not None:
        launch_apply(out[:, c_head:], x_tail, mean, rstd, gw, gb, groups, act or None, c_head, c_in)
    return out


def _apply_triton_refuse(x, mean, rstd, gw, gb, groups, act, x_tail=None) -> list[str]:
    reasons = triton_refusals(x, x_tail, gw, gb, dtypes=_TRITON_DTYPES)
    for name, t in (("x", x), ("x_tail", x_tail)):
        if t is not None and not t.is_contiguous(memory_format=torch.channels_last):
            reasons.append(f"{name} (strides {t.stride()}) is not channels-last")
    if mean.dtype != torch.float32 or rstd.dtype != torch.float32:
        reasons.append(f"statistics dtype {mean.dtype} (the kernel reads fp32 mean/rstd)")
    return reasons


def _apply_cuda(x, mean, rstd, gw, gb, groups, act, x_tail=None):
    if x_tail is None:
        return torch.ops.ldmopt.group_norm_apply_cuda(x, mean, rstd, gw, gb, groups, act or "")
    return torch.ops.ldmopt.group_norm_apply_cuda(x, mean, rstd, gw, gb, groups, act or "", x_tail)


def _apply_cuda_refuse(x, mean, rstd, gw, gb, groups, act, x_tail=None) -> list[str]:
    if x_tail is not None:
        reasons = cuda_two_part_refusals("group_norm_apply_cuda", x, x_tail, mean, rstd, gw, gb)
        if mean.dtype != torch.float32 or rstd.dtype != torch.float32:
            reasons.append(f"statistics dtype {mean.dtype} (the kernel reads fp32 mean/rstd)")
        return reasons
    reasons = cuda_one_part_refusals("group_norm_apply_cuda", x, x_tail, mean, rstd, gw, gb)
    if reasons:
        return reasons
    # The kernel writes y in x's layout: only an x that is channels-last and nothing else gives the op's layout.
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous() or not x.numel():
        reasons.append(f"x of shape {tuple(x.shape)}, strides {x.stride()} is not a dense channels-last 4-D tensor")
    if mean.dtype != torch.float32 or rstd.dtype != torch.float32:
        reasons.append(f"statistics dtype {mean.dtype} (the kernel reads fp32 mean/rstd)")
    return reasons


APPLY = BackendTable(
    "group_norm_apply",
    [
        Backend("cuda", _apply_cuda, _apply_cuda_refuse),
        Backend("triton", apply_triton, _apply_triton_refuse),
        Backend("torch", _apply_torch),
    ],
)


def staged_apply(x, mean, rstd, gw, gb, groups, act, x_tail=None):
    """What the fused convolution's staged placement runs inside its own triton backend: the cuda backend when it is
    built and takes the input, else the triton one (counted in backend_counts either way). A backend forced for
    group_norm_apply itself is honoured as the op would (cuda or torch: that one, or BackendUnavailableError)."""
    forced = APPLY.forced()
    if forced in ("cuda", "torch"):
        return APPLY(x, mean, rstd, gw, gb, groups, act, x_tail)
    cuda = forced is None and not _apply_cuda_refuse(x, mean, rstd, gw, gb, groups, act, x_tail)
    backend_counts[("group_norm_apply", "cuda" if cuda else "triton")] += 1
    return (_apply_cuda if cuda else apply_triton)(x, mean, rstd, gw, gb, groups, act, x_tail)


@torch.library.custom_op("ldmopt::group_norm_apply", mutates_args=())
def group_norm_apply(
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    gn_weight: Tensor | None,
    gn_bias: Tensor | None,
    num_groups: int,
    activation: str,
    x_tail: Tensor | None = None,
) -> Tensor:
    """act(group_norm(cat([x, x_tail], 1))) with per-(n, group) ``mean``/``rstd`` [N, G]; ``activation`` "" or "silu".
    4-D x; the result is channels-last in x's dtype."""
    _check_tail("x_tail", x, x_tail)
    c = x.shape[1] + (0 if x_tail is None else x_tail.shape[1])
    stats_ok = tuple(mean.shape) == tuple(rstd.shape) == (x.shape[0], num_groups)
    if x.dim() != 4 or num_groups <= 0 or c % num_groups or not stats_ok:
        raise ValueError(
            f"group_norm_apply: x {tuple(x.shape)} ({c} channels in all), num_groups={num_groups}, mean "
            f"{tuple(mean.shape)}, rstd {tuple(rstd.shape)}: expected a 4-D x whose channels the groups divide and "
            "[N, num_groups] statistics"
        )
    return APPLY(x, mean, rstd, gn_weight, gn_bias, num_groups, activation, x_tail)


register_eager(group_norm_apply)


@group_norm_apply.register_fake
def _(x, mean, rstd, gn_weight, gn_bias, num_groups, activation, x_tail=None):
    c = x.shape[1] + (0 if x_tail is None else x_tail.shape[1])
    return torch.empty((x.shape[0], c, *x.shape[2:]), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
