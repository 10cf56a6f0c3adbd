"""The @triton.jit kernels of the implicit-GEMM convolution with GroupNorm in its loader (kernels/gn_conv2d.py
describes the op, picks the tiles the autotuner wraps this forward kernel in, and launches it): the forward kernel
and its pieces, the loader's input staging (resampling, normalisation, activation, zero padding) and channel parts,
and the epilogue's adds and output statistics, which kernels/conv_epilogue.py's pass after a cuDNN conv shares.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import identity, variance_floor
from ._gemm import row_statistics


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
        var = variance_floor(tl.sum(tl.where(mask, s2, 0.0), axis=1) / count - mean * mean)
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
