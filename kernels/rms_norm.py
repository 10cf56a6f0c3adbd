"""RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) [* weight] [+ bias]``, forward and backward, in one row kernel each,
optionally followed by a rotary position embedding of the normalised row (Wan's query/key norm + RoPE). With CENTER
the row is centred first: a LayerNorm, ``(x - mean) * rsqrt(var + eps)`` (CogVideoX's per-head query/key norms);
its statistics are then [2, M]: rstd, then mean.

Layout: x is addressed as [M, C] rows with arbitrary strides (M = all leading dims: tokens, or tokens x heads for a
per-head query/key norm); weight and bias are [C]. y is a fresh contiguous [M, C] in the caller's dtype; rstd fp32
[M] ([2, M] with CENTER). Statistics and the affine in fp32 over the whole row held in registers (C <= MAX_C), one
rounding of y, int64 row offsets.
Backward, per chunk of rows: dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * weight (CENTER: g - mean(g) in
place of g, the mean's gradient), plus per-chunk column sums of dy * xhat (d weight) and of dy (d bias, BIAS_GRAD),
dy being the rotated row's gradient turned back with RoPE.

RoPE (ROPE): ``y * cos + partner(y) * sin`` with partner(y) = (-y[2i+1], y[2i]) per pair: row r reads the cos/sin
tables [P, W] (any strides, fp16/bf16/fp32, read in fp32) at position (r // ROWS_PER_POS) % P (ROWS_PER_POS: heads
when each row is one head), column (c // COL_DIV) % W: COL_DIV 2 for one angle per pair (W = D/2, Wan), 1 for one
value per element (W = D, diffusers' "real" layout: Flux). The backward: dy * cos - partner(dy * sin), then the
norm's backward.

Two parts (TWO_PART, forward only): y is the normalised concatenation of two inputs along a dim before C, e.g. Flux's
text and image queries [B, T, H, D] and [B, S, H, D] -> [B, T + S, H, D], each part with its own weight (norm_added_q,
norm_q). Row r of y is row ``within`` of sample ``r // (HEAD_ROWS + TAIL_ROWS)`` with ``within = r % (HEAD_ROWS +
TAIL_ROWS)``: the head part's row (sample * HEAD_ROWS + within) while within < HEAD_ROWS, else the tail part's. The
concatenation is never written; the RoPE position of a row is its position in y.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, cdiv, new_output, row_moments, row_tiles
from ._gemm import divisibility_attrs

#: Widest row a program holds in registers; wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192


@triton.jit
def _partner(y, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(-y[2i+1], y[2i]) for each pair of a [BLOCK_R, BLOCK_C] tile, in y's register layout (no shared memory)."""
    even, odd = tl.split(tl.reshape(y, [BLOCK_R, BLOCK_C // 2, 2]))
    return tl.reshape(tl.join(-odd, even), [BLOCK_R, BLOCK_C])


@triton.jit
def _load_angles(cos_ptr, sin_ptr, rows, mask, stride_cp, stride_cd, stride_sp, stride_sd, P, ROWS_PER_POS, W,
                 COL_DIV, BLOCK_C: tl.constexpr):  # fmt: skip
    """fp32 (cos, sin) [rows, BLOCK_C]: each row's position, each column's table entry (see the module docstring)."""
    position = rows // ROWS_PER_POS % P
    column = tl.arange(0, BLOCK_C) // COL_DIV % W
    cos = tl.load(cos_ptr + position[:, None] * stride_cp + column[None, :] * stride_cd, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + position[:, None] * stride_sp + column[None, :] * stride_sd, mask=mask, other=0.0)
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _load_rows(x_ptr, x2_ptr, w_ptr, w2_ptr, rows, c, c64, mask, c_ok, stride_xm, stride_xc, stride_x2m, stride_x2c,
               HEAD_ROWS, TAIL_ROWS, HAS_WEIGHT: tl.constexpr, TWO_PART: tl.constexpr):  # fmt: skip
    """fp32 (x [rows, C], weight [rows or 1, C]): the rows of x, or of the two parts' concatenation."""
    w = 1.0  # no weight: the caller does not multiply
    if TWO_PART:
        within = rows % (HEAD_ROWS + TAIL_ROWS)
        sample = rows // (HEAD_ROWS + TAIL_ROWS)
        in_head = (within < HEAD_ROWS)[:, None]
        head_rows = sample * HEAD_ROWS + within
        tail_rows = sample * TAIL_ROWS + within - HEAD_ROWS  # negative (and masked off) for head rows
        x = tl.load(x_ptr + head_rows[:, None] * stride_xm + c64[None, :] * stride_xc, mask=mask & in_head, other=0.0)
        x2 = tl.load(x2_ptr + tail_rows[:, None] * stride_x2m + c64[None, :] * stride_x2c, mask=mask & ~in_head,
                     other=0.0)  # fmt: skip
        x = x.to(tl.float32) + x2.to(tl.float32)
        if HAS_WEIGHT:
            w_head = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            w_tail = tl.load(w2_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            w = tl.where(in_head, w_head, w_tail)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + c64[None, :] * stride_xc, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    return x, w


@triton.jit
def _rms_norm_fwd_kernel(
    y_ptr,  # [M, C] contiguous
    rstd_ptr,  # [M] fp32; [2, M] with CENTER (rstd, then mean)
    x_ptr,  # [M, C], or the head part's rows (TWO_PART)
    w_ptr,  # [C] (HAS_WEIGHT)
    b_ptr,  # [C] (HAS_BIAS)
    cos_ptr,  # [P, W] (ROPE)
    sin_ptr,  # [P, W] (ROPE)
    x2_ptr,  # the tail part's rows (TWO_PART)
    w2_ptr,  # [C]: the tail part's weight (TWO_PART and HAS_WEIGHT)
    stride_xm,
    stride_xc,
    stride_x2m,
    stride_x2c,
    stride_cp,
    stride_cd,
    stride_sp,
    stride_sd,
    M,
    C,
    P,
    ROWS_PER_POS,
    W,
    COL_DIV,
    HEAD_ROWS,  # rows per sample of the head part (TWO_PART)
    TAIL_ROWS,  # rows per sample of the tail part (TWO_PART)
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROPE: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    TWO_PART: tl.constexpr,
    CENTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c64 = c.to(tl.int64)  # a column stride (a channel of an NCHW tensor) times C can pass 2^31
    r_ok = rows < M
    c_ok = c < C
    mask = r_ok[:, None] & c_ok[None, :]
    x, w = _load_rows(x_ptr, x2_ptr, w_ptr, w2_ptr, rows, c, c64, mask, c_ok, stride_xm, stride_xc, stride_x2m,
                      stride_x2c, HEAD_ROWS, TAIL_ROWS, HAS_WEIGHT, TWO_PART)  # fmt: skip
    if CENTER:  # LayerNorm: the centred row (masked lanes stay 0)
        mean, var = row_moments(x, mask, C)
        x = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * w
    if HAS_BIAS:
        y = y + tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        cos, sin = _load_angles(cos_ptr, sin_ptr, rows, mask, stride_cp, stride_cd, stride_sp, stride_sd, P,
                                ROWS_PER_POS, W, COL_DIV, BLOCK_C)  # fmt: skip
        y = y * cos + _partner(y, BLOCK_R, BLOCK_C) * sin
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=r_ok)
        if CENTER:
            tl.store(rstd_ptr + M + rows, mean, mask=r_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dx_ptr,  # [M, C] contiguous
    part_dw_ptr,  # [n_chunks, C] fp32 (HAS_WEIGHT)
    part_db_ptr,  # [n_chunks, C] fp32 (BIAS_GRAD): column sums of the normalised row's gradient
    dy_ptr,
    x_ptr,
    rstd_ptr,
    w_ptr,
    cos_ptr,  # [P, W] (ROPE)
    sin_ptr,
    stride_dym,
    stride_dyc,
    stride_xm,
    stride_xc,
    stride_cp,
    stride_cd,
    stride_sp,
    stride_sd,
    M,
    C,
    P,
    ROWS_PER_POS,
    W,
    COL_DIV,
    ROWS_PER_PROG,
    HAS_WEIGHT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    ROPE: tl.constexpr,
    CENTER: tl.constexpr,
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
    sum_db = tl.zeros([BLOCK_C], dtype=tl.float32)
    r_begin = chunk.to(tl.int64) * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_R):
        rows = r_begin + r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < M
        mask = r_ok[:, None] & c_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + c64[None, :] * stride_dyc, mask=mask, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + c64[None, :] * stride_xc, mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        dy = dy.to(tl.float32)
        if ROPE:  # the gradient of the normalised row: dy turned back by the same angles
            cos, sin = _load_angles(cos_ptr, sin_ptr, rows, mask, stride_cp, stride_cd, stride_sp, stride_sd, P,
                                    ROWS_PER_POS, W, COL_DIV, BLOCK_C)  # fmt: skip
            dy = dy * cos - _partner(dy * sin, BLOCK_R, BLOCK_C)
        x = x.to(tl.float32)
        if CENTER:
            x = tl.where(mask, x - tl.load(rstd_ptr + M + rows, mask=r_ok, other=0.0)[:, None], 0.0)
        xhat = x * rstd[:, None]
        if BIAS_GRAD:
            sum_db += tl.sum(dy, axis=0)
        if HAS_WEIGHT:
            sum_dw += tl.sum(dy * xhat, axis=0)
            g = dy * w[None, :]
        else:
            g = dy
        dot = tl.sum(g * xhat, axis=1) / C
        if CENTER:  # LayerNorm: the mean's gradient too
            dx = rstd[:, None] * (g - tl.sum(g, axis=1)[:, None] / C - xhat * dot[:, None])
        else:
            dx = rstd[:, None] * (g - xhat * dot[:, None])
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(part_dw_ptr + chunk * C + c, sum_dw, mask=c_ok)
    if BIAS_GRAD:
        tl.store(part_db_ptr + chunk * C + c, sum_db, mask=c_ok)


# ----------------------------------------------------------------------------------------------------------- launchers


def tiles(c: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows, at most 64 per tile."""
    return row_tiles(c, 64)


class Rope(NamedTuple):
    """The rotary tables [P, W] and how rows and columns map onto them (see the module docstring)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rows_per_position: int = 1
    per_pair: bool = True  # W = D/2 (one angle per pair) rather than W = D (one value per element)


def _rope_args(rope: Rope | None, x: torch.Tensor) -> list:
    """(cos, sin, their 4 strides, P, ROWS_PER_POS, W, COL_DIV) for the kernels; placeholders without RoPE."""
    if rope is None:
        return [x, x, 0, 0, 0, 0, 1, 1, 1, 1]
    cos, sin, rows_per_position, per_pair = rope
    strides = [cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1)]
    return [cos, sin, *strides, cos.shape[0], rows_per_position, cos.shape[1], 2 if per_pair else 1]


class TailPart(NamedTuple):
    """The second part of a two-part input: its rows [M2, C] (any strides), its weight [C] (None when the head part
    has none), and the rows per sample of each part (HEAD_ROWS, TAIL_ROWS in the module docstring)."""

    x: torch.Tensor
    weight: torch.Tensor | None
    head_rows: int
    tail_rows: int


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
    store_rstd: bool,
    rope: Rope | None = None,
    tail: TailPart | None = None,
    center: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, C] in ``dtype``, rstd fp32 [M] ([2, M]: rstd, mean with center) or empty unless store_rstd). x [M, C]
    any strides; weight, bias [C]; rope: the tables and their mapping, applied to y; tail: a second part, y then
    normalising the concatenation (M = both parts' rows; no bias); center: a LayerNorm."""
    m, c = x.shape
    x2, w2, head_rows, tail_rows = tail if tail is not None else (x, None, 1, 1)
    if tail is not None:
        m += x2.shape[0]
    block_r, block_c, warps = tiles(c)
    y = new_output((m, c), device=x.device, dtype=dtype)
    rstd = new_output(((2, m) if center else (m,)) if store_rstd else (0,), device=x.device, dtype=torch.float32)
    weight = weight.contiguous() if weight is not None else None
    w2 = w2.contiguous() if w2 is not None else weight
    bias = bias.contiguous() if bias is not None else None
    cos, sin, *rope_ints = _rope_args(rope, x)
    _rms_norm_fwd_kernel[(cdiv(m, block_r),)](
        y, rstd, x, weight if weight is not None else x, bias if bias is not None else x, cos, sin, x2,
        w2 if w2 is not None else x, x.stride(0), x.stride(1), x2.stride(0), x2.stride(1), *rope_ints[:4], m, c,
        *rope_ints[4:], head_rows, tail_rows, eps, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        ROPE=rope is not None, STORE_RSTD=store_rstd, TWO_PART=tail is not None, CENTER=center, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    rope: Rope | None = None,
    center: bool = False,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, C] in x's dtype, dweight fp32 [C] or empty without a weight, dbias fp32 [C] or empty unless
    bias_grad). dy, x [M, C] any strides; rstd the forward's statistics ([2, M] with center)."""
    m, c = x.shape
    block_r, block_c, warps = tiles(c)
    # Enough programs to fill a GPU (a few per SM), each summing its d weight over a contiguous run of rows.
    chunks = max(1, min(cdiv(m, block_r), 1024))
    rows = cdiv(cdiv(m, chunks), block_r) * block_r
    chunks = cdiv(m, rows)
    dx = new_output((m, c), device=x.device, dtype=x.dtype)
    part_dw = torch.empty((chunks, c) if weight is not None else (0,), device=x.device, dtype=torch.float32)
    part_db = torch.empty((chunks, c) if bias_grad else (0,), device=x.device, dtype=torch.float32)
    weight = weight.contiguous() if weight is not None else None
    rstd = rstd.contiguous()  # read by row index (a caller's split of joint statistics may be a strided view)
    cos, sin, *rope_ints = _rope_args(rope, x)
    _rms_norm_bwd_kernel[(chunks,)](
        dx, part_dw, part_db, dy, x, rstd, weight if weight is not None else x, cos, sin, dy.stride(0), dy.stride(1),
        x.stride(0), x.stride(1), *rope_ints[:4], m, c, *rope_ints[4:], rows, HAS_WEIGHT=weight is not None,
        BIAS_GRAD=bias_grad, ROPE=rope is not None, CENTER=center, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    dw = part_dw.sum(0) if weight is not None else part_dw
    return dx, dw, part_db.sum(0) if bias_grad else part_db


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    rope_types = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "stride_cp": "i32", "stride_cd": "i32", "stride_sp": "i32",
                  "stride_sd": "i32", "P": "i32", "ROWS_PER_POS": "i32", "W": "i32", "COL_DIV": "i32"}  # fmt: skip
    # Not multiples of 16 in use: Wan's table views step 2 columns, COL_DIV is 1 or 2, heads and positions any.
    unaligned = ("stride_cd", "stride_sd", "P", "ROWS_PER_POS", "W", "COL_DIV")
    # Flux/SD3 per-head query/key norms (128), Wan's across heads (1536, 5120), each with and without RoPE, the
    # widest supported row in fp32.
    # Flux's text + image query/key (two parts, per-head rows of 128) with and without weights; CogVideoX's per-head
    # LayerNorm (64, affine) + RoPE and a wide LayerNorm row.
    cases = (("bf16", 128, True, False, ""), ("fp16", 1536, True, False, ""), ("bf16", 5120, True, False, ""),
             ("fp32", MAX_C, False, False, ""), ("bf16", 128, True, True, ""), ("bf16", 1536, True, True, ""),
             ("bf16", 5120, True, True, ""), ("fp32", 5120, True, True, ""), ("bf16", 128, True, True, "two_part"),
             ("fp16", 128, False, True, "two_part"), ("bf16", 64, True, True, "layer_norm"),
             ("fp16", 64, True, True, "layer_norm"), ("fp32", 3072, True, False, "layer_norm"),
             ("bf16", 3072, True, False, "bias"))  # fmt: skip
    for dtype, c, weight, rope, variant in cases:
        two_part, center, bias = variant == "two_part", variant == "layer_norm", variant in ("layer_norm", "bias")
        block_r, block_c, warps = tiles(c)
        tag = f"{dtype},C={c},weight={weight},rope={rope}" + (f",{variant}" if variant else "")
        signature = {
            "y_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
            "b_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "stride_xm": "i32", "stride_xc": "i32",
            "stride_x2m": "i32", "stride_x2c": "i32", "M": "i32", "C": "i32", "HEAD_ROWS": "i32", "TAIL_ROWS": "i32",
            "eps": "fp32", **rope_types,
        }  # fmt: skip
        constexprs = {
            "stride_xc": 1, "stride_x2c": 1, "HAS_WEIGHT": weight, "HAS_BIAS": bias, "ROPE": rope,
            "STORE_RSTD": True, "TWO_PART": two_part, "CENTER": center, "BLOCK_R": block_r, "BLOCK_C": block_c,
        }  # fmt: skip
        # Rows per sample: Flux's 512 text and 4096 image tokens x 24 heads, but any count in general.
        skip = ("M", "HEAD_ROWS", "TAIL_ROWS", *unaligned)
        attrs = divisibility_attrs(_rms_norm_fwd_kernel, signature, constexprs, skip=skip)
        specs.append(
            dict(name=f"rms_norm_fwd[{tag}]", fn=_rms_norm_fwd_kernel, signature=signature, constexprs=constexprs,
                 attrs=attrs, num_warps=warps)
        )  # fmt: skip
        if two_part:  # the backward runs per part: the one-part kernel
            continue
        signature = {
            "dx_ptr": f"*{dtype}", "part_dw_ptr": "*fp32", "part_db_ptr": "*fp32", "dy_ptr": f"*{dtype}",
            "x_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "w_ptr": f"*{dtype}", "stride_dym": "i32", "stride_dyc": "i32",
            "stride_xm": "i32", "stride_xc": "i32", "M": "i32", "C": "i32", "ROWS_PER_PROG": "i32", **rope_types,
        }  # fmt: skip
        constexprs = {"stride_dyc": 1, "stride_xc": 1, "HAS_WEIGHT": weight, "BIAS_GRAD": bias, "ROPE": rope,
                      "CENTER": center, "BLOCK_R": block_r, "BLOCK_C": block_c}  # fmt: skip
        attrs = divisibility_attrs(_rms_norm_bwd_kernel, signature, constexprs, skip=("M", "ROWS_PER_PROG", *unaligned))
        specs.append(
            dict(name=f"rms_norm_bwd[{tag}]", fn=_rms_norm_bwd_kernel, signature=signature, constexprs=constexprs,
                 attrs=attrs, num_warps=warps)
        )  # fmt: skip
    return specs
