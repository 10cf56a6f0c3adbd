"""GroupNorm fused into a convolution's loads (family ``gn_conv``).

- ``resnet``: ``ResnetBlock2D`` runs ``ldmopt.nn.resnet.fused_resnet_forward``: conv1 reads its input through
  GroupNorm1 + SiLU (+ nearest 2x upsample / 2x2 average pool), adds the time embedding and accumulates GroupNorm2
  statistics in its epilogue; conv2 reads through GroupNorm2 + SiLU and adds the shortcut and ``/
  output_scale_factor``. ``can_fuse`` gives the reasons a block stays stock; inputs the fused path does not serve
  (NCHW instead of channels-last, dtype mismatch, dropout in training) run diffusers' forward per call, counted in
  ``ldmopt.nn.resnet.fallback_reasons`` (the report shows them).
- ``transformer2d_in``: ``Transformer2DModel`` with continuous input: ``norm`` (GroupNorm) + ``proj_in`` (1x1 conv,
  or Linear read as a 1x1 conv) in one ``gn_silu_conv2d(activation=None)``; on the way out, when the residual is
  channels-last, ``proj_out`` (Linear or 1x1 conv) runs as one GEMM over the tokens with the residual added in its
  epilogue and writes channels-last, so the next ResnetBlock2D gets channels-last input and stays fused (a LoRA or
  hooks on ``proj_out``, checked per call, keep the stock projection and add). Once the GroupNorm that reads the
  output (the next resnet's norm1, or an up block's with its skip) asked for its statistics or channel sums
  (``nn.stats_handover``), proj_out runs as a 1x1 conv instead, whose epilogue sums them. When the first
  transformer block's norm1 is read in GEMM loads (the ``residual`` family), proj_in's epilogue also sums the
  LayerNorm statistics of its output rows and hands them to it, so norm1 runs no statistics pass.
- ``spatiotemporal_in``: SVD's ``TransformerSpatioTemporalModel``: the same GroupNorm + ``proj_in`` (a Linear) in one
  ``gn_silu_conv2d(activation=None)``, the same statistics for the first block's norm1, and the same ``proj_out`` +
  residual epilogue; the blocks run as in diffusers.
- ``spatiotemporal_resnet``: SVD's ``SpatioTemporalResBlock`` runs ``ldmopt.nn.temporal_resnet``'s fused forward:
  its temporal resnet (Conv3d (3, 1, 1)) as two (3, 1) fused convs over a (video, C, frame, pixel) view, the
  AlphaBlender mix in conv2's epilogue.
- ``temporal_conv``: the UNet3D's ``TemporalConvLayer`` (ModelScope) as four such convs.

All are class swaps (rule.py). Tolerance: the ops' (within 2x the error of the unfused PyTorch ops in the input
dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn import resnet as R
from ..nn import stats_handover as handover
from ..nn import temporal_resnet as TR
from ..nn.child_check import count_stock, hooked, readable
from ..nn.proj_out import pointwise_as_conv, proj_out_residual
from ..ops.gn_conv2d import gn_silu_conv2d
from ..ops.linear import linear
from .rule import ClassSwapRule, Rule, Site, stock

# Children whose forward the fused path does not call (nonlinearity still runs on temb, but not on the main path).
_BYPASSED = ("norm1", "norm2", "conv1", "conv2", "conv_shortcut", "dropout", "nonlinearity", "upsample", "downsample")


def _resnet_forward(self, input_tensor: Tensor, temb: Tensor | None = None, *args, **kwargs) -> Tensor:
    return R.fused_resnet_forward(self, input_tensor, temb, *args, **kwargs)


class ResnetBlockRule(ClassSwapRule):
    name = "resnet"
    family = "gn_conv"
    description = "ResnetBlock2D: GN+SiLU fused into conv1/conv2 loads, temb/shortcut/stats in epilogues"
    # can_fuse, asked on every call, already checks these (class, hooks, weight): the guard need not again.
    checked_in_forward = ("norm1", "norm2", "conv1", "conv2", "conv_shortcut")

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.resnet import ResnetBlock2D

        return (ResnetBlock2D,)

    def reasons(self, site: Site) -> list[str]:
        return R.can_fuse(site.module)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        block = site.module
        found = {name: getattr(block, name, None) for name in _BYPASSED}
        return {"": block, **{k: v for k, v in found.items() if isinstance(v, nn.Module)}}

    def methods(self, site: Site):
        return _resnet_forward


def _norm_proj_in_readable(self, where: str) -> bool:
    """Whether ``norm`` and ``proj_in`` are still what the fused path reads (child_check); counts why not."""
    for name, kinds in (("norm", (nn.GroupNorm,)), ("proj_in", (nn.Linear, nn.Conv2d))):
        child = self._modules.get(name)
        if not readable(child, *kinds):
            count_stock(where, name, child)
            return False
    return True


def _norm_proj_in(self, hidden_states: Tensor, consumer: str) -> tuple[Tensor, float | None, Tensor | None]:
    """``proj_in(norm(hidden_states))`` as one 1x1 conv with the GroupNorm in its loads: (h, eps, row_stats). The
    GroupNorm's statistics come from the producer of hidden_states when it handed them over; h's pixel rows' LayerNorm
    statistics (``row_stats``, for ``eps``) come from the conv's epilogue when the first transformer block's norm1 asked
    for them on an earlier call (stats_handover), else eps and row_stats are None."""
    weight, bias, precision = pointwise_as_conv(self.proj_in)
    norm = self.norm
    stats = handover.take(hidden_states, norm.num_groups, norm.eps, consumer)
    eps = handover.wanted_layer_norm_eps(self, hidden_states)
    out = gn_silu_conv2d(
        hidden_states, norm.weight, norm.bias, norm.num_groups, norm.eps, weight, bias, 1, 0, activation=None,
        fp32_precision=precision, stats=stats, next_norm_eps=eps,
    )  # fmt: skip
    return (out, None, None) if eps is None else (out[0], eps, out[1])


def _t2d_operate_on_continuous_inputs(self, hidden_states: Tensor) -> tuple[Tensor, int]:
    if not _norm_proj_in_readable(self, "Transformer2DModel"):
        return stock(self, "_operate_on_continuous_inputs")(hidden_states)
    batch, _, height, width = hidden_states.shape
    h, eps, row_stats = _norm_proj_in(self, hidden_states, "Transformer2DModel.norm")
    tokens = h.permute(0, 2, 3, 1).reshape(batch, height * width, h.shape[1])
    handover.offer_layer_norm(tokens, self, eps, row_stats)  # for the first block's norm1
    # What diffusers returns as inner_dim, and later reshapes proj_out's output with: proj_in's output channels for a
    # 1x1 conv, but the INPUT channels for a linear projection (applied after that reshape there).
    return tokens, hidden_states.shape[1] if self.use_linear_projection else h.shape[1]


def _proj_out_fusable(where: str, proj_out: nn.Module, residual: Tensor) -> bool:
    """Whether proj_out + residual can run as one GEMM with the add in its epilogue: a channels-last residual and a
    plain Linear or 1x1 conv (a LoRA or hooks keep the stock path, counted in ``child_check.fallback_reasons``)."""
    if not residual.is_contiguous(memory_format=torch.channels_last):
        return False
    if readable(proj_out, nn.Linear) or (readable(proj_out, nn.Conv2d) and _is_pointwise(proj_out)):
        # Another width broadcasts in diffusers' add (a 1-channel proj_out); the epilogue adds like shapes only.
        return proj_out.weight.shape[0] == residual.shape[1]
    count_stock(where, "proj_out", proj_out)
    return False


def _proj_out_residual(proj_out: nn.Module, tokens, residual: Tensor, mix: Tensor | None = None) -> Tensor:
    """``proj_out(tokens) + residual`` (when _proj_out_fusable) with the add in the GEMM epilogue, as channels-last
    (N, C, H, W) like the residual. tokens may be a pair blended per frame by ``mix`` (ops.linear)."""
    weight = proj_out.weight if proj_out.weight.dim() == 2 else proj_out.weight.flatten(1)
    n, c, h, w = residual.shape
    res_tokens = residual.permute(0, 2, 3, 1).reshape(n, h * w, c)  # a view: channels-last memory is token order
    x = tuple(t.reshape(n, h * w, -1) for t in tokens) if isinstance(tokens, tuple) else tokens.reshape(n, h * w, -1)
    out = linear(x, weight, proj_out.bias, residual=res_tokens, mix=mix)
    return out.view(n, h, w, c).permute(0, 3, 1, 2)


def _blend_weight(mixer: nn.Module, image_only_indicator: Tensor, rows: int) -> Tensor | None:
    """AlphaBlender's weight of its spatial input per frame ([rows] or one value, fp32; fp64 for an fp64 mixer), as
    its forward computes it for 3-D tokens; None when the mixer is not diffusers' own, hooked, or its alpha does not
    broadcast over the frames (the stock mixer runs, and raises where diffusers does)."""
    from diffusers.models.resnet import AlphaBlender

    if type(mixer) is not AlphaBlender or hooked(mixer):
        count_stock("TransformerSpatioTemporalModel", "time_mixer", mixer)
        return None
    alpha = TR.spatial_weight(mixer, image_only_indicator, 3)
    return alpha.reshape(-1) if alpha.numel() in (1, rows) else None


def _geometry(conv: nn.Conv2d) -> tuple:
    return (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)


def _is_pointwise(conv: nn.Conv2d) -> bool:
    return _geometry(conv) == ((1, 1), (1, 1), (0, 0), (1, 1), 1, "zeros")


def _t2d_get_output_for_continuous_inputs(self, hidden_states, residual, batch_size, height, width, inner_dim):
    if _proj_out_fusable("Transformer2DModel", self.proj_out, residual):
        return proj_out_residual(self.proj_out, hidden_states, residual)
    keep_channels_last = residual.is_contiguous(memory_format=torch.channels_last)
    if not self.use_linear_projection:
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        if not keep_channels_last:
            hidden_states = hidden_states.contiguous()
        hidden_states = self.proj_out(hidden_states)
    else:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        if not keep_channels_last:
            hidden_states = hidden_states.contiguous()
    return hidden_states + residual


_T2D_METHODS = {
    "_operate_on_continuous_inputs": _t2d_operate_on_continuous_inputs,
    "_get_output_for_continuous_inputs": _t2d_get_output_for_continuous_inputs,
}


class Transformer2DInRule(ClassSwapRule):
    name = "transformer2d_in"
    family = "gn_conv"
    description = "Transformer2DModel: GroupNorm fused into proj_in's loads; channels-last kept on the way out"
    checked_in_forward = ("norm", "proj_in")

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        return (Transformer2DModel,)

    def match(self, site: Site) -> bool:
        m = site.module
        return bool(getattr(m, "is_input_continuous", False)) and type(m._modules.get("norm")) is nn.GroupNorm

    def reasons(self, site: Site) -> list[str]:
        m = site.module
        proj = m.proj_in
        if m.use_linear_projection:
            if type(proj) is not nn.Linear:
                return [f"proj_in is {type(proj).__name__}, not a plain nn.Linear (LoRA/quantized layers stay stock)"]
            return []
        if type(proj) is not nn.Conv2d:
            return [f"proj_in is {type(proj).__name__}, not a plain nn.Conv2d (LoRA/quantized layers stay stock)"]
        if not _is_pointwise(proj):
            return [f"proj_in is not a plain 1x1 convolution ({_geometry(proj)})"]
        return []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module, "norm": site.module.norm, "proj_in": site.module.proj_in}

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        return {"proj_out": site.module.proj_out}  # the residual in its epilogue (_proj_out_fusable, per call)

    def methods(self, site: Site):
        return _T2D_METHODS


def _svd_time_context(context: Tensor, batch: int, frames: int, pixels: int) -> Tensor:
    """The first frame's context of each video, one row per (video, pixel): what SVD's temporal blocks attend to."""
    first = context[None, :].reshape(batch, frames, -1, context.shape[-1])[:, 0]
    first = first[:, None].broadcast_to(batch, pixels, context.shape[-2], context.shape[-1])
    return first.reshape(batch * pixels, -1, context.shape[-1])


def _spatiotemporal_forward(
    self,
    hidden_states: Tensor,
    encoder_hidden_states: Tensor | None = None,
    image_only_indicator: Tensor | None = None,
    return_dict: bool = True,
):
    """``TransformerSpatioTemporalModel.forward`` with GroupNorm fused into proj_in and channels-last kept."""
    from diffusers.models.transformers.transformer_temporal import TransformerTemporalModelOutput

    if (
        encoder_hidden_states is None
        or image_only_indicator is None
        or not _norm_proj_in_readable(self, "TransformerSpatioTemporalModel")
    ):
        return stock(self)(hidden_states, encoder_hidden_states, image_only_indicator, return_dict)
    batch_frames, channels, height, width = hidden_states.shape
    num_frames = image_only_indicator.shape[-1]
    batch_size = batch_frames // num_frames
    time_context = _svd_time_context(encoder_hidden_states, batch_size, num_frames, height * width)
    residual = hidden_states
    h, eps, row_stats = _norm_proj_in(self, hidden_states, "TransformerSpatioTemporalModel.norm")
    hidden_states = h.permute(0, 2, 3, 1).reshape(batch_frames, height * width, h.shape[1])
    frame_index = torch.arange(num_frames, device=hidden_states.device).repeat(batch_size, 1).reshape(-1)
    emb = self.time_pos_embed(self.time_proj(frame_index).to(dtype=hidden_states.dtype))[:, None, :]
    pairs = list(zip(self.transformer_blocks, self.temporal_transformer_blocks, strict=True))
    fuse_out = _proj_out_fusable("TransformerSpatioTemporalModel", self.proj_out, residual)
    output = None
    handover.offer_layer_norm(hidden_states, self, eps, row_stats)  # for the first block's norm1, called next
    for i, (block, temporal_block) in enumerate(pairs):
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            hidden_states = self._gradient_checkpointing_func(block, hidden_states, None, encoder_hidden_states, None)
        else:
            hidden_states = block(hidden_states, encoder_hidden_states=encoder_hidden_states)
        mixed = temporal_block(hidden_states + emb, num_frames=num_frames, encoder_hidden_states=time_context)
        mix = _blend_weight(self.time_mixer, image_only_indicator, batch_frames) if i == len(pairs) - 1 else None
        if fuse_out and mix is not None:
            # The last blend is read by proj_out's loads: neither it nor its products are written.
            output = _proj_out_residual(self.proj_out, (hidden_states, mixed), residual, mix)
            break
        hidden_states = self.time_mixer(
            x_spatial=hidden_states, x_temporal=mixed, image_only_indicator=image_only_indicator
        )
    if output is None and fuse_out:
        output = _proj_out_residual(self.proj_out, hidden_states, residual)
    if output is None:
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_frames, height, width, channels).permute(0, 3, 1, 2)
        if not residual.is_contiguous(memory_format=torch.channels_last):
            hidden_states = hidden_states.contiguous()
        output = hidden_states + residual
    return TransformerTemporalModelOutput(sample=output) if return_dict else (output,)


class SpatioTemporalInRule(ClassSwapRule):
    name = "spatiotemporal_in"
    family = "gn_conv"
    description = "SVD TransformerSpatioTemporalModel: GroupNorm fused into proj_in's loads; channels-last kept"
    checked_in_forward = ("norm", "proj_in")

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

        return (TransformerSpatioTemporalModel,)

    def reasons(self, site: Site) -> list[str]:
        m = site.module
        reasons = []
        if type(m.norm) is not nn.GroupNorm or not m.norm.affine:
            reasons.append(f"norm is {type(m.norm).__name__}, not an affine nn.GroupNorm")
        for name in ("proj_in", "proj_out"):
            if type(getattr(m, name)) is not nn.Linear:
                reasons.append(f"{name} is {type(getattr(m, name)).__name__}, not a plain nn.Linear")
        return reasons

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module, "norm": site.module.norm, "proj_in": site.module.proj_in}

    def methods(self, site: Site):
        return _spatiotemporal_forward


def _spatiotemporal_resblock_forward(self, hidden_states, temb=None, image_only_indicator=None):
    return TR.fused_spatiotemporal_forward(self, hidden_states, temb, image_only_indicator)


class SpatioTemporalResBlockRule(ClassSwapRule):
    name = "spatiotemporal_resnet"
    family = "gn_conv"
    description = (
        "SpatioTemporalResBlock: temporal resnet as two (3,1) convs with GN+SiLU in the loads, per-frame temb and the "
        "AlphaBlender mix in the epilogues; channels-last kept"
    )

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.resnet import SpatioTemporalResBlock

        return (SpatioTemporalResBlock,)

    def reasons(self, site: Site) -> list[str]:
        return TR.spatiotemporal_reasons(site.module)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        temporal = site.module.temporal_res_block
        bypassed = {f"temporal_res_block.{k}": getattr(temporal, k, None) for k in _TEMPORAL_BYPASSED}
        return {
            "": site.module,
            "temporal_res_block": temporal,
            "time_mixer": site.module.time_mixer,
            **{k: v for k, v in bypassed.items() if isinstance(v, nn.Module)},
        }

    def shallow(self, site: Site) -> set[str]:
        # The spatial resnet and time_emb_proj still run as modules (and are checked by their own rules/calls).
        return {"", "temporal_res_block"}

    def methods(self, site: Site):
        return _spatiotemporal_resblock_forward


# nonlinearity still runs on temb, but not on the main path (its hooks would be skipped there).
_TEMPORAL_BYPASSED = ("norm1", "conv1", "norm2", "conv2", "dropout", "conv_shortcut", "nonlinearity")


def _temporal_conv_forward(self, hidden_states, num_frames=1):
    return TR.fused_temporal_conv_forward(self, hidden_states, num_frames)


class TemporalConvLayerRule(ClassSwapRule):
    name = "temporal_conv"
    family = "gn_conv"
    description = "TemporalConvLayer: four (3,1) convs with GN+SiLU in the loads and the identity in the last epilogue"

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.resnet import TemporalConvLayer

        return (TemporalConvLayer,)

    def reasons(self, site: Site) -> list[str]:
        return TR.temporal_conv_reasons(site.module)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        # Every stage and its children: the walk visits what is not listed (their GroupNorm would be patched again).
        stages = {k: getattr(site.module, k) for k in ("conv1", "conv2", "conv3", "conv4")}
        children = {f"{k}.{i}": m for k, seq in stages.items() for i, m in seq._modules.items()}
        return {"": site.module, **stages, **children}

    def methods(self, site: Site):
        return _temporal_conv_forward


RULES: list[Rule] = [
    ResnetBlockRule(),
    Transformer2DInRule(),
    SpatioTemporalInRule(),
    SpatioTemporalResBlockRule(),
    TemporalConvLayerRule(),
]
