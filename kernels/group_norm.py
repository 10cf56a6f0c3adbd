"""GroupNorm (+ optional fused activation), forward and backward, for NCHW / NHWC / 5-D tensors.

Layout: x is addressed as (N, C, S) with arbitrary strides, S = product of spatial dims (F*H*W), so one kernel
serves contiguous and channels-last inputs (Triton specialises the unit stride). Dtypes fp32/fp16/bf16 in and out;
statistics, mean/rstd and all accumulation in fp32; offsets in int64.
Algorithm: (1) per-(n, chunk, c) Welford partials over S-chunks, (2) Chan-merge them per (n, group) into mean/rstd,
(3) one elementwise pass y = act(x * a + b) with a = w * rstd, b = bias - a * mean. Backward mirrors it: partial
sums of dz and dz * xhat, a per-group reduction, one elementwise pass for dx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ACTIVATIONS, new_output, next_power_of_2

# Programs to aim for in the statistics passes: enough to fill a large GPU several times over.
_TARGET_PROGRAMS = 1024
# Warps for the 4K-element tiles: 16 elements per thread keeps registers well under the 255 cap.
_TILE_WARPS = 8


@triton.jit
def _group_norm_fwd_partial_kernel(
    part_mean_ptr,  # [N, n_chunks, C] fp32
    part_m2_ptr,  # [N, n_chunks, C] fp32
    x_ptr,
    stride_xn,
    stride_xc,
    stride_xs,
    C,
    S,
    S_PER_PROG,
    n_chunks,
    n_cblocks,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_c = pid % n_cblocks
    pid_chunk = (pid // n_cblocks) % n_chunks
    n = (pid // (n_cblocks * n_chunks)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    s_begin = pid_chunk * S_PER_PROG
    s_end = tl.minimum(s_begin + S_PER_PROG, S)
    x_base = x_ptr + n * stride_xn

    count = tl.zeros([BLOCK_C], dtype=tl.float32)
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < s_end)[:, None] & c_mask[None, :]
        offs = s[:, None].to(tl.int64) * stride_xs + c[None, :].to(tl.int64) * stride_xc
        x = tl.load(x_base + offs, mask=mask, other=0.0).to(tl.float32)
        n_b = tl.minimum(s_end - s0, BLOCK_S).to(tl.float32)
        b_mean = tl.sum(x, axis=0) / n_b
        centred = tl.where(mask, x - b_mean[None, :], 0.0)
        b_m2 = tl.sum(centred * centred, axis=0)
        # Chan et al. merge of (count, mean, m2) with the block's statistics.
        total = count + n_b
        delta = b_mean - mean
        mean += delta * (n_b / total)
        m2 += b_m2 + delta * delta * (count * n_b / total)
        count = total
    out = (n * n_chunks + pid_chunk) * C + c
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
    total = (S * cpg).to(tl.float32)
    group_mean = tl.sum(acc, axis=0) / total
    # Pass 2: M2 = sum of partial M2 + sum count * (partial mean - group mean)^2.
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
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
    var = tl.maximum(tl.sum(acc, axis=0) / total, 0.0)
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
    S,
    G,
    n_sblocks,
    n_cblocks,
    ACTIVATION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_c = pid % n_cblocks
    pid_s = (pid // n_cblocks) % n_sblocks
    n = (pid // (n_cblocks * n_sblocks)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    c_mask = c < C
    mask = (s < S)[:, None] & c_mask[None, :]
    group = n * G + c // (C // G)
    mean = tl.load(mean_ptr + group, mask=c_mask, other=0.0)
    rstd = tl.load(rstd_ptr + group, mask=c_mask, other=0.0)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0)
    b = tl.load(b_ptr + c, mask=c_mask, other=0.0)
    scale = w * rstd
    shift = b - scale * mean
    s64 = s[:, None].to(tl.int64)
    c64 = c[None, :].to(tl.int64)
    x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    y = ACTIVATION(x * scale[None, :] + shift[None, :])
    tl.store(y_ptr + n * stride_yn + s64 * stride_ys + c64 * stride_yc, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_bwd_partial_kernel(
    part_dz_ptr,  # [N, n_chunks, C] fp32: sum of dz
    part_dzxhat_ptr,  # [N, n_chunks, C] fp32: sum of dz * xhat
    dy_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    stride_dyn,
    stride_dyc,
    stride_dys,
    stride_xn,
    stride_xc,
    stride_xs,
    C,
    S,
    G,
    S_PER_PROG,
    n_chunks,
    n_cblocks,
    ACTIVATION_GRAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_c = pid % n_cblocks
    pid_chunk = (pid // n_cblocks) % n_chunks
    n = (pid // (n_cblocks * n_chunks)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    group = n * G + c // (C // G)
    mean = tl.load(mean_ptr + group, mask=c_mask, other=0.0)
    rstd = tl.load(rstd_ptr + group, mask=c_mask, other=0.0)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0)
    b = tl.load(b_ptr + c, mask=c_mask, other=0.0)
    scale = w * rstd
    shift = b - scale * mean
    s_begin = pid_chunk * S_PER_PROG
    s_end = tl.minimum(s_begin + S_PER_PROG, S)
    c64 = c[None, :].to(tl.int64)
    sum_dz = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dzxhat = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < s_end)[:, None] & c_mask[None, :]
        s64 = s[:, None].to(tl.int64)
        x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + n * stride_dyn + s64 * stride_dys + c64 * stride_dyc, mask=mask, other=0.0)
        dz = ACTIVATION_GRAD(x * scale[None, :] + shift[None, :], dy.to(tl.float32))
        dz = tl.where(mask, dz, 0.0)
        xhat = (x - mean[None, :]) * rstd[None, :]
        sum_dz += tl.sum(dz, axis=0)
        sum_dzxhat += tl.sum(dz * xhat, axis=0)
    out = (n * n_chunks + pid_chunk) * C + c
    tl.store(part_dz_ptr + out, sum_dz, mask=c_mask)
    tl.store(part_dzxhat_ptr + out, sum_dzxhat, mask=c_mask)


@triton.jit
def _group_norm_bwd_finalize_kernel(
    dz_nc_ptr,  # [N, C] fp32: per-(n, c) sum of dz (-> grad bias)
    dzxhat_nc_ptr,  # [N, C] fp32: per-(n, c) sum of dz * xhat (-> grad weight)
    coef_ptr,  # [N, G, 2] fp32: sum_g w * dz, sum_g w * dz * xhat
    part_dz_ptr,
    part_dzxhat_ptr,
    w_ptr,
    C,
    G,
    n_chunks,
    BLOCK_CPG: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)  # n * G + g
    n = (pid // G).to(tl.int64)
    g = pid % G
    cpg = C // G
    j = tl.arange(0, BLOCK_CPG)
    j_mask = j < cpg
    c = g * cpg + j
    acc_dz = tl.zeros([BLOCK_K, BLOCK_CPG], dtype=tl.float32)
    acc_dzxhat = tl.zeros([BLOCK_K, BLOCK_CPG], dtype=tl.float32)
    for k0 in range(0, n_chunks, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (k < n_chunks)[:, None] & j_mask[None, :]
        offs = (n * n_chunks + k[:, None]) * C + c[None, :]
        acc_dz += tl.load(part_dz_ptr + offs, mask=mask, other=0.0)
        acc_dzxhat += tl.load(part_dzxhat_ptr + offs, mask=mask, other=0.0)
    dz_c = tl.sum(acc_dz, axis=0)
    dzxhat_c = tl.sum(acc_dzxhat, axis=0)
    tl.store(dz_nc_ptr + n * C + c, dz_c, mask=j_mask)
    tl.store(dzxhat_nc_ptr + n * C + c, dzxhat_c, mask=j_mask)
    w = tl.load(w_ptr + c, mask=j_mask, other=0.0)
    tl.store(coef_ptr + pid * 2, tl.sum(w * dz_c, axis=0))
    tl.store(coef_ptr + pid * 2 + 1, tl.sum(w * dzxhat_c, axis=0))


@triton.jit
def _group_norm_bwd_dx_kernel(
    dx_ptr,
    dy_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    coef_ptr,
    stride_dxn,
    stride_dxc,
    stride_dxs,
    stride_dyn,
    stride_dyc,
    stride_dys,
    stride_xn,
    stride_xc,
    stride_xs,
    C,
    S,
    G,
    n_sblocks,
    n_cblocks,
    ACTIVATION_GRAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_c = pid % n_cblocks
    pid_s = (pid // n_cblocks) % n_sblocks
    n = (pid // (n_cblocks * n_sblocks)).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    c_mask = c < C
    mask = (s < S)[:, None] & c_mask[None, :]
    cpg = C // G
    group = n * G + c // cpg
    mean = tl.load(mean_ptr + group, mask=c_mask, other=0.0)
    rstd = tl.load(rstd_ptr + group, mask=c_mask, other=0.0)
    sum_wdz = tl.load(coef_ptr + group * 2, mask=c_mask, other=0.0)
    sum_wdzxhat = tl.load(coef_ptr + group * 2 + 1, mask=c_mask, other=0.0)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0)
    b = tl.load(b_ptr + c, mask=c_mask, other=0.0)
    scale = w * rstd
    shift = b - scale * mean
    s64 = s[:, None].to(tl.int64)
    c64 = c[None, :].to(tl.int64)
    x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + n * stride_dyn + s64 * stride_dys + c64 * stride_dyc, mask=mask, other=0.0)
    dz = ACTIVATION_GRAD(x * scale[None, :] + shift[None, :], dy.to(tl.float32))
    xhat = (x - mean[None, :]) * rstd[None, :]
    inv_m = 1.0 / (cpg * S).to(tl.float32)
    dx = rstd[None, :] * (w[None, :] * dz - (sum_wdz[None, :] + xhat * sum_wdzxhat[None, :]) * inv_m)
    tl.store(dx_ptr + n * stride_dxn + s64 * stride_dxs + c64 * stride_dxc, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------- launchers


def as_ncs(t: torch.Tensor) -> tuple[int, int, int, tuple[int, int, int]]:
    """(N, C, S, strides) of t viewed as (N, C, S); raises ValueError when its spatial dims do not flatten."""
    n, c = t.shape[:2]
    spatial = t.shape[2:]
    s = 1
    for d in spatial:
        s *= d
    # The flattened spatial axis needs one stride: every spatial dim must nest inside the next one.
    for i in range(2, t.dim() - 1):
        if t.shape[i] > 1 and t.stride(i) != t.stride(i + 1) * t.shape[i + 1]:
            raise ValueError(f"spatial dims of a tensor with strides {t.stride()} do not flatten into one axis")
    s_stride = t.stride(-1) if t.dim() > 2 else 1
    return n, c, s, (t.stride(0), t.stride(1), s_stride)


def _tiles(c: int, s: int, channels_contiguous: bool) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C): ~4K elements per tile, the contiguous axis widest."""
    if channels_contiguous:
        block_c = min(128, next_power_of_2(c))
        block_s = max(16, 4096 // block_c)
    else:
        block_s = min(256, max(16, next_power_of_2(s)))
        block_c = max(1, 4096 // block_s)
        block_c = min(block_c, next_power_of_2(c))
    return block_s, block_c


def _chunks(n: int, n_cblocks: int, s: int, block_s: int) -> tuple[int, int]:
    """(S_PER_PROG, n_chunks) so that the statistics passes launch about _TARGET_PROGRAMS programs."""
    s_blocks = triton.cdiv(s, block_s)
    want = max(1, min(s_blocks, triton.cdiv(_TARGET_PROGRAMS, n * n_cblocks)))
    s_per_prog = triton.cdiv(s_blocks, want) * block_s
    return s_per_prog, triton.cdiv(s, s_per_prog)


def _affine(
    weight: torch.Tensor | None, bias: torch.Tensor | None, c: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.ones(c, device=device, dtype=torch.float32) if weight is None else weight.float().contiguous()
    b = torch.zeros(c, device=device, dtype=torch.float32) if bias is None else bias.float().contiguous()
    return w, b


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
    block_s, block_c = _tiles(c, s, sxc == 1)
    n_cblocks = triton.cdiv(c, block_c)
    s_per_prog, n_chunks = _chunks(n, n_cblocks, s, block_s)
    part_mean = torch.empty((n, n_chunks, c), device=x.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    _group_norm_fwd_partial_kernel[(n * n_chunks * n_cblocks,)](
        part_mean, part_m2, x, sxn, sxc, sxs, c, s, s_per_prog, n_chunks, n_cblocks,
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_TILE_WARPS,
    )  # fmt: skip
    mean = new_output((n, num_groups), device=x.device, dtype=torch.float32)
    rstd = new_output((n, num_groups), device=x.device, dtype=torch.float32)
    block_r = min(1024, next_power_of_2(n_chunks * (c // num_groups)))
    _group_norm_fwd_finalize_kernel[(n * num_groups,)](
        mean, rstd, part_mean, part_m2, c, s, s_per_prog, n_chunks, num_groups, eps, BLOCK_R=block_r, num_warps=4
    )
    w, b = _affine(weight, bias, c, x.device)
    n_sblocks = triton.cdiv(s, block_s)
    _group_norm_fwd_apply_kernel[(n * n_sblocks * n_cblocks,)](
        y, x, w, b, mean, rstd, sxn, sxc, sxs, syn, syc, sys_, c, s, num_groups, n_sblocks, n_cblocks,
        ACTIVATION=ACTIVATIONS[activation][0], BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_TILE_WARPS,
    )  # fmt: skip
    return y, mean, rstd


def group_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    num_groups: int,
    activation: str | None,
    need_affine_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) of y = act(group_norm(x)); dx has x's strides, dweight/dbias fp32 or None."""
    n, c, s, (sxn, sxc, sxs) = as_ncs(x)
    if dy.stride() != x.stride():
        dy = dy.contiguous(memory_format=_memory_format_of(x))
    _, _, _, (sdn, sdc, sds) = as_ncs(dy)
    dx = new_output(like=x)
    _, _, _, (sxgn, sxgc, sxgs) = as_ncs(dx)
    block_s, block_c = _tiles(c, s, sxc == 1)
    n_cblocks = triton.cdiv(c, block_c)
    s_per_prog, n_chunks = _chunks(n, n_cblocks, s, block_s)
    w, b = _affine(weight, bias, c, x.device)
    act_grad = ACTIVATIONS[activation][1]
    part_dz = torch.empty((n, n_chunks, c), device=x.device, dtype=torch.float32)
    part_dzxhat = torch.empty_like(part_dz)
    _group_norm_bwd_partial_kernel[(n * n_chunks * n_cblocks,)](
        part_dz, part_dzxhat, dy, x, w, b, mean, rstd, sdn, sdc, sds, sxn, sxc, sxs, c, s, num_groups,
        s_per_prog, n_chunks, n_cblocks, ACTIVATION_GRAD=act_grad, BLOCK_S=block_s, BLOCK_C=block_c,
        num_warps=_TILE_WARPS,
    )  # fmt: skip
    dz_nc = torch.empty((n, c), device=x.device, dtype=torch.float32)
    dzxhat_nc = torch.empty_like(dz_nc)
    coef = torch.empty((n, num_groups, 2), device=x.device, dtype=torch.float32)
    block_cpg = next_power_of_2(c // num_groups)
    block_k = max(1, min(next_power_of_2(n_chunks), 4096 // block_cpg))
    _group_norm_bwd_finalize_kernel[(n * num_groups,)](
        dz_nc, dzxhat_nc, coef, part_dz, part_dzxhat, w, c, num_groups, n_chunks,
        BLOCK_CPG=block_cpg, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    n_sblocks = triton.cdiv(s, block_s)
    _group_norm_bwd_dx_kernel[(n * n_sblocks * n_cblocks,)](
        dx, dy, x, w, b, mean, rstd, coef, sxgn, sxgc, sxgs, sdn, sdc, sds, sxn, sxc, sxs, c, s, num_groups,
        n_sblocks, n_cblocks, ACTIVATION_GRAD=act_grad, BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_TILE_WARPS,
    )  # fmt: skip
    if not need_affine_grads:
        return dx, None, None
    return dx, dzxhat_nc.sum(0), dz_nc.sum(0)


def _memory_format_of(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    # fp16 in both layouts covers the register/shared-memory shape of every kernel; bf16 and fp32 NHWC on top.
    for dtype, channels_last in (("fp16", True), ("fp16", False), ("bf16", True), ("fp32", True)):
        if True:
            block_s, block_c = _tiles(320, 4096, channels_last)
            xs = {"stride_xn": "i64", "stride_xc": "i64", "stride_xs": "i64"}
            unit = "stride_xc" if channels_last else "stride_xs"
            layout = "nhwc" if channels_last else "nchw"
            tile = {"BLOCK_S": block_s, "BLOCK_C": block_c}
            specs.append(
                dict(
                    name=f"group_norm_fwd_partial[{dtype},{layout}]",
                    fn=_group_norm_fwd_partial_kernel,
                    signature={"part_mean_ptr": "*fp32", "part_m2_ptr": "*fp32", "x_ptr": f"*{dtype}", **xs,
                               "C": "i32", "S": "i32", "S_PER_PROG": "i32", "n_chunks": "i32", "n_cblocks": "i32"},
                    constexprs={unit: 1, **tile},
                    num_warps=_TILE_WARPS,
                )
            )  # fmt: skip
            ys = {"stride_yn": "i64", "stride_yc": "i64", "stride_ys": "i64"}
            y_unit = "stride_yc" if channels_last else "stride_ys"
            for act in ("silu", None):
                specs.append(
                    dict(
                        name=f"group_norm_fwd_apply[{dtype},{layout},{act}]",
                        fn=_group_norm_fwd_apply_kernel,
                        signature={"y_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "w_ptr": "*fp32", "b_ptr": "*fp32",
                                   "mean_ptr": "*fp32", "rstd_ptr": "*fp32", **xs, **ys, "C": "i32", "S": "i32",
                                   "G": "i32", "n_sblocks": "i32", "n_cblocks": "i32"},
                        constexprs={unit: 1, y_unit: 1, "ACTIVATION": ACTIVATIONS[act][0], **tile},
                        num_warps=_TILE_WARPS,
                    )
                )  # fmt: skip
            dys = {"stride_dyn": "i64", "stride_dyc": "i64", "stride_dys": "i64"}
            dy_unit = "stride_dyc" if channels_last else "stride_dys"
            common = {"w_ptr": "*fp32", "b_ptr": "*fp32", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
            specs.append(
                dict(
                    name=f"group_norm_bwd_partial[{dtype},{layout},silu]",
                    fn=_group_norm_bwd_partial_kernel,
                    signature={"part_dz_ptr": "*fp32", "part_dzxhat_ptr": "*fp32", "dy_ptr": f"*{dtype}",
                               "x_ptr": f"*{dtype}", **common, **dys, **xs, "C": "i32", "S": "i32", "G": "i32",
                               "S_PER_PROG": "i32", "n_chunks": "i32", "n_cblocks": "i32"},
                    constexprs={unit: 1, dy_unit: 1, "ACTIVATION_GRAD": ACTIVATIONS["silu"][1], **tile},
                    num_warps=_TILE_WARPS,
                )
            )  # fmt: skip
            dxs = {"stride_dxn": "i64", "stride_dxc": "i64", "stride_dxs": "i64"}
            dx_unit = "stride_dxc" if channels_last else "stride_dxs"
            specs.append(
                dict(
                    name=f"group_norm_bwd_dx[{dtype},{layout},silu]",
                    fn=_group_norm_bwd_dx_kernel,
                    signature={"dx_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", **common,
                               "coef_ptr": "*fp32", **dxs, **dys, **xs, "C": "i32", "S": "i32", "G": "i32",
                               "n_sblocks": "i32", "n_cblocks": "i32"},
                    constexprs={unit: 1, dy_unit: 1, dx_unit: 1, "ACTIVATION_GRAD": ACTIVATIONS["silu"][1], **tile},
                    num_warps=_TILE_WARPS,
                )
            )  # fmt: skip
    specs.append(
        dict(
            name="group_norm_fwd_finalize",
            fn=_group_norm_fwd_finalize_kernel,
            signature={"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "part_mean_ptr": "*fp32", "part_m2_ptr": "*fp32",
                       "C": "i32", "S": "i32", "S_PER_PROG": "i32", "n_chunks": "i32", "G": "i32", "eps": "fp32"},
            constexprs={"BLOCK_R": 1024},
            num_warps=4,
        )
    )  # fmt: skip
    specs.append(
        dict(
            name="group_norm_bwd_finalize",
            fn=_group_norm_bwd_finalize_kernel,
            signature={"dz_nc_ptr": "*fp32", "dzxhat_nc_ptr": "*fp32", "coef_ptr": "*fp32", "part_dz_ptr": "*fp32",
                       "part_dzxhat_ptr": "*fp32", "w_ptr": "*fp32", "C": "i32", "G": "i32", "n_chunks": "i32"},
            constexprs={"BLOCK_CPG": 64, "BLOCK_K": 64},
            num_warps=4,
        )
    )  # fmt: skip
    return specs
