"""Wan self-attention (family ``rms_norm``, rule ``wan_qk_norm_rope``): the query/key RMSNorm across heads and the
rotary embedding of Wan 2.1/2.2 (also VACE, Animate, ChronoEdit) and SkyReels-V2 in one row kernel each.

diffusers' processor runs ``norm_q(q)`` (one torch kernel), then its RoPE as eight elementwise passes over strided
halves of q, half of them writing fp32 temporaries (``x1 * cos - x2 * sin`` ...) and two strided copies into a fresh
tensor; the same for k. The fused forward computes the projections, attention and output exactly as the stock
processor does (its own helpers, backend and parallel config) and replaces only those passes with
``ldmopt.ops.rms_norm(q, norm_q.weight, rope=(cos, sin))``: fp32 statistics, affine and rotation, one rounding.

Only self-attention with RoPE is taken (cross-attention has none; its norms stay torch's one kernel). A module
whose processor is not the stock one (a user's, or another library's) keeps the stock forward, as does a call the
fused forward does not take (no rotary_emb, angles that need grad, shapes other than Wan's), with the reason in the
report.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import count_reason
from .qk_norm_rope import processor_attention, processor_reasons, torch_norm_rope, torch_rms_norm_reason
from .rule import ClassSwapRule, Rule, Site, diffusers_classes, stock

#: Attention classes with Wan's processor (the WanAttention classes are copies in separate modules).
WAN_ATTENTIONS = (
    "transformers.transformer_wan:WanAttention",
    "transformers.transformer_chronoedit:WanAttention",
    "transformers.transformer_wan_animate:WanAttention",
    "transformers.transformer_skyreels_v2:SkyReelsV2Attention",
)


def _angles(rotary_emb: object, b: int, s: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Wan's (freqs_cos, freqs_sin) [1 or B, S, 1, D], each angle repeated for both members of a pair, as the
    kernel's per-pair tables [P, D/2] (views): cos from the even, sin from the odd columns, as the processor reads
    them. A string says why they cannot be used."""
    if not (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2):
        return "rotary_emb is not a (cos, sin) pair"
    freqs_cos, freqs_sin = rotary_emb
    for t in (freqs_cos, freqs_sin):
        wan_shape = isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] in (1, b)
        if not wan_shape or t.shape[1:] != (s, 1, head_dim):
            return f"rotary tables of shape {tuple(getattr(t, 'shape', ()))}, not [1 or {b}, {s}, 1, {head_dim}]"
        if t.requires_grad:
            return "rotary tables that require grad"
        if t.device != device:
            return f"rotary tables on {t.device}, the tokens on {device}"
    if freqs_cos.shape != freqs_sin.shape:
        return f"rotary cos and sin of shapes {tuple(freqs_cos.shape)} and {tuple(freqs_sin.shape)}"
    return freqs_cos[..., 0::2].flatten(0, 2), freqs_sin[..., 1::2].flatten(0, 2)


def _call_angles(self, hidden_states, encoder_hidden_states, rotary_emb, kwargs) -> tuple | str:
    """The kernel's angle tables for this call, or why the call keeps the stock forward."""
    reasons = processor_reasons(self)
    if reasons:
        return reasons[0]
    if encoder_hidden_states is not None or kwargs:
        return "called with encoder_hidden_states or extra arguments"
    if rotary_emb is None:
        return "called without rotary_emb"
    if hidden_states.dim() != 3 or hidden_states.numel() == 0:
        return f"hidden states of shape {tuple(hidden_states.shape)}, not non-empty [B, S, C]"
    return _angles(rotary_emb, *hidden_states.shape[:2], self.inner_dim // self.heads, hidden_states.device)


def _wan_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                           **kwargs):  # fmt: skip
    angles = _call_angles(self, hidden_states, encoder_hidden_states, rotary_emb, kwargs)
    if isinstance(angles, str):
        count_reason(type(self).__name__, angles)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)

    processor, base = self.processor, type(self)._ldmopt_base
    helpers = sys.modules[base.__module__]  # the processor's own projection and attention functions
    query, key, value = helpers._get_qkv_projections(self, hidden_states, None)
    query = torch_norm_rope(self.norm_q, query, angles).unflatten(2, (self.heads, -1))
    key = torch_norm_rope(self.norm_k, key, angles).unflatten(2, (self.heads, -1))
    value = value.unflatten(2, (self.heads, -1))
    out = processor_attention(helpers, processor, query, key, value, attention_mask)
    return self.to_out[1](self.to_out[0](out))


class WanQKNormRopeRule(ClassSwapRule):
    name = "wan_qk_norm_rope"
    family = "rms_norm"
    description = "Wan self-attention: query/key RMSNorm across heads + RoPE in one row kernel each"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes(*WAN_ATTENTIONS)

    def match(self, site: Site) -> bool:
        attn = site.module
        # Wan blocks name their cross-attention attn2: diffusers 0.35 builds the VACE blocks' attn2 without
        # is_cross_attention, and every call of it (with encoder_hidden_states) would run stock.
        self_attention = not getattr(attn, "is_cross_attention", True) and site.attr != "attn2"
        return self_attention and getattr(attn, "add_k_proj", None) is None

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        width = attn.inner_dim
        reasons = [
            r for r in (torch_rms_norm_reason(n, getattr(attn, n, None), width) for n in ("norm_q", "norm_k")) if r
        ]
        if width % attn.heads or (width // attn.heads) % 2:
            reasons.append(f"{width} channels in {attn.heads} heads: the rotary pairs need an even head size")
        return reasons + processor_reasons(attn)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        attn = site.module
        return {"": attn, "norm_q": attn.norm_q, "norm_k": attn.norm_k}

    def methods(self, site: Site):
        return _wan_attention_forward


RULES: list[Rule] = [WanQKNormRopeRule()]
