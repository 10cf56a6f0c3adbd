"""A whole tiny StableDiffusionPipeline, patched vs unpatched, end to end."""

import pytest
import torch

import ldmopt
from ldmopt.demo import build_tiny_sd_pipeline, run_sd
from ldmopt.patch import PatchError
from tests.patch.helpers import assert_same_snapshot, snapshot


def test_tiny_sd_pipeline_patched_vs_stock():
    pipe = build_tiny_sd_pipeline("cpu", torch.float32, seed=0)
    stock, _ = run_sd(pipe, steps=2, seed=1)
    before = {name: snapshot(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    report = ldmopt.patch(pipe)
    assert set(report.models) == {"unet", "vae", "text_encoder"}
    assert report.counts("unet") == {
        "downsample_conv": 3,
        "geglu": 10,
        "group_norm_silu": 1,
        "residual_block": 10,
        "resnet": 14,
        "transformer2d_in": 10,
        "up_block_skip": 4,
        "upsample_conv": 3,
    }
    assert report.counts("vae") == {"group_norm": 2, "group_norm_silu": 2, "resnet": 16, "upsample_conv": 3}
    assert report.counts("text_encoder") == {}
    with ldmopt.use_backend("torch"):
        patched, _ = run_sd(pipe, steps=2, seed=1)
    assert not report.fallbacks(), report.fallbacks()  # channels-last end to end: every patched block ran fused
    assert stock.shape == patched.shape and stock.shape[-1] == 16 * pipe.vae_scale_factor
    # Images in [0, 1] after 2 DDIM steps and the VAE decoder, fp32: only rounding differs.
    torch.testing.assert_close(patched, stock, atol=2e-4, rtol=0)
    assert ldmopt.patch(pipe).total == 0  # twice: a no-op
    assert ldmopt.unpatch(pipe) == report.total
    for name, snap in before.items():
        assert_same_snapshot(snap, snapshot(getattr(pipe, name)))
    pipe.unet = torch.compile(pipe.unet)
    with pytest.raises(PatchError, match="unet is already compiled"):
        ldmopt.patch(pipe)
