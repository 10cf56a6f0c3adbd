"""A patched model under torch.func: jvp (the tangent of the denoiser along a direction, as continuous-time
consistency models and MeanFlow train with), grad and vmap must equal the stock model's, in fp64, for a UNet, a
video UNet and a DiT-style transformer. The fused ops run their reference compositions there (see
tests/ops/test_function_transforms.py), and class-swapped blocks their stock forwards."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from tests.patch import models
from tests.patch.helpers import output_tensor, with_nontrivial_norms


def _math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA written out: PyTorch's CPU SDPA kernel has no forward-mode derivative, for the stock model either."""
    assert dropout_p == 0.0 and not is_causal and not enable_gqa
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ value


BUILDERS = {"sd15": models.sd15_unet, "svd": models.svd, "flux": models.flux}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_patched_model_jvp_and_grad_equal_the_stock_models(family, monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _math_attention)
    torch.manual_seed(0)
    model = with_nontrivial_norms(BUILDERS[family]().double())
    kwargs = models.inputs(family, model)
    name = "sample" if "sample" in kwargs else "hidden_states"
    x = kwargs.pop(name)
    direction = torch.randn_like(x)

    def denoise(sample):
        return output_tensor(model(**{name: sample}, **kwargs))

    def loss(sample):
        return denoise(sample).square().sum()

    samples = torch.stack([x, torch.randn_like(x)])  # vmap over whole batches: per-sample work, per-sample gradients
    stock_y, stock_jvp = torch.func.jvp(denoise, (x,), (direction,))
    stock_grad = torch.func.grad(loss)(x)
    stock_mapped = torch.func.vmap(denoise)(samples)
    report = ldmopt.patch(model)
    assert report.replaced, "nothing was patched"
    before = sum(ldmopt.ops.backend_counts.values())
    y, jvp = torch.func.jvp(denoise, (x,), (direction,))
    grad = torch.func.grad(loss)(x)
    assert sum(ldmopt.ops.backend_counts.values()) > before, "the fused paths did not run"
    mapped = torch.func.vmap(denoise)(samples)
    # fp64: only rounding differs (Flux's rotary tables are built in fp64 by ldmopt, fp32 in diffusers' CPU path).
    bound = 1e-7 if family == "flux" else 1e-12
    compared = {"output": (y, stock_y), "jvp": (jvp, stock_jvp), "grad": (grad, stock_grad)}
    compared["vmap"] = (mapped, stock_mapped)
    for what, (got, expected) in compared.items():
        err = (got - expected).abs().max().item() / expected.abs().max().item()
        assert err <= bound, f"{family} {what}: relative error {err:.2e} > {bound:.0e}"
    ldmopt.unpatch(model)
