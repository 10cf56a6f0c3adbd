"""Qwen-Image attention (family ``rms_norm``, rule ``qwen_qk_norm_rope``): the per-head query/key RMSNorms of both
streams and the rotary embedding in one row kernel per tensor.

Qwen-Image's blocks use diffusers' generic ``Attention`` with ``QwenDoubleStreamAttnProcessor2_0``: diffusers'
``RMSNorm`` per head (eight elementwise passes each) and ``apply_rotary_emb_qwen`` on complex tables (an fp32 copy of
q, the complex multiply, the real view, a cast back). The tables are complex [S, D/2]: their real and imaginary
parts are the cos and sin of one angle per pair, which ``ldmopt.ops.rms_norm(..., rope_layout="pairs")`` reads as
strided views. q (and k) of both streams are normalised, rotated and concatenated [text | image] by one kernel that
writes only the joint tensor (``rms_norm((text, image), ..., cat_dim=1)``; norms of different epsilons or output
dtypes: one call per stream, then the concatenation). The fused forward keeps the rest of the processor:
projections, the joint text/image mask it builds from ``encoder_hidden_states_mask`` (diffusers 0.39 and newer; before,
the ``attention_mask`` it was given, the text mask unused, as the stock processor did), the values' concatenation, the
attention backend and parallel config, the output projections. The output dtype of each norm is the stock module's
(a half-precision weight's dtype).

Another processor, a call the fused forward does not take (no rotary tables or text stream, kwargs the stock
forward would warn about, tables that do not match the tokens) keeps the stock forward, with the reason in the report.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import count_reason, qualified_name
from .qk_norm_rope import QUIET_KWARGS, ProcessorQKNormRopeRule, diffusers_joint_norm_rope, processor_attention
from .rule import Rule, Site, diffusers_at_least, stock

_PAIRS = dict(rope_layout="pairs", rope_dim=-3)  # x [B, S, H, D], tables [S, D/2]
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


#: The stock processor, by qualified name (a subclass is another processor; no import inside a traced forward).
PROCESSOR = "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0"
#: From this release the processor builds the joint mask from ``encoder_hidden_states_mask`` and refuses an
#: ``attention_mask``; before it, it attended with ``attention_mask`` as given and ignored the text mask.
MASK_FROM_TEXT = "0.39"
_BUILDS_MASK = diffusers_at_least(MASK_FROM_TEXT)  # once, at import: not inside a traced forward


def _tables(freqs: object, tokens: int, half: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | str:
    """cos and sin [tokens, half] as views of complex tables, or why they cannot be used."""
    if not isinstance(freqs, torch.Tensor) or not freqs.is_complex() or freqs.shape != (tokens, half):
        return f"rotary tables {tuple(getattr(freqs, 'shape', ()))} are not complex [{tokens}, {half}]"
    if freqs.requires_grad or freqs.device != device:
        return "rotary tables that require grad or sit on another device"
    pairs = torch.view_as_real(freqs)
    return pairs[..., 0], pairs[..., 1]


def _call_tables(self, hidden_states, encoder_hidden_states, attention_mask, kwargs) -> tuple | str:
    """((image cos, sin), (text cos, sin)) for this call, or why the call keeps the stock forward."""
    if qualified_name(type(self.processor)) != PROCESSOR:
        return f"its processor is {type(self.processor).__name__}, not diffusers' QwenDoubleStreamAttnProcessor2_0"
    extra = set(kwargs) - {"encoder_hidden_states_mask", "image_rotary_emb"} - QUIET_KWARGS
    if extra:
        return f"called with attention kwargs {sorted(extra)}"
    rotary = kwargs.get("image_rotary_emb")
    if rotary is None or encoder_hidden_states is None:
        return "called without image_rotary_emb or encoder_hidden_states"
    if attention_mask is not None and _BUILDS_MASK:
        return "called with an attention_mask (stock raises)"
    if (
        hidden_states.dim() != 3
        or encoder_hidden_states.dim() != 3
        or not (hidden_states.numel() and encoder_hidden_states.numel())
    ):
        return "token tensors that are not non-empty [B, S, C]"
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2):
        return "image_rotary_emb is not an (image, text) pair"
    half = self.inner_dim // self.heads // 2
    device = hidden_states.device
    image = _tables(rotary[0], hidden_states.shape[1], half, device)
    text = _tables(rotary[1], encoder_hidden_states.shape[1], half, device)
    return next((t for t in (image, text) if isinstance(t, str)), (image, text))


def _joint_mask(hidden_states, encoder_hidden_states_mask):
    """The processor's mask over [text, image] keys: the text mask, then every image token."""
    if encoder_hidden_states_mask is None:
        return None
    image = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
    return torch.cat([encoder_hidden_states_mask, image], dim=1)[:, None, None, :]


def _qwen_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    tables = _call_tables(self, hidden_states, encoder_hidden_states, attention_mask, kwargs)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, **kwargs)

    (image_tables, text_tables), processor = tables, self.processor
    if _BUILDS_MASK:
        mask = _joint_mask(hidden_states, kwargs.get("encoder_hidden_states_mask"))
    else:
        mask = attention_mask
    head = (-1, self.inner_dim // self.heads)  # as the processor: a fixed head size (tensor parallelism)
    img_q, img_k, img_v = (proj(hidden_states).unflatten(-1, head) for proj in (self.to_q, self.to_k, self.to_v))
    txt = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
    txt_q, txt_k, txt_v = (proj(encoder_hidden_states).unflatten(-1, head) for proj in txt)
    # [text, image], as the processor concatenates them: norms, rotation and concatenation in one kernel per tensor
    tables = tuple(torch.cat(pair) for pair in zip(text_tables, image_tables))  # [T + S, D/2]: a few kB
    query = diffusers_joint_norm_rope((self.norm_added_q, self.norm_q), (txt_q, img_q), tables, 1, **_PAIRS)
    key = diffusers_joint_norm_rope((self.norm_added_k, self.norm_k), (txt_k, img_k), tables, 1, **_PAIRS)
    value = torch.cat([txt_v, img_v], dim=1)

    helpers = sys.modules[type(processor).__module__]  # the processor's own attention function
    out = processor_attention(helpers, processor, query, key, value, mask)
    text = encoder_hidden_states.shape[1]
    image_out = self.to_out[0](out[:, text:, :].contiguous())
    if len(self.to_out) > 1:
        image_out = self.to_out[1](image_out)
    return image_out, self.to_add_out(out[:, :text, :].contiguous())


class QwenQKNormRopeRule(ProcessorQKNormRopeRule):
    name = "qwen_qk_norm_rope"
    description = "Qwen-Image attention: per-head query/key RMSNorm + RoPE in one row kernel per stream"
    processor = PROCESSOR

    def norm_names(self, attn: nn.Module) -> tuple[str, ...]:
        return _NORMS

    def head(self, attn: nn.Module) -> int:
        return attn.inner_dim // attn.heads  # as the processor computes it

    def extra_reasons(self, attn: nn.Module) -> list[str]:
        if getattr(attn, "to_add_out", None) is None or getattr(attn, "add_q_proj", None) is None:
            return ["no text-stream projections (add_q_proj / to_add_out)"]
        return []

    def methods(self, site: Site):
        return _qwen_attention_forward


RULES: list[Rule] = [QwenQKNormRopeRule()]
