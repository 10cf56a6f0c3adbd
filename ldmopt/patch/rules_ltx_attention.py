"""LTX-Video attention (family ``rms_norm``, rule ``ltx_qk_norm_rope``): the query/key RMSNorm across heads and the
rotary embedding in one row kernel each.

diffusers' LTXVideoAttnProcessor runs ``norm_q`` / ``norm_k`` (torch's RMSNorm over all heads, one kernel) and then,
in the self-attention, its ``apply_rotary_emb`` on [B, S, C]: the partner's negation and interleave, fp32 copies of
q and of the partner, two multiplies, an add and a cast back, about seven passes over each of q and k, with tables
[B or 1, S, C] of one value per element. The fused forward runs ``ldmopt.ops.rms_norm(q, norm_q.weight, rope=(cos,
sin), rope_layout="elements")`` instead: per-sample tables are read per row of q, one table for the batch per
position. The cross-attention (no rotary tables) gets the norms alone in the same kernel. The projections, the mask
preparation, the attention backend and parallel config and the output projection are the processor's.

A module whose processor is not the stock one, or a call the fused forward does not take (tables of another shape,
that need grad or are not floating point, other kwargs), keeps the stock forward, with the reason in the report.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import count_reason
from ..ops.rms_norm import rms_norm
from .qk_norm_rope import processor_attention, processor_reasons, torch_eps, torch_rms_norm_reason
from .rule import ClassSwapRule, Rule, Site, diffusers_classes, stock


def _call_tables(self, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs) -> tuple | str | None:
    """(cos, sin) as the kernel reads them ([S, C] per position, or [B * S, C] per row), None without rotary
    tables, or why the call keeps the stock forward."""
    reasons = processor_reasons(self)
    if reasons:
        return reasons[0]
    if kwargs:
        return f"called with attention kwargs {sorted(kwargs)}"
    for t in (hidden_states, encoder_hidden_states):
        if t is not None and (t.dim() != 3 or t.numel() == 0):
            return f"token tensors of shape {tuple(t.shape)}, not non-empty [B, S, C]"
    if image_rotary_emb is None:
        return None
    if encoder_hidden_states is not None:  # the processor would rotate the context's keys by the queries' tables
        return "rotary tables with encoder_hidden_states (the keys are the context's)"
    b, s, _ = hidden_states.shape
    c = self.inner_dim
    if not (isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2):
        return "image_rotary_emb is not a (cos, sin) pair"
    if c != self.inner_kv_dim or c % 2:
        return f"query and key widths {c} and {self.inner_kv_dim}: the kernel rotates one even width for both"
    tables = []
    for t in image_rotary_emb:
        if not isinstance(t, torch.Tensor) or t.requires_grad or not t.is_floating_point():
            return "rotary tables that are not floating-point tensors, or require grad"
        if t.dim() != 3 or t.shape[0] not in (1, b) or t.shape[1:] != (s, c):
            return f"rotary tables of shape {tuple(t.shape)}, not [1 or {b}, {s}, {c}]"
        tables.append(t[0] if t.shape[0] == 1 else t.reshape(b * s, c))  # per position, or per row of q
    return tuple(tables)


def _norm_rope(norm: nn.RMSNorm, x: torch.Tensor, tables) -> torch.Tensor:
    rope = dict(rope=tables, rope_layout="elements", rope_dim=-2) if tables is not None else {}
    return rms_norm(x, norm.weight, None, torch_eps(norm, x), **rope)


def _ltx_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None,
                           image_rotary_emb=None, **kwargs):  # fmt: skip
    tables = _call_tables(self, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)

    processor = self.processor
    context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    batch, sequence_length, _ = context.shape
    if attention_mask is not None:  # as the processor prepares it
        attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch)
        attention_mask = attention_mask.view(batch, self.heads, -1, attention_mask.shape[-1])
    query = _norm_rope(self.norm_q, self.to_q(hidden_states), tables)
    key = _norm_rope(self.norm_k, self.to_k(context), tables)
    value = self.to_v(context)
    query, key, value = (t.unflatten(2, (self.heads, -1)) for t in (query, key, value))
    helpers = sys.modules[type(processor).__module__]  # the processor's own attention function
    out = processor_attention(helpers, processor, query, key, value, attention_mask)
    return self.to_out[1](self.to_out[0](out))


class LTXQKNormRopeRule(ClassSwapRule):
    name = "ltx_qk_norm_rope"
    family = "rms_norm"
    description = "LTX-Video attention: query/key RMSNorm across heads + RoPE in one row kernel each"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("transformers.transformer_ltx:LTXAttention")

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        widths = {"norm_q": attn.inner_dim, "norm_k": attn.inner_kv_dim}
        reasons = [torch_rms_norm_reason(n, getattr(attn, n, None), w) for n, w in widths.items()]
        return [r for r in reasons if r] + processor_reasons(attn)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        attn = site.module
        return {"": attn, "norm_q": attn.norm_q, "norm_k": attn.norm_k}

    def methods(self, site: Site):
        return _ltx_attention_forward


RULES: list[Rule] = [LTXQKNormRopeRule()]
