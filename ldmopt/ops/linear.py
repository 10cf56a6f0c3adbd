"""Linear layer with a fused epilogue: ``y = residual + gate[b] * act(x @ weight.T + bias)``.

Custom ops ``ldmopt::linear_fwd`` / ``ldmopt::linear_bwd``; backends triton (kernels/linear.py; on GPUs by default
cuBLAS's GEMM, then kernels/linear_epilogue.py's pass: ops/linear_cublas.py) and torch (reference, fp32 math; fp64 for
fp64 inputs). Backward: dX and dW with torch.matmul, the elementwise part (activation derivative,
gate, d(bias), d(gate)) in one Triton pass over dy and the saved pre-activation. The input may come in two parts
(``x_tail``), read as their concatenation along channels without writing it, or blended per sample (``mix``:
``mix * x + (1 - mix) * x_tail``, SVD's AlphaBlender before its container's proj_out) without writing the blend.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._autocast import autocast_off, autocast_operands
from ._checks import check_activation, check_eps, check_out_dtype, check_tensor, dense, rows_as
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    register_autograd_keeping_backend,
    register_eager,
    triton_refusals,
)
from .linear_cublas import choose_gemm_placement, gemm_placement, linear_then_epilogue

SUPPORTED_ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def sum_as(g: Tensor, dims, dtype: torch.dtype) -> Tensor:
    """``g`` summed over ``dims`` in the compute dtype (fp32; fp64 for fp64 g), returned in ``dtype`` (a bias's
    gradient). Where ``dtype`` is g's own, one sum: PyTorch sums fp16/bf16 tensors in fp32 and rounds once (CPU and
    CUDA), the result of an fp32 sum and a cast without the cast's extra pass."""
    if dtype == g.dtype:
        return g.sum(dims)
    return g.sum(dims, dtype=compute_dtype(g)).to(dtype)


def activation_torch(activation: str | None, z: Tensor) -> Tensor:
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    return z


def activation_grad_torch(activation: str | None, z: Tensor, dy: Tensor) -> Tensor:
    """dy * act'(z), written out (no autograd inside the op)."""
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * 0.7071067811865476))
        return dy * (cdf + z * torch.exp(-0.5 * z * z) * 0.3989422804014327)
    if activation == "gelu_tanh":
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z**3))
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        return dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * d_inner)
    if activation == "silu":
        s = torch.sigmoid(z)
        return dy * s * (1.0 + z * (1.0 - s))
    return dy


def gemm_torch(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b in the compute dtype. On CUDA the GEMM runs in the input dtype (cuBLAS accumulates in fp32), so the
    reference backend is not slower than the unfused module when it serves a GPU tensor."""
    cd = compute_dtype(x)
    # Inside an op the operands were already cast for autocast; a nested F.linear must not cast them again.
    with autocast_off(x.device.type):
        if x.is_cuda:
            return F.linear(x, weight, bias).to(cd)
        return F.linear(x.to(cd), weight.to(cd), None if bias is None else bias.to(cd))


def per_sample(name: str, t: Tensor, x: Tensor, width: int) -> Tensor:
    """A per-sample modulation vector as a [B, width] view (no copy): ``t`` is [B, width] or [B, 1, ..., width] with
    B = x.shape[0]; for 2-D x (rows without a sample axis) it is one vector per row, [M, width]. A batch of one is
    broadcast over the samples (a stride-0 view), as the stock elementwise ops broadcast it (e.g. one timestep for a
    batch)."""
    check_tensor(name, t)
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    b = x.shape[0]
    if t.dim() >= 2 and t.shape[0] == 1 and b > 1:
        t = t.expand(b, *t.shape[1:])
    ok = t.dim() >= 2 and t.shape[0] == b and t.shape[-1] == width and all(d == 1 for d in t.shape[1:-1])
    if not ok or t.dim() > max(2, x.dim()):
        raise ValueError(
            f"{name} must have shape ({b}, {width}) or ({b}, 1, {width}) for x of shape {tuple(x.shape)} "
            f"(one vector per sample x.shape[0], broadcast over tokens), got {tuple(t.shape)}"
        )
    return t.reshape(b, width) if t.dim() > 2 else t


def needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------------ torch reference


def _out_dtype(x: Tensor, gate: Tensor | None, residual: Tensor | None) -> torch.dtype:
    dtype = x.dtype
    for t in (gate, residual):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _joined(x: Tensor, x_tail: Tensor | None, mix: Tensor | None = None) -> Tensor:
    """The GEMM's input: x, [x | x_tail], or the per-sample blend mix * x + (1 - mix) * x_tail (computed in the
    compute dtype, rounded once to x's dtype, as the fused kernel does)."""
    if x_tail is None:
        return x
    if mix is None:
        return torch.cat([x, x_tail], dim=-1)
    cd = compute_dtype(x)
    m = _row_weights(mix, x.shape[0], cd)
    return (m * x.to(cd) + (1.0 - m) * x_tail.to(cd)).to(x.dtype)


def _row_weights(mix: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """[rows, 1]: each sample's blend weight repeated over its rows (rows grouped by sample, rows % S == 0)."""
    return mix.to(dtype).repeat_interleave(rows // mix.shape[0])[:, None]


def _fwd_torch(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail=None, mix=None, saturate=False):
    cd = torch.float64 if _out_dtype(x, gate, residual) == torch.float64 else torch.float32
    z = gemm_torch(_joined(x, x_tail, mix), weight, bias)
    out = activation_torch(activation, z)
    if gate is not None:
        out = (out.view(gate.shape[0], -1, out.shape[-1]) * gate.to(cd)[:, None, :]).view(out.shape)
    if residual is not None:
        out = out + residual.to(cd).reshape(out.shape)
    pre = z.to(x.dtype, copy=True) if save_pre else x.new_empty((0,))
    dtype = dtype or _out_dtype(x, gate, residual)
    if saturate:
        out = out.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    # out is a fresh tensor (z itself at most, which pre copies): no copy needed to keep the outputs unaliased.
    return out.to(dtype), pre


def _bwd_torch(dy, pre, gate, activation, need_dgate):
    cd = compute_dtype(dy)
    m, n = dy.shape
    g = dy.to(cd)
    z = pre.to(cd) if pre is not None else None
    dgate = dy.new_empty((0,), dtype=cd)
    if need_dgate:
        dgate = (g * activation_torch(activation, z)).view(gate.shape[0], -1, n).sum(1)
    if gate is not None:
        g = (g.view(gate.shape[0], -1, n) * gate.to(cd)[:, None, :]).view(m, n)
    dz = activation_grad_torch(activation, z, g) if activation is not None else g
    return dense(dz, dy.dtype, copy=True), dz.sum(0), dgate


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse_fwd(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail=None, mix=None,
                       saturate=False):  # fmt: skip
    return triton_refusals(x, weight, bias, gate, residual, x_tail, mix, dtypes=TRITON_DTYPES,
                           matmul=runs_triton_gemm(x, mix is not None))  # fmt: skip


def runs_triton_gemm(x: Tensor, blend: bool = False) -> bool:
    """Whether the triton backend of a fused GEMM op runs ldmopt's Triton GEMM for ``x`` (tl.dot, which the interpreter
    gets wrong for bf16), not cuBLAS's GEMM and an elementwise pass (ops/linear_cublas.py)."""
    return gemm_placement(x.device, blend) == "triton"


def _fwd_triton(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail=None, mix=None, saturate=False):
    from ldmopt.kernels.linear import linear_fwd as launch

    if choose_gemm_placement(x.device, blend=mix is not None) == "cublas":
        dtype = dtype or _out_dtype(x, gate, residual)
        return linear_then_epilogue(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail,
                                    saturate=saturate)  # fmt: skip
    mix = None if mix is None else mix.float()
    return launch(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail, mix, saturate=saturate)


def _bwd_triton(dy, pre, gate, activation, need_dgate):
    from ldmopt.kernels.linear import linear_bwd as launch

    dz, dbias, dgate = launch(dy, pre, gate, activation, need_dgate)
    return dz, dbias, dgate if dgate is not None else dy.new_empty((0,), dtype=torch.float32)


FORWARD = BackendTable("linear", [Backend("triton", _fwd_triton, _triton_refuse_fwd), Backend("torch", _fwd_torch)])
BACKWARD = BackendTable(
    "linear_backward",
    [
        Backend("triton", _bwd_triton, lambda dy, pre, gate, *a: triton_refusals(dy, pre, gate, dtypes=TRITON_DTYPES)),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


def check_epilogue_rows(op: str, x: Tensor, weight: Tensor, gate: Tensor | None, residual: Tensor | None) -> None:
    """Checked in the ops too, not only in ops.linear: the kernels index gate and residual rows from these shapes."""
    m, n = x.shape[0], weight.shape[0]
    if gate is not None and (gate.dim() != 2 or gate.shape[1] != n or not gate.shape[0] or m % gate.shape[0]):
        raise ValueError(f"{op}: gate of shape {tuple(gate.shape)} is not [B, {n}] with B dividing M={m}")
    if residual is not None and (residual.shape[-1] != n or residual.numel() != m * n):
        raise ValueError(f"{op}: residual of shape {tuple(residual.shape)} does not hold M={m} rows of {n}")


@torch.library.custom_op("ldmopt::linear_fwd", mutates_args=())
def linear_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gate: Tensor | None,
    residual: Tensor | None,
    activation: str,
    save_pre: bool,
    dtype: torch.dtype | None,
    x_tail: Tensor | None = None,
    mix: Tensor | None = None,
    saturate: bool = False,
) -> tuple[Tensor, Tensor]:
    """(y [M, N], pre): x [M, K] (with x_tail [M, K2]: the input is [x | x_tail], weight [N, K + K2]; with mix [S]
    as well, x_tail is [M, K] and the input mix[s] * x + (1 - mix[s]) * x_tail for the rows of sample s, M % S == 0),
    weight [N, K], bias [N], gate [B, N] (rows grouped by sample, M % B == 0), residual [M, N] or [B', T', N] with
    B' T' = M (any strides). y has ``dtype``, by default the promoted dtype of x, gate and residual. pre = x W^T + bias
    ([M, N] in x's dtype, saved for backward) when save_pre, else empty. saturate: y clamped to its dtype's finite
    range before the rounding, NaN kept (Flux's fp16 clip); forward only (``ops.linear`` clamps after the op when
    gradients are needed)."""
    if mix is not None and (
        x_tail is None or x_tail.shape != x.shape or mix.dim() != 1 or not mix.numel() or x.shape[0] % mix.numel()
    ):
        tail = None if x_tail is None else tuple(x_tail.shape)
        raise ValueError(
            f"linear_fwd: mix of shape {tuple(mix.shape)} needs x_tail shaped like x {tuple(x.shape)} (got {tail}) "
            "and one value per equal group of rows"
        )
    check_epilogue_rows("linear_fwd", x, weight, gate, residual)
    return FORWARD(x, weight, bias, gate, residual, activation or None, save_pre, dtype, x_tail, mix, saturate)


@linear_fwd.register_fake
def _(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail=None, mix=None, saturate=False):
    y = x.new_empty((x.shape[0], weight.shape[0]), dtype=dtype or _out_dtype(x, gate, residual))
    return y, (x.new_empty(y.shape) if save_pre else x.new_empty((0,)))


@torch.library.custom_op("ldmopt::linear_bwd", mutates_args=())
def linear_bwd(
    dy: Tensor, pre: Tensor | None, gate: Tensor | None, activation: str, need_dgate: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dz, dbias, dgate) of y = residual + gate * act(z): dz = act'(z) * gate * dy in dy's dtype; dbias [N] and
    dgate [B, N] (empty unless need_dgate) in the compute dtype (fp32, fp64 for fp64)."""
    # What the kernels and the reference read, checked for direct calls (the forward's backward always passes them).
    if (activation or need_dgate) and (pre is None or pre.shape != dy.shape):
        raise ValueError(
            f"linear_bwd: activation={activation!r}, need_dgate={need_dgate} read the pre-activation: pre must have "
            f"dy's shape {tuple(dy.shape)}, got {None if pre is None else tuple(pre.shape)}"
        )
    if gate is not None and (
        gate.dim() != 2 or gate.shape[1] != dy.shape[1] or not len(gate) or dy.shape[0] % len(gate)
    ):
        raise ValueError(f"linear_bwd: gate of shape {tuple(gate.shape)} is not [B, {dy.shape[1]}] with B dividing M")
    if need_dgate and gate is None:
        raise ValueError("linear_bwd: need_dgate=True needs the gate (dgate is per gate row)")
    return BACKWARD(dy, pre, gate, activation or None, need_dgate)


@linear_bwd.register_fake
def _(dy, pre, gate, activation, need_dgate):
    cd = compute_dtype(dy)
    dgate = dy.new_empty((gate.shape[0], dy.shape[1]) if need_dgate else (0,), dtype=cd)
    return dy.new_empty(dy.shape), dy.new_empty((dy.shape[1],), dtype=cd), dgate


def _setup_context(ctx, inputs, output):
    x, weight, bias, gate, residual, activation, save_pre, _dtype, *tail = inputs
    x_tail = tail[0] if tail else None
    mix = tail[1] if len(tail) > 1 else None
    if len(tail) > 2 and tail[2]:
        raise RuntimeError(
            "ldmopt::linear_fwd with saturate=True has no backward (the clamp's gradient needs the unclamped "
            "output); ldmopt.ops.linear(..., saturate=True) clamps after the op when gradients are needed"
        )
    # x (and x_tail) only for the weight's gradient, the blend's or a recomputed pre-activation: a frozen layer whose
    # input needs a gradient (adapter, ControlNet training) must not keep its [M, K] input alive until backward.
    # The blend's input gradients need only mix (dx = mix dA, dx_tail = (1 - mix) dA); its own gradient needs both.
    need = ctx.needs_input_grad
    need_dmix = len(need) > 9 and need[9]
    # Only a gradient through the GEMM recomputes the pre-activation (the residual's alone is dy itself).
    through_gemm = any(need[:4]) or (len(need) > 8 and need[8]) or need_dmix
    recompute = through_gemm and not save_pre and (bool(activation) or need[3])  # activation: "" for none
    keep_x = need[1] or need_dmix or recompute
    x_kept, tail_kept = (x, x_tail) if keep_x else (None, None)
    ctx.save_for_backward(x_kept, weight, bias, gate, output[1] if save_pre else None, tail_kept, mix)
    ctx.in_features, ctx.has_tail, ctx.has_gate = x.shape[1], x_tail is not None, gate is not None
    ctx.input_rows, ctx.input_dtypes = x.shape[0], (x.dtype, None if x_tail is None else x_tail.dtype)
    ctx.activation = activation or None
    ctx.residual_shape = None if residual is None else residual.shape
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dpre):
    x, weight, bias, gate, pre, x_tail, mix = ctx.saved_tensors
    if dy is None:
        return (None,) * 11
    need_dx, need_dw, need_db, need_dgate, need_dres = ctx.needs_input_grad[:5]
    need_dtail = len(ctx.needs_input_grad) > 8 and ctx.needs_input_grad[8]
    need_dmix = len(ctx.needs_input_grad) > 9 and ctx.needs_input_grad[9]
    activation = ctx.activation
    dres = dy.reshape(ctx.residual_shape) if need_dres else None
    if not (need_dx or need_dw or need_db or need_dgate or need_dtail or need_dmix):
        return None, None, None, None, dres, None, None, None, None, None, None  # the residual's alone: no GEMM
    if activation is None and gate is None:
        dz, dgate = dy, None
        dbias = sum_as(dy, 0, bias.dtype) if need_db else None
    else:
        if (activation is not None or need_dgate) and pre is None:
            # Only when a caller asked for no saved pre-activation yet needs gradients: recompute it.
            pre = gemm_torch(_joined(x, x_tail, mix), weight, bias).to(x.dtype)
        dz, dbias, dgate = call(linear_bwd, dy, pre if activation is not None or need_dgate else None, gate,
                                activation or "", need_dgate)  # fmt: skip
    if dz.dtype != weight.dtype:
        dz = dz.to(weight.dtype)  # dy arrived in the promoted dtype (e.g. an fp32 residual stream under autocast)
    k = ctx.in_features
    dmix = None
    if mix is not None:
        dx, dtail, dmix = _blend_input_grads(dz, weight, x, x_tail, mix, (need_dx, need_dtail, need_dmix), ctx)
    elif not ctx.has_tail:
        dx, dtail = (torch.matmul(dz, weight) if need_dx else None), None
    elif need_dx or need_dtail:
        dx_joined = torch.matmul(dz, weight)  # one GEMM; each part's gradient is a column view of it
        dx, dtail = dx_joined[:, :k], dx_joined[:, k:]
    else:
        dx = dtail = None
    dw = None
    if need_dw:
        dzt = dz.t()
        if mix is not None:
            dw = torch.matmul(dzt, _joined(x, x_tail, mix))  # the blend, recomputed as the kernel formed it
        else:
            dw = torch.matmul(dzt, x) if x_tail is None else torch.cat([dzt @ x, dzt @ x_tail], dim=1)
    db = dbias.to(bias.dtype) if need_db else None
    dg = dgate.to(gate.dtype) if need_dgate else None
    return dx, dw, db, dg, dres, None, None, None, (dtail if need_dtail else None), dmix, None


def _blend_input_grads(dz, weight, x, x_tail, mix, needs, ctx):
    """(dx, dx_tail, dmix) of the input mix[s] * x + (1 - mix[s]) * x_tail: one GEMM for its gradient dA, then
    dx = mix dA, dx_tail = (1 - mix) dA and dmix[s] = sum over the sample's rows of dA . (x - x_tail) (fp64 sums).
    x and x_tail are kept (not None) only when dmix is needed."""
    need_dx, need_dtail, need_dmix = needs
    if not (need_dx or need_dtail or need_dmix):
        return None, None, None
    (x_dtype, tail_dtype), total_rows = ctx.input_dtypes, ctx.input_rows
    cd = torch.float64 if x_dtype == torch.float64 else torch.float32
    da = torch.matmul(dz, weight).to(cd)
    rows = total_rows // mix.shape[0]
    m = _row_weights(mix, total_rows, cd)
    dx = (m * da).to(x_dtype) if need_dx else None
    dtail = ((1.0 - m) * da).to(tail_dtype) if need_dtail else None
    dmix = None
    if need_dmix:
        # Per-row dot products in the compute dtype, then fp64 sums over each sample's rows (no fp64 M x K copy).
        per_row = (da * (x.to(cd) - x_tail.to(cd))).sum(1)
        dmix = per_row.to(torch.float64).view(mix.shape[0], rows).sum(1).to(mix.dtype)
    return dx, dtail, dmix


def _differentiable_backward(ctx) -> bool:
    # Without an activation or gate the backward is matmuls and sums of dy with saved inputs (x, weight, the blend's
    # parts): PyTorch ops that differentiate exactly (torch.autograd.functional.jvp/hvp take this double backward).
    return ctx.activation is None and not ctx.has_gate


register_autograd_keeping_backend(linear_fwd, _backward, _setup_context, _differentiable_backward)
register_eager(linear_bwd)


# ------------------------------------------------------------------------------------------------ public function


def check_at_least_1d(name: str, x: Tensor) -> None:
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"{name}: x must have at least 1 dim ([..., K]), got shape {tuple(x.shape)}")


def check_linear_args(
    name: str,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows_multiple: int = 1,
    k: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Shared checks of x [..., K], weight [N*rows_multiple, K] and bias [N*rows_multiple] (messages name ``name``;
    ``k``: the input's width when x is only its first part; ``dtype``: the weight's required dtype, x's by default)."""
    check_at_least_1d(name, x)
    k = x.shape[-1] if k is None else k
    check_tensor("weight", weight, ndim=(2,))
    if weight.shape[1] != k:
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, expected (N, {k}) for x with K={k}")
    if weight.shape[0] % rows_multiple:
        raise ValueError(f"{name}: weight has {weight.shape[0]} rows, expected a multiple of {rows_multiple}")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and t.dtype != x.dtype:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype} but x has {x.dtype}; matching dtypes are required")
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but x is on {x.device}")
    if bias is not None:
        check_tensor("bias", bias, ndim=(1,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{name}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _residual_rows(residual: Tensor, n: int) -> Tensor:
    """The residual as [M, N] rows, else as [B', T', N] (a stream whose sample and token axes have no common row
    stride, e.g. a transposed patch embedding: the kernel addresses both), viewed without a copy where possible."""
    # Decided from the strides, not by catching view's error: torch.jit.trace crashes after a caught op error.
    if _mergeable(residual.shape[:-1], residual.stride()[:-1]):
        return residual.view(-1, n)
    if residual.dim() >= 3 and _mergeable(residual.shape[:-2], residual.stride()[:-2]):
        return residual.view(-1, residual.shape[-2], n)
    return residual.reshape(-1, n)


def _mergeable(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether dims of these sizes and strides merge into one by a view (dims of size one aside)."""
    dims = [(size, step) for size, step in zip(shape, stride) if size != 1]
    return all(outer == inner * size for (_, outer), (size, inner) in itertools.pairwise(dims))


def _split_input(x: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(x, x_tail): a tensor, or the two parts of an input concatenated along its last axis."""
    if isinstance(x, torch.Tensor):
        return x, None
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        count = len(x) if isinstance(x, (tuple, list)) else type(x).__name__
        raise ValueError(
            f"linear: x must be a tensor or a pair of tensors (concatenated along the last axis), got {count}"
        )
    head, tail = x
    check_tensor("x[0]", head)
    check_tensor("x[1]", tail)
    if head.dim() < 1 or tail.shape[:-1] != head.shape[:-1]:
        raise ValueError(
            f"linear: x[1] has shape {tuple(tail.shape)}; it must match x[0] {tuple(head.shape)} in every axis but "
            "the last"
        )
    if tail.device != head.device:
        raise ValueError(f"linear: x[1] is on {tail.device} but x[0] is on {head.device}; both parts must match")
    return head, tail


def _common_dtype(x: Tensor, x_tail: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Two parts of different dtypes promoted to a common one, as ``torch.cat`` would (one part is copied then)."""
    if x_tail is None or x_tail.dtype == x.dtype:
        return x, x_tail
    dtype = torch.promote_types(x.dtype, x_tail.dtype)
    return x.to(dtype), x_tail.to(dtype)


def linear(
    x: Tensor | tuple[Tensor, Tensor],
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = None,
    gate: Tensor | None = None,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    mix: Tensor | None = None,
    clip_fp16: bool = False,
    next_norm_eps: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``residual + gate[b] * act(x @ weight.T + bias)`` in one GEMM with a fused epilogue.

    x is [..., K] (any leading dims), weight [N, K] and bias [N] as in nn.Linear, same dtype as x. x may also be a pair
    ``(x_head, x_tail)`` of [..., K1] and [..., K2] tensors (K1 + K2 = K, same leading shape) read as their
    concatenation along the last axis, which is never written (Flux's ``proj_out(cat([attn, mlp], -1))``); parts of
    different dtypes are promoted to a common one first, as ``torch.cat`` does (after autocast's casts). With ``mix``
    (one weight per sample x.shape[0]: shape (B,), (B, 1, ..., 1) or a single value) the pair has one shape and the
    input is their blend ``mix * x_head + (1 - mix) * x_tail`` (diffusers' AlphaBlender before SVD's proj_out),
    formed in fp32 in the GEMM's loads and rounded once to the input dtype; the blend is never written. (Under
    torch.autocast both parts are cast to the autocast dtype first, as F.linear would cast the blend.)
    ``activation``: None, "gelu" (erf), "gelu_tanh" or "silu". ``gate`` (DiT/SD3/Flux gated residual) is one [N]
    vector per sample x.shape[0], shaped (B, N) or (B, 1, N), broadcast over the tokens; for 2-D x it is one vector
    per row (M, N).
    ``residual`` has the output's shape [..., N]. Accumulation and epilogue in fp32, one rounding to x's dtype at the
    end (on GPUs by default the GEMM is cuBLAS's, its output rounded to x's dtype before the epilogue pass, as the
    unfused ops round it: ops/linear_cublas.py). gate and residual may have another float dtype: the output takes the
    promoted dtype, as the unfused ops do, or ``out_dtype`` (one rounding of the fp32 epilogue, e.g. Wan's
    ``(h.float() + ff(x).float() * gate).type_as(h)`` with an fp32 gate and a bf16 stream: ``out_dtype=h.dtype``).
    ``clip_fp16``: an fp16 result is clamped to [-65504, 65504] before it is rounded, NaN kept (Flux's
    ``clip(-65504, 65504)`` of its fp16 stream, otherwise a pass of its own; other dtypes are left as they are). When
    gradients are needed the clamp runs after the op, as torch.clamp (its gradient needs the unclamped values).
    Under torch.autocast x, weight and bias are cast to the autocast dtype first, as F.linear does. Tolerance versus
    an fp64 reference: within 2x the error of the unfused PyTorch ops in the output dtype.
    ``next_norm_eps``: also return, as ``(y, stats)``, the LayerNorm statistics of y's rows over its last axis with
    this eps (:func:`layer_norm_stats`'s [2, M]: what ``layer_norm_linear(y, ..., stats=stats)`` takes), summed in the
    GEMM's epilogue, so the LayerNorm reading y next runs no statistics pass (one input tensor, no ``mix`` or
    ``clip_fp16``).
    """
    x, x_tail = _split_input(x)
    check_at_least_1d("linear", x)
    x, weight, bias, x_tail = autocast_operands(x, weight, bias, x_tail)
    x, x_tail = _common_dtype(x, x_tail)
    if mix is not None:
        mix = _per_sample_mix(mix, x, x_tail)
    # The weight's K is checked against the joined width (both parts' channels; a blend's is one part's).
    joined_k = x.shape[-1] + (0 if x_tail is None or mix is not None else x_tail.shape[-1])
    check_linear_args("linear", x, weight, bias, k=joined_k)
    check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
    n = weight.shape[0]
    out_shape = (*x.shape[:-1], n)
    if gate is not None:
        if x.dim() < 2:
            raise ValueError(f"gate needs x with a sample axis ([B, ..., K]), got x of shape {tuple(x.shape)}")
        gate = per_sample("gate", gate, x, n)
    if residual is not None:
        check_tensor("residual", residual)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have the output's shape {out_shape}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
        residual = _residual_rows(residual, n)
    x2 = x.reshape(-1, x.shape[-1])
    tail2 = None if x_tail is None else x_tail.reshape(-1, x_tail.shape[-1])
    save_pre = (activation is not None or (gate is not None and gate.requires_grad)) and needs_grad(
        x, weight, bias, gate, x_tail, mix
    )
    check_out_dtype(out_dtype)
    saturate = clip_fp16 and (out_dtype or _out_dtype(x, gate, residual)) == torch.float16
    clamp_after = saturate and needs_grad(x, weight, bias, gate, residual, x_tail, mix)
    if next_norm_eps is not None:
        if x_tail is not None or clip_fp16:
            raise ValueError("linear: next_norm_eps needs a single input tensor x, without mix or clip_fp16")
        from .linear_stats import linear_stats_fwd  # it imports this module

        y, _pre, stats = call(linear_stats_fwd, x2, weight, bias, gate, residual, activation or "", save_pre,
                              out_dtype, check_eps(next_norm_eps))  # fmt: skip
        return rows_as(y, out_shape), stats
    y, _pre = call(linear_fwd, x2, weight, bias, gate, residual, activation or "", save_pre, out_dtype, tail2, mix,
                   saturate and not clamp_after)  # fmt: skip
    if clamp_after:
        y = y.clamp(-torch.finfo(y.dtype).max, torch.finfo(y.dtype).max)
    return rows_as(y, out_shape)


def _per_sample_mix(mix: Tensor, x: Tensor, x_tail: Tensor | None) -> Tensor:
    """The blend weight as one value per sample x.shape[0] ([B], a view where possible)."""
    if x_tail is None or x_tail.shape != x.shape:
        got = "one tensor" if x_tail is None else f"parts of shapes {tuple(x.shape)} and {tuple(x_tail.shape)}"
        raise ValueError(f"linear: mix blends two inputs of one shape, x=(x_head, x_tail); got {got}")
    check_tensor("mix", mix)
    if mix.device != x.device:
        raise ValueError(f"mix is on {mix.device} but x is on {x.device}")
    b = x.shape[0] if x.dim() >= 2 else 1
    if mix.numel() == 1:
        return mix.reshape(1).expand(b)
    if x.dim() < 2 or mix.shape[0] != b or mix.numel() != b:
        raise ValueError(
            f"mix must hold one value per sample x.shape[0] ({b},), or (B, 1, ..., 1), for x of shape "
            f"{tuple(x.shape)}; got {tuple(mix.shape)}"
        )
    return mix.reshape(b)
