"""``ldmopt::layer_norm_apply``: ``layer_norm(x) * w + b (+ positions)`` from row statistics already known, rounded
to a given dtype.

What the backward of a GEMM reading a LayerNorm in its loads (layer_norm_linear.py) recomputes as its A operand for
the weight gradient: the forward never wrote the norm's output. Internal: no autograd (only that backward calls it),
so it is not exported from ``ldmopt.ops``.

Also what cuBLAS's GEMM reads under the "cublas" placement (layer_norm_linear.py), in the forward.

Backends: cuda (ldmopt._C's ``layer_norm_apply_cuda``, csrc/layer_norm: one warp a row, one C++ op call instead of a
Triton launch; output in x's dtype), triton (kernels/layer_norm_apply.py: one elementwise pass, fp32 math) and torch,
the reference (the unfused composition in the statistics' dtype, fp32; fp64 for fp64), all rounding once to ``dtype``
as the GEMM's loads do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import Backend, BackendTable, call, cuda_extension_refusals, register_eager, triton_refusals
from .linear import TRITON_DTYPES


def position_rows_of(positions: Tensor, rows: int, position_rows: int) -> Tensor:
    """positions[(m // position_rows) % P] for every row m: [rows, K]."""
    index = torch.arange(rows, device=positions.device) // position_rows % positions.shape[0]
    return positions.index_select(0, index)


def standardised(x: Tensor, stats: Tensor) -> Tensor:
    """(x - mean) * rstd per row, in the statistics' dtype (the compute dtype)."""
    return (x.to(stats.dtype) - stats[0][:, None]) * stats[1][:, None]


def affine(xhat, norm_weight, norm_bias, positions=None, position_rows=1) -> Tensor:
    """The LayerNorm's output (plus the positions) from the standardised rows, in their dtype."""
    cd, h = xhat.dtype, xhat
    if norm_weight is not None:
        h = h * norm_weight.to(cd)
    if norm_bias is not None:
        h = h + norm_bias.to(cd)
    if positions is not None:
        h = h + position_rows_of(positions, xhat.shape[0], position_rows).to(cd)
    return h


def apply_reference(x, stats, norm_weight, norm_bias, positions, position_rows, dtype):
    """The torch backend: the LayerNorm's output (plus positions) in the statistics' dtype, rounded once to ``dtype``
    (also what the reference normalised GEMM reads)."""
    return affine(standardised(x, stats), norm_weight, norm_bias, positions, position_rows).to(dtype)


def _apply_triton(x, stats, norm_weight, norm_bias, positions, position_rows, dtype):
    from ldmopt.kernels.layer_norm_apply import layer_norm_apply as launch

    return launch(x, stats, norm_weight, norm_bias, positions, position_rows, dtype)


def triton_apply_refusals(x, stats, norm_weight, norm_bias, positions, position_rows, dtype) -> list[str]:
    reasons = triton_refusals(x, norm_weight, norm_bias, positions, dtypes=TRITON_DTYPES)
    if dtype not in TRITON_DTYPES:
        reasons.append(f"output dtype {dtype}")
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        reasons.append(f"statistics {stats.dtype} with strides {stats.stride()} (the kernel reads contiguous fp32)")
    return reasons or row_width_refusals("layer_norm_apply", x.shape[1], "the kernel")


def _apply_cuda(x, stats, norm_weight, norm_bias, positions, position_rows, dtype):
    return torch.ops.ldmopt.layer_norm_apply_cuda(x, stats, norm_weight, norm_bias, positions, position_rows)


def cuda_apply_refusals(x, stats, norm_weight, norm_bias, positions, position_rows, dtype) -> list[str]:
    """What csrc/layer_norm's apply refuses (its TORCH_CHECKs stay as the last guard): fp32/fp16/bf16 x with unit column
    stride, the output in x's dtype, contiguous fp32 statistics, contiguous fp32/fp16/bf16 parameters, positions in x's
    dtype."""
    reasons = cuda_extension_refusals("layer_norm_apply_cuda", x, stats, norm_weight, norm_bias, positions)
    if reasons:
        return reasons
    if x.dtype not in TRITON_DTYPES:
        reasons.append(f"x dtype {x.dtype} (the CUDA kernel serves fp32/fp16/bf16)")
    if dtype != x.dtype:
        reasons.append(f"output dtype {dtype} differs from x's {x.dtype} (the CUDA kernel writes x's dtype)")
    if x.shape[1] > 1 and x.stride(1) != 1:
        reasons.append(f"x strides {x.stride()}: the CUDA kernel reads rows with unit column stride")
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        reasons.append(f"statistics {stats.dtype} with strides {stats.stride()} (the kernel reads contiguous fp32)")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is not None and (t.dtype not in TRITON_DTYPES or not t.is_contiguous()):
            reasons.append(f"{name} {t.dtype} with strides {t.stride()} (contiguous fp32/fp16/bf16)")
    if positions is not None and (positions.dtype != x.dtype or (positions.shape[1] > 1 and positions.stride(1) != 1)):
        reasons.append(f"positions {positions.dtype} with strides {positions.stride()} (x's dtype, unit column stride)")
    return reasons


def row_width_refusals(kernel_module: str, c: int, what: str) -> list[str]:
    """Why a row kernel of ``ldmopt.kernels.<kernel_module>`` (whole rows in registers, up to its MAX_C) refuses rows
    of ``c`` channels; imports the kernel module, so call it once Triton is known to be there."""
    import importlib

    max_c = importlib.import_module(f"ldmopt.kernels.{kernel_module}").MAX_C
    return [f"rows of {c} channels ({what} holds rows of at most {max_c})"] if c > max_c else []


APPLY = BackendTable(
    "layer_norm_apply",
    [
        Backend("cuda", _apply_cuda, cuda_apply_refusals),
        Backend("triton", _apply_triton, triton_apply_refusals),
        Backend("torch", apply_reference),
    ],
)


@torch.library.custom_op("ldmopt::layer_norm_apply", mutates_args=())
def layer_norm_apply_op(
    x: Tensor,
    stats: Tensor,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    positions: Tensor | None,
    position_rows: int,
    dtype: torch.dtype,
) -> Tensor:
    """[M, C] in ``dtype``: ``(x - mean) * rstd * norm_weight + norm_bias + positions[(m // position_rows) % P]`` for
    x [M, C] and stats [2, M] (the means, then the rstds)."""
    if x.dim() != 2 or tuple(stats.shape) != (2, x.shape[0]) or position_rows < 1:
        raise ValueError(
            f"layer_norm_apply: x {tuple(x.shape)}, stats {tuple(stats.shape)}, position_rows={position_rows}: "
            "expected x [M, C], stats [2, M] and position_rows >= 1"
        )
    return APPLY(x, stats, norm_weight, norm_bias, positions, position_rows, dtype)


@layer_norm_apply_op.register_fake
def _(x, stats, norm_weight, norm_bias, positions, position_rows, dtype):
    return x.new_empty(x.shape, dtype=dtype)


register_eager(layer_norm_apply_op)


def layer_norm_apply(x, stats, norm_weight, norm_bias, positions, position_rows, dtype) -> Tensor:
    return call(layer_norm_apply_op, x, stats, norm_weight, norm_bias, positions, position_rows, dtype)
