"""benchmarks/saved_activations.py: the bytes a training step keeps for backward, counted on the meta device, with
attention counted as FlashAttention saves it; the patched models keep less than the stock ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from benchmarks import saved_activations as S


def test_attention_is_counted_as_flash_attention_saves_it():
    b, h, t, d = 2, 3, 5, 8
    q, k, v = (torch.empty(b, t, h * d, device="meta").view(b, t, h, d).transpose(1, 2) for _ in range(3))
    layer = torch.nn.Linear(h * d, h * d, device="meta")
    model = torch.nn.Module()
    model.layer = layer

    def forward():
        out = F.scaled_dot_product_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
        return layer(out.transpose(1, 2).reshape(b, t, h * d))

    model.forward = forward
    stock_sdpa = F.scaled_dot_product_attention
    total, _ = S.saved_bytes(model, SimpleNamespace(method="forward", kwargs={}))
    assert F.scaled_dot_product_attention is stock_sdpa  # restored
    qkv_out = 4 * b * t * h * d * 4  # fp32 q, k, v and the output (which the linear saves too: counted once)
    assert total == qkv_out + b * h * t * 4  # + the fp32 log-sum-exp; the linear's weight is a parameter


@pytest.mark.parametrize("name", ["sd15", "dit", "animatediff"])
def test_patched_models_keep_less_for_backward(name):
    pytest.importorskip("diffusers")
    result = S.compare(name, None, 1, None, tiny=True)
    assert result["patched_modules"] > 0
    assert 0 < result["patched"] < result["stock"], result


def test_main_prints_a_table(capsys):
    pytest.importorskip("diffusers")
    assert S.main(["dit", "--batch", "2", "--resolution", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model | batch | stock | patched | less |") and "| dit (" in out, out
