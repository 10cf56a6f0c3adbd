"""Conv weights in channels-last for a model ``patch`` gave fused convolutions, restored by ``unpatch``.

The fused convolution (kernels/gn_conv2d.py) reads its weight tile [BK input channels, BN output channels] for one
tap with the weight's own strides. Channels-last weights ([C_out, KH, KW, C_in] in memory) make the input channels
unit-stride, so the tile arrives in 16-byte vectors straight into shared memory. diffusers builds and loads
contiguous [C_out, C_in, KH, KW] weights: a 3x3 tap then steps 9 elements between input channels, every element
would be its own 2-byte load through registers, and (read from the compiled code, ldmopt.aot's counters) the main
loop of the staged conv's 128x128x64 tile would issue 437 instead of 180 instructions per warp and k-step on sm_90
(503 instead of 277 on sm_80): an MMA-bound loop turned issue-bound at about 1.7x its tensor-core time. So the op
copies such a weight into channels-last on every call instead (``ldmopt.ops.gn_conv2d.layout_conversions``, shown
by the report), as cuDNN does given a channels-last input: a launch and two passes over the weight per call.

So a patch call converts, once and in place, the weights of the Conv2d / Conv3d modules whose weights the fused
forwards of the model read (the convs they bypass) to channels-last (``channels_last_3d`` for Conv3d): the same
Parameter objects, values and state_dict keys, new strides; 1x1 kernels are channels-last already (a downsampler's
conv too: its fused conv runs once a GroupNorm asks for its output's statistics, cuDNN's until then, which takes the
channels-last weight as it is). Convs that stay stock (conv_in, conv_out, LoRA layers, anything a guard left
unfused) keep their layout. A later patch call of
the same model converts what an earlier one left (``channels_last_weights=True`` after a training patch). By
default only when ``training`` is False: FSDP's ``fully_shard`` refuses non-contiguous parameters, so a training
patch leaves the layout to the user (``channels_last_weights=True`` without FSDP). Convs that
``filter_fn`` excludes, quantized or subclassed parameters (a tensor subclass, integer or 8-bit storage) and
parametrized weights are left as they are. ``unpatch`` makes contiguous again each weight that still has the
strides patch gave it; one the user re-laid out meanwhile is theirs, and so are all of them when the model's other
spatial conv weights, contiguous when patched, are all channels-last by then (``model.to(memory_format=...)``).
While patched, ``safetensors.torch.save_file`` refuses those weights (non-contiguous): ``save_pretrained`` makes them
contiguous itself; otherwise save after ``unpatch`` or ``.contiguous()`` each tensor. A gradient a weight already
has is re-laid out with it; optimizer state made before the conversion keeps the old layout, and torch's fused AdamW
walks parameter and moments as flat memory without checking their strides, so each moment would then update another
element, silently (as after an ``unpatch`` of weights patched channels-last while training): patch before creating
the optimizer or loading its state, or call :func:`match_optimizer_layout` after ``patch`` / ``unpatch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

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


def fused_convs(label: str, pairs: Iterable[tuple[Rule, Site]]) -> list[tuple[str, nn.Module]]:
    """(qualified name, conv) of each Conv2d/Conv3d whose weight a fused forward of these (rule, site) pairs reads
    itself (the conv is bypassed: listed by the rule's ``touched`` under a child name)."""
    return [
        (".".join(p for p in (label, site.name, rel) if p), m)
        for rule, site in pairs
        for rel, m in rule.touched(site).items()
        if rel and isinstance(m, (nn.Conv2d, nn.Conv3d))
    ]


def convertible_convs(
    convs: Iterable[tuple[str, nn.Module]], filter_fn: Callable[[nn.Module, str], bool] | None
) -> list[tuple[str, nn.Module]]:
    """The convs among ``convs`` whose weight :class:`ChannelsLastWeights` would convert (each weight once)."""
    out = []
    seen: set[int] = set()
    for qualified, module in convs:
        weight = _convertible(module)
        if weight is None or id(weight) in seen:
            continue
        if filter_fn is not None and not filter_fn(module, qualified):
            continue
        seen.add(id(weight))
        out.append((qualified, module))
    return out


def _relayout(weight: nn.Parameter, memory_format: torch.memory_format) -> None:
    """``weight``'s data, and a gradient it already has (AccumulateGrad adds into it in its own layout), in
    ``memory_format``, in place."""
    weight.data = weight.data.contiguous(memory_format=memory_format)
    if weight.grad is not None and weight.grad.shape == weight.shape:
        weight.grad = weight.grad.contiguous(memory_format=memory_format)


def _channels_last(conv: nn.Module) -> bool:
    weight = conv._parameters.get("weight")
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() in _FORMATS
        and weight.is_contiguous(memory_format=_FORMATS[weight.dim()])
        and not weight.is_contiguous()
    )


class _Converted(NamedTuple):
    convs: list[tuple[nn.Module, tuple[int, ...]]]  # each converted conv and the strides patch gave its weight
    #: the model's other spatial conv weights, contiguous when patched: all channels-last at unpatch means the user
    #: converted the model meanwhile (model.to(memory_format=torch.channels_last)), which asks for ours too
    witnesses: list[nn.Module]


class ChannelsLastWeights(Rule):
    """A model-level edit that goes with the fused convolutions (not a patched module): ``site.context["convs"]``
    lists the convs; ``replace`` converts their weights, ``restore`` converts back what it converted."""

    name = "channels_last_weights"
    family = "gn_conv"
    description = "conv weights in channels-last, the layout the fused convolutions read (unpatch restores)"
    counted = False

    def replace(self, site: Site) -> _Converted:
        done = []
        try:
            for _, conv in site.context["convs"]:
                weight = conv._parameters["weight"]
                _relayout(weight, _FORMATS[weight.dim()])
                done.append((conv, weight.stride()))
        except BaseException:  # out of memory halfway: no record would restore the ones done
            self.restore(site, _Converted(done, []))
            raise
        converted = {id(conv) for conv, _ in done}
        witnesses = [m for m in site.module.modules() if id(m) not in converted and _convertible(m) is not None]
        return _Converted(done, witnesses)

    def restore(self, site: Site, data: _Converted) -> None:
        if data.witnesses and all(_channels_last(conv) for conv in data.witnesses):
            return  # the whole model went channels-last after patching: the fused convs' weights stay so too
        for conv, given in data.convs:
            weight = conv._parameters.get("weight")
            if isinstance(weight, torch.Tensor) and weight.stride() == given:
                _relayout(weight, torch.contiguous_format)


CHANNELS_LAST_WEIGHTS = ChannelsLastWeights()


def weight_layout_action(
    label: str,
    model: nn.Module,
    pairs: Iterable[tuple[Rule, Site]],
    filter_fn: Callable[[nn.Module, str], bool] | None,
    wanted: bool,
) -> tuple[tuple[Rule, Site] | None, list[tuple[str, nn.Module]]]:
    """(the action converting the weights of the convs that ``model``'s fused forwards read, or None; the convs
    left not channels-last). ``pairs``: the (rule, site) of every patch on ``model``, this call's and earlier ones';
    ``wanted``: the caller's (or the default's) choice."""
    convs = convertible_convs(fused_convs(label, pairs), filter_fn)
    if not convs or not wanted:
        return None, convs
    return (CHANNELS_LAST_WEIGHTS, Site("", model, None, None, context={"convs": convs})), []


def weight_bytes(convs: Iterable[tuple[str, nn.Module]]) -> int:
    return sum(conv.weight.numel() * conv.weight.element_size() for _, conv in convs)


def match_optimizer_layout(optimizer: torch.optim.Optimizer) -> int:
    """Give each per-parameter state tensor of ``optimizer`` (AdamW's moments) its parameter's strides, where they
    differ; returns how many it re-laid out. Call it after ``patch`` or ``unpatch`` changed conv weights' layouts
    under an optimizer that already holds state, or after loading a state saved with other layouts: torch's fused
    AdamW reads parameter, gradient and moments as flat memory alike, so mismatched strides update the wrong
    elements without an error (foreach and single-tensor AdamW index by position and are unaffected)."""
    relaid = 0
    for param, entry in optimizer.state.items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                entry[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
                relaid += 1
    return relaid
