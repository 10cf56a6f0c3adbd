"""adaLN modulation: ``s = x (+ residual)``, ``y = layer_norm(s, eps) * (1 + scale[b]) + shift[b]`` (LayerNorm without
affine parameters), the AdaLayerNormZero / AdaLayerNormZeroSingle / AdaLayerNormContinuous / PixArt pattern.

Custom ops ``ldmopt::adaln_modulate_fwd`` / ``ldmopt::adaln_modulate_bwd``; backends triton
(kernels/adaln_modulate.py) and torch (reference, fp32 math; fp64 for fp64 inputs). Saved for backward: the
normalised input s (x itself, or the residual sum the forward writes anyway), per-row fp32 mean/rstd and scale; the
unfused path keeps s, its statistics and the normalised activations, so this saves less.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_tensor
from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend, register_eager, triton_refusals
from .linear import TRITON_DTYPES, compute_dtype, needs_grad, per_sample

# ------------------------------------------------------------------------------------------------ torch reference


def _stats_torch(s: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    var, mean = torch.var_mean(s.to(compute_dtype(s)), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _fwd_torch(x, scale, shift, residual, eps, store_sum, save):
    cd = compute_dtype(x)
    m, c = x.shape
    s = x + residual if residual is not None else x  # rounded to x's dtype, as the unfused add
    mean, rstd = _stats_torch(s, eps)
    xhat = (s.to(cd) - mean[:, None]) * rstd[:, None]
    y = xhat.view(scale.shape[0], -1, c) * (1.0 + scale.to(cd))[:, None, :] + shift.to(cd)[:, None, :]
    empty = x.new_empty((0,))
    if not save:
        mean, rstd = mean.new_empty((0,)), rstd.new_empty((0,))
    return y.view(m, c).to(x.dtype, copy=True), (s.clone() if store_sum else empty), mean, rstd


def _bwd_torch(dy, s, mean, rstd, scale, dsum):
    cd = compute_dtype(s)
    m, c = s.shape
    b = scale.shape[0]
    xhat = (s.to(cd) - mean.to(cd)[:, None]) * rstd.to(cd)[:, None]
    dyc = dy.to(cd)
    dshift = dyc.view(b, -1, c).sum(1)
    dscale = (dyc * xhat).view(b, -1, c).sum(1)
    g = (dyc.view(b, -1, c) * (1.0 + scale.to(cd))[:, None, :]).view(m, c)
    dx = rstd.to(cd)[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + dsum.to(cd)
    return dx.to(s.dtype), dscale, dshift


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse(x, scale, shift, residual, *args) -> list[str]:
    from ldmopt import _env

    reasons = triton_refusals(x, scale, shift, residual, dtypes=TRITON_DTYPES)
    if not reasons and _env.triton_available():
        from ldmopt.kernels.adaln_modulate import MAX_C

        if x.shape[-1] > MAX_C:
            reasons.append(f"rows of C={x.shape[-1]} channels (triton holds rows up to {MAX_C} in registers)")
    return reasons


def _fwd_triton(x, scale, shift, residual, eps, store_sum, save):
    from ldmopt.kernels.adaln_modulate import adaln_fwd

    return adaln_fwd(x, scale, shift, residual, eps, store_sum, save)


def _bwd_triton(dy, s, mean, rstd, scale, dsum):
    from ldmopt.kernels.adaln_modulate import adaln_bwd

    return adaln_bwd(dy, s, mean, rstd, scale, dsum)


FORWARD = BackendTable("adaln_modulate", [Backend("triton", _fwd_triton, _triton_refuse), Backend("torch", _fwd_torch)])
BACKWARD = BackendTable(
    "adaln_modulate_backward",
    [
        Backend("triton", _bwd_triton, lambda dy, s, mean, rstd, scale, dsum: _triton_refuse(s, scale, dy, dsum)),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::adaln_modulate_fwd", mutates_args=())
def adaln_modulate_fwd(
    x: Tensor,
    scale: Tensor,
    shift: Tensor,
    residual: Tensor | None,
    eps: float,
    store_sum: bool,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s, mean, rstd): x, residual [M, C]; scale, shift [B, C] (rows grouped by sample, M % B == 0).
    s = x + residual ([M, C], empty unless store_sum); mean/rstd per row in the compute dtype (empty unless save)."""
    return FORWARD(x, scale, shift, residual, eps, store_sum, save)


@adaln_modulate_fwd.register_fake
def _(x, scale, shift, residual, eps, store_sum, save):
    stats = x.new_empty((x.shape[0],) if save else (0,), dtype=compute_dtype(x))
    s = torch.empty_like(x) if store_sum else x.new_empty((0,))
    return torch.empty_like(x), s, stats, torch.empty_like(stats)


@torch.library.custom_op("ldmopt::adaln_modulate_bwd", mutates_args=())
def adaln_modulate_bwd(
    dy: Tensor, s: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, dsum: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(ds, dscale, dshift): ds [M, C] in s's dtype is the gradient of x and of the residual (dsum, the gradient that
    reached the returned sum, included); dscale/dshift [B, C] in the compute dtype."""
    return BACKWARD(dy, s, mean, rstd, scale, dsum)


@adaln_modulate_bwd.register_fake
def _(dy, s, mean, rstd, scale, dsum):
    per = s.new_empty(scale.shape, dtype=compute_dtype(s))
    return torch.empty_like(s), per, torch.empty_like(per)


def _setup_context(ctx, inputs, output):
    x, scale, shift, residual, eps, store_sum, save = inputs
    _y, s, mean, rstd = output
    # Keep x and residual alive only when their sum was not written (a caller asked for no saved state).
    sources = (None, None)
    if residual is None:
        s = x
    elif not store_sum:
        s, sources = None, (x, residual)
    ctx.save_for_backward(s, *sources, mean if save else None, rstd if save else None, scale)
    ctx.eps = eps
    ctx.shift_dtype = shift.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dsum, _dmean, _drstd):
    s, x, residual, mean, rstd, scale = ctx.saved_tensors
    if s is None:
        s = x + residual
    if dsum is not None and dsum.shape != s.shape:
        dsum = None  # the gradient of an empty (unwritten) sum output
    if dy is None and dsum is None:
        return (None,) * 7
    if mean is None:
        mean, rstd = _stats_torch(s, ctx.eps)
    if dy is None:
        dy = torch.zeros_like(s)
    dx, dscale, dshift = call(adaln_modulate_bwd, dy, s, mean, rstd, scale, dsum)
    need_dx, need_dscale, need_dshift, need_dres = ctx.needs_input_grad[:4]
    return (
        dx if need_dx else None,
        dscale.to(scale.dtype) if need_dscale else None,
        dshift.to(ctx.shift_dtype) if need_dshift else None,
        dx if need_dres else None,
        None,
        None,
        None,
    )


register_autograd_keeping_backend(adaln_modulate_fwd, _backward, _setup_context)
register_eager(adaln_modulate_bwd)


# ------------------------------------------------------------------------------------------------ public function


def adaln_modulate(
    x: Tensor,
    scale: Tensor,
    shift: Tensor,
    *,
    residual: Tensor | None = None,
    eps: float = 1e-6,
    return_residual: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``layer_norm(s) * (1 + scale[b]) + shift[b]`` with ``s = x + residual`` (or x), in one pass over each row.

    x is [B, ..., C] (rows of C channels grouped by sample B = x.shape[0]) or [M, C]; scale and shift are one [C]
    vector per sample, shaped (B, C) or (B, 1, C) (e.g. the chunks of AdaLayerNormZero's emb, any strides), or one per
    row (M, C) for 2-D x. LayerNorm has no affine parameters (diffusers' adaLN norms); x and a residual of another
    dtype are promoted first, as ``x + residual`` would be (under autocast an fp32 gate makes the gated attention
    output fp32 while the stream is bf16); the sum s is rounded to x's dtype as the unfused add does; statistics and
    modulation in fp32. ``return_residual=True`` returns ``(y, s)``
    (needs ``residual``). Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in x's
    dtype.
    """
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims ([B, ..., C] or [M, C]), got shape {tuple(x.shape)}")
    c = x.shape[-1]
    scale = per_sample("scale", scale, x, c)
    shift = per_sample("shift", shift, x, c)
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise TypeError(f"residual is on {residual.device}; expected x's device {x.device}")
        if residual.dtype != x.dtype:  # as `x + residual` would: e.g. an fp32 gated attention output + bf16 stream
            dtype = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(dtype), residual.to(dtype)
        residual = residual.reshape(-1, c)
    elif return_residual:
        raise ValueError("return_residual=True needs a residual (the sum x + residual is what it returns)")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    save = needs_grad(x, scale, shift, residual)
    store_sum = residual is not None and (return_residual or save)
    y, s, _mean, _rstd = call(adaln_modulate_fwd, x.reshape(-1, c), scale, shift, residual, float(eps), store_sum, save)
    y = y.view(x.shape)
    return (y, s.view(x.shape)) if return_residual else y
