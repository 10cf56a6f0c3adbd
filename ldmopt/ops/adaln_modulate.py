"""adaLN modulation: ``s = x (+ residual)`` or ``s = residual + gate[b] * x``, ``y = layer_norm(s, eps) * (1 +
scale[b]) + shift[b]`` (LayerNorm without affine parameters), the AdaLayerNormZero / AdaLayerNormZeroSingle /
AdaLayerNormContinuous / PixArt pattern, and Wan's gated residual add before its norms.

Custom ops ``ldmopt::adaln_modulate_fwd`` / ``ldmopt::adaln_modulate_bwd``; backends cuda for the forward
(ldmopt._C's ``adaln_modulate_cuda`` where the extension is built: one C++ op call, a warp a row, for rows with unit
column stride whose residual shares x's dtype), triton (kernels/adaln_modulate.py: any strides and dtypes) and torch
(reference, fp32 math; fp64 for fp64 inputs). Saved for backward: the
normalised input s (x itself, or the residual sum the forward writes anyway), per-row fp32 mean/rstd and scale (and x
and the gate with a gate); the unfused path keeps s, its statistics and the normalised activations (and x and the gate
for the product), so this saves less.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_eps, check_tensor, dense
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    cuda_extension_refusals,
    register_autograd_keeping_backend,
    register_eager,
    triton_refusals,
)
from .linear import TRITON_DTYPES, compute_dtype, needs_grad, per_sample

# ------------------------------------------------------------------------------------------------ torch reference


def _stats_torch(s: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    var, mean = torch.var_mean(s.to(compute_dtype(s)), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _gated_sum_torch(x, residual, gate):
    """residual + gate[b] * x in fp32 (fp64 for fp64), rounded to the residual's dtype."""
    cd = compute_dtype(residual)
    m, c = x.shape
    prod = x.to(cd).view(gate.shape[0], -1, c) * gate.to(cd)[:, None, :]
    return (residual.to(cd) + prod.view(m, c)).to(residual.dtype)


def _fwd_torch(x, scale, shift, residual, gate, eps, store_sum, save):
    m, c = x.shape
    if gate is not None:
        s = _gated_sum_torch(x, residual, gate)
    else:
        s = x + residual if residual is not None else x  # rounded to x's dtype, as the unfused add
    cd = compute_dtype(s)
    mean, rstd = _stats_torch(s, eps)
    xhat = (s.to(cd) - mean[:, None]) * rstd[:, None]
    y = xhat.view(scale.shape[0], -1, c) * (1.0 + scale.to(cd))[:, None, :] + shift.to(cd)[:, None, :]
    empty = s.new_empty((0,))  # in the sum's dtype, as the fake and the kernels return it
    if not save:
        mean, rstd = mean.new_empty((0,)), rstd.new_empty((0,))
    return dense(y.view(m, c), s.dtype), (dense(s, s.dtype) if store_sum else empty), mean, rstd  # s: a new sum


def _times_gate(ds: Tensor, gate: Tensor, dtype: torch.dtype) -> Tensor:
    """ds * gate[b] in the compute dtype, rounded to ``dtype`` (the unfused product's backward, from the rounded ds)."""
    cd = compute_dtype(ds)
    m, c = ds.shape
    return dense((ds.to(cd).view(gate.shape[0], -1, c) * gate.to(cd)[:, None, :]).view(m, c), dtype)


def _bwd_torch(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight=False):
    cd = compute_dtype(s)
    m, c = s.shape
    b = scale.shape[0]
    xhat = (s.to(cd) - mean.to(cd)[:, None]) * rstd.to(cd)[:, None]
    dyc = dy.to(cd)
    dshift = dyc.view(b, -1, c).sum(1)
    dscale = (dyc * xhat).view(b, -1, c).sum(1)
    factor = scale.to(cd) if scale_is_weight else 1.0 + scale.to(cd)
    g = (dyc.view(b, -1, c) * factor[:, None, :]).view(m, c)
    dx = rstd.to(cd)[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + dsum.to(cd)
    if gate is None:
        return dense(dx, s.dtype), dscale, dshift, s.new_empty((0,)), dscale.new_empty((0,))
    dgate = (dx * x.to(cd)).view(b, -1, c).sum(1)
    return dense(dx, s.dtype), dscale, dshift, _times_gate(dx, gate, x.dtype), dgate


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse(x, scale, shift, residual, gate, *args) -> list[str]:
    from ldmopt import _env

    reasons = triton_refusals(x, scale, shift, residual, gate, dtypes=TRITON_DTYPES)
    if not reasons and _env.triton_available():
        from ldmopt.kernels.adaln_modulate import MAX_C

        if x.shape[-1] > MAX_C:
            reasons.append(f"rows of C={x.shape[-1]} channels (triton holds rows up to {MAX_C} in registers)")
    return reasons


def _triton_refuse_bwd(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight=False) -> list[str]:
    reasons = _triton_refuse(s, scale, dy, dsum, gate, x)
    if not reasons and gate is not None and s.dtype == torch.float32:
        from ldmopt.kernels.adaln_modulate import MAX_GATED_FP32_BWD_C

        if s.shape[-1] > MAX_GATED_FP32_BWD_C:
            reasons.append(
                f"gated fp32 backward rows of C={s.shape[-1]} channels (triton's register budget holds up to "
                f"{MAX_GATED_FP32_BWD_C})"
            )
    return reasons


def _fwd_triton(x, scale, shift, residual, gate, eps, store_sum, save):
    from ldmopt.kernels.adaln_modulate import adaln_fwd

    return adaln_fwd(x, scale, shift, residual, gate, eps, store_sum, save)


def _bwd_triton(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight=False):
    from ldmopt.kernels.adaln_modulate import adaln_bwd

    return adaln_bwd(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight)


# ------------------------------------------------------------------------------------------------ cuda (ldmopt._C)

#: the dtypes ldmopt._C's kernel reads (its rows, and each of scale, shift and gate in its own)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cuda_refuse(x, scale, shift, residual, gate, eps, store_sum, save) -> list[str]:
    """What ldmopt._C's adaln_modulate_cuda would reject (it raises; refused here, the triton pass takes them)."""
    reasons = cuda_extension_refusals("adaln_modulate_cuda", x, scale, shift, residual, gate)
    if reasons:
        return reasons
    operands = (("x", x), ("scale", scale), ("shift", shift), ("residual", residual), ("gate", gate))
    for name, t in operands:
        if t is None:
            continue
        if t.device != x.device:
            reasons.append(f"{name} on {t.device}, x on {x.device}")
        if t.dtype not in CUDA_DTYPES:
            reasons.append(f"{name} dtype {t.dtype} (the CUDA kernel reads fp32/fp16/bf16)")
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            reasons.append(f"{name} of shape {tuple(t.shape)}, strides {t.stride()}: the CUDA kernel reads rows of "
                           "unit column stride")  # fmt: skip
    if residual is not None and residual.dtype != x.dtype:
        reasons.append(f"residual dtype {residual.dtype} differs from x's {x.dtype} (the CUDA kernel reads one dtype)")
    if not x.shape[-1]:
        reasons.append("x has no columns")
    if store_sum and residual is None:
        reasons.append("store_sum without a residual")
    if not (isinstance(eps, float) and 0.0 <= eps < math.inf):  # (a symbolic eps under torch.compile is not checked)
        reasons.append(f"eps={eps!r} (the CUDA kernel takes a finite eps >= 0)")
    return reasons


def _fwd_cuda(x, scale, shift, residual, gate, eps, store_sum, save):
    return torch.ops.ldmopt.adaln_modulate_cuda(x, scale, shift, residual, gate, float(eps), store_sum, save)


FORWARD = BackendTable(
    "adaln_modulate",
    [
        Backend("cuda", _fwd_cuda, _cuda_refuse),
        Backend("triton", _fwd_triton, _triton_refuse),
        Backend("torch", _fwd_torch),
    ],
)
BACKWARD = BackendTable(
    "adaln_modulate_backward",
    [
        Backend("triton", _bwd_triton, _triton_refuse_bwd),
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
    gate: Tensor | None,
    eps: float,
    store_sum: bool,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s, mean, rstd): x, residual [M, C]; gate, scale, shift [B, C] (rows grouped by sample, M % B == 0).
    s = x + residual, or residual + gate[b] * x (gate and store_sum need a residual), [M, C], empty unless store_sum;
    y and s in x's dtype, the residual's with a gate; mean/rstd per row in the compute dtype (empty unless save)."""
    # Checked here too, not only in ops.adaln_modulate: the kernels index the per-sample rows from these shapes.
    m, c = x.shape
    for name, t in (("scale", scale), ("shift", shift), ("gate", gate)):
        if t is not None and (t.shape != scale.shape or t.dim() != 2 or t.shape[1] != c or not len(t) or m % len(t)):
            raise ValueError(
                f"adaln_modulate_fwd: {name} of shape {tuple(t.shape)} is not [B, {c}] (as scale) with B dividing M={m}"
            )
    if gate is not None and residual is None:
        raise ValueError("adaln_modulate_fwd: a gate needs a residual (the gated sum is residual + gate * x)")
    if store_sum and residual is None:  # the sum would be x itself; the Triton and CUDA kernels write none
        raise ValueError("adaln_modulate_fwd: store_sum=True needs a residual (without one the sum is x)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"adaln_modulate_fwd: residual of shape {tuple(residual.shape)} is not x's {tuple(x.shape)}")
    if residual is not None and gate is None and residual.dtype != x.dtype:  # ops.adaln_modulate promotes first
        raise ValueError(
            f"adaln_modulate_fwd: residual dtype {residual.dtype} differs from x's {x.dtype} (without a gate the sum "
            "is in x's dtype: promote both first)"
        )
    return FORWARD(x, scale, shift, residual, gate, eps, store_sum, save)


@adaln_modulate_fwd.register_fake
def _(x, scale, shift, residual, gate, eps, store_sum, save):
    dtype = residual.dtype if gate is not None else x.dtype
    stats = x.new_empty((x.shape[0],) if save else (0,), dtype=compute_dtype(x.new_empty((0,), dtype=dtype)))
    s = x.new_empty(x.shape if store_sum else (0,), dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype), s, stats, torch.empty_like(stats)


@torch.library.custom_op("ldmopt::adaln_modulate_bwd", mutates_args=())
def adaln_modulate_bwd(
    dy: Tensor,
    s: Tensor,
    mean: Tensor,
    rstd: Tensor,
    scale: Tensor,
    dsum: Tensor | None,
    x: Tensor | None,
    gate: Tensor | None,
    scale_is_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(ds, dscale, dshift, dx, dgate): ds [M, C] in s's dtype is the gradient of the residual, and of x without a
    gate (dsum, the gradient that reached the returned sum, included); dscale/dshift [B, C] in the compute dtype. With a
    gate (x: the gated input): dx = ds * gate[b] in x's dtype, dgate [B, C] in the compute dtype; else both empty.
    ``scale_is_weight``: the rows were multiplied by ``scale`` itself, not ``1 + scale`` (a LayerNorm's affine weight,
    which ``w - 1`` would round away when |w| is far below 1)."""
    if gate is not None and (x is None or x.shape != s.shape):  # checked for direct calls: dx = ds * gate reads x
        raise ValueError(
            f"adaln_modulate_bwd: with a gate, x (the gated input) must have s's shape {tuple(s.shape)}, got "
            f"{None if x is None else tuple(x.shape)}"
        )
    return BACKWARD(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight)


@adaln_modulate_bwd.register_fake
def _(dy, s, mean, rstd, scale, dsum, x, gate, scale_is_weight=False):
    per = s.new_empty(scale.shape, dtype=compute_dtype(s))
    if gate is None:
        return s.new_empty(s.shape), per, torch.empty_like(per), s.new_empty((0,)), per.new_empty((0,))
    return s.new_empty(s.shape), per, torch.empty_like(per), x.new_empty(x.shape), torch.empty_like(per)


def _setup_context(ctx, inputs, output):
    x, scale, shift, residual, gate, eps, store_sum, save = inputs
    _y, s, mean, rstd = output
    # Keep x and residual alive only when their sum was not written (a caller asked for no saved state); x also when
    # the gate needs its gradient (d gate needs x; d x = ds * gate does not: a frozen gate, as in every frozen-base
    # fine-tuning of Flux/SD3/Wan, keeps no more than the unfused product would).
    sources = (None, None)
    if residual is None:
        s = x
    elif not store_sum:
        s, sources = None, (x, residual)
    elif gate is not None and ctx.needs_input_grad[4]:
        sources = (x, None)
    ctx.save_for_backward(s, *sources, mean if save else None, rstd if save else None, scale, gate)
    ctx.eps = eps
    ctx.x_dtype = x.dtype
    ctx.shift_dtype = shift.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dsum, _dmean, _drstd):
    s, x, residual, mean, rstd, scale, gate = ctx.saved_tensors
    if s is None:
        s = _gated_sum_torch(x, residual, gate) if gate is not None else x + residual
    if dsum is not None and dsum.shape != s.shape:
        dsum = None  # the gradient of an empty (unwritten) sum output
    if dy is None and dsum is None:
        return (None,) * 8
    if mean is None:
        mean, rstd = _stats_torch(s, ctx.eps)
    if dy is None:
        dy = torch.zeros_like(s)
    gate_without_x = gate is not None and x is None  # the gate needs no gradient: x was not kept
    kernel_gate = None if gate_without_x else gate
    ds, dscale, dshift, dxg, dgate = call(adaln_modulate_bwd, dy, s, mean, rstd, scale, dsum, x, kernel_gate)
    need_dx, need_dscale, need_dshift, need_dres, need_dgate = ctx.needs_input_grad[:5]
    if gate_without_x:
        dxg = _times_gate(ds, gate, ctx.x_dtype) if need_dx else None
    elif gate is None:
        # x and the residual have the same gradient, but each needs a tensor of its own: through the public op's
        # reshapes autograd would hand two views of one storage to two leaves' .grad, and the next accumulation
        # would add into it twice (3x for 2 backward passes)
        dxg = ds.clone() if need_dx and need_dres else ds
    return (
        dxg if need_dx else None,
        dscale.to(scale.dtype) if need_dscale else None,
        dshift.to(ctx.shift_dtype) if need_dshift else None,
        ds if need_dres else None,
        dgate.to(gate.dtype) if need_dgate else None,
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
    gate: Tensor | None = None,
    eps: float | None = None,
    return_residual: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``layer_norm(s) * (1 + scale[b]) + shift[b]`` with ``s = x + residual`` (or x), in one pass over each row.

    x is [B, ..., C] (rows of C channels grouped by sample B = x.shape[0]) or [M, C]; scale and shift are one [C]
    vector per sample, shaped (B, C) or (B, 1, C) (e.g. the chunks of AdaLayerNormZero's emb, any strides), or one per
    row (M, C) for 2-D x. LayerNorm has no affine parameters (diffusers' adaLN norms); x and a residual of another
    dtype are promoted first, as ``x + residual`` would be (under autocast an fp32 gate makes the gated attention
    output fp32 while the stream is bf16); the sum s is rounded to x's dtype as the unfused add does; statistics and
    modulation in fp32. ``return_residual=True`` returns ``(y, s)`` (needs ``residual``).

    ``gate`` (shaped like scale; needs ``residual``) makes the sum the gated residual add ``s = residual + gate[b] * x``
    computed in fp32 and rounded to the residual's dtype, in which y is returned too: Wan's
    ``(h.float() + attn_output * gate).type_as(h)`` before its norms, without the product ever stored.

    Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in the output dtype.
    """
    # None, not a float default: one Dynamo graph input shared by every call (pytorch/pytorch#193194)
    eps = 1e-6 if eps is None else eps
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims ([B, ..., C] or [M, C]), got shape {tuple(x.shape)}")
    c = x.shape[-1]
    scale = per_sample("scale", scale, x, c)
    shift = per_sample("shift", shift, x, c)
    if gate is not None:
        if residual is None:
            raise ValueError("gate needs a residual (the gated sum is residual + gate * x)")
        gate = per_sample("gate", gate, x, c)
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise TypeError(f"residual is on {residual.device}; expected x's device {x.device}")
        if residual.dtype != x.dtype and gate is None:  # as `x + residual`: e.g. an fp32 gated output + bf16 stream
            dtype = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(dtype), residual.to(dtype)
        residual = residual.reshape(-1, c)
    elif return_residual:
        raise ValueError("return_residual=True needs a residual (the sum x + residual is what it returns)")
    eps = check_eps(eps)
    save = needs_grad(x, scale, shift, residual, gate)
    store_sum = residual is not None and (return_residual or save)
    y, s, _mean, _rstd = call(adaln_modulate_fwd, x.reshape(-1, c), scale, shift, residual, gate, eps, store_sum, save)
    y = y.view(x.shape)
    return (y, s.view(x.shape)) if return_residual else y
