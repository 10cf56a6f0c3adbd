"""GEGLU (diffusers ``GEGLU``): ``y = (x Wh^T + bh) * gelu_erf(x Wg^T + bg)`` with ``W = [Wh; Wg]`` the [2I, K] weight
of ``GEGLU.proj`` (value rows [0, I), gate rows [I, 2I)), forward and the elementwise part of its backward.

Layout: x is addressed as [M, K] with arbitrary strides, the weight as [2I, K] with arbitrary strides, y is a fresh
contiguous [M, I]. fp32/fp16/bf16 in and out; fp32 accumulation; int64 offsets. With NORM the input is x's rows
LayerNorm'd in the loads from fp32 row statistics (diffusers' norm3 -> GEGLU feed-forward, the norm never written).
Algorithm: one GEMM with two fp32 accumulators sharing each x tile (one flat K loop, grouped tile order); the epilogue
writes I columns instead of the 2I-wide projection. When a backward pass will follow, the epilogue also stores the
pre-activation [h | g] (2I columns, what the unfused path keeps alive too) so backward is one elementwise pass:
dh = dy * gelu(g), dg = dy * h * gelu'(g), plus per-chunk column sums for d(bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FP32_CLEAN_EVERYWHERE,
    LAUNCH_OPTIONS,
    autotune,
    cdiv,
    fp32_archs,
    gelu_erf,
    gelu_erf_grad,
    layer_normed,
    new_output,
)
from ._gemm import (
    bwd_tiles,
    divisibility_attrs,
    gemm_configs,
    grouped_tile,
    input_precision,
    m_bucket,
    norm_operands,
    prune_by_arch,
    prune_operands,
    prune_wide_input,
    row_chunks,
)
from ._tuned_launch import tuned_launch

_BWD_WARPS = 8


@triton.jit
def _geglu_fwd_kernel(
    y_ptr,  # [M, I] contiguous
    pre_ptr,  # [M, 2I] contiguous: [h | g] with bias, written when STORE_PRE
    x_ptr,
    w_ptr,  # [2I, K]
    b_ptr,  # [2I]
    stats_ptr,  # [2, M] fp32 (NORM): the input rows' mean, then their rstd
    norm_w_ptr,  # [K] (NORM_WEIGHT)
    norm_b_ptr,  # [K] (NORM_BIAS)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    M,
    N,  # I, the output width
    K,
    M_BUCKET,  # autotune key only
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
    NORM_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
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
    x_ptrs = x_ptr + rows[:, None] * stride_xm + rk64[None, :] * stride_xk
    wh_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + rk64[:, None] * stride_wk
    wg_ptrs = w_ptr + (rn % N + N).to(tl.int64)[None, :] * stride_wn + rk64[:, None] * stride_wk
    x_step = tl.cast(BLOCK_K, tl.int64) * stride_xk  # int64: BLOCK_K times a huge column stride can pass 2^31
    w_step = tl.cast(BLOCK_K, tl.int64) * stride_wk
    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM:
        mean = tl.load(stats_ptr + rows)
        rstd = tl.load(stats_ptr + M + rows)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        wh = tl.load(wh_ptrs, mask=k_ok[:, None], other=0.0)
        if NORM:  # rounded to the weight's dtype (x may be wider: an fp32 stream under autocast)
            a = layer_normed(a, mean, rstd, norm_w_ptr, norm_b_ptr, k0 + rk, k_ok, NORM_WEIGHT, NORM_BIAS).to(wh.dtype)
        wg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
        acc_h = tl.dot(a, wh, acc_h, input_precision=INPUT_PRECISION)
        acc_g = tl.dot(a, wg, acc_g, input_precision=INPUT_PRECISION)
        x_ptrs += x_step
        wh_ptrs += w_step
        wg_ptrs += w_step

    n_ok = rn < N
    mask = (rm < M)[:, None] & n_ok[None, :]
    rm64 = rm.to(tl.int64)
    if HAS_BIAS:
        acc_h += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if STORE_PRE:
        pre = pre_ptr + rm64[:, None] * (2 * N) + rn[None, :]
        tl.store(pre, acc_h.to(pre_ptr.dtype.element_ty), mask=mask)
        tl.store(pre + N, acc_g.to(pre_ptr.dtype.element_ty), mask=mask)
    y = acc_h * gelu_erf(acc_g)
    tl.store(y_ptr + rm64[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# Both accumulators live in registers: a 128x128 tile holds 2 x 64 fp32 values per thread at 8 warps, which fits with
# wgmma (sm_90) but spills 120 B with mma.sync (sm_80, at 8 or 16 warps), so those tiles are sm_90-only.
GEGLU_TILES = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, lowest compute capability)
    (128, 128, 64, 8, 3, 90),
    (128, 128, 32, 8, 4, 90),
    (128, 64, 64, 8, 4, 80),
    (64, 128, 64, 8, 3, 80),
    (128, 64, 32, 8, 4, 80),
    (64, 64, 64, 4, 4, 80),
]


# fp32 operands: two fp32 accumulators plus IEEE (CUDA-core) products leave sm_80 a single clean tile; the 16-bit
# 128x128x64 tile spills 14 KB per thread there on sm_90.
GEGLU_TILES_FP32 = [
    (128, 64, 32, 8, 3, {("tf32", 80), ("ieee", 90), ("tf32", 90)}),
    (64, 128, 32, 8, 3, {("tf32", 80), ("ieee", 90), ("tf32", 90)}),
    (64, 64, 32, 8, 3, FP32_CLEAN_EVERYWHERE),
]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    # Two accumulators leave no room for fp32 A tiles (an fp32 stream under autocast) at 128x128x64 on any arch.
    configs = prune_by_arch(prune_operands(configs, named_args, **kwargs), named_args)
    return prune_wide_input(configs, named_args, below_major=100)


_geglu_fwd_tuned = autotune(
    configs=gemm_configs(GEGLU_TILES, GEGLU_TILES_FP32),
    key=["M_BUCKET", "N", "K", "NORM", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": _prune},
)(_geglu_fwd_kernel)


@triton.jit
def _geglu_bwd_kernel(
    dpre_ptr,  # [M, 2I] contiguous: [dh | dg]
    part_db_ptr,  # [n_chunks, 2I] fp32: per-chunk column sums of [dh | dg]
    dy_ptr,
    pre_ptr,  # [M, 2I] contiguous [h | g]
    stride_dym,
    stride_dyn,
    M,
    N,  # I
    ROWS_PER_PROG,
    n_nblocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid % n_nblocks
    chunk = pid // n_nblocks
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)  # a column stride times N can pass 2^31
    n_ok = rn < N
    m_begin = chunk * ROWS_PER_PROG
    m_end = tl.minimum(m_begin + ROWS_PER_PROG, M)
    sum_dh = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_dg = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(m_begin, m_end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < m_end)[:, None] & n_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + rn64[None, :] * stride_dyn, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        pre = pre_ptr + rows[:, None] * (2 * N) + rn[None, :]
        h = tl.load(pre, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(pre + N, mask=mask, other=0.0).to(tl.float32)
        dh = tl.where(mask, dy * gelu_erf(g), 0.0)
        dg = tl.where(mask, gelu_erf_grad(g, dy * h), 0.0)
        out = dpre_ptr + rows[:, None] * (2 * N) + rn[None, :]
        tl.store(out, dh.to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(out + N, dg.to(dpre_ptr.dtype.element_ty), mask=mask)
        sum_dh += tl.sum(dh, axis=0)
        sum_dg += tl.sum(dg, axis=0)
    part = part_db_ptr + chunk.to(tl.int64) * (2 * N) + rn
    tl.store(part, sum_dh, mask=n_ok)
    tl.store(part + N, sum_dg, mask=n_ok)


# ----------------------------------------------------------------------------------------------------------- launchers


def geglu_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    save_pre: bool,
    norm: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, I], pre): y = (x Wh^T + bh) * gelu_erf(x Wg^T + bg); pre = [h | g] ([M, 2I]) when save_pre, else an
    empty tensor. x [M, K], weight [2I, K], bias [2I]; any strides. With norm = (stats [2, M] fp32 mean
    and rstd, any strides, weight [K] or None, bias [K] or None) the input is x's rows LayerNorm'd in the loads."""
    m, k = x.shape
    n = weight.shape[0] // 2
    bias = None if bias is None else bias.contiguous()  # read with unit stride
    norm_pointers, norm_flags = norm_operands(norm, x)
    y = new_output((m, n), device=x.device, dtype=weight.dtype)
    pre = new_output((m, 2 * n) if save_pre else (0,), device=x.device, dtype=weight.dtype)

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    tuned_launch(_geglu_fwd_tuned)[grid](
        y, pre, x, weight, bias if bias is not None else x, *norm_pointers, x.stride(0), x.stride(1), weight.stride(0),
        weight.stride(1), m, n, k, m_bucket(m), HAS_BIAS=bias is not None, **norm_flags, STORE_PRE=save_pre,
        INPUT_PRECISION=input_precision(x.dtype),
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, pre


def geglu_bwd(dy: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dpre [M, 2I] in dy's dtype, dbias fp32 [2I]) from dy [M, I] (any strides) and the saved pre [M, 2I] (read as
    contiguous: a strided one, which only a direct call of the op can pass, is copied)."""
    m, n = dy.shape
    pre = pre.contiguous()
    block_m, block_n = bwd_tiles(n)
    n_nblocks = cdiv(n, block_n)
    rows, n_chunks = row_chunks(1, m, n_nblocks, block_m)
    dpre = new_output((m, 2 * n), device=dy.device, dtype=dy.dtype)
    part_db = torch.empty((n_chunks, 2 * n), device=dy.device, dtype=torch.float32)
    _geglu_bwd_kernel[(n_chunks * n_nblocks,)](
        dpre, part_db, dy, pre, dy.stride(0), dy.stride(1), m, n, rows, n_nblocks,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_BWD_WARPS,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return dpre, part_db.sum(0)


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []

    def fwd(name, dtype, tile, store_pre, norm=False, x_dtype=None):
        bm, bn, bk, warps, stages, arch = tile
        signature = {
            "y_ptr": f"*{dtype}", "pre_ptr": f"*{dtype}", "x_ptr": f"*{x_dtype or dtype}",
            "w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "stats_ptr": "*fp32", "norm_w_ptr": f"*{dtype}",
            "norm_b_ptr": f"*{dtype}",
            "stride_xm": "i32", "stride_xk": "i32", "stride_wn": "i32", "stride_wk": "i32",
            "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32",
        }  # fmt: skip
        constexprs = {
            "stride_xk": 1, "stride_wk": 1, "HAS_BIAS": True, "NORM": norm, "NORM_WEIGHT": norm, "NORM_BIAS": norm,
            "STORE_PRE": store_pre, "INPUT_PRECISION": "tf32",
            "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
        }  # fmt: skip
        attrs = divisibility_attrs(_geglu_fwd_kernel, signature, constexprs, skip=("M", "M_BUCKET"))
        archs = tuple(a for a in (80, 90) if a >= arch)
        return dict(name=name, fn=_geglu_fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                    num_warps=warps, num_stages=stages, archs=archs)  # fmt: skip

    # Every autotune tile in fp16 with the pre-activation stored (the training path, the heavier epilogue).
    for tile in GEGLU_TILES:
        tag = "x".join(map(str, tile[:3])) + f"w{tile[3]}s{tile[4]}" + ("" if tile[5] <= 80 else f",sm{tile[5]}+")
        specs.append(fwd(f"geglu_fwd[fp16,train,{tag}]", "fp16", tile, True))
    for dtype in ("fp16", "bf16"):
        for tile in (GEGLU_TILES[0], GEGLU_TILES[2]):
            tag = "x".join(map(str, tile[:3])) + ("" if tile[5] <= 80 else f",sm{tile[5]}+")
            specs.append(fwd(f"geglu_fwd[{dtype},infer,{tag}]", dtype, tile, False))
    specs.append(fwd("geglu_fwd[bf16,train,128x128x64,sm90+]", "bf16", GEGLU_TILES[0], True))
    specs.append(fwd("geglu_fwd[bf16,train,128x64x64]", "bf16", GEGLU_TILES[2], True))
    # diffusers' norm3 LayerNorm'd in the loads (UNet feed-forwards), inference and training.
    for dtype, tile, train in (("fp16", GEGLU_TILES[0], False), ("fp16", GEGLU_TILES[2], True),
                               ("bf16", GEGLU_TILES[0], True), ("fp16", GEGLU_TILES[5], False)):  # fmt: skip
        tag = "x".join(map(str, tile[:3])) + ("" if tile[5] <= 80 else f",sm{tile[5]}+")
        specs.append(fwd(f"geglu_fwd[{dtype},layer-normed x,{'train' if train else 'infer'},{tag}]", dtype, tile,
                         train, norm=True))  # fmt: skip
    # Under autocast: an fp32 stream normalised and rounded to the fp16 weight's dtype (128x128x64 pruned: _prune).
    for tile in (GEGLU_TILES[1], GEGLU_TILES[2]):
        tag = "x".join(map(str, tile[:3])) + ("" if tile[5] <= 80 else f",sm{tile[5]}+")
        specs.append(fwd(f"geglu_fwd[fp32 x,fp16 w,layer-normed x,train,{tag}]", "fp16", tile, True, norm=True,
                         x_dtype="fp32"))  # fmt: skip
    # fp32 operands: every fp32 tile, layer-normed x and the pre-activation stored (the heaviest), at each
    # (precision, arch) it is claimed clean for.
    for *tile, clean in GEGLU_TILES_FP32:
        tag = "x".join(map(str, tile[:3]))
        for precision in ("ieee", "tf32"):
            spec = fwd(f"geglu_fwd[fp32 {precision},layer-normed x,train,{tag}]", "fp32", (*tile, 0), True, norm=True)
            spec["constexprs"]["INPUT_PRECISION"] = precision
            specs.append({**spec, "archs": fp32_archs(clean, precision)})
    block_m, block_n = bwd_tiles(1280)
    for dtype in ("fp16", "bf16"):
        signature = {
            "dpre_ptr": f"*{dtype}", "part_db_ptr": "*fp32", "dy_ptr": f"*{dtype}", "pre_ptr": f"*{dtype}",
            "stride_dym": "i32", "stride_dyn": "i32", "M": "i32", "N": "i32", "ROWS_PER_PROG": "i32",
            "n_nblocks": "i32",
        }  # fmt: skip
        constexprs = {"stride_dyn": 1, "BLOCK_M": block_m, "BLOCK_N": block_n}
        attrs = divisibility_attrs(_geglu_bwd_kernel, signature, constexprs, skip=("M", "n_nblocks"))
        specs.append(
            dict(name=f"geglu_bwd[{dtype}]", fn=_geglu_bwd_kernel, signature=signature, constexprs=constexprs,
                 attrs=attrs, num_warps=_BWD_WARPS)
        )  # fmt: skip
    return specs
