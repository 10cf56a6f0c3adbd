"""RMSNorm (+ RoPE) of two inputs' concatenation along a dim before the last, the concatenation never written.

Flux's double-stream attention normalises the text and image queries with their own norms (``norm_added_q``,
``norm_q``), concatenates them along the tokens, and rotates the joint sequence; the same for the keys. The row
kernel here reads each output row from the part it lies in, with that part's weight, and rotates it by its position
in the joint sequence: the normalised parts and their concatenation are never written, only the joint result.

Custom op ``ldmopt::rms_norm_joint_fwd``; backends triton (kernels/rms_norm.py with ``TWO_PART``) and torch
(reference: each part by ``ops.rms_norm``'s reference, then ``torch.cat``). Backward: the joint gradient split into
the parts (views for one sample, copies otherwise, as ``torch.cat``'s backward hands them over) and
``ldmopt::rms_norm_bwd`` on each, with that part's rows of the saved statistics and of the tables.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_eps, check_out_dtype, check_tensor, check_vector
from ._dispatch import Backend, BackendTable, call, register_autograd_keeping_backend, triton_refusals
from .linear import TRITON_DTYPES, compute_dtype, needs_grad
from .rms_norm import _check_rope, _fwd_torch, check_tables, rms_norm_bwd

# ------------------------------------------------------------------------------------------------ the parts' rows


def _check_rows(x_head: Tensor, x_tail: Tensor, head_rows: int, tail_rows: int, w_head=None, w_tail=None,
                cos=None, sin=None, rope_rows: int = 1) -> None:  # fmt: skip
    """What the kernel would otherwise overrun or read differently from the reference: whole samples of rows, as
    many in each part, both weights or neither, tables of one sample's joint positions with whole positions in each
    part (the op is callable through torch.ops with anything)."""
    if (w_head is None) != (w_tail is None):
        raise ValueError("rms_norm_joint_fwd takes both parts' weights or neither (ops.rms_norm fills a missing one)")
    if x_head.dim() != 2 or x_tail.dim() != 2 or x_head.shape[1] != x_tail.shape[1]:
        raise ValueError(f"the parts must be [M, C] rows of one C, got {tuple(x_head.shape)} and {tuple(x_tail.shape)}")
    if head_rows < 1 or tail_rows < 1 or x_head.shape[0] % head_rows or x_tail.shape[0] % tail_rows:
        raise ValueError(
            f"parts of {x_head.shape[0]} and {x_tail.shape[0]} rows are not whole samples of {head_rows} and "
            f"{tail_rows} rows"
        )
    samples = x_head.shape[0] // head_rows
    if x_tail.shape[0] // tail_rows != samples:
        raise ValueError(f"the parts hold {samples} and {x_tail.shape[0] // tail_rows} samples; they must agree")
    check_tables(cos, sin, rope_rows)
    if cos is not None:
        # The backward hands each part its own rows of the tables: the joint sequence's positions, head part first.
        if head_rows % rope_rows or tail_rows % rope_rows:
            raise ValueError(
                f"rope_rows={rope_rows} does not divide the parts' {head_rows} and {tail_rows} rows per sample"
            )
        positions = (head_rows + tail_rows) // rope_rows
        if cos.shape[0] != positions:
            raise ValueError(
                f"rope tables of {cos.shape[0]} positions: a sample's joint sequence has {positions} "
                f"({head_rows} + {tail_rows} rows, {rope_rows} per position)"
            )


def _split(t: Tensor, samples: int, head_rows: int) -> tuple[Tensor, Tensor]:
    """A joint [M, ...] tensor's head-part and tail-part rows, as [M_head, ...] and [M_tail, ...]."""
    per_sample = t.reshape(samples, -1, *t.shape[1:])
    return per_sample[:, :head_rows].flatten(0, 1), per_sample[:, head_rows:].flatten(0, 1)


def _join(head: Tensor, tail: Tensor, samples: int) -> Tensor:
    return torch.cat([head.view(samples, -1, *head.shape[1:]), tail.view(samples, -1, *tail.shape[1:])], 1).flatten(
        0, 1
    )


def _split_tables(cos, sin, head_rows, rope_rows):
    """Each part's rows of the tables (their positions are the joint sequence's: the head part's come first)."""
    if cos is None:
        return (None, None), (None, None)
    first = head_rows // rope_rows
    return (cos[:first], sin[:first]), (cos[first:], sin[first:])


# ------------------------------------------------------------------------------------------------ backends


def _fwd_torch_joint(x_head, x_tail, w_head, w_tail, eps, dtype, save, head_rows, tail_rows, cos, sin, rope_rows,
                     rope_per_pair):  # fmt: skip
    samples = x_head.shape[0] // head_rows
    head_tables, tail_tables = _split_tables(cos, sin, head_rows, rope_rows)
    y_head, rstd_head = _fwd_torch(x_head, w_head, None, eps, dtype, save, *head_tables, rope_rows, rope_per_pair)
    y_tail, rstd_tail = _fwd_torch(x_tail, w_tail, None, eps, dtype, save, *tail_tables, rope_rows, rope_per_pair)
    return _join(y_head, y_tail, samples), _join(rstd_head, rstd_tail, samples) if save else rstd_head


def _fwd_triton_joint(x_head, x_tail, w_head, w_tail, eps, dtype, save, head_rows, tail_rows, cos, sin, rope_rows,
                      rope_per_pair):  # fmt: skip
    from ldmopt.kernels.rms_norm import Rope, TailPart, rms_norm_fwd

    rope = Rope(cos, sin, rope_rows, rope_per_pair) if cos is not None else None
    tail = TailPart(x_tail, w_tail, head_rows, tail_rows)
    return rms_norm_fwd(x_head, w_head, None, eps, dtype, save, rope=rope, tail=tail)


def _triton_refuse_joint(x_head, x_tail, w_head, w_tail, *args) -> list[str]:
    from ldmopt import _env

    cos, sin = args[-4:-2]
    reasons = triton_refusals(x_head, x_tail, w_head, w_tail, cos, sin, dtypes=TRITON_DTYPES)
    if not reasons and _env.triton_available():
        from ldmopt.kernels.rms_norm import MAX_C

        if x_head.shape[-1] > MAX_C:
            reasons.append(f"rows of C={x_head.shape[-1]} channels (triton holds rows up to {MAX_C} in registers)")
    return reasons


FORWARD = BackendTable(
    "rms_norm_joint",
    [Backend("triton", _fwd_triton_joint, _triton_refuse_joint), Backend("torch", _fwd_torch_joint)],
)


# ------------------------------------------------------------------------------------------------ custom op


@torch.library.custom_op("ldmopt::rms_norm_joint_fwd", mutates_args=())
def rms_norm_joint_fwd(
    x_head: Tensor,
    x_tail: Tensor,
    w_head: Tensor | None,
    w_tail: Tensor | None,
    eps: float,
    dtype: torch.dtype,
    save: bool,
    head_rows: int,
    tail_rows: int,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    rope_rows: int = 1,
    rope_per_pair: bool = True,
) -> tuple[Tensor, Tensor]:
    """(y [M_head + M_tail, C] in ``dtype``, rstd [M] in the compute dtype, empty unless save): y's rows are, per
    sample, the head part's ``head_rows`` rows then the tail part's ``tail_rows``, each normalised with its part's
    weight (both or neither given), then rotated as ``ldmopt::rms_norm_fwd`` rotates row r of y."""
    _check_rows(x_head, x_tail, head_rows, tail_rows, w_head, w_tail, cos, sin, rope_rows)  # before any backend
    return FORWARD(x_head, x_tail, w_head, w_tail, eps, dtype, save, head_rows, tail_rows, cos, sin, rope_rows,
                   rope_per_pair)  # fmt: skip


@rms_norm_joint_fwd.register_fake
def _(x_head, x_tail, w_head, w_tail, eps, dtype, save, head_rows, tail_rows, cos=None, sin=None, rope_rows=1,
      rope_per_pair=True):  # fmt: skip
    m = x_head.shape[0] + x_tail.shape[0]
    rstd = x_head.new_empty((m,) if save else (0,), dtype=compute_dtype(x_head))
    return x_head.new_empty((m, x_head.shape[1]), dtype=dtype), rstd


def _setup_context(ctx, inputs, output):
    x_head, x_tail, w_head, w_tail, eps, _dtype, save, head_rows, _tail_rows, cos, sin, rope_rows, per_pair = inputs
    # A part is kept only when its input or weight needs a gradient (Flux's text stream comes from a frozen context
    # embedder in frozen-base training: the unfused norms would not keep it either).
    need = ctx.needs_input_grad
    keep_head, keep_tail = need[0] or need[2], need[1] or need[3]
    ctx.save_for_backward(
        x_head if keep_head else None, x_tail if keep_tail else None, output[1] if save else None, w_head, w_tail,
        cos, sin,
    )  # fmt: skip
    ctx.rows = (x_head.shape[0] // head_rows, head_rows)
    ctx.rope_mapping = (rope_rows, per_pair)
    ctx.eps = eps
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _drstd):
    x_head, x_tail, rstd, w_head, w_tail, cos, sin = ctx.saved_tensors
    if dy is None:
        return (None,) * 13
    samples, head_rows = ctx.rows
    rope_rows, per_pair = ctx.rope_mapping
    rstd_parts = (None, None) if rstd is None else _split(rstd, samples, head_rows)
    grads = []
    parts = zip((x_head, x_tail), (w_head, w_tail), _split(dy, samples, head_rows), rstd_parts,
                _split_tables(cos, sin, head_rows, rope_rows))  # fmt: skip
    for x, w, dy_part, rstd_part, tables in parts:
        if x is None:  # neither this part's input nor its weight needs a gradient
            grads.append((None, None))
            continue
        if rstd_part is None:  # a caller asked for no saved state yet needs gradients: recompute the statistics
            rstd_part = torch.rsqrt(x.to(compute_dtype(x)).pow(2).mean(-1) + ctx.eps)
        grads.append(call(rms_norm_bwd, dy_part, x, rstd_part, w, *tables, rope_rows, per_pair)[:2])
    (dx_head, dw_head), (dx_tail, dw_tail) = grads
    need = ctx.needs_input_grad
    return (
        dx_head if need[0] else None,
        dx_tail if need[1] else None,
        dw_head.to(w_head.dtype) if need[2] and dw_head is not None else None,
        dw_tail.to(w_tail.dtype) if need[3] and dw_tail is not None else None,
        *(None,) * 9,
    )


register_autograd_keeping_backend(rms_norm_joint_fwd, _backward, _setup_context)


# ------------------------------------------------------------------------------------------------ public function


def _pair(value, name: str) -> tuple:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(f"{name} must be a (head, tail) pair, got {type(value).__name__}")
    return tuple(value)


def _joint_weights(weight, c: int, like: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(head, tail) weights: a pair, one weight for both, or None; a pair with one None reads ones there."""
    w_head, w_tail = _pair(weight, "weight") if isinstance(weight, (tuple, list)) else (weight, weight)
    for name, w in (("weight[0]", w_head), ("weight[1]", w_tail)):
        check_vector(name, w, c, like)
    if (w_head is None) != (w_tail is None):  # the kernel takes both or neither: a missing weight is ones
        present = w_head if w_head is not None else w_tail
        ones = torch.ones(c, dtype=present.dtype, device=present.device)
        w_head, w_tail = (w_head, ones) if w_head is not None else (ones, w_tail)
    return w_head, w_tail


def rms_norm_joint(
    x: tuple[Tensor, Tensor] | list[Tensor],
    weight: Tensor | tuple | list | None,
    eps: float,
    *,
    cat_dim: int,
    out_dtype: torch.dtype | None = None,
    rope: tuple[Tensor, Tensor] | None = None,
    rope_layout: str | None = None,
    rope_dim: int | None = None,
) -> Tensor:
    """``rms_norm(torch.cat(x, cat_dim))`` with each part normalised by its own weight, the concatenation never
    written (see :func:`ldmopt.ops.rms_norm`, which calls this for a pair ``x``). The parts have the same shape but
    along ``cat_dim``, a dim before the last; they are promoted to one dtype first, as ``torch.cat`` does. With rope
    the tables hold the joint sequence's positions along ``cat_dim`` (``rope_dim``: that dim, the default)."""
    head, tail = _pair(x, "x")
    check_tensor("x[0]", head)
    check_tensor("x[1]", tail)
    if head.dim() != tail.dim() or head.dim() < 2:
        shapes = f"{tuple(head.shape)} and {tuple(tail.shape)}"
        raise ValueError(f"x's parts must have one number of dims, at least 2, got shapes {shapes}")
    # before the last either way: -1 is the last dim, the one each row is normalised along
    before_last = isinstance(cat_dim, int) and not isinstance(cat_dim, bool) and -head.dim() <= cat_dim < head.dim() - 1
    if not before_last or cat_dim == -1:
        raise ValueError(f"cat_dim must be a dim of x's parts before the last, got {cat_dim!r} ({head.dim()}-d parts)")
    if tail.device != head.device:
        raise ValueError(f"x[1] is on {tail.device} but x[0] is on {head.device}")
    dim = cat_dim % head.dim()
    if head.shape[:dim] != tail.shape[:dim] or head.shape[dim + 1 :] != tail.shape[dim + 1 :]:
        raise ValueError(
            f"x's parts must match except along cat_dim={cat_dim}, got {tuple(head.shape)} and {tuple(tail.shape)}"
        )
    dtype = torch.promote_types(head.dtype, tail.dtype)
    head, tail = head.to(dtype), tail.to(dtype)
    c = head.shape[-1]
    w_head, w_tail = _joint_weights(weight, c, head)
    eps = check_eps(eps)
    check_out_dtype(out_dtype)
    joint_shape = (*head.shape[:dim], head.shape[dim] + tail.shape[dim], *head.shape[dim + 1 :])
    rope_args = (None, None, 1, True)
    if rope is not None:
        if rope_dim is not None and not (isinstance(rope_dim, int) and rope_dim % head.dim() == dim):
            raise ValueError(
                f"with two parts, rope_dim must be the concatenation's dim (cat_dim={cat_dim}): the tables hold the "
                f"joint sequence's positions; got rope_dim={rope_dim!r}"
            )
        rope_dim = dim - head.dim()  # as _check_rope counts dims: from the end
        joint_like = head.new_empty(()).expand(joint_shape)  # the joint's shape for the checks, no memory
        rope_args = _check_rope(rope, rope_layout, rope_dim, joint_like, None)
        if rope_args[0].shape[0] != joint_shape[dim]:
            raise ValueError(
                f"with two parts, the rope tables must hold the {joint_shape[dim]} positions of the joint sequence "
                f"along cat_dim, got tables for {rope_args[0].shape[0]}"
            )
    head_rows = math.prod(head.shape[dim:-1])
    tail_rows = math.prod(tail.shape[dim:-1])
    save = needs_grad(head, tail, w_head, w_tail)
    y, _rstd = call(rms_norm_joint_fwd, head.reshape(-1, c), tail.reshape(-1, c), w_head, w_tail, eps,
                    out_dtype or dtype, save, head_rows, tail_rows, *rope_args)  # fmt: skip
    return y.view(joint_shape)
