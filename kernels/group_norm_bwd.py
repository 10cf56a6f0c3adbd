"""GroupNorm (+ optional fused activation) backward for NCHW / NHWC / 5-D tensors (forward: group_norm.py).

Same (N, C, S) strided addressing as the forward; fp32 accumulation; int64 offsets. With z = x * a + b the
pre-activation and dz = act'(z) * dy: (1) per-(n, chunk, c) partial sums of dz and dz * xhat, (2) one program per
group: per image the sums of w * dz and w * dz * xhat, and over all images dweight/dbias, (3) one elementwise pass
dx = rstd * (w * dz - (sum(w dz) + xhat * sum(w dz xhat)) / M), M = elements per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ACTIVATIONS, LAUNCH_OPTIONS, cdiv, new_output, next_power_of_2
from .group_norm import (
    _TILE_WARPS,
    _affine_args,
    _channel_coefficients,
    _chunks,
    _divisible_at_sd_shapes,
    _load_affine,
    _strides,
    _tile_index,
    _tiles,
    as_ncs,
)

#: Elements of the finalize kernel's [images, chunks, channels of a group] tile of partial sums.
_FINALIZE_ELEMENTS = 4096


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
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION_GRAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n, pid_chunk, c, c_mask = _tile_index(n_cblocks, n_chunks, C, BLOCK_C)
    mean, rstd, _, scale, shift = _channel_coefficients(
        mean_ptr, rstd_ptr, w_ptr, b_ptr, n, c, c_mask, C, G, HAS_WEIGHT, HAS_BIAS
    )
    s_begin = pid_chunk * S_PER_PROG
    s_end = tl.minimum(s_begin + S_PER_PROG, S)
    c64 = c[None, :].to(tl.int64)
    # Per-element sums, reduced across rows once after the loop: a reduction per tile would put shared-memory
    # round trips and barriers between one tile's loads and the next.
    sum_dz = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    sum_dzxhat = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < s_end)[:, None] & c_mask[None, :]
        s64 = s[:, None].to(tl.int64)
        x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + n * stride_dyn + s64 * stride_dys + c64 * stride_dyc, mask=mask, other=0.0)
        dz = ACTIVATION_GRAD(x * scale[None, :] + shift[None, :], dy.to(tl.float32))
        dz = tl.where(mask, dz, 0.0)
        xhat = (x - mean[None, :]) * rstd[None, :]
        sum_dz += dz
        sum_dzxhat += dz * xhat
    out = (n * n_chunks + pid_chunk) * C + c
    tl.store(part_dz_ptr + out, tl.sum(sum_dz, axis=0), mask=c_mask)
    tl.store(part_dzxhat_ptr + out, tl.sum(sum_dzxhat, axis=0), mask=c_mask)


@triton.jit
def _group_norm_bwd_finalize_kernel(
    dweight_ptr,  # [C] fp32: sum over (n, s) of dz * xhat
    dbias_ptr,  # [C] fp32: sum over (n, s) of dz
    coef_ptr,  # [N, G, 2] fp32: sum_g w * dz, sum_g w * dz * xhat
    part_dz_ptr,
    part_dzxhat_ptr,
    w_ptr,
    N,
    C,
    G,
    n_chunks,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_CPG: tl.constexpr,
):
    # One program per group, over every image: the per-(n, c) sums give the group's coefficients per image and,
    # summed over the images here, the affine gradients (no separate reductions over N after the kernel).
    g = tl.program_id(0)
    cpg = C // G
    j = tl.arange(0, BLOCK_CPG)
    j_mask = j < cpg
    c = g * cpg + j
    w, _ = _load_affine(w_ptr, w_ptr, c, j_mask, HAS_WEIGHT, False)
    dweight = tl.zeros([BLOCK_CPG], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_CPG], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < N
        acc_dz = tl.zeros([BLOCK_N, BLOCK_K, BLOCK_CPG], dtype=tl.float32)
        acc_dzxhat = tl.zeros([BLOCK_N, BLOCK_K, BLOCK_CPG], dtype=tl.float32)
        for k0 in range(0, n_chunks, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = n_mask[:, None, None] & (k < n_chunks)[None, :, None] & j_mask[None, None, :]
            offs = (n.to(tl.int64)[:, None, None] * n_chunks + k[None, :, None]) * C + c[None, None, :]
            acc_dz += tl.load(part_dz_ptr + offs, mask=mask, other=0.0)
            acc_dzxhat += tl.load(part_dzxhat_ptr + offs, mask=mask, other=0.0)
        dz_c = tl.sum(acc_dz, axis=1)  # [BLOCK_N, BLOCK_CPG]: per-(n, c) sums
        dzxhat_c = tl.sum(acc_dzxhat, axis=1)
        coef = coef_ptr + (n * G + g) * 2
        tl.store(coef, tl.sum(w[None, :] * dz_c, axis=1), mask=n_mask)
        tl.store(coef + 1, tl.sum(w[None, :] * dzxhat_c, axis=1), mask=n_mask)
        dbias += tl.sum(dz_c, axis=0)
        dweight += tl.sum(dzxhat_c, axis=0)
    tl.store(dweight_ptr + c, dweight, mask=j_mask)
    tl.store(dbias_ptr + c, dbias, mask=j_mask)


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
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION_GRAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n, pid_s, c, c_mask = _tile_index(n_cblocks, n_sblocks, C, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = (s < S)[:, None] & c_mask[None, :]
    cpg = C // G
    group = n * G + c // cpg
    mean, rstd, w, scale, shift = _channel_coefficients(
        mean_ptr, rstd_ptr, w_ptr, b_ptr, n, c, c_mask, C, G, HAS_WEIGHT, HAS_BIAS
    )
    sum_wdz = tl.load(coef_ptr + group * 2, mask=c_mask, other=0.0)
    sum_wdzxhat = tl.load(coef_ptr + group * 2 + 1, mask=c_mask, other=0.0)
    s64 = s[:, None].to(tl.int64)
    c64 = c[None, :].to(tl.int64)
    x = tl.load(x_ptr + n * stride_xn + s64 * stride_xs + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + n * stride_dyn + s64 * stride_dys + c64 * stride_dyc, mask=mask, other=0.0)
    dz = ACTIVATION_GRAD(x * scale[None, :] + shift[None, :], dy.to(tl.float32))
    xhat = (x - mean[None, :]) * rstd[None, :]
    inv_m = 1.0 / (tl.cast(S, tl.float32) * cpg)  # cpg * S in int32 wraps for a group of 2^31 elements
    dx = rstd[None, :] * (w[None, :] * dz - (sum_wdz[None, :] + xhat * sum_wdzxhat[None, :]) * inv_m)
    tl.store(dx_ptr + n * stride_dxn + s64 * stride_dxs + c64 * stride_dxc, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------- launchers


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
    mean, rstd = mean.contiguous(), rstd.contiguous()  # read as [N, G] by index; caller-given statistics may be views
    if dy.stride() != x.stride():
        dy = dy.contiguous(memory_format=memory_format_of(x))
    _, _, _, (sdn, sdc, sds) = as_ncs(dy)
    dx = new_output(like=x)
    _, _, _, (sxgn, sxgc, sxgs) = as_ncs(dx)
    block_s, block_c = _tiles(c, s, sxc == 1)
    n_cblocks = cdiv(c, block_c)
    s_per_prog, n_chunks = _chunks(n, n_cblocks, s, block_s)
    w, b, has_w, has_b = _affine_args(weight, bias, x)
    act_grad = ACTIVATIONS[activation][1]
    part_dz = torch.empty((n, n_chunks, c), device=x.device, dtype=torch.float32)
    part_dzxhat = torch.empty_like(part_dz)
    _group_norm_bwd_partial_kernel[(n * n_chunks * n_cblocks,)](
        part_dz, part_dzxhat, dy, x, w, b, mean, rstd, sdn, sdc, sds, sxn, sxc, sxs, c, s, num_groups,
        s_per_prog, n_chunks, n_cblocks, HAS_WEIGHT=has_w, HAS_BIAS=has_b, ACTIVATION_GRAD=act_grad,
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=_TILE_WARPS,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    # Separate tensors, not rows of one: the custom op's outputs may not share storage.
    dweight = torch.empty((c,), device=x.device, dtype=torch.float32)
    dbias = torch.empty_like(dweight)
    coef = torch.empty((n, num_groups, 2), device=x.device, dtype=torch.float32)
    block_cpg = next_power_of_2(c // num_groups)
    block_k = max(1, min(next_power_of_2(n_chunks), _FINALIZE_ELEMENTS // block_cpg))
    block_n = max(1, min(next_power_of_2(n), _FINALIZE_ELEMENTS // (block_cpg * block_k)))
    _group_norm_bwd_finalize_kernel[(num_groups,)](
        dweight, dbias, coef, part_dz, part_dzxhat, w, n, c, num_groups, n_chunks,
        HAS_WEIGHT=has_w, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_CPG=block_cpg, num_warps=4,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    n_sblocks = cdiv(s, block_s)
    _group_norm_bwd_dx_kernel[(n * n_sblocks * n_cblocks,)](
        dx, dy, x, w, b, mean, rstd, coef, sxgn, sxgc, sxgs, sdn, sdc, sds, sxn, sxc, sxs, c, s, num_groups,
        n_sblocks, n_cblocks, HAS_WEIGHT=has_w, HAS_BIAS=has_b, ACTIVATION_GRAD=act_grad, BLOCK_S=block_s,
        BLOCK_C=block_c, num_warps=_TILE_WARPS,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    if not need_affine_grads:
        return dx, None, None
    return dx, dweight, dbias


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    silu_grad = ACTIVATIONS["silu"][1]
    for dtype, channels_last in (("fp16", True), ("fp16", False), ("bf16", True), ("fp32", True)):
        unit = "c" if channels_last else "s"
        tag = f"{dtype},{'nhwc' if channels_last else 'nchw'}"
        block_s, block_c = _tiles(320, 4096, channels_last)
        tile = {"BLOCK_S": block_s, "BLOCK_C": block_c}
        affine = {"HAS_WEIGHT": True, "HAS_BIAS": True}
        params = {"w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
        (xs, x1), (dys, dy1), (dxs, dx1) = (_strides(p, unit) for p in ("x", "dy", "dx"))
        sizes = {"C": "i32", "S": "i32", "G": "i32"}
        specs += [
            dict(
                name=f"group_norm_bwd_partial[{tag},silu]",
                fn=_group_norm_bwd_partial_kernel,
                signature={"part_dz_ptr": "*fp32", "part_dzxhat_ptr": "*fp32", "dy_ptr": f"*{dtype}",
                           "x_ptr": f"*{dtype}", **params, **dys, **xs, **sizes, "S_PER_PROG": "i32",
                           "n_chunks": "i32", "n_cblocks": "i32"},
                constexprs={**x1, **dy1, **affine, "ACTIVATION_GRAD": silu_grad, **tile},
                num_warps=_TILE_WARPS,
            ),
            dict(
                name=f"group_norm_bwd_dx[{tag},silu]",
                fn=_group_norm_bwd_dx_kernel,
                signature={"dx_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", **params,
                           "coef_ptr": "*fp32", **dxs, **dys, **xs, **sizes, "n_sblocks": "i32", "n_cblocks": "i32"},
                constexprs={**x1, **dy1, **dx1, **affine, "ACTIVATION_GRAD": silu_grad, **tile},
                num_warps=_TILE_WARPS,
            ),
        ]  # fmt: skip
    specs.append(
        dict(
            name="group_norm_bwd_finalize",
            fn=_group_norm_bwd_finalize_kernel,
            signature={"dweight_ptr": "*fp32", "dbias_ptr": "*fp32", "coef_ptr": "*fp32", "part_dz_ptr": "*fp32",
                       "part_dzxhat_ptr": "*fp32", "w_ptr": "*fp16", "N": "i32", "C": "i32", "G": "i32",
                       "n_chunks": "i32"},
            constexprs={"HAS_WEIGHT": True, "BLOCK_N": 2, "BLOCK_K": 32, "BLOCK_CPG": 64},
            num_warps=4,
        )
    )  # fmt: skip
    return _divisible_at_sd_shapes(specs)
