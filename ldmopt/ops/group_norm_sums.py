"""GroupNorm statistics from per-channel sums: the custom op ``ldmopt::group_norm_stats_from_sums``.

A fused convolution asked for ``out_channel_sums`` (``gn_silu_conv2d``) returns its output's per-(image, channel) sum
and sum of squares in fp64, [N, C, 2], summed in its epilogue. From those, the per-(n, group) mean and rstd of the
output, or of its channel concatenation with another summed tensor (a UNet up block's ``cat([hidden, skip], 1)``,
whose groups may straddle the two), cost one small launch instead of a pass over the activations
(ldmopt.nn.stats_handover hands such sums from producers to the up blocks).

Backends: cuda (ldmopt._C's ``group_norm_stats_from_sums_cuda``, csrc/group_norm_sums: one C++ op call, a warp per
(video, group)), triton (kernels/group_norm_sums.py, one launch) and torch, the reference (fp64 sums, fp32 results).
Not
differentiable: the sums come from an epilogue as constants; a consumer's backward differentiates through the
statistics of its own input as if it had computed them (gn_conv2d's backward does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import Backend, BackendTable, cuda_extension_refusals, register_eager, triton_refusals


def _check(sums: Tensor, num_groups: int, count: int, sums_tail: Tensor | None, frames: int) -> None:
    """The op's own checks (it is callable through torch.ops): the kernel indexes by these shapes."""
    parts = (("sums", sums),) if sums_tail is None else (("sums", sums), ("sums_tail", sums_tail))
    for name, t in parts:
        if t.dim() != 3 or t.shape[2] != 2 or t.dtype != torch.float64:
            raise ValueError(
                f"{name} must be [N, C, 2] float64 (per channel: the sum and the sum of squares), got "
                f"{tuple(t.shape)} {t.dtype}"
            )
    if sums_tail is not None and (sums_tail.shape[0] != sums.shape[0] or sums_tail.device != sums.device):
        raise ValueError(
            f"sums_tail ({sums_tail.shape[0]} images on {sums_tail.device}) must match sums "
            f"({sums.shape[0]} images on {sums.device})"
        )
    channels = sums.shape[1] + (0 if sums_tail is None else sums_tail.shape[1])
    if num_groups <= 0 or channels % num_groups:
        raise ValueError(f"num_groups={num_groups} must be a positive divisor of the {channels} channels")
    if count <= 0:
        raise ValueError(f"count={count}: each channel's sums must be over at least one value")
    if frames <= 0 or sums.shape[0] % frames:
        raise ValueError(f"frames={frames} must be a positive divisor of the {sums.shape[0]} images of sums")


def _from_sums_torch(sums, num_groups, eps, count, sums_tail=None, frames=1):
    both = sums if sums_tail is None else torch.cat([sums, sums_tail], dim=1)
    group_sums = both.reshape(both.shape[0] // frames, frames, num_groups, -1, 2).sum((1, 3))
    elements = count * frames * (both.shape[1] // num_groups)
    mean = group_sums[..., 0] / elements
    var = (group_sums[..., 1] / elements - mean * mean).clamp_min(0.0)
    return mean.float(), torch.rsqrt(var.float() + eps)


def _from_sums_triton(sums, num_groups, eps, count, sums_tail=None, frames=1):
    from ldmopt.kernels.group_norm_sums import group_norm_stats_from_sums as launch

    return launch(sums, num_groups, eps, count, sums_tail, frames)


def _from_sums_cuda(sums, num_groups, eps, count, sums_tail=None, frames=1):
    return torch.ops.ldmopt.group_norm_stats_from_sums_cuda(sums, sums_tail, num_groups, eps, count, frames)


def cuda_refusals(sums, num_groups, eps, count, sums_tail=None, frames=1) -> list[str]:
    """What csrc/group_norm_sums refuses beyond the op's own checks: sums it does not read in place."""
    reasons = cuda_extension_refusals("group_norm_stats_from_sums_cuda", sums, sums_tail)
    if reasons:
        return reasons
    for name, t in (("sums", sums), ("sums_tail", sums_tail)):
        if t is not None and not t.is_contiguous():
            reasons.append(f"{name} strides {t.stride()}: the CUDA kernel reads contiguous [N, C, 2] sums")
    return reasons


FROM_SUMS = BackendTable(
    "group_norm_stats_from_sums",
    [
        Backend("cuda", _from_sums_cuda, cuda_refusals),
        Backend(
            "triton",
            _from_sums_triton,
            lambda sums, groups, eps, count, sums_tail=None, frames=1: triton_refusals(
                sums, sums_tail, dtypes=(torch.float64,)
            ),
        ),
        Backend("torch", _from_sums_torch),
    ],
)


@torch.library.custom_op("ldmopt::group_norm_stats_from_sums", mutates_args=())
def group_norm_stats_from_sums(
    sums: Tensor, num_groups: int, eps: float, count: int, sums_tail: Tensor | None = None, frames: int = 1
) -> tuple[Tensor, Tensor]:
    """(mean, rstd) [N, num_groups] fp32 of a tensor whose per-channel sum and sum of squares over ``count`` values
    (its spatial size) are ``sums`` [N, C, 2] fp64, or of its concatenation along channels with the tensor whose
    sums are ``sums_tail``. GroupNorm's biased variance, ``rstd = 1 / sqrt(var + eps)``. ``frames``: the N images
    are N / frames videos whose groups span their frames (a GroupNorm over (C/G, F, H, W)); the results are
    [N / frames, num_groups]."""
    _check(sums, num_groups, count, sums_tail, frames)
    mean, rstd = FROM_SUMS(sums, num_groups, eps, count, sums_tail, frames)
    return mean, rstd


register_eager(group_norm_stats_from_sums)


@group_norm_stats_from_sums.register_fake
def _(sums, num_groups, eps, count, sums_tail=None, frames=1):
    mean = sums.new_empty((sums.shape[0] // frames, num_groups), dtype=torch.float32)
    return mean, torch.empty_like(mean)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _backward(ctx, _dmean, _drstd):
    # Sums handed over from an epilogue are constants (they arrive detached); nothing flows back into them.
    return (None,) * len(ctx.needs_input_grad)


group_norm_stats_from_sums.register_autograd(_backward, setup_context=_setup_context)
