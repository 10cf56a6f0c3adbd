"""RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) [* weight] [+ bias]``, forward and backward, in one row kernel each.

Layout: x is addressed as [M, C] rows with arbitrary strides (M = all leading dims: tokens, or tokens x heads for a
per-head query/key norm); weight and bias are [C]. y is a fresh contiguous [M, C] in the caller's dtype; rstd fp32
[M]. Statistics and the affine in fp32 over the whole row held in registers (C <= MAX_C), one rounding of y,
int64 row offsets.
Backward, per chunk of rows: dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * weight, plus per-chunk column sums
of dy * xhat (d weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new_output, row_tiles
from .linear import divisibility_attrs

#: Widest row a program holds in registers; wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192


@triton.jit
def _rms_norm_fwd_kernel(
    y_ptr,  # [M, C] contiguous
    rstd_ptr,  # [M] fp32
    x_ptr,
    w_ptr,  # [C] (HAS_WEIGHT)
    b_ptr,  # [C] (HAS_BIAS)
    stride_xm,
    stride_xc,
    M,
    C,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c64 = c.to(tl.int64)  # a column stride (a channel of an NCHW tensor) times C can pass 2^31
    r_ok = rows < M
    c_ok = c < C
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + c64[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=r_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dx_ptr,  # [M, C] contiguous
    part_dw_ptr,  # [n_chunks, C] fp32 (HAS_WEIGHT)
    dy_ptr,
    x_ptr,
    rstd_ptr,
    w_ptr,
    stride_dym,
    stride_dyc,
    stride_xm,
    stride_xc,
    M,
    C,
    ROWS_PER_PROG,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    chunk = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    c64 = c.to(tl.int64)  # as in the forward
    c_ok = c < C
    if HAS_WEIGHT:
        w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    sum_dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    r_begin = chunk.to(tl.int64) * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_R):
        rows = r_begin + r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < M
        mask = r_ok[:, None] & c_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + c64[None, :] * stride_dyc, mask=mask, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + c64[None, :] * stride_xc, mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        dy = dy.to(tl.float32)
        xhat = x.to(tl.float32) * rstd[:, None]
        if HAS_WEIGHT:
            sum_dw += tl.sum(dy * xhat, axis=0)
            g = dy * w[None, :]
        else:
            g = dy
        dot = tl.sum(g * xhat, axis=1) / C
        dx = rstd[:, None] * (g - xhat * dot[:, None])
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(part_dw_ptr + chunk * C + c, sum_dw, mask=c_ok)


# ----------------------------------------------------------------------------------------------------------- launchers


def tiles(c: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows, at most 64 per tile."""
    return row_tiles(c, 64)


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
    store_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, C] in ``dtype``, rstd fp32 [M] or empty unless store_rstd). x [M, C] any strides; weight, bias [C]."""
    m, c = x.shape
    block_r, block_c, warps = tiles(c)
    y = new_output((m, c), device=x.device, dtype=dtype)
    rstd = new_output((m,) if store_rstd else (0,), device=x.device, dtype=torch.float32)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    _rms_norm_fwd_kernel[(triton.cdiv(m, block_r),)](
        y, rstd, x, weight if weight is not None else x, bias if bias is not None else x, x.stride(0), x.stride(1),
        m, c, eps, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, STORE_RSTD=store_rstd,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, C] in x's dtype, dweight fp32 [C] or empty without a weight). dy, x [M, C] any strides."""
    m, c = x.shape
    block_r, block_c, warps = tiles(c)
    # Enough programs to fill a GPU (a few per SM), each summing its d weight over a contiguous run of rows.
    chunks = max(1, min(triton.cdiv(m, block_r), 1024))
    rows = triton.cdiv(triton.cdiv(m, chunks), block_r) * block_r
    chunks = triton.cdiv(m, rows)
    dx = new_output((m, c), device=x.device, dtype=x.dtype)
    part_dw = torch.empty((chunks, c) if weight is not None else (0,), device=x.device, dtype=torch.float32)
    weight = weight.contiguous() if weight is not None else None
    _rms_norm_bwd_kernel[(chunks,)](
        dx, part_dw, dy, x, rstd, weight if weight is not None else x, dy.stride(0), dy.stride(1), x.stride(0),
        x.stride(1), m, c, rows, HAS_WEIGHT=weight is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    dw = part_dw.sum(0) if weight is not None else part_dw
    return dx, dw


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    # Flux/SD3 per-head query/key norms (128), Wan's across heads (1536, 5120), the widest supported row in fp32.
    for dtype, c, weight in (("bf16", 128, True), ("fp16", 1536, True), ("bf16", 5120, True), ("fp32", MAX_C, False)):
        block_r, block_c, warps = tiles(c)
        signature = {
            "y_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
            "b_ptr": f"*{dtype}", "stride_xm": "i32", "stride_xc": "i32", "M": "i32", "C": "i32", "eps": "fp32",
        }  # fmt: skip
        constexprs = {
            "stride_xc": 1, "HAS_WEIGHT": weight, "HAS_BIAS": False, "STORE_RSTD": True, "BLOCK_R": block_r,
            "BLOCK_C": block_c,
        }  # fmt: skip
        attrs = divisibility_attrs(_rms_norm_fwd_kernel, signature, constexprs, skip=("M",))
        specs.append(
            dict(name=f"rms_norm_fwd[{dtype},C={c},weight={weight}]", fn=_rms_norm_fwd_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
        signature = {
            "dx_ptr": f"*{dtype}", "part_dw_ptr": "*fp32", "dy_ptr": f"*{dtype}", "x_ptr": f"*{dtype}",
            "rstd_ptr": "*fp32", "w_ptr": f"*{dtype}", "stride_dym": "i32", "stride_dyc": "i32", "stride_xm": "i32",
            "stride_xc": "i32", "M": "i32", "C": "i32", "ROWS_PER_PROG": "i32",
        }  # fmt: skip
        constexprs = {"stride_dyc": 1, "stride_xc": 1, "HAS_WEIGHT": weight, "BLOCK_R": block_r, "BLOCK_C": block_c}
        attrs = divisibility_attrs(_rms_norm_bwd_kernel, signature, constexprs, skip=("M", "ROWS_PER_PROG"))
        specs.append(
            dict(name=f"rms_norm_bwd[{dtype},C={c},weight={weight}]", fn=_rms_norm_bwd_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
    return specs
