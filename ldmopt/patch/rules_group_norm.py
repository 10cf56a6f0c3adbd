"""GroupNorm rules: GroupNorm+SiLU where the SiLU is the next op, and plain GroupNorm everywhere else.

- ``group_norm_silu``: models whose forward runs ``conv_act(conv_norm_out(x))`` (VAE Encoder/Decoder, the video
  VAEs' of SVD, Allegro and HunyuanVideo, the UNets' output head) and ``nn.Sequential`` with a ``GroupNorm, SiLU``
  pair (UNet3D's TemporalConvLayer): the GroupNorm becomes ``ldmopt.nn.GroupNorm(activation="silu")`` sharing its
  parameters, the SiLU a :class:`FusedAway`.
- ``group_norm``: any other ``nn.GroupNorm`` (Transformer2DModel.norm, attention group_norm, resnet norms not taken
  by the resnet rule) becomes ``ldmopt.nn.GroupNorm`` sharing its parameters.

Exact: the reference backend computes the same math in fp32 (tolerance: ldmopt.ops.group_norm's docstring).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.child_check import plain_weight
from ..nn.group_norm import GroupNorm as _LdmoptGroupNorm
from ..ops.group_norm import group_norm
from .rule import ChildSwapRule, Rule, Site, diffusers_classes, link_moved_work, moved_work_intact


class PatchedGroupNorm(_LdmoptGroupNorm):
    """``ldmopt.nn.GroupNorm`` as ``patch`` installs it; inputs the fused op does not take (2-D) go to torch."""

    def forward(self, x: Tensor) -> Tensor:
        # The SiLU it took over goes back to its FusedAway when the pair was broken up after patching (rule.py).
        activation = self.activation if moved_work_intact(self) else None
        if x.dim() in (3, 4, 5) and x.numel() and plain_weight(self):  # the ops refuse empty inputs
            return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, activation)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if activation == "silu" else y

    def _get_name(self) -> str:
        return "ldmopt.GroupNorm"


def _is_stock_gn(m: Any) -> bool:
    return type(m) is nn.GroupNorm


def _is_stock_silu(m: Any) -> bool:
    return type(m) is nn.SiLU


#: Models whose forward runs ``sample = self.conv_act(self.conv_norm_out(sample))`` when conv_norm_out is a GroupNorm,
#: and uses conv_act nowhere else (read in diffusers 0.42; the decoders use SpatialNorm instead when
#: norm_type="spatial", which match() rejects).
GROUP_NORM_SILU_HEADS = (
    "autoencoders.vae:Encoder",
    "autoencoders.vae:Decoder",
    "autoencoders.vae:MaskConditionDecoder",
    "autoencoders.autoencoder_kl_temporal_decoder:TemporalDecoder",
    "autoencoders.autoencoder_kl_allegro:AllegroEncoder3D",
    "autoencoders.autoencoder_kl_allegro:AllegroDecoder3D",
    "autoencoders.autoencoder_kl_hunyuan_video:HunyuanVideoEncoder3D",
    "autoencoders.autoencoder_kl_hunyuan_video:HunyuanVideoDecoder3D",
    "unets.unet_2d_condition:UNet2DConditionModel",
    "unets.unet_2d:UNet2DModel",
    "unets.unet_3d_condition:UNet3DConditionModel",
    "unets.unet_motion_model:UNetMotionModel",
    "unets.unet_spatio_temporal_condition:UNetSpatioTemporalConditionModel",
)


class GroupNormSiLUHead(ChildSwapRule):
    """``conv_norm_out`` (GroupNorm) followed by ``conv_act`` (SiLU) in the model's forward."""

    name = "group_norm_silu"
    family = "group_norm"
    description = "GroupNorm+SiLU in one pass (conv_norm_out + conv_act)"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes(*GROUP_NORM_SILU_HEADS)

    def match(self, site: Site) -> bool:
        m = site.module
        return _is_stock_gn(m._modules.get("conv_norm_out")) and _is_stock_silu(m._modules.get("conv_act"))

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"conv_norm_out": site.module.conv_norm_out, "conv_act": site.module.conv_act}

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        m = site.module
        norm = PatchedGroupNorm.from_module(m.conv_norm_out, "silu")
        return m, {"conv_norm_out": norm, "conv_act": link_moved_work(m, "conv_norm_out", norm, "conv_act")}


def _gn_silu_pairs(seq: nn.Sequential) -> list[tuple[str, str]]:
    keys = list(seq._modules)
    pairs = []
    i = 0
    while i + 1 < len(keys):
        if _is_stock_gn(seq._modules[keys[i]]) and _is_stock_silu(seq._modules[keys[i + 1]]):
            pairs.append((keys[i], keys[i + 1]))
            i += 2
        else:
            i += 1
    return pairs


class GroupNormSiLUSequential(ChildSwapRule):
    """``nn.Sequential(..., GroupNorm, SiLU, ...)``: the SiLU consumes the GroupNorm's output directly."""

    name = "group_norm_silu_seq"
    family = "group_norm"
    description = "GroupNorm+SiLU in one pass (inside nn.Sequential)"

    def targets(self) -> tuple[type, ...]:
        return (nn.Sequential,)

    def match(self, site: Site) -> bool:
        return bool(_gn_silu_pairs(site.module))

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {k: site.module._modules[k] for pair in _gn_silu_pairs(site.module) for k in pair}

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        seq = site.module
        children = {}
        for norm_key, act_key in _gn_silu_pairs(seq):
            norm = PatchedGroupNorm.from_module(seq._modules[norm_key], "silu")
            children[norm_key], children[act_key] = norm, link_moved_work(seq, norm_key, norm, act_key)
        return seq, children


class GroupNormAnywhere(ChildSwapRule):
    """Any other ``nn.GroupNorm``: same math through ldmopt's kernel (channels-last aware, fp32 statistics)."""

    name = "group_norm"
    family = "group_norm"
    description = "GroupNorm through ldmopt's kernel"

    def targets(self) -> tuple[type, ...]:
        return (nn.GroupNorm,)

    def reasons(self, site: Site) -> list[str]:
        if site.parent is None:
            return ["a GroupNorm passed as the root module cannot be replaced in place (patch its parent)"]
        return []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module}

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        return site.parent, {site.attr: PatchedGroupNorm.from_module(site.module, None)}


RULES: list[Rule] = [GroupNormSiLUHead(), GroupNormSiLUSequential(), GroupNormAnywhere()]
