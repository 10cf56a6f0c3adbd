"""ldmopt._C's conv epilogue (conv_epilogue_cuda: the pass after a cuDNN conv under the "cudnn" placement), run on
CPU by the fiber emulator against fp64 references: shortcut, time embedding and residual adds, the output scale, and
the output's GroupNorm statistics or channel sums, over several pixel chunks and channel tiles, packed and scalar."""

import pytest
import torch

from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(2, 40, 9, 7), (1, 320, 8, 8), (3, 24, 5, 5), (2, 640, 4, 4), (1, 8, 1, 1), (2, 36, 3, 3), (1, 64, 40, 40)]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _randn(shape, dtype, mean=0.0, scale=1.0):
    return _cl((torch.randn(shape, dtype=torch.float64) * scale + mean).to(dtype))


def _reference(z, shortcut, residual, temb, inv_scale):
    out = z.double()
    if shortcut is not None:
        out = out + shortcut.double()
    if temb is not None:
        out = out + temb.double()[:, :, None, None]
    if residual is not None:
        out = out + residual.double()
    return out * inv_scale


def _group_stats(y, groups, eps):
    n = y.shape[0]
    var, mean = torch.var_mean(y.double().reshape(n, groups, -1), dim=2, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _channel_sums(y):
    rows = y.double().permute(0, 2, 3, 1).reshape(y.shape[0], -1, y.shape[1])
    return torch.stack([rows.sum(1), (rows * rows).sum(1)], dim=-1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv1_temb_and_group_statistics(emu, shape, dtype):
    """A resnet's conv1: z + temb[n], then the statistics norm2 reads, with a mean far above the spread."""
    n, c = shape[:2]
    groups = next(g for g in (8, 4, 2, 1) if c % g == 0)
    z = _randn(shape, dtype, mean=20.0)
    temb = torch.randn(n, c, dtype=torch.float64).to(dtype)
    ref = _reference(z, None, None, temb, 1.0)
    mean, rstd, sums = emu.conv_epilogue(z, temb=temb, groups=groups, eps=1e-6)
    assert_within_torch_error(z, ref, ref.float().to(dtype), f"y {shape} {dtype}")
    m_ref, r_ref = _group_stats(z, groups, 1e-6)
    assert_close(mean, m_ref, torch.float32, "mean")
    assert_close(rstd, r_ref, torch.float32, "rstd")
    assert sums.shape == (n, 0, 2)
    pack = 16 // z.element_size()
    assert emu.last_plan["vec"] == (pack if c % pack == 0 else 1)


@pytest.mark.parametrize("per_image_gate", [False, True])
@pytest.mark.parametrize("temb_kind", ["rows", "image", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_temporal_conv_per_row_temb_and_gate(emu, dtype, per_image_gate, temb_kind):
    """A video model's temporal conv over a (video, channel, frame, pixel) view: temb and an fp32 gate per output row
    (frame), residual + gate * (z + shortcut + temb), the scale and the next GroupNorm's statistics; one row spans
    several pixel chunks, packed (C = 48) and scalar (C = 38), temb with its frames strided apart. A per-row gate
    also beside a per-image temb or none (SVD's temporal conv2: residual + gate * z)."""
    for c, layout in ((48, "packed"), (38, "scalar")):
        n, frames, pixels = 2, 5, 37
        shape = (n, c, frames, pixels)
        z, sc, res = _randn(shape, dtype, mean=2.0), _randn(shape, dtype), _randn(shape, dtype, scale=0.5)
        temb = {
            "rows": torch.randn(n, frames, c, dtype=torch.float64).to(dtype).transpose(1, 2),  # [N, C, F], unit C
            "image": torch.randn(n, c, dtype=torch.float64).to(dtype),
            "none": None,
        }[temb_kind]
        gate = torch.rand(n, 1 if per_image_gate else frames, dtype=torch.float64) + 0.25
        out = z.double() + sc.double()
        if temb is not None:
            out = out + (temb.double()[..., None] if temb.dim() == 3 else temb.double()[:, :, None, None])
        ref = (res.double() + gate[:, None, :, None] * out) / 1.25
        mean, rstd, _ = emu.conv_epilogue(z, sc, res, temb, gate.float(), inv_scale=0.8, groups=2, eps=1e-6)
        assert_within_torch_error(z, ref, ref.float().to(dtype), f"y {layout} {dtype} temb {temb_kind}")
        m_ref, r_ref = _group_stats(z, 2, 1e-6)
        assert_close(mean, m_ref, torch.float32, "mean")
        assert_close(rstd, r_ref, torch.float32, "rstd")
        assert emu.last_plan["vec"] == (16 // z.element_size() if layout == "packed" else 1), (layout, emu.last_plan)
        assert emu.last_plan["chunks"] > 1 or n * frames * pixels < 128


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv2_shortcut_residual_scale_and_channel_sums(emu, dtype):
    """A resnet's conv2: (z + shortcut + residual) / output_scale_factor, and the per-channel fp64 sums an up block's
    two-part GroupNorm finalises; several pixel chunks per image."""
    shape = (2, 48, 20, 13)
    z, sc, res = _randn(shape, dtype), _randn(shape, dtype, mean=3.0), _randn(shape, dtype, scale=2.0)
    ref = _reference(z, sc, res, None, 1 / 1.4142)
    mean, _, sums = emu.conv_epilogue(z, sc, res, inv_scale=1 / 1.4142, groups=4, channel_sums=True)
    assert emu.last_plan["chunks"] > 1
    assert_within_torch_error(z, ref, ref.float().to(dtype), "y")
    got_mean, _ = _group_stats(z, 4, 1e-5)
    assert_close(mean, got_mean, torch.float32, "mean")
    expect = _channel_sums(z)
    torch.testing.assert_close(sums, expect, rtol=2e-5, atol=1e-3)


def test_uneven_last_chunk_is_weighted_by_its_pixels(emu):
    """S = 667 pixels in chunks of 61, the last of 57; a ramp over the pixels gives every chunk its own mean, so a
    merge that weighted the last chunk like the others would move the statistics."""
    z = _cl((torch.arange(23 * 29, dtype=torch.float64).reshape(1, 1, 23, 29) / 100 + torch.randn(1, 16, 23, 29))
            .float())  # fmt: skip
    mean, rstd, sums = emu.conv_epilogue(z, groups=2, channel_sums=True)
    assert (emu.last_plan["chunks"], emu.last_plan["chunk_pixels"]) == (11, 61)
    m_ref, r_ref = _group_stats(z, 2, 1e-5)
    assert_close(mean, m_ref, torch.float32, "mean")
    assert_close(rstd, r_ref, torch.float32, "rstd")
    torch.testing.assert_close(sums, _channel_sums(z), rtol=2e-6, atol=1e-6)


def test_scalar_path_on_strided_operands(emu):
    """Operands whose pixel rows are not 16-byte multiples (a slice of wider channels) take the one-channel lanes."""
    shape = (2, 40, 5, 6)
    wide = _randn((2, 44, 5, 6), torch.float16)
    res = wide[:, 2:42]  # pixel stride 44 channels, start 4 bytes in: not packable
    z = _randn(shape, torch.float16)
    temb = torch.randn(2, 40, dtype=torch.float16)
    ref = _reference(z, None, res, temb, 0.5)
    mean, _, _ = emu.conv_epilogue(z, residual=res, temb=temb, inv_scale=0.5, groups=8)
    assert emu.last_plan["vec"] == 1
    assert_within_torch_error(z, ref, ref.float().half(), "y")
    assert_close(mean, _group_stats(z, 8, 1e-5)[0], torch.float32, "mean")


def test_statistics_only_leave_z_unwritten(emu):
    """write=False (a producer asked only for statistics): z is read, never written."""
    z = _randn((2, 32, 7, 7), torch.bfloat16, mean=-4.0)
    before = z.clone()
    mean, _, sums = emu.conv_epilogue(z, write=False, groups=0, channel_sums=True)
    assert torch.equal(z, before) and mean.shape == (2, 0)
    torch.testing.assert_close(sums, _channel_sums(z), rtol=2e-5, atol=1e-3)


def test_nan_in_a_group_keeps_its_statistics_nan(emu):
    z = _randn((1, 16, 4, 4), torch.float32)
    z[0, 5, 2, 3] = float("nan")  # group 1 of 4
    mean, rstd, _ = emu.conv_epilogue(z, groups=4)
    assert mean[0, 1].isnan() and rstd[0, 1].isnan() and not mean[0, [0, 2, 3]].isnan().any()


def test_elementwise_only_and_reversed_schedule(emu):
    """No statistics: the pass alone; the threads of a block run in reverse too (a missing barrier would show)."""
    shape = (2, 64, 6, 6)
    z, sc = _randn(shape, torch.float16), _randn(shape, torch.float16)
    ref = _reference(z, sc, None, None, 1.0)
    emu.conv_epilogue(z, sc)
    assert_within_torch_error(z, ref, ref.float().half(), "y")
    emu.reverse_schedule(True)
    try:
        z = _randn(shape, torch.float16, mean=5.0)
        mean, _, _ = emu.conv_epilogue(z, groups=32)
    finally:
        emu.reverse_schedule(False)
    assert_close(mean, _group_stats(z, 32, 1e-5)[0], torch.float32, "mean")


def test_no_pixels_launch_nothing(emu):
    mean, rstd, sums = emu.conv_epilogue(_cl(torch.randn(2, 8, 0, 3)), groups=2)
    assert mean.shape == rstd.shape == (2, 2) and sums.shape == (2, 0, 2)


# ------------------------------------------------------------------------------------------------ statistics from sums


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("two_part", [False, True])
def test_group_norm_statistics_from_channel_sums(emu, frames, two_part):
    """group_norm_stats_from_sums_cuda: the GroupNorm statistics of cat([head, tail], 1) (an up block's skip concat,
    groups straddling the two parts) from each part's per-channel fp64 sums, groups spanning a video's frames; rows
    far from zero mean."""
    n, c_head, c_tail, groups, hw = 6, 24, 40 if two_part else 0, 8, 35
    x = torch.randn(n, c_head + c_tail, hw, dtype=torch.float64) * 0.5
    x = x + 30.0 * torch.randn(n, 1, 1, dtype=torch.float64)
    sums = torch.stack([x.sum(2), (x * x).sum(2)], dim=-1)
    head, tail = sums[:, :c_head], (sums[:, c_head:] if two_part else None)
    mean, rstd = emu.group_norm_stats_from_sums(head, groups, 1e-6, hw, tail, frames)
    video = x.reshape(n // frames, frames, groups, -1, hw).transpose(1, 2).reshape(n // frames, groups, -1)
    var, m = torch.var_mean(video, dim=2, unbiased=False)
    assert_close(mean, m, torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(var + 1e-6), torch.float32, "rstd")


def test_image_strides_past_2_31_elements(emu):
    """A shortcut whose image stride is 2^32 + 1024 elements (a batch of VAE-decoder activations passes 2^31): image 1
    is read at its 64-bit offset. The views lie in one lazily mapped buffer (8 GiB of address space, a few pages
    touched); a 32-bit offset would land on the -100s at element 1024."""
    n, c, oh, ow = 2, 8, 1, 2
    image_stride = 2**32 + 1024
    try:
        big = torch.empty(image_stride + 2048, dtype=torch.float16)
    except RuntimeError as exc:  # the address space (overcommit) refused
        pytest.skip(f"needs 8 GiB of virtual memory: {exc}")
    shortcut = big.as_strided((n, c, oh, ow), (image_stride, 1, ow * c, c))
    shortcut.copy_(torch.arange(n * c * oh * ow, dtype=torch.float16).reshape(n, c, oh, ow) + 1)
    big[1024 : 1024 + 16].fill_(-100.0)
    z = torch.zeros(n, c, oh, ow, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    emu.conv_epilogue(z, shortcut)
    torch.testing.assert_close(z, shortcut.clone(), rtol=0, atol=0)
