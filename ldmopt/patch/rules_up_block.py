"""UNet up blocks whose resnets read the skip connection in place (family ``gn_conv``, rule ``up_block_skip``).

diffusers' up blocks concatenate the running activation with the skip from the down path,
``torch.cat([hidden_states, res_hidden_states], dim=1)``, only for the next ResnetBlock2D to read it: its GroupNorm
statistics, conv1 (through norm1 + SiLU) and the 1x1 ``conv_shortcut``. The patched forward hands the resnet the pair
instead, and ``ldmopt.nn.resnet.fused_resnet_forward`` reads each channel block where its part lies
(``gn_silu_conv2d(x=(hidden, skip))``): the concatenation (both parts read, their sum written, then read back three
times) is never written.

Blocks: UpBlock2D and CrossAttnUpBlock2D (SD1.5, SD2.1, SDXL), UpBlockMotion and CrossAttnUpBlockMotion
(AnimateDiff), UpBlock3D and CrossAttnUpBlock3D (ModelScope), UpBlockSpatioTemporal and
CrossAttnUpBlockSpatioTemporal (SVD: the SpatioTemporalResBlock hands the pair to its spatial ResnetBlock2D).
Everything else in their forward runs as in diffusers (FreeU, gradient checkpointing where the class has it,
attentions, motion modules, temporal convs, upsamplers; the deprecated ``scale`` arguments take diffusers' own
forward). A resnet that ldmopt's ``resnet`` / ``spatiotemporal_resnet`` rule did not patch, or that was hooked,
replaced or changed since (checked per call), gets the concatenation and its own forward, as in diffusers.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..nn import resnet as R
from ..nn import temporal_resnet as TR
from ..nn.child_check import hooked, observed, stock, stock_class
from .rule import ClassSwapRule, Site, changed_guard_reason, diffusers_classes

_FREEU = ("s1", "s2", "b1", "b2")


def _runs_fused(module: nn.Module, rule_class: type) -> bool:
    """Whether ``module`` runs ``rule_class``'s fused forward when called: patched by that rule, nothing attached to it
    (its fused forward is called directly here, past ``__call__``), its bypassed children unchanged."""
    label = getattr(type(module), "_ldmopt_label", None)  # the class ldmopt made (read through getattr: dynamo)
    return label == rule_class.description and not hooked(module) and changed_guard_reason(module) is None


def _reads_parts(resnet: nn.Module) -> bool:
    from .rules_gn_conv import ResnetBlockRule

    return _runs_fused(resnet, ResnetBlockRule)


#: How a class's diffusers forward calls its resnet outside gradient checkpointing (inside, always positionally):
#: positional ``resnet(x, temb)``; "keywords" ``resnet(input_tensor=x, temb=temb)`` (the motion blocks); "svd"
#: ``resnet(x, temb, image_only_indicator=indicator)``. Hooks that read the call's arguments see the same call.
POSITIONAL, KEYWORDS, SVD = "positional", "keywords", "svd"


def _call_arguments(style: str, x, args: tuple) -> tuple[tuple, dict]:
    if style == KEYWORDS:
        return (), {"input_tensor": x, "temb": args[0]}
    if style == SVD:
        return (x, args[0]), {"image_only_indicator": args[1]}
    return (x, *args), {}


def resnet_on_skip(resnet: nn.Module, hidden: Tensor, skip: Tensor, temb: Tensor | None, style=POSITIONAL) -> Tensor:
    """``resnet(torch.cat([hidden, skip], 1), temb)``, with the concatenation read in place when the resnet is fused."""
    if _reads_parts(resnet):
        with observed(resnet, *_call_arguments(style, hidden, (temb,))):  # the profiler's scope for the resnet
            return R.fused_resnet_forward(resnet, (hidden, skip), temb)
    args, kwargs = _call_arguments(style, torch.cat([hidden, skip], dim=1), (temb,))
    return resnet(*args, **kwargs)


def spatiotemporal_on_skip(resnet: nn.Module, hidden: Tensor, skip: Tensor, temb, image_only_indicator, style=SVD):
    """SVD's ``resnet(torch.cat([hidden, skip], 1), temb, image_only_indicator=...)``: the pair goes through the fused
    SpatioTemporalResBlock to its spatial ResnetBlock2D when both are fused."""
    from .rules_gn_conv import SpatioTemporalResBlockRule

    if _runs_fused(resnet, SpatioTemporalResBlockRule) and _reads_parts(resnet.spatial_res_block):
        with observed(resnet, *_call_arguments(style, hidden, (temb, image_only_indicator))):
            return TR.fused_spatiotemporal_forward(resnet, (hidden, skip), temb, image_only_indicator)
    args, kwargs = _call_arguments(style, torch.cat([hidden, skip], dim=1), (temb, image_only_indicator))
    return resnet(*args, **kwargs)


def _up_layers(
    block: nn.Module,
    hidden: Tensor,
    skips: tuple[Tensor, ...],
    resnet_args: tuple,
    after=None,
    *,
    run_resnet=resnet_on_skip,
    style: str = POSITIONAL,
    freeu: bool = True,
    checkpointing: bool = True,
) -> Tensor:
    """The shared loop of the up blocks: pop a skip, FreeU, ``run_resnet(resnet, hidden, skip, *resnet_args)``, then
    ``after(i, hidden)`` (the layer's attention, motion module, temporal conv), as diffusers orders them. ``freeu`` /
    ``checkpointing``: whether the class's own forward has FreeU / gradient checkpointing."""
    freeu = freeu and all(getattr(block, name, None) for name in _FREEU)
    for i, resnet in enumerate(block.resnets):
        skip, skips = skips[-1], skips[:-1]
        if freeu:
            from diffusers.utils.torch_utils import apply_freeu

            hidden, skip = apply_freeu(
                block.resolution_idx, hidden, skip, s1=block.s1, s2=block.s2, b1=block.b1, b2=block.b2
            )
        if checkpointing and torch.is_grad_enabled() and block.gradient_checkpointing:
            run = functools.partial(run_resnet, resnet, style=POSITIONAL)  # diffusers passes the resnet positionally
            hidden = block._gradient_checkpointing_func(run, hidden, skip, *resnet_args)
        else:
            hidden = run_resnet(resnet, hidden, skip, *resnet_args, style=style)
        if after is not None:
            hidden = after(i, hidden)
    return hidden


def _upsample(block: nn.Module, hidden: Tensor, upsample_size, style: str = POSITIONAL) -> Tensor:
    """The upsamplers, called as the class's diffusers forward calls them (``style``, as for the resnets)."""
    if block.upsamplers is not None:
        for upsampler in block.upsamplers:
            if style == KEYWORDS:
                hidden = upsampler(hidden_states=hidden, output_size=upsample_size)
            else:
                hidden = upsampler(hidden, upsample_size)
    return hidden


def _attend(block, i, hidden, encoder_hidden_states, cross_attention_kwargs, attention_mask, encoder_attention_mask,
            style: str = POSITIONAL):  # fmt: skip
    args, kwargs = ((), {"hidden_states": hidden}) if style == KEYWORDS else ((hidden,), {})
    return block.attentions[i](
        *args,
        **kwargs,
        encoder_hidden_states=encoder_hidden_states,
        cross_attention_kwargs=cross_attention_kwargs,
        attention_mask=attention_mask,
        encoder_attention_mask=encoder_attention_mask,
        return_dict=False,
    )[0]


def _scale_given(cross_attention_kwargs) -> bool:
    return cross_attention_kwargs is not None and cross_attention_kwargs.get("scale", None) is not None


def up_block_forward(self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, *args, **kwargs):
    """UpBlock2D.forward with the skip read in place."""
    if args or kwargs.get("scale") is not None:  # diffusers' deprecation message
        return stock(self)(hidden_states, res_hidden_states_tuple, temb, upsample_size, *args, **kwargs)
    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,))
    return _upsample(self, hidden, upsample_size)


def cross_attn_up_block_forward(
    self,
    hidden_states,
    res_hidden_states_tuple,
    temb=None,
    encoder_hidden_states=None,
    cross_attention_kwargs=None,
    upsample_size=None,
    attention_mask=None,
    encoder_attention_mask=None,
):
    """CrossAttnUpBlock2D.forward with the skip read in place."""
    if _scale_given(cross_attention_kwargs):  # diffusers' deprecation warning
        return stock(self)(hidden_states, res_hidden_states_tuple, temb, encoder_hidden_states, cross_attention_kwargs,
                           upsample_size, attention_mask, encoder_attention_mask)  # fmt: skip

    def after(i, hidden):
        return _attend(self, i, hidden, encoder_hidden_states, cross_attention_kwargs, attention_mask,
                       encoder_attention_mask)  # fmt: skip

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,), after)
    return _upsample(self, hidden, upsample_size)


def up_block_motion_forward(
    self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, num_frames=1, *args, **kwargs
):
    """UpBlockMotion.forward with the skip read in place."""
    if args or kwargs.get("scale") is not None:
        return stock(self)(hidden_states, res_hidden_states_tuple, temb, upsample_size, num_frames, *args, **kwargs)

    def after(i, hidden):
        return self.motion_modules[i](hidden, num_frames=num_frames)

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,), after, style=KEYWORDS)
    return _upsample(self, hidden, upsample_size, style=KEYWORDS)


def cross_attn_up_block_motion_forward(
    self,
    hidden_states,
    res_hidden_states_tuple,
    temb=None,
    encoder_hidden_states=None,
    cross_attention_kwargs=None,
    upsample_size=None,
    attention_mask=None,
    encoder_attention_mask=None,
    num_frames=1,
):
    """CrossAttnUpBlockMotion.forward with the skip read in place."""
    if _scale_given(cross_attention_kwargs):
        return stock(self)(hidden_states, res_hidden_states_tuple, temb, encoder_hidden_states, cross_attention_kwargs,
                           upsample_size, attention_mask, encoder_attention_mask, num_frames)  # fmt: skip

    def after(i, hidden):
        hidden = _attend(self, i, hidden, encoder_hidden_states, cross_attention_kwargs, attention_mask,
                         encoder_attention_mask, style=KEYWORDS)  # fmt: skip
        return self.motion_modules[i](hidden, num_frames=num_frames)

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,), after, style=KEYWORDS)
    return _upsample(self, hidden, upsample_size, style=KEYWORDS)


def up_block_3d_forward(self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, num_frames=1):
    """UpBlock3D.forward with the skip read in place."""

    def after(i, hidden):
        return self.temp_convs[i](hidden, num_frames=num_frames)

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,), after, checkpointing=False)
    return _upsample(self, hidden, upsample_size)


def cross_attn_up_block_3d_forward(
    self,
    hidden_states,
    res_hidden_states_tuple,
    temb=None,
    encoder_hidden_states=None,
    upsample_size=None,
    attention_mask=None,
    num_frames=1,
    cross_attention_kwargs=None,
):
    """CrossAttnUpBlock3D.forward with the skip read in place (diffusers does not use its attention_mask)."""

    def after(i, hidden):
        hidden = self.temp_convs[i](hidden, num_frames=num_frames)
        hidden = self.attentions[i](hidden, encoder_hidden_states=encoder_hidden_states,
                                    cross_attention_kwargs=cross_attention_kwargs, return_dict=False)[0]  # fmt: skip
        return self.temp_attentions[i](hidden, num_frames=num_frames, cross_attention_kwargs=cross_attention_kwargs,
                                       return_dict=False)[0]  # fmt: skip

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb,), after, checkpointing=False)
    return _upsample(self, hidden, upsample_size)


def up_block_spatiotemporal_forward(
    self, hidden_states, res_hidden_states_tuple, temb=None, image_only_indicator=None, upsample_size=None
):
    """UpBlockSpatioTemporal.forward with the skip read in place."""
    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb, image_only_indicator),
                        run_resnet=spatiotemporal_on_skip, style=SVD, freeu=False)  # fmt: skip
    return _upsample(self, hidden, upsample_size)


def cross_attn_up_block_spatiotemporal_forward(
    self,
    hidden_states,
    res_hidden_states_tuple,
    temb=None,
    encoder_hidden_states=None,
    image_only_indicator=None,
    upsample_size=None,
):
    """CrossAttnUpBlockSpatioTemporal.forward with the skip read in place."""

    def after(i, hidden):
        return self.attentions[i](hidden, encoder_hidden_states=encoder_hidden_states,
                                  image_only_indicator=image_only_indicator, return_dict=False)[0]  # fmt: skip

    hidden = _up_layers(self, hidden_states, res_hidden_states_tuple, (temb, image_only_indicator), after,
                        run_resnet=spatiotemporal_on_skip, style=SVD, freeu=False)  # fmt: skip
    return _upsample(self, hidden, upsample_size)


_FORWARDS = {
    "UpBlock2D": up_block_forward,
    "CrossAttnUpBlock2D": cross_attn_up_block_forward,
    "UpBlockMotion": up_block_motion_forward,
    "CrossAttnUpBlockMotion": cross_attn_up_block_motion_forward,
    "UpBlock3D": up_block_3d_forward,
    "CrossAttnUpBlock3D": cross_attn_up_block_3d_forward,
    "UpBlockSpatioTemporal": up_block_spatiotemporal_forward,
    "CrossAttnUpBlockSpatioTemporal": cross_attn_up_block_spatiotemporal_forward,
}


def _can_read_parts(resnet: nn.Module) -> bool:
    """Whether a resnet of the block could read the pair: a ResnetBlock2D, or SVD's SpatioTemporalResBlock around
    one, that the resnet rules would fuse (properties of the instance; calls are checked again each time)."""
    if type(resnet).__name__ == "SpatioTemporalResBlock":
        return not TR.spatiotemporal_reasons(resnet) and not R.can_fuse(resnet.spatial_res_block)
    return not R.can_fuse(resnet)


class UpBlockSkipRule(ClassSwapRule):
    name = "up_block_skip"
    family = "gn_conv"
    description = "UNet up block: each fused resnet reads cat([hidden, skip]) in place (never written)"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes(
            "unets.unet_2d_blocks:UpBlock2D",
            "unets.unet_2d_blocks:CrossAttnUpBlock2D",
            "unets.unet_motion_model:UpBlockMotion",
            "unets.unet_motion_model:CrossAttnUpBlockMotion",
            "unets.unet_3d_blocks:UpBlock3D",
            "unets.unet_3d_blocks:CrossAttnUpBlock3D",
            "unets.unet_3d_blocks:UpBlockSpatioTemporal",
            "unets.unet_3d_blocks:CrossAttnUpBlockSpatioTemporal",
        )

    def reasons(self, site: Site) -> list[str]:
        block = site.module
        base = next(cls for cls in self.targets() if isinstance(block, cls))
        own = stock_class(block)
        if own.forward is not base.forward:
            return [f"{own.__qualname__} overrides {base.__name__}.forward"]
        if not any(_can_read_parts(r) for r in block.resnets):
            return ["none of its resnets can run fused (each would get the concatenation; see the resnet rules)"]
        return []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module}

    def methods(self, site: Site):
        base = next(cls for cls in self.targets() if isinstance(site.module, cls))
        return _FORWARDS[base.__name__]


RULES = [UpBlockSkipRule()]
