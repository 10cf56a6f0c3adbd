"""Linear layer with a fused epilogue: ``y = residual + gate[b] * act(x @ W^T + bias)``, forward, and the elementwise
part of its backward.

Layout: x is addressed as [M, K] with arbitrary strides (M = samples x tokens), the weight as nn.Linear's [N, K] with
arbitrary strides, y is a fresh contiguous [M, N]. gate is [B, N] (any strides) applied to row m through sample
b = m // T (T = M / B tokens per sample); residual is [M, N], or [B', T', N] with M = B' T' (a token stream whose
sample and token axes do not merge into one row stride, e.g. a transposed patch embedding), with any strides.
The input may come in two parts, x [M, K] and x_tail [M, K2] (any strides), read as their concatenation along K
against the weight's K + K2 columns: a concatenation made only for this GEMM is never written. Or, blended
(BLEND), two [M, K] inputs read as ``mix[m // T_MIX] * x + (1 - mix[m // T_MIX]) * x_tail`` (SVD's AlphaBlender
before a container's proj_out), mixed in fp32 and rounded once to the input dtype before the dot.
fp32/fp16/bf16 in and out; fp32 accumulation; int64 offsets (the gate's and the residual's column offsets int32 unless
they reach 2^31: INT64_COLS).
Algorithm: one flat K loop of tl.dot over [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles in grouped tile order (L2 reuse
of the weight columns), then bias, activation, gate and residual on the fp32 accumulator. Backward: a row-chunked
elementwise kernel writes dz = act'(z) * gate * dy and per-chunk column sums for d(bias) and d(gate); the matmuls
dX = dz W and dW = dz^T x are left to torch.matmul (cuBLAS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ACTIVATIONS, FP32_CLEAN_EVERYWHERE, LAUNCH_OPTIONS, autotune, cdiv, fp32_archs, new_output
from ._gemm import (
    accumulate_k,
    accumulate_k_blend,
    accumulate_k_normed,
    bwd_tiles,
    divisibility_attrs,
    gemm_configs,
    grouped_tile,
    input_precision,
    int64_columns,
    m_bucket,
    norm_operands,
    prune_operands,
    prune_wide_input,
    row_chunks,
    row_statistics,
    row_stats_workspace,
)
from ._tuned_launch import tuned_launch

_BWD_WARPS = 8


@triton.jit
def gated_residual(out, rm, rn, sample, mask, gate_ptr, stride_gb, stride_gn, res_ptr, stride_rb, stride_rt, stride_rn,
                   RES_T, sat_max, HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_3D: tl.constexpr,
                   SATURATE: tl.constexpr, INT64_COLS: tl.constexpr):  # fmt: skip
    """``residual + gate[sample] * out`` on an fp32 [BLOCK_M, BLOCK_N] tile of rows ``rm``, columns ``rn`` (``sample``:
    each row's gate row, int64), then clamped to [-sat_max, sat_max] (SATURATE, NaN kept): the epilogue after the
    activation, shared by the fused GEMM and the pass after a cuBLAS GEMM (kernels/linear_epilogue.py). gate [B, N] and
    residual [M, N], or [B', T', N] (RESIDUAL_3D, RES_T rows per stride_rb step), any strides."""
    rm64 = rm.to(tl.int64)
    if INT64_COLS:  # the gate's and the residual's column offsets
        rn_idx = rn.to(tl.int64)
    else:  # int32 is exact there: fewer registers in the epilogue (int64 spills some tiles)
        rn_idx = rn
    if HAS_GATE:
        g = tl.load(gate_ptr + sample[:, None] * stride_gb + rn_idx[None, :] * stride_gn, mask=mask, other=0.0)
        out = out * g.to(tl.float32)
    if HAS_RESIDUAL:
        if RESIDUAL_3D:  # int32 div/mod (rows < 2^31), int64 offsets
            r_rows = (rm // RES_T).to(tl.int64) * stride_rb + (rm % RES_T).to(tl.int64) * stride_rt
        else:
            r_rows = rm64 * stride_rt
        r = tl.load(res_ptr + r_rows[:, None] + rn_idx[None, :] * stride_rn, mask=mask, other=0.0)
        out = out + r.to(tl.float32)
    if SATURATE:  # Flux's fp16 clip(-65504, 65504), before the rounding that would overflow to inf
        out = tl.minimum(tl.maximum(out, -sat_max, propagate_nan=tl.PropagateNan.ALL), sat_max,
                         propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    return out


@triton.jit
def _linear_fwd_kernel(
    y_ptr,  # [M, N] contiguous
    pre_ptr,  # [M, N] contiguous: x W^T + bias, written when STORE_PRE (saved for backward)
    x_ptr,
    w_ptr,
    b_ptr,  # [N]
    gate_ptr,  # [B, N]
    res_ptr,  # [M, N]
    x2_ptr,  # [M, K2] (HAS_TAIL): the input's last K2 columns; [M, K] (BLEND): the second input
    mix_ptr,  # [M / T_MIX] fp32 (BLEND): the first input's weight per group of T_MIX rows
    stats_ptr,  # [2, M] fp32 (NORM): the input rows' mean, then their rstd
    norm_w_ptr,  # [K] (NORM_WEIGHT): the LayerNorm's weight
    norm_b_ptr,  # [K] (NORM_BIAS): the LayerNorm's bias
    pos_ptr,  # [P, K] (NORM_POS): added to the norm, row m taking table row (m // POS_ROWS) % P
    ws_ptr,  # [M, 2] fp64 (OUT_STATS): per-row sums of the output and of its squares, zeroed by the launcher
    counter_ptr,  # [cdiv(M, BLOCK_M)] int32 (OUT_STATS): finished column tiles per row tile, zeroed by the launcher
    out_stats_ptr,  # [2, M] fp32 (OUT_STATS): the output rows' LayerNorm mean, then their rstd
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_gb,
    stride_gn,
    stride_rb,
    stride_rt,
    stride_rn,
    stride_x2m,
    stride_x2k,
    stride_pp,
    M,
    N,
    K,
    K2,
    T,
    T_MIX,
    RES_T,  # residual rows per stride_rb step (RESIDUAL_3D)
    POS_ROWS,  # consecutive rows per positional-table row (NORM_POS)
    POS_P,  # the positional table's rows (NORM_POS)
    sat_max,  # SATURATE: the output clamped to [-sat_max, sat_max] before its rounding (NaN kept)
    out_eps,  # OUT_STATS: the LayerNorm's eps
    M_BUCKET,  # autotune key only
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_3D: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLEND: tl.constexpr,
    NORM: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
    NORM_BIAS: tl.constexpr,
    NORM_POS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    SATURATE: tl.constexpr,
    OUT_STATS: tl.constexpr,  # also the output rows' LayerNorm statistics (for the norm that reads them next)
    INT64_COLS: tl.constexpr,  # int64_columns(gate, residual): their column offsets reach 2^31
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # int64 offsets: a column-strided view (an NCHW map read as [HW, C]) can span 2^31 elements or more.
    rk64 = rk.to(tl.int64)
    # Rows/columns past the edge wrap onto valid ones, so only the K tail needs a load mask; the store masks them.
    rows = (rm % M).to(tl.int64)
    w_rows = (rn % N).to(tl.int64)[None, :] * stride_wn
    x_ptrs = x_ptr + rows[:, None] * stride_xm + rk64[None, :] * stride_xk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_ptrs = w_ptr + w_rows + rk64[:, None] * stride_wk
    if BLEND:
        mix = tl.load(mix_ptr + rows // T_MIX)
        x2_ptrs = x2_ptr + rows[:, None] * stride_x2m + rk64[None, :] * stride_x2k
        acc = accumulate_k_blend(acc, x_ptrs, x2_ptrs, mix, w_ptrs, rk, K, stride_xk, stride_x2k, stride_wk, BLOCK_K,
                                 INPUT_PRECISION)  # fmt: skip
    elif NORM:
        mean = tl.load(stats_ptr + rows)
        rstd = tl.load(stats_ptr + M + rows)
        pos_rows = ((rows // POS_ROWS) % POS_P) * stride_pp
        acc = accumulate_k_normed(acc, x_ptrs, w_ptrs, mean, rstd, norm_w_ptr, norm_b_ptr, pos_ptr, pos_rows, rk, K,
                                  stride_xk, stride_wk, NORM_WEIGHT, NORM_BIAS, NORM_POS, BLOCK_K,
                                  INPUT_PRECISION)  # fmt: skip
    else:
        acc = accumulate_k(acc, x_ptrs, w_ptrs, rk, K, stride_xk, stride_wk, BLOCK_K, INPUT_PRECISION)
    if HAS_TAIL:  # the weight's last K2 columns against the second part of the input
        x2_ptrs = x2_ptr + rows[:, None] * stride_x2m + rk64[None, :] * stride_x2k
        w2_ptrs = w_ptr + w_rows + (K + rk64)[:, None] * stride_wk
        acc = accumulate_k(acc, x2_ptrs, w2_ptrs, rk, K2, stride_x2k, stride_wk, BLOCK_K, INPUT_PRECISION)

    n_ok = rn < N
    mask = (rm < M)[:, None] & n_ok[None, :]
    rm64 = rm.to(tl.int64)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_offs = rm64[:, None] * N + rn[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + out_offs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
    out = gated_residual(ACTIVATION(acc), rm, rn, rm64 // T, mask, gate_ptr, stride_gb, stride_gn, res_ptr, stride_rb,
                         stride_rt, stride_rn, RES_T, sat_max, HAS_GATE, HAS_RESIDUAL, RESIDUAL_3D, SATURATE,
                         INT64_COLS)  # fmt: skip
    out = out.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + out_offs, out, mask=mask)
    if OUT_STATS:
        row_statistics(out, mask, rm, rm < M, pid_m, pid_n, ws_ptr, counter_ptr, out_stats_ptr, M, N, out_eps, BLOCK_N)


LINEAR_TILES = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 32, 8, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
# fp32 operands: 32-deep K steps (the 64-deep IEEE tiles above spill 0.6-1.2 KB per thread on sm_80, and
# 64x128x32 at 4 warps spills with TF32 on sm_90's gated 3-D residual epilogue).
LINEAR_TILES_FP32 = [
    (128, 128, 32, 8, 3, FP32_CLEAN_EVERYWHERE),
    (128, 128, 32, 8, 4, FP32_CLEAN_EVERYWHERE),
    (128, 64, 32, 4, 3, FP32_CLEAN_EVERYWHERE),
    (64, 128, 32, 8, 3, FP32_CLEAN_EVERYWHERE),
    (64, 64, 32, 4, 4, FP32_CLEAN_EVERYWHERE),
]


def _prune_linear(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    return prune_wide_input(prune_operands(configs, named_args, **kwargs), named_args)


# K2, BLEND and NORM in the key: a two-part, blended or normed GEMM tunes apart from a plain one of the same shape;
# INPUT_PRECISION: IEEE and TF32 fp32 products tune (and prune) apart.
# The statistics workspace and counters (OUT_STATS) accumulate across a launch's programs: the autotuner zeroes them
# before each benchmark launch and the one after tuning; without statistics they are empty tensors, never an input.
_linear_fwd_tuned = autotune(
    configs=gemm_configs(LINEAR_TILES, LINEAR_TILES_FP32),
    key=["M_BUCKET", "N", "K", "K2", "BLEND", "NORM", "OUT_STATS", "INPUT_PRECISION"],
    reset_to_zero=["ws_ptr", "counter_ptr"],
    prune_configs_by={"early_config_prune": _prune_linear},
)(_linear_fwd_kernel)
#: The smallest row tile of any config: the statistics' counters are allocated for it.
_MIN_BLOCK_M = min(config.kwargs["BLOCK_M"] for config in _linear_fwd_tuned.configs)


@triton.jit
def _linear_bwd_kernel(
    dz_ptr,  # [M, N] contiguous: gradient of the pre-activation z = x W^T + bias
    part_db_ptr,  # [B * n_chunks, N] fp32: per-chunk column sums of dz
    part_dg_ptr,  # [B * n_chunks, N] fp32: per-chunk column sums of dy * act(z)
    dy_ptr,
    pre_ptr,  # [M, N] contiguous z (read when HAS_PRE)
    gate_ptr,  # [B, N]
    stride_dym,
    stride_dyn,
    stride_gb,
    stride_gn,
    N,
    T,
    ROWS_PER_PROG,
    n_chunks,
    n_nblocks,
    ACTIVATION: tl.constexpr,
    ACTIVATION_GRAD: tl.constexpr,
    HAS_PRE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    NEED_DGATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program: columns [BLOCK_N] of rows [t_begin, t_end) of one sample, so gate[b] is a [BLOCK_N] vector.
    pid = tl.program_id(0)
    pid_n = pid % n_nblocks
    chunk = (pid // n_nblocks) % n_chunks
    sample = (pid // (n_nblocks * n_chunks)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)  # a column stride times N can pass 2^31
    n_ok = rn < N
    if HAS_GATE:
        g = tl.load(gate_ptr + sample * stride_gb + rn64 * stride_gn, mask=n_ok, other=0.0).to(tl.float32)
    t_begin = chunk * ROWS_PER_PROG
    t_end = tl.minimum(t_begin + ROWS_PER_PROG, T)
    # Per-element sums, reduced across rows once after the loop (no barrier between one tile's loads and the next).
    sum_dz = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_dg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_M):
        t = t0 + tl.arange(0, BLOCK_M)
        mask = (t < t_end)[:, None] & n_ok[None, :]
        rows = sample * T + t.to(tl.int64)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + rn64[None, :] * stride_dyn, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        if HAS_PRE:
            z = tl.load(pre_ptr + rows[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            z = dy
        if NEED_DGATE:
            sum_dg += tl.where(mask, dy * ACTIVATION(z), 0.0)
        if HAS_GATE:
            dy = dy * g[None, :]
        dz = tl.where(mask, ACTIVATION_GRAD(z, dy), 0.0)
        sum_dz += dz
        tl.store(dz_ptr + rows[:, None] * N + rn[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
    out = (sample * n_chunks + chunk) * N + rn
    tl.store(part_db_ptr + out, tl.sum(sum_dz, axis=0), mask=n_ok)
    if NEED_DGATE:
        tl.store(part_dg_ptr + out, tl.sum(sum_dg, axis=0), mask=n_ok)


# ----------------------------------------------------------------------------------------------------------- launchers


def gate_residual_args(
    m: int, gate: torch.Tensor | None, residual: torch.Tensor | None
) -> tuple[tuple[int, int], tuple[int, int, int], int, int]:
    """What :func:`gated_residual` takes of gate [B, N] and residual [M, N] or [B', T', N] over M rows: (gate strides,
    residual strides as (per B' sample, per row, per column), rows per gate row T, residual rows per sample RES_T);
    zeros for an absent one."""
    gs = gate.stride() if gate is not None else (0, 0)
    if residual is None:
        res_t, rs = m, (0, 0, 0)
    elif residual.dim() == 2:
        res_t, rs = m, (0, *residual.stride())
    else:
        res_t, rs = residual.shape[1], residual.stride()
    return gs, rs, m // gate.shape[0] if gate is not None else m, max(res_t, 1)


def out_dtype(x: torch.Tensor, gate: torch.Tensor | None, residual: torch.Tensor | None) -> torch.dtype:
    """The output dtype of ``residual + gate * act(x W^T)`` under PyTorch's type promotion."""
    dtype = x.dtype
    for t in (gate, residual):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def linear_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
    save_pre: bool,
    dtype: torch.dtype | None = None,
    x_tail: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
    positions: tuple[torch.Tensor, int] | None = None,
    saturate: bool = False,
    out_stats: torch.Tensor | None = None,
    out_eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, pre): y = residual + gate[row // T] * act(x W^T + bias) as [M, N] in ``dtype``, by default the promoted
    dtype of x, gate and residual; pre = x W^T + bias (x's dtype) when save_pre, else an empty tensor. x [M, K],
    weight [N, K], gate [B, N] with M % B == 0, residual [M, N] or [B', T', N] (B' T' = M); any strides. With
    x_tail [M, K2] the input is [x | x_tail] and the weight [N, K + K2]; with mix [S] (fp32, M % S == 0) as well,
    x_tail is [M, K] and the input mix[row // (M / S)] * x + (1 - mix) * x_tail. With norm = (stats [2, M] fp32 mean
    and rstd, any strides, weight [K] or None, bias [K] or None) the input is x's rows LayerNorm'd in the loads, plus,
    with positions = (table [P, K] with unit column stride, rows per table row R), table[(m // R) % P]. saturate: y
    clamped to its dtype's finite range before the rounding (NaN kept). out_stats: a [2, M] fp32 tensor (unit column
    stride, row stride M) that receives y's rows' LayerNorm mean and rstd (``out_eps``), summed in the epilogue."""
    m, k = x.shape
    blend = mix is not None
    k2 = x_tail.shape[1] if x_tail is not None and not blend else 0
    x2s = x_tail.stride() if x_tail is not None else (0, 0)
    n = weight.shape[0]
    bias = None if bias is None else bias.contiguous()  # read with unit stride
    norm_pointers, norm_flags = norm_operands(norm, x)
    pos, pos_rows = positions if positions is not None else (None, 1)
    y = new_output((m, n), device=x.device, dtype=dtype or out_dtype(x, gate, residual))
    pre = new_output((m, n) if save_pre else (0,), device=x.device, dtype=weight.dtype)
    gs, rs, tokens, res_t = gate_residual_args(m, gate, residual)

    if out_stats is not None:
        ws, counters = row_stats_workspace(x.device, m, cdiv(m, _MIN_BLOCK_M))
    else:
        # Empty, so the autotuner's reset_to_zero has nothing to clear (never an input), and nothing to read.
        ws = counters = out_stats = pre if not save_pre else torch.empty(0, device=x.device)

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    tuned_launch(_linear_fwd_tuned)[grid](
        y, pre, x, weight, bias if bias is not None else x, gate if gate is not None else x,
        residual if residual is not None else x, x_tail if x_tail is not None else x,
        mix.contiguous() if blend else x, *norm_pointers, pos if pos is not None else x, ws, counters, out_stats,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), gs[0], gs[1], rs[0], rs[1], rs[2], x2s[0], x2s[1],
        pos.stride(0) if pos is not None else 0, m, n, k, k2, tokens, m // mix.shape[0] if blend else 1, res_t,
        pos_rows, pos.shape[0] if pos is not None else 1, torch.finfo(y.dtype).max, out_eps, m_bucket(m),
        ACTIVATION=ACTIVATIONS[activation][0], HAS_BIAS=bias is not None, HAS_GATE=gate is not None,
        HAS_RESIDUAL=residual is not None, RESIDUAL_3D=residual is not None and residual.dim() == 3,
        HAS_TAIL=x_tail is not None and not blend, BLEND=blend, **norm_flags, NORM_POS=pos is not None,
        STORE_PRE=save_pre, SATURATE=saturate, OUT_STATS=out_stats.numel() > 0,
        INT64_COLS=int64_columns(gate, residual),
        INPUT_PRECISION=input_precision(x.dtype),
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, pre


def linear_bwd(
    dy: torch.Tensor,
    pre: torch.Tensor | None,
    gate: torch.Tensor | None,
    activation: str | None,
    need_dgate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dz, dbias fp32 [N], dgate fp32 [B, N] or None) for y = residual + gate * act(z): dz = act'(z) * gate * dy in
    dy's dtype. dy [M, N] any strides; pre (z) [M, N] (read as contiguous: a strided one, which only a direct call of
    the op can pass, is copied), needed when activation is set or need_dgate."""
    m, n = dy.shape
    pre = None if pre is None else pre.contiguous()
    num_samples = gate.shape[0] if gate is not None else 1
    tokens = m // num_samples
    block_m, block_n = bwd_tiles(n)
    n_nblocks = cdiv(n, block_n)
    rows, n_chunks = row_chunks(num_samples, tokens, n_nblocks, block_m)
    dz = new_output((m, n), device=dy.device, dtype=dy.dtype)
    part_db = torch.empty((num_samples * n_chunks, n), device=dy.device, dtype=torch.float32)
    part_dg = torch.empty_like(part_db) if need_dgate else part_db
    gs = gate.stride() if gate is not None else (0, 0)
    act, act_grad = ACTIVATIONS[activation]
    _linear_bwd_kernel[(num_samples * n_chunks * n_nblocks,)](
        dz, part_db, part_dg, dy, pre if pre is not None else dy, gate if gate is not None else dy,
        dy.stride(0), dy.stride(1), gs[0], gs[1], n, tokens, rows, n_chunks, n_nblocks,
        ACTIVATION=act, ACTIVATION_GRAD=act_grad, HAS_PRE=pre is not None, HAS_GATE=gate is not None,
        NEED_DGATE=need_dgate, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_BWD_WARPS,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    dgate = part_dg.view(num_samples, n_chunks, n).sum(1) if need_dgate else None
    return dz, part_db.sum(0), dgate


def _fwd_spec(
    name, dtype, tile, activation, gate, residual, store_pre, residual_3d=False, tail=False, blend=False, norm=False,
    x_dtype=None, pos=False, saturate=False, out_stats=False,
):  # fmt: skip
    bm, bn, bk, warps, stages = tile
    signature = {
        "y_ptr": f"*{dtype}", "pre_ptr": f"*{dtype}", "x_ptr": f"*{x_dtype or dtype}", "w_ptr": f"*{dtype}",
        "b_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}",
        "mix_ptr": "*fp32", "stats_ptr": "*fp32", "norm_w_ptr": f"*{dtype}", "norm_b_ptr": f"*{dtype}",
        "pos_ptr": f"*{dtype}", "ws_ptr": "*fp64", "counter_ptr": "*i32", "out_stats_ptr": "*fp32",
        "stride_xm": "i32", "stride_xk": "i32", "stride_wn": "i32", "stride_wk": "i32",
        "stride_gb": "i32", "stride_gn": "i32", "stride_rb": "i32", "stride_rt": "i32", "stride_rn": "i32",
        "stride_x2m": "i32", "stride_x2k": "i32", "stride_pp": "i32", "M": "i32", "N": "i32", "K": "i32", "K2": "i32",
        "T": "i32",
        "T_MIX": "i32", "RES_T": "i32", "POS_ROWS": "i32", "POS_P": "i32", "sat_max": "fp32", "out_eps": "fp32",
        "M_BUCKET": "i32",
    }  # fmt: skip
    constexprs = {
        "stride_xk": 1, "stride_wk": 1, "stride_gn": 1, "stride_rn": 1, "stride_x2k": 1,
        "ACTIVATION": ACTIVATIONS[activation][0], "HAS_BIAS": True, "HAS_GATE": gate, "HAS_RESIDUAL": residual,
        "RESIDUAL_3D": residual_3d, "HAS_TAIL": tail, "BLEND": blend, "NORM": norm, "NORM_WEIGHT": norm,
        "NORM_BIAS": norm, "NORM_POS": pos, "STORE_PRE": store_pre, "SATURATE": saturate, "OUT_STATS": out_stats,
        "INT64_COLS": False,
        "INPUT_PRECISION": "tf32", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
    }  # fmt: skip
    skip = ("M", "T", "T_MIX", "RES_T", "POS_ROWS", "POS_P", "M_BUCKET")
    attrs = divisibility_attrs(_linear_fwd_kernel, signature, constexprs, skip=skip)
    return dict(name=name, fn=_linear_fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                num_warps=warps, num_stages=stages)  # fmt: skip


#: (label, _fwd_spec's positional arguments after the tile, keyword arguments): the heaviest fp32 epilogues.
FP32_EPILOGUES = (
    ("layer-normed x,gelu", ("gelu", False, False, True), {"norm": True}),
    ("gate+residual 3-D", (None, True, True, False, True), {}),
    ("residual+row stats", (None, False, True, False), {"out_stats": True}),
)


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    # Every autotune tile with the heaviest epilogue (GELU-tanh, pre-activation stored) in fp16.
    for tile in LINEAR_TILES:
        tag = "x".join(map(str, tile[:3])) + f"w{tile[3]}s{tile[4]}"
        specs.append(_fwd_spec(f"linear_fwd[fp16,gelu_tanh,{tag}]", "fp16", tile, "gelu_tanh", False, False, True))
    main = (128, 128, 64, 8, 3)
    specs.append(_fwd_spec("linear_fwd[bf16,gelu_tanh]", "bf16", main, "gelu_tanh", False, False, False))
    specs.append(_fwd_spec("linear_fwd[bf16,gate+residual]", "bf16", main, None, True, True, True))
    specs.append(_fwd_spec("linear_fwd[fp16,gelu,gate+residual]", "fp16", main, "gelu", True, True, True))
    # A UNet block's residual projections handing the next LayerNorm its statistics (atomics + arrival counter), on
    # every tile autotuning may pick.
    for tile in LINEAR_TILES:
        tag = "x".join(map(str, tile[:3])) + f"w{tile[3]}s{tile[4]}"
        specs.append(_fwd_spec(f"linear_fwd[fp16,residual+row stats,{tag}]", "fp16", tile, None, False, True, False,
                               out_stats=True))  # fmt: skip
    specs.append(_fwd_spec("linear_fwd[bf16,residual+row stats]", "bf16", main, None, False, True, False,
                           out_stats=True))  # fmt: skip
    specs.append(_fwd_spec("linear_fwd[fp16,gelu,gate+residual+row stats]", "fp16", main, "gelu", True, True, True,
                           out_stats=True))  # fmt: skip
    # An attention output projection's gated residual epilogue on a [B, T, N] residual of any strides.
    specs.append(_fwd_spec("linear_fwd[fp16,gate+residual 3-D]", "fp16", main, None, True, True, False, True))
    # Flux's single-stream proj_out: [attention | MLP] read in two parts, gated residual epilogue.
    specs.append(
        _fwd_spec("linear_fwd[bf16,two-part x,gate+residual]", "bf16", main, None, True, True, False, False, True)
    )
    specs.append(
        _fwd_spec("linear_fwd[fp16,two-part x,gelu_tanh]", "fp16", main, "gelu_tanh", False, False, True, False, True)
    )
    # The same in fp16 for inference, saturated as Flux clips its fp16 stream.
    specs.append(_fwd_spec("linear_fwd[fp16,two-part x,gate+residual,saturate]", "fp16", main, None, True, True, False,
                           False, True, saturate=True))  # fmt: skip
    # SVD's container proj_out: the AlphaBlender's two inputs mixed per frame in the loads, residual epilogue.
    for dtype, tile in (("fp16", main), ("bf16", (128, 64, 64, 4, 4))):
        specs.append(
            _fwd_spec(f"linear_fwd[{dtype},blended x,residual]", dtype, tile, None, False, True, False, blend=True)
        )
    # A LayerNorm read in the loads (UNet blocks' norm -> q/k/v projections, norm3 -> GELU feed-forward).
    for dtype, tile, act in (("fp16", main, None), ("bf16", main, "gelu"), ("fp16", (64, 128, 64, 4, 4), None)):
        tag = "x".join(map(str, tile[:3]))
        specs.append(_fwd_spec(f"linear_fwd[{dtype},layer-normed x,{act},{tag}]", dtype, tile, act, False, False,
                               act is not None, norm=True))  # fmt: skip
    # AnimateDiff's motion modules: sinusoidal positions (one table row per frame) added to the norm in the loads.
    specs.append(_fwd_spec("linear_fwd[fp16,layer-normed x + positions]", "fp16", main, None, False, False, False,
                           norm=True, pos=True))  # fmt: skip
    # Under autocast: an fp32 stream normalised and rounded to the fp16 weight's dtype in the loads; below sm_90 the
    # 128x128x64 tiles are pruned (prune_wide_input).
    for tile, archs in ((main, (90,)), ((128, 128, 32, 8, 4), (80, 90)), ((64, 128, 64, 4, 4), (80, 90))):
        tag = "x".join(map(str, tile[:3]))
        spec = _fwd_spec(f"linear_fwd[fp32 x,fp16 w,layer-normed x,{tag}]", "fp16", tile, None, False, False, False,
                         norm=True, x_dtype="fp32")  # fmt: skip
        specs.append({**spec, "archs": archs})
    # fp32 operands: every fp32 tile with its heaviest epilogues, at each (precision, arch) it is claimed clean for.
    for *tile, clean in LINEAR_TILES_FP32:
        tag = "x".join(map(str, tile[:3])) + f"w{tile[3]}s{tile[4]}"
        for precision in ("ieee", "tf32"):
            archs = fp32_archs(clean, precision)
            for label, args, extra in FP32_EPILOGUES:
                spec = _fwd_spec(f"linear_fwd[fp32 {precision},{label},{tag}]", "fp32", tuple(tile), *args, **extra)
                spec["constexprs"]["INPUT_PRECISION"] = precision
                specs.append({**spec, "archs": archs})
    block_m, block_n = bwd_tiles(4608)
    for dtype, act, gate in (("fp16", "gelu_tanh", False), ("bf16", None, True), ("fp16", "gelu", True)):
        signature = {
            "dz_ptr": f"*{dtype}", "part_db_ptr": "*fp32", "part_dg_ptr": "*fp32", "dy_ptr": f"*{dtype}",
            "pre_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "stride_dym": "i32", "stride_dyn": "i32",
            "stride_gb": "i32", "stride_gn": "i32", "N": "i32", "T": "i32", "ROWS_PER_PROG": "i32",
            "n_chunks": "i32", "n_nblocks": "i32",
        }  # fmt: skip
        constexprs = {
            "stride_dyn": 1, "stride_gn": 1, "ACTIVATION": ACTIVATIONS[act][0], "ACTIVATION_GRAD": ACTIVATIONS[act][1],
            "HAS_PRE": True, "HAS_GATE": gate, "NEED_DGATE": gate, "BLOCK_M": block_m, "BLOCK_N": block_n,
        }  # fmt: skip
        attrs = divisibility_attrs(_linear_bwd_kernel, signature, constexprs, skip=("T", "n_chunks", "n_nblocks"))
        specs.append(
            dict(name=f"linear_bwd[{dtype},{act},gate={gate}]", fn=_linear_bwd_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=_BWD_WARPS)
        )  # fmt: skip
    return specs
