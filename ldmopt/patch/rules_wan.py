"""Wan-style transformer blocks (family ``adaln``, rule ``wan_block``): Wan 2.1/2.2 (``WanTransformerBlock``, also
used by Wan VACE, Wan Animate and ChronoEdit) and SkyReels-V2 (``SkyReelsV2TransformerBlock``).

Their forward keeps the residual stream in the model dtype but does every norm, modulation and gated add in fp32:
``(norm1(h.float()) * (1 + scale) + shift).type_as(h)``, ``(h.float() + attn * gate).type_as(h)``,
``norm2(h.float()).type_as(h)``, ``(h.float() + ff.float() * gate).type_as(h)``: about 20 elementwise passes over
the token stream per block, half of them on fp32 copies. The fused forward keeps the same fp32 math with one rounding
per result, in four kernels around the attention and feed-forward GEMMs:

1. ``adaln_modulate`` for norm1 + modulation;
2. ``adaln_modulate`` with ``gate``: the gated residual add after self-attention and norm2 (its affine weight and
   bias as ``1 + (weight - 1)`` and ``shift``) in one row kernel that also returns the new stream;
3. ``adaln_modulate`` with the residual: the cross-attention residual add, norm3 and the feed-forward modulation;
4. the feed-forward output GEMM with the fp32 gate and the residual in its epilogue, rounded once to the stream dtype
   (``out_dtype``), after ``ffn.net[0]`` (the GELU projection, fused by the feed-forward rules).

Per-sample modulation (temb [B, 6, C], Wan 2.1 / 2.2 14B) and per-token modulation (temb [B, T, 6, C], Wan 2.2 TI2V
5B; SkyReels-V2 diffusion forcing [B, 6, T, C]) are both covered: per-token rows are flattened to [B*T, C] views.
The attention modules run as before. Anything else (another norm type, a feed-forward that is not [act, dropout,
Linear], hidden states that are not [B, T, C]) keeps the stock forward, with the reason in the report.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.child_check import count_reason
from ..nn.linear import feed_forward_reasons, ff_gated_residual
from ..ops.adaln_modulate import adaln_modulate
from .rule import ClassSwapRule, Rule, Site, diffusers_classes, stock

#: The blocks with Wan's forward (the three WanTransformerBlock classes are copies in separate modules).
WAN_BLOCKS = (
    "transformers.transformer_wan:WanTransformerBlock",
    "transformers.transformer_chronoedit:WanTransformerBlock",
    "transformers.transformer_wan_animate:WanTransformerBlock",
    "transformers.transformer_skyreels_v2:SkyReelsV2TransformerBlock",
)


def _chunks(self, temb: torch.Tensor, skyreels: bool) -> list[torch.Tensor] | None:
    """The six modulation tensors exactly as the stock forward forms them ([B, 1, C] or [B, T, C], fp32)."""
    table = self.scale_shift_table
    if temb.ndim == 3:
        return list((table + temb.float()).chunk(6, dim=1))
    if temb.ndim == 4 and skyreels:  # diffusion forcing: [B, 6, T, C]
        return [c.squeeze(1) for c in (table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
    if temb.ndim == 4:  # Wan 2.2 TI2V: [B, T, 6, C]
        return [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return None


def _rows(chunks: list[torch.Tensor], hidden: torch.Tensor):
    """(flat, mods): how ``hidden`` and the modulation are handed to the row kernels. Per-sample modulation keeps
    [B, T, C] with [B, 1, C] vectors; per-token modulation flattens both to [B*T, C] rows (views where possible)."""
    b, t, c = hidden.shape
    if all(m.shape[1] == 1 for m in chunks):
        return (lambda h: h), [m.expand(b, 1, c) for m in chunks]
    return (lambda h: h.reshape(b * t, c)), [m.expand(b, t, c).reshape(b * t, c) for m in chunks]


def _affine_as_modulation(norm: nn.LayerNorm, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's weight and bias as adaln's ``(1 + scale, shift)``, one vector per row of ``like``'s modulation
    (scale = weight - 1 is exact for weights in [0.5, 2] and within an fp32 ulp otherwise; zeros without affine)."""
    rows, c = like.shape[0], like.shape[-1]
    zeros = like.new_zeros((), dtype=torch.float32).expand(rows, c)
    scale = (norm.weight.float() - 1.0).expand(rows, c) if norm.weight is not None else zeros
    shift = norm.bias.float().expand(rows, c) if norm.bias is not None else zeros
    return (scale, shift) if like.dim() == 2 else (scale[:, None], shift[:, None])


def _fused_body(self, hidden_states, encoder_hidden_states, chunks, attention_mask, rotary_emb) -> torch.Tensor:
    shape = hidden_states.shape
    flat, mods = _rows(chunks, hidden_states)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods

    # 1. Self-attention on (norm1(h) * (1 + scale) + shift) in the stream dtype.
    norm_hidden_states = adaln_modulate(flat(hidden_states), scale_msa, shift_msa, eps=self.norm1.eps).view(shape)
    # rotary_emb by keyword: SkyReels-V2 blocks before diffusers 0.36 hold the generic Attention (processor kwargs).
    attn_output = self.attn1(norm_hidden_states, None, attention_mask, rotary_emb=rotary_emb)

    # 2. The gated residual add and norm2 in one kernel (or the stock add when norm2 is an Identity).
    if isinstance(self.norm2, nn.Identity):
        hidden_states = (hidden_states.float() + attn_output * chunks[2]).type_as(hidden_states)
        norm_hidden_states = hidden_states
    else:
        scale2, shift2 = _affine_as_modulation(self.norm2, scale_msa)
        norm_hidden_states, hidden_states = adaln_modulate(
            flat(attn_output), scale2, shift2, residual=flat(hidden_states), gate=gate_msa, eps=self.norm2.eps,
            return_residual=True,
        )  # fmt: skip
        norm_hidden_states, hidden_states = norm_hidden_states.view(shape), hidden_states.view(shape)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states)

    # 3. Residual add + norm3 + modulation, then the feed-forward with its fp32 gated residual in the GEMM epilogue.
    norm_hidden_states, hidden_states = adaln_modulate(
        flat(attn_output), c_scale_msa, c_shift_msa, residual=flat(hidden_states), eps=self.norm3.eps,
        return_residual=True,
    )  # fmt: skip
    out = ff_gated_residual(
        self.ffn, norm_hidden_states, c_gate_msa, hidden_states, "ffn", out_dtype=hidden_states.dtype
    )
    return out.view(shape)


def _usable(self, hidden_states: torch.Tensor, chunks: list[torch.Tensor] | None) -> bool:
    """Whether the fused forward takes these shapes; otherwise the stock forward runs, counted in the report."""
    ok = chunks is not None and hidden_states.dim() == 3
    if ok:
        b, t, _ = hidden_states.shape
        ok = all(m.dim() == 3 and m.shape[0] in (1, b) and m.shape[1] in (1, t) for m in chunks)
    if not ok:
        count_reason(type(self).__name__, "hidden states / temb shapes the fused forward does not take")
    elif not hidden_states.numel():  # an empty batch: the ops refuse it, the stock forward returns it empty
        count_reason(type(self).__name__, "empty hidden states (the fused ops need at least one element)")
        ok = False
    return ok


def _wan_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    chunks = _chunks(self, temb, skyreels=False)
    if not _usable(self, hidden_states, chunks):
        return stock(self)(hidden_states, encoder_hidden_states, temb, rotary_emb)
    return _fused_body(self, hidden_states, encoder_hidden_states, chunks, None, rotary_emb)


def _skyreels_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask):
    chunks = _chunks(self, temb, skyreels=True)
    if not _usable(self, hidden_states, chunks):
        return stock(self)(hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)
    return _fused_body(self, hidden_states, encoder_hidden_states, chunks, attention_mask, rotary_emb)


def _fp32_layer_norm_reason(name: str, norm: object, affine: bool | None) -> str | None:
    """Why ``norm`` is not the FP32LayerNorm the fused forward reads (affine None: either kind)."""
    from diffusers.models.normalization import FP32LayerNorm

    if type(norm) is not FP32LayerNorm:
        return f"{name} is {type(norm).__name__}, not diffusers' FP32LayerNorm"
    has_affine = norm.weight is not None
    if affine is not None and has_affine != affine:
        return f"{name} {'has' if has_affine else 'lacks'} affine parameters, unlike Wan's"
    if has_affine and (not norm.weight.is_floating_point() or norm.weight.shape != norm.normalized_shape):
        return f"{name}.weight is not a floating vector of the normalised width"
    return None


class WanBlockRule(ClassSwapRule):
    name = "wan_block"
    family = "adaln"
    description = "Wan block: fp32 norms, modulation and gated adds in 3 row kernels, FF out GEMM with fp32 gate"
    checked_in_forward = ("ffn.net.2",)

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes(*WAN_BLOCKS)

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        reasons = [
            r
            for r in (
                _fp32_layer_norm_reason("norm1", block.norm1, affine=False),
                _fp32_layer_norm_reason("norm3", block.norm3, affine=False),
                None if isinstance(block.norm2, nn.Identity) else _fp32_layer_norm_reason("norm2", block.norm2, None),
            )
            if r
        ]
        table = getattr(block, "scale_shift_table", None)
        if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[:2] != (1, 6):
            reasons.append("scale_shift_table is not the [1, 6, C] table of Wan's blocks")
        return reasons + feed_forward_reasons(block.ffn, "ffn")

    def touched(self, site: Site) -> dict[str, nn.Module]:
        block = site.module
        return {
            "": block, "norm1": block.norm1, "norm2": block.norm2, "norm3": block.norm3, "ffn": block.ffn,
            "ffn.net.2": block.ffn.net[2],
        }  # fmt: skip

    def shallow(self, site: Site) -> set[str]:
        return {"", "ffn"}  # the attention modules and ffn.net[0] / net[1] are still called

    def methods(self, site: Site):
        return _skyreels_forward if type(site.module).__name__ == "SkyReelsV2TransformerBlock" else _wan_forward


RULES: list[Rule] = [WanBlockRule()]
