"""GroupNorm with an optional fused activation: ``act(group_norm(x, G, weight, bias, eps))``.

Custom ops ``ldmopt::group_norm_fwd`` / ``ldmopt::group_norm_bwd``; backends cuda (ldmopt._C), triton
(kernels/group_norm.py), torch (reference, fp32 math; fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_activation, check_eps, check_tensor, check_vector, memory_format_of, spatial_dims_flatten
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    cuda_extension_refusals,
    register_autograd_keeping_backend,
    register_eager,
    triton_refusals,
)

SUPPORTED_ACTIVATIONS = (None, "silu")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------ torch reference


def _fwd_torch(x, weight, bias, num_groups, eps, activation):
    n, c = x.shape[:2]
    cd = _stats_dtype(x)
    xf = x.to(cd).reshape(n, num_groups, -1)
    var, mean = torch.var_mean(xf, dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    z = ((xf - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    affine_shape = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        z = z * weight.to(cd).reshape(affine_shape)
    if bias is not None:
        z = z + bias.to(cd).reshape(affine_shape)
    if activation == "silu":
        z = F.silu(z)
    y = torch.empty_like(x)
    y.copy_(z)
    return y, mean, rstd


def _bwd_torch(dy, x, weight, bias, mean, rstd, num_groups, activation):
    n, c = x.shape[:2]
    cd = _stats_dtype(x)
    cpg = c // num_groups
    view = (n, num_groups, cpg, -1)
    xhat = (x.to(cd).reshape(view) - mean.to(cd)[:, :, None, None]) * rstd.to(cd)[:, :, None, None]
    w = torch.ones(c, dtype=cd, device=x.device) if weight is None else weight.to(cd)
    b = torch.zeros(c, dtype=cd, device=x.device) if bias is None else bias.to(cd)
    w = w.reshape(1, num_groups, cpg, 1)
    dz = dy.to(cd).reshape(view)
    if activation == "silu":
        z = xhat * w + b.reshape(1, num_groups, cpg, 1)
        s = torch.sigmoid(z)
        dz = dz * s * (1 + z * (1 - s))
    dbias = dz.sum(dim=(0, 3)).reshape(c)
    dweight = (dz * xhat).sum(dim=(0, 3)).reshape(c)
    wdz = dz * w
    inv_m = 1.0 / (cpg * xhat.shape[-1])
    c1 = wdz.sum(dim=(2, 3), keepdim=True)
    c2 = (wdz * xhat).sum(dim=(2, 3), keepdim=True)
    dx_val = rstd.to(cd)[:, :, None, None] * (wdz - (c1 + xhat * c2) * inv_m)
    dx = torch.empty_like(x)
    dx.copy_(dx_val.reshape(x.shape))
    return dx, dweight, dbias


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse(x, *args) -> list[str]:
    reasons = triton_refusals(x, dtypes=_TRITON_DTYPES)
    if x.dtype not in _TRITON_DTYPES:
        reasons.append(f"x dtype {x.dtype} (triton serves fp32/fp16/bf16)")
    if not spatial_dims_flatten(x):
        reasons.append(f"x strides {x.stride()}: its spatial dims do not flatten into one strided axis")
    return reasons


def _fwd_triton(x, weight, bias, num_groups, eps, activation):
    from ldmopt.kernels.group_norm import group_norm_fwd

    return group_norm_fwd(x, weight, bias, num_groups, eps, activation)


def _bwd_triton(dy, x, weight, bias, mean, rstd, num_groups, activation):
    from ldmopt.kernels.group_norm_bwd import group_norm_bwd

    return group_norm_bwd(dy, x, weight, bias, mean, rstd, num_groups, activation, True)


# ------------------------------------------------------------------------------------------------ cuda (ldmopt._C)


def _fwd_cuda(x, weight, bias, num_groups, eps, activation):
    return torch.ops.ldmopt.group_norm_fwd_cuda(x, weight, bias, num_groups, eps, activation or "")


def _bwd_cuda(dy, x, weight, bias, mean, rstd, num_groups, activation):
    return torch.ops.ldmopt.group_norm_bwd_cuda(dy, x, weight, bias, mean, rstd, num_groups, activation or "")


def _cuda_layout(x: Tensor) -> bool:
    """The layouts csrc/group_norm reads: contiguous, or channels-last (C innermost) for 3-, 4- and 5-D x."""
    if x.is_contiguous() or (x.dim() == 3 and x.transpose(1, 2).is_contiguous()):
        return True
    return x.dim() in (4, 5) and x.is_contiguous(memory_format=memory_format_of(x)) and not x.is_contiguous()


def cuda_shape_refusals(x: Tensor) -> list[str]:
    """csrc/group_norm's shape and layout limits: non-empty 3-, 4- and 5-D x, contiguous or channels-last."""
    if x.dim() not in (3, 4, 5) or x.numel() == 0:
        return [f"x of shape {tuple(x.shape)} (the CUDA kernels take non-empty 3-, 4- and 5-D x)"]
    if not _cuda_layout(x):
        return [f"x strides {x.stride()} are neither contiguous nor channels-last"]
    return []


def _cuda_refuse(symbol: str, *tensors: Tensor, stats: tuple[Tensor, ...] = ()) -> list[str]:
    """What the C++ op would refuse, so that another backend runs instead (the forward's input is dense already;
    gn_conv2d's backward hands any layout, and stats a user passed, here)."""
    x = tensors[-1]
    reasons = cuda_extension_refusals(symbol, *tensors)
    if reasons:
        return reasons
    if x.dtype not in _TRITON_DTYPES:
        reasons.append(f"x dtype {x.dtype} (the CUDA kernels serve fp32/fp16/bf16)")
    reasons += cuda_shape_refusals(x)  # only direct op calls and gn_conv2d's backward can fail these
    if any(t.dtype != x.dtype for t in tensors):
        reasons.append("dy and x of different dtypes")
    if any(t.dtype != torch.float32 for t in stats):
        reasons.append("statistics not in fp32")
    return reasons


FORWARD = BackendTable(
    "group_norm",
    [
        Backend("cuda", _fwd_cuda, lambda x, *a: _cuda_refuse("group_norm_fwd_cuda", x)),
        Backend("triton", _fwd_triton, _triton_refuse),
        Backend("torch", _fwd_torch),
    ],
)
BACKWARD = BackendTable(
    "group_norm_backward",
    [
        Backend(
            "cuda",
            _bwd_cuda,
            lambda dy, x, w, b, mean, rstd, *a: _cuda_refuse("group_norm_bwd_cuda", dy, x, stats=(mean, rstd)),
        ),
        Backend("triton", _bwd_triton, lambda dy, x, *a: _triton_refuse(x) or triton_refusals(dy)),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::group_norm_fwd", mutates_args=())
def group_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int, eps: float, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): y keeps x's strides; mean/rstd are [N, G] in fp32 (fp64 for fp64 inputs)."""
    y, mean, rstd = FORWARD(x, weight, bias, num_groups, eps, activation or None)
    return y, mean, rstd


@group_norm_fwd.register_fake
def _(x, weight, bias, num_groups, eps, activation):
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("ldmopt::group_norm_bwd", mutates_args=())
def group_norm_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    num_groups: int,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); dweight/dbias are per-channel sums in the statistics dtype."""
    dx, dweight, dbias = BACKWARD(dy, x, weight, bias, mean, rstd, num_groups, activation or None)
    return dx, dweight, dbias


@group_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, num_groups, activation):
    affine = x.new_empty((x.shape[1],), dtype=_stats_dtype(x))
    return torch.empty_like(x), affine, torch.empty_like(affine)


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, _eps, activation = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups
    ctx.activation = activation
    # mean/rstd are statistics for another op, which differentiates through them itself: not differentiable
    # outputs (a gradient sent into them would be lost), so no zero-filled gradients are made for them either.
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return (None,) * 6
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = call(group_norm_bwd, dy, x, weight, bias, mean, rstd, ctx.num_groups, ctx.activation)
    dweight = dweight.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    dbias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    return dx, dweight, dbias, None, None, None


register_autograd_keeping_backend(group_norm_fwd, _backward, _setup_context)
register_eager(group_norm_bwd)


# ------------------------------------------------------------------------------------------------ public function


def group_norm(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    activation: str | None = None,
) -> Tensor:
    """``act(group_norm(x))`` for (N, C, *) inputs as torch.nn.GroupNorm takes them: (N, C, H, W) or (N, C, F, H, W),
    contiguous or channels-last, read in place; (N, C), (N, C, L) and more than three trailing dims as (N, C, L).

    Math: per (n, group) mean and biased variance in fp32 (fp64 for fp64 inputs), ``y = (x - mean) * rstd * weight
    + bias``, then ``activation`` (None or "silu"). The output has x's memory format. Tolerance versus an fp64
    reference: within 2x the error of PyTorch's own F.group_norm in x's dtype. Other dense layouts are made
    contiguous first.
    """
    # None, not a float default: one Dynamo graph input shared by every call (pytorch/pytorch#193194)
    eps = 1e-5 if eps is None else eps
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have shape (N, C, *), got {tuple(x.shape)}")
    if x.dim() not in (3, 4, 5):  # the kernels' layouts; the statistics do not depend on how the rest is shaped
        y = group_norm(x.reshape(*x.shape[:2], -1), num_groups, weight, bias, eps, activation)
        return y.view(x.shape)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    eps = check_eps(eps)
    c = x.shape[1]
    if c % num_groups:
        raise ValueError(f"x has C={c} channels, not divisible by num_groups={num_groups}")
    check_vector("weight", weight, c, x)
    check_vector("bias", bias, c, x)
    check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
    # Layouts only matter to the kernels; under torch.func transforms the reference runs (and vmap cannot query them).
    dense = torch._C._are_functorch_transforms_active() or x.is_contiguous()
    if not (dense or x.is_contiguous(memory_format=memory_format_of(x))):
        x = x.contiguous()
    y, _mean, _rstd = call(group_norm_fwd, x, weight, bias, num_groups, float(eps), activation or "")
    return y
