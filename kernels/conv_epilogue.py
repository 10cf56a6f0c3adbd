"""The fused convolution's epilogue as a pass of its own, after a convolution PyTorch ran (cuDNN on GPUs).

``y = (residual + gate[n, oh] * (z + temb[n, oh] + shortcut)) / output_scale`` over a channels-last conv output z
(its bias already added), written in place into z, and, from the values as stored, what the fused conv's epilogue
sums: the per-(n, group) statistics of y for the next GroupNorm, the per-(n, channel) fp64 sums a later two-part
GroupNorm finalises, or the LayerNorm statistics of y's pixels. Nothing to add and a scale of 1 (a producer asked
only for statistics) makes it a read-only pass. The statistics code is the fused conv's own
(kernels/gn_conv2d.channel_statistics, kernels/_gemm.row_statistics), so both paths round and sum alike.

Why a separate pass at all: the measured Triton implicit-GEMM convolution is slower than cuDNN at Stable Diffusion
shapes (benchmarks/RESULTS.md, 2026-12-04), so the "cudnn" placement (ldmopt/ops/gn_conv2d_prologue.py) keeps
cuDNN's conv and fuses what surrounds it: one elementwise pass replaces the stock block's separate temb add, residual
add, division and statistics passes.
One program per (image, BM pixels, BN channels), as the fused conv's grid, so the per-image arrival counters and the
row-statistics counters are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldmopt._env import interpreter_enabled

from ._common import LAUNCH_OPTIONS, cdiv, next_power_of_2
from ._gemm import row_statistics
from .gn_conv2d import (
    RESAMPLE,
    _idx,
    channel_statistics,
    channel_sums_output,
    epilogue_adds,
    int64_index,
    nhwc_strides,
    output_statistics_buffers,
    temb_gate_strides,
)

#: elements per tile: 32 fp32 values per thread at 4 warps
_TILE = 4096


@triton.jit
def _conv_epilogue_kernel(
    y_ptr,  # [N, OH, OW, C] (strides); z itself when written in place
    z_ptr,  # the conv output [N, OH, OW, C] (strides), bias included
    sc_ptr,  # the shortcut conv's output [N, OH, OW, C] (strides)
    ws_ptr,  # [N, C, 2] fp64 (OUT_ROW_STATS: [N * OH * OW, 2]), zeroed by the launcher
    counter_ptr,  # [N] int32 (OUT_ROW_STATS: one per row tile)
    out_mean_ptr,  # [N, G_out] fp32 (OUT_ROW_STATS: [2, N * OH * OW])
    out_rstd_ptr,
    temb_ptr,  # [N, C] or [N, C, OH] (strides; sth = 0 for the former)
    gate_ptr,  # [N, OH] fp32 (strides; sgh = 0 for one gate per image)
    res_ptr,  # [N, RH, RW, C] (strides)
    syn, syh, syw, syc,
    szn, szh, szw, szc,
    sscn, ssch, sscw, sscc,
    stn, stc, sth,
    sgn, sgh,
    srn, srh, srw, src,
    OH, OW, C, HR, WR, G_out, out_eps, inv_scale,
    HAS_TEMB: tl.constexpr, TEMB_ROWS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SC: tl.constexpr,
    HAS_RES: tl.constexpr, RES_RESAMPLE: tl.constexpr, WRITE: tl.constexpr,
    OUT_STATS: tl.constexpr, STATS_BLOCK_G: tl.constexpr, STATS_BLOCK_CPG: tl.constexpr, OUT_ROW_STATS: tl.constexpr,
    IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    S = OH * OW
    n_mt = tl.cdiv(S, BM)
    n_nt = tl.cdiv(C, BN)
    pid = tl.program_id(0)
    nt = pid % n_nt
    mt = (pid // n_nt) % n_mt
    n = pid // (n_nt * n_mt)
    offs_m = mt * BM + tl.arange(0, BM)
    m_mask = offs_m < S
    oh = offs_m // OW
    ow = offs_m % OW
    offs_n = nt * BN + tl.arange(0, BN)
    n_mask = offs_n < C
    mask = m_mask[:, None] & n_mask[None, :]
    rows = _idx(oh, IDX64)[:, None]
    cols = _idx(offs_n, IDX64)[None, :]
    pixel = rows * szh + _idx(ow, IDX64)[:, None] * szw
    acc = tl.load(z_ptr + n.to(tl.int64) * szn + pixel + cols * szc, mask=mask, other=0.0).to(tl.float32)
    if HAS_SC:  # added before the gate, as the fused conv accumulates its shortcut into the conv's tile
        sc_off = n.to(tl.int64) * sscn + rows * ssch + _idx(ow, IDX64)[:, None] * sscw + cols * sscc
        acc += tl.load(sc_ptr + sc_off, mask=mask, other=0.0).to(tl.float32)
    acc = epilogue_adds(acc, n, oh, ow, offs_n, m_mask, n_mask, mask, temb_ptr, stn, stc, sth, gate_ptr, sgn, sgh,
                        res_ptr, srn, srh, srw, src, HR, WR, inv_scale, HAS_TEMB, TEMB_ROWS, HAS_GATE, HAS_RES,
                        RES_RESAMPLE, IDX64, BN)  # fmt: skip
    out = acc.to(y_ptr.dtype.element_ty)
    if WRITE:
        y_pixel = rows * syh + _idx(ow, IDX64)[:, None] * syw
        tl.store(y_ptr + n.to(tl.int64) * syn + y_pixel + cols * syc, out, mask=mask)
    if OUT_STATS:
        channel_statistics(out, mask, tl.minimum(S - mt * BM, BM), offs_n, n_mask, n, n_mt * n_nt, ws_ptr,
                           counter_ptr, out_mean_ptr, out_rstd_ptr, C, G_out, S, out_eps, STATS_BLOCK_G,
                           STATS_BLOCK_CPG)  # fmt: skip
    if OUT_ROW_STATS:
        rows_total = (tl.num_programs(0) // (n_mt * n_nt)).to(tl.int64) * S
        row_statistics(out, mask, n.to(tl.int64) * S + offs_m, m_mask, n * n_mt + mt, nt, ws_ptr, counter_ptr,
                       out_mean_ptr, rows_total, C, out_eps, BN)  # fmt: skip


def _tile(c: int) -> tuple[int, int, int]:
    """(BM, BN, num_warps): every channel in one tile up to 128 (a row's statistics need few column tiles), the
    pixels filling the rest of _TILE; one large tile in the interpreter, whose cost is per program."""
    bn = min(next_power_of_2(c), 128)
    bm = max(16, _TILE // bn)
    return (bm, bn, 4) if not interpreter_enabled() else (min(bm, 256), bn, 4)


def conv_epilogue(
    z: torch.Tensor,
    temb: torch.Tensor | None,
    gate: torch.Tensor | None,
    shortcut: torch.Tensor | None,
    residual: torch.Tensor | None,
    residual_resample: str,
    output_scale: float,
    out_groups: int,
    out_eps: float,
    out_layer_norm: bool = False,
    out_channel_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, out_mean, out_rstd, channel_sums) as kernels/gn_conv2d.gn_conv2d_fwd returns them, from the conv output z
    [N, C, OH, OW] (channels-last, bias added; y is z, overwritten, when there is anything to add or scale).
    temb: [N, C] or [N, C, OH]; gate: [N, 1] or [N, OH] fp32; shortcut: the shortcut conv's output, like z;
    residual: [N, C, RH, RW] read through ``residual_resample``."""
    n, c, oh, ow = z.shape
    s = oh * ow
    bm, bn, warps = _tile(c)
    out_mean, out_rstd, ws, counters, block_g, block_cpg = output_statistics_buffers(
        z.device, n, c, s, out_groups, out_layer_norm, out_channel_sums, bm
    )
    write = any(t is not None for t in (temb, gate, shortcut, residual)) or output_scale != 1.0
    if not (write or out_groups or out_layer_norm or out_channel_sums):  # nothing to add, scale or sum: z is y
        return z, out_mean, out_rstd, channel_sums_output(ws, n, c, False)
    res_h, res_w = residual.shape[2:] if residual is not None else (1, 1)
    grid = (n * cdiv(s, bm) * cdiv(c, bn),)
    _conv_epilogue_kernel[grid](
        z, z, shortcut if shortcut is not None else z, ws, counters, out_mean, out_rstd,
        temb if temb is not None else z, gate if gate is not None else z, residual if residual is not None else z,
        *nhwc_strides(z), *nhwc_strides(z), *nhwc_strides(shortcut), *temb_gate_strides(temb, gate),
        *nhwc_strides(residual),
        oh, ow, c, res_h, res_w, out_groups if out_channel_sums else max(out_groups, 1), float(out_eps),
        1.0 / float(output_scale),
        HAS_TEMB=temb is not None, TEMB_ROWS=temb is not None and temb.dim() == 3, HAS_GATE=gate is not None,
        HAS_SC=shortcut is not None,
        HAS_RES=residual is not None, RES_RESAMPLE=RESAMPLE[residual_resample], WRITE=write,
        OUT_STATS=out_groups > 0 or out_channel_sums, STATS_BLOCK_G=block_g, STATS_BLOCK_CPG=block_cpg,
        OUT_ROW_STATS=out_layer_norm, IDX64=int64_index((z, shortcut, residual), (temb, gate)), BM=bm, BN=bn,
        num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return z, out_mean, out_rstd, channel_sums_output(ws, n, c, out_channel_sums)


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate: the resnet conv1 epilogue (temb, group statistics), conv2's
    (residual, channel sums), a temporal conv's (per-row temb, gate, residual), a projection's row statistics."""
    from ._gn_conv2d_specs import conv_epilogue_aot_specs

    return conv_epilogue_aot_specs()
