"""Attention with per-head query/key LayerNorms and RoPE (family ``rms_norm``): the norm and the rotation in one row
kernel per tensor (``ldmopt.ops.layer_norm_rope``), for diffusers' generic ``Attention`` with

- ``CogVideoXAttnProcessor2_0`` (rule ``cogvideox_qk_norm_rope``: CogVideoX, CogView3-Plus, ConsisID) over
  ``[text | video]`` tokens: q and k go through torch's LayerNorm per head, then ``apply_rotary_emb`` on the video
  tokens only (the partner's negation and interleave, fp32 copies, two multiplies, an add, a cast back) and a copy
  into the slice, about nine passes over each. The fused forward normalises and rotates them in the projections'
  [B, S, H, D] order, with the tables extended by cos = 1, sin = 0 rows for the text tokens (an exact identity), so
  q and k are neither sliced nor copied back; the concatenation of the streams, the projections, SDPA, the output
  projection and the split are the processor's.
- ``HunyuanAttnProcessor2_0`` (rule ``hunyuan_dit_qk_norm_rope``: HunyuanDiT): the same norms, every query token
  rotated (the keys too in self-attention); the processor's cross-attention context, SDPA, the cast of its output
  to the queries' dtype, ``to_out``, ``residual_connection`` and ``rescale_output_factor`` are kept.

A cross-attention (``is_cross_attention``) rotates q only, as both processors do. Another processor, norms that are
not nn.LayerNorm over the head size, an attention mask, a spatial or group norm (HunyuanDiT's processor has them; its
model does not use them), 4-D inputs, tables that do not match the tokens, or a dtype the fused path would not
reproduce (norm parameters in another dtype than the tokens, autocast off CUDA) keep the stock forward per call,
with the reason in the report.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.child_check import count_reason, qualified_name
from ..ops._autocast import autocast_enabled
from ..ops.rms_norm import layer_norm_rope
from .qk_norm_rope import QUIET_KWARGS, ProcessorQKNormRopeRule, with_identity_rows
from .rule import Rule, Site, stock

#: The stock processors, by qualified name (a subclass is another processor; no import inside a traced forward).
COGVIDEOX = "diffusers.models.attention_processor.CogVideoXAttnProcessor2_0"
HUNYUAN_DIT = "diffusers.models.attention_processor.HunyuanAttnProcessor2_0"
_ELEMENTS = dict(rope_layout="elements", rope_dim=-3)  # x [B, S, H, D], tables [S, D]


def _layer_norm_reason(name: str, norm: object, head: int) -> str | None:
    """Why ``norm`` is not a torch.nn.LayerNorm over the last ``head`` channels with plain (or no) parameters."""
    if type(norm) is not nn.LayerNorm:
        return f"{name} is {type(norm).__name__}, not torch.nn.LayerNorm"
    if tuple(norm.normalized_shape) != (head,):
        return f"{name} normalises {tuple(norm.normalized_shape)}, not the head size {head}"
    for p in (norm.weight, norm.bias):
        if p is not None and (type(p) is not nn.Parameter or not p.is_floating_point()):
            return f"{name}'s parameters are not plain floating-point tensors"
    return None


def _out_dtype(x: torch.Tensor, norms: list[nn.LayerNorm]) -> torch.dtype | None:
    """The dtype torch's LayerNorm returns for x, or None where the fused path would not follow it."""
    if autocast_enabled(x.device.type) and x.dtype != torch.float64:  # autocast leaves fp64 alone
        return torch.float32 if x.device.type == "cuda" else None  # layer_norm is on CUDA autocast's fp32 list
    params = [p for n in norms for p in (n.weight, n.bias) if p is not None]
    return x.dtype if all(p.dtype == x.dtype for p in params) else None


def _call_reason(self, processor: str, hidden_states, attention_mask, kwargs, allowed: set[str]) -> str | None:
    """Why this call keeps the stock forward, before the tables are looked at; None if it can run fused."""
    if qualified_name(type(self.processor)) != processor:
        return f"its processor is {type(self.processor).__name__}, not diffusers' {processor.rpartition('.')[2]}"
    extra = set(kwargs) - allowed - QUIET_KWARGS
    if extra:
        return f"called with attention kwargs {sorted(extra)}"
    if attention_mask is not None:
        return "called with an attention_mask"
    if hidden_states.dim() != 3 or hidden_states.numel() == 0:
        return "token tensors that are not non-empty [B, S, C]"
    if _out_dtype(hidden_states, [self.norm_q, self.norm_k]) is None:
        return "norm parameters in another dtype than the tokens, or autocast off CUDA"
    return None


def _tables(self, tables, tokens: int, device: torch.device) -> tuple | str | None:
    """(cos, sin) [tokens, D] on ``device`` (as apply_rotary_emb moves them), None without tables, or why not."""
    if tables is None:
        return None
    head = self.norm_q.normalized_shape[0]
    if head % 2:
        return f"head size {head} is odd: the rotary pairs need an even one"
    if not (isinstance(tables, (tuple, list)) and len(tables) == 2):
        return "image_rotary_emb is not a (cos, sin) pair"
    for t in tables:
        if not isinstance(t, torch.Tensor) or t.requires_grad or not t.is_floating_point():
            return "rotary tables that are not floating-point tensors, or require grad"
        if t.shape != (tokens, head):
            return f"rotary tables of shape {tuple(t.shape)}, not [{tokens}, {head}]"
    return tuple(t.to(device) for t in tables)


def _cogvideox_tables(self, hidden_states, encoder_hidden_states, attention_mask, kwargs) -> tuple | str | None:
    """(cos, sin) [T + S, D] with identity rows for the text, None without rotary tables, or why the call keeps the
    stock forward."""
    reason = _call_reason(self, COGVIDEOX, hidden_states, attention_mask, kwargs, {"image_rotary_emb"})
    if reason is None and (encoder_hidden_states is None or encoder_hidden_states.dim() != 3):
        reason = "called without [B, T, C] encoder_hidden_states"
    if reason is not None:
        return reason
    tables = _tables(self, kwargs.get("image_rotary_emb"), hidden_states.shape[1], hidden_states.device)
    if not isinstance(tables, tuple):
        return tables
    return with_identity_rows(tables, encoder_hidden_states.shape[1], first=True)


def _norm_rope(norm: nn.LayerNorm, x: torch.Tensor, tables, out_dtype) -> torch.Tensor:
    rope = dict(rope=tables, **_ELEMENTS) if tables is not None else {}
    return layer_norm_rope(x, norm.weight, norm.bias, norm.eps, out_dtype=out_dtype, **rope)


def _norm_rope_attention(self, query, key, value, tables) -> tuple[torch.Tensor, torch.dtype]:
    """SDPA over the projections [B, S, C] with q and k normalised per head, and rotated (k only in
    self-attention), by one kernel each, as both processors order their steps: the output [B, S, heads x head] and
    the normalised queries' dtype."""
    batch = query.shape[0]
    head = key.shape[-1] // self.heads
    query, key, value = (t.view(batch, -1, self.heads, head) for t in (query, key, value))
    out_dtype = _out_dtype(query, [self.norm_q, self.norm_k])
    query = _norm_rope(self.norm_q, query, tables, out_dtype)
    key = _norm_rope(self.norm_k, key, None if self.is_cross_attention else tables, out_dtype)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=0.0, is_causal=False
    )
    return out.transpose(1, 2).reshape(batch, -1, self.heads * head), query.dtype


def _cogvideox_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    tables = _cogvideox_tables(self, hidden_states, encoder_hidden_states, attention_mask, kwargs)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, **kwargs)

    text = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    projections = (proj(hidden_states) for proj in (self.to_q, self.to_k, self.to_v))
    out, _ = _norm_rope_attention(self, *projections, tables)
    out = self.to_out[1](self.to_out[0](out))
    encoder_out, out = out.split([text, out.shape[1] - text], dim=1)
    return out, encoder_out


def _hunyuan_dit_attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    reason = _call_reason(self, HUNYUAN_DIT, hidden_states, attention_mask, kwargs, {"image_rotary_emb", "temb"})
    if reason is None and (self.spatial_norm is not None or self.group_norm is not None):
        reason = "a spatial_norm or group_norm before the projections"
    context = encoder_hidden_states
    if reason is None and context is not None and (context.dim() != 3 or context.shape[0] != hidden_states.shape[0]):
        reason = "encoder_hidden_states that are not [B, T, C] with the queries' batch"
    tables = reason or _tables(self, kwargs.get("image_rotary_emb"), hidden_states.shape[1], hidden_states.device)
    if isinstance(tables, str):
        count_reason(type(self).__name__, tables)
        return stock(self)(hidden_states, encoder_hidden_states, attention_mask, **kwargs)

    residual = hidden_states
    query = self.to_q(hidden_states)
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    elif self.norm_cross:
        encoder_hidden_states = self.norm_encoder_hidden_states(encoder_hidden_states)
    key, value = self.to_k(encoder_hidden_states), self.to_v(encoder_hidden_states)
    out, query_dtype = _norm_rope_attention(self, query, key, value, tables)
    out = self.to_out[1](self.to_out[0](out.to(query_dtype)))  # as the processor casts SDPA's output
    if self.residual_connection:
        out = out + residual
    return out / self.rescale_output_factor


class _LayerNormQKRule(ProcessorQKNormRopeRule):
    """A processor rule whose attention has torch LayerNorm q/k norms over the head size."""

    def norm_names(self, attn: nn.Module) -> tuple[str, ...]:
        return ("norm_q", "norm_k")

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        if subclass := self.subclass_reasons(attn):
            return subclass
        head = attn.inner_dim // attn.heads
        reasons = [_layer_norm_reason(n, getattr(attn, n, None), head) for n in self.norm_names(attn)]
        return [r for r in reasons if r]  # an odd head size is checked per call: only a rotation needs pairs


class CogVideoXQKNormRopeRule(_LayerNormQKRule):
    name = "cogvideox_qk_norm_rope"
    description = "CogVideoX attention: per-head query/key LayerNorm + RoPE of the video tokens in one row kernel"
    processor = COGVIDEOX

    def methods(self, site: Site):
        return _cogvideox_attention_forward


class HunyuanDiTQKNormRopeRule(_LayerNormQKRule):
    name = "hunyuan_dit_qk_norm_rope"
    description = "HunyuanDiT attention: per-head query/key LayerNorm + RoPE in one row kernel"
    processor = HUNYUAN_DIT

    def methods(self, site: Site):
        return _hunyuan_dit_attention_forward


RULES: list[Rule] = [CogVideoXQKNormRopeRule(), HunyuanDiTQKNormRopeRule()]
