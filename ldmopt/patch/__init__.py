"""``ldmopt.patch(pipe)`` / ``ldmopt.unpatch(pipe)``: drop ldmopt's fused kernels into diffusers models, reversibly.

A table of rules keyed by module class (:func:`rule_table`); each rule matches instances, says why one must stay on
the stock path, replaces and restores. ``patch`` returns a :class:`PatchReport`. ``tune(pipe, run)`` patches only the
modules whose fused forward measured faster than the stock one while ``run()`` ran (tune.py). Families
(``families=``) and rules:

| family             | rule                | keyed by (diffusers 0.42)                    | fused                     |
|--------------------|---------------------|----------------------------------------------|---------------------------|
| gn_conv            | resnet              | ResnetBlock2D                                | GN+SiLU in conv loads     |
| gn_conv            | transformer2d_in    | Transformer2DModel (continuous input)        | GN in proj_in's loads     |
| gn_conv            | spatiotemporal_in   | TransformerSpatioTemporalModel (SVD)         | GN in proj_in's loads     |
| gn_conv            | spatiotemporal_     | SpatioTemporalResBlock (SVD UNet and VAE     | temporal resnet: GN+SiLU  |
|                    | resnet              | decoder)                                     | in (3,1) conv loads, temb |
|                    |                     |                                              | per frame, alpha blend in |
|                    |                     |                                              | the epilogue              |
| gn_conv            | temporal_conv       | TemporalConvLayer (UNet3D: ModelScope)       | four (3,1) fused convs    |
| gn_conv            | up_block_skip       | the UNet up blocks (SD, SDXL, AnimateDiff,   | resnets read cat([hidden, |
|                    |                     | ModelScope, SVD)                             | skip]) in place           |
| gn_conv            | upsample_conv       | Upsample2D (UNet up blocks, VAE decoders)    | nearest 2x in conv loads  |
| gn_conv            | downsample_conv     | Downsample2D (UNet down blocks; 3x3, pad 1)  | output GroupNorm stats /  |
|                    |                     |                                              | channel sums in epilogue  |
| group_norm         | group_norm_silu     | VAE encoders/decoders (also SVD, Allegro,    | conv_norm_out + conv_act  |
|                    |                     | HunyuanVideo), the UNets' output head        |                           |
| group_norm         | group_norm_silu_seq | nn.Sequential (GroupNorm, SiLU)              | GN+SiLU in one pass       |
| group_norm         | group_norm          | nn.GroupNorm anywhere else                   | ldmopt GroupNorm kernel   |
| feed_forward       | geglu / gelu        | GEGLU / GELU                                 | GEGLU/GELU GEMM epilogue  |
| feed_forward       | flux_mlp            | FluxSingleTransformerBlock and look-alikes   | proj_mlp + GELU(tanh)     |
|                    |                     | (Chroma, HunyuanVideo, HunyuanImage, Bria,   |                           |
|                    |                     | LongCat, Motif)                              |                           |
| adaln              | adaln_zero(_single) | AdaLayerNormZero, -ZeroSingle                | LayerNorm + modulation    |
| adaln              | adaln_continuous    | AdaLayerNormContinuous                       | LayerNorm + modulation    |
| adaln              | adaln_block         | BasicTransformerBlock (ada_norm_zero/single: | LN+modulation; attention  |
|                    |                     | DiT, PixArt, Latte)                          | and FF (gated) residuals  |
|                    |                     |                                              | in the output GEMMs       |
| adaln              | joint_block         | JointTransformerBlock, FluxTransformerBlock  | per stream: gated update  |
|                    |                     |                                              | + LN + modulation in one  |
|                    |                     |                                              | row kernel; FF gated      |
|                    |                     |                                              | residual in its GEMM      |
| adaln              | flux_single_gated   | FluxSingleTransformerBlock                   | gated residual + fp16 clip|
|                    |                     |                                              | in proj_out; its input    |
|                    |                     |                                              | halves read in place      |
| residual           | residual_block      | BasicTransformerBlock (layer_norm: SD1.5,    | attention and FF residual |
|                    |                     | SDXL, SVD, AnimateDiff, ModelScope UNets)    | adds in the output GEMMs' |
|                    |                     |                                              | epilogues                 |
| adaln              | wan_block           | WanTransformerBlock (Wan 2.1/2.2, VACE,      | fp32 gated adds + norms + |
|                    |                     | Animate, ChronoEdit), SkyReelsV2 block       | modulation in 3 row       |
|                    |                     |                                              | kernels; FF out GEMM with |
|                    |                     |                                              | fp32 gate + residual      |
| rms_norm           | rms_norm            | diffusers RMSNorm (q/k norms of SD3.5,       | one row kernel, fp32      |
|                    |                     | HunyuanVideo, LTX, CogView4, Qwen-Image ...; | statistics and affine     |
|                    |                     | torch.nn.RMSNorm is fused by torch already)  |                           |
| rms_norm           | wan_qk_norm_rope    | WanAttention (self-attention), SkyReelsV2    | q/k RMSNorm + RoPE in one |
|                    |                     | Attention; the stock processor's own steps   | row kernel each           |
| rms_norm           | flux_qk_norm_rope   | FluxAttention (Flux.1, Chroma); the stock    | per-head q/k RMSNorm +    |
|                    |                     | processor's own steps                        | RoPE + the text/image     |
|                    |                     |                                              | join, one kernel a tensor |
| rms_norm           | qwen_qk_norm_rope   | Attention with Qwen-Image's double-stream    | the same, complex tables  |
|                    |                     | processor                                    | read as cos/sin views     |
| rms_norm           | hunyuan_video_qk_   | Attention with HunyuanVideo's processor      | per-head q/k RMSNorm; the |
|                    | norm_rope           | (with q/k norms)                             | video tokens' RoPE in it  |
| rms_norm           | cogvideox_qk_norm_  | Attention with CogVideoX's processor         | per-head q/k LayerNorm;   |
|                    | rope                | (CogVideoX, CogView3-Plus, ConsisID)         | the video tokens' RoPE    |
| rms_norm           | hunyuan_dit_qk_     | Attention with HunyuanDiT's processor        | per-head q/k LayerNorm +  |
|                    | norm_rope           |                                              | RoPE in one kernel each   |
| rms_norm           | ltx_qk_norm_rope    | LTXAttention (LTX-Video); the stock          | q/k RMSNorm across heads  |
|                    |                     | processor's own steps                        | + RoPE, one kernel each   |
| temporal_layout    | temporal_container  | AnimateDiffTransformer3D,                    | whole temporal transformer|
|                    |                     | TransformerTemporalModel (UNet3D)            | in (B, F, N, C) order     |
| temporal_layout    | svd_temporal_block  | TemporalBasicTransformerBlock (SVD)          | the same, one block       |
| temporal_layout    | latte_temporal      | LatteTransformer3DModel                      | temporal blocks on the    |
|                    |                     |                                              | spatial blocks' tokens    |
| temporal_attention | temporal_attention  | Attention over frames not claimed above      | strided temporal kernel   |
|                    |                     | (with temporal_layout off, or refused there) | (attention processor)     |
| svd_attn2          | svd_attn2           | Attention over SVD's one context token       | single-key shortcut       |
"""

import inspect
import sys
import types

from .core import FAMILIES, PatchError, is_patched, patch, rule_table, unpatch
from .report import PatchReport
from .tune import tune
from .tune_choice import patch_tuned
from .weight_layout import match_optimizer_layout

__all__ = [
    "FAMILIES",
    "PatchError",
    "PatchReport",
    "is_patched",
    "match_optimizer_layout",
    "patch",
    "patch_tuned",
    "rule_table",
    "tune",
    "unpatch",
]


class _CallablePackage(types.ModuleType):
    # Importing this package sets the attribute `ldmopt.patch` to the package itself, shadowing the function that
    # ldmopt/__init__.py exposes under the same name; calling the package calls the function, so both spellings work.
    def __call__(self, *args, **kwargs) -> PatchReport:
        return patch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
__signature__ = inspect.signature(patch)  # what inspect.signature / help() show for the callable package
