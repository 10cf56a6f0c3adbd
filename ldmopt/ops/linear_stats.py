"""``ldmopt::linear_stats_fwd``: the fused linear op (``ops.linear``) that also returns the LayerNorm statistics of
its output's rows, for the LayerNorm that reads that output next.

A UNet transformer block adds each attention's output to its token stream in the output projection's epilogue
(``nn.attention_residual``), and the next LayerNorm (norm2, then norm3) reads that sum at once. Here the projection's
epilogue also sums each row it stores (fp64 atomics across the column tiles, the last tile of a row block turning
them into mean and rstd, kernels/linear.py), so the norm runs no statistics pass of its own: a launch and a read of
the stream fewer. The statistics are ``layer_norm_stats(y, eps)`` of the stored y up to the order of the fp64 sums;
under ``torch.use_deterministic_algorithms``, and for a gated Triton GEMM on fp32 operands, they come from that
statistics pass instead; an fp64 output runs the reference backend. Under the "cublas" GEMM placement (GPUs' default,
ops/linear_cublas.py) the epilogue pass after cuBLAS's GEMM sums them the same way. Backward is linear's: the
statistics carry no gradient (the LayerNorm GEMMs that read them differentiate through them themselves).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend
from .layer_norm_linear import _stats_torch, layer_norm_stats_op
from .linear import (
    _backward,
    _differentiable_backward,
    _fwd_torch,
    _out_dtype,
    _setup_context,
    _triton_refuse_fwd,
    check_epilogue_rows,
    compute_dtype,
)
from .linear_cublas import choose_gemm_placement, linear_then_epilogue


def _fwd_torch_stats(x, weight, bias, gate, residual, activation, save_pre, dtype, eps):
    y, pre = _fwd_torch(x, weight, bias, gate, residual, activation, save_pre, dtype)
    return y, pre, _stats_torch(y, eps)


def _fwd_triton_stats(x, weight, bias, gate, residual, activation, save_pre, dtype, eps):
    from ldmopt.kernels._common import new_output
    from ldmopt.kernels.linear import linear_fwd

    # A statistics pass instead of the epilogue's sums under deterministic algorithms (the fp64 atomics add in the
    # order tiles finish), and for a gated GEMM on fp32 tiles (the gate and the statistics together spill registers
    # in some TF32 tiles: sm_80 128x64x32, sm_90 128x128x32; no UNet block gates the projections it takes them from).
    # The cuBLAS placement's pass has no GEMM accumulator to spill beside them: it sums a gated fp32 output's rows.
    fp32_tiles = x.dtype == weight.dtype == torch.float32
    cublas = choose_gemm_placement(x.device) == "cublas"
    if cublas:
        launch = functools.partial(linear_then_epilogue, dtype=dtype or _out_dtype(x, gate, residual))
    else:
        launch = functools.partial(linear_fwd, dtype=dtype)
    if torch.are_deterministic_algorithms_enabled() or (gate is not None and fp32_tiles and not cublas):
        y, pre = launch(x, weight, bias, gate, residual, activation, save_pre)
        return y, pre, call(layer_norm_stats_op, y, eps)
    stats = new_output((2, x.shape[0]), device=x.device, dtype=torch.float32)
    y, pre = launch(x, weight, bias, gate, residual, activation, save_pre, out_stats=stats, out_eps=eps)
    return y, pre, stats


def _triton_refuse_stats(x, weight, bias, gate, residual, activation, save_pre, dtype, eps):
    reasons = _triton_refuse_fwd(x, weight, bias, gate, residual, activation, save_pre, dtype)
    if (dtype or _out_dtype(x, gate, residual)) == torch.float64:
        reasons.append("an fp64 output: its statistics are fp64, the epilogue's fp32")
    return reasons


FORWARD = BackendTable(
    "linear_stats",
    [Backend("triton", _fwd_triton_stats, _triton_refuse_stats), Backend("torch", _fwd_torch_stats)],
)


@torch.library.custom_op("ldmopt::linear_stats_fwd", mutates_args=())
def linear_stats_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gate: Tensor | None,
    residual: Tensor | None,
    activation: str,
    save_pre: bool,
    dtype: torch.dtype | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y [M, N], pre, stats [2, M]): ``ldmopt::linear_fwd``'s y and pre (see there: x [M, K], weight [N, K], gate
    [B, N], residual [M, N] or [B', T', N]), and the LayerNorm mean and rstd (``eps``) of each row of y, in fp32 (fp64
    for an fp64 y)."""
    check_epilogue_rows("linear_stats_fwd", x, weight, gate, residual)
    return FORWARD(x, weight, bias, gate, residual, activation or None, save_pre, dtype, eps)


@linear_stats_fwd.register_fake
def _(x, weight, bias, gate, residual, activation, save_pre, dtype, eps):
    out_dtype = dtype or _out_dtype(x, gate, residual)
    y = x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)
    pre = x.new_empty(y.shape) if save_pre else x.new_empty((0,))
    return y, pre, x.new_empty((2, x.shape[0]), dtype=compute_dtype(y))


def _setup_context_stats(ctx, inputs, output):
    _setup_context(ctx, inputs[:8], output[:2])
    # the statistics carry no gradient (a consumer recomputes through y): say so, not drop one silently
    ctx.mark_non_differentiable(output[2])


def _backward_stats(ctx, dy, dpre, _dstats):
    return (*_backward(ctx, dy, dpre)[:8], None)  # eps


register_autograd_keeping_backend(linear_stats_fwd, _backward_stats, _setup_context_stats, _differentiable_backward)
