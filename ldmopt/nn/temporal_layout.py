"""Temporal transformers run whole in (B, F, N, C) token order, so no permuted copy of the activation is made.

diffusers' temporal layers take (B*F, C, H, W) activations, permute them to (B*N, F, C) sequences (one copy), run
their transformer blocks, and permute back (another copy). Every op in those blocks but the attention acts per
token, and ldmopt's temporal attention kernel reads frames with a stride, so the blocks can run on the tokens where
they already lie:

- **SVD** ``TemporalBasicTransformerBlock`` (:func:`svd_block_bfnc`): its (B*F, N, C) input is viewed as
  (B, F, N, C); ``attn1`` runs the strided kernel along F; ``attn2``, whose context is one image-embedding token per
  (batch, pixel), is the exact single-key shortcut broadcast over frames.
- **AnimateDiff** ``AnimateDiffTransformer3D`` (motion modules) and **ModelScope/UNet3D**
  ``TransformerTemporalModel`` (``transformer_in``, ``temp_attentions``) (:func:`container_bfnc`): a channels-last
  (B*F, C, H, W) input already IS the (B, F, H*W, C) token array. Its GroupNorm over (C/G, F, H, W) runs on the
  channels_last_3d (B, C, F, H, W) view, proj_in/proj_out and the blocks' norms and feed-forwards act on the token
  array, attn1/attn2 (self-attention over frames) run the strided kernel, and the residual add writes the result in
  the input's layout. An NCHW input is first copied to channels-last (one copy instead of diffusers' two, counted
  in :data:`layout_conversions`).

Same modules, parameters and state_dict; results equal to diffusers' forward within the temporal kernel's tolerance
(fp32 scores and softmax). A call these paths do not cover (chunked feed-forward, custom processors, masks or
contexts, F > 64) runs the class's own forward, the reason counted in :data:`fallback_reasons`.

Two ways in: ``ldmopt.patch`` (family ``temporal_layout``: a class swap, see ldmopt/patch/rules_temporal_layout.py), or
:func:`install_temporal_blocks` (an instance ``forward``, for code that does not use ``patch``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ops.temporal_attention import MAX_FRAMES
from .temporal_attention import (
    _single_key_module_reason,
    _stock_or_ours,
    single_key_attention,
    temporal_self_attention,
    unsupported_reason,
)

#: Class name -> kind of every module that can run in (B, F, N, C) order.
SVD_BLOCKS = ("TemporalBasicTransformerBlock",)
CONTAINERS = ("AnimateDiffTransformer3D", "TransformerTemporalModel")

#: (class name, reason) -> calls that ran diffusers' forward instead (process-wide, like ldmopt.nn.resnet's).
fallback_reasons: Counter[tuple[str, str]] = Counter()
#: what -> calls that copied an NCHW input to channels-last before running in token order.
layout_conversions: Counter[str] = Counter()


def processor_reason(attn, name: str) -> str | None:
    if not _stock_or_ours(attn.processor):
        return f"{name} has custom processor {type(attn.processor).__name__}"
    return None


# ------------------------------------------------------------------------------------------------ SVD block


def svd_block_static_reason(block: nn.Module) -> str | None:
    """Why an SVD ``TemporalBasicTransformerBlock`` can never run in (B, F, N, C) order (None when it can)."""
    reason = unsupported_reason(block.attn1)
    if reason is not None:
        return f"attn1: {reason}"
    if block.attn2 is not None and (block.attn2.added_kv_proj_dim is not None or block.attn2.to_out is None):
        return "attn2 has added key/value projections or no output projection"
    return None


def svd_block_reason(block: nn.Module, hidden_states: Tensor, num_frames: int, context: Tensor | None) -> str | None:
    """Why this call of an SVD temporal block must run diffusers' forward (None when it runs in token order)."""
    if block._chunk_size is not None:
        return "chunked feed-forward"
    if hidden_states.ndim != 3 or hidden_states.shape[0] % num_frames:
        return f"input of shape {tuple(hidden_states.shape)} for {num_frames} frames"
    if num_frames > MAX_FRAMES:
        return f"F={num_frames} frames > {MAX_FRAMES}"
    for name in ("attn1", "attn2"):
        attn = getattr(block, name)
        reason = None if attn is None else processor_reason(attn, name)
        if reason is not None:
            return reason
    reason = svd_block_static_reason(block)
    if reason is not None:
        return reason
    if block.attn2 is not None:
        pairs = hidden_states.shape[0] // num_frames * hidden_states.shape[1]
        if context is None or context.ndim != 3 or tuple(context.shape[:2]) != (pairs, 1):
            return "attn2 context is not one key per (batch, pixel)"
        reason = _single_key_module_reason(block.attn2)
        if reason is not None:
            return f"attn2: {reason}"
    return None


def svd_block_bfnc(block: nn.Module, hidden_states: Tensor, num_frames: int, context: Tensor | None) -> Tensor:
    """``TemporalBasicTransformerBlock.forward`` in token order (call only when :func:`svd_block_reason` is None)."""
    bf, n, c = hidden_states.shape
    b = bf // num_frames
    x = hidden_states.view(b, num_frames, n, c)
    h = block.ff_in(block.norm_in(x))
    if block.is_res:
        h = h + x
    h = temporal_self_attention(block.attn1, block.norm1(h), None, (b, num_frames, n)) + h
    if block.attn2 is not None:
        attn2 = block.attn2
        # (B*N, 1, C) context rows -> (B, 1, N, C), broadcast over the frames.
        out = single_key_attention(attn2, context).view(b, 1, n, -1)
        if attn2.residual_connection:
            out = out + block.norm2(h)
        h = out / attn2.rescale_output_factor + h
    ff = block.ff(block.norm3(h))
    h = ff + h if block.is_res else ff
    return h.view(bf, n, -1)


# ------------------------------------------------------------------------------------------------ containers


def _positional_reason(pos_embed) -> str | None:
    if pos_embed is None:
        return None
    if type(pos_embed).__name__ != "SinusoidalPositionalEmbedding" or not isinstance(
        getattr(pos_embed, "pe", None), Tensor
    ):
        return f"positional embedding {type(pos_embed).__name__} (only the sinusoidal table over frames is known)"
    return None


def _block_static_reason(block: nn.Module) -> str | None:
    if type(block).__name__ != "BasicTransformerBlock":
        return f"block {type(block).__name__} is not a BasicTransformerBlock"
    if block.norm_type != "layer_norm":
        return f"block norm_type {block.norm_type!r} (only 'layer_norm')"
    if block.only_cross_attention or hasattr(block, "fuser"):
        return "only_cross_attention or a GLIGEN fuser"
    reason = _positional_reason(block.pos_embed)
    if reason is not None:
        return reason
    for name in ("attn1", "attn2"):
        attn = getattr(block, name)
        if attn is None:
            continue
        if attn.is_cross_attention:
            return f"{name} is cross-attention (the frames' self-attention is what runs in token order)"
        reason = unsupported_reason(attn)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def container_static_reason(container: nn.Module) -> str | None:
    """Why an AnimateDiff / UNet3D temporal container can never run in (B, F, N, C) order (None when it can)."""
    if not isinstance(container.norm, nn.GroupNorm) and type(container.norm).__name__ != "GroupNorm":
        return f"norm is {type(container.norm).__name__}, not a GroupNorm"
    for i, block in enumerate(container.transformer_blocks):
        reason = _block_static_reason(block)
        if reason is not None:
            return f"transformer_blocks.{i}: {reason}"
    return None


def container_reason(
    container: nn.Module,
    hidden_states: Tensor,
    num_frames: int,
    encoder_hidden_states: Tensor | None,
    cross_attention_kwargs: dict | None,
) -> str | None:
    """Why this call of a temporal container must run diffusers' forward (None when it runs in token order)."""
    if hidden_states.ndim != 4 or hidden_states.shape[0] % num_frames:
        return f"input of shape {tuple(hidden_states.shape)} for {num_frames} frames"
    if num_frames > MAX_FRAMES:
        return f"F={num_frames} frames > {MAX_FRAMES}"
    if encoder_hidden_states is not None:
        return "encoder_hidden_states given (the blocks' attn2 would attend to it)"
    if {k for k in (cross_attention_kwargs or {}) if k != "scale"}:  # "scale" is deprecated and ignored by diffusers
        return f"cross_attention_kwargs {sorted(cross_attention_kwargs)}"
    for i, block in enumerate(container.transformer_blocks):
        if block._chunk_size is not None:
            return f"transformer_blocks.{i}: chunked feed-forward"
        for name in ("attn1", "attn2"):
            attn = getattr(block, name)
            reason = None if attn is None else processor_reason(attn, name)
            if reason is not None:
                return f"transformer_blocks.{i}: {reason}"
    return container_static_reason(container)


def _with_positions(pos_embed, x: Tensor) -> Tensor:
    # SinusoidalPositionalEmbedding adds pe[:, :F] along the sequence axis; here F is axis 1 of (B, F, N, C).
    return x if pos_embed is None else x + pos_embed.pe[:, : x.shape[1], None]


def _basic_block_bfnc(block: nn.Module, x: Tensor, bfn: tuple[int, int, int]) -> Tensor:
    """``BasicTransformerBlock.forward`` (norm_type "layer_norm", self-attention only) on (B, F, N, C) tokens."""
    normed = _with_positions(block.pos_embed, block.norm1(x))
    x = temporal_self_attention(block.attn1, normed, None, bfn) + x
    if block.attn2 is not None:
        normed = _with_positions(block.pos_embed, block.norm2(x))
        x = temporal_self_attention(block.attn2, normed, None, bfn) + x
    return block.ff(block.norm3(x)) + x


def container_bfnc(container: nn.Module, hidden_states: Tensor, num_frames: int) -> Tensor:
    """The container's forward in token order (call only when :func:`container_reason` is None). The result has the
    input's memory layout (channels-last in, channels-last out)."""
    bf, c, h, w = hidden_states.shape
    b = bf // num_frames
    x = hidden_states
    if not x.is_contiguous(memory_format=torch.channels_last):
        layout_conversions[f"{type(container).__name__}: NCHW input copied to channels-last"] += 1
        x = x.contiguous(memory_format=torch.channels_last)
    tokens = x.permute(0, 2, 3, 1).view(b, num_frames, h, w, c)
    # GroupNorm over (C/G, F, H, W) per video, on the channels_last_3d (B, C, F, H, W) view of the same memory.
    normed = container.norm(tokens.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
    if not normed.is_contiguous():
        layout_conversions[f"{type(container).__name__}: GroupNorm returned a non-channels-last output"] += 1
    t = container.proj_in(normed.reshape(b, num_frames, h * w, c))
    for block in container.transformer_blocks:
        t = _basic_block_bfnc(block, t, (b, num_frames, h * w))
    t = container.proj_out(t)
    # A binary op's output takes its first operand's layout when the layouts differ: the input's.
    return hidden_states + t.view(bf, h, w, -1).permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------------------------ instance forwards


class TemporalBlockBFNC:
    """Instance ``forward`` of an SVD ``TemporalBasicTransformerBlock``: :func:`svd_block_bfnc` when
    :func:`svd_block_reason` finds nothing against the call, else the class's forward (reason counted)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.kernel_calls = 0
        self.fallback_reasons: Counter[str] = Counter()

    def reason(self, hidden_states: Tensor, num_frames: int, context: Tensor | None) -> str | None:
        return svd_block_reason(self.block, hidden_states, num_frames, context)

    def __call__(self, hidden_states: Tensor, num_frames: int, encoder_hidden_states: Tensor | None = None) -> Tensor:
        block = self.block
        reason = self.reason(hidden_states, num_frames, encoder_hidden_states)
        if reason is not None:
            self.fallback_reasons[reason] += 1
            return type(block).forward(block, hidden_states, num_frames, encoder_hidden_states)
        self.kernel_calls += 1
        return svd_block_bfnc(block, hidden_states, num_frames, encoder_hidden_states)


class TemporalContainerBFNC:
    """Instance ``forward`` of an ``AnimateDiffTransformer3D`` / ``TransformerTemporalModel``: :func:`container_bfnc`
    when :func:`container_reason` finds nothing against the call, else the class's forward (reason counted)."""

    def __init__(self, container: nn.Module) -> None:
        self.block = container
        self.kernel_calls = 0
        self.fallback_reasons: Counter[str] = Counter()

    def __call__(self, hidden_states: Tensor, *args, **kwargs):
        return run_container(self.block, hidden_states, *args, counter=self, **kwargs)


_CONTAINER_ARGS = ("encoder_hidden_states", "timestep", "class_labels", "num_frames", "cross_attention_kwargs")


def run_container(container: nn.Module, hidden_states: Tensor, *args, counter=None, **kwargs):
    """Either container's forward signature (TransformerTemporalModel adds ``return_dict``): the token-order path or
    the class's own forward. ``counter`` (kernel_calls, fallback_reasons) counts per instance; the module-level
    :data:`fallback_reasons` always counts."""
    call = dict(zip(_CONTAINER_ARGS, args, strict=False), **kwargs)
    base = getattr(type(container), "_ldmopt_base", type(container))
    kind = base.__name__
    reason = container_reason(
        container,
        hidden_states,
        call.get("num_frames", 1),
        call.get("encoder_hidden_states"),
        call.get("cross_attention_kwargs"),
    )
    if reason is not None:
        fallback_reasons[(kind, reason)] += 1
        if counter is not None:
            counter.fallback_reasons[reason] += 1
        return base.forward(container, hidden_states, *args, **kwargs)
    if counter is not None:
        counter.kernel_calls += 1
    out = container_bfnc(container, hidden_states, call.get("num_frames", 1))
    if kind == "AnimateDiffTransformer3D":
        return out
    if not call.get("return_dict", True):
        return (out,)
    from diffusers.models.transformers.transformer_temporal import TransformerTemporalModelOutput

    return TransformerTemporalModelOutput(sample=out)


def run_svd_block(block: nn.Module, hidden_states: Tensor, num_frames: int, encoder_hidden_states=None) -> Tensor:
    """SVD block forward for the class swap: token order, or the base class's forward with the reason counted."""
    base = getattr(type(block), "_ldmopt_base", type(block))
    reason = svd_block_reason(block, hidden_states, num_frames, encoder_hidden_states)
    if reason is not None:
        fallback_reasons[(base.__name__, reason)] += 1
        return base.forward(block, hidden_states, num_frames, encoder_hidden_states)
    return svd_block_bfnc(block, hidden_states, num_frames, encoder_hidden_states)


@dataclass
class BlockInstall:
    """What :func:`install_temporal_blocks` did: per module name, the installed forward; modules left alone."""

    blocks: dict[str, nn.Module] = field(default_factory=dict)
    forwards: dict[str, TemporalBlockBFNC | TemporalContainerBFNC] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    active: bool = True

    def report(self) -> dict[str, Counter]:
        return {n: Counter({"kernel": f.kernel_calls, **f.fallback_reasons}) for n, f in self.forwards.items()}


def install_temporal_blocks(model: nn.Module) -> BlockInstall:
    """Run every SVD temporal block and AnimateDiff / UNet3D temporal container of ``model`` in (B, F, N, C) order
    (an instance ``forward``; parameters, state_dict and class unchanged)."""
    install = BlockInstall()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in SVD_BLOCKS + CONTAINERS:
            continue
        if "forward" in vars(module):
            install.skipped[name] = "forward already overridden on the instance"
            continue
        static = svd_block_static_reason(module) if kind in SVD_BLOCKS else container_static_reason(module)
        if static is not None:
            install.skipped[name] = static
            continue
        wrapper = TemporalBlockBFNC(module) if kind in SVD_BLOCKS else TemporalContainerBFNC(module)
        module.forward = install.forwards[name] = wrapper
        install.blocks[name] = module
    return install


def uninstall_temporal_blocks(install: BlockInstall) -> None:
    """Give every module its class's forward back (a second call does nothing)."""
    if not install.active:
        return
    for name, block in install.blocks.items():
        if vars(block).get("forward") is install.forwards[name]:
            del block.forward
    install.active = False
