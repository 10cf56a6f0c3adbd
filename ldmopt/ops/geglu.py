"""GEGLU as in diffusers: ``h, g = (x @ weight.T + bias).chunk(2, -1); y = h * gelu_erf(g)``, in one GEMM.

Custom ops ``ldmopt::geglu_fwd`` / ``ldmopt::geglu_bwd``; backends triton (kernels/geglu.py; on GPUs by default
cuBLAS's GEMM, then kernels/linear_epilogue.py's pass: ops/linear_cublas.py) and torch (reference, fp32 math; fp64 for
fp64 inputs).

Saved for backward: x and, when a gradient is needed, the pre-activation [h | g] ([M, 2I], written by the forward
epilogue). The unfused diffusers path keeps the 2I-wide projection plus gelu(g) ([M, I]) alive, so this saves less,
and backward costs one elementwise pass instead of a GEMM recomputation: dpre = [dy * gelu(g) | dy * h * gelu'(g)]
(Triton, with d(bias) as fp32 column sums), then dX = dpre W and dW = dpre^T x with torch.matmul. Inference (no grad)
writes only the I output columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._autocast import autocast_operands
from ._checks import dense, rows_as
from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend, register_eager, triton_refusals
from .linear import (
    TRITON_DTYPES,
    activation_grad_torch,
    check_linear_args,
    compute_dtype,
    gemm_torch,
    needs_grad,
    runs_triton_gemm,
)
from .linear_cublas import choose_gemm_placement, linear_then_epilogue

# ------------------------------------------------------------------------------------------------ torch reference


def _fwd_torch(x, weight, bias, save_pre):
    z = gemm_torch(x, weight, bias)
    h, g = z.chunk(2, dim=-1)
    pre = z.to(x.dtype, copy=True) if save_pre else x.new_empty((0,))
    return (h * F.gelu(g)).to(x.dtype, copy=True), pre


def _bwd_torch(dy, pre):
    cd = compute_dtype(dy)
    h, g = pre.to(cd).chunk(2, dim=-1)
    dyc = dy.to(cd)
    dpre = torch.cat([dyc * F.gelu(g), activation_grad_torch("gelu", g, dyc * h)], dim=-1)
    return dense(dpre, dy.dtype), dpre.sum(0)


# ------------------------------------------------------------------------------------------------ triton


def _fwd_triton(x, weight, bias, save_pre):
    from ldmopt.kernels.geglu import geglu_fwd as launch

    if choose_gemm_placement(x.device) == "cublas":
        return linear_then_epilogue(x, weight, bias, None, None, "gelu", save_pre, x.dtype, glu=True)
    return launch(x, weight, bias, save_pre)


def _bwd_triton(dy, pre):
    from ldmopt.kernels.geglu import geglu_bwd as launch

    return launch(dy, pre)


def _triton_refuse_fwd(x, weight, bias, save_pre):
    return triton_refusals(x, weight, bias, dtypes=TRITON_DTYPES, matmul=runs_triton_gemm(x))


FORWARD = BackendTable(
    "geglu",
    [
        Backend("triton", _fwd_triton, _triton_refuse_fwd),
        Backend("torch", _fwd_torch),
    ],
)
BACKWARD = BackendTable(
    "geglu_backward",
    [
        Backend("triton", _bwd_triton, lambda dy, pre: triton_refusals(dy, pre, dtypes=TRITON_DTYPES)),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::geglu_fwd", mutates_args=())
def geglu_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, save_pre: bool) -> tuple[Tensor, Tensor]:
    """(y [M, I], pre): x [M, K], weight [2I, K] (value rows first, then gate rows), bias [2I]. pre = [h | g]
    ([M, 2I], saved for backward) when save_pre, else empty."""
    return FORWARD(x, weight, bias, save_pre)


@geglu_fwd.register_fake
def _(x, weight, bias, save_pre):
    rows = weight.shape[0]
    pre = x.new_empty((x.shape[0], rows) if save_pre else (0,))
    return x.new_empty((x.shape[0], rows // 2)), pre


@torch.library.custom_op("ldmopt::geglu_bwd", mutates_args=())
def geglu_bwd(dy: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """(dpre [M, 2I] in dy's dtype, dbias [2I] in the compute dtype) from dy [M, I] and pre = [h | g]."""
    return BACKWARD(dy, pre)


@geglu_bwd.register_fake
def _(dy, pre):
    return pre.new_empty(pre.shape, dtype=dy.dtype), dy.new_empty((pre.shape[1],), dtype=compute_dtype(dy))


def _setup_context(ctx, inputs, output):
    x, weight, bias, save_pre = inputs
    # x only for the weight's gradient or a recomputed pre-activation: a frozen layer whose input needs a gradient
    # (adapter, ControlNet training) must not keep its [M, K] input alive until backward.
    keep_x = ctx.needs_input_grad[1] or not save_pre
    ctx.save_for_backward(x if keep_x else None, weight, bias, output[1] if save_pre else None)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dpre):
    x, weight, bias, pre = ctx.saved_tensors
    if dy is None:
        return None, None, None, None
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if pre is None:
        # Only when a caller asked for no saved pre-activation yet needs gradients: recompute it.
        pre = gemm_torch(x, weight, bias).to(x.dtype)
    dpre, dbias = call(geglu_bwd, dy, pre)
    dx = torch.matmul(dpre, weight) if need_dx else None
    dw = torch.matmul(dpre.t(), x) if need_dw else None
    db = dbias.to(bias.dtype) if need_db else None
    return dx, dw, db, None


register_autograd_keeping_backend(geglu_fwd, _backward, _setup_context)
register_eager(geglu_bwd)


# ------------------------------------------------------------------------------------------------ public function


def geglu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """diffusers' GEGLU: ``h, g = (x @ weight.T + bias).chunk(2, -1); h * gelu(g)`` with the exact (erf) GELU.

    x is [..., K] (any leading dims); weight [2I, K] and bias [2I] are ``GEGLU.proj``'s parameters unchanged (value
    rows [0, I), gate rows [I, 2I)), same dtype as x. Returns [..., I]. One GEMM with two fp32 accumulators and the
    epilogue in fp32, one rounding to x's dtype (the unfused path rounds the projection, gelu and the product); on
    GPUs by default cuBLAS's GEMM, rounded to x's dtype, then the epilogue as one pass (ops/linear_cublas.py).
    Under torch.autocast the operands are cast to the autocast dtype first, as F.linear does. Tolerance versus an
    fp64 reference: within 2x the error of diffusers' GEGLU in x's dtype.
    """
    x, weight, bias = autocast_operands(x, weight, bias)
    check_linear_args("geglu", x, weight, bias, rows_multiple=2)
    rows, k = weight.shape
    y, _pre = call(geglu_fwd, x.reshape(-1, k), weight, bias, needs_grad(x, weight, bias))
    return rows_as(y, (*x.shape[:-1], rows // 2))
