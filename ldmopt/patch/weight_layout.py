"""Conv weights in channels-last for a model ``patch`` gave fused convolutions, restored by ``unpatch``.

The fused convolution (kernels/gn_conv2d.py) reads its weight tile [BK input channels, BN output channels] for one
tap with the weight's own strides. Channels-last weights ([C_out, KH, KW, C_in] in memory) make the input channels
unit-stride, so the tile arrives in 16-byte vectors straight into shared memory. diffusers builds and loads
contiguous [C_out, C_in, KH, KW] weights: a 3x3 tap then steps 9 elements between input channels, every element
would be its own 2-byte load through registers, and (read from the compiled code, ldmopt.aot's counters) the main
loop of the staged conv's 128x128x64 tile would issue 437 instead of 180 instructions per warp and k-step on sm_90
(503 instead of 277 on sm_80): an MMA-bound loop turned issue-bound at about 1.7x its tensor-core time. So the op
copies such a weight into channels-last on every call instead (``ldmopt.ops.gn_conv2d.layout_conversions``, shown
by the report), as cuDNN does given a channels-last input: a launch and two passes over the weight per call. Stock
convolutions of a patched model make the same copy, their activations being channels-last.

So a patch call that fuses a model's convolutions also converts that model's Conv2d / Conv3d weights with a spatial
kernel to channels-last (``channels_last_3d`` for Conv3d) once, in place: the same Parameter objects, values and
state_dict keys, new strides; 1x1 kernels are channels-last already. By default only when ``training`` is False:
FSDP's ``fully_shard`` refuses non-contiguous parameters, so a training patch leaves the layout to the user
(``model.to(memory_format=torch.channels_last)`` before DDP, or ``channels_last_weights=True``). Convs that
``filter_fn`` excludes, quantized or subclassed parameters (a tensor subclass, integer or 8-bit storage) and
parametrized weights are left as they are. ``unpatch`` makes contiguous again each weight that still has the
strides patch gave it; one the user re-laid out meanwhile is theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .rule import Rule, Site

#: weight rank -> the channels-last memory format of that rank (Conv2d, Conv3d)
_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _convertible(conv: nn.Module) -> torch.Tensor | None:
    """The conv's weight Parameter if it is a plain, dense, contiguous floating-point tensor with a spatial kernel
    that is not channels-last yet; None otherwise."""
    if not isinstance(conv, (nn.Conv2d, nn.Conv3d)) or "parametrizations" in conv._modules:
        return None
    weight = conv._parameters.get("weight")
    if type(weight) is not nn.Parameter or type(weight.data) is not torch.Tensor:
        return None
    if not weight.is_floating_point() or weight.element_size() == 1 or weight.dim() not in _FORMATS:
        return None
    if not weight.is_contiguous() or weight.is_contiguous(memory_format=_FORMATS[weight.dim()]):
        return None  # a 1x1 kernel is both; a layout the user chose is left alone
    return weight


def reads_fused_conv(rule: Rule, site: Site) -> bool:
    """True when the fused forward this (rule, site) installs reads a conv's weight itself (the conv is bypassed)."""
    return any(rel and isinstance(m, (nn.Conv2d, nn.Conv3d)) for rel, m in rule.touched(site).items())


def convertible_convs(
    label: str, model: nn.Module, filter_fn: Callable[[nn.Module, str], bool] | None
) -> list[tuple[str, nn.Module]]:
    """(qualified name, conv) of each conv of ``model`` whose weight :class:`ChannelsLastWeights` would convert."""
    out = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        weight = _convertible(module)
        if weight is None or id(weight) in seen:
            continue
        qualified = ".".join(p for p in (label, name) if p)
        if filter_fn is not None and not filter_fn(module, qualified):
            continue
        seen.add(id(weight))
        out.append((qualified, module))
    return out


class ChannelsLastWeights(Rule):
    """A model-level edit that goes with the fused convolutions (not a patched module): ``site.context["convs"]``
    lists the convs; ``replace`` converts their weights, ``restore`` converts back what it converted."""

    name = "channels_last_weights"
    family = "gn_conv"
    description = "conv weights in channels-last, the layout the fused convolutions read (unpatch restores)"
    counted = False

    def replace(self, site: Site) -> list[tuple[nn.Module, tuple[int, ...]]]:
        done = []
        for _, conv in site.context["convs"]:
            weight = conv._parameters["weight"]
            weight.data = weight.data.contiguous(memory_format=_FORMATS[weight.dim()])
            done.append((conv, weight.stride()))
        return done

    def restore(self, site: Site, data: Any) -> None:
        for conv, given in data:
            weight = conv._parameters.get("weight")
            if isinstance(weight, torch.Tensor) and weight.stride() == given:
                weight.data = weight.data.contiguous()


CHANNELS_LAST_WEIGHTS = ChannelsLastWeights()


def weight_layout_action(
    label: str,
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None,
    convs_fused: bool,
    wanted: bool,
) -> tuple[tuple[Rule, Site] | None, list[tuple[str, nn.Module]]]:
    """(the action converting ``model``'s conv weights, or None; the convs still not channels-last after it).
    ``convs_fused``: this patch call installed fused forwards that read conv weights; ``wanted``: the caller's (or
    the default's) choice."""
    convs = convertible_convs(label, model, filter_fn) if convs_fused else []
    if not convs or not wanted:
        return None, convs
    return (CHANNELS_LAST_WEIGHTS, Site("", model, None, None, context={"convs": convs})), []


def weight_bytes(convs: Iterable[tuple[str, nn.Module]]) -> int:
    return sum(conv.weight.numel() * conv.weight.element_size() for _, conv in convs)
