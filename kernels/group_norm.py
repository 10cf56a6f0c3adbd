"""GroupNorm (+ optional fused activation), forward, for NCHW / NHWC / 5-D tensors (backward: group_norm_bwd.py).

Layout: x is addressed as (N, C, S) with arbitrary strides, S = product of spatial dims (F*H*W), so one kernel
serves contiguous and channels-last inputs (Triton specialises the unit stride). Dtypes fp32/fp16/bf16 in and out;
statistics, mean/rstd and all accumulation in fp32; offsets in int64.
Algorithm: (1) per-(n, chunk, c) Welford partials over S-chunks (per-element accumulators in the loop, merged
across rows once at the end), (2) Chan-merge them per (n, group) into mean/rstd, (3) one elementwise pass
y = act(x * a + b) with a = w * rstd, b = bias - a * mean. Groups of at most _ONEPASS_MAX_GROUP elements take a single
launch instead: one program per (n, group) does both passes.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ._common import ACTIVATIONS, LAUNCH_OPTIONS, cdiv, new_output, next_power_of_2, variance_floor

# Programs to aim for in the statistics passes: enough to fill a large GPU several times over.
_TARGET_PROGRAMS = 1024
# Groups up to this many elements take the single-launch path (launch latency dominates there).
_ONEPASS_MAX_GROUP = 16384
# 2K-element tiles over 8 warps: 8 elements (16 bytes of fp16) per thread. Larger tiles made ptxas spill on sm_90.
_TILE_ELEMENTS = 2048
_TILE_WARPS = 8


@triton.jit
def _load_affine(w_ptr, b_ptr, c, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Per-channel weight and bias in fp32 (1 and 0 when absent), read in the parameters' own dtype."""
    if HAS_WEIGHT:
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full(c.shape, 1.0, tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(c.shape, tl.float32)
    return w, b


@triton.jit
def _channel_coefficients(
    mean_ptr, rstd_ptr, w_ptr, b_ptr, n, c, c_mask, C, G, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """Per channel of image n: (mean, rstd, weight, scale, shift) with z = x * scale + shift the affine output."""
    group = n * G + c // (C // G)
    mean = tl.load(mean_ptr + group, mask=c_mask, other=0.0)
    rstd = tl.load(rstd_ptr + group, mask=c_mask, other=0.0)
    w, b = _load_affine(w_ptr, b_ptr, c, c_mask, HAS_WEIGHT, HAS_BIAS)
    scale = w * rstd
    return mean, rstd, w, scale, b - scale * mean


@triton.jit
def _tile_index(n_cblocks, n_outer, C, BLOCK_C: tl.constexpr):
    """This program's (image n as int64, index along S (block or chunk), channels c, channel mask) on a 1-D grid of
    N x n_outer x n_cblocks programs, channels fastest."""
    pid = tl.program_id(0)
    outer = (pid // n_cblocks) % n_outer
    n = (pid // (n_cblocks * n_outer)).to(tl.int64)
    c = (pid % n_cblocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    return n, outer, c, c < C


@triton.jit
def _welford_step(mean, m2, x, mask, inv_count):
    """One more value per element of a [rows, cols] tile of running (mean, m2) accumulators, where mask; every
    element that takes a value this step has seen the same number of them, so 1 / count is one scalar. Per-element
    accumulators keep the loop free of cross-thread reductions (each costs shared-memory round trips and barriers
    between one tile's load and the next), and Welford's update stays exact for |mean| >> std, where the fp32 sum of
    squares would lose the variance (with x shifted near its mean first: see _first_row)."""
    delta = x - mean
    new_mean = mean + delta * inv_count
    new_m2 = m2 + delta * (x - new_mean)
    return tl.where(mask, new_mean, mean), tl.where(mask, new_m2, m2)


@triton.jit
def _merge_rows(mean, m2, row_count):
    """Per-column (mean, m2) of a [rows, cols] tile of per-element accumulators, row r having seen row_count[r]
    values (Chan et al.: the count-weighted mean, then each row's m2 plus its spread around that mean)."""
    total = tl.maximum(tl.sum(row_count, axis=0), 1.0)
    col_mean = tl.sum(mean * row_count[:, None], axis=0) / total
    d = mean - col_mean[None, :]
    col_m2 = tl.sum(m2 + d * d * row_count[:, None], axis=0)
    return col_mean, col_m2


@triton.jit
def _first_row(col_ptrs, row_offset, col_mask):
    """[1, cols] fp32: each column's first value, the shift its accumulators take values relative to: with
    |mean| >> std the running mean then holds the spread, not the mean's own fp32 rounding (ulp(1e3) = 6e-5)."""
    return tl.load(col_ptrs + row_offset, mask=col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _rows_seen(begin, end, BLOCK_S: tl.constexpr):
    """How many values row r of a BLOCK_S-row tile stepped over [begin, end) took: ceil((end - begin - r) / BLOCK_S)."""
    left = tl.maximum(end - begin - tl.arange(0, BLOCK_S), 0)
    return ((left + BLOCK_S - 1) // BLOCK_S).to(tl.float32)


@triton.jit
def _group_norm_fwd_partial_kernel(
    part_mean_ptr,  # [N, n_chunks, C_total] fp32
    part_m2_ptr,  # [N, n_chunks, C_total] fp32
    x_ptr,
    stride_xn,
    stride_xc,
    stride_xs,
    C,
    C_total,  # the partials' row: x's channels are [c_offset, c_offset + C) of a channel concatenation
    c_offset,
    S,
    S_PER_PROG,
    n_chunks,
    n_cblocks,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n, pid_chunk, c, c_mask = _tile_index(n_cblocks, n_chunks, C, BLOCK_C)
    s_begin = pid_chunk * S_PER_PROG
    s_end = tl.minimum(s_begin + S_PER_PROG, S)
    x_base = x_ptr + n * stride_xn + c[None, :].to(tl.int64) * stride_xc

    shift = _first_row(x_base, s_begin.to(tl.int64) * stride_xs, c_mask)  # past 2^31 elements per image
    mean = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    steps = 0.0
    for s0 in range(s_begin, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < s_end)[:, None] & c_mask[None, :]
        x = tl.load(x_base + s[:, None].to(tl.int64) * stride_xs, mask=mask, other=0.0).to(tl.float32)
        steps += 1.0
        mean, m2 = _welford_step(mean, m2, x - shift, mask, 1.0 / steps)
    mean, m2 = _merge_rows(mean, m2, _rows_seen(s_begin, s_end, BLOCK_S))
    mean += tl.reshape(shift, [BLOCK_C])
    out = (n * n_chunks + pid_chunk) * C_total + c_offset + c
    tl.store(part_mean_ptr + out, mean, mask=c_mask)
    tl.store(part_m2_ptr + out, m2, mask=c_mask)


@triton.jit
def _group_norm_fwd_finalize_kernel(
    mean_ptr,  # [N, G] fp32
    rstd_ptr,  # [N, G] fp32
    part_mean_ptr,
    part_m2_ptr,
    C,
    S,
    S_PER_PROG,
    n_chunks,
    G,
    eps,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)  # n * G + g
    n = (pid // G).to(tl.int64)
    g = pid % G
    cpg = C // G
    n_items = n_chunks * cpg
    base = n * n_chunks * C + g * cpg
    # Pass 1: the group's mean as the count-weighted mean of the partial means.
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for r0 in range(0, n_items, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = r < n_items
        chunk = r // cpg
        cnt = tl.minimum(S - chunk * S_PER_PROG, S_PER_PROG).to(tl.float32)
        pm = tl.load(part_mean_ptr + base + chunk * C + r % cpg, mask=mask, other=0.0)
        acc += tl.where(mask, pm * cnt, 0.0)
    total = tl.cast(S, tl.float32) * cpg  # S * cpg in int32 wraps for a group of 2^31 elements (G=1, a video map)
    group_mean = tl.sum(acc, axis=0) / total
    # Pass 2: M2 = sum of partial M2 + sum count * (partial mean - group mean)^2, less the residual's share: the
    # first mean rounds away from a constant group's value, whose spread would otherwise count as variance
    # (row_moments in _common.py: the same correction).
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    residual = tl.zeros([BLOCK_R], dtype=tl.float32)
    for r0 in range(0, n_items, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = r < n_items
        chunk = r // cpg
        cnt = tl.minimum(S - chunk * S_PER_PROG, S_PER_PROG).to(tl.float32)
        offs = base + chunk * C + r % cpg
        pm = tl.load(part_mean_ptr + offs, mask=mask, other=0.0)
        pm2 = tl.load(part_m2_ptr + offs, mask=mask, other=0.0)
        d = pm - group_mean
        acc += tl.where(mask, pm2 + cnt * d * d, 0.0)
        residual += tl.where(mask, cnt * d, 0.0)
    residual_sum = tl.sum(residual, axis=0)
    group_mean += residual_sum / total
    m2 = tl.sum(acc, axis=0) - residual_sum * (residual_sum / total)
    var = variance_floor(m2 / total)
    tl.store(mean_ptr + pid, group_mean)
    tl.store(rstd_ptr + pid, 1.0 / tl.sqrt(var + eps))


@triton.jit
def _group_norm_fwd_apply_kernel(
    y_ptr,
    x_ptr,
    w_ptr,  # [C] fp32
    b_ptr,  # [C] fp32
    mean_ptr,
    rstd_ptr,
    stride_xn,
    stride_xc,
    stride_xs,
    stride_yn,
    stride_yc,
    stride_ys,
    C,
    C_total,  # channels of the tensor whose groups mean/rstd describe: x is its channels [c_offset, c_offset + C)
    c_offset,
    S,
    G,
    n_sblocks,
    n_cblocks,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n, pid_s, c, c_mask = _tile_index(n_cblocks, n_sblocks, C, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (s < S)[:, None] & c_mask[None, :]
    _, _, _, scale, shift = _channel_coefficients(
        mean_ptr, rstd_ptr, w_ptr, b_ptr, n, c_offset + c, c_mask, C_total, G, HAS_WEIGHT, HAS_BIAS
    )
    s64 = s[:, None].to(tl.int64)
    c64 = c[None, :].to(tl.int64)
    x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    y = ACTIVATION(x * scale[None, :] + shift[None, :])
    tl.store(y_ptr + n * stride_yn + s64 * stride_ys + c64 * stride_yc, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_fwd_onepass_kernel(
    y_ptr,
    mean_ptr,
    rstd_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    stride_xn,
    stride_xc,
    stride_xs,
    stride_yn,
    stride_yc,
    stride_ys,
    S,
    G,
    eps,
    CPG: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CPG: tl.constexpr,
):
    # One program per (n, group) for small groups: statistics then the normalised output in a single launch
    # (the second read of the group hits L1/L2). The group size CPG is a compile-time constant so that the channel
    # mask is constant over aligned vectors: channels-last rows of 40 channels load as 16-byte vectors, not scalars.
    pid = tl.program_id(0)
    n = (pid // G).to(tl.int64)
    g = pid % G
    cpg = CPG
    j = tl.arange(0, BLOCK_CPG)
    j_mask = j < cpg
    c64 = (g * cpg + j)[None, :].to(tl.int64)
    x_base = x_ptr + n * stride_xn + c64 * stride_xc
    y_base = y_ptr + n * stride_yn + c64 * stride_yc
    shift = _first_row(x_base, 0, j_mask)
    mean = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    steps = 0.0
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < S)[:, None] & j_mask[None, :]
        x = tl.load(x_base + s[:, None].to(tl.int64) * stride_xs, mask=mask, other=0.0).to(tl.float32)
        steps += 1.0
        mean, m2 = _welford_step(mean, m2, x - shift, mask, 1.0 / steps)
    mean, m2 = _merge_rows(mean, m2, _rows_seen(0, S, BLOCK_S))
    mean += tl.reshape(shift, [BLOCK_CPG])
    # Every channel saw S values: the group mean is the mean of channel means.
    mean = tl.where(j_mask, mean, 0.0)
    first = tl.sum(mean, axis=0) / cpg
    d = tl.where(j_mask, mean - first, 0.0)
    residual = tl.sum(d, axis=0)  # the first mean's rounding (row_moments in _common.py)
    group_mean = first + residual / cpg
    spread = tl.sum(d * d, axis=0) - residual * (residual / cpg)
    var = variance_floor((tl.sum(m2, axis=0) + S * spread) / (S * cpg))
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + pid, group_mean)
    tl.store(rstd_ptr + pid, rstd)
    w, b = _load_affine(w_ptr, b_ptr, g * cpg + j, j_mask, HAS_WEIGHT, HAS_BIAS)
    scale = w * rstd
    shift = b - scale * group_mean
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < S)[:, None] & j_mask[None, :]
        s64 = s[:, None].to(tl.int64)
        x = tl.load(x_base + s64 * stride_xs, mask=mask, other=0.0).to(tl.float32)
        y = ACTIVATION(x * scale[None, :] + shift[None, :])
        tl.store(y_base + s64 * stride_ys, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------- launchers


def as_ncs(t: torch.Tensor) -> tuple[int, int, int, tuple[int, int, int]]:
    """(N, C, S, strides) of t viewed as (N, C, S); raises ValueError when its spatial dims do not flatten."""
    n, c = t.shape[:2]
    spatial = t.shape[2:]
    s = 1
    for d in spatial:
        s *= d
    # The flattened spatial axis needs one stride: every spatial dim must nest inside the next one. Size-1 dims
    # carry arbitrary strides (PyTorch ignores them for contiguity), so only the others count.
    dims = [i for i in range(2, t.dim()) if t.shape[i] > 1]
    for outer, inner in itertools.pairwise(dims):
        if t.stride(outer) != t.stride(inner) * t.shape[inner]:
            raise ValueError(f"spatial dims of a tensor with strides {t.stride()} do not flatten into one axis")
    s_stride = t.stride(dims[-1]) if dims else 1
    return n, c, s, (t.stride(0), t.stride(1), s_stride)


def _tiles(c: int, s: int, channels_contiguous: bool) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C): _TILE_ELEMENTS per tile, the contiguous axis widest."""
    if channels_contiguous:
        block_c = min(128, next_power_of_2(c))
        block_s = max(8, _TILE_ELEMENTS // block_c)
    else:
        # NCHW: 128 contiguous positions x 8 channels; 256 x 8 spilled in the sm_90 backward.
        block_s = min(128, max(16, next_power_of_2(s)))
        block_c = min(max(1, (_TILE_ELEMENTS // 2) // block_s), next_power_of_2(c))
    return block_s, block_c


def _chunks(n: int, n_cblocks: int, s: int, block_s: int) -> tuple[int, int]:
    """(S_PER_PROG, n_chunks) so that the statistics passes launch about _TARGET_PROGRAMS programs."""
    s_blocks = cdiv(s, block_s)
    want = max(1, min(s_blocks, cdiv(_TARGET_PROGRAMS, n * n_cblocks)))
    s_per_prog = cdiv(s_blocks, want) * block_s
    return s_per_prog, cdiv(s, s_per_prog)


def _affine_args(weight: torch.Tensor | None, bias: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """(w_ptr, b_ptr, HAS_WEIGHT, HAS_BIAS): absent parameters pass x as a never-read placeholder pointer."""
    w = x if weight is None else weight.contiguous()
    b = x if bias is None else bias.contiguous()
    return w, b, weight is not None, bias is not None


def group_norm_stats(
    x: torch.Tensor, num_groups: int, eps: float, x_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(n, group) mean and rstd, [N, G] fp32, of x viewed as (N, C, S) (the split statistics passes), or of
    ``cat([x, x_tail], 1)``: one partials pass per part into the same per-channel rows, so groups may straddle the
    parts and the concatenation is never written."""
    parts = [(t, *as_ncs(t)) for t in (x, x_tail) if t is not None]
    n, s = parts[0][1], parts[0][3]
    c = sum(p[2] for p in parts)
    tiles = [_tiles(pc, s, strides[1] == 1) for _, _, pc, _, strides in parts]
    n_cblocks = [cdiv(pc, block_c) for (_, _, pc, _, _), (_, block_c) in zip(parts, tiles)]
    s_per_prog, n_chunks = _chunks(n, sum(n_cblocks), s, max(block_s for block_s, _ in tiles))
    part_mean = torch.empty((n, n_chunks, c), device=x.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    c_offset = 0
    for (t, _, pc, _, (sxn, sxc, sxs)), (block_s, block_c), cblocks in zip(parts, tiles, n_cblocks):
        _group_norm_fwd_partial_kernel[(n * n_chunks * cblocks,)](
            part_mean, part_m2, t, sxn, sxc, sxs, pc, c, c_offset, s, s_per_prog, n_chunks, cblocks,
            BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_TILE_WARPS,
            **LAUNCH_OPTIONS,
        )  # fmt: skip
        c_offset += pc
    mean = new_output((n, num_groups), device=x.device, dtype=torch.float32)
    rstd = new_output((n, num_groups), device=x.device, dtype=torch.float32)
    block_r = min(1024, next_power_of_2(n_chunks * (c // num_groups)))
    _group_norm_fwd_finalize_kernel[(n * num_groups,)](
        mean, rstd, part_mean, part_m2, c, s, s_per_prog, n_chunks, num_groups, eps, BLOCK_R=block_r, num_warps=4,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return mean, rstd


def group_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    eps: float,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = act(group_norm(x)); returns (y, mean [N, G] fp32, rstd [N, G] fp32). y has x's strides."""
    n, c, s, (sxn, sxc, sxs) = as_ncs(x)
    y = new_output(like=x)
    _, _, _, (syn, syc, sys_) = as_ncs(y)
    w, b, has_w, has_b = _affine_args(weight, bias, x)
    act = ACTIVATIONS[activation][0]
    cpg = c // num_groups
    if cpg * s <= _ONEPASS_MAX_GROUP:
        mean = new_output((n, num_groups), device=x.device, dtype=torch.float32)
        rstd = new_output((n, num_groups), device=x.device, dtype=torch.float32)
        block_cpg = next_power_of_2(cpg)
        block_s = max(1, min(next_power_of_2(s), _TILE_ELEMENTS // block_cpg))
        _group_norm_fwd_onepass_kernel[(n * num_groups,)](
            y, mean, rstd, x, w, b, sxn, sxc, sxs, syn, syc, sys_, s, num_groups, eps, CPG=cpg,
            HAS_WEIGHT=has_w, HAS_BIAS=has_b, ACTIVATION=act, BLOCK_S=block_s, BLOCK_CPG=block_cpg,
            num_warps=_TILE_WARPS,
            **LAUNCH_OPTIONS,
        )  # fmt: skip
        return y, mean, rstd
    mean, rstd = group_norm_stats(x, num_groups, eps)
    group_norm_apply(y, x, mean, rstd, weight, bias, num_groups, activation)
    return y, mean, rstd


def group_norm_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_groups: int,
    activation: str | None,
    c_offset: int = 0,
    c_total: int | None = None,
) -> torch.Tensor:
    """y = act((x - mean) * rstd * weight + bias) with given per-(n, group) mean/rstd [N, G] fp32, one launch.

    ``c_offset``, ``c_total``: x holds channels [c_offset, c_offset + C) of a tensor of c_total channels (one part of
    a channel concatenation), whose groups mean/rstd describe and whose channels weight/bias index; y is x's part of
    the output."""
    n, c, s, (sxn, sxc, sxs) = as_ncs(x)
    _, _, _, (syn, syc, sys_) = as_ncs(y)
    w, b, has_w, has_b = _affine_args(weight, bias, x)
    c_total = c if c_total is None else c_total
    mean, rstd = mean.contiguous(), rstd.contiguous()  # read as [N, G] rows (caller-given statistics may be views)
    block_s, block_c = _tiles(c, s, sxc == 1)
    n_cblocks = cdiv(c, block_c)
    n_sblocks = cdiv(s, block_s)
    _group_norm_fwd_apply_kernel[(n * n_sblocks * n_cblocks,)](
        y, x, w, b, mean, rstd, sxn, sxc, sxs, syn, syc, sys_, c, c_total, c_offset, s, num_groups, n_sblocks,
        n_cblocks, HAS_WEIGHT=has_w, HAS_BIAS=has_b, ACTIVATION=ACTIVATIONS[activation][0], BLOCK_S=block_s,
        BLOCK_C=block_c, num_warps=_TILE_WARPS,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y


def _strides(prefix: str, unit: str) -> tuple[dict, dict]:
    """Signature entries for an (n, c, s) stride triple, and the constexpr pinning its unit stride."""
    sig = {f"stride_{prefix}n": "i64", f"stride_{prefix}c": "i64", f"stride_{prefix}s": "i64"}
    return sig, {f"stride_{prefix}{unit}": 1}


def _divisible_at_sd_shapes(specs: list[dict]) -> list[dict]:
    """Mark what Triton sees as multiples of 16 at Stable Diffusion shapes (pointers, strides, C, S, S_PER_PROG), so
    the gate compiles the vectorised variant that runs."""
    for spec in specs:
        spec["divisible_by_16"] = [
            name
            for name, ty in spec["signature"].items()
            if ty.startswith("*") or name.startswith("stride_") or name in ("C", "S", "S_PER_PROG")
        ]
        spec["divisible_by_16"] = [n for n in spec["divisible_by_16"] if n not in spec["constexprs"]]
    return specs


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    silu = ACTIVATIONS["silu"][0]
    # fp16 in both layouts covers the register/shared-memory shape of every kernel; bf16 and fp32 NHWC on top.
    for dtype, channels_last in (("fp16", True), ("fp16", False), ("bf16", True), ("fp32", True)):
        unit = "c" if channels_last else "s"
        tag = f"{dtype},{'nhwc' if channels_last else 'nchw'}"
        block_s, block_c = _tiles(320, 4096, channels_last)
        tile = {"BLOCK_S": block_s, "BLOCK_C": block_c}
        affine = {"HAS_WEIGHT": True, "HAS_BIAS": True}
        params = {"w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
        (xs, x1), (ys, y1) = _strides("x", unit), _strides("y", unit)
        specs += [
            dict(
                name=f"group_norm_fwd_partial[{tag}]",
                fn=_group_norm_fwd_partial_kernel,
                signature={"part_mean_ptr": "*fp32", "part_m2_ptr": "*fp32", "x_ptr": f"*{dtype}", **xs, "C": "i32",
                           "C_total": "i32", "c_offset": "i32", "S": "i32", "S_PER_PROG": "i32", "n_chunks": "i32",
                           "n_cblocks": "i32"},
                constexprs={**x1, **tile},
            ),
            dict(
                name=f"group_norm_fwd_apply[{tag},silu]",
                fn=_group_norm_fwd_apply_kernel,
                signature={"y_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", **params, **xs, **ys, "C": "i32",
                           "C_total": "i32", "c_offset": "i32", "S": "i32", "G": "i32", "n_sblocks": "i32",
                           "n_cblocks": "i32"},
                constexprs={**x1, **y1, **affine, "ACTIVATION": silu, **tile},
            ),
            dict(
                name=f"group_norm_fwd_onepass[{tag},silu]",
                fn=_group_norm_fwd_onepass_kernel,
                signature={"y_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "x_ptr": f"*{dtype}",
                           "w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", **xs, **ys, "S": "i32", "G": "i32",
                           "eps": "fp32"},
                # SD's small levels: 1280 channels in 32 groups of 40, 8x8 or 16x16 pixels.
                constexprs={**x1, **y1, **affine, "ACTIVATION": silu, "CPG": 40, "BLOCK_S": 32, "BLOCK_CPG": 64},
            ),
        ]  # fmt: skip
    for spec in specs:
        spec["num_warps"] = _TILE_WARPS
    specs += [
        dict(
            name="group_norm_fwd_finalize",
            fn=_group_norm_fwd_finalize_kernel,
            signature={"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "part_mean_ptr": "*fp32", "part_m2_ptr": "*fp32",
                       "C": "i32", "S": "i32", "S_PER_PROG": "i32", "n_chunks": "i32", "G": "i32", "eps": "fp32"},
            constexprs={"BLOCK_R": 1024},
            num_warps=4,
        ),
    ]  # fmt: skip
    return _divisible_at_sd_shapes(specs)
