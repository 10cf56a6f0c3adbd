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
- **Latte** ``LatteTransformer3DModel`` (``latte_forward`` in ldmopt/nn/temporal_layout_latte.py, the model's
  forward: its temporal blocks are called from there): each temporal block runs on the spatial blocks' (B*F, N, C)
  tokens viewed as (B, F, N, C), with its ada_norm_single modulation per video (LayerNorm + modulation and the gated
  feed-forward residual as ldmopt's fused row kernel and GEMM epilogue), instead of diffusers' permute to
  (B*N, F, C) and back around every block.

Same modules, parameters and state_dict; results equal to diffusers' forward within the temporal kernel's tolerance
(fp32 scores and softmax). A call these paths do not cover (chunked feed-forward, custom processors, masks or
contexts, F > 64, or a child they compute instead of calling, such as a block, attn1/attn2 or pos_embed, that is
hooked, wrapped by accelerate/diffusers hooks or replaced) runs the class's own forward, the reason counted in
:data:`fallback_reasons`.

Two ways in: ``ldmopt.patch`` (family ``temporal_layout``: a class swap, see ldmopt/patch/rules_temporal_layout.py), or
:func:`install_temporal_blocks` (an instance ``forward``, for code that does not use ``patch``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ops.gn_conv2d import gn_silu_conv2d
from ..ops.temporal_attention import MAX_FRAMES
from . import stats_handover as handover
from .child_check import (
    bypassed_hook_reason,
    counting,
    function_mode_reason,
    hooked,
    hooked_children,
    plain_weight,
    readable,
    stock,
    stock_class,
    tally,
    transform_reason,
    wrapped_forward,
)
from .group_norm import GroupNorm as LdmoptGroupNorm
from .layer_norm_input import NormedInput, fused_norm_eps, normed_with_positions
from .linear import ff_residual, ff_residual_and_stats
from .proj_out import proj_out_residual
from .temporal_attention import (
    _single_key_module_reason,
    _stock_or_ours,
    single_key_attention,
    single_key_structure_reason,
    temporal_self_attention,
    temporal_self_attention_and_stats,
    unsupported_reason,
    zero_gradient_anchor,
)
from .temporal_resnet import video_view

#: Class name -> kind of every module that can run in (B, F, N, C) order.
SVD_BLOCKS = ("TemporalBasicTransformerBlock",)
CONTAINERS = ("AnimateDiffTransformer3D", "TransformerTemporalModel")

#: (class name, reason) -> calls that ran diffusers' forward instead (process-wide, like ldmopt.nn.resnet's).
fallback_reasons: Counter[tuple[str, str]] = Counter()
#: what -> calls that copied an NCHW input to channels-last before running in token order.
layout_conversions: Counter[str] = Counter()


def processor_reason(block: nn.Module) -> str | None:
    """Why ``block``'s attention modules cannot be bypassed: a module that is not diffusers' Attention (replaced, or
    a subclass with its own forward), or a processor that is neither diffusers' stock one nor ldmopt's (IP-Adapter,
    custom LoRA processors ...) must keep running."""
    from diffusers.models.attention_processor import Attention

    for name in ("attn1", "attn2"):
        attn = getattr(block, name, None)
        if attn is None:
            continue
        if not isinstance(attn, Attention) or stock_class(attn).forward is not Attention.forward:
            return f"{name} is a {type(attn).__name__}, not diffusers' Attention"
        if not _stock_or_ours(attn.processor):
            return f"{name} has custom processor {type(attn.processor).__name__}"
    return None


def first_hooked_reason(children: dict[str, nn.Module | None]) -> str | None:
    """Why the token-order path cannot compute these children itself (None when it can): one is
    :func:`~ldmopt.nn.child_check.hooked` (forward/backward hooks, global hooks, or a forward wrapped on the instance
    by accelerate's offload or diffusers' cache/layer-skip hooks), which the stock forward would run. Shallow: the
    children's own children (projections, norms) are called, or checked where they are read."""
    names = hooked_children(children, deep=False)
    return bypassed_hook_reason(names[0]) if names else None


# ------------------------------------------------------------------------------------------------ SVD block


def svd_block_static_reason(block: nn.Module) -> str | None:
    """Why an SVD ``TemporalBasicTransformerBlock`` cannot run in (B, F, N, C) order, whatever the call (None when it
    can): its structure, and its attention processors (checked again per call: they can change after patching)."""
    reason = processor_reason(block)
    if reason is not None:
        return reason
    reason = unsupported_reason(block.attn1)
    if reason is not None:
        return f"attn1: {reason}"
    reason = None if block.attn2 is None else single_key_structure_reason(block.attn2)
    return None if reason is None else f"attn2: {reason}"


def svd_block_reason(block: nn.Module, hidden_states: Tensor, num_frames: int, context: Tensor | None) -> str | None:
    """Why this call of an SVD temporal block must run diffusers' forward (None when it runs in token order)."""
    transform = transform_reason()
    if transform is not None:
        return transform
    if block._chunk_size is not None:
        return "chunked feed-forward"
    if hidden_states.ndim != 3 or hidden_states.shape[0] % num_frames:
        return f"input of shape {tuple(hidden_states.shape)} for {num_frames} frames"
    if num_frames > MAX_FRAMES:
        return f"F={num_frames} frames > {MAX_FRAMES}"
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
    return first_hooked_reason(svd_bypassed(block))


def svd_bypassed(block: nn.Module) -> dict[str, nn.Module | None]:
    """The children of an SVD temporal block that :func:`svd_block_bfnc` computes itself or skips, where the stock
    forward calls them: the attention modules, and attn2's query path (norm2 unless attn2's residual connection
    calls it, to_q, to_k, norm_q, norm_k), whose value the single-key shortcut never needs."""
    children = {"attn1": block.attn1, "attn2": block.attn2}
    attn2 = block.attn2
    if attn2 is not None:
        if not attn2.residual_connection:
            children["norm2"] = block.norm2
        children.update({f"attn2.{n}": getattr(attn2, n, None) for n in ("to_q", "to_k", "norm_q", "norm_k")})
    return children


def svd_block_bfnc(block: nn.Module, hidden_states: Tensor, num_frames: int, context: Tensor | None) -> Tensor:
    """``TemporalBasicTransformerBlock.forward`` in token order (call only when :func:`svd_block_reason` is None)."""
    bf, n, c = hidden_states.shape
    b = bf // num_frames
    x = hidden_states.view(b, num_frames, n, c)
    where = type(block).__name__
    # Each norm that only feeds GEMMs is read in their loads (NormedInput); norm2 feeds the skipped query path.
    # norm1's statistics come from the epilogue of ff_in's output GEMM, which wrote its input.
    stats = None
    if block.is_res:
        eps = fused_norm_eps(block.norm1, c)
        h, stats = ff_residual_and_stats(block.ff_in, NormedInput(block.norm_in, x, where, "norm_in"), x, eps)
    else:
        h = block.ff_in(block.norm_in(x))
    normed = NormedInput(block.norm1, h, where, "norm1", stats=stats)
    h = temporal_self_attention(block.attn1, normed, None, (b, num_frames, n), residual=h, name="attn1")
    if block.attn2 is not None:
        attn2 = block.attn2
        # (B*N, 1, C) context rows -> (B, 1, N, C), broadcast over the frames.
        # norm2 only feeds attn2's (skipped) query path unless the residual connection uses it.
        norm2 = None if attn2.residual_connection else block.norm2
        out = single_key_attention(attn2, zero_gradient_anchor(context, [norm2])).view(b, 1, n, -1)
        if attn2.residual_connection:
            out = out + block.norm2(h)
        h = out / attn2.rescale_output_factor + h
    if block.is_res:
        h = ff_residual(block.ff, NormedInput(block.norm3, h, where, "norm3"), h)
    else:
        h = block.ff(block.norm3(h))
    return h.view(bf, n, -1)


def _counted(base: type, reason: str | None, counter=None) -> bool:
    """Count one call as a fall-back to ``base``'s forward (``reason`` set) or as a token-order call; True for a
    fall-back. The module-level :data:`fallback_reasons` always counts; ``counter`` (an instance forward's
    kernel_calls / fallback_reasons) when given."""
    reason = reason or function_mode_reason()  # a mode that intercepts SDPA would miss the attention kernel
    if reason is None:
        if counter is not None and counting():
            counter.kernel_calls += 1
        return False
    tally(fallback_reasons, (base.__name__, reason))
    if counter is not None:
        tally(counter.fallback_reasons, reason)
    return True


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
    """Why an AnimateDiff / UNet3D temporal container cannot run in (B, F, N, C) order, whatever the call (None when it
    can): structure and attention processors."""
    if not isinstance(container.norm, nn.GroupNorm) and type(container.norm).__name__ != "GroupNorm":
        return f"norm is {type(container.norm).__name__}, not a GroupNorm"
    for i, block in enumerate(container.transformer_blocks):
        reason = processor_reason(block) or _block_static_reason(block)
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
    transform = transform_reason()
    if transform is not None:
        return transform
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
    return container_static_reason(container) or container_hook_reason(container)


def container_hook_reason(container: nn.Module) -> str | None:
    """Why a container's blocks cannot run in token order now (None when they can): a block, its attn1/attn2 or its
    pos_embed, which the token-order path computes itself, is hooked or wrapped (see :func:`first_hooked_reason`).
    Their other children (norms, projections, feed-forward) are called or checked where they are read."""
    for i, block in enumerate(container.transformer_blocks):
        prefix = f"transformer_blocks.{i}"
        children = {
            prefix: block,
            **{f"{prefix}.{n}": getattr(block, n, None) for n in ("attn1", "attn2", "pos_embed")},
        }
        reason = first_hooked_reason(children)
        if reason is not None:
            return reason
    return None


def _with_positions(pos_embed, x: Tensor, bfn: tuple[int, int, int]) -> Tensor:
    """x + pe[f] for tokens x indexed as (B, F, N) (shaped (B, F, N, C) or (B, F*N, C)): SinusoidalPositionalEmbedding
    adds pe[:, :F] along the frame axis of diffusers' (B*N, F, C) layout. A hooked module is called on that layout
    (a permuted copy), so that its hooks run as on the stock path."""
    if hooked(pos_embed):
        b, f, n = bfn
        seq = x.reshape(b, f, n, x.shape[-1]).permute(0, 2, 1, 3).reshape(b * n, f, x.shape[-1])
        return pos_embed(seq).view(b, n, f, -1).permute(0, 2, 1, 3).reshape(x.shape)
    return (x.view(*bfn, x.shape[-1]) + pos_embed.pe[:, : bfn[1], None]).view(x.shape)


def _basic_block_bfnc(block: nn.Module, x: Tensor, bfn: tuple[int, int, int], stats: Tensor | None = None) -> Tensor:
    """``BasicTransformerBlock.forward`` (norm_type "layer_norm", self-attention only) on tokens indexed as (B, F, N)
    (shaped (B, F, N, C), or (B, F*N, C)); each norm is read in the loads of the GEMMs after it, with diffusers'
    sinusoidal positions (one per frame) added there too. ``stats``: x's ``layer_norm_stats`` for norm1's eps, when
    the GEMM that wrote x summed them."""
    where = type(block).__name__

    def normed(name: str, t: Tensor, stats: Tensor | None = None) -> Tensor | NormedInput:
        # Rows ((b F + f) N + n) take position f: one per frame, N rows each.
        add = lambda y: _with_positions(block.pos_embed, y, bfn)
        return normed_with_positions(getattr(block, name), t, where, name, block.pos_embed, bfn[1], bfn[2], add, stats)

    # norm2's and norm3's statistics come from the epilogue of the output projection that wrote their input.
    after_attn1 = block.norm2 if block.attn2 is not None else block.norm3
    x, stats = temporal_self_attention_and_stats(block.attn1, normed("norm1", x, stats), None, bfn, residual=x,
                                                 name="attn1", next_norm=after_attn1)  # fmt: skip
    if block.attn2 is not None:
        x, stats = temporal_self_attention_and_stats(block.attn2, normed("norm2", x, stats), None, bfn, residual=x,
                                                     name="attn2", next_norm=block.norm3)  # fmt: skip
    return ff_residual(block.ff, NormedInput(block.norm3, x, where, "norm3", stats=stats), x)


def _norm_proj_in_fusable(container: nn.Module) -> bool:
    """Whether the container's GroupNorm can be read through proj_in's loads: an affine torch GroupNorm (or ldmopt's,
    without an activation) and a plain nn.Linear, neither hooked nor wrapped (checked per call)."""
    norm, proj_in = container.norm, container.proj_in
    ours = type(norm) is LdmoptGroupNorm and norm.activation is None  # a subclass may compute more
    if not (type(norm) is nn.GroupNorm or ours) or not norm.affine or hooked(norm) or not plain_weight(norm):
        return False
    return readable(proj_in)


def _project(container: nn.Module, name: str, t: Tensor) -> Tensor:
    """``container.<name>(t)`` called as the class's forward calls it (AnimateDiffTransformer3D by keyword,
    ``input=``): a hook with kwargs, or a full backward hook (positional inputs only), sees the stock call."""
    base = getattr(type(container), "_ldmopt_base", type(container))
    layer = getattr(container, name)
    return layer(input=t) if base.__name__ == "AnimateDiffTransformer3D" else layer(t)


def container_bfnc(container: nn.Module, hidden_states: Tensor, num_frames: int) -> Tensor:
    """The container's forward in token order (call only when :func:`container_reason` is None). The result has the
    input's memory layout (channels-last in, channels-last out)."""
    bf, c, h, w = hidden_states.shape
    b = bf // num_frames
    x = hidden_states
    if not x.is_contiguous(memory_format=torch.channels_last):
        tally(layout_conversions, f"{type(container).__name__}: NCHW input copied to channels-last")
        x = x.contiguous(memory_format=torch.channels_last)
    tokens = x.permute(0, 2, 3, 1).view(b, num_frames, h, w, c)
    stats = None  # the first block's norm1 statistics, when proj_in's epilogue sums them
    if _norm_proj_in_fusable(container):
        # GroupNorm in proj_in's loads: a 1x1 conv over the channels-last (B, C, F, H*W) view, whose per-image
        # statistics are the video's over (C/G, F, H, W); the output's memory is (B, F, N, C') token order, whose
        # rows the first block's norm1 reads: their statistics come from the same epilogue.
        norm, proj_in = container.norm, container.proj_in
        blocks = container.transformer_blocks
        eps = fused_norm_eps(blocks[0].norm1, proj_in.weight.shape[0]) if len(blocks) else None
        # the video's statistics from the per-frame channel sums of x's producer, when it summed them
        where = f"{type(container).__name__}.norm"
        video_stats = handover.take_video(x, num_frames, norm.num_groups, norm.eps, where)
        t = gn_silu_conv2d(
            video_view(x, num_frames), norm.weight, norm.bias, norm.num_groups, norm.eps,
            proj_in.weight[:, :, None, None], proj_in.bias, 1, 0, activation=None, fp32_precision="matmul",
            next_norm_eps=eps, stats=video_stats,
        )  # fmt: skip
        t, stats = t if eps is not None else (t, None)
        t = t.permute(0, 2, 3, 1)
    else:
        # GroupNorm over (C/G, F, H, W) per video, on the channels_last_3d (B, C, F, H, W) view of the same memory.
        normed = container.norm(tokens.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
        if not normed.is_contiguous():
            tally(layout_conversions, f"{type(container).__name__}: GroupNorm returned a non-channels-last output")
        t = _project(container, "proj_in", normed.reshape(b, num_frames, h * w, c))
    for i, block in enumerate(container.transformer_blocks):
        t = _basic_block_bfnc(block, t, (b, num_frames, h * w), stats if i == 0 else None)
    if x is hidden_states and readable(container.proj_out):
        # Channels-last in: the residual is the token array itself, added in proj_out's epilogue; offered to the
        # GroupNorm that reads the result next (the next resnet's, or an up block's with its skip: nn.proj_out).
        return proj_out_residual(container.proj_out, t, x)
    t = _project(container, "proj_out", t)
    # A binary op's output takes its first operand's layout when the layouts differ: the input's.
    return hidden_states + t.view(bf, h, w, -1).permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------------------------ instance forwards


#: the containers' positional parameters after hidden_states (AnimateDiffTransformer3D's forward stops before
#: return_dict, TransformerTemporalModel's has it)
_CONTAINER_ARGS = (
    "encoder_hidden_states", "timestep", "class_labels", "num_frames", "cross_attention_kwargs", "return_dict",
)  # fmt: skip


def run_container(container: nn.Module, hidden_states: Tensor, *args, counter=None, **kwargs):
    """Either container's forward signature (TransformerTemporalModel adds ``return_dict``): the token-order path or
    the class's own forward. ``counter`` (kernel_calls, fallback_reasons) counts per instance; the module-level
    :data:`fallback_reasons` always counts."""
    call = dict(zip(_CONTAINER_ARGS, args, strict=False), **kwargs)
    base = getattr(type(container), "_ldmopt_base", type(container))
    reason = container_reason(
        container,
        hidden_states,
        call.get("num_frames", 1),
        call.get("encoder_hidden_states"),
        call.get("cross_attention_kwargs"),
    )
    if _counted(base, reason, counter):
        return stock(container)(hidden_states, *args, **kwargs)
    out = container_bfnc(container, hidden_states, call.get("num_frames", 1))
    if base.__name__ == "AnimateDiffTransformer3D":
        return out
    if not call.get("return_dict", True):
        return (out,)
    from diffusers.models.transformers.transformer_temporal import TransformerTemporalModelOutput

    return TransformerTemporalModelOutput(sample=out)


def run_svd_block(
    block: nn.Module, hidden_states: Tensor, num_frames: int, encoder_hidden_states=None, *, counter=None
) -> Tensor:
    """SVD block forward: token order, or the base class's forward with the reason counted (``counter`` as in
    :func:`run_container`)."""
    base = getattr(type(block), "_ldmopt_base", type(block))
    reason = svd_block_reason(block, hidden_states, num_frames, encoder_hidden_states)
    if _counted(base, reason, counter):
        return stock(block)(hidden_states, num_frames, encoder_hidden_states)
    return svd_block_bfnc(block, hidden_states, num_frames, encoder_hidden_states)


class _InstanceForward:
    """An instance ``forward`` that runs ``run`` (the token-order path or the class's forward) and counts, per
    instance, the calls that took each."""

    run = None

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.kernel_calls = 0
        self.fallback_reasons: Counter[str] = Counter()

    def __call__(self, hidden_states: Tensor, *args, **kwargs):
        return type(self).run(self.block, hidden_states, *args, counter=self, **kwargs)


class TemporalBlockBFNC(_InstanceForward):
    """Instance ``forward`` of an SVD ``TemporalBasicTransformerBlock`` (:func:`run_svd_block`)."""

    run = staticmethod(run_svd_block)


class TemporalContainerBFNC(_InstanceForward):
    """Instance ``forward`` of an AnimateDiff / UNet3D temporal container (:func:`run_container`)."""

    run = staticmethod(run_container)


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
        if wrapped_forward(module):
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
