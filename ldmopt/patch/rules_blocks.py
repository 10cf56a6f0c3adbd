"""Transformer-block rules (family ``adaln``): adaLN modulation and gated residuals inside a block's forward.

- ``adaln_block``: ``BasicTransformerBlock`` with ``norm_type`` "ada_norm_zero" (DiT) or "ada_norm_single" (PixArt,
  Latte). The feed-forward's LayerNorm + ``(1 + scale) / shift`` runs as one ``adaln_modulate`` row kernel;
  PixArt/Latte's ``scale_shift_table`` self-attention modulation likewise. Every residual add is in a GEMM epilogue:
  the self-attention's gated ``h + gate * (o W^T + b)`` and the cross-attention's ``h + o W^T + b`` in ``to_out.0``
  (``ldmopt.nn.attention_residual``: diffusers' default processor reproduced up to ``to_out``, with per-call
  fall-backs to the attention module and the stock ops), the feed-forward's gated residual in ``ff.net[2]``. The
  attention projections, ``norm1`` of ada_norm_zero (its own rule) and ``ff.net[0]`` (the feed-forward rules) are
  called as before.
- ``joint_block``: SD3 ``JointTransformerBlock`` and Flux ``FluxTransformerBlock``: per stream, the attention's
  gated residual update ``h + gate * attn``, LayerNorm and modulation in one row kernel (the product never written),
  and the feed-forward's gated residual in its output GEMM (the attention runs as before).
- ``flux_single_gated``: ``FluxSingleTransformerBlock``: ``residual + gate * proj_out(cat([attn, mlp], -1))`` as one
  GEMM that reads the attention output and the MLP activation in place (the concatenation is never written), with
  the gated residual in its epilogue. The block's input ``cat([text, image], 1)`` is a view when the two are the
  halves of the previous single block's output, as FluxTransformer2DModel passes them (inference only: under
  autograd or torch.compile the block concatenates).

Both are class swaps (see rule.py): same instance, same children and parameters. A call the fused forward does not
cover (feed-forward chunking, GLIGEN kwargs, 4-D hidden states) runs the stock forward. Tolerance: the ops'
(within 2x the error of the unfused PyTorch ops in the input dtype); the fused path rounds once where the stock
path rounds after each op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..nn.attention_residual import ldmopt_processor, processor_reason
from ..nn.attention_residual import sdpa_attention_residual as attend
from ..nn.child_check import count_reason
from ..nn.layer_norm_input import NormedInput
from ..nn.linear import (
    feed_forward_reasons,
    ff_gated_residual,
    gated_residual_linear,
    modulation_batch_reason,
    plain_layer_norm_reason,
    plain_linear_reason,
)
from ..ops.adaln_modulate import adaln_modulate
from .rule import ClassSwapRule, Rule, Site, attention_reads, stock


def basic_block_forward(fused: Callable) -> Callable:
    """A ``BasicTransformerBlock.forward`` with diffusers' signature that runs ``fused(self, hidden_states,
    attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, kwargs, class_labels)`` (``kwargs``: a
    copy of the cross-attention kwargs), or the stock forward for what no fused block path covers: feed-forward
    chunking, GLIGEN kwargs, hidden states that are not (B, tokens, C)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        timestep: torch.LongTensor | None = None,
        cross_attention_kwargs: dict[str, Any] | None = None,
        class_labels: torch.LongTensor | None = None,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        kwargs = dict(cross_attention_kwargs or {})
        reason = _stock_call_reason(self, kwargs, hidden_states) or modulation_batch_reason(
            hidden_states, timestep, class_labels
        )
        if reason is not None:
            count_reason(type(self).__name__, reason)
            return stock(self)(
                hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep,
                cross_attention_kwargs, class_labels, added_cond_kwargs,
            )  # fmt: skip
        return fused(
            self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, kwargs,
            class_labels,
        )  # fmt: skip

    # Pickled by reference (torch.save of a patched model): the module-level name the decorated function is bound to.
    forward.__name__, forward.__qualname__, forward.__module__ = fused.__name__, fused.__qualname__, fused.__module__
    forward.__doc__ = fused.__doc__
    return forward


@basic_block_forward
def _adaln_block_forward(
    self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, kwargs, class_labels
) -> torch.Tensor:
    single = self.norm_type == "ada_norm_single"
    if single:
        batch = hidden_states.shape[0]
        chunks = (self.scale_shift_table[None] + timestep.reshape(batch, 6, -1)).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
        norm_hidden_states = adaln_modulate(hidden_states, scale_msa, shift_msa, eps=self.norm1.eps)
        ff_norm = self.norm2
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
            hidden_states, timestep, class_labels, hidden_dtype=hidden_states.dtype
        )
        gate_msa = gate_msa.unsqueeze(1)
        ff_norm = self.norm3
    if self.pos_embed is not None:
        norm_hidden_states = self.pos_embed(norm_hidden_states)
    where = type(self).__name__
    context = encoder_hidden_states if self.only_cross_attention else None
    # h + gate * attn1(...) and h + attn2(...): the gate and the adds in the output projections' GEMM epilogues.
    hidden_states = attend(
        self.attn1, norm_hidden_states, hidden_states, context, attention_mask, kwargs, where, "attn1", gate=gate_msa
    )
    if self.attn2 is not None:
        if single:
            norm_hidden_states = hidden_states  # PixArt: no norm before the cross-attention
        elif self.pos_embed is None:  # DiT-style cross-attention: norm2 read in to_q's loads
            norm_hidden_states = NormedInput(self.norm2, hidden_states, where, "norm2")
        else:
            norm_hidden_states = self.pos_embed(self.norm2(hidden_states))
        hidden_states = attend(
            self.attn2, norm_hidden_states, hidden_states, encoder_hidden_states, encoder_attention_mask, kwargs,
            where, "attn2",
        )  # fmt: skip
    norm_hidden_states = adaln_modulate(hidden_states, scale_mlp, shift_mlp, eps=ff_norm.eps)
    return ff_gated_residual(self.ff, norm_hidden_states, gate_mlp, hidden_states)


class AdaLNBlockRule(ClassSwapRule):
    name = "adaln_block"
    family = "adaln"
    description = "adaLN block: LayerNorm+modulation row kernels; attention and FF residuals in the output GEMMs"
    checked_in_forward = ("ff.net.2",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.attention import BasicTransformerBlock

        return (BasicTransformerBlock,)

    def match(self, site: Site) -> bool:
        return getattr(site.module, "norm_type", None) in ("ada_norm_zero", "ada_norm_single")

    def _norms(self, block) -> dict[str, Any]:
        if block.norm_type == "ada_norm_single":
            return {"norm1": block.norm1, "norm2": block.norm2}
        return {"norm3": block.norm3}

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        reasons = []
        if hasattr(block, "fuser"):
            reasons.append("GLIGEN fuser (attention_type 'gated') is not fused")
        for name, norm in self._norms(block).items():
            reason = plain_layer_norm_reason(name, norm)
            if reason:
                reasons.append(reason)
        return reasons + feed_forward_reasons(block.ff)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        block = site.module
        return {"": block, **self._norms(block), "ff": block.ff, "ff.net.2": block.ff.net[2]}

    def shallow(self, site: Site) -> set[str]:
        return {"", "ff"}  # ff's children net.0 / net.1 are still called

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        # The attentions' residual adds in to_out.0's epilogues; DiT-style norm2 in attn2's to_q loads.
        block = site.module
        dit_norm2 = block.norm_type == "ada_norm_zero" and block.pos_embed is None
        return {
            **attention_reads(block.attn1, "attn1", None),
            **attention_reads(block.attn2, "attn2", "cross" if dit_norm2 else None),
        }

    def stock_part_reasons(self, site: Site) -> list[str]:
        return unmirrored_processor_reasons(site.module)

    def methods(self, site: Site):
        return _adaln_block_forward


def unmirrored_processor_reasons(block: nn.Module) -> list[str]:
    """A BasicTransformerBlock's attentions whose processor the fused path does not mirror (a custom one, an
    IP-Adapter's): each of their calls runs stock, with the residual add after it. ldmopt's own processors (installed
    by ldmopt.nn.install_processors before patching) are a fused path of their own, as the per-call count has it."""
    reasons = []
    for name in ("attn1", "attn2"):
        attn = getattr(block, name, None)
        if attn is not None and not ldmopt_processor(attn.processor) and (reason := processor_reason(attn, name)):
            reasons.append(reason)
    return reasons


def adjacent_halves(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """``torch.cat([first, second], 1)`` as a view, when no gradient is asked and the two are the halves of one
    tensor along dim 1 (the previous Flux single block's outputs, which FluxTransformer2DModel hands to the next: its
    ``hidden[:, :text], hidden[:, text:]``); else None. Under autograd or torch.compile: None (the caller concatenates;
    a view would bypass the graph's record of where the halves came from)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (first.requires_grad or second.requires_grad)):
        return None
    # Plain tensors only: a subclass (DTensor) or a functorch wrapper has no storage to compare.
    plain = type(first) is torch.Tensor and type(second) is torch.Tensor
    if not plain or torch._C._are_functorch_transforms_active():
        return None
    if first.dim() != second.dim() or first.dim() < 2 or first.dtype != second.dtype or first.device != second.device:
        return None
    if first.stride() != second.stride() or first.shape[:1] + first.shape[2:] != second.shape[:1] + second.shape[2:]:
        return None
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    if second.storage_offset() != first.storage_offset() + first.shape[1] * first.stride(1):
        return None
    joint = (first.shape[0], first.shape[1] + second.shape[1], *first.shape[2:])
    return first.as_strided(joint, first.stride(), first.storage_offset())


def _flux_single_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = modulation_batch_reason(hidden_states, temb)
    if reason is not None:
        count_reason(type(self).__name__, reason)
        return stock(self)(hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
    text_seq_len = encoder_hidden_states.shape[1]
    # [text | image]: the previous single block's two outputs are still one tensor, read in place (no copy).
    joint = adjacent_halves(encoder_hidden_states, hidden_states)
    hidden_states = joint if joint is not None else torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    attn_output = self.attn(
        hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    # proj_out(cat([attn, mlp], -1)): the GEMM reads both parts in place, the concatenation is never written.
    # diffusers clips an fp16 stream to +-65504 afterwards: here in the epilogue, before the rounding.
    hidden_states = gated_residual_linear(
        self.proj_out, (attn_output, mlp_hidden_states), gate, residual, "FluxSingleTransformerBlock", "proj_out",
        clip_fp16=True,
    )  # fmt: skip
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


class FluxSingleGatedRule(ClassSwapRule):
    name = "flux_single_gated"
    family = "adaln"
    description = "Flux single block: proj_out GEMM reading [attn | mlp] in place, gated residual in its epilogue"
    checked_in_forward = ("proj_out",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

        return (FluxSingleTransformerBlock,)

    def reasons(self, site: Site) -> list[str]:
        reason = plain_linear_reason("proj_out", site.module.proj_out)
        return [reason] if reason else []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module, "proj_out": site.module.proj_out}

    def methods(self, site: Site):
        return _flux_single_forward


def _stream(hidden, update, update_gate, scale, shift, gate, norm, ff, name="ff", clip_fp16=False):
    """``h = hidden + update_gate * update; h + gate * ff(layer_norm(h) * (1 + scale) + shift)``: the gated residual
    add, LayerNorm and modulation in one row kernel, the feed-forward's output projection with the gated residual in
    one GEMM (``clip_fp16``: an fp16 result clipped to +-65504 there, as Flux clips its text stream). ``update_gate``
    is one vector per sample (B, C)."""
    if torch.promote_types(torch.promote_types(update.dtype, update_gate.dtype), hidden.dtype) == hidden.dtype:
        # The gate's multiply in the row kernel too (it rounds the sum to the stream's dtype, as the stock add does).
        normed, hidden = adaln_modulate(
            update, scale, shift, residual=hidden, gate=update_gate, eps=norm.eps, return_residual=True
        )
    else:  # the gated update would promote the stream (an fp32 gate on a bf16 stream): the stock product first
        pending = update_gate.unsqueeze(1) * update
        normed, hidden = adaln_modulate(pending, scale, shift, residual=hidden, eps=norm.eps, return_residual=True)
    return ff_gated_residual(ff, normed, gate, hidden, name, clip_fp16=clip_fp16)


def _stock_call_reason(block: nn.Module, kwargs: dict, hidden_states: torch.Tensor) -> str | None:
    """Why a BasicTransformerBlock call runs diffusers' forward (counted in the report), None when fused."""
    if block._chunk_size is not None:
        return "feed-forward chunking (set_chunk_feed_forward)"
    if "gligen" in kwargs:
        return "GLIGEN cross_attention_kwargs"
    if hidden_states.dim() != 3:
        return f"{hidden_states.dim()}-D hidden states (the fused block takes (B, tokens, C))"
    if not hidden_states.numel():  # the ops refuse empty inputs; diffusers' forward returns them empty
        return f"empty hidden states of shape {tuple(hidden_states.shape)}"
    return None


def _sd3_joint_forward(
    self,
    hidden_states: torch.FloatTensor,
    encoder_hidden_states: torch.FloatTensor,
    temb: torch.FloatTensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    reason = (
        "feed-forward chunking (set_chunk_feed_forward)"
        if self._chunk_size is not None
        else modulation_batch_reason(hidden_states, temb) or modulation_batch_reason(encoder_hidden_states, temb)
    )
    if reason is None and not (hidden_states.numel() and encoder_hidden_states.numel()):
        reason = "empty token tensors (the fused ops need at least one element)"
    if reason is not None:
        count_reason(type(self).__name__, reason)
        return stock(self)(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = self.norm1(
            hidden_states, emb=temb
        )
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states, **joint_attention_kwargs
    )
    update, update_gate = attn_output, gate_msa
    if self.use_dual_attention:
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        update, update_gate = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs), gate_msa2
    hidden_states = _stream(hidden_states, update, update_gate, scale_mlp, shift_mlp, gate_mlp, self.norm2, self.ff)
    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states = _stream(
        encoder_hidden_states, context_attn_output, c_gate_msa, c_scale_mlp, c_shift_mlp, c_gate_mlp,
        self.norm2_context, self.ff_context, name="ff_context",
    )  # fmt: skip
    return encoder_hidden_states, hidden_states


def _flux_double_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = modulation_batch_reason(hidden_states, temb) or modulation_batch_reason(encoder_hidden_states, temb)
    if reason is not None:
        count_reason(type(self).__name__, reason)
        return stock(self)(hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    attn_output, context_attn_output = attention_outputs[:2]
    hidden_states = _stream(hidden_states, attn_output, gate_msa, scale_mlp, shift_mlp, gate_mlp, self.norm2, self.ff)
    if len(attention_outputs) == 3:  # IP-Adapter output, added after the feed-forward as diffusers does
        hidden_states = hidden_states + attention_outputs[2]
    # diffusers clips an fp16 text stream to +-65504 afterwards: here in the feed-forward's epilogue.
    encoder_hidden_states = _stream(
        encoder_hidden_states, context_attn_output, c_gate_msa, c_scale_mlp, c_shift_mlp, c_gate_mlp,
        self.norm2_context, self.ff_context, name="ff_context", clip_fp16=True,
    )  # fmt: skip
    return encoder_hidden_states, hidden_states


class JointBlockRule(ClassSwapRule):
    """SD3 ``JointTransformerBlock`` and Flux ``FluxTransformerBlock``: both streams' gated residual update + LayerNorm
    + modulation in one row kernel each, and their feed-forward output GEMMs with the gated residual epilogue."""

    name = "joint_block"
    family = "adaln"
    description = "SD3/Flux joint block: gated residual+LayerNorm+modulation per stream, FF out GEMM epilogue"
    checked_in_forward = ("ff.net.2", "ff_context.net.2")

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.attention import JointTransformerBlock
        from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

        return (JointTransformerBlock, FluxTransformerBlock)

    def _streams(self, block) -> list[str]:
        return ["", "_context"] if getattr(block, "ff_context", None) is not None else [""]

    def reasons(self, site: Site) -> list[str]:
        reasons = []
        for suffix in self._streams(site.module):
            reason = plain_layer_norm_reason(f"norm2{suffix}", getattr(site.module, f"norm2{suffix}"))
            reasons += [reason] if reason else []
            reasons += feed_forward_reasons(getattr(site.module, f"ff{suffix}"), name=f"ff{suffix}")
        return reasons

    def touched(self, site: Site) -> dict[str, nn.Module]:
        out = {"": site.module}
        for suffix in self._streams(site.module):
            ff = getattr(site.module, f"ff{suffix}")
            out.update({f"norm2{suffix}": getattr(site.module, f"norm2{suffix}"), f"ff{suffix}": ff})
            out[f"ff{suffix}.net.2"] = ff.net[2]
        return out

    def shallow(self, site: Site) -> set[str]:
        return {"", *(f"ff{suffix}" for suffix in self._streams(site.module))}

    def methods(self, site: Site):
        return _sd3_joint_forward if type(site.module).__name__ == "JointTransformerBlock" else _flux_double_forward


RULES: list[Rule] = [AdaLNBlockRule(), JointBlockRule(), FluxSingleGatedRule()]
