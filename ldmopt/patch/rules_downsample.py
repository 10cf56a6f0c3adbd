"""A downsampler's conv that sums its output's statistics for the GroupNorms that read it (family ``gn_conv``, rule
``downsample_conv``).

diffusers' ``Downsample2D`` (UNet down blocks) is a plain 3x3 stride-2 conv. Its output is read twice by GroupNorms:
the next down block's first resnet (norm1), and, as a skip connection, an up block's resnet beside the hidden state
(``cat([hidden, skip], 1)``). Each would run a statistics pass over it. The patched forward offers its output to them
(ldmopt.nn.stats_handover): once one asked, the conv runs as ``gn_silu_conv2d(x, ..., normalize=False, stride=2)``,
whose epilogue sums the per-group statistics and the per-channel sums they read (on GPUs: cuDNN's conv and a
read-only statistics pass, the op's "cudnn" placement, ops/gn_conv2d_prologue.py); until then, whenever nothing asks,
and under autograd (a gradient-checkpointing recompute must run the ops of the forward it replays), the stock conv
runs (cuDNN). Results agree within the convs' rounding; fp32 products follow PyTorch's
convolution precision either way.

Served: ``use_conv`` with ``padding=1`` (the conv a plain 3x3 / stride 2 / padding 1 nn.Conv2d) and no norm. A
downsampler that pads asymmetrically (``padding=0``, VAE encoders) or average-pools is not matched. A LoRA, quantized
weight or hooks on the conv (checked per call), the deprecated ``scale`` argument, another dtype than the conv's
outside autocast, or a non-4-D input run diffusers' forward, counted in ``report.fallbacks()``. An NCHW input is
converted to channels-last for the fused conv (counted in ``ldmopt.nn.resnet.layout_conversions``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import resnet as R
from ..nn import stats_handover as handover
from ..nn.child_check import count_reason, readable, stock, stock_class, unreadable_reason
from ..ops.gn_conv2d import gn_silu_conv2d
from .rule import ClassSwapRule, Site, diffusers_classes

_WHERE = "Downsample2D"


def _conv_reasons(conv: nn.Module) -> list[str]:
    if not readable(conv, nn.Conv2d):
        return [unreadable_reason("conv", conv)]
    got = (tuple(conv.kernel_size), tuple(conv.stride), conv.padding, tuple(conv.dilation), conv.groups,
           conv.padding_mode)  # fmt: skip
    if got != ((3, 3), (2, 2), (1, 1), (1, 1), 1, "zeros"):
        return [f"conv has (kernel, stride, padding, dilation, groups, padding_mode)={got}; fused: 3x3, stride 2, "
                "padding 1, no dilation or groups, zero padding"]  # fmt: skip
    return []


def _runtime_reasons(x: Tensor, conv: nn.Module, args, kwargs) -> list[str]:
    if args or kwargs.get("scale", None) is not None:
        return ["deprecated scale argument (diffusers' forward warns)"]
    if not isinstance(x, Tensor) or x.dim() != 4:
        return ["input is not a 4-D tensor"]
    if not x.numel():  # an empty batch: the ops refuse it, diffusers' forward returns it empty
        return ["empty input (the fused ops need at least one element)"]
    return R.dtype_reasons(x, conv.weight)


def fused_downsample_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """``Downsample2D.forward``, offering its output; the fused conv with output statistics once a consumer asked."""
    conv = self._modules.get("conv")
    reasons = _conv_reasons(conv) or _runtime_reasons(hidden_states, conv, args, kwargs)
    if reasons:
        for reason in reasons:
            count_reason(_WHERE, reason)
        return stock(self)(hidden_states, *args, **kwargs)
    assert hidden_states.shape[1] == self.channels  # as diffusers asserts
    config = handover.wanted_group_norm(self, hidden_states)
    sums = handover.wants_sums(self, hidden_states)
    # Under autograd the stock conv stays: a (non-reentrant) gradient-checkpointing recompute must save what the
    # forward it replays saved, and a request learned in between would switch the op. (A reentrant checkpoint runs
    # its forward without autograd and may take the fused conv there: its recompute then differs by rounding only.)
    if (config is None and not sums) or torch.is_grad_enabled():
        out = conv(hidden_states)  # what diffusers' forward computes here (no norm, symmetric padding)
        handover.offer(out, self)
        return out
    x = R.to_channels_last(hidden_states, f"{_WHERE}: NCHW input")
    out = gn_silu_conv2d(x, None, None, 0, 0.0, conv.weight, conv.bias, 2, 1, normalize=False, out_stats=config,
                         out_channel_sums=sums)  # fmt: skip
    return handover.offer_result(out, self, config, sums)


class DownsampleConvRule(ClassSwapRule):
    name = "downsample_conv"
    family = "gn_conv"
    description = "Downsample2D: its output's GroupNorm statistics summed in the conv's epilogue once asked for"
    checked_in_forward = ("conv",)

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("downsampling:Downsample2D")

    def match(self, site: Site) -> bool:
        # Average pooling, or a conv after asymmetric padding (VAE encoders): no conv this path serves.
        block = site.module
        return bool(block.use_conv and block.padding == 1)

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        own = stock_class(block)
        if own.forward is not self.targets()[0].forward:
            return [f"{own.__qualname__} overrides Downsample2D.forward"]
        if block.norm is not None:
            return [f"norm {type(block.norm).__name__} before the downsampling"]
        return _conv_reasons(block._modules.get("conv"))

    def touched(self, site: Site) -> dict[str, nn.Module]:
        conv = site.module._modules.get("conv")
        return {"": site.module, **({"conv": conv} if isinstance(conv, nn.Module) else {})}

    def methods(self, site: Site):
        return fused_downsample_forward


RULES = [DownsampleConvRule()]
