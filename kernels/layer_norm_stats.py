"""LayerNorm row statistics: ``mean`` and ``rstd = 1 / sqrt(var + eps)`` (biased variance) of each row of x, in fp32.

What a GEMM that reads a LayerNorm in its loads needs (kernels/linear.py, kernels/geglu.py: ``NORM``): the norm's
output is then never written, and one statistics pass serves every GEMM that reads the same norm (diffusers' to_q,
to_k and to_v).
Layout: x is addressed as [M, C] rows with arbitrary strides; stats is a fresh contiguous [2, M] fp32 tensor (means,
then rstds). fp32/fp16/bf16 in; whole rows held in registers (C <= MAX_C), centred two-pass variance with the
residual correction (no cancellation for rows far from zero mean, 0 for constant rows), int64 row and column offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, cdiv, new_output, row_moments, row_tiles
from ._gemm import divisibility_attrs

#: Widest row a program holds in registers; wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192


@triton.jit
def _row_stats_kernel(
    stats_ptr,  # [2, M] fp32 contiguous: mean, then rstd
    x_ptr,
    stride_xm,
    stride_xc,
    M,
    C,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # M + rows (the rstds) too
    cols = tl.arange(0, BLOCK_C)
    r_ok = rows < M
    mask = r_ok[:, None] & (cols < C)[None, :]
    # int64 column offsets as well: a column-strided view (an NCHW map as [HW, C]) can span 2^31 elements or more.
    x_offs = rows[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xc
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean, var = row_moments(x, mask, C)
    rstd = tl.math.rsqrt(var + eps)
    tl.store(stats_ptr + rows, mean, mask=r_ok)
    tl.store(stats_ptr + M + rows, rstd, mask=r_ok)


def layer_norm_stats(x: torch.Tensor, eps: float) -> torch.Tensor:
    """stats [2, M] fp32 (row means, then rstds) of x [M, C] (any strides, C <= MAX_C)."""
    m, c = x.shape
    stats = new_output((2, m), device=x.device, dtype=torch.float32)
    block_r, block_c, warps = row_tiles(c, max_rows=16)
    _row_stats_kernel[(cdiv(m, block_r),)](
        stats, x, x.stride(0), x.stride(1), m, c, eps, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return stats


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    for dtype, c in (("fp16", 320), ("bf16", 1280), ("fp32", 3072), ("fp16", MAX_C)):
        block_r, block_c, warps = row_tiles(c, max_rows=16)
        signature = {"stats_ptr": "*fp32", "x_ptr": f"*{dtype}", "stride_xm": "i32", "stride_xc": "i32", "M": "i32",
                     "C": "i32", "eps": "fp32"}  # fmt: skip
        constexprs = {"stride_xc": 1, "BLOCK_R": block_r, "BLOCK_C": block_c}
        attrs = divisibility_attrs(_row_stats_kernel, signature, constexprs, skip=("M", "eps"))
        specs.append(
            dict(name=f"layer_norm_stats[{dtype},C={c}]", fn=_row_stats_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
    return specs
