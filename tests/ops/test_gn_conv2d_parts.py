"""ldmopt.ops.gn_conv2d with a two-part input: ``x=(hidden, skip)`` stands for ``cat([hidden, skip], 1)`` (a UNet up
block's skip connection), read where the parts lie (Triton interpreter), against the unfused composition on the
materialised concatenation.

Channel counts are odd and the split is not a multiple of the tile's channel block, so that tiles straddle nothing
but GroupNorm groups straddle the parts (C = 7 + 9 in 4 groups of 4: the second group holds channels 4..7).
"""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops import gn_conv2d as op_module
from ldmopt.ops.gn_conv2d import gn_conv2d_stats, gn_silu_conv2d
from tests.ops.test_gn_conv2d import DTYPES, _cl, _resample
from tests.tolerances import assert_within_torch_error


def _parts(n, c_head, c_tail, h, w, dtype):
    head = _cl(torch.randn(n, c_head, h, w, dtype=torch.float64) * 1.2 + 0.3).to(dtype)
    # The skip has another scale and offset, as a down block's output does: a group across the boundary mixes them.
    tail = _cl(torch.randn(n, c_tail, h, w, dtype=torch.float64) * 0.7 - 0.5).to(dtype)
    return head, tail


def _block_params(c_in, c_out, dtype):
    gw = (torch.randn(c_in, dtype=torch.float64) * 0.5 + 1.0).to(dtype)  # non-trivial affine
    gb = (torch.randn(c_in, dtype=torch.float64) * 0.5).to(dtype)
    w = (torch.randn(c_out, c_in, 3, 3, dtype=torch.float64) / (9 * c_in) ** 0.5).to(dtype)
    b = (torch.randn(c_out, dtype=torch.float64) * 0.3).to(dtype)
    sw = (torch.randn(c_out, c_in, 1, 1, dtype=torch.float64) / c_in**0.5).to(dtype)
    sb = (torch.randn(c_out, dtype=torch.float64) * 0.3).to(dtype)
    return gw, gb, w, b, sw, sb


def _compose(head, tail, gw, gb, groups, w, b, resample, temb, sw, sb, scale):
    """conv(silu(gn(cat))) + temb + 1x1 shortcut of cat, in the inputs' dtype (fp64: reference)."""
    x = torch.cat([head, tail], 1)
    a = F.silu(F.group_norm(x, groups, gw, gb, 1e-5))
    y = F.conv2d(_resample(a, resample), w, b, 1, 1) + temb[:, :, None, None]
    return (y + F.conv2d(_resample(x, resample), sw, sb)) / scale


def _fused(head, tail, gw, gb, groups, w, b, resample, temb, sw, sb, scale):
    return gn_silu_conv2d((head, tail), gw, gb, groups, 1e-5, w, b, 1, 1, resample=resample, temb=temb,
                          shortcut=((head, tail), sw, sb), shortcut_resample=resample, output_scale=scale)  # fmt: skip


@pytest.mark.parametrize("resample", ["none", "up"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_part_input_matches_concatenation(resample, dtype):
    head, tail = _parts(3, 7, 9, 5, 7, dtype)
    gw, gb, w, b, sw, sb = _block_params(16, 11, dtype)
    temb = torch.randn(3, 11, dtype=dtype)
    args = (head, tail, gw, gb, 4, w, b, resample, temb, sw, sb, 1.25)
    with ldmopt.use_backend("triton"):
        out = _fused(*args)
    ref = _compose(*[a.double() if torch.is_tensor(a) else a for a in args])
    lowp = _compose(*args)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype
    assert_within_torch_error(out, ref, lowp, f"two-part {resample} {dtype}")


def test_two_part_output_statistics_and_reference_backend():
    head, tail = _parts(2, 5, 11, 6, 5, torch.float32)
    gw, gb, w, b, sw, sb = _block_params(16, 12, torch.float32)
    kwargs = dict(shortcut=((head, tail), sw, sb), out_stats=(3, 1e-6))
    with ldmopt.use_backend("triton"):
        y, (mean, rstd) = gn_silu_conv2d((head, tail), gw, gb, 4, 1e-5, w, b, **kwargs)
    with ldmopt.use_backend("torch"):
        y_ref, _ = gn_silu_conv2d((head, tail), gw, gb, 4, 1e-5, w, b, **kwargs)
    torch.testing.assert_close(y, y_ref, atol=5e-5, rtol=5e-5)
    var, mu = torch.var_mean(y.double().reshape(2, 3, -1), dim=-1, unbiased=False)
    torch.testing.assert_close(mean.double(), mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-6), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_statistics_of_two_parts_equal_those_of_the_concatenation(layout):
    head, tail = _parts(3, 13, 7, 4, 9, torch.float32)
    if layout == "nchw":
        head, tail = head.contiguous(), tail.contiguous()
    x = torch.cat([head, tail], 1).double()
    var, mu = torch.var_mean(x.reshape(3, 5, -1), dim=-1, unbiased=False)
    with ldmopt.use_backend("triton"):
        mean, rstd = gn_conv2d_stats(head, 5, 1e-5, tail)
    torch.testing.assert_close(mean.double(), mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [(5, 7), (11, 1)])
def test_backward_of_two_parts_matches_autograd_of_concatenation(dtype, split):
    # 3 groups of 4: the second straddles the parts (5 + 7); a one-channel part, whose layout is both channels-last
    # and contiguous, must still give backward a channels-last concatenation for its fused passes (11 + 1)
    head, tail = _parts(2, *split, 4, 5, dtype)
    gw, gb, w, b, sw, sb = _block_params(12, 9, dtype)
    temb = torch.randn(2, 9, dtype=dtype)
    leaves = [head, tail, gw, gb, w, b, temb, sw, sb]
    dy = _cl(torch.randn(2, 9, 8, 10, dtype=dtype))

    grads = {}
    for name, cast in (("ours", None), ("ref", torch.float64), ("lowp", None)):
        ts = [(t.detach().to(cast) if cast else t.detach().clone()).requires_grad_() for t in leaves]
        h, t, gw_, gb_, w_, b_, temb_, sw_, sb_ = ts
        args = (h, t, gw_, gb_, 3, w_, b_, "up", temb_, sw_, sb_, 0.8)
        if name == "ours":
            with ldmopt.use_backend("triton"):
                out = _fused(*args)
        else:
            out = _compose(*args)
        out.backward(dy.to(cast or dtype))
        grads[name] = [t.grad for t in ts]
    names = ("dhead", "dtail", "dgn_weight", "dgn_bias", "dweight", "dbias", "dtemb", "dsw", "dsb")
    for name, ours, ref, lowp in zip(names, grads["ours"], grads["ref"], grads["lowp"]):
        assert ours.dtype == dtype and ours.shape == ref.shape, name
        assert_within_torch_error(ours, ref, lowp, f"{name} {dtype}")


def test_gradcheck_two_parts_reference_fp64():
    head, tail = _parts(2, 3, 3, 4, 3, torch.float64)
    gw, gb, w, b, sw, sb = _block_params(6, 4, torch.float64)
    inputs = [t.requires_grad_() for t in (head, tail, gw, gb, w, sw)]

    def fn(h, t, gw, gb, w, sw):
        return gn_silu_conv2d((h, t), gw, gb, 3, 1e-5, w, b, shortcut=((h, t), sw, sb))

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_nchw_part_runs_reference_with_reason():
    head, tail = _parts(2, 4, 4, 5, 5, torch.float32)
    gw, gb, w, b, _, _ = _block_params(8, 4, torch.float32)
    op_module.fallback_reasons.clear()
    y = gn_silu_conv2d((head, tail.contiguous()), gw, gb, 2, 1e-5, w, b)
    assert any("x_tail (strides" in r for (_, _, r) in op_module.fallback_reasons)
    ref = F.conv2d(F.silu(F.group_norm(torch.cat([head, tail], 1), 2, gw, gb, 1e-5)), w, b, 1, 1)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x,match",
    [
        ((torch.randn(2, 4, 5, 5),), "x must be a tensor or a pair"),
        ((torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 6)), "must agree in batch, spatial size and dtype"),
        ((torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5, dtype=torch.float64)), "must agree in batch"),
        ((torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5)), r"x\[1\] must have 4 dims"),
        ((torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5)), r"expected \(4, 7, kh, kw\) for x with C=7"),
    ],
)
def test_bad_parts_messages(x, match):
    gw, gb, w, b, _, _ = _block_params(8, 4, torch.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        gn_silu_conv2d(x, gw, gb, 2, 1e-5, w, b)


def test_opcheck_two_parts():
    head, tail = _parts(2, 3, 5, 3, 4, torch.float32)
    gw, gb, w, b, sw, sb = _block_params(8, 6, torch.float32)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(head, 2, 1e-5, tail)
    args = (head.requires_grad_(), mean, rstd, gw, gb, w.requires_grad_(), b, None, None, head, sw, sb, None,
            2, "silu", 1, [1, 1], "none", "none", "none", 1.0, 3, 1e-5, tail.requires_grad_(), tail)  # fmt: skip
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d_stats, (head.detach(), 2, 1e-5, tail.detach()))


def test_torch_compile_fullgraph_two_parts():
    torch._dynamo.reset()
    head, tail = _parts(2, 3, 5, 4, 3, torch.float32)
    gw, gb, w, b, sw, sb = _block_params(8, 6, torch.float32)
    head.requires_grad_()

    def fn(h, t):
        return gn_silu_conv2d((h, t), gw, gb, 2, 1e-5, w, b, shortcut=((h, t), sw, sb))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with ldmopt.use_backend("torch"):
        out = compiled(head, tail)
        ref = fn(head, tail)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert head.grad is not None and torch.isfinite(head.grad).all()


def test_ops_refuse_mismatched_tails():
    # Through torch.ops nothing checks the pair first: the ops themselves refuse a tail the kernels would overrun.
    head, _ = _parts(2, 4, 4, 4, 4, torch.float32)
    tail = _cl(torch.randn(1, 4, 2, 2))
    with pytest.raises(ValueError, match=r"x_tail of shape \(1, 4, 2, 2\) must match the first part \(2, 4, 4, 4\)"):
        torch.ops.ldmopt.gn_conv2d_stats(head, 2, 1e-5, tail)
    gw, gb, w, b, sw, sb = _block_params(8, 4, torch.float32)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(head, 2, 1e-5, head)
    args = (head, mean, rstd, gw, gb, w, b, None, None, head, sw, sb, None, 2, "silu", 1, [1, 1], "none", "none",
            "none", 1.0, 0, 1e-5, head)  # fmt: skip
    with pytest.raises(ValueError, match="shortcut_x_tail of shape"):
        torch.ops.ldmopt.gn_conv2d(*args, tail.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="must have the first part's dtype"):
        torch.ops.ldmopt.gn_conv2d(*args, head.double())
