"""Tiny random-weight models of every family ldmopt.patch covers, built from configs (no downloads)."""

from __future__ import annotations

import torch

TINY_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    norm_num_groups=8,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
)


def sd15_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**TINY_UNET)


def sd21_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**{**TINY_UNET, "use_linear_projection": True, "upcast_attention": True})


def sdxl_unet():
    from diffusers import UNet2DConditionModel

    cfg = {
        **TINY_UNET,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "use_linear_projection": True,
        "transformer_layers_per_block": (1, 2),
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 8 * 6 + 32,
    }
    return UNet2DConditionModel(**cfg)


def vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16),
        norm_num_groups=4,
        latent_channels=4,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        sample_size=16,
    )


def dit():
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=10, norm_num_groups=4,
    )  # fmt: skip


def pixart():
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=16, norm_num_groups=4,
    )  # fmt: skip


def sd3():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16,
    )  # fmt: skip


def sd35():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    )  # fmt: skip


def flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip


def animatediff():
    from diffusers import MotionAdapter, UNet2DConditionModel, UNetMotionModel

    unet = UNet2DConditionModel(
        **{
            **TINY_UNET,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        }
    )
    adapter = MotionAdapter(
        block_out_channels=(32, 64), motion_layers_per_block=1, motion_norm_num_groups=8,
        motion_num_attention_heads=2, motion_max_seq_length=8,
    )  # fmt: skip
    return UNetMotionModel.from_unet2d(unet, adapter)


def svd():
    from diffusers import UNetSpatioTemporalConditionModel

    return UNetSpatioTemporalConditionModel(
        sample_size=8, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=32, num_attention_heads=(2, 4), addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=12, num_frames=3,
    )  # fmt: skip


def modelscope():
    from diffusers import UNet3DConditionModel

    return UNet3DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"), up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8,
    )  # fmt: skip


def latte():
    from diffusers import LatteTransformer3DModel

    return LatteTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=16, video_length=3,
    )  # fmt: skip


def inputs(family: str, model, batch: int = 2, frames: int = 3) -> dict:
    """Keyword arguments for one forward call of a tiny model (random, on the model's device and dtype)."""
    p = next(model.parameters())
    kw = dict(device=p.device, dtype=p.dtype)
    t = torch.tensor([10] * batch, device=p.device)
    if family in ("sd15", "sd21"):
        return dict(
            sample=torch.randn(batch, 4, 8, 8, **kw), timestep=t, encoder_hidden_states=torch.randn(batch, 5, 32, **kw)
        )
    if family == "sdxl":
        cond = dict(text_embeds=torch.randn(batch, 32, **kw), time_ids=torch.randn(batch, 6, **kw))
        return dict(
            sample=torch.randn(batch, 4, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 5, 32, **kw),
            added_cond_kwargs=cond,
        )
    if family == "vae":
        return dict(sample=torch.randn(batch, 3, 16, 16, **kw))
    if family == "dit":
        return dict(
            hidden_states=torch.randn(batch, 4, 8, 8, **kw),
            timestep=t,
            class_labels=torch.tensor([1] * batch, device=p.device),
        )
    if family == "pixart":
        cond = dict(resolution=None, aspect_ratio=None)
        return dict(
            hidden_states=torch.randn(batch, 4, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 5, 16, **kw),
            added_cond_kwargs=cond,
        )
    if family == "sd3":
        return dict(
            hidden_states=torch.randn(batch, 4, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 5, 16, **kw),
            pooled_projections=torch.randn(batch, 16, **kw),
        )
    if family == "flux":
        grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
        img_ids = torch.stack(grid, -1).reshape(-1, 3).to(p.device)
        return dict(
            hidden_states=torch.randn(batch, 16, 8, **kw), encoder_hidden_states=torch.randn(batch, 5, 16, **kw),
            pooled_projections=torch.randn(batch, 16, **kw), timestep=t.to(p.dtype) / 1000, img_ids=img_ids,
            txt_ids=torch.zeros(5, 3, device=p.device),
        )  # fmt: skip
    if family == "animatediff":  # the AnimateDiff pipeline repeats the prompt per frame before the UNet
        return dict(
            sample=torch.randn(batch, 4, frames, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch * frames, 5, 32, **kw),
        )
    if family == "modelscope":
        return dict(
            sample=torch.randn(batch, 4, frames, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 5, 32, **kw),
        )
    if family == "svd":
        return dict(
            sample=torch.randn(batch, frames, 8, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 1, 32, **kw),
            added_time_ids=torch.randn(batch, 3, **kw),
        )
    if family == "latte":
        return dict(
            hidden_states=torch.randn(batch, 4, frames, 8, 8, **kw),
            timestep=t,
            encoder_hidden_states=torch.randn(batch, 5, 16, **kw),
            enable_temporal_attentions=True,
        )
    raise KeyError(family)


BUILDERS = {
    "sd15": sd15_unet,
    "sd21": sd21_unet,
    "sdxl": sdxl_unet,
    "vae": vae,
    "dit": dit,
    "pixart": pixart,
    "sd3": sd3,
    "flux": flux,
    "animatediff": animatediff,
    "svd": svd,
    "modelscope": modelscope,
    "latte": latte,
}
