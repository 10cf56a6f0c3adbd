"""HunyuanVideo attention (family ``rms_norm``, rule ``hunyuan_video_qk_norm_rope``): the per-head query/key RMSNorms
and the rotary embedding of the video tokens in one row kernel per tensor.

HunyuanVideo's blocks use diffusers' generic ``Attention`` with ``HunyuanVideoAttnProcessor2_0``: diffusers'
``RMSNorm`` per head (eight elementwise passes each), then ``apply_rotary_emb`` on the video tokens only (fp32
copies, the partner's negation and interleave, two multiplies, an add, a cast back; about seven passes more). In the
single-stream blocks the text tokens ride along after the video tokens, normalised but not rotated. The fused
forward normalises and rotates q and k with ``ldmopt.ops.rms_norm(..., rope_layout="elements")``, one call per
tensor: in the single-stream blocks over all tokens, with tables extended by cos = 1, sin = 0 rows for the text
(an exact identity), so q and k are neither sliced nor concatenated; in the double-stream blocks q (and k) of the
video and text streams in one ``rms_norm((video, text), ..., cat_dim=1)`` call with the same identity rows for the
text, which writes only their concatenation (norms of different epsilons or output dtypes: one call per stream,
then the concatenation). The rest is the processor's: projections, the values' concatenation, attention backend and
parallel config, the split and the output projections. Each norm's output dtype is the stock module's (under
autocast: fp32 from a bf16 input with an fp32 weight).

Another processor (the token refiner's attention has diffusers' plain one), a call without rotary tables or with
other kwargs, tables that do not match the video tokens, an empty token tensor: the stock forward, with the reason
in the report. The head size is the norms' width, as the processor's ``unflatten(2, (heads, -1))`` leaves it under
tensor parallelism (local heads, the global inner_dim).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import count_reason, qualified_name
from .qk_norm_rope import (
    QUIET_KWARGS,
    ProcessorQKNormRopeRule,
    diffusers_joint_norm_rope,
    diffusers_norm_rope,
    processor_attention,
    with_identity_rows,
)
from .rule import Rule, Site, stock

#: The stock processor, by qualified name (a subclass is another processor; no import inside a traced forward).
PROCESSOR = "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0"
_ELEMENTS = dict(rope_layout="elements", rope_dim=-3)  # x [B, S, H, D], tables [S, D]


def _call_tables(self, hidden_states, encoder_hidden_states, kwargs) -> tuple | str:
    """(cos, sin) [video tokens, D] for this call, or why the call keeps the stock forward."""
    if qualified_name(type(self.processor)) != PROCESSOR:
        return f"its processor is {type(self.processor).__name__}, not diffusers' HunyuanVideoAttnProcessor2_0"
    extra = set(kwargs) - {"image_rotary_emb"} - QUIET_KWARGS
    if extra:
        return f"called with attention kwargs {sorted(extra)}"
    tables = kwargs.get("image_rotary_emb")
    if tables is None:
        return "called without image_rotary_emb"
    streams = [t for t in (hidden_states, encoder_hidden_states) if t is not None]
    if any(t.dim() != 3 or t.numel() == 0 for t in streams):
        return f"token tensors of shapes {[tuple(t.shape) for t in streams]}, not non-empty [B, S, C]"
    if not (isinstance(tables, (tuple, list)) and len(tables) == 2):
        return "image_rotary_emb is not a (cos, sin) pair"
    shape = (hidden_states.shape[1], _head(self))
    for t in tables:
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.requires_grad:
            return f"rotary tables of shape {tuple(getattr(t, 'shape', ()))}, not {list(shape)} without grad"
    # As apply_rotary_emb does: tables on another device are moved to the tokens'.
    return tuple(t.to(hidden_states.device) for t in tables)


def _hunyuan_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    tables = _call_tables(self, hidden_states, encoder_hidden_states, kwargs)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, **kwargs)

    processor, video = self.processor, hidden_states.shape[1]
    single_stream = self.add_q_proj is None and encoder_hidden_states is not None
    if single_stream:  # [video, text] in one stream: both normalised, only the video tokens rotated
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    query, key, value = (
        proj(hidden_states).unflatten(2, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v)
    )
    if single_stream:  # the text rows turn by zero: one kernel over all tokens
        tables = with_identity_rows(tables, hidden_states.shape[1] - video, first=False)
    if self.add_q_proj is not None and encoder_hidden_states is not None:
        # [video | text]: both streams' norms, the video tokens' rotation and the concatenation in one kernel each
        added = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        text_q, text_k, text_v = (proj(encoder_hidden_states).unflatten(2, (self.heads, -1)) for proj in added)
        tables = with_identity_rows(tables, encoder_hidden_states.shape[1], first=False)
        query = diffusers_joint_norm_rope((self.norm_q, self.norm_added_q), (query, text_q), tables, 1, **_ELEMENTS)
        key = diffusers_joint_norm_rope((self.norm_k, self.norm_added_k), (key, text_k), tables, 1, **_ELEMENTS)
        value = torch.cat([value, text_v], dim=1)
    else:
        query, key = (
            diffusers_norm_rope(self.norm_q, query, tables, **_ELEMENTS),
            diffusers_norm_rope(self.norm_k, key, tables, **_ELEMENTS),
        )

    helpers = sys.modules[type(processor).__module__]  # the processor's own attention function
    out = processor_attention(helpers, processor, query, key, value, attention_mask)
    if encoder_hidden_states is None:
        return out, None
    text = encoder_hidden_states.shape[1]
    out, text_out = out[:, :-text], out[:, -text:]
    if getattr(self, "to_out", None) is not None:
        out = self.to_out[1](self.to_out[0](out))
    if getattr(self, "to_add_out", None) is not None:
        text_out = self.to_add_out(text_out)
    return out, text_out


def _head(attn: nn.Module) -> int:
    """The per-head width: the norms' (diffusers' RMSNorm keeps its normalised dims in ``dim``)."""
    return attn.norm_q.dim[0]


def _norm_names(attn: nn.Module) -> tuple[str, ...]:
    return ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.add_q_proj is not None else ())


class HunyuanVideoQKNormRopeRule(ProcessorQKNormRopeRule):
    name = "hunyuan_video_qk_norm_rope"
    description = "HunyuanVideo attention: per-head query/key RMSNorm + RoPE of the video tokens in one row kernel"
    processor = PROCESSOR

    def norm_names(self, attn: nn.Module) -> tuple[str, ...]:
        return _norm_names(attn)

    def head(self, attn: nn.Module) -> int:
        return _head(attn)

    def methods(self, site: Site):
        return _hunyuan_attention_forward


RULES: list[Rule] = [HunyuanVideoQKNormRopeRule()]
