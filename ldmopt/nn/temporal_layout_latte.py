"""Latte's temporal blocks in (B, F, N, C) token order: ``LatteTransformer3DModel``'s forward with each temporal
block on the spatial blocks' (B*F, N, C) tokens viewed as (B, F, N, C), instead of diffusers' permute to (B*N, F, C)
and back around every block (see ldmopt/nn/temporal_layout.py for the other temporal transformers)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.adaln_modulate import adaln_modulate
from ..ops.temporal_attention import MAX_FRAMES
from .child_check import hooked, stock, transform_reason
from .linear import feed_forward_reasons, ff_gated_residual, plain_layer_norm_reason
from .temporal_attention import temporal_self_attention, unsupported_reason
from .temporal_layout import _basic_block_bfnc, _block_static_reason, _counted, processor_reason


def _latte_block_reason(block: nn.Module) -> str | None:
    if type(block).__name__ != "BasicTransformerBlock" or block.norm_type not in ("ada_norm_single", "layer_norm"):
        return "not a BasicTransformerBlock with norm_type 'ada_norm_single' or 'layer_norm'"
    if block.norm_type == "layer_norm":
        return _block_static_reason(block)
    if block.attn2 is not None or block.pos_embed is not None or hasattr(block, "fuser"):
        return "attn2, a positional embedding or a GLIGEN fuser"
    # The same structure the adaln_block rule requires (its row kernel and gated GEMM run here too).
    reasons = [plain_layer_norm_reason(name, getattr(block, name)) for name in ("norm1", "norm2")]
    reasons = [r for r in reasons if r] + feed_forward_reasons(block.ff)
    if reasons:
        return reasons[0]
    reason = unsupported_reason(block.attn1)
    return None if reason is None else f"attn1: {reason}"


def latte_static_reason(model: nn.Module) -> str | None:
    """Why a ``LatteTransformer3DModel``'s temporal blocks cannot run in token order, whatever the call (None when
    they can): structure and attention processors."""
    for i, block in enumerate(model.temporal_transformer_blocks):
        reason = processor_reason(block) or _latte_block_reason(block)
        if reason is not None:
            return f"temporal_transformer_blocks.{i}: {reason}"
    return None


def latte_reason(model: nn.Module, hidden_states: Tensor, timestep, encoder_hidden_states) -> str | None:
    """Why this call of a Latte model must run diffusers' forward (None when its temporal blocks run in token order)."""
    transform = transform_reason()
    if transform is not None:
        return transform
    if hidden_states.ndim != 5 or timestep is None or encoder_hidden_states is None:
        return "not a (B, C, F, H, W) call with timestep and encoder_hidden_states"
    if hidden_states.shape[2] > MAX_FRAMES:
        return f"F={hidden_states.shape[2]} frames > {MAX_FRAMES}"
    if model.adaln_single is None or model.caption_projection is None:
        return "no adaln_single or caption_projection"
    for i, block in enumerate(model.temporal_transformer_blocks):
        if block._chunk_size is not None:
            return f"temporal_transformer_blocks.{i}: chunked feed-forward"
    return latte_static_reason(model)


def _latte_temporal_block(block: nn.Module, x: Tensor, emb: Tensor, bfn: tuple[int, int, int]) -> Tensor:
    """A BasicTransformerBlock attending over frames, on (B, F*N, C) frame-major tokens. ada_norm_single (Latte's
    own config): ``emb`` (B, 6C) is each video's timestep embedding (diffusers repeats it per pixel); layer_norm
    (diffusers' default): as in the AnimateDiff containers."""
    if block.norm_type == "layer_norm":
        return _basic_block_bfnc(block, x, bfn)
    b = x.shape[0]
    chunks = (block.scale_shift_table[None] + emb.reshape(b, 6, -1)).chunk(6, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
    normed = adaln_modulate(x, scale_msa, shift_msa, eps=block.norm1.eps)
    x = temporal_self_attention(block.attn1, normed, None, bfn, residual=x, gate=gate_msa)  # gated epilogue
    normed = adaln_modulate(x, scale_mlp, shift_mlp, eps=block.norm2.eps)
    return ff_gated_residual(block.ff, normed, gate_mlp, x)


def latte_forward(
    self,
    hidden_states: Tensor,
    timestep=None,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    enable_temporal_attentions: bool = True,
    return_dict: bool = True,
):
    """``LatteTransformer3DModel.forward`` with the temporal blocks on the spatial blocks' (B*F, N, C) tokens viewed
    as (B, F, N, C): no permute to (B*N, F, C) and back around each of them (2 copies per layer in diffusers)."""
    base = getattr(type(self), "_ldmopt_base", type(self))
    reason = latte_reason(self, hidden_states, timestep, encoder_hidden_states)
    if _counted(base, reason):
        return stock(self)(
            hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, enable_temporal_attentions,
            return_dict,
        )  # fmt: skip
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    batch, channels, frames, height, width = hidden_states.shape
    x = hidden_states.permute(0, 2, 1, 3, 4).reshape(-1, channels, height, width)
    patch = self.config.patch_size
    height, width = x.shape[-2] // patch, x.shape[-1] // patch
    pixels = height * width
    x = self.pos_embed(x)
    added = {"resolution": None, "aspect_ratio": None}
    emb, embedded_timestep = self.adaln_single(
        timestep, added_cond_kwargs=added, batch_size=batch, hidden_dtype=x.dtype
    )
    context = self.caption_projection(encoder_hidden_states)
    context = context.repeat_interleave(frames, dim=0, output_size=context.shape[0] * frames)
    emb_spatial = emb.repeat_interleave(frames, dim=0, output_size=emb.shape[0] * frames)
    checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing
    for i, (spatial, temporal) in enumerate(
        zip(self.transformer_blocks, self.temporal_transformer_blocks, strict=True)
    ):
        args = (x, None, context, encoder_attention_mask, emb_spatial, None, None)
        x = self._gradient_checkpointing_func(spatial, *args) if checkpointing else spatial(*args)
        if not enable_temporal_attentions:
            continue
        tokens = x.view(batch, frames, pixels, -1)
        if i == 0 and frames > 1:
            tokens = tokens + self.temp_pos_embed.to(tokens.dtype)[:, :, None]
        tokens = tokens.reshape(batch, frames * pixels, -1)
        step = (temporal, tokens, emb, (batch, frames, pixels))
        x = (
            self._gradient_checkpointing_func(_latte_temporal_block, *step)
            if checkpointing
            else _latte_temporal_block(*step)
        )
        x = x.view(batch * frames, pixels, -1)
    embedded_timestep = embedded_timestep.repeat_interleave(frames, dim=0, output_size=batch * frames)
    shift, scale = (self.scale_shift_table[None] + embedded_timestep[:, None]).chunk(2, dim=1)
    # diffusers' Latte: an affine-free LayerNorm, computed here unless a hook or wrapper must see it run
    if plain_layer_norm_reason("norm_out", self.norm_out) is None and not hooked(self.norm_out):
        x = adaln_modulate(x, scale, shift, eps=self.norm_out.eps)
    else:
        x = self.norm_out(x) * (1 + scale) + shift
    x = self.proj_out(x)
    x = x.reshape(-1, height, width, patch, patch, self.out_channels)
    x = torch.einsum("nhwpqc->nchpwq", x).reshape(-1, self.out_channels, height * patch, width * patch)
    output = x.reshape(batch, frames, *x.shape[1:]).permute(0, 2, 1, 3, 4)
    return Transformer2DModelOutput(sample=output) if return_dict else (output,)
