"""Residual-epilogue rule (family ``residual``): the three residual adds of UNet transformer blocks in GEMM epilogues.

- ``residual_block``: ``BasicTransformerBlock`` with ``norm_type`` "layer_norm" (the spatial and cross-attention
  blocks of SD1.5, SD2.1, SDXL, SVD, AnimateDiff and ModelScope UNets). The self-attention and cross-attention
  outputs are added to the token stream by their output projection's GEMM (``ldmopt.nn.attention_residual``:
  diffusers' default processor reproduced up to ``to_out``, whose ``/ 1.0`` pass also goes), and the feed-forward's
  by ``ff.net[2]``'s. Each LayerNorm is read in the loads of the GEMMs after it (``ldmopt.nn.layer_norm_input``:
  norm1 by to_q/to_k/to_v, norm2 by the cross-attention's to_q, norm3 by the feed-forward's fused GEGLU/GELU
  projection): the norms' outputs are never written. norm1's statistics come from one pass over the block's input,
  norm2's and norm3's from the epilogue of the output projection that wrote their input (``ops.linear(...,
  next_norm_eps=)``). diffusers' sinusoidal
  positional embeddings on norm1/norm2 are added in the same loads; another (or hooked) one is called as a module
  on the norm's output. Attention masks are served (diffusers' mask preparation is called).

A class swap (see rule.py): same instance, same children and parameters. Per call, an attention the mirrored
processors do not serve (another processor, hooks on the attention module, extra attention kwargs, an output
projection wrapped after patching, e.g. by a LoRA) runs as diffusers calls it, followed by the stock add, the reason
counted in the report's fall-backs; a feed-forward that is not diffusers' [act, dropout, Linear] (final_dropout) or
is hooked runs as a module, followed by the add; feed-forward chunking, GLIGEN kwargs and 4-D hidden states run the
stock forward.
Tolerance: the linear op's (the fused path rounds once where the stock path rounds after the GEMM and after the add).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.attention_residual import attention_residual_and_stats as attend
from ..nn.attention_residual import static_reason
from ..nn.layer_norm_input import NormedInput, fused_norm_eps, normed_with_positions
from ..nn.linear import ff_residual_and_stats
from ..nn.stats_handover import offer_layer_norm, take_layer_norm, wanted_layer_norm_eps
from .rule import ClassSwapRule, Rule, Site, attention_reads, feed_forward_reads
from .rules_blocks import basic_block_forward, unmirrored_processor_reasons

NORM_TYPES = ("layer_norm",)  # "layer_norm_i2vgen" blocks have no norm3: their stock forward cannot run


@basic_block_forward
def _residual_block_forward(
    self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, kwargs, class_labels
) -> torch.Tensor:
    where = type(self).__name__
    # Each norm's output (plus sinusoidal positions) only feeds GEMMs, which read it in their loads. norm2's and norm3's
    # statistics come from the output projection's epilogue that wrote their input (the residual sum); norm1's from
    # what wrote the block's input when it handed them over: the previous block's feed-forward GEMM (blocks in a row:
    # SDXL's ten), or for the first block its transformer's proj_in (the fused GroupNorm + 1x1 conv's epilogue).
    # Taken (and, on a miss, asked for) only when norm1 will be read in the loads: a hooked or replaced norm1 runs as
    # a module, which would compute its statistics anyway, and its producer then stops summing them (stats_handover).
    eps = fused_norm_eps(self.norm1, hidden_states.shape[-1])
    stats = take_layer_norm(hidden_states, eps, "norm1") if eps is not None else None
    normed = _normed(self, "norm1", hidden_states, where, stats)
    context = encoder_hidden_states if self.only_cross_attention else None
    after_attn1 = self.norm2 if self.attn2 is not None else self.norm3
    hidden_states, stats = attend(self.attn1, normed, hidden_states, context, attention_mask, kwargs, where, "attn1",
                                  next_norm=after_attn1)  # fmt: skip
    if self.attn2 is not None:
        normed = _normed(self, "norm2", hidden_states, where, stats)
        hidden_states, stats = attend(self.attn2, normed, hidden_states, encoder_hidden_states, encoder_attention_mask,
                                      kwargs, where, "attn2", next_norm=self.norm3)  # fmt: skip
    normed = NormedInput(self.norm3, hidden_states, where, "norm3", stats=stats)
    eps = wanted_layer_norm_eps(self, hidden_states)  # asked by the block after this one, on an earlier call
    out, out_stats = ff_residual_and_stats(self.ff, normed, hidden_states, eps)
    offer_layer_norm(out, self, eps, out_stats)
    return out


def _normed(block: nn.Module, name: str, x: torch.Tensor, where: str, stats: torch.Tensor | None = None):
    """``pos_embed(norm(x))`` (or ``norm(x)``) read in the GEMMs' loads: (B, T, C) rows b * T + t take position t.
    ``stats``: x's statistics for this norm, when the GEMM that wrote x summed them."""
    norm = getattr(block, name)
    return normed_with_positions(norm, x, where, name, block.pos_embed, x.shape[1], 1, block.pos_embed, stats)


class ResidualBlockRule(ClassSwapRule):
    name = "residual_block"
    family = "residual"
    description = (
        "UNet transformer block: attention and feed-forward residual adds in the output GEMMs' epilogues, LayerNorms "
        "read in the loads of the GEMMs after them"
    )

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.attention import BasicTransformerBlock

        return (BasicTransformerBlock,)

    def match(self, site: Site) -> bool:
        return getattr(site.module, "norm_type", None) in NORM_TYPES

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        reasons = ["GLIGEN fuser (attention_type 'gated') is not fused"] if hasattr(block, "fuser") else []
        for name in ("attn1", "attn2"):
            attn = getattr(block, name, None)
            reason = None if attn is None else static_reason(attn, name)
            if reason:
                reasons.append(reason)
        return reasons

    def touched(self, site: Site) -> dict[str, nn.Module]:
        # Only the block's own forward is replaced. What its fused path reads instead of calling (the attentions'
        # to_out.0, the feed-forward and its net.2) is checked on every call, so a LoRA or hook on one of them costs
        # that one epilogue, not the block; the attention modules are still called whenever their processor is not
        # the mirrored one, and other rules may give them processors.
        return {"": site.module}

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        # norm1 in attn1's projections (to_q alone when only_cross_attention), norm2 in attn2's to_q, norm3 in the
        # feed-forward's first projection; the residual adds in to_out.0's and net.2's epilogues.
        block = site.module
        reads = attention_reads(block.attn1, "attn1", "cross" if block.only_cross_attention else "self")
        reads.update(attention_reads(block.attn2, "attn2", "cross"))
        return {**reads, **feed_forward_reads(block.ff)}

    def stock_part_reasons(self, site: Site) -> list[str]:
        return unmirrored_processor_reasons(site.module)

    def methods(self, site: Site):
        return _residual_block_forward


RULES: list[Rule] = [ResidualBlockRule()]
