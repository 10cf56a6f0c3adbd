"""Nearest 2x upsampling read in the next convolution's loads (family ``gn_conv``, rule ``upsample_conv``).

diffusers' ``Upsample2D`` (UNet up blocks, the VAE decoder) writes ``F.interpolate(x, scale_factor=2, mode="nearest")``,
four times x, for its 3x3 conv to read back. The patched forward runs the conv as ``gn_silu_conv2d(x, ...,
normalize=False, resample="up")``: the implicit-GEMM loader reads x at ``(oh // 2, ow // 2)``, so the upsampled tensor
is never written (x is read instead of four times x). In the SDXL VAE decoder at 1024 px that tensor is 2 GB at the
last level. On GPUs, though, the op's auto placement ("cudnn", ops/gn_conv2d_prologue.py) upsamples before cuDNN's
conv as diffusers does, keeping only the epilogue's statistics: that Triton conv measured 0.83x cuDNN's on the VAE's
upsampler (H200, benchmarks/RESULTS.md); ``LDMOPT_GN_CONV_PROLOGUE=staged`` reads through the index map there too.

Served: ``interpolate`` with ``use_conv`` (the conv a plain 3x3 / padding 1 nn.Conv2d, or 1x1), no norm, and
``output_size`` None or exactly twice the input (an upsampler without a conv, or with a transposed one, is not matched:
nothing to fuse). Anything else, and inputs the fused conv does not
take (another dtype than the conv's outside autocast, the deprecated ``scale`` argument), runs diffusers' forward,
counted in ``report.fallbacks()``; a LoRA, quantized weight or hooks on the conv (checked per call) likewise. An NCHW
input is converted to channels-last once (counted in ``ldmopt.nn.resnet.layout_conversions``): a quarter of what the
stock path writes. The output is offered to the GroupNorm that reads it next (ldmopt.nn.stats_handover): once asked,
the conv's epilogue sums its statistics, or its channel sums for an up block's ``cat([hidden, skip], 1)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..nn import resnet as R
from ..nn import stats_handover as handover
from ..nn.child_check import count_reason, readable, stock, stock_class, unreadable_reason
from ..ops.gn_conv2d import gn_silu_conv2d
from .rule import ClassSwapRule, Site, diffusers_classes

_WHERE = "Upsample2D"


def _conv_name(block: nn.Module) -> str:
    return "conv" if block.name == "conv" else "Conv2d_0"


def _conv_reasons(conv: nn.Module) -> list[str]:
    if not readable(conv, nn.Conv2d):
        return [unreadable_reason("conv", conv)]
    k = tuple(conv.kernel_size)
    same = (k[0] // 2, k[1] // 2)
    got = (k, tuple(conv.stride), conv.padding, tuple(conv.dilation), conv.groups, conv.padding_mode)
    if k not in ((3, 3), (1, 1)) or got[1:] != ((1, 1), same, (1, 1), 1, "zeros"):
        return [f"conv has (kernel, stride, padding, dilation, groups, padding_mode)={got}; fused: 3x3 or 1x1, "
                "stride 1, padding k // 2, no dilation or groups, zero padding"]  # fmt: skip
    return []


def upsample_reasons(block: nn.Module) -> list[str]:
    """Why this Upsample2D can never take the fused path (properties of the instance)."""
    reasons = []
    if block.norm is not None:
        reasons.append(f"norm {type(block.norm).__name__} before the upsampling")
    if not reasons:
        reasons += _conv_reasons(getattr(block, _conv_name(block)))
    return reasons


def _settings_reasons(block: nn.Module) -> list[str]:
    """The settings patch matched (nearest 2x, then a conv; no norm), read again per call: a user may flip them."""
    if not block.use_conv or not block.interpolate or block.use_conv_transpose:
        return [f"use_conv={block.use_conv}, interpolate={block.interpolate}, use_conv_transpose="
                f"{block.use_conv_transpose} (fused: an interpolation, then a conv)"]  # fmt: skip
    if block.norm is not None:
        return [f"norm {type(block.norm).__name__} before the upsampling"]
    return []


def _runtime_reasons(block: nn.Module, x: Tensor, output_size, args, kwargs) -> list[str]:
    if args or kwargs.get("scale", None) is not None:
        return ["deprecated scale argument (diffusers' forward warns)"]
    if not isinstance(x, Tensor) or x.dim() != 4:
        return ["input is not a 4-D tensor"]
    if not x.numel():  # an empty batch: the ops refuse it, diffusers' forward returns it empty
        return ["empty input (the fused ops need at least one element)"]
    if output_size is not None and tuple(output_size) != (2 * x.shape[2], 2 * x.shape[3]):
        # No sizes in the reason: a server seeing many odd sizes would fill the reason counter with them
        return ["output_size is not twice the input's size (an odd-sized skip connection's)"]
    return R.dtype_reasons(x, getattr(block, _conv_name(block)).weight)


def fused_upsample_forward(self, hidden_states: Tensor, output_size=None, *args, **kwargs) -> Tensor:
    """``Upsample2D.forward`` as one convolution that reads the input through nearest 2x index arithmetic."""
    conv = self._modules.get(_conv_name(self))
    # The conv is the whole fusion: its class, hooks, weight and geometry are checked on every call (a LoRA or another
    # conv may replace it after patching), and so are the block's settings.
    reasons = _settings_reasons(self) or _conv_reasons(conv)
    reasons = reasons or _runtime_reasons(self, hidden_states, output_size, args, kwargs)
    if reasons:
        for reason in reasons:
            count_reason(_WHERE, reason)
        return stock(self)(hidden_states, output_size, *args, **kwargs)
    assert hidden_states.shape[1] == self.channels  # as diffusers asserts
    hidden_states = R.to_channels_last(hidden_states, f"{_WHERE}: NCHW input")
    k = conv.kernel_size[0]
    # The next resnet's GroupNorm statistics (a VAE decoder's), or the channel sums an up block's first resnet reads
    # with its skip, from the epilogue when asked for on an earlier call (stats_handover).
    config = handover.wanted_group_norm(self, hidden_states)
    sums = handover.wants_sums(self, hidden_states)
    out = gn_silu_conv2d(hidden_states, None, None, 0, 0.0, conv.weight, conv.bias, 1, k // 2, normalize=False,
                         resample="up", out_stats=config, out_channel_sums=sums)  # fmt: skip
    return handover.offer_result(out, self, config, sums)


class UpsampleConvRule(ClassSwapRule):
    name = "upsample_conv"
    family = "gn_conv"
    description = (
        "Upsample2D: nearest 2x read in the Triton conv's loads (the upsampled tensor is never written), or, on GPUs, "
        "cuDNN's conv with the next GroupNorm's statistics summed after it"
    )
    checked_in_forward = ("conv", "Conv2d_0")

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("upsampling:Upsample2D")

    def match(self, site: Site) -> bool:
        # An upsampler without a conv after the interpolation (a resnet's own, a transposed conv) has nothing to fuse.
        block = site.module
        return bool(block.use_conv and block.interpolate and not block.use_conv_transpose)

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        own = stock_class(block)
        base = self.targets()[0]
        if own.forward is not base.forward:
            return [f"{own.__qualname__} overrides Upsample2D.forward"]
        return upsample_reasons(block)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        conv = site.module._modules.get(_conv_name(site.module))
        return {"": site.module, **({_conv_name(site.module): conv} if isinstance(conv, nn.Module) else {})}

    def methods(self, site: Site):
        return fused_upsample_forward


RULES = [UpsampleConvRule()]
