"""GEMM building blocks shared by the linear, GEGLU and LayerNorm -> linear kernels: autotune configs and their
pruning, the grouped tile order, the K loops (plain, blended, LayerNorm'd A), the row-statistics epilogue (also the
convolution's), and the sizing of the row-chunked backward passes and of the ahead-of-time specs (divisibility hints,
int64 column offsets)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldmopt._env import interpreter_enabled

from ._common import (
    cdiv,
    config_tag,
    fp32_dot_precision,
    layer_normed,
    next_power_of_2,
    prune_by_operand_width,
    tag_config,
    tag_fp32_configs,
    variance_floor,
)

# Programs to aim for in the backward elementwise passes (several waves on a large GPU).
_TARGET_PROGRAMS = 1024
# Elements per backward tile: 4K keeps every thread at 16 fp32 values per live tensor at 8 warps.
_BWD_TILE = 4096


def _interpreting() -> bool:
    return interpreter_enabled()


def gemm_configs(tiles: list[tuple[int, ...]], fp32_tiles: list[tuple] = ()) -> list[triton.Config]:
    """autotune configs from (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, lowest compute capability]) for
    16-bit operands and (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, {(precision, arch) where clean}) for fp32
    ones (prune_operands picks between them); one small config in the interpreter."""
    if _interpreting():
        tiles, fp32_tiles = [(32, 32, 32, 4, 1)], ()

    def config(bm, bn, bk, w, s, min_arch=0):
        made = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        return tag_config(made, min_arch=min_arch)

    fp32_configs = tag_fp32_configs([config(*tile[:5]) for tile in fp32_tiles], [tile[5] for tile in fp32_tiles])
    return [config(*tile) for tile in tiles] + fp32_configs


def prune_operands(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The tiles for the operands' width and tl.dot precision (prune_by_operand_width): fp32 tiles when x and the
    weight are both fp32 (a wider x is rounded to the weight's dtype in the loads)."""
    x, w = named_args["x_ptr"], named_args["w_ptr"]
    operand = w if w.element_size() < x.element_size() else x
    return prune_by_operand_width(configs, operand, kwargs.get("INPUT_PRECISION", "tf32"))


def prune_by_arch(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles that spill below their lowest compute capability (asked at tuning time, never at import)."""
    x = named_args["x_ptr"]
    if x.device.type != "cuda":
        return configs
    major, minor = torch.cuda.get_device_capability(x.device)
    kept = [c for c in configs if config_tag(c, "min_arch", 0) <= 10 * major + minor]
    return kept or configs


def prune_wide_input(
    configs: list[triton.Config], named_args: dict, below_major: int = 9, **kwargs
) -> list[triton.Config]:
    """Below compute capability ``below_major``.0, drop the 128x128x64 tiles when an fp32 input is rounded to a 16-bit
    weight's dtype in the loads (a LayerNorm'd stream under autocast): its fp32 A tiles spill there (asked at tuning
    time, never at import)."""
    x, w = named_args["x_ptr"], named_args["w_ptr"]
    if x.device.type != "cuda" or x.element_size() <= w.element_size():
        return configs
    if torch.cuda.get_device_capability(x.device)[0] >= below_major:
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] < 128 * 128 * 64]
    return kept or configs


def norm_operands(norm: tuple | None, placeholder: torch.Tensor) -> tuple[tuple, dict]:
    """The NORM kernel arguments (stats, weight, bias pointers; the weight and bias read with unit stride) and their
    constexpr flags for norm = (stats, weight or None, bias or None), or None; ``placeholder`` fills unused pointers."""
    stats, weight, bias = norm if norm is not None else (None, None, None)
    pointers = tuple(t.contiguous() if t is not None else placeholder for t in (stats, weight, bias))
    flags = dict(NORM=stats is not None, NORM_WEIGHT=weight is not None, NORM_BIAS=bias is not None)
    return pointers, flags


def m_bucket(m: int) -> int:
    """Autotune key for the row count: the next power of two, so every resolution does not re-tune."""
    return next_power_of_2(m)


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for fp32 operands, following torch's matmul setting ('highest' means no TF32)."""
    return fp32_dot_precision(dtype, "matmul")


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) with GROUP_M row tiles sweeping the same column tiles back to back (L2 reuse)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


def row_stats_workspace(device: torch.device, rows: int, row_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`row_statistics` accumulates into, zeroed: (ws [rows, 2] fp64 flat, counters [row_tiles] int32) in
    one fresh buffer (one memset), so no state outlives the call. ``row_tiles``: as many as the smallest row tile of
    any config makes."""
    buffer = torch.zeros(2 * rows + cdiv(row_tiles, 2), device=device, dtype=torch.float64)
    return buffer[: 2 * rows], buffer[2 * rows :].view(torch.int32)


@triton.jit
def row_statistics(out, mask, rows, row_ok, row_tile, col_tile, ws_ptr, counter_ptr, out_stats_ptr, M, N, eps,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Epilogue: the LayerNorm (mean, rstd) over all N columns of the stored rows ``rows`` (where ``row_ok``) of an
    [M, N] output, into out_stats [2, M] fp32. Each column tile adds its rows' centred sums in fp64 to ws [M, 2]
    (corrected two-pass within the tile, so a mean far above the spread keeps the variance); the last column tile of
    row tile ``row_tile`` to finish (arrival counter) turns the sums into statistics. ws and the counters start at
    zero (the launcher's fresh buffer). Used by the linear GEMM and the convolution (whose rows are pixels)."""
    v = tl.where(mask, out.to(tl.float32), 0.0)  # the values as stored, rounded
    cols = tl.minimum(N - col_tile * BLOCK_N, BLOCK_N).to(tl.float32)
    row_mean = tl.sum(v, axis=1) / cols
    d = tl.where(mask, v - row_mean[:, None], 0.0)
    residual = tl.sum(d, axis=1)
    row_m2 = tl.maximum(tl.sum(d * d, axis=1) - residual * residual / cols, 0.0)
    cols64 = cols.to(tl.float64)
    row_sum = row_mean.to(tl.float64) * cols64 + residual.to(tl.float64)
    row_sq = row_m2.to(tl.float64) + row_sum * (row_sum / cols64)
    rows64 = rows.to(tl.int64)
    ws_off = rows64 * 2
    tl.atomic_add(ws_ptr + ws_off, row_sum, mask=row_ok, sem="relaxed")
    tl.atomic_add(ws_ptr + ws_off + 1, row_sq, mask=row_ok, sem="relaxed")
    # Every thread's adds are ordered before the counter's release (CUTLASS semaphore pattern).
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + row_tile, 1, sem="acq_rel")
    if done == tl.cdiv(N, BLOCK_N) - 1:
        zero = tl.zeros_like(row_sum)
        # Atomic reads: the other tiles' relaxed adds live in L2.
        s1 = tl.atomic_add(ws_ptr + ws_off, zero, mask=row_ok, sem="relaxed")
        s2 = tl.atomic_add(ws_ptr + ws_off + 1, zero, mask=row_ok, sem="relaxed")
        n64 = tl.cast(N, tl.float64)
        mean = s1 / n64
        var = variance_floor(s2 / n64 - mean * mean)
        tl.store(out_stats_ptr + rows64, mean.to(tl.float32), mask=row_ok)
        tl.store(out_stats_ptr + M + rows64, 1.0 / tl.sqrt(var.to(tl.float32) + eps), mask=row_ok)


@triton.jit
def accumulate_k(
    acc, a_ptrs, b_ptrs, rk, K, stride_ak, stride_bk, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr
):
    """acc + A B over K: A tiles [BLOCK_M, BLOCK_K] at a_ptrs, B tiles [BLOCK_K, BLOCK_N] at b_ptrs; only the K tail is
    masked (rows and columns past the edge wrap onto valid ones)."""
    a_step = tl.cast(BLOCK_K, tl.int64) * stride_ak  # int64: BLOCK_K times a huge column stride can pass 2^31
    b_step = tl.cast(BLOCK_K, tl.int64) * stride_bk
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def accumulate_k_blend(
    acc, a_ptrs, a2_ptrs, mix, b_ptrs, rk, K, stride_ak, stride_a2k, stride_bk, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """accumulate_k of the per-row blend ``mix * A + (1 - mix) * A2`` (mix [BLOCK_M] fp32), formed in registers."""
    a_step = tl.cast(BLOCK_K, tl.int64) * stride_ak  # int64, as in accumulate_k
    a2_step = tl.cast(BLOCK_K, tl.int64) * stride_a2k
    b_step = tl.cast(BLOCK_K, tl.int64) * stride_bk
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        a2 = tl.load(a2_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        blended = mix[:, None] * a.to(tl.float32) + (1.0 - mix[:, None]) * a2  # exact at mix 0 and 1
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(blended.to(a.dtype), b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += a_step
        a2_ptrs += a2_step
        b_ptrs += b_step
    return acc


@triton.jit
def accumulate_k_normed(
    acc, a_ptrs, b_ptrs, mean, rstd, norm_w_ptr, norm_b_ptr, pos_ptr, pos_rows, rk, K, stride_ak, stride_bk,
    HAS_NORM_WEIGHT: tl.constexpr, HAS_NORM_BIAS: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """accumulate_k of the LayerNorm'd rows (layer_normed: fp32 statistics mean/rstd [BLOCK_M]), formed in registers
    and rounded to B's dtype (A may be wider: an fp32 stream under autocast)."""
    a_step = tl.cast(BLOCK_K, tl.int64) * stride_ak  # int64, as in accumulate_k
    b_step = tl.cast(BLOCK_K, tl.int64) * stride_bk
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        h = layer_normed(a, mean, rstd, norm_w_ptr, norm_b_ptr, k0 + rk, k_ok, HAS_NORM_WEIGHT, HAS_NORM_BIAS, pos_ptr,
                         pos_rows, HAS_POS)  # fmt: skip
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(h.to(b.dtype), b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


def bwd_tiles(n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the row-chunked backward passes: ~4K elements, columns widest."""
    block_n = min(256, next_power_of_2(n))
    return max(1, _BWD_TILE // block_n), block_n


def row_chunks(num_samples: int, tokens: int, n_nblocks: int, block_m: int) -> tuple[int, int]:
    """(ROWS_PER_PROG, n_chunks) so that a row-chunked pass launches about _TARGET_PROGRAMS programs."""
    blocks = cdiv(tokens, block_m)
    want = max(1, min(blocks, cdiv(_TARGET_PROGRAMS, num_samples * n_nblocks)))
    rows = cdiv(blocks, want) * block_m
    return rows, cdiv(tokens, rows)


def int64_columns(*tensors: torch.Tensor | None) -> bool:
    """Whether some tensor's column offsets (column index x column stride) reach 2^31: a column-strided view, e.g. an
    NCHW map read as [HW, C] (column stride HW) with C x HW >= 2^31. Kernels then form those offsets in int64
    (INT64_COLS); in int32 otherwise, exact there and lighter on registers. Row offsets are int64 always."""
    return any(t is not None and t.dim() and (t.shape[-1] - 1) * t.stride(-1) >= 2**31 for t in tensors)


def divisibility_attrs(fn, signature: dict, constexprs: dict, skip: tuple[str, ...] = ()) -> dict:
    """Triton's runtime hint "multiple of 16" on every pointer and integer argument not in ``skip``, as a launch with
    aligned tensors and sizes gets it: without it the compile has no vector loads and no cp.async pipelining."""
    return {
        (fn.arg_names.index(k),): [["tt.divisibility", 16]]
        for k, v in signature.items()
        if k not in constexprs and k not in skip and (v.startswith("*") or v.startswith("i"))
    }
