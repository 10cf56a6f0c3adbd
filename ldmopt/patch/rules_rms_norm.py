"""RMSNorm rule (family ``rms_norm``): diffusers' ``RMSNorm`` (the query/key norms of SD3.5, HunyuanVideo, LTX,
CogView4, Sana and more, and some blocks' own norms) runs as one ``ldmopt.ops.rms_norm`` row kernel instead of eight
elementwise passes with an fp32 copy of the activation. torch.nn.RMSNorm (Flux, Wan) is left alone: torch already runs
it as one fused kernel on a GPU.

A class swap (see rule.py): same instance, same parameters. The output dtype is the stock module's: the weight's when
it is fp16/bf16, fp32 (the promoted dtype) when it is fp32, the input's without a weight; the stock module rounds to
half precision before multiplying by a half weight, the fused kernel once at the end (within 2x the stock error). A
weight that is not a plain tensor (quantized), an NPU input or rows strided in memory (DC-AE normalises the channels
of an NCHW tensor through movedim) run the stock forward, counted in ``report.fallbacks()``. LTX-Video's VAE, whose
rows are strided on every call, is left stock at patch time with that reason.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.child_check import count_reason, plain_weight
from ..ops.rms_norm import rms_norm
from .rule import ClassSwapRule, Rule, Site, diffusers_classes, stock

_HALF = (torch.float16, torch.bfloat16)
_LTX_VAE_MODULE = "diffusers.models.autoencoders.autoencoder_kl_ltx"


def stock_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.dtype:
    """The stock module's output dtype: x's without a weight; with one, the product's (the normalised x is cast to a
    half-precision weight's dtype first, else stays fp32), promoted with the bias."""
    if weight is None:
        return x.dtype
    dtype = (
        weight.dtype
        if weight.dtype in _HALF
        else torch.promote_types(torch.promote_types(x.dtype, torch.float32), weight.dtype)
    )
    return dtype if bias is None else torch.promote_types(dtype, bias.dtype)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # Stock for: NPU inputs (diffusers' own NPU kernel), empty tensors (stock returns them empty), rows not contiguous
    # in memory (DC-AE normalises channels of an NCHW tensor through movedim: the kernel's reads would be strided,
    # and stock keeps that layout for the next conv), and quantized weights.
    reason = None
    if not plain_weight(self):
        reason = "weight is not a plain tensor (quantized?)"
    elif hidden_states.device.type == "npu":
        reason = "NPU input (diffusers' own NPU kernel)"
    elif hidden_states.numel() != 0 and hidden_states.stride(-1) != 1:
        reason = "rows not contiguous in memory (channels of a channels-first tensor normalised through movedim)"
    if reason is not None:
        count_reason("RMSNorm", reason)
    if reason is not None or hidden_states.numel() == 0:
        return stock(self)(hidden_states)
    weight, bias = self.weight, self.bias
    return rms_norm(hidden_states, weight, bias, self.eps, out_dtype=stock_out_dtype(hidden_states, weight, bias))


class RMSNormRule(ClassSwapRule):
    name = "rms_norm"
    family = "rms_norm"
    description = "RMSNorm in one row kernel (fp32 statistics and affine)"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("normalization:RMSNorm")

    def reasons(self, site: Site) -> list[str]:
        norm = site.module
        reasons = []
        if site.parent is not None and type(site.parent).__module__ == _LTX_VAE_MODULE:
            # Its causal convs pad by concatenation, so even a channels-last activation arrives channels-first.
            reasons.append(
                "LTX-Video's VAE normalises the channels of channels-first activations (through movedim): the rows"
                " are strided in memory on every call, and the stock path keeps that layout for the next conv"
            )
        if len(getattr(norm, "dim", ())) != 1:
            reasons.append(f"normalises over dims {tuple(getattr(norm, 'dim', ()))}; the kernel takes one last dim")
        for name in ("weight", "bias"):
            t = getattr(norm, name, None)
            if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1):
                reasons.append(f"{name} is not a floating-point vector")
        return reasons

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module}

    def methods(self, site: Site):
        return _rms_norm_forward


RULES: list[Rule] = [RMSNormRule()]
