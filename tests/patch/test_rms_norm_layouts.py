"""RMSNorms that normalise the channels of a channels-first activation through ``movedim`` (LTX-Video's VAE, DC-AE's
ResBlock) see rows strided in memory: the row kernel does not take them, and the report must say so, at patch time
where it is so on every call, in ``fallbacks()`` where it depends on the input's layout."""

import diffusers
import torch

import ldmopt


def _ltx_vae() -> torch.nn.Module:
    return diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,) * 4,
        decoder_block_out_channels=(8,) * 4, layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=1, patch_size_t=1,
    ).eval()  # fmt: skip


def _dc_ae() -> torch.nn.Module:
    return diffusers.AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], decoder_norm_types="rms_norm",
    ).eval()  # fmt: skip


def test_ltx_vae_rms_norms_are_left_stock_with_the_reason():
    torch.manual_seed(0)
    vae, x = _ltx_vae(), torch.randn(1, 3, 9, 16, 16)
    with torch.no_grad():
        expected = vae(x).sample
        report = ldmopt.patch(vae)
        actual = vae(x).sample
    assert "rms_norm" not in report.counts()
    skipped = [s for s in report.skipped if s.rule == "rms_norm"]
    assert skipped and all("movedim" in " ".join(s.reasons) for s in skipped)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    ldmopt.unpatch(vae)


def test_dc_ae_strided_rows_run_stock_and_are_counted():
    torch.manual_seed(0)
    vae, x = _dc_ae(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = vae(x).sample
        report = ldmopt.patch(vae)
        actual = vae(x).sample
    assert report.counts().get("rms_norm", 0) > 0
    strided = {k: n for k, n in report.fallbacks().items() if k.startswith("RMSNorm") and "not contiguous" in k}
    assert strided, report.fallbacks()
    assert sum(report.backends().get("rms_norm", {}).values()) > 0  # the other RMSNorms ran the op
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    ldmopt.unpatch(vae)
