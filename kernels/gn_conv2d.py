"""Implicit-GEMM 2-D convolution whose loader applies GroupNorm + activation, with a fused epilogue.

Computes ``y = (residual + gate[n, oh] * (conv(act(gn(x)), W) + bias + temb[n, oh] + shortcut)) / output_scale``
(temb and gate per image or per output row) and, optionally, the per-(n, group) statistics of y for the next
GroupNorm. x is NHWC (channels-last; any strides are accepted, channel stride 1 is the fast path), fp32/fp16/bf16;
accumulation, GroupNorm math and statistics in fp32 (statistics sums in fp64). Kernels 1x1, 3x3 and 3x1 (a temporal
conv over a (video, channel, frame, pixel) view), stride 1 or 2, zero padding applied after the activation; nearest
2x upsampling or 2x2 average pooling of the conv input is index arithmetic in the loader; an optional 1x1 "shortcut"
conv of a second input accumulates into the same tile. Either input may come in two channel parts (a UNet up block's
``cat([hidden, skip], 1)``): each channel block lies in one part and is loaded from where that part lies, so the
concatenation is never written.
Algorithm: one program per (image, BM output pixels, BN output channels); ONE flat loop over kh*kw*channel-blocks
stages an [BM, BK] input tile (normalised with per-(n, c) scale/shift [BK] vectors) and a [BK, BN] weight tile into
tl.dot. Output statistics: per-column centred sums of the tile are added in fp64 to a per-(n, c) workspace; the last
program of each image (atomic counter) folds them into per-group mean/rstd. The workspace is a fresh zeroed buffer
per call, so nothing outlives a launch (CUDA graphs, concurrent streams); autotuning zeroes it again before each of its
benchmark launches and before the launch that follows them (reset_to_zero).
fp32 operands: TF32 or IEEE products as PyTorch's convolution (default) or, for a Linear read as a 1x1 conv, its
matmul would compute them (``fp32_precision``, _common.FP32_PRECISIONS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldmopt._env import interpreter_enabled

from ._common import (
    ACTIVATIONS,
    autotune,
    cdiv,
    config_tag,
    fp32_dot_precision,
    identity,
    new_output,
    next_power_of_2,
    prune_by_operand_width,
    tag_config,
    tag_fp32_configs,
)
from ._gemm import row_statistics, row_stats_workspace
from ._tuned_launch import tuned_launch

#: resample codes shared with ldmopt/ops/gn_conv2d.py
RESAMPLE = {"none": 0, "up": 1, "down": 2}
#: offset reach (an operand's largest index x stride sum; per image for the activations, whose batch offsets are
#: always int64) from which every offset is computed in int64: IDX64, see int64_index
INT64_INDEX_FROM = 2**31 - 1


#: Tiles for fp32 operands, each with the (dot precision, arch) pairs where it compiles without spills (ptxas): the
#: 16-bit tiles spill 8-168 bytes per thread with IEEE products (CUDA cores), and no tile is clean everywhere.
CONV_TILES_FP32 = (
    (64, 128, 32, 8, 3, {("ieee", 80), ("ieee", 90), ("tf32", 90)}),
    (128, 64, 32, 8, 3, {("ieee", 80), ("tf32", 80), ("tf32", 90)}),
    (64, 64, 32, 8, 3, {("ieee", 80), ("tf32", 80), ("tf32", 90)}),
)


#: 16-bit tiles (BM, BN, BK, warps, stages) for a conv with the GroupNorm prologue in its loader (NORMALIZE): the
#: normalised A tile passes through registers, so the k-step stays at 32 (64 only for the 64x64 tile) to keep them
#: within 255 with the heaviest epilogues.
CONV_TILES_LOADER = ((128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (64, 64, 64, 4, 3))
#: 16-bit tiles for a plain conv (statistics staged before it, upsamplers, downsamplers): A goes from shared memory
#: straight into the MMA, and BK=64 halves the loop's overhead per MMA. sm_90 SASS per warp and k-step, 128x128 with
#: temb + statistics: 180 instructions for 4 wgmma at BK=64 against 121 for 2 at BK=32 (8 warps on 4 schedulers: 360
#: issue cycles for 512 tensor-core cycles, against 242 for 256); sm_80: 277 for 64 mma.sync against 171 for 32.
CONV_TILES_PLAIN = ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3))


def _configs() -> list[triton.Config]:
    if interpreter_enabled():
        # The interpreter's cost is per program and per numpy op: one large tile.
        return [triton.Config({"BM": 64, "BN": 128, "BK": 64}, num_warps=4, num_stages=1)]
    tiles = []
    for tile in dict.fromkeys(CONV_TILES_LOADER + CONV_TILES_PLAIN):  # in order, each tile once
        bm, bn, bk, w, s = tile
        config = triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        families = (("loader", CONV_TILES_LOADER), ("plain", CONV_TILES_PLAIN))
        tiles.append(tag_config(config, prologues=frozenset(name for name, family in families if tile in family)))
    fp32 = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bm, bn, bk, w, s, _ in
            CONV_TILES_FP32]  # fmt: skip
    return tiles + tag_fp32_configs(fp32, [tile[5] for tile in CONV_TILES_FP32])


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The tiles for the operands' width (_common.prune_by_operand_width); of the 16-bit ones, those for a loader
    with (NORMALIZE) or without the GroupNorm prologue."""
    configs = prune_by_operand_width(configs, named_args["x_ptr"], kwargs.get("DOT_PRECISION", "tf32"))
    family = "loader" if kwargs.get("NORMALIZE", True) else "plain"
    return [c for c in configs if family in config_tag(c, "prologues", (family,))] or configs


@triton.jit
def _idx(i, IDX64: tl.constexpr):
    """An index about to be multiplied by a stride: int64 with IDX64, int32 (fewer registers) otherwise."""
    if IDX64:
        i = i.to(tl.int64)
    return i


@triton.jit
def _stage_input(
    base,
    ih,
    iw,
    row_ok,
    ci,
    c_mask,
    sxh,
    sxw,
    sxc,
    H,
    W,
    scale,
    shift,
    RESAMPLE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    IDX64: tl.constexpr,
):
    """[BM, BK] fp32 tile of the conv input at conv-input coordinates (ih, iw); zero outside (after activation).

    RESAMPLE 0: x itself (H x W). 1: nearest 2x upsample of x (2H x 2W). 2: 2x2 average pool of x (H//2 x W//2).
    """
    # IDX64: an operand's offsets reach 2^31 (a large image, or a view with a large stride): row and channel
    # offsets in int64
    ih = _idx(ih, IDX64)
    iw = _idx(iw, IDX64)
    coff = _idx(ci, IDX64)[None, :] * sxc
    if RESAMPLE == 2:
        valid = row_ok & (ih >= 0) & (ih < H // 2) & (iw >= 0) & (iw < W // 2)
        mask = valid[:, None] & c_mask[None, :]
        a = tl.zeros([ih.shape[0], ci.shape[0]], dtype=tl.float32)
        for dy in tl.static_range(2):
            for dx in tl.static_range(2):
                roff = (2 * ih + dy) * sxh + (2 * iw + dx) * sxw
                v = tl.load(base + roff[:, None] + coff, mask=mask, other=0.0).to(tl.float32)
                if NORMALIZE:
                    v = ACTIVATION(v * scale[None, :] + shift[None, :])
                a += v
        a = tl.where(mask, a * 0.25, 0.0)
    else:
        if RESAMPLE == 1:
            valid = row_ok & (ih >= 0) & (ih < 2 * H) & (iw >= 0) & (iw < 2 * W)
            sh = tl.where(valid, ih, 0) // 2
            sw = tl.where(valid, iw, 0) // 2
        else:
            valid = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            sh = ih
            sw = iw
        mask = valid[:, None] & c_mask[None, :]
        roff = sh * sxh + sw * sxw
        a = tl.load(base + roff[:, None] + coff, mask=mask, other=0.0).to(tl.float32)
        if NORMALIZE:
            a = tl.where(mask, ACTIVATION(a * scale[None, :] + shift[None, :]), 0.0)
    return a


@triton.jit
def _channel_part(cb, n_cb_head, C_head, C, kk, head, tail, s_head_h, s_head_w, s_head_c, s_tail_h, s_tail_w,
                  s_tail_c, TWO_PART: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Where channel block ``cb`` of the input lies: (base, strides h/w/c, channels within the part, channels of the
    input, mask). With TWO_PART, blocks ``< n_cb_head`` read the head (channels [0, C_head)), the rest the tail."""
    if not TWO_PART:
        ci = cb * BK + kk
        return head, s_head_h, s_head_w, s_head_c, ci, ci, ci < C
    in_tail = cb >= n_cb_head
    local = tl.where(in_tail, cb - n_cb_head, cb) * BK + kk
    c_lo = tl.where(in_tail, C_head, 0)
    count = tl.where(in_tail, C - C_head, C_head)
    base = tl.where(in_tail, tail, head)
    sh = tl.where(in_tail, s_tail_h, s_head_h)
    sw = tl.where(in_tail, s_tail_w, s_head_w)
    sc = tl.where(in_tail, s_tail_c, s_head_c)
    return base, sh, sw, sc, local, c_lo + local, local < count


@triton.jit
def _finalize_stats(ws_ptr, mean_ptr, rstd_ptr, n, C, G, S, eps, BLOCK_G: tl.constexpr, BLOCK_CPG: tl.constexpr):
    """Per-group mean/rstd of image n from the per-channel fp64 sums in ws [N, C, 2]."""
    cpg = C // G
    j = tl.arange(0, BLOCK_CPG)
    count = tl.cast(S, tl.float64) * cpg  # S * cpg in int32 overflows past 2^31 outputs per image
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & (j < cpg)[None, :]
        off = ((n * C + g[:, None] * cpg + j[None, :]) * 2).to(tl.int64)
        zero = tl.zeros([BLOCK_G, BLOCK_CPG], dtype=tl.float64)
        # Atomic reads: the other programs' relaxed adds live in L2.
        s1 = tl.atomic_add(ws_ptr + off, zero, mask=mask, sem="relaxed")
        s2 = tl.atomic_add(ws_ptr + off + 1, zero, mask=mask, sem="relaxed")
        mean = tl.sum(tl.where(mask, s1, 0.0), axis=1) / count
        var = tl.maximum(tl.sum(tl.where(mask, s2, 0.0), axis=1) / count - mean * mean, 0.0)
        rstd = 1.0 / tl.sqrt(var.to(tl.float32) + eps)
        tl.store(mean_ptr + n * G + g, mean.to(tl.float32), mask=g < G)
        tl.store(rstd_ptr + n * G + g, rstd, mask=g < G)


@triton.jit
def epilogue_adds(acc, n, oh, ow, offs_n, m_mask, n_mask, mask, temb_ptr, stn, stc, sth, gate_ptr, sgn, sgh, res_ptr,
                  srn, srh, srw, src, HR, WR, inv_scale, HAS_TEMB: tl.constexpr, TEMB_ROWS: tl.constexpr,
                  HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, RES_RESAMPLE: tl.constexpr, IDX64: tl.constexpr,
                  BN: tl.constexpr):  # fmt: skip
    """Epilogue: ``(residual + gate[n, oh] * (acc + temb[n, oh])) * inv_scale`` over an output tile of image n (rows
    (oh, ow), channels offs_n), in fp32. Used by the fused convolution and by the pass after a cuDNN one
    (kernels/conv_epilogue.py)."""
    if HAS_TEMB:
        n_t = _idx(n, IDX64)
        c_t = _idx(offs_n, IDX64)
        if TEMB_ROWS:  # one vector per output row (a temporal conv's per-frame embedding)
            temb_off = n_t * stn + _idx(oh, IDX64)[:, None] * sth + c_t[None, :] * stc
            acc += tl.load(temb_ptr + temb_off, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(temb_ptr + n_t * stn + c_t * stc, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:  # everything but the residual is scaled (SVD's alpha blend of spatial and temporal paths)
        acc *= tl.load(gate_ptr + _idx(n, IDX64) * sgn + _idx(oh, IDX64) * sgh, mask=m_mask, other=0.0)[:, None]
    if HAS_RES:
        zero_n = tl.zeros([BN], dtype=tl.float32)
        acc += _stage_input(res_ptr + n.to(tl.int64) * srn, oh, ow, m_mask, offs_n, n_mask, srh, srw, src, HR, WR,
                            zero_n, zero_n, RES_RESAMPLE, False, identity, IDX64)  # fmt: skip
    return acc * inv_scale


@triton.jit
def channel_statistics(out, mask, rows, cols, col_ok, n, tiles_per_image, ws_ptr, counter_ptr, mean_ptr, rstd_ptr, C,
                       G, S, eps, BLOCK_G: tl.constexpr, BLOCK_CPG: tl.constexpr):  # fmt: skip
    """Epilogue: adds an output tile's per-channel sums (its ``rows`` pixels of image n, channels ``cols``) to ws
    [N, C, 2] fp64; with G > 0, the last of the image's ``tiles_per_image`` tiles to finish (arrival counter) folds
    them into per-group mean/rstd [N, G]. G == 0: the caller takes the per-channel sums themselves (a later two-part
    GroupNorm's). ws and the counters start at zero (the launcher's fresh buffer). Used by the fused convolution and
    by the epilogue after a cuDNN one (kernels/conv_epilogue.py)."""
    # Centred per-column sums of the stored values (fp32 within the tile), then fp64 sums across tiles.
    v = tl.where(mask, out.to(tl.float32), 0.0)
    rows = rows.to(tl.float32)
    col_mean = tl.sum(v, axis=0) / rows
    d = tl.where(mask, v - col_mean[None, :], 0.0)
    residual = tl.sum(d, axis=0)  # corrected two-pass: removes the fp32 mean's rounding error (|mean| >> std)
    col_m2 = tl.maximum(tl.sum(d * d, axis=0) - residual * residual / rows, 0.0)
    # The correction is added in fp64: rounded back to a fp32 mean it would bias the variance by rows * ulp^2.
    rows64 = rows.to(tl.float64)
    col_sum = col_mean.to(tl.float64) * rows64 + residual.to(tl.float64)
    ws_off = (n * C + cols).to(tl.int64) * 2
    tl.atomic_add(ws_ptr + ws_off, col_sum, mask=col_ok, sem="relaxed")
    col_sq = col_m2.to(tl.float64) + col_sum * (col_sum / rows64)
    tl.atomic_add(ws_ptr + ws_off + 1, col_sq, mask=col_ok, sem="relaxed")
    if G > 0:
        # Every thread's adds are ordered before the counter's release (CUTLASS semaphore pattern).
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + n, 1, sem="acq_rel")
        if done == tiles_per_image - 1:
            _finalize_stats(ws_ptr, mean_ptr, rstd_ptr, n, C, G, S, eps, BLOCK_G, BLOCK_CPG)


# The statistics workspace and arrival counters accumulate across a launch's programs and must be zero when it starts:
# the autotuner zeroes them before each benchmark launch and before the launch after tuning (the launcher's fresh
# buffers cover launches with a tuned key). So they are never the input: without statistics they are empty tensors.
@autotune(
    configs=_configs(),
    key=["KEY_S", "KEY_CIN", "KEY_COUT", "KH", "KW", "STRIDE", "RESAMPLE", "HAS_SC", "NORMALIZE", "OUT_STATS",
         "OUT_ROW_STATS", "HAS_TEMB", "HAS_RES", "HAS_GATE", "IDX64", "X_TWO_PART", "SC_TWO_PART", "DOT_PRECISION"],
    reset_to_zero=["ws_ptr", "counter_ptr"],
    prune_configs_by={"early_config_prune": _prune_configs},
)  # fmt: skip
@triton.jit
def _gn_conv2d_fwd_kernel(
    y_ptr,  # [N, OH, OW, C_out] (strides)
    ws_ptr,  # [N, C_out, 2] fp64 (OUT_ROW_STATS: [N * OH * OW, 2]), zeroed by the launcher
    counter_ptr,  # [N] int32 (OUT_ROW_STATS: one per row tile of the smallest BM), zeroed by the launcher
    out_mean_ptr,  # [N, G_out] fp32 (OUT_ROW_STATS: [2, N * OH * OW], the LayerNorm statistics of the pixels)
    out_rstd_ptr,
    x_ptr,  # [N, H, W, C_in] (strides), or its first C_head channels when X_TWO_PART
    x2_ptr,  # X_TWO_PART: channels [C_head, C_in) of the input [N, H, W, C_in - C_head] (strides)
    mean_ptr,  # [N, G_in] fp32
    rstd_ptr,
    gamma_ptr,  # [C_in]
    beta_ptr,
    w_ptr,  # [C_out, C_in, KH, KW] (strides)
    bias_ptr,  # [C_out]
    temb_ptr,  # [N, C_out] or [N, C_out, OH] (strides; sth = 0 for the former)
    res_ptr,  # [N, RH, RW, C_out] (strides)
    xs_ptr,  # shortcut input [N, HS, WS, C_sc] (strides), or its first C_sc_head channels when SC_TWO_PART
    xs2_ptr,  # SC_TWO_PART: the rest of the shortcut input's channels
    ws_w_ptr,  # shortcut weight [C_out, C_sc] (strides)
    bias2_ptr,  # shortcut bias [C_out]
    gate_ptr,  # [N, OH] fp32 (strides; sgh = 0 for one gate per image)
    sxn, sxh, sxw, sxc,
    sx2n, sx2h, sx2w, sx2c,
    swo, swi, swh, sww,
    syn, syh, syw, syc,
    stn, stc, sth,
    sgn, sgh,
    srn, srh, srw, src,
    ssn, ssh, ssw, ssc,
    ss2n, ss2h, ss2w, ss2c,
    swso, swsi,
    H, W, C_in, OH, OW, C_out, G_in, HR, WR, HS, WS, C_sc, G_out, C_head, C_sc_head,
    out_eps, inv_scale,
    KEY_S, KEY_CIN, KEY_COUT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    RESAMPLE: tl.constexpr, NORMALIZE: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr,
    TEMB_ROWS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, RES_RESAMPLE: tl.constexpr,
    HAS_SC: tl.constexpr, SC_RESAMPLE: tl.constexpr, HAS_BIAS2: tl.constexpr,
    OUT_STATS: tl.constexpr, STATS_BLOCK_G: tl.constexpr, STATS_BLOCK_CPG: tl.constexpr, OUT_ROW_STATS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDX64: tl.constexpr,
    X_TWO_PART: tl.constexpr, SC_TWO_PART: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    S = OH * OW
    n_mt = tl.cdiv(S, BM)
    n_nt = tl.cdiv(C_out, BN)
    pid = tl.program_id(0)
    nt = pid % n_nt
    mt = (pid // n_nt) % n_mt
    n = pid // (n_nt * n_mt)

    offs_m = mt * BM + tl.arange(0, BM)
    m_mask = offs_m < S
    oh = offs_m // OW
    ow = offs_m % OW
    offs_n = nt * BN + tl.arange(0, BN)
    n_mask = offs_n < C_out
    kk = tl.arange(0, BK)
    w_cols = _idx(offs_n, IDX64)[None, :] * swo

    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_base = x_ptr + n.to(tl.int64) * sxn
    x2_base = x2_ptr + n.to(tl.int64) * sx2n  # read only with X_TWO_PART
    # Each part's channels in whole blocks, so that a block reads one part (one part: C_head == C_in).
    n_cb_head = tl.cdiv(C_head, BK)
    n_cb = n_cb_head + tl.cdiv(C_in - C_head, BK)
    if NORMALIZE:
        cpg_in = C_in // G_in
    # One flat loop over (kh, kw, channel block): nested loops defeat the pipeliner and spill.
    # (kh, kw, cb) advance as counters: an integer division by the run-time n_cb costs ~10 instructions per k-step.
    cb = n_cb * 0
    kh = cb
    kw = cb
    for _ in range(0, KH * KW * n_cb):
        part, sph, spw, spc, c_local, ci, c_mask = _channel_part(
            cb, n_cb_head, C_head, C_in, kk, x_base, x2_base, sxh, sxw, sxc, sx2h, sx2w, sx2c, X_TWO_PART, BK
        )
        if NORMALIZE:
            grp = n * G_in + ci // cpg_in
            mu = tl.load(mean_ptr + grp, mask=c_mask, other=0.0)
            rs = tl.load(rstd_ptr + grp, mask=c_mask, other=0.0)
            if HAS_GAMMA:
                scale = tl.load(gamma_ptr + ci, mask=c_mask, other=0.0).to(tl.float32) * rs
            else:
                scale = rs
            shift = -scale * mu
            if HAS_BETA:
                shift += tl.load(beta_ptr + ci, mask=c_mask, other=0.0).to(tl.float32)
        else:
            scale = tl.zeros([BK], dtype=tl.float32)
            shift = scale
        ih = oh * STRIDE + (kh - PAD_H)
        iw = ow * STRIDE + (kw - PAD_W)
        a = _stage_input(part, ih, iw, m_mask, c_local, c_mask, sph, spw, spc, H, W, scale, shift,
                         RESAMPLE, NORMALIZE, ACTIVATION, IDX64)  # fmt: skip
        # (pointer + each term in turn: summing the offsets first changes the compile and spills some tiles)
        b = tl.load(w_ptr + w_cols + _idx(ci, IDX64)[:, None] * swi + _idx(kh, IDX64) * swh + _idx(kw, IDX64) * sww,
                    mask=c_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a.to(w_ptr.dtype.element_ty), b, acc, input_precision=DOT_PRECISION)
        cb += 1
        next_tap = cb == n_cb
        cb = tl.where(next_tap, 0, cb)
        kw = tl.where(next_tap, kw + 1, kw)
        next_row = kw == KW
        kw = tl.where(next_row, 0, kw)
        kh = tl.where(next_row, kh + 1, kh)

    if HAS_SC:
        # 1x1 stride-1 shortcut conv of a second input (optionally resampled) into the same accumulator.
        xs_base = xs_ptr + n.to(tl.int64) * ssn
        xs2_base = xs2_ptr + n.to(tl.int64) * ss2n  # read only with SC_TWO_PART
        ws_cols = _idx(offs_n, IDX64)[None, :] * swso
        n_sc_head = tl.cdiv(C_sc_head, BK)
        for cb in range(0, n_sc_head + tl.cdiv(C_sc - C_sc_head, BK)):
            part, sph, spw, spc, c_local, ci, c_mask = _channel_part(
                cb, n_sc_head, C_sc_head, C_sc, kk, xs_base, xs2_base, ssh, ssw, ssc, ss2h, ss2w, ss2c, SC_TWO_PART, BK
            )
            zero = tl.zeros([BK], dtype=tl.float32)
            a = _stage_input(part, oh, ow, m_mask, c_local, c_mask, sph, spw, spc, HS, WS, zero, zero,
                             SC_RESAMPLE, False, ACTIVATION, IDX64)  # fmt: skip
            ws_ptrs = ws_w_ptr + ws_cols + _idx(ci, IDX64)[:, None] * swsi
            b = tl.load(ws_ptrs, mask=c_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a.to(ws_w_ptr.dtype.element_ty), b, acc, input_precision=DOT_PRECISION)

    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS2:
        acc += tl.load(bias2_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = epilogue_adds(acc, n, oh, ow, offs_n, m_mask, n_mask, mask, temb_ptr, stn, stc, sth, gate_ptr, sgn, sgh,
                        res_ptr, srn, srh, srw, src, HR, WR, inv_scale, HAS_TEMB, TEMB_ROWS, HAS_GATE, HAS_RES,
                        RES_RESAMPLE, IDX64, BN)  # fmt: skip
    out = acc.to(y_ptr.dtype.element_ty)
    y_off = n.to(tl.int64) * syn + (oh.to(tl.int64) * syh + ow.to(tl.int64) * syw)[:, None] + offs_n[None, :] * syc
    tl.store(y_ptr + y_off, out, mask=mask)

    if OUT_STATS:
        channel_statistics(out, mask, tl.minimum(S - mt * BM, BM), offs_n, n_mask, n, n_mt * n_nt, ws_ptr,
                           counter_ptr, out_mean_ptr, out_rstd_ptr, C_out, G_out, S, out_eps, STATS_BLOCK_G,
                           STATS_BLOCK_CPG)  # fmt: skip
    if OUT_ROW_STATS:
        # The LayerNorm statistics of each output pixel's channel vector: the token rows a transformer's proj_in
        # hands its first block's norm1. Rows n * S + m of [N * S, C_out]; the image count is the grid's.
        rows_total = (tl.num_programs(0) // (n_mt * n_nt)).to(tl.int64) * S
        row_statistics(out, mask, n.to(tl.int64) * S + offs_m, m_mask, n * n_mt + mt, nt, ws_ptr, counter_ptr,
                       out_mean_ptr, rows_total, C_out, out_eps, BN)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- launchers


def _reach(t: torch.Tensor, first_dim: int = 0) -> int:
    """The largest offset of t's elements from its first one, counting dims from ``first_dim``."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape[first_dim:], t.stride()[first_dim:]))


def int64_index(images, others) -> bool:
    """IDX64: whether some offset the kernel forms reaches INT64_INDEX_FROM: within one image of ``images`` (per
    image: their batch offsets are int64 always), or anywhere in ``others`` (weights, temb, gate). A large image, or a
    view with a large stride (e.g. an NCHW residual of C x H x W >= 2^31 elements, whose channel stride is H x W).
    Offsets are int32 otherwise, exact there and lighter on registers."""
    reach = [_reach(t, 1) for t in images if t is not None] + [_reach(t) for t in others if t is not None]
    return max(reach) >= INT64_INDEX_FROM


#: The smallest row tile of any config: the row statistics' counters are allocated for it.
_MIN_BM = min(config.kwargs["BM"] for config in _gn_conv2d_fwd_kernel.configs)


def _stats_workspace(device: torch.device, n: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ws [N*C*2] fp64, counters [N] int32), zeroed: one fresh buffer per call (one memset), so no state outlives
    the call — concurrent streams, CUDA graphs and torch.compile see an ordinary allocation."""
    buffer = torch.zeros(n * c * 2 + (n + 1) // 2, device=device, dtype=torch.float64)
    return buffer[: n * c * 2], buffer[n * c * 2 :].view(torch.int32)[:n]


def output_statistics_buffers(
    device: torch.device,
    n: int,
    c: int,
    s: int,
    out_groups: int,
    out_layer_norm: bool,
    out_channel_sums: bool,
    min_bm: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(out_mean, out_rstd, ws, counters, STATS_BLOCK_G, STATS_BLOCK_CPG) for an epilogue over an [N, C, S-pixel]
    output that sums per-group statistics and/or channel sums (channel_statistics) or LayerNorm row statistics
    (_gemm.row_statistics, one counter per row tile of ``min_bm`` pixels): the fused conv's and the pass after a
    cuDNN conv's (kernels/conv_epilogue.py)."""
    if out_layer_norm and out_groups:
        raise ValueError(f"out_layer_norm with out_groups={out_groups}: one kind of output statistics per call")
    out_mean = new_output((2, n * s) if out_layer_norm else (n, out_groups), device=device, dtype=torch.float32)
    out_rstd = new_output((n, out_groups), device=device, dtype=torch.float32)
    if out_layer_norm:
        ws, counters = row_stats_workspace(device, n * s, n * cdiv(s, min_bm))
        return out_mean, out_rstd, ws, counters, 1, 1
    if out_groups or out_channel_sums:
        ws, counters = _stats_workspace(device, n, c)
        # At least 64 channels per group tile: the finalisation is a few KB per image, and one tile shape for every
        # group size up to 64 means one compiled variant (times the autotune configs) instead of one per size.
        # (Sums alone, out_groups=0, finalise nothing: the same variant as 64 or fewer channels per group.)
        block_cpg = max(64, next_power_of_2(c // out_groups)) if out_groups else 64
        block_g = max(1, min(next_power_of_2(max(out_groups, 1)), 1024 // block_cpg))
        return out_mean, out_rstd, ws, counters, block_g, block_cpg
    # Empty, so the autotuner's reset_to_zero has nothing to clear (never the input), and nothing to read.
    return out_mean, out_rstd, out_mean, out_rstd, 1, 1


def channel_sums_output(ws: torch.Tensor, n: int, c: int, out_channel_sums: bool) -> torch.Tensor:
    """The [N, C, 2] fp64 channel sums the workspace holds when they were asked for, else an empty [N, 0, 2]."""
    if out_channel_sums:
        return ws.view(n, c, 2)
    return torch.empty((n, 0, 2), device=ws.device, dtype=torch.float64)


def nhwc_strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """An [N, C, H, W] tensor's strides in (n, h, w, c) order, the kernels' argument order; zeros for None."""
    return (t.stride(0), t.stride(2), t.stride(3), t.stride(1)) if t is not None else (0, 0, 0, 0)


def temb_gate_strides(temb: torch.Tensor | None, gate: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """(stn, stc, sth, sgn, sgh) of an epilogue's temb ([N, C] or per row [N, C, OH]) and gate ([N, 1] or [N, OH]):
    0 along what they broadcast over, and for an absent one."""
    stn, stc = temb.stride()[:2] if temb is not None else (0, 0)
    sth = temb.stride(2) if temb is not None and temb.dim() == 3 else 0
    sgn, sgh = (gate.stride(0), gate.stride(1) if gate.shape[1] > 1 else 0) if gate is not None else (0, 0)
    return stn, stc, sth, sgn, sgh


def _resampled_size(h: int, w: int, resample: str) -> tuple[int, int]:
    if resample == "up":
        return 2 * h, 2 * w
    if resample == "down":
        return h // 2, w // 2
    return h, w


def conv_output_size(h: int, w: int, kernel: tuple[int, int], stride: int, padding: tuple[int, int], resample: str):
    """(OH, OW) of the conv applied to x (H, W) after ``resample``."""
    hc, wc = _resampled_size(h, w, resample)
    return (hc + 2 * padding[0] - kernel[0]) // stride + 1, (wc + 2 * padding[1] - kernel[1]) // stride + 1


def gn_conv2d_fwd(
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temb: torch.Tensor | None,
    residual: torch.Tensor | None,
    shortcut_x: torch.Tensor | None,
    shortcut_weight: torch.Tensor | None,
    shortcut_bias: torch.Tensor | None,
    gate: torch.Tensor | None,
    num_groups: int,
    activation: str | None,
    stride: int,
    padding: tuple[int, int],
    resample: str,
    residual_resample: str,
    shortcut_resample: str,
    output_scale: float,
    out_groups: int,
    out_eps: float,
    x_tail: torch.Tensor | None = None,
    shortcut_x_tail: torch.Tensor | None = None,
    fp32_precision: str = "conv",
    out_layer_norm: bool = False,
    out_channel_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: (y [N, C_out, OH, OW] channels-last, out_mean [N, out_groups] fp32, out_rstd, channel_sums).

    ``mean is None`` skips the normalisation prologue (plain conv). out_groups=0: no statistics (empty tensors).
    ``out_layer_norm`` (with out_groups=0): out_mean is instead the LayerNorm statistics ``[2, N * OH * OW]`` (means,
    then rstds for ``out_eps``) of y's pixels over their C_out channels, and out_rstd is empty.
    ``out_channel_sums``: channel_sums is the statistics workspace, [N, C_out, 2] fp64 sums of y and of y squared
    per (image, channel), from which any grouping of y's channels (with another tensor's, cat([y, skip], 1) in a UNet
    up block) can be finalised (kernels/group_norm_sums.py); out_groups may then be 0. Otherwise it is empty.
    temb: [N, C_out] or [N, C_out, OH]; gate: [N, 1] or [N, OH] fp32. ``x_tail`` / ``shortcut_x_tail``: the input is
    ``cat([x, x_tail], 1)`` (likewise the shortcut's), read where the parts lie. ``fp32_precision``: whose TF32 setting
    fp32 products follow, PyTorch's "conv" or "matmul" (_common.torch_fp32_precision).
    """
    dot_precision = fp32_dot_precision(x.dtype, fp32_precision)  # first: it validates fp32_precision
    n, c_head, h, w = x.shape
    c_in = c_head + (x_tail.shape[1] if x_tail is not None else 0)
    c_out, _, kh, kw = weight.shape
    # Per-channel vectors and statistics are read with unit stride.
    mean, rstd, gamma, beta, bias, shortcut_bias = (
        None if t is None else t.contiguous() for t in (mean, rstd, gamma, beta, bias, shortcut_bias)
    )
    oh, ow = conv_output_size(h, w, (kh, kw), stride, padding, resample)
    y = new_output((n, c_out, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    s = oh * ow
    out_mean, out_rstd, ws, counters, block_g, block_cpg = output_statistics_buffers(
        x.device, n, c_out, s, out_groups, out_layer_norm, out_channel_sums, _MIN_BM
    )
    normalize = mean is not None
    temb_rows = temb is not None and temb.dim() == 3
    dummy = x
    res_h, res_w = residual.shape[2:] if residual is not None else (1, 1)
    sc_h, sc_w = shortcut_x.shape[2:] if shortcut_x is not None else (1, 1)
    c_sc_head = shortcut_x.shape[1] if shortcut_x is not None else 1
    c_sc = c_sc_head + (shortcut_x_tail.shape[1] if shortcut_x_tail is not None else 0)
    grid = lambda meta: (n * cdiv(s, meta["BM"]) * cdiv(c_out, meta["BN"]),)
    tuned_launch(_gn_conv2d_fwd_kernel)[grid](
        y, ws, counters, out_mean, out_rstd, x, x_tail if x_tail is not None else dummy,
        mean if normalize else dummy, rstd if normalize else dummy,
        gamma if gamma is not None else dummy, beta if beta is not None else dummy,
        weight, bias if bias is not None else dummy, temb if temb is not None else dummy,
        residual if residual is not None else dummy,
        shortcut_x if shortcut_x is not None else dummy,
        shortcut_x_tail if shortcut_x_tail is not None else dummy,
        shortcut_weight if shortcut_weight is not None else dummy,
        shortcut_bias if shortcut_bias is not None else dummy,
        gate if gate is not None else dummy,
        *nhwc_strides(x), *nhwc_strides(x_tail), *weight.stride(), *nhwc_strides(y), *temb_gate_strides(temb, gate),
        *nhwc_strides(residual), *nhwc_strides(shortcut_x), *nhwc_strides(shortcut_x_tail),
        *(shortcut_weight.stride()[:2] if shortcut_weight is not None else (0, 0)),
        h, w, c_in, oh, ow, c_out, num_groups if normalize else 1, res_h, res_w, sc_h, sc_w, c_sc,
        out_groups if out_channel_sums else max(out_groups, 1), c_head, c_sc_head, float(out_eps),
        1.0 / float(output_scale),
        min(next_power_of_2(s), 1 << 16), next_power_of_2(c_in), next_power_of_2(c_out),
        KH=kh, KW=kw, STRIDE=stride, PAD_H=padding[0], PAD_W=padding[1], RESAMPLE=RESAMPLE[resample],
        NORMALIZE=normalize,
        ACTIVATION=ACTIVATIONS[activation][0], HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None,
        HAS_BIAS=bias is not None, HAS_TEMB=temb is not None, TEMB_ROWS=temb_rows, HAS_GATE=gate is not None,
        HAS_RES=residual is not None,
        RES_RESAMPLE=RESAMPLE[residual_resample], HAS_SC=shortcut_x is not None,
        SC_RESAMPLE=RESAMPLE[shortcut_resample], HAS_BIAS2=shortcut_bias is not None,
        OUT_STATS=out_groups > 0 or out_channel_sums,
        STATS_BLOCK_G=block_g, STATS_BLOCK_CPG=block_cpg, OUT_ROW_STATS=out_layer_norm, DOT_PRECISION=dot_precision,
        IDX64=int64_index((x, x_tail, y, residual, shortcut_x, shortcut_x_tail), (weight, shortcut_weight, temb, gate)),
        X_TWO_PART=x_tail is not None, SC_TWO_PART=shortcut_x_tail is not None,
    )  # fmt: skip
    return y, out_mean, out_rstd, channel_sums_output(ws, n, c_out, out_channel_sums)


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate (kept in _gn_conv2d_specs.py with their rationale)."""
    from ._gn_conv2d_specs import conv_aot_specs

    return conv_aot_specs()
