"""adaLN modulation: ``s = x (+ residual)``, ``y = layer_norm(s) * (1 + scale[b]) + shift[b]`` (LayerNorm without
affine parameters), forward and backward, in one row kernel each.

Layout: x and residual are addressed as [M, C] rows with arbitrary strides (M = samples x tokens); scale and shift are
[B, C] with arbitrary strides, applied to row m through sample b = m // T (T = M / B). Outputs y (and the residual sum s
when asked) are fresh contiguous [M, C]; mean/rstd are fp32 [M]. fp32/fp16/bf16 in and out, statistics in fp32 over the
whole row held in registers (C <= MAX_C), int64 row offsets.
Algorithm: forward reads each row once (centred two-pass variance in registers). Backward, per chunk of rows of one
sample: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * (1 + scale[b]), plus per-chunk column sums of
dy (d shift) and dy * xhat (d scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new_output, next_power_of_2
from .linear import divisibility_attrs, row_chunks

#: Widest row a program holds in registers; wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192
# Elements per tile: 4K fp32 values keep each thread at 16 per live tensor with 8 warps.
_TILE = 4096


@triton.jit
def _adaln_fwd_kernel(
    y_ptr,  # [M, C] contiguous
    sum_ptr,  # [M, C] contiguous: x + residual, written when STORE_SUM
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    x_ptr,
    res_ptr,
    scale_ptr,  # [B, C]
    shift_ptr,  # [B, C]
    stride_xm,
    stride_xc,
    stride_rm,
    stride_rc,
    stride_scb,
    stride_scc,
    stride_shb,
    stride_shc,
    M,
    C,
    T,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
    STORE_STATS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    r_ok = rows < M
    c_ok = c < C
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + c[None, :] * stride_xc, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + c[None, :] * stride_rc, mask=mask, other=0.0)
        # Round the sum to the input dtype first, as the unfused `x + residual` does: the norm sees what is returned.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(sum_ptr + rows[:, None] * C + c[None, :], x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / C + eps)
    sample = rows // T
    sc = tl.load(scale_ptr + sample[:, None] * stride_scb + c[None, :] * stride_scc, mask=mask, other=0.0)
    sh = tl.load(shift_ptr + sample[:, None] * stride_shb + c[None, :] * stride_shc, mask=mask, other=0.0)
    y = centred * rstd[:, None] * (1.0 + sc.to(tl.float32)) + sh.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=r_ok)
        tl.store(rstd_ptr + rows, rstd, mask=r_ok)


@triton.jit
def _adaln_bwd_kernel(
    dx_ptr,  # [M, C] contiguous
    part_dscale_ptr,  # [B * n_chunks, C] fp32
    part_dshift_ptr,  # [B * n_chunks, C] fp32
    dy_ptr,
    s_ptr,  # the normalised input (x + residual) [M, C]
    dsum_ptr,  # gradient arriving at the returned residual sum [M, C] (HAS_DSUM)
    mean_ptr,
    rstd_ptr,
    scale_ptr,
    stride_dym,
    stride_dyc,
    stride_sm,
    stride_sc,
    stride_dsm,
    stride_dsc,
    stride_scb,
    stride_scc,
    C,
    T,
    ROWS_PER_PROG,
    n_chunks,
    HAS_DSUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    sample = (pid // n_chunks).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    sc = tl.load(scale_ptr + sample * stride_scb + c * stride_scc, mask=c_ok, other=0.0).to(tl.float32)
    t_begin = chunk * ROWS_PER_PROG
    t_end = tl.minimum(t_begin + ROWS_PER_PROG, T)
    sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dyxhat = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_R):
        t = t0 + tl.arange(0, BLOCK_R)
        r_ok = t < t_end
        mask = r_ok[:, None] & c_ok[None, :]
        rows = sample * T + t.to(tl.int64)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + c[None, :] * stride_dyc, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        s = tl.load(s_ptr + rows[:, None] * stride_sm + c[None, :] * stride_sc, mask=mask, other=0.0)
        mean = tl.load(mean_ptr + rows, mask=r_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        xhat = tl.where(mask, (s.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        sum_dy += tl.sum(dy, axis=0)
        sum_dyxhat += tl.sum(dy * xhat, axis=0)
        g = dy * (1.0 + sc[None, :])
        c1 = tl.sum(g, axis=1) / C
        c2 = tl.sum(g * xhat, axis=1) / C
        dx = rstd[:, None] * (g - c1[:, None] - xhat * c2[:, None])
        if HAS_DSUM:
            ds = tl.load(dsum_ptr + rows[:, None] * stride_dsm + c[None, :] * stride_dsc, mask=mask, other=0.0)
            dx += ds.to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    out = (sample * n_chunks + chunk) * C + c
    tl.store(part_dscale_ptr + out, sum_dyxhat, mask=c_ok)
    tl.store(part_dshift_ptr + out, sum_dy, mask=c_ok)


# ----------------------------------------------------------------------------------------------------------- launchers


def tiles(c: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows, ~4K elements per tile, 16 fp32 values per thread at 4K."""
    block_c = next_power_of_2(c)
    block_r = max(1, min(16, _TILE // block_c))
    warps = max(1, min(16, block_r * block_c // 512))
    return block_r, block_c, warps


def adaln_fwd(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    residual: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, mean, rstd): s = x + residual ([M, C], empty unless store_sum), y = layer_norm(s) * (1 + scale[b]) +
    shift[b]; mean/rstd fp32 [M] (empty unless store_stats). x, residual [M, C]; scale, shift [B, C]; any strides."""
    m, c = x.shape
    tokens = m // scale.shape[0]
    block_r, block_c, warps = tiles(c)
    y = new_output((m, c), device=x.device, dtype=x.dtype)
    s = new_output((m, c) if store_sum else (0,), device=x.device, dtype=x.dtype)
    mean = new_output((m,) if store_stats else (0,), device=x.device, dtype=torch.float32)
    rstd = new_output((m,) if store_stats else (0,), device=x.device, dtype=torch.float32)
    rs = residual.stride() if residual is not None else (0, 0)
    _adaln_fwd_kernel[(triton.cdiv(m, block_r),)](
        y, s, mean, rstd, x, residual if residual is not None else x, scale, shift, x.stride(0), x.stride(1),
        rs[0], rs[1], scale.stride(0), scale.stride(1), shift.stride(0), shift.stride(1), m, c, tokens, eps,
        HAS_RESIDUAL=residual is not None, STORE_SUM=store_sum, STORE_STATS=store_stats, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return y, s, mean, rstd


def adaln_bwd(
    dy: torch.Tensor,
    s: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor,
    dsum: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, C] in s's dtype, dscale fp32 [B, C], dshift fp32 [B, C]); dx is also the residual's gradient. dsum is
    the gradient that reached the returned sum s (or None)."""
    m, c = s.shape
    num_samples = scale.shape[0]
    tokens = m // num_samples
    block_r, block_c, warps = tiles(c)
    rows, n_chunks = row_chunks(num_samples, tokens, 1, block_r)
    dx = new_output((m, c), device=s.device, dtype=s.dtype)
    part_dscale = torch.empty((num_samples * n_chunks, c), device=s.device, dtype=torch.float32)
    part_dshift = torch.empty_like(part_dscale)
    ds = dsum.stride() if dsum is not None else (0, 0)
    _adaln_bwd_kernel[(num_samples * n_chunks,)](
        dx, part_dscale, part_dshift, dy, s, dsum if dsum is not None else dy, mean, rstd, scale,
        dy.stride(0), dy.stride(1), s.stride(0), s.stride(1), ds[0], ds[1], scale.stride(0), scale.stride(1),
        c, tokens, rows, n_chunks, HAS_DSUM=dsum is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    dscale = part_dscale.view(num_samples, n_chunks, c).sum(1)
    dshift = part_dshift.view(num_samples, n_chunks, c).sum(1)
    return dx, dscale, dshift


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    # DiT/PixArt (1152), SD3 (1536), Flux (3072) and the widest supported row.
    for dtype, c, residual in (
        ("fp16", 1152, True),
        ("bf16", 1536, False),
        ("bf16", 3072, True),
        ("fp32", MAX_C, True),
    ):
        block_r, block_c, warps = tiles(c)
        signature = {
            "y_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
            "x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "scale_ptr": f"*{dtype}", "shift_ptr": f"*{dtype}",
            "stride_xm": "i32", "stride_xc": "i32", "stride_rm": "i32", "stride_rc": "i32", "stride_scb": "i32",
            "stride_scc": "i32", "stride_shb": "i32", "stride_shc": "i32", "M": "i32", "C": "i32", "T": "i32",
            "eps": "fp32",
        }  # fmt: skip
        constexprs = {
            "stride_xc": 1, "stride_rc": 1, "stride_scc": 1, "stride_shc": 1, "HAS_RESIDUAL": residual,
            "STORE_SUM": residual, "STORE_STATS": True, "BLOCK_R": block_r, "BLOCK_C": block_c,
        }  # fmt: skip
        attrs = divisibility_attrs(_adaln_fwd_kernel, signature, constexprs, skip=("M", "T"))
        specs.append(
            dict(name=f"adaln_fwd[{dtype},C={c},residual={residual}]", fn=_adaln_fwd_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
        signature = {
            "dx_ptr": f"*{dtype}", "part_dscale_ptr": "*fp32", "part_dshift_ptr": "*fp32", "dy_ptr": f"*{dtype}",
            "s_ptr": f"*{dtype}", "dsum_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
            "scale_ptr": f"*{dtype}", "stride_dym": "i32", "stride_dyc": "i32", "stride_sm": "i32", "stride_sc": "i32",
            "stride_dsm": "i32", "stride_dsc": "i32", "stride_scb": "i32", "stride_scc": "i32", "C": "i32",
            "T": "i32", "ROWS_PER_PROG": "i32", "n_chunks": "i32",
        }  # fmt: skip
        constexprs = {
            "stride_dyc": 1, "stride_sc": 1, "stride_dsc": 1, "stride_scc": 1, "HAS_DSUM": residual,
            "BLOCK_R": block_r, "BLOCK_C": block_c,
        }  # fmt: skip
        attrs = divisibility_attrs(_adaln_bwd_kernel, signature, constexprs, skip=("T", "n_chunks"))
        specs.append(
            dict(name=f"adaln_bwd[{dtype},C={c},dsum={residual}]", fn=_adaln_bwd_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
    return specs
