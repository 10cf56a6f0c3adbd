"""Conditioning of another batch than the tokens: diffusers' FasterCache skips the unconditional half of a CFG batch by
halving hidden_states, encoder_hidden_states and timestep but not SD3's pooled_projections or DiT's class_labels, and
the stock blocks broadcast the tokens of batch 1 against a modulation of batch 2. The fused blocks take one modulation
vector per sample (or one for all), so they run the stock forward there, counted, instead of raising."""

import copy

import pytest
import torch

import ldmopt

from . import models

# What FasterCache halves in each family's call (the rest keeps the full batch).
HALVED = {
    "sd3": ("hidden_states", "encoder_hidden_states", "timestep"),
    "flux": ("hidden_states", "encoder_hidden_states", "timestep"),
    "dit": ("hidden_states", "timestep"),
}


@pytest.mark.parametrize("family", sorted(HALVED))
def test_tokens_of_batch_one_against_a_modulation_of_batch_two(family):
    torch.manual_seed(0)
    stock = getattr(models, family)().eval()
    call = models.inputs(family, stock)
    call.update({k: call[k][:1] for k in HALVED[family]})
    with torch.no_grad():
        expected = stock(**call).sample
        patched = copy.deepcopy(stock)
        report = ldmopt.patch(patched)
        assert report.total > 0
        actual = patched(**call).sample
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert any("modulation batch 2 for a token batch 1" in k for k in report.fallbacks()), report.fallbacks()


def test_fused_adaln_module_broadcasts_tokens_like_stock():
    from diffusers.models.normalization import AdaLayerNormContinuous

    from ldmopt.nn import FusedAdaLayerNormContinuous

    torch.manual_seed(0)
    stock = AdaLayerNormContinuous(16, 12, elementwise_affine=False, eps=1e-6)
    fused = FusedAdaLayerNormContinuous.from_module(stock)
    x, cond = torch.randn(1, 7, 16), torch.randn(2, 12)
    torch.testing.assert_close(fused(x, cond), stock(x, cond), rtol=1e-5, atol=1e-5)
