"""GroupNorm statistics finalised from per-channel sums, for one tensor or the channel concatenation of two.

A UNet up block's first GroupNorm reads ``cat([hidden, skip], 1)``; hidden was written just before by a fused conv or
GEMM, skip long before, by the down block. When both producers summed their outputs per (image, channel) in their
epilogues (kernels/gn_conv2d.py's statistics workspace: fp64 sum and sum of squares), the per-(n, group) mean and
rstd of the concatenation follow from those sums alone: one small launch instead of a statistics pass over both
tensors. Groups may straddle the two parts (SD1.5: 1280 + 640 channels in 32 groups of 60). A video's GroupNorm
(AnimateDiff's motion modules: groups over (C/G, F, H, W)) adds the sums of its F consecutive frames.
Layout: sums [N, C_head, 2] and [N, C_tail, 2] fp64, contiguous; mean and rstd [N, G] fp32. The group sums are added
in fp64, and the variance is E[x^2] - mean^2 in fp64, as the conv's own finalisation forms it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, cdiv, new_output, next_power_of_2, variance_floor
from ._gemm import divisibility_attrs

#: Channel sums a program adds at most (BLOCK_G x BLOCK_CPG); cpg up to 1024 fits one row of it.
_TILE = 1024


@triton.jit
def _group_norm_stats_from_sums_kernel(
    mean_ptr,  # [N, G] fp32
    rstd_ptr,
    head_ptr,  # [N, C_head, 2] fp64: per channel, the sum and the sum of squares of S values
    tail_ptr,  # TWO_PART: [N, C - C_head, 2] fp64
    C_head,
    C,
    G,
    S,
    FRAMES,
    eps,
    TWO_PART: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_CPG: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # the sample: images n * FRAMES ... n * FRAMES + FRAMES - 1
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cpg = C // G
    j = tl.arange(0, BLOCK_CPG)
    c = g[:, None] * cpg + j[None, :]
    mask = (g < G)[:, None] & (j < cpg)[None, :]
    in_head = mask & (c < C_head)
    in_tail = mask & (c >= C_head)
    # Each channel's (sum, sum of squares) pair is loaded as one 16-byte vector: a trailing axis of 2, split after.
    pair = tl.arange(0, 2)[None, None, :]
    sums = tl.zeros([BLOCK_G, BLOCK_CPG, 2], dtype=tl.float64)
    for f in range(0, FRAMES):
        image = n * FRAMES + f
        head_off = ((image * C_head + c) * 2)[:, :, None] + pair
        sums += tl.load(head_ptr + head_off, mask=in_head[:, :, None], other=0.0)
        if TWO_PART:
            tail_off = ((image * (C - C_head) + (c - C_head)) * 2)[:, :, None] + pair
            sums += tl.load(tail_ptr + tail_off, mask=in_tail[:, :, None], other=0.0)
    s1, s2 = tl.split(sums)
    count = tl.cast(S, tl.float64) * FRAMES * cpg  # in int32 it overflows past 2^31 elements per group
    mean = tl.sum(s1, axis=1) / count
    var = variance_floor(tl.sum(s2, axis=1) / count - mean * mean)
    rstd = 1.0 / tl.sqrt(var.to(tl.float32) + eps)
    out = n * G + g
    tl.store(mean_ptr + out, mean.to(tl.float32), mask=g < G)
    tl.store(rstd_ptr + out, rstd, mask=g < G)


def _tiles(cpg: int, groups: int) -> tuple[int, int]:
    block_cpg = next_power_of_2(cpg)
    return max(1, min(next_power_of_2(groups), _TILE // block_cpg)), block_cpg


def group_norm_stats_from_sums(
    sums: torch.Tensor,
    num_groups: int,
    eps: float,
    count: int,
    sums_tail: torch.Tensor | None = None,
    frames: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) [N / frames, G] fp32 of a tensor whose per-channel sums are ``sums`` [N, C, 2] fp64 over
    ``count`` values each (its spatial size), or of ``cat([that, other], 1)`` with ``sums_tail`` the other's; with
    ``frames``, each group spans that many consecutive images (a video's frames, normalised together). One launch."""
    n, c_head = sums.shape[:2]
    n //= frames
    c = c_head + (0 if sums_tail is None else sums_tail.shape[1])
    sums = sums.contiguous()
    tail = sums if sums_tail is None else sums_tail.contiguous()
    mean = new_output((n, num_groups), device=sums.device, dtype=torch.float32)
    rstd = new_output((n, num_groups), device=sums.device, dtype=torch.float32)
    block_g, block_cpg = _tiles(c // num_groups, num_groups)
    _group_norm_stats_from_sums_kernel[(n, cdiv(num_groups, block_g))](
        mean, rstd, sums, tail, c_head, c, num_groups, count, frames, eps,
        TWO_PART=sums_tail is not None, BLOCK_G=block_g, BLOCK_CPG=block_cpg, num_warps=4,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return mean, rstd


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate: SD1.5's up-block groups (cpg 40 to 80, two parts), a
    one-part tensor, and the widest group a program holds."""
    specs = []
    for cpg, groups, two_part in ((80, 32, True), (60, 32, True), (40, 32, False), (_TILE, 1, True)):
        block_g, block_cpg = _tiles(cpg, groups)
        signature = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "head_ptr": "*fp64", "tail_ptr": "*fp64",
                     "C_head": "i32", "C": "i32", "G": "i32", "S": "i32", "FRAMES": "i32", "eps": "fp32"}  # fmt: skip
        constexprs = {"TWO_PART": two_part, "BLOCK_G": block_g, "BLOCK_CPG": block_cpg}
        attrs = divisibility_attrs(_group_norm_stats_from_sums_kernel, signature, constexprs, skip=("FRAMES", "eps"))
        specs.append(
            dict(name=f"group_norm_stats_from_sums[cpg={cpg},G={groups},two_part={two_part}]",
                 fn=_group_norm_stats_from_sums_kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                 num_warps=4)
        )  # fmt: skip
    return specs
