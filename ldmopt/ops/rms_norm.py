"""RMSNorm: ``y = x * rsqrt(mean(x^2, -1) + eps) [* weight] [+ bias]`` in one pass over each row, fp32 statistics and
affine, one rounding of y. The query/key norms of SD3.5, HunyuanVideo, LTX and others (diffusers' ``RMSNorm``, which
runs as eight elementwise passes with an fp32 copy of the activation; torch.nn.RMSNorm, in Flux and Wan, is already
one fused kernel on a GPU). ``layer_norm_rope``: the same kernel centring each row first, a LayerNorm (CogVideoX's
per-head query/key norms), whose statistics are then [2, M] (rstd, mean).

Optionally followed by a rotary position embedding of y in the same pass (``rope``): Wan's query/key norm across
heads and RoPE, which diffusers runs as one norm kernel and eight elementwise passes over strided halves, half of
them writing fp32 temporaries.

Custom ops ``ldmopt::rms_norm_fwd`` / ``ldmopt::rms_norm_bwd``; backends triton (kernels/rms_norm.py) and torch
(reference, fp32 math; fp64 for fp64 inputs). Saved for backward: x and the per-row fp32 rstd (and mean, for the
LayerNorm); the unfused path keeps the fp32 copy of x, the normalised activation and its rounded copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_eps, check_out_dtype, check_tensor, check_vector, dense
from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend, register_eager, triton_refusals
from .linear import TRITON_DTYPES, compute_dtype, needs_grad

# ------------------------------------------------------------------------------------------------ torch reference


def _partner(y: Tensor) -> Tensor:
    """(-y[2i+1], y[2i]) for each pair of each row of y [M, C]."""
    pairs = y.view(y.shape[0], -1, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).view(y.shape)


def _tables(y: Tensor, cos: Tensor, sin: Tensor, rows_per_position: int, per_pair: bool) -> tuple[Tensor, Tensor]:
    """cos and sin as [M, C] in y's dtype: row r at position (r // rows_per_position) % P, column c at table column
    (c // 2) % W for one angle per pair, c % W for one value per element."""
    (m, c), (p, w) = y.shape, cos.shape
    position = torch.arange(m, device=y.device) // rows_per_position % p
    column = torch.arange(c, device=y.device) // (2 if per_pair else 1) % w
    return tuple(t.to(y.dtype)[position][:, column] for t in (cos, sin))


def _fwd_torch(x, weight, bias, eps, dtype, save, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False):
    cd = compute_dtype(x)
    xc = x.to(cd)
    mean = xc.mean(-1) if center else None
    if center:
        xc = xc - mean[:, None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    if cos is not None:
        cos, sin = _tables(y, cos, sin, rope_rows, rope_per_pair)
        y = y * cos + _partner(y) * sin
    y = dense(y, dtype)
    if not save:
        return y, rstd.new_empty((0,))
    return y, torch.stack([rstd, mean]) if center else rstd


def _bwd_torch(dy, x, stats, weight, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False,
               bias_grad=False):  # fmt: skip
    cd = compute_dtype(x)
    rstd = (stats[0] if center else stats).to(cd)
    xhat = (x.to(cd) - stats[1].to(cd)[:, None] if center else x.to(cd)) * rstd[:, None]
    dyc = dy.to(cd)
    if cos is not None:  # the gradient of the normalised row (the transpose of the rotation)
        cos, sin = _tables(dyc, cos, sin, rope_rows, rope_per_pair)
        dyc = dyc * cos - _partner(dyc * sin)
    g = dyc * weight.to(cd) if weight is not None else dyc
    if center:  # LayerNorm: the mean's gradient too
        g = g - g.mean(-1, keepdim=True)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyc * xhat).sum(0) if weight is not None else xhat.new_empty((0,))
    db = dyc.sum(0) if bias_grad else xhat.new_empty((0,))
    return dense(dx, x.dtype), dw, db


# ------------------------------------------------------------------------------------------------ triton


def _triton_refuse(x, weight, bias, eps=None, dtype=None, save=None, cos=None, sin=None, *mapping) -> list[str]:
    from ldmopt import _env

    reasons = triton_refusals(x, weight, bias, cos, sin, dtypes=TRITON_DTYPES)
    if not reasons and _env.triton_available():
        from ldmopt.kernels.rms_norm import MAX_C

        if x.shape[-1] > MAX_C:
            reasons.append(f"rows of C={x.shape[-1]} channels (triton holds rows up to {MAX_C} in registers)")
    return reasons


def _fwd_triton(x, weight, bias, eps, dtype, save, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False):
    from ldmopt.kernels.rms_norm import Rope, rms_norm_fwd

    rope = Rope(cos, sin, rope_rows, rope_per_pair) if cos is not None else None
    return rms_norm_fwd(x, weight, bias, eps, dtype, save, rope=rope, center=center)


def _bwd_triton(dy, x, stats, weight, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False,
                bias_grad=False):  # fmt: skip
    from ldmopt.kernels.rms_norm import Rope, rms_norm_bwd

    rope = Rope(cos, sin, rope_rows, rope_per_pair) if cos is not None else None
    return rms_norm_bwd(dy, x, stats, weight, rope=rope, center=center, bias_grad=bias_grad)


def _bwd_triton_refuse(dy, x, rstd, weight, cos=None, sin=None, *mapping) -> list[str]:
    return _triton_refuse(x, weight, dy, cos=cos, sin=sin)


FORWARD = BackendTable("rms_norm", [Backend("triton", _fwd_triton, _triton_refuse), Backend("torch", _fwd_torch)])
BACKWARD = BackendTable(
    "rms_norm_backward",
    [
        Backend("triton", _bwd_triton, _bwd_triton_refuse),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    dtype: torch.dtype,
    save: bool,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    rope_rows: int = 1,
    rope_per_pair: bool = True,
    center: bool = False,
) -> tuple[Tensor, Tensor]:
    """(y [M, C] in ``dtype``, statistics in the compute dtype, empty unless save: rstd [M], or [2, M] (rstd, mean)
    with center): x [M, C]; weight, bias [C]; cos, sin: RoPE tables [P, W] or None; row r reads position
    (r // rope_rows) % P; column c reads (c // 2) % W with rope_per_pair (one angle per pair), c % W without (one
    value per element). center: the row centred first, a LayerNorm."""
    check_tables(cos, sin, rope_rows)
    return FORWARD(x, weight, bias, eps, dtype, save, cos, sin, rope_rows, rope_per_pair, center)


@rms_norm_fwd.register_fake
def _(x, weight, bias, eps, dtype, save, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False):
    stats = ((2, x.shape[0]) if center else (x.shape[0],)) if save else (0,)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(stats, dtype=compute_dtype(x))


@torch.library.custom_op("ldmopt::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    rope_rows: int = 1,
    rope_per_pair: bool = True,
    center: bool = False,
    bias_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [M, C] in x's dtype, dweight [C] in the compute dtype (empty without a weight), dbias [C] in the compute
    dtype (empty unless bias_grad)); rstd: the forward's statistics ([2, M] with center)."""
    check_tables(cos, sin, rope_rows)
    return BACKWARD(dy, x, rstd, weight, cos, sin, rope_rows, rope_per_pair, center, bias_grad)


@rms_norm_bwd.register_fake
def _(dy, x, rstd, weight, cos=None, sin=None, rope_rows=1, rope_per_pair=True, center=False, bias_grad=False):
    dw = x.new_empty((x.shape[1],) if weight is not None else (0,), dtype=compute_dtype(x))
    db = x.new_empty((x.shape[1],) if bias_grad else (0,), dtype=compute_dtype(x))
    return x.new_empty(x.shape), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, _dtype, save, cos, sin, rope_rows, rope_per_pair, *center = inputs
    ctx.save_for_backward(x, output[1] if save else None, weight, cos, sin)
    ctx.rope_mapping = (rope_rows, rope_per_pair)
    ctx.center = bool(center and center[0])
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _drstd):
    x, stats, weight, cos, sin = ctx.saved_tensors
    if dy is None:
        return (None,) * 11
    if stats is None:  # a caller asked for no saved state yet needs gradients: recompute the statistics
        xc = x.to(compute_dtype(x))
        mean = xc.mean(-1) if ctx.center else None
        rstd = torch.rsqrt((xc - mean[:, None] if ctx.center else xc).pow(2).mean(-1) + ctx.eps)
        stats = torch.stack([rstd, mean]) if ctx.center else rstd
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = call(rms_norm_bwd, dy, x, stats, weight, cos, sin, *ctx.rope_mapping, ctx.center, need_db)
    return (
        dx if need_dx else None,
        dw.to(weight.dtype) if need_dw else None,
        db.to(ctx.bias_dtype) if need_db else None,
        *(None,) * 8,
    )


register_autograd_keeping_backend(rms_norm_fwd, _backward, _setup_context)
register_eager(rms_norm_bwd)


# ------------------------------------------------------------------------------------------------ public function


_ROPE_LAYOUTS = ("pairs", "elements")


def check_tables(cos: Tensor | None, sin: Tensor | None, rope_rows: int) -> None:
    """What the ops read of the RoPE tables whatever their caller (torch.ops calls pass anything): both or neither,
    one 2-D shape with at least one position and column, at least one row per position (each index is taken modulo
    the tables' sizes)."""
    if (cos is None) != (sin is None):
        raise ValueError("rope tables: cos and sin must both be given or both be None")
    if cos is None:
        return
    if cos.dim() != 2 or sin.shape != cos.shape or not cos.numel():
        raise ValueError(
            f"rope tables cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must share one [P, W] shape, P, W >= 1"
        )
    if rope_rows < 1:
        raise ValueError(f"rope_rows={rope_rows}: at least one row per position")


def _check_rope(rope: object, layout: object, dim: object, x: Tensor, bias: Tensor | None) -> tuple:
    """(cos, sin, rows per position, per pair) as the kernels read them, or (None, None, 1, True) without rope."""
    if rope is None:
        return None, None, 1, True
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2):
        raise TypeError(f"rope must be a (cos, sin) pair of tensors or None, got {type(rope).__name__}")
    if layout not in _ROPE_LAYOUTS:  # no default: [P, D] tables read as pairs would silently rotate wrongly
        raise ValueError(
            f"rope_layout must be one of {_ROPE_LAYOUTS} with rope (pairs: tables [P, D/2], one angle per pair; "
            f"elements: tables [P, D], one value per element), got {layout!r}"
        )
    cos, sin = rope
    for name, t in (("rope cos", cos), ("rope sin", sin)):
        check_tensor(name, t, ndim=(2,))
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but the input is on {x.device}")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad; rms_norm's RoPE takes fixed angles (detach them)")
    if sin.shape != cos.shape:
        raise ValueError(f"rope cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    positions, width = cos.shape
    head = 2 * width if layout == "pairs" else width
    if head % 2 or x.shape[-1] % head:
        raise ValueError(
            f"rope tables of {width} columns ({layout}: heads of {head}) do not divide x's last dim {x.shape[-1]} into "
            "heads of an even size"
        )
    if not (isinstance(dim, int) and -x.dim() <= dim <= -2):
        raise ValueError(f"rope_dim must be a dim of x before the last (from {-x.dim()} to -2), got {dim!r}")
    rows = x.numel() // x.shape[-1]
    if x.shape[dim] == positions:
        rows_per_position = x[(0,) * (x.dim() + dim + 1)].numel() // x.shape[-1]  # the dims between dim and C
    elif rows == positions and dim == -2:  # one row of tables per row of x (heads between would be ambiguous)
        rows_per_position = 1
    else:
        raise ValueError(
            f"rope tables for {positions} positions do not match x of shape {tuple(x.shape)} at rope_dim={dim}: give "
            "one row of tables per position along rope_dim, or (rope_dim=-2) per row of x"
        )
    if bias is not None:
        raise ValueError("bias with rope is not supported (RoPE'd query/key norms have no bias)")
    return cos, sin, rows_per_position, layout == "pairs"


def rms_norm(
    x: Tensor | tuple[Tensor, Tensor],
    weight: Tensor | tuple[Tensor | None, Tensor | None] | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    rope: tuple[Tensor, Tensor] | None = None,
    rope_layout: str | None = None,
    rope_dim: int | None = None,
    cat_dim: int | None = None,
) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight + bias`` over the last dim, in one pass over each row.

    x is [..., C] (any leading dims: tokens, or tokens x heads for a per-head norm); weight and bias are [C] or None,
    of any float dtype. Statistics and affine in fp32, one rounding to ``out_dtype`` (default x's dtype).

    ``rope=(cos, sin)``: a rotary embedding of the normalised rows, in the same pass, ``y * cos + partner * sin``
    with partner = ``(-y[2i+1], y[2i])`` for each pair of each head (C = heads x D, or one head per row). The tables
    are [P, W] with P the positions, along ``rope_dim`` of x (dims between it and the last share a position: the
    heads of x [B, S, H, D] with rope_dim=-3), or one per row of x:

    - ``rope_layout="pairs"``: W = D/2, one angle per pair (Wan, whose tables repeat each angle: pass
      ``freqs_cos[..., 0::2]`` and ``freqs_sin[..., 1::2]``, views);
    - ``rope_layout="elements"``: W = D, one value per element, diffusers' ``apply_rotary_emb(use_real=True,
      use_real_unbind_dim=-1)`` layout (Flux).

    ``rope_layout`` has no default: the shape of the tables alone cannot tell [P, D/2] from [P, D]. The tables take
    no gradient; no bias with rope. fp16/bf16/fp32 tables are read by the kernel; fp64 ones (diffusers builds them
    so on MPS) send the call to the torch reference backend.

    ``x=(head, tail)`` with ``cat_dim``: the norm of ``torch.cat([head, tail], cat_dim)`` (a dim before the last),
    each part with its own weight (``weight=(w_head, w_tail)``, or one for both), in one pass that never writes the
    concatenation (Flux's text and image queries: ``cat_dim=1``). No bias; with rope the tables hold the joint
    sequence's positions along ``cat_dim`` (``rope_dim`` defaults to it). See ``ops.rms_norm_joint``.

    Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in the output dtype.
    """
    # None, not a float default: one Dynamo graph input shared by every call (pytorch/pytorch#193194)
    eps = 1e-6 if eps is None else eps
    if isinstance(x, (tuple, list)):
        from .rms_norm_joint import rms_norm_joint

        if bias is not None:
            raise ValueError("bias with two parts (x=(head, tail)) is not supported: query/key norms have none")
        if cat_dim is None:
            raise ValueError("x=(head, tail) needs cat_dim, the dim they are concatenated along")
        return rms_norm_joint(x, weight, eps, cat_dim=cat_dim, out_dtype=out_dtype, rope=rope,
                              rope_layout=rope_layout, rope_dim=rope_dim)  # fmt: skip
    if cat_dim is not None:
        raise ValueError(f"cat_dim={cat_dim!r} is for two parts, x=(head, tail); x is one tensor")
    if rope_dim is None:
        rope_dim = -2
    return _row_norm(x, weight, bias, eps, out_dtype, rope, rope_layout, rope_dim, center=False)


def _row_norm(x, weight, bias, eps, out_dtype, rope, rope_layout, rope_dim, center: bool) -> Tensor:
    check_tensor("x", x)  # also refuses empty tensors
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim ([..., C]), got a 0-d tensor")
    c = x.shape[-1]
    check_vector("weight", weight, c, x)
    check_vector("bias", bias, c, x)
    eps = check_eps(eps)
    check_out_dtype(out_dtype)
    # A LayerNorm's bias is added before the rotation (CogVideoX); the RMSNorms rotated here have none.
    rope_args = _check_rope(rope, rope_layout, rope_dim, x, None if center else bias)
    save = needs_grad(x, weight, bias)
    y, _stats = call(rms_norm_fwd, x.reshape(-1, c), weight, bias, eps, out_dtype or x.dtype, save, *rope_args,
                     center)  # fmt: skip
    return y.view(x.shape)


def layer_norm_rope(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    rope: tuple[Tensor, Tensor] | None = None,
    rope_layout: str | None = None,
    rope_dim: int = -2,
) -> Tensor:
    """``layer_norm(x) * weight + bias`` over the last dim, then (``rope``) its rotary embedding, in one pass over
    each row: the per-head query/key LayerNorm + RoPE of CogVideoX (also CogView3-Plus, ConsisID), which diffusers
    runs as torch's norm then about seven elementwise passes, most in fp32. Statistics, affine and rotation in fp32,
    one rounding to ``out_dtype`` (default x's dtype). ``rope``, ``rope_layout`` and ``rope_dim`` as in
    :func:`rms_norm`; the bias is added before the rotation, as the unfused modules do.

    Tolerance versus an fp64 reference: within 2x the error of the unfused PyTorch ops in the output dtype.
    """
    eps = 1e-5 if eps is None else eps  # as in rms_norm
    return _row_norm(x, weight, bias, eps, out_dtype, rope, rope_layout, rope_dim, center=True)
