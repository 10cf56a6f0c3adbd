"""float64 gradcheck of what training differentiates through, on the reference backend, beyond tests/ops.

tests/ops gradchecks each op in one configuration (group_norm, geglu, linear, adaln_modulate, temporal_attention,
and gn_conv2d with resample="down" + temb). Training a patched UNet also differentiates through gn_conv2d's other
configurations and through the patched blocks, where several ops are chained and statistics produced by one conv's
epilogue are consumed by the next conv (autograd sees them as constants; the consumer's backward must account for
them). These are checked here, with every parameter as a gradcheck input (torch.func.functional_call).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call

import ldmopt
from ldmopt.ops.gn_conv2d import gn_silu_conv2d

F64 = torch.float64


def _cl(*shape):
    return torch.randn(*shape, dtype=F64).contiguous(memory_format=torch.channels_last).requires_grad_()


def _p(*shape):
    return torch.randn(*shape, dtype=F64, requires_grad=True)


def _vec(n, scale=0.5):
    # Non-trivial affine parameters: a backward that leaves them out of the SiLU derivative fails here.
    return (1.0 + scale * torch.randn(n, dtype=F64)).requires_grad_()


def _gradcheck(fn, inputs):
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.mark.parametrize("resample", ["none", "up", "down"])
def test_gn_conv2d_resnet_chain(resample):
    """conv1 (GN+SiLU loader, resample, temb, output statistics) -> conv2 reading those statistics, with a 1x1
    shortcut conv of the (resampled) input and output_scale: the ResnetBlock2D composition."""
    n, cin, cout, g = 2, 4, 6, 2
    x = _cl(n, cin, 4, 4)
    leaves = [x, _vec(cin), _vec(cin, 0.3), _p(cout, cin, 3, 3), _p(cout), _p(n, cout), _vec(cout), _vec(cout, 0.3),
              _p(cout, cout, 3, 3), _p(cout, cin, 1, 1), _p(cout)]  # fmt: skip

    def block(x, g1w, g1b, w1, b1, temb, g2w, g2b, w2, sw, sb):
        h, stats = gn_silu_conv2d(x, g1w, g1b, g, 1e-5, w1, b1, resample=resample, temb=temb, out_stats=(g, 1e-5))
        return gn_silu_conv2d(h, g2w, g2b, g, 1e-5, w2, None, stats=stats, shortcut=(x, sw, sb),
                              shortcut_resample=resample, output_scale=2.0)  # fmt: skip

    _gradcheck(block, leaves)


@pytest.mark.parametrize("resample", ["none", "down"])
def test_gn_conv2d_identity_residual(resample):
    """Residual added in the epilogue (with its own resample), as a block with in == out channels."""
    x = _cl(2, 4, 4, 4)
    leaves = [x, _vec(4), _vec(4, 0.3), _p(4, 4, 3, 3)]

    def fn(x, gw, gb, w):
        return gn_silu_conv2d(x, gw, gb, 2, 1e-5, w, None, resample=resample, residual=x, residual_resample=resample)

    _gradcheck(fn, leaves)


def test_gn_conv2d_plain_and_no_activation():
    """normalize=False stride-2 conv (a Downsample2D) and GroupNorm without activation into a 1x1 conv (a
    Transformer2DModel's norm + proj_in)."""
    x = _cl(1, 4, 5, 5)
    leaves = [x, _p(3, 4, 3, 3), _vec(3), _vec(3, 0.3), _p(5, 3, 1, 1), _p(5)]

    def fn(x, wd, gw, gb, wp, bp):
        h = gn_silu_conv2d(x, None, None, 1, 1e-5, wd, None, 2, 1, normalize=False)
        return gn_silu_conv2d(h, gw, gb, 3, 1e-6, wp, bp, 1, 0, activation=None)

    _gradcheck(fn, leaves)


# ------------------------------------------------------------------------------------------------ patched blocks


class _Holder(torch.nn.Module):
    """Gives the block a parent, as inside a model; forward passes everything through."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


def _gradcheck_patched(
    block, args: tuple, kwargs: dict | None = None, expect_ops: tuple[str, ...] = (), pending: str = ""
):
    """Patch (training=True) a float64 copy of ``block``; gradcheck its output w.r.t. its tensor arguments and every
    parameter; check the fused ops ran and nothing fell back to the stock forward."""
    holder = _Holder(copy.deepcopy(block).double().train())
    report = ldmopt.patch(holder, training=True)
    assert report.total > 0, str(report)
    names = [n for n, _ in holder.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in holder.named_parameters()]
    tensors = [a.detach().clone().requires_grad_() for a in args]
    kwargs = kwargs or {}

    def fn(*leaves):
        out = functional_call(holder, dict(zip(names, leaves[len(tensors) :])), tuple(leaves[: len(tensors)]), kwargs)
        return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)

    _gradcheck(fn, tensors + params)
    ran = report.backends()
    if pending and pending not in ran:
        pytest.skip(f"ldmopt.patch does not route this block through {pending} yet (ran: {sorted(ran)})")
    assert all(op in ran for op in expect_ops), (expect_ops, ran)
    assert not report.fallbacks(), report.fallbacks()


@pytest.mark.parametrize("kind", ["shortcut", "up", "down"])
def test_patched_resnet_block(kind):
    from diffusers.models.resnet import ResnetBlock2D

    out = 6 if kind == "shortcut" else 4
    block = ResnetBlock2D(in_channels=4, out_channels=out, temb_channels=5, groups=2, groups_out=2,
                          up=kind == "up", down=kind == "down", output_scale_factor=1.5)  # fmt: skip
    x = torch.randn(2, 4, 4, 4, dtype=F64).contiguous(memory_format=torch.channels_last)
    _gradcheck_patched(block, (x, torch.randn(2, 5, dtype=F64)), expect_ops=("gn_conv2d",))


def test_patched_transformer2d_geglu():
    """Transformer2DModel: GroupNorm + 1x1 proj_in fused, self/cross attention, the LayerNorms read in the loads of
    the projections and of the GEGLU feed-forward."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=2,
                               cross_attention_dim=6)  # fmt: skip
    x = torch.randn(1, 8, 3, 3, dtype=F64).contiguous(memory_format=torch.channels_last)
    ehs = torch.randn(1, 2, 6, dtype=F64)
    _gradcheck_patched(model, (x,), {"encoder_hidden_states": ehs, "return_dict": False},
                       ("gn_conv2d", "layer_norm_linear", "geglu_backward"))  # fmt: skip


def test_patched_dit_block_adaln():
    """DiT block: adaLN-Zero (LayerNorm + modulation in one row kernel), GELU-tanh feed-forward with the gated
    residual in the GEMM epilogue."""
    from diffusers.models.attention import BasicTransformerBlock

    block = BasicTransformerBlock(8, 2, 4, activation_fn="gelu-approximate", num_embeds_ada_norm=5,
                                  norm_type="ada_norm_zero", norm_elementwise_affine=False)  # fmt: skip
    block.norm1.emb.class_embedder.dropout_prob = 0.0  # train-mode label drop is random: gradcheck needs a function
    x = torch.randn(2, 3, 8, dtype=F64)
    kwargs = {"timestep": torch.tensor([3, 1]), "class_labels": torch.tensor([0, 4])}
    _gradcheck_patched(block, (x,), kwargs, expect_ops=("adaln_modulate",))


def test_patched_motion_module_temporal_attention():
    """AnimateDiff motion module: GroupNorm, temporal self-attention over frames, the LayerNorms (norm1/norm2 with
    their sinusoidal positions) read in the loads of the projections and of the GEGLU feed-forward."""
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    module = AnimateDiffTransformer3D(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=2,
                                      double_self_attention=True, positional_embeddings="sinusoidal",
                                      num_positional_embeddings=8)  # fmt: skip
    frames = 3
    x = torch.randn(2 * frames, 8, 2, 2, dtype=F64)
    _gradcheck_patched(module, (x,), {"num_frames": frames}, ("layer_norm_linear", "geglu_backward"),
                       pending="temporal_attention")  # fmt: skip
