"""Models outside the 15-config zoo that share patched structures: the video VAEs' GroupNorm+SiLU heads and the
Flux-style single-stream blocks of Chroma and HunyuanVideo. Patched (reference backend) vs stock, and unpatch."""

import pytest
import torch

import ldmopt
from ldmopt.patch.rule import FusedAway
from tests.patch.helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot

diffusers = pytest.importorskip("diffusers")
R = torch.randn


def _svd_vae():
    model = diffusers.AutoencoderKLTemporalDecoder(
        block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    )  # fmt: skip
    return model, {"sample": R(2, 3, 16, 16), "num_frames": 2}


def _hunyuan_video_vae():
    model = diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4,
    )  # fmt: skip
    return model, {"sample": R(1, 3, 5, 16, 16)}


def _asymmetric_vae():
    model = diffusers.AsymmetricAutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(8, 16),
        layers_per_down_block=1, up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(8, 16),
        layers_per_up_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    )  # fmt: skip
    return model, {"sample": R(2, 3, 16, 16), "mask": (R(2, 1, 16, 16) > 0).float()}


def _hunyuan_video():
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
    )  # fmt: skip
    inputs = {
        "hidden_states": R(1, 4, 1, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": R(1, 12, 16),
        "pooled_projections": R(1, 8),
        "encoder_attention_mask": torch.ones(1, 12),
        "guidance": torch.tensor([3000.0]),
    }
    return model, inputs


def _chroma():
    model = diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_num_channels=8, approximator_hidden_dim=16,
        approximator_layers=1,
    )  # fmt: skip
    inputs = {
        "hidden_states": R(2, 16, 4),
        "encoder_hidden_states": R(2, 8, 32),
        "img_ids": R(16, 3),
        "txt_ids": R(8, 3),
        "timestep": torch.tensor([0.2, 0.8]),
    }
    return model, inputs


#: name -> (builder, rule that must apply, how many times)
CASES = {
    "svd-vae": (_svd_vae, "group_norm_silu", 2),
    "hunyuan-video-vae": (_hunyuan_video_vae, "group_norm_silu", 2),
    "asymmetric-vae": (_asymmetric_vae, "group_norm_silu", 2),
    "hunyuan-video": (_hunyuan_video, "flux_mlp", 1),
    "chroma": (_chroma, "flux_mlp", 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_patched_matches_stock_and_unpatches(name):
    builder, rule, count = CASES[name]
    torch.manual_seed(0)
    model, inputs = builder()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():  # zero-initialised layers (output projections, gates) would hide a difference
                p.normal_(std=0.05)
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get(rule) == count, str(report)
    # The activation moved into the GroupNorm / GEMM epilogue: a FusedAway stands where it was.
    assert sum(isinstance(m, FusedAway) for m in model.modules()) >= count
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert_outputs_close(output_tensor(model(**inputs)), ref, name=name)
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


def test_every_keyed_class_path_resolves_in_this_diffusers():
    # diffusers_classes leaves out what a diffusers lacks; on the newest tested one every path must resolve (no typos).
    from ldmopt.patch.rule import diffusers_at_least, diffusers_classes

    if not diffusers_at_least("0.42"):
        pytest.skip("an older diffusers than the one the class paths were written against (0.42)")
    from ldmopt.patch.rules_group_norm import GROUP_NORM_SILU_HEADS
    from ldmopt.patch.rules_linear import SINGLE_STREAM_BLOCKS
    from ldmopt.patch.rules_wan import WAN_BLOCKS
    from ldmopt.patch.rules_wan_attention import WAN_ATTENTIONS

    for paths in (GROUP_NORM_SILU_HEADS, SINGLE_STREAM_BLOCKS, WAN_BLOCKS, WAN_ATTENTIONS):
        assert len(diffusers_classes(*paths)) == len(paths)


def test_processors_matched_by_name_exist_in_this_diffusers():
    import importlib

    from ldmopt.nn.child_check import qualified_name
    from ldmopt.patch import rules_hunyuan_attention, rules_qwen_attention

    for name in (rules_qwen_attention.PROCESSOR, rules_hunyuan_attention.PROCESSOR):
        module, _, cls = name.rpartition(".")
        assert qualified_name(getattr(importlib.import_module(module), cls)) == name
