"""The @triton.jit kernels of temporal attention over frames (kernels/temporal_attention.py launches them): the
forward and the backward over BLOCK_P sequences of strided (B, F, N, H, D) views, and the pieces they share (sequence
offsets, head-dim chunk loads, batched dots, the exact softmax, the score gradients). Layout, algorithm and tiles are
described in kernels/temporal_attention.py, which picks each launch's tile and compiles them ahead of time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _seq_offsets(s, N, H, stride_b, stride_n, stride_h, ALIGN: tl.constexpr):
    # s indexes the flattened (b, n, h) space, h fastest. ALIGN (checked by the launcher) divides every stride: with
    # a head stride of 40 or 72 Triton cannot see that itself (it only marks multiples of 16), and loads stay scalar.
    h = s % H
    t = s // H
    n = t % N
    b = t // N
    return tl.multiple_of(b.to(tl.int64) * stride_b + n.to(tl.int64) * stride_n + h.to(tl.int64) * stride_h, ALIGN)


@triton.jit
def _tile_ptrs(ptr, seq_off, f, d, stride_f, stride_d, ALIGN: tl.constexpr):
    # [P, F, D] addresses of a head-dim chunk of BLOCK_P sequences. int64: a view with a large frame (or head-dim)
    # stride spans 2^31 elements or more within one sequence (e.g. the contiguous dq of a strided q).
    frame_off = tl.multiple_of(f.to(tl.int64) * stride_f, ALIGN)
    return ptr + seq_off[:, None, None] + (frame_off[None, :, None] + d.to(tl.int64)[None, None, :] * stride_d)


@triton.jit
def _load_chunk(ptr, seq_off, f, d, stride_f, stride_d, mask, ALIGN: tl.constexpr):
    # One [P, F, chunk] tile, zero where masked (padded frames and head-dim lanes add nothing to any product).
    return tl.load(_tile_ptrs(ptr, seq_off, f, d, stride_f, stride_d, ALIGN), mask=mask, other=0.0)


@triton.jit
def _bdot(a, b, acc, DOT_PRECISION: tl.constexpr):
    # Batched a @ b + acc on [P, M, K] x [P, K, N]. One sequence per program drops to a 2-D dot: the 3-D MMA layout
    # puts the warps on the batch axis, so with P = 1 all but one warp would compute a redundant copy.
    if a.shape[0] == 1:
        r = tl.dot(
            tl.reshape(a, (a.shape[1], a.shape[2])),
            tl.reshape(b, (b.shape[1], b.shape[2])),
            tl.reshape(acc, (acc.shape[1], acc.shape[2])),
            input_precision=DOT_PRECISION,
        )
        return tl.reshape(r, acc.shape)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _scores(
    acc,
    a_ptr,
    b_ptr,
    a_off,
    b_off,
    stride_af,
    stride_ad,
    stride_bf,
    stride_bd,
    f,
    row_mask,
    D,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # acc += A B^T over the head dim, A and B [P, F, D] in chunks of BLOCK_D.
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask & (d < D)[None, None, :]
        a = _load_chunk(a_ptr, a_off, f, d, stride_af, stride_ad, mask, ALIGN)
        b = _load_chunk(b_ptr, b_off, f, d, stride_bf, stride_bd, mask, ALIGN)
        acc = _bdot(a, tl.permute(b, (0, 2, 1)), acc, DOT_PRECISION)
    return acc


@triton.jit
def _softmax(s, col_valid, qk_scale):
    # Exact row softmax of s * scale in fp32 (exp2 with log2(e) folded into qk_scale); padded keys get weight 0.
    s = tl.where(col_valid, s * qk_scale, float("-inf"))
    m = tl.max(s, axis=2)
    p = tl.exp2(s - m[:, :, None])
    return p / tl.sum(p, axis=2)[:, :, None]


@triton.jit
def _product_into(
    out_ptr, out_off, a, b, f, d, mask, zero_o, stride_f, stride_d, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr
):
    # One head-dim chunk of an output or a gradient: a @ b ([P, F, F] x [P, F, chunk]) stored in out's dtype.
    out = _bdot(a, b, zero_o, DOT_PRECISION)
    tl.store(_tile_ptrs(out_ptr, out_off, f, d, stride_f, stride_d, ALIGN), out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _temporal_attention_fwd_kernel(
    o_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_ob, stride_of, stride_on, stride_oh, stride_od,
    stride_qb, stride_qf, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kf, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vf, stride_vn, stride_vh, stride_vd,
    n_seq,
    N,
    H,
    F,
    qk_scale,
    SEQ_BUCKET,  # autotune key only
    LAYOUT,  # autotune key only
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    f = tl.arange(0, BLOCK_F)
    row_mask = (s < n_seq)[:, None, None] & (f < F)[None, :, None]
    q_off = _seq_offsets(s, N, H, stride_qb, stride_qn, stride_qh, ALIGN)
    k_off = _seq_offsets(s, N, H, stride_kb, stride_kn, stride_kh, ALIGN)
    v_off = _seq_offsets(s, N, H, stride_vb, stride_vn, stride_vh, ALIGN)
    o_off = _seq_offsets(s, N, H, stride_ob, stride_on, stride_oh, ALIGN)

    acc = tl.zeros([BLOCK_P, BLOCK_F, BLOCK_F], dtype=tl.float32)
    zero_o = tl.zeros([BLOCK_P, BLOCK_F, BLOCK_D], dtype=tl.float32)
    if BLOCK_D >= D:
        # The whole head dim in one chunk: v is loaded with q and k, its latency hidden behind theirs and the scores.
        d = tl.arange(0, BLOCK_D)
        mask = row_mask & (d < D)[None, None, :]
        q = _load_chunk(q_ptr, q_off, f, d, stride_qf, stride_qd, mask, ALIGN)
        k = _load_chunk(k_ptr, k_off, f, d, stride_kf, stride_kd, mask, ALIGN)
        v = _load_chunk(v_ptr, v_off, f, d, stride_vf, stride_vd, mask, ALIGN)
        acc = _bdot(q, tl.permute(k, (0, 2, 1)), acc, DOT_PRECISION)
        p = _softmax(acc, (f < F)[None, None, :], qk_scale).to(v_ptr.dtype.element_ty)
        _product_into(o_ptr, o_off, p, v, f, d, mask, zero_o, stride_of, stride_od, DOT_PRECISION, ALIGN)
    else:
        acc = _scores(
            acc, q_ptr, k_ptr, q_off, k_off, stride_qf, stride_qd, stride_kf, stride_kd, f, row_mask, D,
            BLOCK_D, DOT_PRECISION, ALIGN,
        )  # fmt: skip
        p = _softmax(acc, (f < F)[None, None, :], qk_scale).to(v_ptr.dtype.element_ty)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = row_mask & (d < D)[None, None, :]
            v = _load_chunk(v_ptr, v_off, f, d, stride_vf, stride_vd, mask, ALIGN)
            _product_into(o_ptr, o_off, p, v, f, d, mask, zero_o, stride_of, stride_od, DOT_PRECISION, ALIGN)


@triton.jit
def _temporal_attention_bwd_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    do_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_dqb, stride_dqf, stride_dqn, stride_dqh, stride_dqd,
    stride_dkb, stride_dkf, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvf, stride_dvn, stride_dvh, stride_dvd,
    stride_dob, stride_dof, stride_don, stride_doh, stride_dod,
    stride_qb, stride_qf, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kf, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vf, stride_vn, stride_vh, stride_vd,
    n_seq,
    N,
    H,
    F,
    scale,
    qk_scale,
    SEQ_BUCKET,  # autotune key only
    LAYOUT,  # autotune key only
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    f = tl.arange(0, BLOCK_F)
    row_mask = (s < n_seq)[:, None, None] & (f < F)[None, :, None]
    q_off = _seq_offsets(s, N, H, stride_qb, stride_qn, stride_qh, ALIGN)
    k_off = _seq_offsets(s, N, H, stride_kb, stride_kn, stride_kh, ALIGN)
    v_off = _seq_offsets(s, N, H, stride_vb, stride_vn, stride_vh, ALIGN)
    do_off = _seq_offsets(s, N, H, stride_dob, stride_don, stride_doh, ALIGN)

    zeros = tl.zeros([BLOCK_P, BLOCK_F, BLOCK_F], dtype=tl.float32)
    zero_o = tl.zeros([BLOCK_P, BLOCK_F, BLOCK_D], dtype=tl.float32)
    col_valid = (f < F)[None, None, :]
    if BLOCK_D >= D:
        # The whole head dim in one chunk: q, k, v and dO are loaded once and kept for the gradients (the chunked
        # path below reads q, k and dO twice).
        d = tl.arange(0, BLOCK_D)
        mask = row_mask & (d < D)[None, None, :]
        q = _load_chunk(q_ptr, q_off, f, d, stride_qf, stride_qd, mask, ALIGN)
        k = _load_chunk(k_ptr, k_off, f, d, stride_kf, stride_kd, mask, ALIGN)
        v = _load_chunk(v_ptr, v_off, f, d, stride_vf, stride_vd, mask, ALIGN)
        do = _load_chunk(do_ptr, do_off, f, d, stride_dof, stride_dod, mask, ALIGN)
        p = _softmax(_bdot(q, tl.permute(k, (0, 2, 1)), zeros, DOT_PRECISION), col_valid, qk_scale)
        dp = _bdot(do, tl.permute(v, (0, 2, 1)), zeros, DOT_PRECISION)
    else:
        acc = _scores(
            zeros, q_ptr, k_ptr, q_off, k_off, stride_qf, stride_qd, stride_kf, stride_kd, f, row_mask, D,
            BLOCK_D, DOT_PRECISION, ALIGN,
        )  # fmt: skip
        p = _softmax(acc, col_valid, qk_scale)
        dp = _scores(
            zeros, do_ptr, v_ptr, do_off, v_off, stride_dof, stride_dod, stride_vf, stride_vd, f, row_mask, D,
            BLOCK_D, DOT_PRECISION, ALIGN,
        )  # fmt: skip
    p_t, ds, ds_t = _score_grads(p, dp, scale, do_ptr, k_ptr, q_ptr)
    # the gradients' offsets only now: live through the score products, they cost registers there
    dq_off = _seq_offsets(s, N, H, stride_dqb, stride_dqn, stride_dqh, ALIGN)
    dk_off = _seq_offsets(s, N, H, stride_dkb, stride_dkn, stride_dkh, ALIGN)
    dv_off = _seq_offsets(s, N, H, stride_dvb, stride_dvn, stride_dvh, ALIGN)
    if BLOCK_D >= D:  # the tiles loaded above
        _product_into(dv_ptr, dv_off, p_t, do, f, d, mask, zero_o, stride_dvf, stride_dvd, DOT_PRECISION, ALIGN)
        _product_into(dq_ptr, dq_off, ds, k, f, d, mask, zero_o, stride_dqf, stride_dqd, DOT_PRECISION, ALIGN)
        _product_into(dk_ptr, dk_off, ds_t, q, f, d, mask, zero_o, stride_dkf, stride_dkd, DOT_PRECISION, ALIGN)
    else:
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = row_mask & (d < D)[None, None, :]
            # each operand loaded just before its product: fewer tiles live at once
            do = _load_chunk(do_ptr, do_off, f, d, stride_dof, stride_dod, mask, ALIGN)
            _product_into(dv_ptr, dv_off, p_t, do, f, d, mask, zero_o, stride_dvf, stride_dvd, DOT_PRECISION, ALIGN)
            k = _load_chunk(k_ptr, k_off, f, d, stride_kf, stride_kd, mask, ALIGN)
            _product_into(dq_ptr, dq_off, ds, k, f, d, mask, zero_o, stride_dqf, stride_dqd, DOT_PRECISION, ALIGN)
            q = _load_chunk(q_ptr, q_off, f, d, stride_qf, stride_qd, mask, ALIGN)
            _product_into(dk_ptr, dk_off, ds_t, q, f, d, mask, zero_o, stride_dkf, stride_dkd, DOT_PRECISION, ALIGN)


@triton.jit
def _score_grads(p, dp, scale, do_ptr, k_ptr, q_ptr):
    # dS = P * (dP - rowsum(P * dP)) * scale, and the operands of the gradient products, each in the dtype of the
    # tensor it multiplies: P^T (dV = P^T dO), dS (dQ = dS K), dS^T (dK = dS^T Q). Padded query rows have dO = 0,
    # hence dP = 0 and dS = 0: they add nothing to dK and dV.
    ds = p * (dp - tl.sum(p * dp, axis=2)[:, :, None]) * scale
    ds_t = tl.permute(ds.to(q_ptr.dtype.element_ty), (0, 2, 1))
    ds = ds.to(k_ptr.dtype.element_ty)
    p_t = tl.permute(p.to(do_ptr.dtype.element_ty), (0, 2, 1))
    return p_t, ds, ds_t
