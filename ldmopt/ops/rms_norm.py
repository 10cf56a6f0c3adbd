"""RMSNorm: ``y = x * rsqrt(mean(x^2, -1) + eps) [* weight] [+ bias]`` in one pass over each row, fp32 statistics and
affine, one rounding of y. The query/key norms of SD3.5, HunyuanVideo, LTX and others (diffusers' ``RMSNorm``, which
runs as eight elementwise passes with an fp32 copy of the activation; torch.nn.RMSNorm, in Flux and Wan, is already
one fused kernel on a GPU).

Custom ops ``ldmopt::rms_norm_fwd`` / ``ldmopt::rms_norm_bwd``; backends triton (kernels/rms_norm.py) and torch
(reference, fp32 math; fp64 for fp64 inputs). Saved for backward: x and the per-row fp32 rstd (the unfused path keeps
the fp32 copy of x, the normalised activation and its rounded copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_eps, check_out_dtype, check_tensor, check_vector
from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend, register_eager, triton_refusals
from .linear import TRITON_DTYPES, compute_dtype, needs_grad

# ------------------------------------------------------------------------------------------------ torch reference


def _fwd_torch(x, weight, bias, eps, dtype, save):
    cd = compute_dtype(x)
    xc = x.to(cd)
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    return y.to(dtype), (rstd if save else rstd.new_empty((0,)))


def _bwd_torch(dy, x, rstd, weight):
    cd = compute_dtype(x)
    xhat = x.to(cd) * rstd.to(cd)[:, None]
    dyc = dy.to(cd)
    g = dyc * weight.to(cd) if weight is not None else dyc
    dx = rstd.to(cd)[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyc * xhat).sum(0) if weight is not None else xhat.new_empty((0,))
    return dx.to(x.dtype), dw


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse(x, weight, bias, *args) -> list[str]:
    from ldmopt import _env

    reasons = triton_refusals(x, weight, bias, dtypes=TRITON_DTYPES)
    if not reasons and _env.triton_available():
        from ldmopt.kernels.rms_norm import MAX_C

        if x.shape[-1] > MAX_C:
            reasons.append(f"rows of C={x.shape[-1]} channels (triton holds rows up to {MAX_C} in registers)")
    return reasons


def _fwd_triton(x, weight, bias, eps, dtype, save):
    from ldmopt.kernels.rms_norm import rms_norm_fwd

    return rms_norm_fwd(x, weight, bias, eps, dtype, save)


def _bwd_triton(dy, x, rstd, weight):
    from ldmopt.kernels.rms_norm import rms_norm_bwd

    return rms_norm_bwd(dy, x, rstd, weight)


FORWARD = BackendTable("rms_norm", [Backend("triton", _fwd_triton, _triton_refuse), Backend("torch", _fwd_torch)])
BACKWARD = BackendTable(
    "rms_norm_backward",
    [
        Backend("triton", _bwd_triton, lambda dy, x, rstd, weight: _triton_refuse(x, weight, dy)),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, dtype: torch.dtype, save: bool
) -> tuple[Tensor, Tensor]:
    """(y [M, C] in ``dtype``, rstd [M] in the compute dtype, empty unless save): x [M, C]; weight, bias [C]."""
    return FORWARD(x, weight, bias, eps, dtype, save)


@rms_norm_fwd.register_fake
def _(x, weight, bias, eps, dtype, save):
    rstd = x.new_empty((x.shape[0],) if save else (0,), dtype=compute_dtype(x))
    return x.new_empty(x.shape, dtype=dtype), rstd


@torch.library.custom_op("ldmopt::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """(dx [M, C] in x's dtype, dweight [C] in the compute dtype, empty without a weight)."""
    return BACKWARD(dy, x, rstd, weight)


@rms_norm_bwd.register_fake
def _(dy, x, rstd, weight):
    dw = x.new_empty((x.shape[1],) if weight is not None else (0,), dtype=compute_dtype(x))
    return torch.empty_like(x), dw


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, _dtype, save = inputs
    ctx.save_for_backward(x, output[1] if save else None, weight)
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _drstd):
    x, rstd, weight = ctx.saved_tensors
    if dy is None:
        return (None,) * 6
    if rstd is None:  # a caller asked for no saved state yet needs gradients: recompute the statistics
        rstd = torch.rsqrt(x.to(compute_dtype(x)).pow(2).mean(-1) + ctx.eps)
    dx, dw = call(rms_norm_bwd, dy, x, rstd, weight)
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    db = dy.sum(0, dtype=compute_dtype(dy)) if need_db else None
    return (
        dx if need_dx else None,
        dw.to(weight.dtype) if need_dw else None,
        db.to(ctx.bias_dtype) if need_db else None,
        None,
        None,
        None,
    )


register_autograd_keeping_backend(rms_norm_fwd, _backward, _setup_context)
register_eager(rms_norm_bwd)


# ------------------------------------------------------------------------------------------------ public function


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-6,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight + bias`` over the last dim, in one pass over each row.

    x is [..., C] (any leading dims: tokens, or tokens x heads for a per-head norm); weight and bias are [C] or None,
    of any float dtype. Statistics and affine in fp32, one rounding to ``out_dtype`` (default x's dtype).
    Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in the output dtype.
    """
    check_tensor("x", x)  # also refuses empty tensors
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim ([..., C]), got a 0-d tensor")
    c = x.shape[-1]
    check_vector("weight", weight, c, x)
    check_vector("bias", bias, c, x)
    eps = check_eps(eps)
    check_out_dtype(out_dtype)
    save = needs_grad(x, weight, bias)
    y, _rstd = call(rms_norm_fwd, x.reshape(-1, c), weight, bias, eps, out_dtype or x.dtype, save)
    return y.view(x.shape)
