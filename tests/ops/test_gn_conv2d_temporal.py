"""ldmopt.ops.gn_conv2d as a temporal convolution: a (3, 1) kernel over a (video, channel, frame, pixel) view of
channels-last frames, with a per-frame time embedding and a per-frame gate on everything but the residual.

The reference is what diffusers computes: 5-D GroupNorm + SiLU + Conv3d with kernel (3, 1, 1), in fp64 (rule: within
2x PyTorch's own error in the input dtype, tests/tolerances.py). Odd frame counts, pixels and channels; 3 groups.
"""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.gn_conv2d import gn_silu_conv2d
from tests.tolerances import assert_close, assert_within_torch_error

DTYPES = [torch.float32, torch.float16]


def _frames(batch, frames, c, h, w, dtype):
    """Channels-last frames (batch*frames, C, H, W), as a fused spatial resnet block leaves them."""
    x = torch.randn(batch * frames, c, h, w, dtype=torch.float64) * 1.2 + 0.3
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


def _video_view(frames_cl, batch):
    """(batch, C, F, H*W) view of channels-last frames: itself channels-last, no copy."""
    bf, c, h, w = frames_cl.shape
    return frames_cl.permute(0, 2, 3, 1).reshape(batch, bf // batch, h * w, c).permute(0, 3, 1, 2)


def _as_5d(view, h, w):
    b, c, f, _ = view.shape
    return view.reshape(b, c, f, h, w)


def _params(c_in, c_out, dtype):
    gw = (torch.randn(c_in, dtype=torch.float64) * 0.4 + 1.0).to(dtype)
    gb = (torch.randn(c_in, dtype=torch.float64) * 0.4).to(dtype)
    w3 = (torch.randn(c_out, c_in, 3, 1, 1, dtype=torch.float64) / (3 * c_in) ** 0.5).to(dtype)
    b = (torch.randn(c_out, dtype=torch.float64) * 0.3).to(dtype)
    return gw, gb, w3, b


def _compose_5d(x5, gw, gb, groups, w3, b, padding, temb=None, gate=None, residual5=None, scale=1.0):
    """diffusers' ops: GroupNorm on the 5-D tensor, SiLU, Conv3d, + temb (B, C, F, 1, 1), gate, residual."""
    z = F.conv3d(F.silu(F.group_norm(x5, groups, gw, gb, 1e-6)), w3, b, padding=(padding, 0, 0))
    if temb is not None:
        z = z + temb[:, :, :, None, None]
    if gate is not None:
        z = z * (gate[:, None, :, None, None] if gate.dim() == 2 else gate[:, None, None, None, None])
    if residual5 is not None:
        z = z + residual5
    return z / scale


def _d(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("padding", [1, 0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_temporal_conv_with_frame_temb_and_statistics(padding, dtype):
    batch, frames, c, c_out, h, w = 2, 5, 9, 12, 3, 5
    x = _frames(batch, frames, c, h, w, dtype)
    view = _video_view(x, batch)
    assert view.is_contiguous(memory_format=torch.channels_last)
    gw, gb, w3, b = _params(c, c_out, dtype)
    oframes = frames + 2 * padding - 2
    temb = torch.randn(batch, oframes, c_out, dtype=dtype).transpose(1, 2)  # strided, as a permuted projection is
    with ldmopt.use_backend("triton"):
        y, (mean, rstd) = gn_silu_conv2d(
            view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (padding, 0), temb=temb, out_stats=(4, 1e-6)
        )
    x5 = _as_5d(view, h, w)
    ref = _compose_5d(x5.double(), _d(gw), _d(gb), 3, _d(w3), _d(b), padding, temb=_d(temb))
    lowp = _compose_5d(x5.float(), gw.float(), gb.float(), 3, w3.float(), b.float(), padding, temb=temb.float())
    lowp = lowp.to(dtype) if dtype != torch.float32 else lowp
    assert y.shape == (batch, c_out, oframes, h * w) and y.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(_as_5d(y, h, w), ref, lowp, f"temporal conv p{padding} {dtype}")
    # Statistics per (video, group) over every frame and pixel: what the next 5-D GroupNorm computes.
    yg = y.double().reshape(batch, 4, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")


@pytest.mark.parametrize("gate_shape", ["per frame", "per video"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_scales_all_but_the_residual(gate_shape, dtype):
    batch, frames, c, h, w = 2, 7, 6, 5, 3
    x = _frames(batch, frames, c, h, w, dtype)
    view = _video_view(x, batch)
    gw, gb, w3, b = _params(c, c, dtype)
    gate = torch.rand(batch, frames) if gate_shape == "per frame" else torch.rand(batch)
    gate[0, ...] = 0.0  # an image-only video (SVD's alpha = 1): output = residual exactly
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (1, 0), gate=gate, residual=view, output_scale=1.5)
    x5 = _as_5d(view, h, w)
    ref = _compose_5d(x5.double(), _d(gw), _d(gb), 3, _d(w3), _d(b), 1, gate=_d(gate), residual5=_d(x5), scale=1.5)
    f32 = [t.float() for t in (x5, gw, gb, w3, b)]
    lowp = _compose_5d(f32[0], *f32[1:3], 3, *f32[3:], 1, gate=gate, residual5=f32[0], scale=1.5).to(dtype)
    assert_within_torch_error(_as_5d(y, h, w), ref, lowp, f"gated temporal conv {gate_shape} {dtype}")
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (1, 0), gate=gate, residual=view)
    torch.testing.assert_close(y[0], view[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_autograd_of_the_5d_composition(dtype):
    batch, frames, c, h, w = 2, 5, 6, 3, 3
    x = _frames(batch, frames, c, h, w, dtype)
    gw, gb, w3, b = _params(c, c, dtype)
    temb = torch.randn(batch, c, frames, dtype=dtype)
    gate = torch.rand(batch, frames, dtype=torch.float32) + 0.2
    leaves = [x, gw, gb, w3, b, temb, gate]
    dy = torch.randn(batch, c, frames, h, w, dtype=torch.float64)

    def run(ts, fused):
        x, gw, gb, w3, b, temb, gate = ts
        view = _video_view(x, batch)
        if fused:
            with ldmopt.use_backend("triton"):
                y = gn_silu_conv2d(view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (1, 0), temb=temb, gate=gate,
                                   residual=view)  # fmt: skip
            return _as_5d(y, h, w)
        x5 = _as_5d(view, h, w)
        return _compose_5d(x5, gw, gb, 3, w3, b, 1, temb=temb, gate=gate.to(x5.dtype), residual5=x5)

    grads = {}
    # lowp: the composition in x's dtype, as the unfused model computes it (its convolution's input gradient rounded
    # to x's dtype, which ours reuses); an fp32 composition left fp16's dgn_bias 1.2x over the bound
    for name, cast in (("ours", None), ("ref", torch.float64), ("lowp", None)):
        ts = [(t.detach().to(cast) if cast else t.detach().clone()).requires_grad_() for t in leaves]
        run(ts, name == "ours").backward(dy.to(ts[0].dtype))
        grads[name] = [t.grad for t in ts]
    names = ("dx", "dgn_weight", "dgn_bias", "dweight", "dbias", "dtemb", "dgate")
    for name, leaf, ours, ref, lowp in zip(names, leaves, grads["ours"], grads["ref"], grads["lowp"]):
        assert ours.dtype == leaf.dtype and ours.shape == ref.shape, name
        lowp = lowp.to(leaf.dtype)
        # One rounding step of x's dtype, also for the fp32 gate, whose gradient sums products of the conv of the
        # activation rounded to x's dtype at other points than the unfused ops round it (seed 16 failed with fp32's).
        assert_within_torch_error(ours, ref, lowp, f"{name} {dtype}", ulp_dtype=dtype)


def test_gradcheck_reference_fp64():
    batch, frames, c, h, w = 2, 3, 4, 2, 3
    x = _frames(batch, frames, c, h, w, torch.float64)
    gw, gb, w3, b = _params(c, c, torch.float64)
    temb = torch.randn(batch, c, frames, dtype=torch.float64)
    gate = torch.rand(batch, frames, dtype=torch.float64) + 0.2
    inputs = [t.requires_grad_() for t in (x, gw, gb, w3, b, temb, gate)]

    def fn(x, gw, gb, w3, b, temb, gate):
        view = _video_view(x, batch)
        return gn_silu_conv2d(view, gw, gb, 2, 1e-6, w3[..., 0], b, 1, (1, 0), temb=temb, gate=gate, residual=view)

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_opcheck_with_gate_and_frame_temb():
    x = _video_view(_frames(2, 3, 4, 2, 3, torch.float32), 2)
    gw, gb, w3, b = _params(4, 6, torch.float32)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, 2, 1e-6)
    temb, gate = torch.randn(2, 6, 3), torch.rand(2, 3)
    residual = torch.randn(2, 6, 3, 6).contiguous(memory_format=torch.channels_last)
    args = (x.requires_grad_(), mean, rstd, gw, gb, w3[..., 0].requires_grad_(), b, temb, residual, None, None,
            None, gate.requires_grad_(), 2, "silu", 1, [1, 0], "none", "none", "none", 1.0, 3, 1e-6)  # fmt: skip
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    frames_cl = _frames(2, 3, 4, 3, 2, torch.float32).requires_grad_()
    gw, gb, w3, b = _params(4, 4, torch.float32)
    gate = torch.rand(2, 3)

    def fn(x):
        view = _video_view(x, 2)
        h, stats = gn_silu_conv2d(view, gw, gb, 2, 1e-6, w3[..., 0], b, 1, (1, 0), out_stats=(2, 1e-6))
        return gn_silu_conv2d(h, gw, gb, 2, 1e-6, w3[..., 0], b, 1, (1, 0), stats=stats, residual=view, gate=gate)

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(frames_cl)
    out.sum().backward()
    grad = frames_cl.grad.clone()
    frames_cl.grad = None
    eager = fn(frames_cl)
    eager.sum().backward()
    assert_close(out, eager.detach().double(), torch.float32, "compiled forward")
    assert_close(grad, frames_cl.grad.double(), torch.float32, "compiled backward")
