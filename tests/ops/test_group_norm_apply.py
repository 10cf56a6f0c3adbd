"""``ldmopt::group_norm_apply`` (internal: the staged conv input and the fused conv's backward recomputation): the
Triton interpreter against F.group_norm + SiLU in fp64, two-part inputs whose groups straddle the parts, the reference
backend's layouts, opcheck, and the fused conv's backward running it."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops import backend_counts
from ldmopt.ops.group_norm_apply import group_norm_apply
from tests.tolerances import assert_within_torch_error


def _case(n, c, h, w, groups, dtype, eps=1e-5):
    x = (
        (torch.randn(n, c, h, w, dtype=torch.float64) * 1.5 + 0.7)
        .to(dtype)
        .contiguous(memory_format=torch.channels_last)
    )
    gw = (torch.randn(c, dtype=torch.float64) * 0.5 + 1.0).to(dtype)
    gb = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype)
    var, mean = torch.var_mean(x.double().reshape(n, groups, -1), dim=-1, unbiased=False)
    return x, gw, gb, mean.float(), torch.rsqrt(var + eps).float()


def _expect(x, gw, gb, groups, act, dtype):
    def run(t, w, b):
        z = F.group_norm(t, groups, w, b, 1e-5)
        return F.silu(z) if act == "silu" else z

    return run(x.double(), gw.double(), gb.double()), run(x.float(), gw.float(), gb.float()).to(dtype)


@pytest.mark.parametrize("act", ["silu", ""])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_group_norm(backend, dtype, act):
    x, gw, gb, mean, rstd = _case(3, 20, 7, 5, 4, dtype)
    with ldmopt.use_backend(backend):
        y = group_norm_apply(x, mean, rstd, gw, gb, 4, act)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    ref, lowp = _expect(x, gw, gb, 4, act, dtype)
    assert_within_torch_error(y, ref, lowp, f"group_norm_apply {backend} {dtype} {act!r}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_two_parts_with_a_group_across_them(backend):
    x, gw, gb, mean, rstd = _case(2, 16, 5, 3, 4, torch.float32)  # groups of 4; the split at 7 cuts the second
    head = x[:, :7].contiguous(memory_format=torch.channels_last)
    tail = x[:, 7:].contiguous(memory_format=torch.channels_last)
    with ldmopt.use_backend(backend):
        y = group_norm_apply(head, mean, rstd, gw, gb, 4, "silu", tail)
    ref, lowp = _expect(x, gw, gb, 4, "silu", torch.float32)
    assert_within_torch_error(y, ref, lowp, f"two parts {backend}")


def test_nchw_input_runs_the_reference_with_a_channels_last_result():
    x, gw, gb, mean, rstd = _case(2, 12, 4, 6, 3, torch.float32)
    nchw = x.contiguous()
    before = backend_counts[("group_norm_apply", "torch")]
    y = group_norm_apply(nchw, mean, rstd, gw, gb, 3, "silu")
    assert backend_counts[("group_norm_apply", "torch")] == before + 1
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref, lowp = _expect(x, gw, gb, 3, "silu", torch.float32)
    assert_within_torch_error(y, ref, lowp, "nchw")


def test_bad_statistics_shape_is_named():
    x, gw, gb, _, _ = _case(2, 12, 4, 6, 3, torch.float32)
    with pytest.raises(ValueError, match=r"mean \(2, 4\).*\[N, num_groups\]"):
        group_norm_apply(x, torch.zeros(2, 4), torch.ones(2, 4), gw, gb, 3, "silu")


def test_opcheck():
    x, gw, gb, mean, rstd = _case(2, 12, 3, 5, 3, torch.float32)
    torch.library.opcheck(torch.ops.ldmopt.group_norm_apply.default, (x, mean, rstd, gw, gb, 3, "silu"))
    head, tail = (
        x[:, :5].contiguous(memory_format=torch.channels_last),
        x[:, 5:].contiguous(memory_format=torch.channels_last),
    )
    torch.library.opcheck(torch.ops.ldmopt.group_norm_apply.default, (head, mean, rstd, None, None, 3, "", tail))


def test_fused_conv_backward_recomputes_its_input_through_it():
    from ldmopt.ops.gn_conv2d import gn_silu_conv2d

    x, gw, gb, _, _ = _case(2, 12, 5, 5, 3, torch.float32)
    w = torch.randn(8, 12, 3, 3) * 0.1
    dy = torch.randn(2, 8, 5, 5)
    leaves = [t.clone().requires_grad_() for t in (x, gw, gb, w)]
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(leaves[0], leaves[1], leaves[2], 3, 1e-5, leaves[3])
        before = backend_counts[("group_norm_apply", "triton")]
        y.backward(dy)
    assert backend_counts[("group_norm_apply", "triton")] == before + 1
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, gw, gb, w)]
    z = F.silu(F.group_norm(ref_leaves[0], 3, ref_leaves[1], ref_leaves[2], 1e-5))
    F.conv2d(z, ref_leaves[3], None, 1, 1).backward(dy.double())
    for name, got, ref in zip(("x", "gn_weight", "gn_bias", "conv_weight"), leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_torch_compile_fullgraph():
    x, gw, gb, mean, rstd = _case(2, 12, 3, 5, 3, torch.float32)
    compiled = torch.compile(lambda *a: group_norm_apply(*a, 3, "silu"), fullgraph=True, backend="aot_eager")
    with ldmopt.use_backend("triton"):
        y = compiled(x, mean, rstd, gw, gb)
    ref, lowp = _expect(x, gw, gb, 3, "silu", torch.float32)
    assert_within_torch_error(y, ref, lowp, "compiled")
