"""A LayerNorm read through the loads of the GEMM after it: ``act(layer_norm(x) @ weight.T + bias)``, or GEGLU.

Custom ops ``ldmopt::layer_norm_stats`` (fp32 row mean and rstd, [2, M]: one read of x) and
``ldmopt::layer_norm_linear_fwd`` (the GEMM normalising each input tile in registers from those statistics, in fp32,
rounded once to the weight's dtype as the norm's output would be, then the dot); backends triton (kernels/
layer_norm_stats.py, and kernels/linear.py / kernels/geglu.py with ``NORM``) and torch (reference, fp32 math; fp64 for
fp64 inputs); the statistics also cuda (ldmopt._C's csrc/layer_norm, where the extension is built).

What it saves: the unfused norm reads x and writes its output, which the GEMM reads; here the statistics pass reads x
and the GEMM reads x: the norm's output is never written. Several GEMMs reading one norm (diffusers' to_q, to_k and
to_v) share one statistics pass (``stats=``). On GPUs by default (ops/linear_cublas.py) the triton backend writes the
norm's output in one pass from those statistics (``ldmopt::layer_norm_apply``) for cuBLAS's GEMM, then runs the
epilogue as one pass: the measured Triton GEMMs were slower than cuBLAS.

Backward: the elementwise part of the epilogue as ``ldmopt::linear_bwd`` / ``ldmopt::geglu_bwd``, then dH = dz W and
dW = dz^T h with h recomputed from the saved statistics in one pass (``ldmopt::layer_norm_apply``), and LayerNorm's
backward from the same statistics in the compute dtype (fp32, fp64 for fp64): dx = rstd (g - mean(g) - xhat
mean(g xhat)) with g = dH w, in one row pass (``ldmopt::adaln_modulate_bwd`` with the weight as its scale, which
also sums the norm's weight and bias gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._autocast import autocast_enabled, autocast_operands
from ._checks import check_activation, check_eps, check_tensor
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    cuda_extension_refusals,
    register_autograd_keeping_backend,
    register_eager,
    statistics_source,
    triton_refusals,
)
from .adaln_modulate import adaln_modulate_bwd
from .geglu import _fwd_torch as _geglu_fwd_torch
from .geglu import geglu_bwd
from .layer_norm_apply import apply_reference, layer_norm_apply, row_width_refusals, triton_apply_refusals
from .linear import TRITON_DTYPES, check_linear_args, compute_dtype, linear_bwd, needs_grad, runs_triton_gemm, sum_as
from .linear import _fwd_torch as _linear_fwd_torch
from .linear_cublas import choose_gemm_placement, linear_then_epilogue

#: Epilogues after the normalised GEMM: an activation of ``ops.linear``, or diffusers' GEGLU (``weight`` [2I, K]).
SUPPORTED_ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "geglu")


# ------------------------------------------------------------------------------------------------ statistics


def _stats_torch(x, eps):
    xc = x.to(compute_dtype(x))
    mean = xc.mean(1)
    var = (xc - mean[:, None]).square().mean(1)
    return torch.stack([mean, torch.rsqrt(var + eps)])


def _stats_triton(x, eps):
    from ldmopt.kernels.layer_norm_stats import layer_norm_stats as launch

    return launch(x, eps)


def _stats_refuse_triton(x, eps):
    reasons = triton_refusals(x, dtypes=TRITON_DTYPES)  # Triton missing among them: the width check imports it
    return reasons or row_width_refusals("layer_norm_stats", x.shape[1], "the statistics kernel")


def _stats_cuda(x, eps):
    return torch.ops.ldmopt.layer_norm_stats_cuda(x, eps)


def _stats_refuse_cuda(x, eps):
    """ldmopt._C's row statistics (one C++ op call, a fraction of a Triton launch's host time): 2-D x in
    fp32/fp16/bf16 with unit column stride and at least one column."""
    reasons = cuda_extension_refusals("layer_norm_stats_cuda", x)
    if reasons:
        return reasons
    if x.dtype not in TRITON_DTYPES:
        reasons.append(f"x dtype {x.dtype} (the CUDA kernel serves fp32/fp16/bf16)")
    if x.dim() != 2 or x.shape[1] == 0:
        reasons.append(f"x of shape {tuple(x.shape)} (the CUDA kernel takes [rows, C] with C >= 1)")
    elif x.shape[1] > 1 and x.stride(1) != 1:
        reasons.append(f"x strides {x.stride()}: the CUDA kernel reads rows with unit column stride")
    return reasons


STATS = BackendTable(
    "layer_norm_stats",
    [
        Backend("cuda", _stats_cuda, _stats_refuse_cuda),
        Backend("triton", _stats_triton, _stats_refuse_triton),
        Backend("torch", _stats_torch),
    ],
)


@torch.library.custom_op("ldmopt::layer_norm_stats", mutates_args=())
def layer_norm_stats_op(x: Tensor, eps: float) -> Tensor:
    """[2, M]: the means, then the rstds 1 / sqrt(var + eps) (biased variance) of x's rows [M, C], in the compute dtype
    (fp32; fp64 for fp64 x). Not differentiable: layer_norm_linear's backward differentiates through them."""
    return STATS(x, eps)


@layer_norm_stats_op.register_fake
def _(x, eps):
    return x.new_empty((2, x.shape[0]), dtype=compute_dtype(x))


register_eager(layer_norm_stats_op)


# ------------------------------------------------------------------------------------------------ normalised GEMM


def _fwd_torch(x, stats, norm_weight, norm_bias, weight, bias, activation, save_pre, positions=None, position_rows=1):
    # The norm's output (plus positions), rounded once as a GEMM reads it.
    h = apply_reference(x, stats, norm_weight, norm_bias, positions, position_rows, weight.dtype)
    return _gemm_torch(h, weight, bias, activation, save_pre)


def _gemm_torch(h, weight, bias, activation, save_pre):
    """(y, pre) of the GEMM and its epilogue on the norm's output h, as the linear and GEGLU references compute it."""
    if activation == "geglu":
        return _geglu_fwd_torch(h, weight, bias, save_pre)
    return _linear_fwd_torch(h, weight, bias, None, None, activation, save_pre, weight.dtype)


def _fwd_triton(x, stats, norm_weight, norm_bias, weight, bias, activation, save_pre, positions=None, position_rows=1):
    if choose_gemm_placement(x.device) == "cublas":
        # The norm's output written by its own pass (a launch where the Triton GEMM normalises in its loads), then
        # cuBLAS and the epilogue pass. The pass reads contiguous statistics and rows up to its MAX_C channels (no
        # diffusion model has wider); wider rows are normalised by the reference's ops, even under a forced backend.
        stats = stats.contiguous()
        if triton_apply_refusals(x, stats, norm_weight, norm_bias, positions, position_rows, weight.dtype):
            h = apply_reference(x, stats, norm_weight, norm_bias, positions, position_rows, weight.dtype)
        else:
            h = layer_norm_apply(x, stats, norm_weight, norm_bias, positions, position_rows, weight.dtype)
        geglu = activation == "geglu"
        return linear_then_epilogue(h, weight, bias, None, None, "gelu" if geglu else activation, save_pre,
                                    weight.dtype, glu=geglu)  # fmt: skip
    norm = (stats, norm_weight, norm_bias)
    if activation == "geglu":
        from ldmopt.kernels.geglu import geglu_fwd as launch_geglu

        return launch_geglu(x, weight, bias, save_pre, norm=norm)
    from ldmopt.kernels.linear import linear_fwd as launch

    pos = None
    if positions is not None:  # the kernel reads table rows with unit column stride
        pos = (positions if positions.stride(1) == 1 else positions.contiguous(), position_rows)
    return launch(x, weight, bias, None, None, activation, save_pre, weight.dtype, norm=norm, positions=pos)


def _refuse_triton(x, stats, norm_weight, norm_bias, weight, bias, activation, save_pre, positions=None, _rows=1):
    reasons = triton_refusals(
        x, stats, norm_weight, norm_bias, weight, bias, positions, dtypes=TRITON_DTYPES, matmul=runs_triton_gemm(x)
    )
    if stats.dtype != torch.float32:
        reasons.append(f"statistics in {stats.dtype} (the kernels read fp32)")
    if positions is not None and activation == "geglu":
        reasons.append("positions with GEGLU (the GEGLU kernel adds none; diffusers adds them before attention only)")
    return reasons


FORWARD = BackendTable(
    "layer_norm_linear", [Backend("triton", _fwd_triton, _refuse_triton), Backend("torch", _fwd_torch)]
)


@torch.library.custom_op("ldmopt::layer_norm_linear_fwd", mutates_args=())
def layer_norm_linear_fwd(
    x: Tensor,
    stats: Tensor,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    save_pre: bool,
    positions: Tensor | None = None,
    position_rows: int = 1,
) -> tuple[Tensor, Tensor]:
    """(y, pre): y = act(h W^T + bias) [M, N] (GEGLU: [M, N / 2]) in the weight's dtype, h = the LayerNorm of x [M, K]
    from stats [2, M] (layer_norm_stats) and the affine norm_weight/norm_bias [K] (or None), plus, with positions
    [P, K], positions[(m // position_rows) % P] on row m. pre: the GEMM's output ([M, N], saved for backward) when
    save_pre, else empty."""
    act = activation or None
    return FORWARD(x, stats, norm_weight, norm_bias, weight, bias, act, save_pre, positions, position_rows)


@layer_norm_linear_fwd.register_fake
def _(x, stats, norm_weight, norm_bias, weight, bias, activation, save_pre, positions=None, position_rows=1):
    n = weight.shape[0]
    y = x.new_empty((x.shape[0], n // 2 if activation == "geglu" else n), dtype=weight.dtype)
    return y, x.new_empty((x.shape[0], n) if save_pre else (0,), dtype=weight.dtype)


def _setup_context(ctx, inputs, output):
    x, stats, norm_weight, norm_bias, weight, bias, activation, save_pre, *rest = inputs
    positions = rest[0] if rest else None
    ctx.save_for_backward(x, stats, norm_weight, norm_bias, weight, bias, output[1] if save_pre else None, positions)
    ctx.position_rows = rest[1] if len(rest) > 1 else 1
    ctx.activation = activation or None
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dpre):
    x, stats, norm_weight, norm_bias, weight, bias, pre, positions = ctx.saved_tensors
    if dy is None:
        return (None,) * 10
    stats = stats.contiguous()  # a caller's statistics may be a view; the norm's passes read them by row, as forward
    need_dx, _, need_dnw, need_dnb, need_dw, need_db = ctx.needs_input_grad[:6]
    activation = ctx.activation
    h_low = None  # what the GEMM read: for dW, or to recompute its output
    if need_dw or (pre is None and activation is not None):
        h_low = layer_norm_apply(x, stats, norm_weight, norm_bias, positions, ctx.position_rows, weight.dtype)
    if pre is None and activation is not None:
        pre = _gemm_torch(h_low, weight, bias, activation, True)[1]
    if activation == "geglu":
        dz, dbias = call(geglu_bwd, dy, pre)
    elif activation is None:
        dz, dbias = dy, (sum_as(dy, 0, bias.dtype) if need_db else None)
    else:
        dz, dbias, _ = call(linear_bwd, dy, pre, None, activation, False)
    dz = dz.to(weight.dtype)
    dw = torch.matmul(dz.t(), h_low) if need_dw else None
    db = dbias.to(bias.dtype) if need_db else None
    dx = dnw = dnb = None
    if need_dx or need_dnw or need_dnb:
        dx, dnw, dnb = _layer_norm_input_grads(torch.matmul(dz, weight), x, stats, norm_weight)
        dnw = dnw.to(norm_weight.dtype) if need_dnw else None
        dnb = dnb.to(norm_bias.dtype) if need_dnb else None
        dx = dx if need_dx else None
    return dx, None, dnw, dnb, dw, db, None, None, None, None  # positions: a fixed table (checked)


def _layer_norm_input_grads(dh: Tensor, x: Tensor, stats: Tensor, norm_weight: Tensor | None):
    """(dx in x's dtype, d norm weight, d norm bias in the compute dtype) of h = layer_norm(x) * w + b from dH, in one
    row pass: adaLN's backward over a single "sample" whose scale is the norm's weight (multiplied as it is, not as
    1 + scale) and whose scale/shift gradients are the sums over every row. The positions added after the affine
    have no gradient."""
    cd = stats.dtype
    k = x.shape[1]
    # the norm's weight as it is: both backends read the scale in its own dtype and multiply in the compute dtype
    weight = norm_weight if norm_weight is not None else torch.ones(k, device=x.device, dtype=cd)
    mean, rstd = stats[0].contiguous(), stats[1].contiguous()
    dx, dscale, dshift, _, _ = call(adaln_modulate_bwd, dh, x, mean, rstd, weight[None], None, None, None, True)
    return dx, dscale[0], dshift[0]


register_autograd_keeping_backend(layer_norm_linear_fwd, _backward, _setup_context)


# ------------------------------------------------------------------------------------------------ public functions


def layer_norm_stats(x: Tensor, eps: float = 1e-5) -> Tensor:
    """The row statistics of ``layer_norm(x)`` over its last axis: [2, M] (M = x.numel() / x.shape[-1]), the means
    then the rstds 1 / sqrt(var + eps), in fp32 (fp64 for fp64 x). Computed once and passed as ``stats=`` to several
    :func:`layer_norm_linear` calls that read the same norm. No gradient flows through them (x is detached): the
    GEMMs' backward differentiates through the statistics themselves."""
    check_tensor("x", x)
    eps = check_eps(eps)
    if x.dim() < 1 or not x.shape[-1]:
        raise ValueError(f"layer_norm_stats: x must be [..., C] with C > 0, got shape {tuple(x.shape)}")
    return call(layer_norm_stats_op, statistics_source(x).reshape(-1, x.shape[-1]), eps)


def layer_norm_linear(
    x: Tensor,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    eps: float | None = None,
    activation: str | None = None,
    stats: Tensor | None = None,
    positions: Tensor | None = None,
    position_rows: int = 1,
) -> Tensor:
    """``act(F.linear(F.layer_norm(x, (K,), norm_weight, norm_bias, eps), weight, bias))`` with the norm read in the
    GEMM's loads: its output is never written.

    x is [..., K]; norm_weight / norm_bias [K] or None (nn.LayerNorm's affine); weight [N, K] and bias [N] as in
    nn.Linear. ``activation``: None, "gelu" (erf), "gelu_tanh", "silu" or "geglu" (diffusers' GEGLU: weight is
    ``GEGLU.proj``'s [2I, K], value rows first, and the output [..., I] is ``h * gelu(g)``). ``stats``: this x's
    :func:`layer_norm_stats` with the same eps, to share one statistics pass between GEMMs reading one norm (else
    computed here). ``positions`` [P, K]: a fixed table (no gradient; diffusers' sinusoidal embeddings) added to the
    norm's output, row m of x's rows [M, K] taking ``positions[(m // position_rows) % P]`` (P frames of
    ``position_rows`` tokens each, repeating). The norm is formed in fp32 and rounded once to the weight's dtype, as the
    unfused norm's output is (or as autocast casts it); the output has the weight's dtype. Under torch.autocast the
    weight and bias are cast to the autocast dtype (as F.linear does) and x, whose fp32 norm autocast keeps in fp32, is
    read as it is. Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in the weight's
    dtype.
    """
    # None, not a float default: one Dynamo graph input shared by every call (pytorch/pytorch#193194)
    eps = 1e-5 if eps is None else eps
    check_tensor("x", x)
    autocast = autocast_enabled(x.device.type)
    if autocast:
        _, weight, bias = autocast_operands(x, weight, bias)
    k = x.shape[-1] if x.dim() else 0
    check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
    # Outside autocast the weight has x's dtype, as F.linear of the norm's output requires; under it, any float x.
    check_linear_args("layer_norm_linear", x, weight, bias, rows_multiple=2 if activation == "geglu" else 1,
                      dtype=weight.dtype if autocast and x.is_floating_point() else None)  # fmt: skip
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is not None:
            check_tensor(name, t, ndim=(1,))
            if t.shape[0] != k or t.device != x.device:
                raise ValueError(
                    f"layer_norm_linear: {name} must be a ({k},) tensor on {x.device}, got {tuple(t.shape)} on "
                    f"{t.device}"
                )
    rows = x.reshape(-1, k)
    if stats is None:
        stats = layer_norm_stats(x, eps)
    elif stats.shape != (2, rows.shape[0]) or stats.dtype != compute_dtype(x) or stats.device != x.device:
        raise ValueError(
            f"layer_norm_linear: stats must be layer_norm_stats(x) of shape (2, {rows.shape[0]}) in "
            f"{compute_dtype(x)} on {x.device}, got {tuple(stats.shape)} in {stats.dtype} on {stats.device}"
        )
    if positions is not None:
        check_tensor("positions", positions, ndim=(2,))
        if positions.shape[1] != k or positions.device != x.device or positions.requires_grad:
            raise ValueError(
                f"layer_norm_linear: positions must be a fixed [P, {k}] table on {x.device} (no gradient), got "
                f"{tuple(positions.shape)} on {positions.device}, requires_grad={positions.requires_grad}"
            )
        # a SymInt under non-strict torch.export with dynamic sizes (the rows per frame, h * w)
        if not isinstance(position_rows, (int, torch.SymInt)) or isinstance(position_rows, bool) or position_rows < 1:
            raise ValueError(f"layer_norm_linear: position_rows must be a positive int, got {position_rows!r}")
    save_pre = activation is not None and needs_grad(x, norm_weight, norm_bias, weight, bias)
    y, _pre = call(layer_norm_linear_fwd, rows, statistics_source(stats), norm_weight, norm_bias, weight, bias,
                   activation or "", save_pre, positions, position_rows)  # fmt: skip
    return y.view(*x.shape[:-1], y.shape[-1])
