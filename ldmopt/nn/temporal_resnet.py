"""Fused forwards for diffusers' temporal convolution blocks, whose Conv3d kernels (3, 1, 1) mix frames per pixel.

A Conv3d with kernel (3, 1, 1) over a (video, C, frames, H, W) tensor is a 2-D convolution with kernel (3, 1) over
the (video, C, frames, H*W) view of channels-last frames, and a 5-D GroupNorm's statistics are that view's per-image
statistics: ``ldmopt.ops.gn_conv2d`` runs these blocks with no layout copy, GroupNorm + SiLU in the conv's loads.

- ``fused_spatiotemporal_forward``: SVD's ``SpatioTemporalResBlock`` (UNet and temporal VAE decoder). The spatial
  ``ResnetBlock2D`` runs as patched (channels-last out); the temporal resnet is two fused convs: conv1 adds the
  per-frame time embedding and accumulates norm2's statistics, conv2 writes the blend with the spatial path,
  ``alpha * x + (1 - alpha) * (x + conv2(...))``, as ``x + (1 - alpha) * conv2(...)`` with the per-frame
  ``1 - alpha`` as the epilogue's gate (fp32). The output stays channels-last (diffusers' is NCHW).
- ``fused_temporal_conv_forward``: the UNet3D's ``TemporalConvLayer`` (ModelScope): four fused convs, each handing
  the next GroupNorm its statistics, the last adding the identity.

``spatiotemporal_reasons(block)`` / ``temporal_conv_reasons(layer)``: why an instance can never take the fused
path (empty: it can). Inputs the fused path does not serve (dtype mismatch outside autocast, dropout in training, no
``image_only_indicator``, frames not dividing the batch) run diffusers' forward, counted in
``ldmopt.nn.child_check.fallback_reasons``; NCHW input is converted to channels-last once (``layout_conversions``).
Tolerance versus diffusers: within 2x the error diffusers makes in the input dtype (fp64 reference). Under
torch.autocast a residual wider than the autocast dtype (fp32 under bf16: the blend's spatial input, the conv
layer's identity) is added after the last conv in its own dtype, as diffusers adds it, so the output has diffusers'
dtype; fp64 models blend in fp64.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor, nn

from ..ops.gn_conv2d import gn_silu_conv2d
from . import stats_handover as handover
from .child_check import (
    bypassed_hook_reason,
    count_reason,
    dropout_reason,
    hooked,
    hooked_children,
    observed,
    readable,
    stock,
    stock_class,
    tally,
    unreadable_reason,
)
from .resnet import autocast_would_round, dtype_reasons, fused_resnet_forward

#: How often a fused forward converted an NCHW input to channels-last (one copy) before fusing.
layout_conversions: Counter[str] = Counter()

_TEMPORAL = ((3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1), 1, "zeros")


def _conv3d_reasons(name: str, conv) -> list[str]:
    if not readable(conv, nn.Conv3d):
        return [unreadable_reason(name, conv) + " (LoRA/quantised/hooked layers stay on the stock path)"]
    got = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
    if got != _TEMPORAL:
        return [f"{name} has (kernel, stride, padding, dilation, groups, padding_mode)={got}; fused: {_TEMPORAL}"]
    return []


def _norm_reasons(name: str, norm) -> list[str]:
    if not readable(norm, nn.GroupNorm):
        return [unreadable_reason(name, norm)]
    return [] if norm.affine else [f"{name} has affine=False"]


def _chain_reasons(pairs, c_in: int) -> list[str]:
    """GroupNorm -> conv pairs whose channel counts chain from c_in."""
    reasons = []
    for norm_name, norm, conv_name, conv in pairs:
        reasons += _norm_reasons(norm_name, norm) + _conv3d_reasons(conv_name, conv)
        if not reasons and (norm.num_channels != c_in or conv.in_channels != c_in):
            reasons.append(
                f"{norm_name}/{conv_name} expect {norm.num_channels}/{conv.in_channels} channels, get {c_in}"
            )
        if not reasons:
            c_in = conv.out_channels
    return reasons


def _diffusers_class(name: str):
    from diffusers.models import resnet

    return getattr(resnet, name)


def spatiotemporal_reasons(block) -> list[str]:
    """Why this SpatioTemporalResBlock can never run fused (properties of the instance, not of its inputs)."""
    temporal, mixer = block.temporal_res_block, block.time_mixer
    reasons = []
    if type(temporal) is not _diffusers_class("TemporalResnetBlock") or hooked(temporal):
        reasons.append(f"temporal_res_block is a hooked or other {type(temporal).__name__}, not TemporalResnetBlock")
        return reasons
    if type(mixer) is not _diffusers_class("AlphaBlender") or hooked(mixer):
        reasons.append(f"time_mixer is a hooked or other {type(mixer).__name__}, not diffusers' AlphaBlender")
    if temporal.conv_shortcut is not None:
        reasons.append("temporal_res_block has a conv_shortcut (in_channels != out_channels)")
    if type(temporal.nonlinearity) is not nn.SiLU:  # the kernel computes SiLU itself: a subclass may differ
        reasons.append(f"temporal_res_block.nonlinearity is {type(temporal.nonlinearity).__name__}, not SiLU")
    computed = {f"temporal_res_block.{n}": getattr(temporal, n) for n in ("nonlinearity", "dropout")}  # not called
    reasons += [bypassed_hook_reason(name, deep=True) for name in hooked_children(computed, deep=True)]
    pairs = [("norm1", temporal.norm1, "conv1", temporal.conv1), ("norm2", temporal.norm2, "conv2", temporal.conv2)]
    reasons += [f"temporal_res_block.{r}" for r in _chain_reasons(pairs, temporal.in_channels)]
    return reasons


def spatial_weight(mixer, image_only_indicator: Tensor, ndims: int, dtype: torch.dtype | None = None) -> Tensor:
    """AlphaBlender's weight of its spatial input, as its forward computes it for ``ndims``-D inputs (switch
    included), in fp32, or fp64 when ``dtype`` (default: the weight's own) is fp64; autograd reaches mix_factor."""
    alpha = mixer.get_alpha(image_only_indicator, ndims)
    alpha = alpha.to(torch.float64 if (dtype or alpha.dtype) == torch.float64 else torch.float32)
    return 1.0 - alpha if mixer.switch_spatial_to_temporal_mix else alpha


def _blend_gate(mixer, image_only_indicator: Tensor, batch: int, frames: int, dtype: torch.dtype) -> Tensor | None:
    """(batch, frames) ``1 - alpha`` in fp32 (fp64 for fp64 models): the weight of AlphaBlender's temporal input,
    broadcast as diffusers broadcasts alpha; None when it does not broadcast (diffusers raises)."""
    alpha = spatial_weight(mixer, image_only_indicator, 5, dtype)
    # learned_with_images: (videos', 1, frames', 1, 1); fixed / learned: one value.
    alpha = alpha.reshape(alpha.shape[0], alpha.shape[2]) if alpha.dim() == 5 else alpha.reshape(1, -1)
    if alpha.shape[0] not in (1, batch) or alpha.shape[1] not in (1, frames):
        return None
    return (1.0 - alpha).expand(batch, frames)


def video_view(frames_cl: Tensor, frames: int) -> Tensor:
    """(videos, C, frames, H*W) view of channels-last (videos*frames, C, H, W): channels-last itself."""
    bf, c, h, w = frames_cl.shape
    return frames_cl.permute(0, 2, 3, 1).reshape(bf // frames, frames, h * w, c).permute(0, 3, 1, 2)


def _frames_view(view: Tensor, h: int, w: int) -> Tensor:
    """The inverse of video_view: (videos*frames, C, H, W) channels-last."""
    b, c, f, _ = view.shape
    return view.permute(0, 2, 3, 1).reshape(b * f, h, w, c).permute(0, 3, 1, 2)


def _runtime_reasons(x: Tensor, frames: int, weight: Tensor, dropouts) -> list[str]:
    if not isinstance(x, Tensor) or x.dim() != 4:
        return ["input is not a 4-D tensor"]
    reasons = []
    if frames <= 0 or x.shape[0] % frames:
        reasons.append(f"{x.shape[0]} frames in the batch are not a multiple of num_frames={frames}")
    reasons += dtype_reasons(x, weight)
    reasons += [f"dropout {why}" for why in map(dropout_reason, dropouts) if why is not None]
    return reasons


def _channels_last(x: Tensor, where: str) -> Tensor:
    if x.is_contiguous(memory_format=torch.channels_last):
        return x
    tally(layout_conversions, f"{where}: NCHW input converted to channels-last")
    return x.contiguous(memory_format=torch.channels_last)


def fused_spatiotemporal_forward(
    block,
    hidden_states: Tensor | tuple[Tensor, Tensor],
    temb: Tensor | None = None,
    image_only_indicator: Tensor | None = None,
) -> Tensor:
    """``SpatioTemporalResBlock.forward``: spatial resnet (as patched), then the temporal resnet and the blend in two
    fused convolutions (see the module docstring).

    ``hidden_states`` may be a pair ``(hidden, skip)`` standing for their channel concatenation (an SVD up block's
    skip connection), handed to the spatial resnet's ``fused_resnet_forward``, which reads it in place: the caller
    (ldmopt.patch's ``up_block_skip``) passes a pair only when ``spatial_res_block`` runs that fused forward."""
    parts = hidden_states if isinstance(hidden_states, tuple) else None
    if parts is not None:
        hidden_states = parts[0]  # what the checks below read: batch, spatial size, dtype (the parts agree on them)
    temporal = block.temporal_res_block
    if image_only_indicator is None:
        reasons = ["no image_only_indicator (diffusers needs it for the frame count)"]
    else:
        frames = image_only_indicator.shape[-1]
        reasons = spatiotemporal_reasons(block) or _runtime_reasons(
            hidden_states, frames, temporal.conv1.weight, (temporal.dropout,)
        )
        if temporal.time_emb_proj is not None and temb is None:
            reasons.append("temb is None for a temporal resnet with time_emb_proj (diffusers raises)")
    gate = None
    if not reasons:
        batch = hidden_states.shape[0] // frames
        gate = _blend_gate(block.time_mixer, image_only_indicator, batch, frames, hidden_states.dtype)
        if gate is None:
            shape = tuple(image_only_indicator.shape)
            reasons.append(f"image_only_indicator of shape {shape} does not broadcast to ({batch}, {frames}) videos")
    if reasons:
        for reason in reasons:
            count_reason("SpatioTemporalResBlock", reason)
        if parts is not None:
            hidden_states = torch.cat(parts, dim=1)
        return stock(block)(hidden_states, temb, image_only_indicator)
    if parts is not None:
        with observed(block.spatial_res_block, (hidden_states, temb)):
            spatial = fused_resnet_forward(block.spatial_res_block, parts, temb)
    else:
        spatial = block.spatial_res_block(hidden_states, temb)
    spatial = _channels_last(spatial, "SpatioTemporalResBlock")
    height, width = spatial.shape[2:]
    x = video_view(spatial, frames)
    t = None
    if temporal.time_emb_proj is not None:
        t = temporal.time_emb_proj(temporal.nonlinearity(temb.reshape(batch, frames, -1))).transpose(1, 2)
    n1, n2 = temporal.norm1, temporal.norm2
    # norm1 normalises each video over (C/G, F, H, W): from the spatial resnet's per-frame channel sums once it sums
    # them (stats_handover), else a statistics pass
    video_stats = handover.take_video(spatial, frames, n1.num_groups, n1.eps, "TemporalResnetBlock.norm1")
    h, stats = gn_silu_conv2d(
        x, n1.weight, n1.bias, n1.num_groups, n1.eps, temporal.conv1.weight.squeeze(-1), temporal.conv1.bias, 1, (1, 0),
        temb=t, out_stats=(n2.num_groups, n2.eps), stats=video_stats,
    )  # fmt: skip
    # diffusers blends in the spatial output's own dtype (fp32 + bf16 -> fp32 under autocast): where the epilogue
    # would round the residual to the autocast dtype, the blend runs after conv2 instead.
    add_after = autocast_would_round(x)
    y = gn_silu_conv2d(
        h, n2.weight, n2.bias, n2.num_groups, n2.eps, temporal.conv2.weight.squeeze(-1), temporal.conv2.bias, 1, (1, 0),
        stats=stats, **({} if add_after else {"residual": x, "gate": gate}),
    )  # fmt: skip
    if add_after:
        y = x + gate[:, None, :, None] * y
    return _frames_view(y, height, width)


def _temporal_conv_stages(layer) -> list[tuple[str, nn.Module, nn.Module, list[nn.Module]]]:
    """(name, norm, conv, dropouts) of conv1..conv4; a stage of another structure gives norm = None."""
    stages = []
    for name in ("conv1", "conv2", "conv3", "conv4"):
        seq = getattr(layer, name, None)
        kinds = [type(m) for m in seq] if type(seq) is nn.Sequential else []
        ok = kinds[:2] == [nn.GroupNorm, nn.SiLU] and kinds[-1] is nn.Conv3d and set(kinds[2:-1]) <= {nn.Dropout}
        stages.append((name, seq[0] if ok else None, seq[-1] if ok else None, list(seq)[2:-1] if ok else []))
    return stages


def temporal_conv_reasons(layer) -> list[str]:
    """Why this TemporalConvLayer can never run fused."""
    reasons = []
    if stock_class(layer).forward is not _diffusers_class("TemporalConvLayer").forward:
        return [f"{stock_class(layer).__qualname__} overrides TemporalConvLayer.forward"]
    stages = _temporal_conv_stages(layer)
    for name, norm, _, _ in stages:
        if norm is None:
            reasons.append(f"{name} is not nn.Sequential(GroupNorm, SiLU, [Dropout], Conv3d)")
    if reasons:
        return reasons
    for name, _, _, dropouts in stages:
        seq = getattr(layer, name)
        if any(hooked(m) for m in (seq, seq[1], *dropouts)):
            reasons.append(f"{name} or its SiLU/Dropout has hooks the fused path would bypass")
    pairs = [(f"{s}[0]", norm, f"{s}[-1]", conv) for s, norm, conv, _ in stages]
    reasons += _chain_reasons(pairs, layer.in_dim)
    if not reasons and stages[-1][2].out_channels != layer.in_dim:
        reasons.append(f"conv4 writes {stages[-1][2].out_channels} channels; the identity has {layer.in_dim}")
    return reasons


def fused_temporal_conv_forward(layer, hidden_states: Tensor, num_frames: int = 1) -> Tensor:
    """``TemporalConvLayer.forward`` in four fused convolutions; the output is channels-last frames."""
    stages = _temporal_conv_stages(layer)
    reasons = temporal_conv_reasons(layer)
    if not reasons:
        dropouts = [d for *_, ds in stages for d in ds]
        reasons = _runtime_reasons(hidden_states, num_frames, stages[0][2].weight, dropouts)
    if reasons:
        for reason in reasons:
            count_reason("TemporalConvLayer", reason)
        return stock(layer)(hidden_states, num_frames)
    height, width = hidden_states.shape[2:]
    x = video_view(_channels_last(hidden_states, "TemporalConvLayer"), num_frames)
    h, stats = x, None
    for i, (_, norm, conv, _) in enumerate(stages):
        last = i == len(stages) - 1
        # The identity is added in the epilogue, or after it where autocast would round it (diffusers adds it in its
        # own dtype: fp32 + bf16 -> fp32).
        add_after = last and autocast_would_round(x)
        around = {"residual": x} if last and not add_after else {}
        if not last:
            around["out_stats"] = (stages[i + 1][1].num_groups, stages[i + 1][1].eps)
        out = gn_silu_conv2d(
            h, norm.weight, norm.bias, norm.num_groups, norm.eps, conv.weight.squeeze(-1), conv.bias, 1, (1, 0),
            stats=stats, **around,
        )  # fmt: skip
        h, stats = (x + out if add_after else out, None) if last else out
    return _frames_view(h, height, width)
