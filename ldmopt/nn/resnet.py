"""Fused forward for diffusers' ``ResnetBlock2D``: the whole block in two fused convolutions.

Interface for the patcher (ldmopt/patch/) and for users:

- ``can_fuse(block) -> list[str]``: why this block instance can never take the fused path (empty list: it can).
  Properties of the block, not of the inputs (class, time_embedding_norm, activation, resampling kernel, conv
  shapes, hooks on the children it reads or bypasses: norms, convs, SiLU, dropout, up/downsampling); asked on every
  call, as children can change after patching.
- ``fused_resnet_forward(block, input_tensor, temb=None, *, stats=None, out_stats=None) -> Tensor``: a drop-in for
  ``ResnetBlock2D.forward`` that reads the block's own parameters (nothing copied). Bind it to an instance with
  ``block.forward = types.MethodType(fused_resnet_forward, block)`` and undo with ``del block.forward``. Inputs the
  fused path cannot serve (``runtime_reasons``: dtype mismatch outside autocast, dropout in training, ...) run
  diffusers' own forward instead; each reason is counted in ``fallback_reasons``. An NCHW input is converted to
  channels-last (one copy, counted in ``layout_conversions``) and fused.
  ``stats=(mean, rstd)``: norm1 statistics of ``input_tensor`` when the producer already computed them (skips two
  launches); ``out_stats=(groups, eps)`` also returns ``(mean, rstd)`` of the output for the NEXT GroupNorm:
  ``(output, (mean, rstd))``.
  ``input_tensor`` may be a pair ``(hidden, skip)`` standing for ``torch.cat([hidden, skip], 1)`` (a UNet up block's
  skip connection): the statistics pass, conv1's loads and the 1x1 shortcut read the two tensors where they lie, so
  the concatenation is never written (ldmopt.patch's ``up_block_skip`` rule passes it so).
- ``FusedResnetBlock2D(block)``: an nn.Module that adopts the block's submodules (same parameters, same state_dict
  keys) and runs ``fused_resnet_forward``.

Conv weights: the fused convolutions read channels-last weights; given contiguous ones (diffusers' default) the
triton backend copies each to channels-last per call (two launches more per block, counted in
``ldmopt.ops.gn_conv2d.layout_conversions``). ``ldmopt.patch`` converts them once; users of the forward or the module
directly convert the block's conv weights themselves (``block.to(memory_format=torch.channels_last)``).

Statistics hand-over (ldmopt.nn.stats_handover): a block offers its output to the fused GroupNorm that reads it next
(the next block's norm1, a Transformer2DModel's norm) and, once that consumer has asked for its (groups, eps), sums
them in conv2's epilogue, so the consumer skips its statistics pass; a block's own norm1 takes what its producer
offers.

Eval-mode launches: norm1 statistics (2, skipped with ``stats`` or a hand-over), conv1 (norm1 + SiLU + [up/down] in
the loader; bias, time embedding and norm2 statistics in the epilogue), conv2 (norm2 + SiLU in the loader; bias, 1x1
shortcut conv or identity residual, / output_scale_factor in the epilogue). Besides those, only the time-embedding
projection (SiLU + Linear) runs. No aten group_norm or convolution is dispatched. Under torch.autocast an identity
residual wider than the autocast dtype (fp32 under bf16) is added after conv2, in its own dtype, as diffusers adds it
(one more pass, and a statistics pass with ``out_stats``), so the output and the residual stream keep diffusers'
dtype.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops._autocast import autocast_enabled
from ..ops._dispatch import call, statistics_source
from ..ops.gn_conv2d import gn_conv2d_stats, gn_silu_conv2d, reads_parts_in_place, resample_input, same_but_channels
from . import stats_handover as handover
from .child_check import (
    bypassed_hook_reason,
    dropout_reason,
    hooked_children,
    readable,
    stock_class,
    tally,
    transform_reason,
    unreadable_reason,
)

#: reason -> how often a fused forward fell back to diffusers' own forward in this process.
fallback_reasons: Counter[str] = Counter()
#: How often a fused forward converted an NCHW input to channels-last (one copy of the input) instead of falling
#: back: diffusers' own video temporal containers hand NCHW tensors to the next resnet block (ldmopt's token-order
#: containers, ldmopt.nn.temporal_layout, keep channels-last).
layout_conversions: Counter[str] = Counter()


def _resnet_block_class():
    try:
        from diffusers.models.resnet import ResnetBlock2D
    except Exception as exc:  # diffusers missing or broken
        return None, f"diffusers is not importable ({type(exc).__name__}: {exc})"
    return ResnetBlock2D, ""


def _callable_name(fn) -> str:
    """A name without a memory address, so that the report groups the blocks that share a reason."""
    if isinstance(fn, functools.partial):
        return f"partial({_callable_name(fn.func)})"
    return getattr(fn, "__qualname__", type(fn).__name__)


def _resample_kind(block) -> tuple[str, str]:
    """("none" | "up" | "down", reason if the resampling is not nearest-2x / 2x2-average)."""
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.upsampling import Upsample2D

    up, down = block.upsample, block.downsample
    if up is not None:
        if type(up) is Upsample2D:  # exact types: the fused conv computes what these classes do
            if up.use_conv or up.use_conv_transpose or up.norm is not None or not up.interpolate:
                return "up", "upsample is an Upsample2D with a conv or norm (only nearest 2x is fused)"
            return "up", ""
        if (
            isinstance(up, functools.partial)
            and up.func is F.interpolate
            and up.keywords.get("mode") == "nearest"
            and up.keywords.get("scale_factor") in (2, 2.0)
        ):
            return "up", ""
        return "up", f"upsample {_callable_name(up)} is not nearest 2x (kernel='fir'?)"
    if down is not None:
        if type(down) is Downsample2D:
            pool = down.conv
            if (
                type(pool) is torch.nn.AvgPool2d
                and pool.kernel_size in (2, (2, 2))
                and pool.stride in (2, (2, 2))
                and pool.padding in (0, (0, 0))
                and down.norm is None
                and not pool.ceil_mode
            ):
                return "down", ""
            return "down", "downsample is a Downsample2D with a conv or norm (only 2x2 average pooling is fused)"
        if (
            isinstance(down, functools.partial)
            and down.func is F.avg_pool2d
            and down.keywords.get("kernel_size") == 2
            and down.keywords.get("stride") == 2
        ):
            return "down", ""
        return "down", f"downsample {_callable_name(down)} is not a 2x2 average pool (kernel='fir'?)"
    return "none", ""


def _conv_reasons(name: str, conv, kernel: int) -> list[str]:
    if not readable(conv, torch.nn.Conv2d):
        return [unreadable_reason(name, conv) + " (LoRA/quantised/hooked layers stay on the stock path)"]
    expect = ((kernel, kernel), (1, 1), (kernel // 2, kernel // 2), (1, 1), 1, "zeros")
    got = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
    if got != expect:
        return [f"{name} has (kernel, stride, padding, dilation, groups, padding_mode)={got}; fused: {expect}"]
    return []


def can_fuse(block) -> list[str]:
    """Reasons this ResnetBlock2D instance can never run fused (empty: it can). Input-dependent reasons are
    checked per call by ``runtime_reasons``."""
    return _structural_reasons(block) + _bypassed_hook_reasons(block)


def _not_a_resnet_block(block) -> str | None:
    """Why ``block`` is no diffusers ResnetBlock2D (or ldmopt's module standing for one), or None."""
    cls, why = _resnet_block_class()
    if cls is None:
        return why
    if not isinstance(block, (cls, FusedResnetBlock2D)):
        return f"{type(block).__name__} is not a diffusers ResnetBlock2D"
    return None


def _structural_reasons(block) -> list[str]:
    """can_fuse's reasons but hooks on bypassed children (which can be removed again)."""
    not_a_block = _not_a_resnet_block(block)
    if not_a_block:
        return [not_a_block]
    cls, _ = _resnet_block_class()
    stock = _stock_class(block)
    if stock.forward is not cls.forward:
        return [f"{stock.__qualname__} overrides ResnetBlock2D.forward"]
    reasons = []
    # Without a time-embedding projection every norm but scale_shift computes what "default" does (the VAE's
    # "group" blocks); with one, diffusers only builds "default" and "scale_shift".
    if block.time_embedding_norm == "scale_shift" or (
        block.time_embedding_norm != "default" and block.time_emb_proj is not None
    ):
        reasons.append(f"time_embedding_norm={block.time_embedding_norm!r} (only 'default' is fused)")
    if type(block.nonlinearity) is not torch.nn.SiLU:  # the kernel computes SiLU itself: a subclass may differ
        reasons.append(f"nonlinearity {type(block.nonlinearity).__name__} (only SiLU/swish is fused)")
    for name in ("norm1", "norm2"):
        norm = getattr(block, name)
        if not readable(norm, torch.nn.GroupNorm):
            reasons.append(unreadable_reason(name, norm))
    reasons += _conv_reasons("conv1", block.conv1, 3) + _conv_reasons("conv2", block.conv2, 3)
    if block.conv_shortcut is not None:
        reasons += _conv_reasons("conv_shortcut", block.conv_shortcut, 1)
    reasons += [r for r in _resample_kind(block)[1:] if r]
    return reasons


def _bypassed_hook_reasons(block) -> list[str]:
    """The children the fused convs compute themselves (the SiLU, the dropout, an Upsample2D/Downsample2D module and
    its pooling) with hooks or a wrapped forward their stock calls would run."""
    children = {name: getattr(block, name, None) for name in ("nonlinearity", "dropout", "upsample", "downsample")}
    return [bypassed_hook_reason(name, deep=True) for name in hooked_children(children, deep=True)]


def dtype_reasons(x: Tensor, weight: Tensor) -> list[str]:
    """Why the fused convs cannot take ``x`` with these weights: an autocast dtype they do not serve, or (outside
    autocast) an input dtype other than the weights'."""
    device = x.device.type
    if autocast_enabled(device):
        if torch.get_autocast_dtype(device) not in (torch.float16, torch.bfloat16, torch.float32):
            return [f"autocast dtype {torch.get_autocast_dtype(device)} is not fp16/bf16/fp32"]
        return []
    return [f"input dtype {x.dtype} differs from the weights' {weight.dtype}"] if x.dtype != weight.dtype else []


def _parts_reasons(parts) -> list[str]:
    head, tail = parts
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in parts):
        return ["a channel-concatenation part is not a 4-D tensor"]
    if not same_but_channels(head, tail) or head.dtype != tail.dtype:
        return [f"skip parts {tuple(head.shape)} {head.dtype} and {tuple(tail.shape)} {tail.dtype} differ in batch, "
                "spatial size or dtype"]  # fmt: skip
    return []


def runtime_reasons(block, input_tensor: Tensor | tuple[Tensor, Tensor], temb: Tensor | None) -> list[str]:
    """Reasons these inputs take diffusers' forward instead of the fused one."""
    transform = transform_reason()
    if transform is not None:
        return [transform]
    reasons = []
    if isinstance(input_tensor, tuple):
        reasons += _parts_reasons(input_tensor)
        if reasons:
            return reasons
        input_tensor = input_tensor[0]
    elif not isinstance(input_tensor, Tensor) or input_tensor.dim() != 4:
        return ["input is not a 4-D tensor"]
    if not input_tensor.numel():
        return ["empty input (the fused ops need at least one element)"]
    reasons += dtype_reasons(input_tensor, block.conv1.weight)
    if temb is not None and block.time_emb_proj is None:
        reasons.append("temb given to a block without time_emb_proj (diffusers adds it unprojected)")
    batch = input_tensor.shape[0]
    if isinstance(temb, Tensor) and temb.dim() >= 1 and temb.shape[0] not in (batch, 1):
        # diffusers' add broadcasts an input of batch 1 to the embeddings' batch; the fused convs keep the input's
        reasons.append(f"temb of batch {temb.shape[0]} for an input of batch {batch}")
    dropout = dropout_reason(block.dropout)
    if dropout is not None:
        reasons.append(f"dropout {dropout}")
    return reasons


def _stock_class(block) -> type:
    """The block's own class, past classes ldmopt made (the patcher's swaps, FusedResnetBlock2D)."""
    if isinstance(block, FusedResnetBlock2D):
        return block._ldmopt_source_cls
    return stock_class(block)


def _diffusers_forward(block, input_tensor, temb):
    return _stock_class(block).forward(block, input_tensor, temb)


def to_channels_last(x: Tensor, what: str) -> Tensor:
    """``x`` channels-last for the fused convs, counting a copy in ``layout_conversions`` as "<what> converted to
    channels-last" (the fused conv modules share the counter)."""
    if x.is_contiguous(memory_format=torch.channels_last):
        return x
    tally(layout_conversions, f"{what} converted to channels-last")
    return x.contiguous(memory_format=torch.channels_last)


def autocast_would_round(t: Tensor) -> bool:
    """Whether torch.autocast is on for ``t``'s device with a dtype that ``t`` would lose precision in."""
    device = t.device.type
    if not autocast_enabled(device) or not t.is_floating_point():
        return False
    autocast_dtype = torch.get_autocast_dtype(device)
    return torch.promote_types(t.dtype, autocast_dtype) != autocast_dtype


def fused_resnet_forward(
    block,
    input_tensor: Tensor | tuple[Tensor, Tensor],
    temb: Tensor | None = None,
    *args,
    stats: tuple[Tensor, Tensor] | None = None,
    out_stats: tuple[int, float] | None = None,
    **kwargs,
) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
    """``ResnetBlock2D.forward`` in two fused convolutions (see the module docstring). Tolerance versus diffusers'
    forward: within 2x the error diffusers itself makes in the input dtype (fp64 reference); extra positional
    arguments (diffusers' deprecated ``scale``) are ignored as diffusers does."""
    if isinstance(input_tensor, list):
        input_tensor = tuple(input_tensor)
    reasons = can_fuse(block) or runtime_reasons(block, input_tensor, temb)
    if reasons:
        for reason in reasons:
            tally(fallback_reasons, reason)
        if isinstance(input_tensor, tuple):
            input_tensor = torch.cat(input_tensor, dim=1)
        return _with_out_stats(_diffusers_forward(block, input_tensor, temb), out_stats)
    # One copy of an NCHW input costs less than the stock path's separate GroupNorm, SiLU and add passes, and the
    # fused output is channels-last, so the blocks after this one need no conversion.
    if isinstance(input_tensor, tuple):
        x = (to_channels_last(input_tensor[0], "NCHW hidden part"), to_channels_last(input_tensor[1], "NCHW skip part"))
        if not reads_parts_in_place(*x):  # the reference backend: one concatenation here, not one per op
            x = torch.cat(x, dim=1)
    else:
        x = to_channels_last(input_tensor, "NCHW input")
    norm1, norm2 = block.norm1, block.norm2
    t = None
    if block.time_emb_proj is not None and temb is not None:
        t = block.time_emb_proj(temb if block.skip_time_act else block.nonlinearity(temb))
        batch = (x[0] if isinstance(x, tuple) else x).shape[0]
        if t.dim() == 2 and t.shape[0] == 1 and batch != 1:
            t = t.expand(batch, -1)  # one embedding for the whole batch, broadcast as diffusers' add does (stride 0)
    resample = _resample_kind(block)[0]
    if stats is None and isinstance(x, tuple):  # an up block's (hidden, skip): from both producers' channel sums
        stats = handover.take_parts(*x, norm1.num_groups, norm1.eps, "ResnetBlock2D.norm1")
    elif stats is None:
        stats = handover.take(x, norm1.num_groups, norm1.eps, "ResnetBlock2D.norm1")
    h, h_stats = gn_silu_conv2d(
        x, norm1.weight, norm1.bias, norm1.num_groups, norm1.eps, block.conv1.weight, block.conv1.bias, 1, 1,
        stats=stats, resample=resample, temb=t, out_stats=(norm2.num_groups, norm2.eps),
    )  # fmt: skip
    residual, add_after = None, False
    if block.conv_shortcut is not None:
        cs = block.conv_shortcut
        around = {"shortcut": (x, cs.weight, cs.bias), "shortcut_resample": resample}
    else:  # in == out channels: an identity residual (a concatenation is materialised for it)
        residual = torch.cat(x, dim=1) if isinstance(x, tuple) else x
        # diffusers adds the identity in its own dtype (fp32 + bf16 -> fp32 under autocast); the epilogue would round
        # it to the autocast dtype first, so then it is added after conv2, as diffusers adds it.
        add_after = autocast_would_round(residual)
        around = {} if add_after else {"residual": residual, "residual_resample": resample}
    # Statistics of the output for the GroupNorm after this block, and its channel sums for an up block's
    # cat([hidden, skip], 1), when their consumers asked for them (stats_handover)
    handing = handover.wanted_group_norm(block, h) if out_stats is None and not add_after else None
    sums = out_stats is None and not add_after and handover.wants_sums(block, h)
    y = gn_silu_conv2d(
        h, norm2.weight, norm2.bias, norm2.num_groups, norm2.eps, block.conv2.weight, block.conv2.bias, 1, 1,
        stats=h_stats, output_scale=1.0 if add_after else block.output_scale_factor,
        out_stats=None if add_after else out_stats or handing, out_channel_sums=sums, **around,
    )  # fmt: skip
    if handing is not None or sums:
        return handover.offer_result(y, block, handing, sums)
    if not add_after:
        if out_stats is None:
            handover.offer(y, block)
        return y
    return _with_out_stats((resample_input(residual, resample) + y) / block.output_scale_factor, out_stats)


def _with_out_stats(out: Tensor, out_stats: tuple[int, float] | None) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
    """``out``, or with ``out_stats=(groups, eps)`` also its GroupNorm statistics from a separate pass."""
    if out_stats is None:
        return out
    return out, call(gn_conv2d_stats, statistics_source(out), out_stats[0], float(out_stats[1]))


class FusedResnetBlock2D(torch.nn.Module):
    """A diffusers ``ResnetBlock2D`` computed by ``fused_resnet_forward``.

    ``FusedResnetBlock2D(block)`` adopts ``block``'s submodules and attributes: the parameters are the same objects
    (no copies) and ``state_dict()`` has the same keys, so checkpoints load into either. Hooks are not carried over.
    """

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        not_a_block = _not_a_resnet_block(block)
        if not_a_block:
            raise TypeError(
                f"FusedResnetBlock2D(block): block must be a diffusers ResnetBlock2D, got {type(block).__name__} "
                f"({not_a_block})"
            )
        structural = _structural_reasons(block)
        if structural:  # a direct user has no patch report: say once why every call will run diffusers' forward
            reasons = "; ".join(structural)
            warnings.warn(f"FusedResnetBlock2D: this block runs diffusers' forward: {reasons}", stacklevel=2)
        for key, value in vars(block).items():
            # The block's own attributes; nn.Module's bookkeeping stays fresh, and a forward installed on the instance
            # (a hook wrapper, or fused_resnet_forward bound to it) is the block's, not this module's.
            if key not in self.__dict__ and key != "forward":
                self.__dict__[key] = value
        self._parameters.update(block._parameters)
        self._buffers.update(block._buffers)
        self._modules.update(block._modules)
        self.training = block.training
        self._ldmopt_source_cls = _stock_class(block)

    def forward(
        self, input_tensor: Tensor | tuple[Tensor, Tensor], temb: Tensor | None = None, *args, **kwargs
    ) -> Tensor:
        """``input_tensor``: the block's input, or a pair ``(hidden, skip)`` read as their channel concatenation."""
        return fused_resnet_forward(self, input_tensor, temb, *args, **kwargs)
