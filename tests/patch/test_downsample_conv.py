"""ldmopt.patch's ``downsample_conv`` rule: diffusers' Downsample2D offers its output to the GroupNorms that read it
(the next down block's norm1, an up block's resnet as the skip); once one asked, its conv runs fused with the output
statistics and channel sums in the epilogue (Triton interpreter), against diffusers' own forward."""

from __future__ import annotations

import pytest
import torch

import ldmopt
from ldmopt.nn import child_check
from ldmopt.nn import stats_handover as handover
from ldmopt.ops.gn_conv2d import channel_sums_torch
from tests.patch.helpers import assert_same_snapshot, snapshot
from tests.tolerances import assert_close, assert_within_torch_error

downsampling = pytest.importorskip("diffusers.models.downsampling")


pytestmark = pytest.mark.usefixtures("fresh_handover")


def _block(channels=12, out_channels=10, dtype=torch.float32, **kw):
    block = downsampling.Downsample2D(channels, use_conv=True, out_channels=out_channels, **kw).eval()
    with torch.no_grad():
        block.conv.bias.normal_()
    return block.to(dtype=dtype, memory_format=torch.channels_last)


def _x(dtype=torch.float32, n=2, c=12, h=9, w=7):
    return (torch.randn(n, c, h, w, dtype=dtype) + 0.5).contiguous(memory_format=torch.channels_last)


def _group_stats(y, groups, eps):
    var, mean = torch.var_mean(y.double().reshape(y.shape[0], groups, -1), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_statistics_come_from_the_conv_once_a_group_norm_asked(dtype):
    block, x = _block(dtype=dtype), _x(dtype)
    before = snapshot(block)
    with torch.no_grad():
        expected = block(x)
        ref = downsampling.Downsample2D.forward(block.double(), x.double())
        block.to(dtype)
        report = ldmopt.patch(block)
        assert report.counts() == {"downsample_conv": 1}, str(report)
        child_check.fallback_reasons.clear()
        with ldmopt.use_backend("triton"):
            first = block(x)
            assert torch.equal(first, expected)  # nothing asked yet: the stock conv
            assert handover.take(first, 5, 1e-6, "test") is None  # the consumer asks (groups 5, eps 1e-6)
            second = block(x)
            stats = handover.take(second, 5, 1e-6, "test")
    assert not child_check.fallback_reasons, dict(child_check.fallback_reasons)
    assert stats is not None and handover.handed_over["test"] == 1
    assert second.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(second, ref, expected, f"downsample {dtype}")
    for got, want, name in zip(stats, _group_stats(second, 5, 1e-6), ("mean", "rstd")):
        assert_close(got, want, torch.float32, name)
    ldmopt.unpatch(block)
    assert_same_snapshot(before, snapshot(block))


def test_an_up_block_skip_comes_with_its_channel_sums():
    block, x = _block(), _x()
    hidden_producer, hidden = torch.nn.Module(), torch.randn(2, 6, 5, 4)
    ldmopt.patch(block)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        skip = block(x)
        handover.offer(hidden, hidden_producer)
        assert handover.take_parts(hidden, skip, 4, 1e-5, "test") is None  # both producers learn to sum
        skip = block(x)
        handover.offer(hidden, hidden_producer, sums=channel_sums_torch(hidden))
        mean, rstd = handover.take_parts(hidden, skip, 4, 1e-5, "test")
    expected = _group_stats(torch.cat([hidden, skip], 1), 4, 1e-5)
    assert_close(mean, expected[0], torch.float32, "mean")
    assert_close(rstd, expected[1], torch.float32, "rstd")
    ldmopt.unpatch(block)


def test_hooked_conv_and_deprecated_scale_run_stock_with_reason():
    block, x = _block(), _x()
    with torch.no_grad():
        plain = block(x)
    ldmopt.patch(block)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        with pytest.warns(FutureWarning, match="scale"):
            block(x, scale=1.0)
        handle = block.conv.register_forward_hook(lambda m, a, o: o * 2)
        hooked = block(x)
        handle.remove()
    torch.testing.assert_close(hooked, plain * 2)
    reasons = " | ".join(child_check.fallback_reasons)
    for expected_reason in ("deprecated scale", "conv has hooks"):
        assert expected_reason in reasons, reasons
    ldmopt.unpatch(block)


def test_training_keeps_the_stock_conv_and_its_gradients():
    """Under autograd the stock conv runs even when asked: a gradient-checkpointing recompute must save what the
    forward it replays saved, and a request learned in between would otherwise switch the op."""
    block, x = _block(), _x()
    leaves = [x.requires_grad_(), block.conv.weight, block.conv.bias]

    def grads():
        out = block(x)
        assert handover.take(out, 5, 1e-6, "test") is None  # a GroupNorm reads the output, and asks
        return [out.detach(), *torch.autograd.grad(out.square().sum(), leaves)]

    expected = grads()
    ldmopt.patch(block, training=True)
    with ldmopt.use_backend("triton"):
        grads()
        ours = grads()
    assert not handover.handed_over
    for name, a, b in zip(("out", "dx", "dweight", "dbias"), ours, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    ldmopt.unpatch(block)


def test_unserved_downsamplers_are_skipped_with_reason_or_not_matched():
    report = ldmopt.patch(downsampling.Downsample2D(8, use_conv=True, kernel_size=5, padding=1))
    skipped = [s.reasons for s in report.skipped if s.rule == "downsample_conv"]
    assert skipped and any("fused: 3x3, stride 2" in r for r in skipped[0]), skipped
    # average pooling, or a conv after asymmetric padding (VAE encoders): nothing this rule serves, no skip entry
    for block in (downsampling.Downsample2D(8), downsampling.Downsample2D(8, use_conv=True, padding=0)):
        report = ldmopt.patch(block)
        assert "downsample_conv" not in report.counts(), str(report)
        assert not [s for s in report.skipped if s.rule == "downsample_conv"], str(report)


@pytest.mark.parametrize("norm_type,norm", [("ln_norm", "LayerNorm"), ("rms_norm", "RMSNorm")])
def test_a_norm_before_the_conv_is_left_stock_with_reason(norm_type, norm):
    # The fused forward runs only the conv: a Downsample2D that normalizes its input first stays diffusers' own.
    block = _block(norm_type=norm_type, eps=1e-5, elementwise_affine=True)
    with torch.no_grad():
        block.norm.weight.normal_()
    model, x = torch.nn.Sequential(block), _x()
    before = snapshot(model)
    with torch.no_grad():
        expected = model(x)
        report = ldmopt.patch(model)
        with ldmopt.use_backend("triton"):
            out = model(x)
            assert handover.take(out, 5, 1e-6, "test") is None  # a GroupNorm reading it asks: still stock after
            again = model(x)
    assert_close(out, expected.double(), torch.float32, f"{norm} downsample")  # (an RMSNorm runs ldmopt's kernel)
    assert_close(again, expected.double(), torch.float32, f"{norm} downsample, asked")
    skipped = [s.reasons for s in report.skipped if s.rule == "downsample_conv"]
    assert "downsample_conv" not in report.counts(), str(report)
    assert skipped == [(f"norm {norm} before the downsampling",)], skipped
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))
