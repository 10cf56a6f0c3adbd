"""Column offsets past 2^31 elements: a column-strided view whose last column lies 2^31 or more elements from its first
(an NCHW map read as [HW, C], batch 1, C x HW >= 2^31: column stride HW) must be read with int64 column offsets.

The views live in one fp16 buffer of 2^32 + a few elements (8 GiB of address space; torch.empty commits no pages, only
the few KB written are touched), laid out so that an offset wrapped to int32 would still land inside the buffer, on a
sentinel: a kernel that wraps reads wrong values instead of crashing. Values are small multiples of 1/8, so every sum
and product the kernels form is exact and the fp64 references are tight."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt import ops
from tests.tolerances import assert_close

#: Column stride: column 2 lies 2 S = 3 x 2^30 >= 2^31 elements from column 0; int32 wraps that to 2 S - 2^32 = -2^30.
S = 3 * 2**29
#: Storage offset of the views' column 0, so that a wrapped column 2 lands at BASE + 2 S - 2^32 = 0 + the view's slot.
BASE = 2**32 - 2 * S
C = 3  # columns per view: the third is the one past 2^31
SLOT = 64  # elements per view and column (rows, at unit stride)
SLOTS = 8
SENTINEL = 512.0


@pytest.fixture
def buffer():
    try:
        buf = torch.empty(BASE + (C - 1) * S + SLOTS * SLOT, dtype=torch.float16)
    except RuntimeError as exc:  # the address space (overcommit) refused
        pytest.skip(f"needs 8 GiB of virtual memory for a 2^32-element buffer: {exc}")
    buf[: SLOTS * SLOT] = SENTINEL  # where a column offset wrapped to int32 reads
    yield buf
    del buf


def _view(buf, slot, shape, values):
    """A [..., rows, C] view with unit row stride and column stride S (a [B, T, C] view: sample stride T) holding
    ``values``."""
    *lead, rows, cols = shape
    assert cols == C and rows * (lead[0] if lead else 1) <= SLOT
    strides = (rows, 1, S) if lead else (1, S)
    view = buf.as_strided(shape, strides, BASE + slot * SLOT)
    view.copy_(values)
    return view


def _eighths(shape, low=-8, high=8):
    return torch.randint(low, high + 1, shape).to(torch.float16) / 8


def _ramp(shape):
    """Rows with distinct entries (no zero variance): column c near c - 1, plus at most 1/4 either way."""
    return torch.arange(C, dtype=torch.float16) - 1 + _eighths(shape, -2, 2)


def test_layer_norm_stats(buffer):
    x = _view(buffer, 0, (16, C), _ramp((16, C)))
    with ldmopt.use_backend("triton"):
        stats = ops.layer_norm_stats(x, eps=1e-5)
    x64 = x.double()
    mean = x64.mean(-1)
    rstd = ((x64 - mean[:, None]).square().mean(-1) + 1e-5).rsqrt()
    assert_close(stats, torch.stack([mean, rstd]), torch.float32, "layer_norm_stats")


@pytest.mark.parametrize("gated", [False, True])
def test_adaln_modulate(buffer, gated):
    b, t = 2, 5
    scale = _view(buffer, 0, (b, C), _eighths((b, C), -4, 4))
    shift = _view(buffer, 1, (b, C), _eighths((b, C)))
    if gated:  # s = residual + gate[b] * x: the residual carries the ramp
        x = _view(buffer, 2, (b, t, C), _eighths((b, t, C), -4, 4))
        residual = _view(buffer, 3, (b, t, C), _ramp((b, t, C)))
        gate = _view(buffer, 4, (b, C), _eighths((b, C), -2, 2))
    else:  # s = x, read again by the backward
        x = _view(buffer, 2, (b, t, C), _ramp((b, t, C)))
        residual = gate = None
    dy = _view(buffer, 5, (b, t, C), _eighths((b, t, C)))
    dsum = _view(buffer, 6, (b, t, C), _eighths((b, t, C)))
    leaves = [v for v in (x, scale, shift, residual, gate) if v is not None]
    for v in leaves:
        v.requires_grad_()
    with ldmopt.use_backend("triton"):
        if gated:
            y, s = ops.adaln_modulate(x, scale, shift, residual=residual, gate=gate, return_residual=True)
            grads = torch.autograd.grad((y, s), leaves, (dy, dsum))
        else:
            y = ops.adaln_modulate(x, scale, shift)
            grads = torch.autograd.grad(y, leaves, dy)

    ref = [v.detach().double().requires_grad_() for v in leaves]
    x64, scale64, shift64 = ref[:3]
    s64 = ref[3] + ref[4][:, None] * x64 if gated else x64
    y64 = F.layer_norm(s64, (C,), eps=1e-6) * (1 + scale64[:, None]) + shift64[:, None]
    assert_close(y, y64, torch.float16, "adaln y")
    if gated:
        assert_close(s, s64, torch.float16, "adaln residual sum")
        expect = torch.autograd.grad((y64, s64), ref, (dy.double(), dsum.double()))
    else:
        expect = torch.autograd.grad(y64, ref, dy.double())
    for name, g, e in zip(("dx", "dscale", "dshift", "dresidual", "dgate"), grads, expect):
        assert_close(g, e, torch.float16, f"adaln {name}")


def test_linear(buffer):
    b, t, n = 2, 5, C  # x [B, T, K=3] and the weight [N=3, K] column-strided along K
    x = _view(buffer, 0, (b, t, C), _eighths((b, t, C)))
    weight = _view(buffer, 1, (n, C), _eighths((n, C)))
    gate = _view(buffer, 2, (b, n), _eighths((b, n)))
    residual = _view(buffer, 3, (b, t, n), _eighths((b, t, n)))
    dy = _view(buffer, 4, (b, t, n), _eighths((b, t, n)))
    bias = _eighths((n,))
    leaves = [x, weight, bias, gate, residual]
    for v in leaves:
        v.requires_grad_()
    with ldmopt.use_backend("triton"):
        y = ops.linear(x, weight, bias, gate=gate, residual=residual)
        grads = torch.autograd.grad(y, leaves, dy)

    ref = [v.detach().double().requires_grad_() for v in leaves]
    x64, w64, b64, g64, r64 = ref
    y64 = r64 + g64[:, None] * F.linear(x64, w64, b64)
    assert_close(y, y64, torch.float16, "linear y")
    expect = torch.autograd.grad(y64, ref, dy.double())
    for name, g, e in zip(("dx", "dweight", "dbias", "dgate", "dresidual"), grads, expect):
        assert_close(g, e, torch.float16, f"linear {name}")


def test_geglu(buffer):
    b, t, i = 2, 5, C  # x [B, T, K=3], the weight [2I=6, K] and dy [B, T, I=3] column-strided
    x = _view(buffer, 0, (b, t, C), _eighths((b, t, C)))
    weight = _view(buffer, 1, (2 * i, C), _eighths((2 * i, C)))
    dy = _view(buffer, 2, (b, t, i), _eighths((b, t, i)))
    bias = _eighths((2 * i,))
    leaves = [x, weight, bias]
    for v in leaves:
        v.requires_grad_()
    with ldmopt.use_backend("triton"):
        y = ops.geglu(x, weight, bias)
        grads = torch.autograd.grad(y, leaves, dy)

    ref = [v.detach().double().requires_grad_() for v in leaves]
    h, g = F.linear(*ref).chunk(2, dim=-1)
    y64 = h * F.gelu(g)
    assert_close(y, y64, torch.float16, "geglu y")
    expect = torch.autograd.grad(y64, ref, dy.double())
    for name, g, e in zip(("dx", "dweight", "dbias"), grads, expect):
        assert_close(g, e, torch.float16, f"geglu {name}")


def _nchw(buf, slot, shape, values):
    """An [N, C, H, W] (or [C_out, C, kh, kw]) view with channel stride S, the other dims packed in the slot."""
    n, c, h, w = shape
    assert c == C and n * h * w <= SLOT
    view = buf.as_strided(shape, (h * w, S, w, 1), BASE + slot * SLOT)
    view.copy_(values)
    return view


@pytest.mark.parametrize("strided", ["all", "weight", "temb", "residual", "shortcut"])
def test_gn_conv2d(buffer, strided):
    # A plain 3x3 conv whose weight, temb, residual, 1x1 shortcut input and shortcut weight are channel-strided
    # (reach 2 S >= 2^31 on a tiny image), all of them or one at a time (each operand's reach must set the int64
    # indexing by itself); x itself must be channels-last.
    n, h, w = 1, 4, 4
    x = _eighths((n, C, h, w), -4, 4).contiguous(memory_format=torch.channels_last)
    values = {
        "weight": _eighths((C, C, 3, 3), -2, 2),
        "temb": _eighths((n, C)),
        "residual": _eighths((n, C, h, w)),
        "shortcut_x": _eighths((n, C, h, w), -4, 4),
        "shortcut_w": _eighths((C, C, 1, 1), -4, 4),
    }
    huge = {
        "weight": lambda v: _nchw(buffer, 0, v.shape, v),
        "temb": lambda v: _view(buffer, 1, v.shape, v),
        "residual": lambda v: _nchw(buffer, 2, v.shape, v),
        "shortcut_x": lambda v: _nchw(buffer, 3, v.shape, v),
        "shortcut_w": lambda v: _nchw(buffer, 4, v.shape, v),
    }
    ops_in = {
        name: huge[name](v) if strided in ("all", name, name.rsplit("_", 1)[0]) else v.clone()
        for name, v in values.items()
    }
    bias = _eighths((C,))
    with ldmopt.use_backend("triton"):
        shortcut = (ops_in["shortcut_x"], ops_in["shortcut_w"], None)
        y = ops.gn_silu_conv2d(x, None, None, 1, 1e-5, ops_in["weight"], bias, normalize=False, temb=ops_in["temb"],
                               residual=ops_in["residual"], shortcut=shortcut)  # fmt: skip

    d = [t.double() for t in (x, values["weight"], bias, values["temb"], values["residual"])]
    sc = F.conv2d(values["shortcut_x"].double(), values["shortcut_w"].double())
    y64 = F.conv2d(d[0], d[1], d[2], padding=1) + d[3][:, :, None, None] + sc + d[4]
    assert_close(y, y64, torch.float16, f"gn_conv2d y, {strided} strided")


def test_rms_norm_and_layer_norm_apply(buffer):
    from ldmopt.ops.layer_norm_apply import layer_norm_apply

    x = _view(buffer, 0, (16, C), _ramp((16, C)))
    weight = _eighths((C,), 4, 12)
    x64 = x.double()
    with ldmopt.use_backend("triton"):
        y = ops.rms_norm(x, weight, eps=1e-5)
    rms = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert_close(y, rms, torch.float16, "rms_norm")
    mean = x64.mean(-1)
    stats = torch.stack([mean, ((x64 - mean[:, None]).square().mean(-1) + 1e-5).rsqrt()]).float()
    with ldmopt.use_backend("triton"):
        h = layer_norm_apply(x, stats, weight, None, None, 1, torch.float16)
    normed = (x64 - stats[0].double()[:, None]) * stats[1].double()[:, None] * weight.double()
    assert_close(h, normed, torch.float16, "layer_norm_apply")


def _frames(buf, slot, shape, values):
    """A (B, F, N, H, D) view with frame stride S, the other dims packed in the slot."""
    b, f, n, h, d = shape
    assert f == C and b * n * h * d <= SLOT
    view = buf.as_strided(shape, (n * h * d, S, h * d, d, 1), BASE + slot * SLOT)
    view.copy_(values)
    return view


def _attention64(q, k, v, scale):
    q, k, v = (t.permute(0, 2, 3, 1, 4) for t in (q, k, v))  # (B, N, H, F, D)
    p = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
    return (p @ v).permute(0, 3, 1, 2, 4)


def test_temporal_attention(buffer):
    # The kernels directly, then through the op (which once refused sequences spanning 2^31 elements).
    from ldmopt.kernels.temporal_attention import temporal_attention_bwd, temporal_attention_fwd

    shape = (1, C, 2, 1, 16)  # (B, F=3, N, H, D): frame 2 lies 2 S >= 2^31 elements from frame 0
    scale = 16**-0.5
    q, k, v, dout = (_frames(buffer, slot, shape, _eighths(shape)) for slot in range(4))
    out = _frames(buffer, 4, shape, torch.full(shape, float("nan")))
    temporal_attention_fwd(q, k, v, scale, out)
    grads = temporal_attention_bwd(dout, q, k, v, scale)

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = _attention64(*ref, scale)
    assert_close(out, o64, torch.float16, "temporal attention out")
    expect = torch.autograd.grad(o64, ref, dout.double())
    for name, g, e in zip(("dq", "dk", "dv"), grads, expect):
        assert_close(g, e, torch.float16, f"temporal attention {name}")
    with ldmopt.use_backend("triton"):
        through_op = ops.temporal_attention(q, k, v, scale=scale)
    assert_close(through_op, o64, torch.float16, "temporal attention through the op")


def test_group_norm_statistics_of_chunks_past_2_31():
    # A (1, 2, 16384) map with spatial stride 2^18 (a channels-last view of a huge image): the statistics pass
    # splits it into 16 chunks of 1024 positions, and chunk k starts k x 2^28 elements in, past 2^31 from k = 8. Each
    # chunk loads its first row as the Welford shift: that offset must be formed in int64 too.
    positions, stride = 16384, 2**18
    try:
        buf = torch.empty(positions * stride + 64, dtype=torch.float16)
    except RuntimeError as exc:
        pytest.skip(f"needs 8 GiB of virtual memory: {exc}")
    x = buf.as_strided((1, 2, positions), (2, 1, stride))
    values = (_eighths((1, 2, positions)) + torch.tensor([1.0, -2.0], dtype=torch.float16)[:, None]).to(torch.float16)
    x.copy_(values)
    with ldmopt.use_backend("triton"):
        mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, 1, 1e-5)
    ref = values.double().reshape(1, -1)
    assert_close(mean, ref.mean(1, keepdim=True).float(), torch.float32, name="mean")
    assert_close(rstd, torch.rsqrt(ref.var(1, unbiased=False, keepdim=True) + 1e-5).float(), torch.float32, name="rstd")
    del x, buf
