"""LayerNorm applied from known row statistics: ``h = (x - mean) * rstd * w + b (+ positions)``, rounded to the output
dtype, in one elementwise pass.

What the backward of a GEMM that reads a LayerNorm in its loads (kernels/linear.py, kernels/geglu.py: ``NORM``)
recomputes as its A operand for the weight gradient dW = dz^T h: the forward never wrote h. The statistics are the
forward's own ([2, M] fp32: means, then rstds), so h is what the forward's loads formed. Positions: diffusers'
sinusoidal table added after the norm (AnimateDiff's motion modules), row m reading table row
``(m // position_rows) % P``.
Layout: x [M, C] rows with arbitrary strides; h a fresh contiguous [M, C]. fp32 math, int64 offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, cdiv, new_output, row_tiles
from ._gemm import divisibility_attrs

#: Widest row of a tile (the tiles hold whole rows); wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192


@triton.jit
def _layer_norm_apply_kernel(
    h_ptr,  # [M, C] contiguous, the output dtype
    x_ptr,
    stats_ptr,  # [2, M] fp32 contiguous
    w_ptr,  # [C] (HAS_WEIGHT)
    b_ptr,  # [C] (HAS_BIAS)
    pos_ptr,  # [P, C] (HAS_POSITIONS)
    stride_xm,
    stride_xc,
    stride_pp,
    stride_pc,
    M,
    C,
    P,
    position_rows,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    r_ok = rows < M
    c_ok = cols < C
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xc, mask=mask, other=0.0)
    mean = tl.load(stats_ptr + rows, mask=r_ok, other=0.0)
    rstd = tl.load(stats_ptr + M + rows, mask=r_ok, other=0.0)
    h = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        h = h + tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_POSITIONS:
        table_row = (rows // position_rows) % P
        offs = table_row[:, None] * stride_pp + cols.to(tl.int64)[None, :] * stride_pc
        h = h + tl.load(pos_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + rows[:, None] * C + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def layer_norm_apply(
    x: torch.Tensor,
    stats: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    positions: torch.Tensor | None,
    position_rows: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """h [M, C] in ``out_dtype`` of x [M, C] (any strides, C <= MAX_C) from stats [2, M] fp32 (contiguous)."""
    m, c = x.shape
    h = new_output((m, c), device=x.device, dtype=out_dtype)
    block_r, block_c, warps = row_tiles(c, max_rows=16)
    ps = positions.stride() if positions is not None else (0, 0)
    _layer_norm_apply_kernel[(cdiv(m, block_r),)](
        h, x, stats, weight if weight is not None else x, bias if bias is not None else x,
        positions if positions is not None else x, x.stride(0), x.stride(1), ps[0], ps[1], m, c,
        positions.shape[0] if positions is not None else 1, position_rows, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, HAS_POSITIONS=positions is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return h


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    for dtype, c, positions in (("fp16", 320, True), ("bf16", 1280, False), ("fp32", 3072, False),
                                ("fp16", MAX_C, False)):  # fmt: skip
        block_r, block_c, warps = row_tiles(c, max_rows=16)
        signature = {"h_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "stats_ptr": "*fp32", "w_ptr": f"*{dtype}",
                     "b_ptr": f"*{dtype}", "pos_ptr": f"*{dtype}", "stride_xm": "i32", "stride_xc": "i32",
                     "stride_pp": "i32", "stride_pc": "i32", "M": "i32", "C": "i32", "P": "i32",
                     "position_rows": "i32"}  # fmt: skip
        constexprs = {"stride_xc": 1, "stride_pc": 1, "HAS_WEIGHT": True, "HAS_BIAS": True,
                      "HAS_POSITIONS": positions, "BLOCK_R": block_r, "BLOCK_C": block_c}  # fmt: skip
        attrs = divisibility_attrs(_layer_norm_apply_kernel, signature, constexprs, skip=("M", "P", "position_rows"))
        specs.append(
            dict(name=f"layer_norm_apply[{dtype},C={c}{',positions' if positions else ''}]",
                 fn=_layer_norm_apply_kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                 num_warps=warps)
        )  # fmt: skip
    return specs
