"""Rules transformer2d_in / spatiotemporal_in: a Linear proj_in read as a 1x1 conv keeps nn.Linear's fp32 precision.

Stock nn.Linear in fp32 runs IEEE products on a GPU unless torch's matmul precision allows TF32, where a convolution
runs TF32 by default: the fused GroupNorm + proj_in must follow the matmul setting for a Linear (fp32_precision
"matmul") and the convolution's for a 1x1 Conv2d ("conv"). The interpreter ignores the precision, so the tests check
what the rules pass (tests/ops/test_gn_conv2d_precision.py checks what the op does with it).
"""

import pytest
import torch

import ldmopt
from ldmopt.patch import rules_gn_conv
from tests.patch.test_container_proj_out import _inputs, _model, _svd_container
from tests.tolerances import assert_close

pytest.importorskip("diffusers.models.transformers.transformer_2d")


def _record_precision(monkeypatch) -> list[str]:
    seen = []
    original = rules_gn_conv.gn_silu_conv2d

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fp32_precision", "conv"))
        return original(*args, **kwargs)

    monkeypatch.setattr(rules_gn_conv, "gn_silu_conv2d", spy)
    return seen


@pytest.mark.parametrize("linear_projection", [True, False], ids=["linear", "conv1x1"])
def test_transformer2d_proj_in_follows_its_stock_layers_precision(monkeypatch, linear_projection):
    model = _model(linear_projection)
    x, context = _inputs()
    with torch.no_grad():
        ref = model(x, encoder_hidden_states=context).sample
    assert ldmopt.patch(model).counts().get("transformer2d_in") == 1
    seen = _record_precision(monkeypatch)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = model(x, encoder_hidden_states=context).sample
    assert seen == ["matmul" if linear_projection else "conv"]
    assert_close(out, ref.double(), torch.float32, "patched container")
    ldmopt.unpatch(model)


def test_svd_container_proj_in_follows_the_matmul_precision(monkeypatch):
    model = _svd_container()
    frames = 2
    x = torch.randn(2 * frames, 32, 3, 5).contiguous(memory_format=torch.channels_last)
    context, indicator = torch.randn(2 * frames, 1, 24), torch.zeros(2, frames)
    with torch.no_grad():
        ref = model(x, context, image_only_indicator=indicator).sample
    assert ldmopt.patch(model).counts().get("spatiotemporal_in") == 1
    seen = _record_precision(monkeypatch)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = model(x, context, image_only_indicator=indicator).sample
    assert seen == ["matmul"]
    assert_close(out, ref.double(), torch.float32, "patched SVD container")
    ldmopt.unpatch(model)
