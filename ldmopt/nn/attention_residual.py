"""A block's residual add (and the adaLN gate before it) moved into the GEMM epilogue of the attention's output
projection.

UNet transformer blocks (SD1.5/SDXL/SVD/AnimateDiff ``BasicTransformerBlock``, "layer_norm") add the attention's
output to the token stream: diffusers' processor runs ``to_out[0]`` (one GEMM writing the projection), ``to_out[1]``
(dropout, p=0), ``/ rescale_output_factor`` (a full pass even when the factor is 1) and the block adds the residual
(another pass reading two tensors). Here ``to_out[0]`` runs as ``ldmopt.ops.linear(core, W, b, residual=r)``: the
GEMM writes ``r + core W^T + b`` once, in fp32 before its one rounding. adaLN blocks (DiT, PixArt: "ada_norm_zero",
"ada_norm_single") multiply the attention output by a per-sample gate first: ``r + gate[b] * (core W^T + b)``, the
same GEMM, which saves the gate's pass too.

:func:`sdpa_attention_residual` reproduces diffusers' ``AttnProcessor2_0`` / ``FusedAttnProcessor2_0`` (the default
processors of every ``Attention`` on torch 2) step by step (projections, mask preparation, q/k norms, SDPA without
``attn.scale``, as they call it) up to the output projection. Anything else runs ``attn(...) + residual`` exactly as
the stock block, the reason counted in ``fallback_reasons``: another processor (IP-Adapter, xformers, ldmopt's
temporal one), hooks on the attention module (diffusers' layer-skip and cache hooks), extra attention kwargs, a
spatial/group norm inside the attention, ``residual_connection`` or a rescale factor other than 1, or an output
projection that cannot be read as a plain nn.Linear (LoRA added after patching) or active dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import linear, per_sample
from .child_check import (
    count_reason,
    dropout_reason,
    function_mode_reason,
    hooked,
    observed,
    readable,
    unreadable_reason,
)
from .layer_norm_input import NormedInput, apply, as_tensor, norm_reason
from .linear import stock_gated_residual

#: diffusers processors whose steps :func:`sdpa_attention_residual` reproduces (class names; exact types are checked).
MIRRORED_PROCESSORS = ("AttnProcessor2_0", "FusedAttnProcessor2_0")


def _mirrored(processor: object) -> bool:
    # by module and name, not by importing the classes: dynamo in torch 2.11 (the GPU image's) cannot trace an import
    # from diffusers' lazy modules (a graph break under fullgraph=True)
    kind = type(processor)
    return kind.__module__ == "diffusers.models.attention_processor" and kind.__name__ in MIRRORED_PROCESSORS


def ldmopt_processor(processor: object) -> bool:
    """ldmopt's temporal and single-key processors (SVD's spatial cross-attention over its one image token): their
    output is not a full GEMM over the tokens, so the add stays as it is."""
    return type(processor).__module__.startswith("ldmopt.")


def epilogue_reason(attn: nn.Module, name: str = "attn") -> str | None:
    """Why ``attn``'s output projection cannot take a residual in its epilogue (None when it can): whatever follows
    ``to_out[0]`` in the processor must be the identity."""
    if attn.residual_connection:
        return f"{name}.residual_connection is set (the attention adds its own input)"
    if attn.rescale_output_factor != 1.0:
        return f"{name}.rescale_output_factor is {attn.rescale_output_factor} (only 1.0)"
    out = attn.to_out
    if len(out) != 2 or dropout_reason(out[1]) is not None:
        return f"{name}.to_out is not [Linear, inactive Dropout]"
    if hooked(out[1]):
        return f"{name}.to_out.1 has hooks or a wrapped forward"
    if not readable(out[0]):
        return unreadable_reason(f"{name}.to_out.0", out[0])
    return None


def static_reason(attn: nn.Module, name: str = "attn") -> str | None:
    """What about ``attn`` itself (not its processor or the call) keeps the stock path: spatial/group norms."""
    if attn.spatial_norm is not None or attn.group_norm is not None:
        return f"{name} has a spatial_norm or group_norm (VAE-style attention)"
    return None


def processor_reason(attn: nn.Module, name: str = "attn") -> str | None:
    """Why ``attn``'s processor keeps its calls stock (None when it is one the fused path mirrors); ldmopt.patch also
    names it at patch time, since a custom processor set before patching keeps that part stock on every call."""
    if not _mirrored(attn.processor):
        return f"{name} runs {type(attn.processor).__name__} (mirrored: {', '.join(MIRRORED_PROCESSORS)})"
    return None


def call_reason(attn: nn.Module, hidden_states: Tensor, kwargs: dict, name: str = "attn") -> str | None:
    """Why this call of ``attn`` runs stock (None when the mirrored processor path serves it)."""
    if hooked(attn):
        return f"{name} has hooks or a wrapped forward"
    if reason := processor_reason(attn, name):
        return reason
    if kwargs:
        return f"attention kwargs {sorted(kwargs)}"
    if hidden_states.dim() != 3:
        return f"{name} input has {hidden_states.dim()} dims (only (B, tokens, C))"
    return static_reason(attn, name) or epilogue_reason(attn, name)


def _projections(
    attn: nn.Module, x: Tensor | NormedInput, context: Tensor | None, name: str = "attn"
) -> tuple[Tensor, Tensor, Tensor]:
    # FusedAttnProcessor2_0 (after fuse_qkv_projections) reads to_qkv / to_kv; AttnProcessor2_0 always to_q/k/v.
    # A NormedInput x: each projection of it reads the norm in its loads (one shared statistics pass).
    fused = type(attn.processor).__name__ == "FusedAttnProcessor2_0"
    if context is not None and attn.norm_cross:
        context = attn.norm_encoder_hidden_states(context)
    if fused and context is None:
        return apply(attn.to_qkv, x, f"{name}.to_qkv").chunk(3, dim=-1)
    if fused:
        return (apply(attn.to_q, x, f"{name}.to_q"), *attn.to_kv(context).chunk(2, dim=-1))
    if context is not None:
        return apply(attn.to_q, x, f"{name}.to_q"), attn.to_k(context), attn.to_v(context)
    if isinstance(x, NormedInput):  # one GEMM over the three weights, the norm read once
        return tuple(x.project_all([attn.to_q, attn.to_k, attn.to_v], [f"{name}.to_{p}" for p in "qkv"]))
    return tuple(apply(getattr(attn, p), x, f"{name}.{p}") for p in ("to_q", "to_k", "to_v"))


def sdpa_core(
    attn: nn.Module, x: Tensor | NormedInput, context: Tensor | None, mask: Tensor | None, name: str = "attn"
) -> Tensor:
    """The mirrored processor's tensor just before ``to_out[0]``: (B, tokens, heads * head_dim). ``x`` may be a
    :class:`NormedInput`, read by the projections in their loads (``name``: the attention's attribute, for the
    report)."""
    batch, seq_len = (x if context is None else context).shape[:2]
    if mask is not None:
        mask = attn.prepare_attention_mask(mask, seq_len, batch)
        mask = mask.view(batch, attn.heads, -1, mask.shape[-1])
    q, k, v = _projections(attn, x, context, name)
    head_dim = k.shape[-1] // attn.heads
    q, k, v = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (q, k, v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    # As the stock processors: no scale argument (attn.scale is the default 1/sqrt(head_dim) they assume).
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(q.dtype)


def _gate_reason(gate: Tensor | None, residual: Tensor, width: int) -> str | None:
    """Why ``ops.linear`` cannot take ``gate`` for this residual (its own check, as a reason instead of an error)."""
    if gate is None:
        return None
    try:
        per_sample("gate", gate, residual, width)
    except ValueError as exc:
        return str(exc)
    return None


def sdpa_attention_residual(*args, **kwargs) -> Tensor:
    """``residual + gate * attn(hidden_states, encoder_hidden_states, attention_mask, **kwargs)`` (no gate: ``attn(...)
    + residual``): :func:`attention_residual_and_stats`'s output, same arguments but ``next_norm``."""
    return attention_residual_and_stats(*args, **kwargs)[0]


def attention_residual_and_stats(
    attn: nn.Module,
    hidden_states: Tensor | NormedInput,
    residual: Tensor,
    encoder_hidden_states: Tensor | None = None,
    attention_mask: Tensor | None = None,
    kwargs: dict | None = None,
    where: str = "Attention",
    name: str = "attn",
    gate: Tensor | None = None,
    next_norm: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(``residual + gate * attn(hidden_states, encoder_hidden_states, attention_mask, **kwargs)`` (no gate:
    ``attn(...) + residual``), its LayerNorm statistics for ``next_norm`` or None). The gate and the add happen in the
    output projection's GEMM epilogue when the call is one the mirrored processors serve (see the module docstring);
    when ``next_norm`` (the LayerNorm that reads the output next) is one the GEMMs after it can read in their loads,
    that epilogue also sums the rows (``ops.linear(..., next_norm_eps=)``), for a :class:`NormedInput` of the output
    to take instead of a statistics pass. ``kwargs``: the block's cross_attention_kwargs, passed on as a dict (any
    key, as diffusers passes them). ``gate``: one vector per sample, (B, 1, C) or (B, C). ``hidden_states`` may be a
    :class:`NormedInput` (a block's norm, then read in the projections' loads; the stock call gets its output)."""
    kwargs = kwargs or {}
    # "scale" is deprecated and ignored by the mirrored processors; a fall-back passes it on, as the stock block does.
    reason = call_reason(attn, hidden_states, {k: v for k, v in kwargs.items() if k != "scale"}, name)
    width = attn.to_out[0].out_features if reason is None else None
    if reason is None and residual.shape != (*hidden_states.shape[:-1], width):
        reason = f"residual shape {tuple(residual.shape)} is not the attention output's"
    if reason is None:
        reason = _gate_reason(gate, residual, width)
    if reason is not None:
        if not ldmopt_processor(attn.processor):  # ldmopt's own processors are a fused path, not a fall-back
            count_reason(where, reason)
        if isinstance(hidden_states, NormedInput) and _queries_unread(attn, hidden_states, encoder_hidden_states,
                                                                      attention_mask, kwargs):  # fmt: skip
            return _without_the_norm(attn, hidden_states, encoder_hidden_states, residual, gate), None
        out = attn(
            as_tensor(hidden_states), encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask,
            **kwargs,
        )  # fmt: skip
        return stock_gated_residual(out, gate, residual), None
    context = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask)
    with observed(attn, (hidden_states,), context):
        core = sdpa_core(attn, hidden_states, encoder_hidden_states, attention_mask, name)
        return _residual_projection(attn.to_out[0], core, gate, residual, next_norm)


def _residual_projection(
    layer: nn.Linear, core: Tensor, gate: Tensor | None, residual: Tensor, next_norm: nn.Module | None
) -> tuple[Tensor, Tensor | None]:
    """(``residual + gate * layer(core)`` in one GEMM, the output's LayerNorm statistics for ``next_norm`` summed in
    its epilogue, or None when ``next_norm`` is absent or not a norm the GEMMs after it read in their loads)."""
    if next_norm is None or norm_reason(next_norm, residual) is not None:
        return linear(core, layer.weight, layer.bias, gate=gate, residual=residual), None
    return linear(core, layer.weight, layer.bias, gate=gate, residual=residual, next_norm_eps=next_norm.eps)


def _queries_unread(attn: nn.Module, normed: NormedInput, context, mask, kwargs: dict) -> bool:
    """Whether this call of ``attn`` reads only its queries' shape, not their values: ldmopt's single-key shortcut
    (SVD's attn2) on inputs its kernel path serves, no hooks or kwargs that could look at the queries."""
    processor = attn.processor
    reads_queries = getattr(processor, "reads_queries", None)
    if reads_queries is None or reads_queries(attn) or hooked(attn) or any(k != "scale" for k in kwargs):
        return False
    if normed.reason is not None or function_mode_reason() is not None:  # a hooked or other norm runs, as stock;
        return False  # a function mode would see the queries the stock processor then computes
    return processor._call_reason(attn, normed.x, context, mask) is None


def _without_the_norm(attn: nn.Module, normed: NormedInput, context, residual: Tensor, gate: Tensor | None) -> Tensor:
    """The attention on queries whose values it never reads, so the norm before it is not computed: the norm's input
    stands in for its output (same shape); its parameters get the zero gradients the stock path gives them."""
    from .temporal_attention import zero_gradient_anchor  # that module imports this one

    out = attn(normed.x, encoder_hidden_states=context)
    if torch.is_grad_enabled():
        out = zero_gradient_anchor(out, [normed.norm])
    return stock_gated_residual(out, gate, residual)


def project_out_and_stats(
    attn: nn.Module,
    core: Tensor,
    x: Tensor | NormedInput,
    residual: Tensor | None,
    where: str,
    gate: Tensor | None = None,
    next_norm: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(What a processor does after the attention core ``core`` (..., heads * head_dim) of input ``x``: to_out,
    residual_connection and rescale_output_factor; plus ``residual`` (after the per-sample ``gate``) when given, in
    the GEMM epilogue when :func:`epilogue_reason` allows, else as the stock ops (counted); and the output's LayerNorm
    statistics for ``next_norm``, summed in that epilogue when ``next_norm`` is a LayerNorm the GEMMs after it read
    in their loads, else None)."""
    if gate is not None and residual is None:
        raise ValueError("project_out_and_stats: a gate needs a residual (the gated sum is residual + gate * out)")
    if residual is not None:
        reason = epilogue_reason(attn) or _gate_reason(gate, residual, attn.to_out[0].out_features)
        if reason is None:
            return _residual_projection(attn.to_out[0], core, gate, residual, next_norm)
        count_reason(where, reason)
    out = attn.to_out[1](attn.to_out[0](core))
    if attn.residual_connection:
        out = out + as_tensor(x)
    out = out / attn.rescale_output_factor
    return (out if residual is None else stock_gated_residual(out, gate, residual)), None
