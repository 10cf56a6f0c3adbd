"""An empty batch (a dataloader's last batch, a serving queue) through patched and fused modules: the ops refuse
empty inputs, so the modules must return what the stock ones return (an empty tensor of the right shape)."""

import torch
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

import ldmopt
from ldmopt.nn import FusedLayerNormLinear
from ldmopt.nn.linear import FusedAdaLayerNormContinuous, FusedAdaLayerNormZero


def test_patched_group_norm_and_resnet_block_return_empty_outputs():
    x = torch.randn(0, 8, 5, 5)
    norm = nn.Sequential(nn.GroupNorm(4, 8), nn.SiLU())
    block = ResnetBlock2D(in_channels=8, out_channels=12, temb_channels=16, groups=4).eval()
    expected = (norm(x).shape, block(x, torch.randn(0, 16)).shape)
    report = ldmopt.patch(norm), ldmopt.patch(block)
    assert all(r.replaced for r in report)
    assert (norm(x).shape, block(x, torch.randn(0, 16)).shape) == expected == ((0, 8, 5, 5), (0, 12, 5, 5))


def test_fused_adaln_and_layer_norm_linear_return_empty_outputs():
    x, emb = torch.randn(0, 7, 16), torch.randn(0, 16)
    zero = AdaLayerNormZero(16, num_embeddings=None)
    continuous = AdaLayerNormContinuous(16, 16, elementwise_affine=False)
    assert FusedAdaLayerNormZero.from_module(zero)(x, emb=emb)[0].shape == zero(x, emb=emb)[0].shape
    assert FusedAdaLayerNormContinuous.from_module(continuous)(x, emb).shape == continuous(x, emb).shape
    assert FusedLayerNormLinear(16, 8, activation="geglu")(x).shape == (0, 7, 8)


def test_patched_upsampler_and_downsampler_return_empty_outputs():
    # The downsampler runs the fused conv only once its consumers asked for its output's statistics (second call).
    from tests.patch import models

    unet = models.sd15_unet().eval()
    down, up = unet.down_blocks[0].downsamplers[0], unet.up_blocks[0].upsamplers[0]
    x_down, x_up = torch.randn(0, 32, 8, 8), torch.randn(0, 64, 4, 4)
    with torch.no_grad():
        expected = down(x_down).shape, up(x_up).shape
        assert ldmopt.patch(unet).replaced
        kwargs = models.inputs("sd15", unet, batch=1)
        with ldmopt.use_backend("torch"):
            unet(**kwargs), unet(**kwargs)
            assert (down(x_down).shape, up(x_up).shape) == expected == ((0, 32, 4, 4), (0, 64, 8, 8))


def test_patched_transformer_blocks_return_zero_token_outputs():
    from diffusers.models.attention import BasicTransformerBlock, JointTransformerBlock

    unet_block = BasicTransformerBlock(16, 2, 8, cross_attention_dim=12).eval()
    dit_block = BasicTransformerBlock(16, 2, 8, norm_type="ada_norm_zero", num_embeds_ada_norm=10).eval()
    joint_block = JointTransformerBlock(16, 2, 8).eval()
    x, ctx, t, labels = torch.randn(2, 0, 16), torch.randn(2, 5, 12), torch.tensor([3, 4]), torch.tensor([1, 2])
    temb, joint_ctx = torch.randn(2, 16), torch.randn(2, 5, 16)

    def run():
        return (
            unet_block(x, encoder_hidden_states=ctx).shape,
            dit_block(x, timestep=t, class_labels=labels).shape,
            tuple(o.shape for o in joint_block(x, joint_ctx, temb)),
        )

    with torch.no_grad():
        expected = run()
        assert all(ldmopt.patch(block).replaced for block in (unet_block, dit_block, joint_block))
        with ldmopt.use_backend("torch"):
            assert run() == expected


def test_patched_wan_block_returns_an_empty_batch():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    block = WanTransformerBlock(16, 24, 2, cross_attn_norm=True).eval()
    rotary = WanRotaryPosEmbed(8, (1, 2, 2), 32)(torch.randn(1, 4, 3, 4, 4))  # 3 x 2 x 2 tokens
    x, context, temb = torch.randn(0, 12, 16), torch.randn(0, 5, 16), torch.randn(0, 6, 16)
    with torch.no_grad():
        expected = block(x, context, temb, rotary).shape
        assert ldmopt.patch(block).replaced
        with ldmopt.use_backend("torch"):
            assert block(x, context, temb, rotary).shape == expected == (0, 12, 16)
