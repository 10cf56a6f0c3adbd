"""The ldmopt._C CUDA kernels, executed on CPU by the fiber emulator (tests/csrc/emulator.py), against fp64 references.

Same launch code and kernels as the GPU build, compiled by g++ with -DLDMOPT_EMULATE: indexing, vectorised and
scalar paths, split reductions, WMMA tile addressing and barrier placement are checked here; speed is not. Each
kernel also runs with the threads of a block scheduled in reverse, so a missing barrier changes the result.
"""

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from ldmopt.ops.group_norm import _bwd_torch, _fwd_torch
from ldmopt.ops.temporal_attention import CUDA_STATIC_SMEM_BYTES, cuda_smem_bytes
from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=[False, True], ids=["in-order", "reversed"])
def schedule(request, emu):
    emu.reverse_schedule(request.param)
    yield request.param
    emu.reverse_schedule(False)


# ------------------------------------------------------------------------------------------------ GroupNorm


def _channels_last(x):
    if x.dim() == 3:
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _gn_inputs(shape, channels_last, dtype, affine=True):
    x = (torch.randn(shape, dtype=torch.float64) * 1.7 + 0.6).to(dtype)
    if channels_last:
        x = _channels_last(x)
    c = shape[1]
    w = (torch.randn(c, dtype=torch.float64) * 0.8 + 1.0).to(dtype) if affine else None
    b = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype) if affine else None
    return x, w, b


def _d(t):
    return None if t is None else t.double()


def _f(t):
    return None if t is None else t.float()


def _check_group_norm(emu, x, w, b, groups, activation):
    dtype = x.dtype
    y, mean, rstd = emu.group_norm_fwd(x, w, b, groups, 1e-5, activation)
    assert y.stride() == x.stride()
    y64, mean64, rstd64 = _fwd_torch(x.double(), _d(w), _d(b), groups, 1e-5, activation or None)
    y32 = _fwd_torch(x.float(), _f(w), _f(b), groups, 1e-5, activation or None)[0].to(dtype)
    assert_within_torch_error(y, y64, y32, f"y {tuple(x.shape)} {dtype}")
    assert_close(mean, mean64, torch.float32, "mean")
    assert_close(rstd, rstd64, torch.float32, "rstd")

    dy = torch.randn_like(x)
    dx, dw, db = emu.group_norm_bwd(dy, x, w, b, mean, rstd, groups, activation)
    ref = _bwd_torch(dy.double(), x.double(), _d(w), _d(b), mean64, rstd64, groups, activation or None)
    low = _bwd_torch(dy.float(), x.float(), _f(w), _f(b), mean, rstd, groups, activation or None)
    assert dx.stride() == x.stride()
    assert_within_torch_error(dx, ref[0], low[0].to(dtype), f"dx {tuple(x.shape)} {dtype}")
    assert_within_torch_error(dw, ref[1], low[1], "dweight")
    assert_within_torch_error(db, ref[2], low[2], "dbias")
    return emu.last_plan


GN_CASES = [
    # (shape, groups): odd spatial sizes, channels per group not a power of two, 3-D and 5-D inputs
    ((2, 32, 5, 7), 8),  # S=35: channels-first runs scalar, channels-last packed
    ((1, 40, 8, 8), 4),  # 10 channels per group, S=64 packed in both layouts
    ((2, 24, 3, 4, 4), 6),  # (N, C, F, H, W)
    ((1, 36, 13), 3),  # 3-D; C=36 is not a multiple of the fp16 pack (8)
]


@pytest.mark.parametrize("shape,groups", GN_CASES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_norm_silu_affine(emu, shape, groups, channels_last, dtype):
    x, w, b = _gn_inputs(shape, channels_last, dtype)
    _check_group_norm(emu, x, w, b, groups, "silu")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_group_norm_plain_no_affine(emu, channels_last, dtype):
    x, w, b = _gn_inputs((2, 24, 6, 6), channels_last, dtype, affine=False)
    _check_group_norm(emu, x, w, b, 4, "")


def test_group_norm_fp32_affine_with_half_input(emu):
    # the kernels read weight/bias in their own dtype: fp32 parameters with an fp16 activation (autocast-style)
    x, w, b = _gn_inputs((2, 24, 5, 5), True, torch.float16)
    _check_group_norm(emu, x, w.float(), b.float() * 3, 4, "silu")


@pytest.mark.parametrize(
    "shape,groups,channels_last,dtype,expect",
    [
        # several spatial chunks per sample: the split reduction and its per-group merge
        ((1, 16, 24, 24), 4, True, torch.float16, {"vec": 8, "n_chunks": 2}),
        ((1, 4, 48, 48), 2, False, torch.float16, {"vec": 8, "n_chunks": 3}),
        ((1, 4, 48, 48), 2, True, torch.float32, {"vec": 4, "n_chunks": 3}),
        # more channel packs than threads: two channel blocks in the channels-last partial kernel
        ((1, 270, 2, 3), 3, True, torch.float32, {"vec": 1, "n_cblocks": 2}),
        # 160 channels in one group: the finalize loops over more channels than threads
        ((1, 160, 3, 3), 1, True, torch.bfloat16, {"vec": 8}),
    ],
)
def test_group_norm_launch_plans(emu, shape, groups, channels_last, dtype, expect):
    x, w, b = _gn_inputs(shape, channels_last, dtype)
    plan = _check_group_norm(emu, x, w, b, groups, "silu")
    assert {k: plan[k] for k in expect} == expect, plan


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_group_norm_unaligned_pointer_takes_scalar_path(emu, channels_last):
    x, w, b = _gn_inputs((2, 16, 4, 4), channels_last, torch.float16)
    plan = _check_group_norm(emu, emulator.misaligned(x), w, b, 4, "silu")
    assert plan["vec"] == 1


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_group_norm_schedules(emu, schedule, channels_last):
    x, w, b = _gn_inputs((2, 16, 24, 24) if channels_last else (1, 4, 48, 48), channels_last, torch.float32)
    _check_group_norm(emu, x, w, b, 4 if channels_last else 2, "silu")


def _apply_reference(x, mean, rstd, w, b, groups, activation, cd):
    """act((x - mean) * rstd * w + b) in ``cd``, per-(n, group) statistics, any rank."""
    n, c = x.shape[:2]
    z = (x.to(cd).reshape(n, groups, -1) - mean.to(cd)[..., None]) * rstd.to(cd)[..., None]
    z = z.reshape(x.shape)
    shape = (c, *[1] * (x.dim() - 2))
    z = z if w is None else z * w.to(cd).reshape(shape)
    z = z if b is None else z + b.to(cd).reshape(shape)
    return F.silu(z) if activation == "silu" else z


@pytest.mark.parametrize("shape,groups", [*GN_CASES, ((1, 16, 24, 24), 4)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_norm_statistics_and_apply_alone(emu, shape, groups, channels_last, dtype):
    """group_norm_stats_cuda and group_norm_apply_cuda: the forward's passes split in two, the apply reading
    statistics it did not compute (shifted from the input's own, so a kernel that recomputed them would fail)."""
    x, w, b = _gn_inputs(shape, channels_last, dtype)
    x = x + 3.0  # a mean far from zero: the statistics' merge must not lose the variance
    mean, rstd = emu.group_norm_stats(x, groups, 1e-5)
    _, mean64, rstd64 = _fwd_torch(x.double(), None, None, groups, 1e-5, None)
    assert_close(mean, mean64, torch.float32, "mean")
    assert_close(rstd, rstd64, torch.float32, "rstd")
    given_mean = mean64 + torch.rand_like(mean64) - 0.5
    given_rstd = rstd64 * (0.5 + torch.rand_like(rstd64))
    for activation in ("silu", ""):
        y = emu.group_norm_apply(x, given_mean.float(), given_rstd.float(), w, b, groups, activation)
        assert y.stride() == x.stride()
        y64 = _apply_reference(x, given_mean, given_rstd, w, b, groups, activation, torch.float64)
        y32 = _apply_reference(x, given_mean.float(), given_rstd.float(), w, b, groups, activation, torch.float32)
        assert_within_torch_error(y, y64, y32.to(dtype), f"apply y {tuple(x.shape)} {dtype} {activation!r}")


@pytest.mark.parametrize("shape, groups", [((1, 16, 24, 24), 4), ((1, 4, 48, 48), 2)])
def test_group_norm_statistics_of_uneven_chunks_far_from_zero(emu, shape, groups):
    # Chunks of 256 + 256 + 64 and 1024 + 1024 + 256 pixels, the mean far above the spread: the first (pivot) mean
    # must weight the short last chunk by its pixels, or the shifted sums turn into a difference of large fp32 sums.
    x = (1000 + torch.randn(shape, dtype=torch.float64)).float().contiguous(memory_format=torch.channels_last)
    mean, rstd = emu.group_norm_stats(x, groups, 1e-5)
    assert emu.last_plan["n_chunks"] > 1 and shape[2] * shape[3] % emu.last_plan["s_per_chunk"]
    var64, mean64 = torch.var_mean(x.double().reshape(shape[0], groups, -1), dim=2, unbiased=False)
    assert_close(mean, mean64, torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(var64 + 1e-5), torch.float32, "rstd")


@pytest.mark.parametrize("shape,groups", [((1, 8, 3, 3), 2), ((2, 12, 5, 7), 4), ((1, 16, 24, 24), 4)])
@pytest.mark.parametrize("value", [1000.1, -37.3])
def test_group_norm_statistics_of_constant_groups(emu, shape, groups, value):
    """A constant group's mean is its value and its variance 0: the finalize's first mean (sum / count in fp32) rounds
    away from the value, and without its residual correction that rounding read as variance (rstd ~1e4, not
    1/sqrt(eps) ~ 316 for eps 1e-5: an output of +-1 where stock gives 0 for a tiny eps). A NaN keeps rstd NaN."""
    x = _channels_last(torch.full(shape, value))
    mean, rstd = emu.group_norm_stats(x, groups, 1e-5)
    torch.testing.assert_close(mean, torch.full_like(mean, value), rtol=0, atol=0)
    torch.testing.assert_close(rstd, torch.full_like(rstd, 1e-5**-0.5), rtol=1e-5, atol=0)
    x[0, 0, 0, 0] = float("nan")
    _, rstd = emu.group_norm_stats(x, groups, 1e-5)
    assert rstd[0, 0].isnan() and not rstd[0, 1:].isnan().any()


def test_group_norm_apply_unaligned_and_without_affine(emu):
    x, _, _ = _gn_inputs((2, 16, 5, 5), True, torch.float16, affine=False)
    x = emulator.misaligned(x)
    mean, rstd = torch.randn(2, 4), torch.rand(2, 4) + 0.5
    y = emu.group_norm_apply(x, mean, rstd, None, None, 4, "silu")
    assert emu.last_plan["vec"] == 1
    ref = _apply_reference(x, mean, rstd, None, None, 4, "silu", torch.float64)
    assert_within_torch_error(y, ref, _apply_reference(x, mean, rstd, None, None, 4, "silu", torch.float32).half(), "y")


@pytest.mark.parametrize(
    "c_head,c_tail,groups,vec",
    [
        ((16, 24, 8, {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8})),  # packs of 16 bytes in both parts
        ((12, 20, 4, {torch.float32: 4, torch.float16: 1, torch.bfloat16: 1})),  # 12 % 8: one element at a time
        ((8, 5, 13, {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1})),  # C = 13, a group per channel
        ((3, 5, 2, {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1})),  # group 0 straddles the parts
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_norm_apply_over_two_parts(emu, schedule, c_head, c_tail, groups, vec, dtype):
    """group_norm_apply_cuda with x_tail: act(group_norm(cat([x, x_tail], 1))) from given statistics, each
    channel read from the part it lies in (an up block's hidden state and skip), the concatenation never written."""
    head, _, _ = _gn_inputs((2, c_head, 5, 7), True, dtype)
    tail, w, b = _gn_inputs((2, c_tail, 5, 7), True, dtype)
    tail = tail - 1.5  # other values than the head's: reading the wrong part shows
    w, b = _gn_inputs((1, c_head + c_tail, 1, 1), False, dtype)[1:]
    mean, rstd = torch.randn(2, groups, dtype=torch.float64), torch.rand(2, groups, dtype=torch.float64) + 0.5
    cat = torch.cat([head, tail], 1)
    for activation, affine in (("silu", (w, b)), ("", (None, None))):
        y = emu.group_norm_apply_parts(head, tail, mean.float(), rstd.float(), *affine, groups, activation)
        assert y.is_contiguous(memory_format=torch.channels_last) and emu.last_plan["vec"] == vec[dtype]
        y64 = _apply_reference(cat, mean, rstd, *affine, groups, activation, torch.float64)
        y32 = _apply_reference(cat, mean.float(), rstd.float(), *affine, groups, activation, torch.float32)
        assert_within_torch_error(y, y64, y32.to(dtype), f"two-part apply {c_head}+{c_tail} {dtype} {activation!r}")


@pytest.mark.parametrize(
    "c_head,c_tail,groups,hw,vec",
    [
        ((16, 24, 8, (5, 7), {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8})),  # 16-byte packs in both
        ((12, 20, 4, (5, 7), {torch.float32: 4, torch.float16: 1, torch.bfloat16: 1})),  # 12 % 8: one at a time
        ((8, 5, 13, (3, 3), {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1})),  # C = 13, a group a channel
        ((3, 5, 2, (5, 7), {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1})),  # group 0 straddles the parts
        ((320, 320, 32, (9, 11), {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8})),  # SD1.5's last up block
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_norm_statistics_over_two_parts(emu, schedule, c_head, c_tail, groups, hw, vec, dtype):
    """group_norm_stats_cuda with x_tail: the per-(n, group) mean and rstd of cat([x, x_tail], 1), each channel read
    from the part it lies in (an up block's hidden state and skip), the concatenation never written."""
    head = _gn_inputs((2, c_head, *hw), True, dtype)[0] + 3.0  # means far from zero, and unlike in the two parts
    tail = _gn_inputs((2, c_tail, *hw), True, dtype)[0] * 2.0 - 1.5
    mean, rstd = emu.group_norm_stats_parts(head, tail, groups, 1e-5)
    assert emu.last_plan["vec"] == vec[dtype]
    _, mean64, rstd64 = _fwd_torch(torch.cat([head, tail], 1).double(), None, None, groups, 1e-5, None)
    assert_close(mean, mean64, torch.float32, f"two-part mean {c_head}+{c_tail} {dtype}")
    assert_close(rstd, rstd64, torch.float32, f"two-part rstd {c_head}+{c_tail} {dtype}")


@pytest.mark.parametrize("misaligned_part", ["head", "tail"])
def test_group_norm_two_part_passes_with_one_part_unaligned(emu, misaligned_part):
    """Either part off 16-byte alignment: the statistics and the apply read one element at a time (the emulator
    checks every packed access's alignment, so a plan that ignored the tail's pointer would fail here)."""
    head = _gn_inputs((2, 16, 5, 5), True, torch.float16)[0]
    tail = _gn_inputs((2, 8, 5, 5), True, torch.float16)[0] - 2.0
    if misaligned_part == "head":
        head = emulator.misaligned(head)
    else:
        tail = emulator.misaligned(tail)
    cat = torch.cat([head, tail], 1)
    mean, rstd = emu.group_norm_stats_parts(head, tail, 6, 1e-5)
    assert emu.last_plan["vec"] == 1
    _, mean64, rstd64 = _fwd_torch(cat.double(), None, None, 6, 1e-5, None)
    assert_close(mean, mean64, torch.float32, "mean")
    assert_close(rstd, rstd64, torch.float32, "rstd")
    y = emu.group_norm_apply_parts(head, tail, mean64.float(), rstd64.float(), None, None, 6, "silu")
    assert emu.last_plan["vec"] == 1
    y64 = _apply_reference(cat, mean64, rstd64, None, None, 6, "silu", torch.float64)
    y32 = _apply_reference(cat, mean64.float(), rstd64.float(), None, None, 6, "silu", torch.float32)
    assert_within_torch_error(y, y64, y32.half(), f"two-part apply, {misaligned_part} unaligned")


# ------------------------------------------------------------------------------------------------ layer norm statistics


@pytest.mark.parametrize("m,c", [(37, 40), (5, 320), (3, 1152), (9, 8), (1, 1), (4, 257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_row_statistics(emu, m, c, dtype):
    """Rows far from zero mean (the variance must not cancel), odd widths that take the scalar path, and a row
    stride wider than the row (a slice of a wider activation)."""
    wide = torch.randn(m, c + 24, dtype=torch.float64) * 0.7 + 40.0 * torch.randn(m, 1, dtype=torch.float64)
    for x in (wide[:, :c].to(dtype), wide[:, :c].to(dtype).contiguous()):
        stats = emu.layer_norm_stats(x, 1e-5)
        var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
        assert_close(stats[0], mean, torch.float32, f"mean {m}x{c} {dtype}")
        assert_close(stats[1], torch.rsqrt(var + 1e-5), torch.float32, f"rstd {m}x{c} {dtype}")
    packed = emu.layer_norm_stats(wide[:, :c].to(dtype).contiguous(), 1e-5)
    assert emu.last_plan["vec"] == (16 // x.element_size() if c % (16 // x.element_size()) == 0 else 1)
    assert packed.isfinite().all()


def test_statistics_of_rows_and_groups_with_nan_stay_nan(emu):
    """A NaN in a row (group) makes its mean and rstd NaN, as PyTorch's; a clamp with fmaxf made rstd 1/sqrt(eps)."""
    x = torch.randn(4, 40)
    x[1, 7] = float("nan")
    stats = emu.layer_norm_stats(x, 1e-5)
    assert stats[:, 1].isnan().all() and not stats[:, [0, 2, 3]].isnan().any()
    g = _channels_last(torch.randn(2, 16, 4, 4))
    g[1, 5, 2, 3] = float("nan")  # group 1 (channels 4-7) of image 1
    mean, rstd = emu.group_norm_stats(g, 4, 1e-5)
    assert mean[1, 1].isnan() and rstd[1, 1].isnan() and (mean.isnan().sum(), rstd.isnan().sum()) == (1, 1)


def test_layer_norm_row_statistics_unaligned_rows(emu):
    x = torch.randn(6, 40 * 3, dtype=torch.float16)[:, 1:41]  # row starts 2 bytes past 16-byte alignment
    stats = emu.layer_norm_stats(x, 1e-6)
    assert emu.last_plan["vec"] == 1
    var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
    assert_close(stats[0], mean, torch.float32, "mean")
    assert_close(stats[1], torch.rsqrt(var + 1e-6), torch.float32, "rstd")


def test_layer_norm_row_statistics_of_no_rows_launch_nothing(emu):
    # the emulator refuses an empty grid as CUDA does: zero rows must return before the launch
    assert emu.layer_norm_stats(torch.randn(0, 24), 1e-5).shape == (2, 0)


def test_grid_sizes_saturate_instead_of_wrapping(emu):
    grid_x = emu.lib.emu_grid_x
    grid_x.restype, grid_x.argtypes = ctypes.c_uint, [ctypes.c_int64]
    assert [grid_x(n) for n in (0, 7, 2**31 - 1)] == [0, 7, 2**31 - 1]
    # past 2^32 a plain cast would wrap to a small grid that skips work; saturated, the launch fails loudly
    assert grid_x(2**32 + 5) == 2**32 - 1 and grid_x(2**40) == 2**32 - 1


# ------------------------------------------------------------------------------------------------ temporal attention


def _qkv(b, f, n, h, d, dtype, layout):
    if layout == "split":  # diffusers' (B*N, F, H*D) projections viewed as (B, F, N, H, D)
        return tuple(
            torch.randn(b * n, f, h * d, dtype=torch.float64).to(dtype).view(b, n, f, h, d).transpose(1, 2)
            for _ in range(3)
        )
    if layout == "packed":  # one fused to_qkv output (B, F, N, 3, H, D)
        qkv = torch.randn(b, f, n, 3, h, d, dtype=torch.float64).to(dtype)
        return qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    # head dim not unit-stride: the scalar staging path
    return tuple(torch.randn(b, f, n, d, h, dtype=torch.float64).to(dtype).transpose(3, 4) for _ in range(3))


def _attention(q, k, v, scale, dtype=None):
    q, k, v = (t.permute(0, 2, 3, 1, 4) for t in (q, k, v))  # (B, N, H, F, D)
    if dtype is None:
        p = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
        out = p @ v
    else:
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale)
    return out.permute(0, 3, 1, 2, 4)


def _check_attention(emu, q, k, v, out=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    expected_strides = torch.empty_like(q).stride() if out is None else out.stride()
    out = emu.temporal_attention_fwd(q, k, v, scale, out)
    assert out.shape == q.shape and out.stride() == expected_strides
    ref = _attention(q.double(), k.double(), v.double(), scale)
    low = _attention(q, k, v, scale, q.dtype)
    assert_within_torch_error(out, ref, low, f"out {tuple(q.shape)} {q.dtype}")
    return emu.last_plan


TA_CASES = [
    # (B, F, N, H, D, layout)
    (1, 14, 3, 2, 40, "split"),  # SVD frame count; head dim 40 padded to 48 in shared memory only
    (2, 5, 2, 3, 24, "packed"),  # slices of a packed qkv tensor
    (1, 25, 2, 1, 72, "split"),  # SVD-XT: F=25 padded to 32, Latte's head dim 72
    (1, 3, 1, 2, 20, "strided-d"),  # head dim not contiguous
    (1, 1, 2, 2, 8, "split"),  # a single frame
]


@pytest.mark.parametrize("b,f,n,h,d,layout", TA_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_temporal_attention(emu, b, f, n, h, d, layout, dtype):
    _check_attention(emu, *_qkv(b, f, n, h, d, dtype, layout))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_temporal_attention_large_logits(emu, dtype):
    # Scaled logits up to about 50 (raw q.k near 400): finite in fp32 softmax, but only with the running maximum taken
    # over the scaled scores exp2 sees; a maximum of the raw ones underflows every exp2 to 0 (a NaN row).
    q, k, v = _qkv(1, 14, 3, 2, 64, dtype, "split")
    out = _check_attention(emu, (q.double() * 4).to(dtype), (k.double() * 4).to(dtype), v)
    assert out["blocks"] >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_temporal_attention_limits(emu, dtype):
    # F=64 and head_dim=256, the largest supported: one sequence per block, the most shared memory
    plan = _check_attention(emu, *_qkv(1, 64, 1, 1, 256, dtype, "split"))
    assert plan["per_block"] == 1 and plan["f_pad"] == 64 and plan["d_pad"] == 256


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_temporal_attention_smem_mirror_matches_make_plan(emu, dtype):
    # ldmopt/ops/temporal_attention.py refuses the cuda backend from its own copy of make_plan's shared memory
    # formula; every F and head_dim the kernel serves, with 1, a few and many sequences (per_block's three regimes)
    for n_seq in (1, 3, 17, 10**6):
        for f in range(1, 65):
            for d in range(1, 257):
                smem = emu.temporal_attention_plan((1, f, n_seq, 1, d), dtype)["smem_bytes"]
                assert cuda_smem_bytes(f, d, dtype, n_seq) == smem, (f, d, dtype, n_seq)
    assert emu.temporal_attention_plan((1, 64, 1, 1, 256), torch.float32)["smem_bytes"] == 217_088
    assert emu.temporal_attention_plan((1, 16, 1, 1, 64), dtype)["static_smem_bytes"] == CUDA_STATIC_SMEM_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_temporal_attention_into_strided_out(emu, dtype):
    # the out= variant: a caller's output whose head dim is not contiguous (scalar stores)
    q, k, v = _qkv(1, 6, 3, 2, 16, dtype, "split")
    out = torch.empty(1, 6, 3, 16, 2, dtype=dtype).transpose(3, 4)
    _check_attention(emu, q, k, v, out)


def test_temporal_attention_partial_last_block(emu, schedule):
    # 17 sequences, 11 per block: the second block has 6 real sequences and 5 missing ones
    plan = _check_attention(emu, *_qkv(1, 4, 17, 1, 16, torch.float16, "split"))
    assert plan["blocks"] == 2 and plan["per_block"] == 11


def test_group_norm_apply_past_the_grid_cap(emu):
    # A VAE-decoder-sized map: 16.8M packs of 4, more than the 2^16 blocks x 256 threads the launch caps the grid at,
    # so each thread strides over several packs; every element written (the output is poisoned first).
    x = torch.randn(1, 16, 2050, 2048)
    mean, rstd = torch.full((1, 4), 0.5), torch.full((1, 4), 2.0)
    y = emu.group_norm_apply(x, mean, rstd, None, None, 4, "")
    assert x.numel() // emu.last_plan["vec"] > 2**24
    assert not y.isnan().any()
    tail = slice(2**26 - 4096, None)  # past the first 2^24 packs
    torch.testing.assert_close(y.reshape(-1)[tail], (x.reshape(-1)[tail] - 0.5) * 2.0, rtol=1e-6, atol=1e-6)
