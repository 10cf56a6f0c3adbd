"""Diffusers architectures the rules were not written for, patched whole: tiny random models of about twenty of them.

The rules match structures (a ResnetBlock2D, a BasicTransformerBlock, an adaLN-Zero norm, a Wan block, ...), not
model classes, so they also fire inside models nobody wrote them for: PriorTransformer, ControlNet, ControlNet-XS,
SparseControlNet, I2VGen-XL, ConsisID, CogView3-Plus, AuraFlow, Mochi, Wan-VACE, the SD3 and Flux ControlNets, VQModel
and the DDPM UNet2DModel. There a fused module must compute what the stock one did, in whatever context the model
calls it. Other models hold near-misses that must stay stock, each skip with its reason (scale-shift time embedding,
GELU resnets, FIR up/down sampling), and some hold nothing a rule matches (Stable Audio, Stable Cascade, HiDream, the
Wan/Qwen-Image VAEs, the tiny autoencoder), where patch must change nothing and not raise.

Each case: eval mode, norm weights and zero-initialised layers drawn random (a norm of ones or a zero gate hides a
wrong weight), fresh random inputs; the output stock, patched (reference backend, fp32 tolerance: only the
summation order differs) and after unpatch, which must restore modules, processors, parameters, state_dict and the
output exactly. The replacement counts are pinned: a rule that stops matching in one of these models fails here.
Training: for four of them, patch(training=True) must give the stock model's parameter gradients. The Triton
kernels run on three models' shapes too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import ldmopt
from tests.patch.helpers import (
    ATOL_TRITON,
    RTOL_TRITON,
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
)

diffusers = pytest.importorskip("diffusers")
R = torch.randn


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


def _flat(tensors) -> torch.Tensor:
    """One tensor of a model's outputs (ControlNets return lists of residuals)."""
    return torch.cat([t.reshape(-1) for t in tensors])


# Builders: each returns the model and ``call(model) -> tensor``, its inputs drawn once (from the per-test seed).


def _prior():
    model = diffusers.PriorTransformer(
        num_attention_heads=2, attention_head_dim=8, num_layers=2, embedding_dim=16, num_embeddings=4,
        additional_embeddings=4,
    )  # fmt: skip
    kw = dict(
        hidden_states=R(2, 16), timestep=torch.tensor([10, 5]), proj_embedding=R(2, 16),
        encoder_hidden_states=R(2, 4, 16), attention_mask=torch.ones(2, 4),
    )  # fmt: skip
    return model, lambda m: m(**kw).predicted_image_embedding


def _controlnet():
    model = diffusers.ControlNetModel(
        block_out_channels=(32, 64), layers_per_block=1, in_channels=4, cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), norm_num_groups=8,
        conditioning_embedding_out_channels=(8, 16),
    )  # fmt: skip
    kw = dict(
        sample=R(2, 4, 8, 8), timestep=torch.tensor([10, 500]), encoder_hidden_states=R(2, 5, 32),
        controlnet_cond=R(2, 3, 16, 16), return_dict=False,
    )  # fmt: skip
    return model, _down_and_mid(kw)


def _down_and_mid(kw: dict) -> Callable:
    """A ControlNet's call: its down and mid residuals as one flat tensor."""

    def call(m):
        down, mid = m(**kw)
        return _flat([*down, mid])

    return call


def _controlnet_xs():
    model = diffusers.UNetControlNetXSModel(
        sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), norm_num_groups=8,
        cross_attention_dim=32, transformer_layers_per_block=1, num_attention_heads=2, ctrl_block_out_channels=(4, 8),
        ctrl_num_attention_heads=2, ctrl_max_norm_num_groups=2, ctrl_conditioning_embedding_out_channels=(2, 2),
        time_embedding_mix=0.5, ctrl_learn_time_embedding=True,
    )  # fmt: skip
    kw = dict(
        sample=R(2, 4, 8, 8), timestep=torch.tensor([10, 500]), encoder_hidden_states=R(2, 5, 32),
        controlnet_cond=R(2, 3, 16, 16), conditioning_scale=0.8,
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _sparse_controlnet():
    model = diffusers.SparseControlNetModel(
        in_channels=4, conditioning_channels=4, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8, conditioning_embedding_out_channels=(8, 16), motion_max_seq_length=8,
        motion_num_attention_heads=2,
    )  # fmt: skip
    kw = dict(
        sample=R(1, 4, 3, 8, 8), timestep=torch.tensor([10]), encoder_hidden_states=R(3, 5, 32),
        controlnet_cond=R(1, 4, 3, 8, 8), conditioning_mask=torch.ones(1, 1, 3, 8, 8), return_dict=False,
    )  # fmt: skip
    return model, _down_and_mid(kw)


def _i2vgenxl():
    model = diffusers.I2VGenXLUNet(
        sample_size=None, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8, num_attention_heads=None,
    )  # fmt: skip
    kw = dict(
        sample=R(1, 4, 2, 8, 8), timestep=torch.tensor([10]), fps=torch.tensor([16]), image_latents=R(1, 4, 2, 8, 8),
        image_embeddings=R(1, 32), encoder_hidden_states=R(1, 5, 32),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _consisid():
    model = diffusers.ConsisIDTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2, text_embed_dim=8,
        num_layers=1, sample_width=8, sample_height=8, sample_frames=8, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=8, cross_attn_interval=1, is_kps=False, is_train_face=True, cross_attn_dim_head=1,
        cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2,
        LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10, LFE_ff_mult=1, LFE_num_scale=1,
        use_rotary_positional_embeddings=True,
    )  # fmt: skip
    angles = R(2 * 4 * 4, 4).repeat_interleave(2, -1)  # 2 frames x (8 x 8) / 2x2 patches: 32 video tokens
    kw = dict(
        hidden_states=R(2, 2, 4, 8, 8), encoder_hidden_states=R(2, 8, 8), timestep=torch.tensor([10, 500]),
        image_rotary_emb=(angles.cos(), angles.sin()), id_vit_hidden=[R(2, 2, 2)], id_cond=R(2, 2),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _cogview3plus():
    model = diffusers.CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=2, out_channels=4,
        text_embed_dim=8, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8, sample_size=8,
    )  # fmt: skip
    kw = dict(
        hidden_states=R(2, 4, 8, 8), encoder_hidden_states=R(2, 5, 8), original_size=R(2, 2), target_size=R(2, 2),
        crop_coords=R(2, 2), timestep=torch.tensor([10, 500]),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _auraflow():
    model = diffusers.AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
        pos_embed_max_size=64,
    )  # fmt: skip
    kw = dict(hidden_states=R(2, 4, 8, 8), encoder_hidden_states=R(2, 5, 16), timestep=_t(0.3, 0.7))
    return model, lambda m: output_tensor(m(**kw))


def _mochi():
    model = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=4, max_sequence_length=16,
    )  # fmt: skip
    kw = dict(
        hidden_states=R(2, 4, 2, 8, 8), encoder_hidden_states=R(2, 5, 16), timestep=torch.tensor([10, 500]),
        encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _wan_vace():
    model = diffusers.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=12,
    )  # fmt: skip
    kw = dict(
        hidden_states=R(1, 4, 2, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=R(1, 5, 16),
        control_hidden_states=R(1, 12, 2, 8, 8), control_hidden_states_scale=_t(0.7, 1.3),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _sd3_controlnet():
    model = diffusers.SD3ControlNetModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16,
    )  # fmt: skip
    kw = dict(
        hidden_states=R(2, 4, 8, 8), controlnet_cond=R(2, 4, 8, 8), encoder_hidden_states=R(2, 5, 16),
        pooled_projections=R(2, 16), timestep=torch.tensor([10, 500]), return_dict=False,
    )  # fmt: skip
    return model, lambda m: _flat(m(**kw)[0])


def _flux_controlnet():
    model = diffusers.FluxControlNetModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=[2, 2, 4],
    )  # fmt: skip
    kw = dict(
        hidden_states=R(2, 16, 8), controlnet_cond=R(2, 16, 8), encoder_hidden_states=R(2, 5, 16),
        pooled_projections=R(2, 16), timestep=_t(0.3, 0.7), img_ids=R(16, 3), txt_ids=R(5, 3), return_dict=False,
    )  # fmt: skip

    def call(m):
        blocks, single = m(**kw)
        return _flat([*blocks, *single])

    return model, call


def _vq(norm_type, channels):
    def build():
        model = diffusers.VQModel(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=channels, layers_per_block=1,
            latent_channels=4, norm_num_groups=8, num_vq_embeddings=16, vq_embed_dim=4, norm_type=norm_type,
            sample_size=16,
        )  # fmt: skip
        x = R(2, 3, 16, 16)
        return model, lambda m: output_tensor(m(x))

    return build


def _unet2d(**config):
    def build():
        base = dict(
            sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
            norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8,
        )  # fmt: skip
        model = diffusers.UNet2DModel(**{**base, **config})
        x, t = R(2, 3, 16, 16), _t(10, 500)
        return model, lambda m: output_tensor(m(x, t))

    return build


def _if_like_unet():
    # DeepFloyd IF's UNet: SimpleCrossAttn blocks, scale-shift time embedding, GELU resnets, text + class embeddings.
    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=6, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8, encoder_hid_dim=16, addition_embed_type="text", addition_embed_type_num_heads=2,
        resnet_time_scale_shift="scale_shift", act_fn="gelu", class_embed_type="timestep", mid_block_scale_factor=1.414,
    )  # fmt: skip
    kw = dict(
        sample=R(2, 3, 8, 8), timestep=torch.tensor([10, 500]), encoder_hidden_states=R(2, 5, 16),
        class_labels=torch.tensor([3, 900]),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _stable_audio():
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    model = diffusers.StableAudioDiTModel(
        sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4, num_attention_heads=2,
        num_key_value_attention_heads=2, out_channels=3, cross_attention_dim=4, time_proj_dim=8,
        global_states_input_dim=8, cross_attention_input_dim=4,
    )  # fmt: skip
    rotary = get_1d_rotary_pos_embed(2, 4 + 1, use_real=True, repeat_interleave_real=False)
    kw = dict(
        hidden_states=R(2, 3, 4), timestep=torch.tensor([10, 500]), encoder_hidden_states=R(2, 5, 4),
        global_hidden_states=R(2, 1, 8), rotary_embedding=rotary,
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _stable_cascade():
    model = diffusers.StableCascadeUNet(
        in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, patch_size=1, conditioning_dim=32,
        block_out_channels=(32, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1), clip_text_pooled_in_channels=16, clip_text_in_channels=16,
        clip_image_in_channels=16, clip_seq=2, dropout=(0.0, 0.0), switch_level=(False,),
        timestep_conditioning_type=("sca",), self_attn=True,
        block_types_per_layer=(("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),) * 2,
    )  # fmt: skip
    kw = dict(
        sample=R(2, 4, 8, 8), timestep_ratio=_t(0.3, 0.7), clip_text_pooled=R(2, 1, 16), clip_text=R(2, 3, 16),
        clip_img=R(2, 1, 16),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _hidream():
    model = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2, num_activated_experts=2,
        axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
    )  # fmt: skip
    kw = dict(
        hidden_states=R(1, 4, 8, 8), encoder_hidden_states_t5=R(1, 6, 8), encoder_hidden_states_llama3=R(2, 1, 6, 4),
        pooled_embeds=R(1, 8), timesteps=torch.tensor([10]),
    )  # fmt: skip
    return model, lambda m: output_tensor(m(**kw))


def _wan_vae():
    model = diffusers.AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False]
    )
    x = R(1, 3, 5, 8, 8)
    return model, lambda m: output_tensor(m(x))


def _qwen_image_vae():
    model = diffusers.AutoencoderKLQwenImage(
        base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False]
    )
    x = R(1, 3, 1, 8, 8)
    return model, lambda m: output_tensor(m(x))


def _tiny_autoencoder():
    model = diffusers.AutoencoderTiny(
        in_channels=3, out_channels=3, encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4,
    )  # fmt: skip
    x = R(2, 3, 16, 16)
    return model, lambda m: output_tensor(m(x))


@dataclass(frozen=True)
class Case:
    build: Callable
    #: {rule: modules replaced}, each must match (rules not named here may fire too).
    rules: dict[str, int]
    #: ``report.skipped_counts()`` exactly.
    skipped: dict[str, int] = field(default_factory=dict)
    #: {rule: text every reason list of that rule's skips must contain}.
    reasons: dict[str, tuple[str, ...]] = field(default_factory=dict)


I2VGEN_XL_RULES = dict(
    geglu=9, gelu=1, group_norm=1, residual_block=4, resnet=8, temporal_container=5, temporal_conv=8,
    transformer2d_in=4, up_block_skip=2, upsample_conv=1,
)  # fmt: skip
FLUX_CONTROLNET_RULES = dict(
    adaln_zero=2, adaln_zero_single=1, flux_mlp=1, flux_qk_norm_rope=2, flux_single_gated=1, gelu=2, joint_block=1
)  # fmt: skip
_unet2d_fir = _unet2d(  # score-SDE (NCSN++) blocks: FIR-kernel up/down sampling
    block_out_channels=(32, 32), norm_num_groups=8, down_block_types=("SkipDownBlock2D", "AttnSkipDownBlock2D"),
    up_block_types=("AttnSkipUpBlock2D", "SkipUpBlock2D"), time_embedding_type="fourier", mid_block_scale_factor=1.414,
)  # fmt: skip

#: Rules firing where they were not written for; nothing left stock.
FIRING = {
    "prior-transformer": Case(_prior, {"gelu": 2, "residual_block": 2}),
    "controlnet": Case(_controlnet, {"resnet": 4, "residual_block": 2, "geglu": 2, "transformer2d_in": 2}),
    "controlnet-xs": Case(
        _controlnet_xs,
        {"geglu": 9, "group_norm": 1, "residual_block": 9, "resnet": 18, "transformer2d_in": 9, "upsample_conv": 1},
    ),
    "sparse-controlnet": Case(
        _sparse_controlnet,
        {"geglu": 4, "residual_block": 2, "resnet": 4, "temporal_container": 2, "transformer2d_in": 2},
    ),
    "i2vgen-xl": Case(_i2vgenxl, I2VGEN_XL_RULES),
    "consisid": Case(_consisid, {"cogvideox_qk_norm_rope": 1, "gelu": 1}),
    "cogview3-plus": Case(_cogview3plus, {"adaln_continuous": 1, "cogvideox_qk_norm_rope": 1, "gelu": 1}),
    "auraflow": Case(_auraflow, {"adaln_zero": 3}),
    "mochi": Case(_mochi, {"adaln_continuous": 1, "rms_norm": 14}),
    "wan-vace": Case(_wan_vace, {"gelu": 5, "wan_block": 3, "wan_qk_norm_rope": 5}),
    "sd3-controlnet": Case(_sd3_controlnet, {"adaln_zero": 4, "gelu": 4, "joint_block": 2}),
    "flux-controlnet": Case(_flux_controlnet, FLUX_CONTROLNET_RULES),
    "vqmodel": Case(_vq("group", (16, 32)), {"group_norm": 2, "group_norm_silu": 2, "resnet": 10, "upsample_conv": 1}),
    # SpatialNorm (MoVQ's decoder) has 32 groups, hence the wider channels.
    "vqmodel-spatial-norm": Case(
        _vq("spatial", (32, 64)), {"group_norm": 15, "group_norm_silu": 1, "resnet": 4, "upsample_conv": 1}
    ),
    "unet2d-ddpm": Case(
        _unet2d(), {"group_norm": 4, "group_norm_silu": 1, "resnet": 8, "up_block_skip": 1, "upsample_conv": 1}
    ),
}

SCALE_SHIFT = "time_embedding_norm='scale_shift' (only 'default' is fused)"
#: Near-misses: what must stay stock, and why.
SKIPPING = {
    "unet2d-scale-shift": Case(
        _unet2d(resnet_time_scale_shift="scale_shift"),
        {"group_norm": 19, "group_norm_silu": 1, "upsample_conv": 1},
        skipped={"resnet": 8, "up_block_skip": 1},
        reasons={"resnet": (SCALE_SHIFT,), "up_block_skip": ("none of its resnets can run fused",)},
    ),
    "if-like-unet": Case(
        _if_like_unet,
        {"group_norm": 25},
        skipped={"resnet": 10},
        reasons={"resnet": (SCALE_SHIFT, "nonlinearity GELU (only SiLU/swish is fused)")},
    ),
    "unet2d-fir": Case(
        _unet2d_fir,
        {"group_norm": 8, "group_norm_silu": 1, "resnet": 8},
        skipped={"resnet": 2},
        reasons={"resnet": ("(kernel='fir'?)",)},
    ),
}

#: Nothing a rule matches.
UNTOUCHED = {
    "stable-audio-dit": _stable_audio,
    "stable-cascade-unet": _stable_cascade,
    "hidream": _hidream,
    "wan-vae": _wan_vae,
    "qwen-image-vae": _qwen_image_vae,
    "autoencoder-tiny": _tiny_autoencoder,
}


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode, its norm weights drawn around 1 and their biases around 0, zero-initialised tensors
    (output projections, gates, ControlNet zero convs) drawn small: no wrong weight or missing term can hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif "norm" in name and p.dim() == 1 and name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif not p.any():
                p.normal_(std=0.05)
    return model.eval()


def _patched_matches_stock_and_unpatches(build, name):
    """Stock output, patch, patched output within fp32 tolerance (reference backend), every skip with a reason,
    unpatch exact. Returns the report, and its backend and fall-back counts read after the patched call."""
    model, call = build()
    model = _randomized(model)
    with torch.no_grad():
        ref = call(model)
    before = snapshot(model)
    report = ldmopt.patch(model)
    for skip in report.skipped:
        assert skip.reasons and all(r.strip() for r in skip.reasons), f"{skip.where} [{skip.rule}] has no reason"
    with torch.no_grad(), ldmopt.use_backend("torch"):
        got = call(model)
    assert_outputs_close(got, ref, name=name)
    ran, fell_back = report.backends(), report.fallbacks()
    ldmopt.unpatch(model)
    assert not ldmopt.is_patched(model)
    assert_same_snapshot(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(call(model), ref), f"{name}: output after unpatch differs from stock"
    return report, ran, fell_back


def _assert_counts(report, case: Case) -> None:
    counts = report.counts()
    assert {rule: counts.get(rule, 0) for rule in case.rules} == case.rules, str(report)
    assert report.skipped_counts() == case.skipped, str(report)


@pytest.mark.parametrize("name", list(FIRING))
def test_rules_fire_on_other_architectures(name):
    case = FIRING[name]
    report, ran, fell_back = _patched_matches_stock_and_unpatches(case.build, name)
    _assert_counts(report, case)
    # The fused ops ran, on the backend asked for, and no patched module took its stock path.
    assert ran and all(set(b) == {"torch"} for b in ran.values()), ran
    assert not fell_back, fell_back


@pytest.mark.parametrize("name", list(SKIPPING))
def test_near_misses_stay_stock_with_their_reason(name):
    case = SKIPPING[name]
    report, _, fell_back = _patched_matches_stock_and_unpatches(case.build, name)
    _assert_counts(report, case)
    assert not fell_back, fell_back
    for skip in report.skipped:
        for text in case.reasons[skip.rule]:
            assert any(text in r for r in skip.reasons), f"{skip.where} [{skip.rule}]: {skip.reasons}"


@pytest.mark.parametrize("name", list(UNTOUCHED))
def test_nothing_to_patch(name):
    report, ran, fell_back = _patched_matches_stock_and_unpatches(UNTOUCHED[name], name)
    assert report.total == 0 and not report.skipped, str(report)
    assert not ran and not fell_back, (ran, fell_back)


def _parameter_grads(model, call, weight) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (call(model) * weight).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "name, rules",
    [
        ("prior-transformer", {"residual_block": 2}),
        ("cogview3-plus", {"adaln_continuous": 1, "cogvideox_qk_norm_rope": 1}),
        ("wan-vace", {"wan_block": 3, "wan_qk_norm_rope": 5}),
        ("sparse-controlnet", {"resnet": 4, "temporal_container": 2}),
    ],
)
def test_training_gradients_match_stock(name, rules):
    model, call = FIRING[name].build()
    model = _randomized(model).train()  # none of these has a dropout with p > 0: both runs compute one function
    with torch.no_grad():
        weight = torch.randn_like(call(model))
    expect = _parameter_grads(model, call, weight)
    report = ldmopt.patch(model, training=True)
    assert {rule: report.counts().get(rule, 0) for rule in rules} == rules, str(report)
    with ldmopt.use_backend("torch"):
        got = _parameter_grads(model, call, weight)
    assert not report.fallbacks(), report.fallbacks()
    assert any(op.endswith("_backward") for op in report.backends()), report.backends()  # ldmopt's backwards ran
    assert got.keys() == expect.keys()
    # Relative to the largest gradient of all, not per tensor: some are zero up to rounding (the key projection's
    # bias: softmax is invariant to a shift of every score by the same amount), and there only the rounding differs.
    # Seen over four seeds: at most 1.2e-6 of it (SparseControlNet).
    scale = max(g.abs().max().item() for g in expect.values())
    for param, g in got.items():
        err = (g.double() - expect[param].double()).abs().max().item()
        assert err <= 2e-5 * scale, f"{name} grad {param}: error {err:.3e}, largest gradient {scale:.3e}"
    ldmopt.unpatch(model)


@pytest.mark.parametrize("name", ["cogview3-plus", "auraflow", "prior-transformer"])
def test_triton_kernels_on_their_shapes(name):
    """The Triton kernels (in the interpreter on CPU) on these models' shapes, e.g. CogView3-Plus's 4-channel heads."""
    model, call = FIRING[name].build()
    model = _randomized(model)
    with torch.no_grad():
        ref = call(model)
    report = ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        got = call(model)
    assert report.backends() and all(set(b) == {"triton"} for b in report.backends().values()), report.backends()
    assert_outputs_close(got, ref, atol=ATOL_TRITON, rtol=RTOL_TRITON, name=name)
    ldmopt.unpatch(model)
