"""ldmopt.patch's ``upsample_conv`` rule: diffusers' Upsample2D as one convolution reading its input through nearest
2x index arithmetic (Triton interpreter), against diffusers' own forward; the upsampled tensor is never dispatched."""

from __future__ import annotations

import pytest
import torch

import ldmopt
from ldmopt.nn import child_check
from ldmopt.nn import resnet as R
from tests.patch.helpers import DispatchedOps, assert_same_snapshot, snapshot
from tests.tolerances import assert_within_torch_error

upsampling = pytest.importorskip("diffusers.models.upsampling")


def _block(channels=12, out_channels=10, dtype=torch.float32, **kw):
    block = upsampling.Upsample2D(channels, use_conv=True, out_channels=out_channels, **kw).eval()
    with torch.no_grad():
        block.conv.bias.normal_()
    return block.to(dtype=dtype, memory_format=torch.channels_last)


def _x(dtype=torch.float32, n=2, c=12, h=5, w=7):
    return torch.randn(n, c, h, w, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("output_size", [None, (10, 14)])
def test_fused_upsample_matches_diffusers_without_writing_the_upsampled_tensor(dtype, output_size):
    block = _block(dtype=dtype)
    x = _x(dtype)
    before = snapshot(block)
    with torch.no_grad():
        expected = block(x, output_size)
        ref = upsampling.Upsample2D.forward(block.double(), x.double(), output_size)
        block.to(dtype)
        report = ldmopt.patch(block)
        assert report.counts() == {"upsample_conv": 1}, str(report)
        child_check.fallback_reasons.clear()
        with ldmopt.use_backend("triton"), DispatchedOps() as ops:
            out = block(x, output_size)
    assert not child_check.fallback_reasons, dict(child_check.fallback_reasons)
    assert not any("upsample" in name or "convolution" in name for name, _ in ops.calls), ops.calls
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(out, ref, expected, f"upsample {dtype}")
    ldmopt.unpatch(block)
    assert_same_snapshot(before, snapshot(block))


def test_stock_upsample_writes_the_upsampled_tensor():
    # The dispatch check above can fail: diffusers' forward dispatches the interpolation.
    block, x = _block(), _x()
    with torch.no_grad(), DispatchedOps() as ops:
        block(x)
    assert any("upsample_nearest2d" in name for name, _ in ops.calls)


def test_other_output_size_deprecated_scale_and_hooked_conv_run_stock_with_reason():
    block, x = _block(), _x()
    with torch.no_grad():
        odd = block(x, (9, 13))
        plain = block(x)
    ldmopt.patch(block)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert torch.equal(block(x, (9, 13)), odd)
        with pytest.warns(FutureWarning, match="scale"):
            block(x, None, scale=1.0)
        handle = block.conv.register_forward_hook(lambda m, a, o: o * 2)
        hooked = block(x)
        handle.remove()
    torch.testing.assert_close(hooked, plain * 2)
    reasons = " | ".join(child_check.fallback_reasons)
    for expected_reason in ("output_size is not twice", "deprecated scale", "conv has hooks"):
        assert expected_reason in reasons, reasons
    ldmopt.unpatch(block)


def test_nchw_input_is_converted_once():
    block, x = _block(), _x().contiguous()
    with torch.no_grad():
        expected = block(x)
        ldmopt.patch(block)
        R.layout_conversions.clear()
        with ldmopt.use_backend("triton"):
            out = block(x)
    assert R.layout_conversions["Upsample2D: NCHW input converted to channels-last"] == 1
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)
    ldmopt.unpatch(block)


def test_training_gradients_match_diffusers():
    block, x = _block(), _x()
    leaves = [x.requires_grad_(), block.conv.weight, block.conv.bias]

    def grads():
        out = block(x)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), leaves)]

    expected = grads()
    ldmopt.patch(block, training=True)
    with ldmopt.use_backend("triton"):
        ours = grads()
    for name, a, b in zip(("out", "dx", "dweight", "dbias"), ours, expected):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, name=name: f"{name}: {m}")
    ldmopt.unpatch(block)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(norm_type="rms_norm", eps=1e-5, elementwise_affine=True), "norm RMSNorm"),
        (dict(kernel_size=5, padding=2), "fused: 3x3 or 1x1"),
    ],
)
def test_unserved_upsamplers_are_skipped_with_reason(kwargs, reason):
    block = upsampling.Upsample2D(8, use_conv=True, **kwargs)
    report = ldmopt.patch(block)
    assert "upsample_conv" not in report.counts()
    skipped = [s.reasons for s in report.skipped if s.rule == "upsample_conv"]
    assert skipped and any(reason in r for r in skipped[0]), skipped


def test_upsamplers_without_a_conv_after_interpolation_are_not_matched():
    # Nothing to fuse: no skip entry, and patch must not trip over the missing conv (conv is None).
    from diffusers.models.resnet import ResnetBlock2D

    for block in (upsampling.Upsample2D(8), upsampling.Upsample2D(8, use_conv_transpose=True),
                  upsampling.Upsample2D(8, use_conv=True, interpolate=False)):  # fmt: skip
        report = ldmopt.patch(block, strict=True)
        assert not report.counts() and not report.skipped, str(report)
    # A resnet with its own conv-less upsampler that the resnet rule leaves stock (scale_shift).
    resnet = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=4, groups=2, up=True,
                           time_embedding_norm="scale_shift")  # fmt: skip
    report = ldmopt.patch(resnet)
    assert "upsample_conv" not in report.counts() and not [s for s in report.skipped if s.rule == "upsample_conv"]
    ldmopt.unpatch(resnet)


@pytest.mark.parametrize("conv_kwargs", [dict(dilation=2, padding=2), dict(padding=0), dict(padding_mode="reflect")])
def test_conv_replaced_after_patch_by_another_geometry_runs_stock(conv_kwargs):
    block, x = _block(), _x()
    ldmopt.patch(block)
    conv = torch.nn.Conv2d(12, 10, 3, **{"padding": 1, **conv_kwargs})
    block.conv = conv.to(memory_format=torch.channels_last)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = block(x)
        expected = upsampling.Upsample2D.forward(block, x)
    assert torch.equal(out, expected)
    assert any("conv has (kernel, stride, padding" in r for r in child_check.fallback_reasons)
    block.conv = conv


@pytest.mark.parametrize("setting", ["use_conv", "interpolate"])
def test_settings_flipped_after_patch_run_stock(setting):
    """use_conv / interpolate switched off after patching: diffusers' forward runs (the fused path would still
    upsample and convolve), with the reason counted."""
    block, x = _block(), _x()
    ldmopt.patch(block)
    setattr(block, setting, False)
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = block(x)
        expected = upsampling.Upsample2D.forward(block, x)
    assert torch.equal(out, expected)
    assert any(f"{setting}=False" in r for r in child_check.fallback_reasons), dict(child_check.fallback_reasons)
