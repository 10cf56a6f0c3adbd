"""Flux attention (family ``rms_norm``, rule ``flux_qk_norm_rope``): the per-head query/key RMSNorms and the rotary
embedding of Flux.1 (and Chroma, which uses the same attention) in one row kernel per tensor, which also joins the
text and image streams.

diffusers' FluxAttnProcessor runs ``norm_q`` / ``norm_k`` (and ``norm_added_q`` / ``norm_added_k`` for the text
stream of the double-stream blocks) as torch kernels, concatenates text and image tokens, then rotates with
``apply_rotary_emb``: x.float() * cos + stack(-x_imag, x_real).float() * sin and a cast back, about seven passes
over q and k each, most in fp32. The fused forward normalises, concatenates and rotates q (and k) in one
``ldmopt.ops.rms_norm((text, image), (norm_added_q.weight, norm_q.weight), cat_dim=1, rope=,
rope_layout="elements")`` call: each output row is read from its stream, normalised with that stream's weight and
rotated by its position in the joint sequence, so neither the normalised streams nor their concatenation are
written (norms of different epsilons: one call per stream, then the concatenation). It keeps the rest of the
processor: its projections, the values' concatenation, the attention backend and parallel config, the output
projections. A single-stream block's attention (no text projections) normalises and rotates q and k in place.

A module whose processor is not the stock one (IP-Adapter, a user's), a call with joint_attention_kwargs the stock
processor would warn about and drop, or tables that do not match the tokens keep the stock forward, with the reason
in the report. IP-Adapter inputs, which the stock forward drops quietly for a stock processor, are dropped too.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import count_reason
from .qk_norm_rope import (
    QUIET_KWARGS,
    processor_attention,
    processor_reasons,
    torch_joint_norm_rope,
    torch_norm_rope,
    torch_rms_norm_reason,
)
from .rule import ClassSwapRule, Rule, Site, diffusers_classes, stock

_ELEMENTS = dict(rope_layout="elements", rope_dim=-3)  # tables [S, D], one value per element; x [B, S, H, D]


def _call_tables(self, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs) -> tuple | str:
    """(cos, sin) [T + S, D] for this call, or why the call keeps the stock forward."""
    reasons = processor_reasons(self)
    if reasons:
        return reasons[0]
    if set(kwargs) - QUIET_KWARGS:  # stock warns about these, then drops them
        return f"called with attention kwargs {sorted(kwargs)}"
    if image_rotary_emb is None:
        return "called without image_rotary_emb"
    if (encoder_hidden_states is not None) != (self.added_kv_proj_dim is not None):
        return "encoder_hidden_states given to an attention without text projections, or missing for one with them"
    streams = [t for t in (encoder_hidden_states, hidden_states) if t is not None]
    if any(t.dim() != 3 or t.numel() == 0 for t in streams):
        return f"token tensors of shapes {[tuple(t.shape) for t in streams]}, not non-empty [B, S, C]"
    if not (isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2):
        return "image_rotary_emb is not a (cos, sin) pair"
    tokens = sum(t.shape[1] for t in streams)
    for t in image_rotary_emb:
        if not isinstance(t, torch.Tensor) or t.shape != (tokens, self.head_dim):
            return f"rotary tables of shape {tuple(getattr(t, 'shape', ()))}, not [{tokens}, {self.head_dim}]"
        if t.requires_grad:
            return "rotary tables that require grad"
    # As apply_rotary_emb does: tables built from ids left on another device are moved to the tokens'.
    return tuple(t.to(hidden_states.device) for t in image_rotary_emb)


def _flux_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None,
                            image_rotary_emb=None, **kwargs):  # fmt: skip
    tables = _call_tables(self, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)

    processor, base = self.processor, type(self)._ldmopt_base
    helpers = sys.modules[base.__module__]  # the processor's own projection and attention functions
    query, key, value, encoder_query, encoder_key, encoder_value = helpers._get_qkv_projections(
        self, hidden_states, encoder_hidden_states
    )
    heads = (-1, self.head_dim)  # as the processor: a fixed head size, the head count absorbed (tensor parallelism)
    text = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
    value = value.unflatten(-1, heads)
    if encoder_hidden_states is None:
        query = torch_norm_rope(self.norm_q, query.unflatten(-1, heads), tables, **_ELEMENTS)
        key = torch_norm_rope(self.norm_k, key.unflatten(-1, heads), tables, **_ELEMENTS)
    else:  # [text | image] tokens: each stream's norm, the rotation and the concatenation in one kernel per tensor
        streams = (encoder_query.unflatten(-1, heads), query.unflatten(-1, heads))
        query = torch_joint_norm_rope((self.norm_added_q, self.norm_q), streams, tables, 1, **_ELEMENTS)
        streams = (encoder_key.unflatten(-1, heads), key.unflatten(-1, heads))
        key = torch_joint_norm_rope((self.norm_added_k, self.norm_k), streams, tables, 1, **_ELEMENTS)
        value = torch.cat([encoder_value.unflatten(-1, heads), value], dim=1)

    out = processor_attention(helpers, processor, query, key, value, attention_mask)
    if encoder_hidden_states is None:
        return out
    encoder_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
    out = self.to_out[1](self.to_out[0](out.contiguous()))
    return out, self.to_add_out(encoder_out.contiguous())


class FluxQKNormRopeRule(ClassSwapRule):
    name = "flux_qk_norm_rope"
    family = "rms_norm"
    description = "Flux attention: per-head query/key RMSNorm + RoPE + text/image concatenation in one row kernel"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("transformers.transformer_flux:FluxAttention")

    def _norms(self, attn: nn.Module) -> list[str]:
        names = ["norm_q", "norm_k"]
        return names + (["norm_added_q", "norm_added_k"] if attn.added_kv_proj_dim is not None else [])

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        reasons = [torch_rms_norm_reason(n, getattr(attn, n, None), attn.head_dim) for n in self._norms(attn)]
        reasons = [r for r in reasons if r]
        if attn.head_dim % 2:
            reasons.append(f"head size {attn.head_dim} is odd: the rotary pairs need an even one")
        return reasons + processor_reasons(attn)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        attn = site.module
        return {"": attn, **{n: getattr(attn, n) for n in self._norms(attn)}}

    def methods(self, site: Site):
        return _flux_attention_forward


RULES: list[Rule] = [FluxQKNormRopeRule()]
