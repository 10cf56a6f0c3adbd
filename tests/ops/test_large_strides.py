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
