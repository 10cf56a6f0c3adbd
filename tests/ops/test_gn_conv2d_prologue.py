"""Where the fused conv applies GroupNorm + SiLU (ldmopt/ops/gn_conv2d_prologue.py): the auto policy's choices, the
override's errors, and the staged placement (an apply pass, then a plain conv) against the unfused composition in the
Triton interpreter, on the cases the loader placement is tested on elsewhere.
"""

import os

import pytest
import torch

import ldmopt
from ldmopt.ops import gn_conv2d_prologue as prologue
from ldmopt.ops.gn_conv2d import gn_silu_conv2d
from tests.ops.test_gn_conv2d import CONV_CASES, DTYPES, _check, _cl, _inputs
from tests.ops.test_gn_conv2d_parts import _block_params, _compose, _fused, _parts
from tests.ops.test_gn_conv2d_temporal import _as_5d, _compose_5d, _d, _frames, _params, _video_view
from tests.tolerances import assert_close, assert_within_torch_error

CUDA = torch.device("cuda")  # a device object: nothing is queried


@pytest.fixture
def staged(monkeypatch):
    monkeypatch.setenv(prologue.ENV, "staged")
    prologue.placement_counts.clear()


@pytest.mark.parametrize(
    "kernel,c_out,stride,resample,expect",
    [
        # staged before cuDNN's conv (the "cudnn" placement) from 3 normalisations per element
        ((3, 3), 320, 1, "none", "cudnn"),  # SD resnet conv: 9 taps x 3 channel tiles
        ((3, 3), 4, 1, "none", "cudnn"),  # conv_out: 9 taps
        ((3, 1), 64, 1, "none", "cudnn"),  # temporal conv: 3 taps
        ((3, 3), 128, 2, "none", "loader"),  # 9/4 taps
        ((1, 1), 256, 1, "none", "loader"),  # 2 channel tiles
        ((1, 1), 320, 1, "none", "cudnn"),  # proj_in after GroupNorm: 3 channel tiles
        ((1, 1), 64, 1, "up", "cudnn"),  # each input pixel feeds 4 conv inputs (one channel tile)
    ],
)
def test_auto_policy_on_a_gpu(kernel, c_out, stride, resample, expect, monkeypatch):
    monkeypatch.delenv(prologue.ENV, raising=False)
    assert prologue.choose_placement(CUDA, kernel, c_out, stride, resample) == expect


def test_auto_keeps_the_loader_in_the_interpreter_and_the_override_wins(monkeypatch):
    monkeypatch.delenv(prologue.ENV, raising=False)
    assert prologue.choose_placement(torch.device("cpu"), (3, 3), 320, 1, "none") == "loader"
    monkeypatch.setenv(prologue.ENV, "Loader ")
    assert prologue.choose_placement(CUDA, (3, 3), 320, 1, "none") == "loader"
    monkeypatch.setenv(prologue.ENV, "staged")
    assert prologue.choose_placement(torch.device("cpu"), (1, 1), 8, 1, "none") == "staged"


def test_bad_override_names_the_variable_value_and_choices(monkeypatch):
    monkeypatch.setenv(prologue.ENV, "registers")
    x, gw, gb, groups, w, b = _inputs(1, 8, 5, 5, 8, 3, torch.float32)
    with ldmopt.use_backend("triton"), pytest.raises(ValueError, match=r"LDMOPT_GN_CONV_PROLOGUE='registers'.*staged"):
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b)


@pytest.mark.parametrize("k,stride,padding,resample", CONV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_conv_matches_composition(k, stride, padding, resample, dtype, staged):
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 20, k, dtype)  # 3 channels per group, odd H and W
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, stride, padding, resample=resample)
    _check(y, (x, gw, gb, groups, w, b, stride, padding, resample), {}, f"staged {k}x{k}/s{stride}/{resample}")
    assert prologue.placement_counts == {"staged": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_epilogue_and_output_statistics(dtype, staged, triton_launches):
    x, gw, gb, groups, w, b = _inputs(3, 8, 5, 7, 12, 3, dtype)
    temb = torch.randn(3, 12, dtype=dtype)
    residual = _cl(torch.randn(3, 12, 5, 7, dtype=dtype))
    shortcut = (x, torch.randn(12, 8, 1, 1, dtype=dtype) * 0.3, torch.randn(12, dtype=dtype))
    with ldmopt.use_backend("triton"):
        y, (mean, rstd) = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, temb=temb, residual=residual,
                                         shortcut=shortcut, output_scale=1.7, out_stats=(4, 1e-6))  # fmt: skip
    kwargs = dict(temb=temb, residual=residual, shortcut=shortcut, scale=1.7)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), kwargs, "staged epilogue")
    yg = y.double().reshape(3, 4, -1)
    assert_close(mean, yg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(yg.var(-1, unbiased=False) + 1e-6), torch.float32, "rstd")
    # statistics (2 launches), the normalisation pass, then the conv; the shortcut reads the raw input
    assert triton_launches[-2:] == ["_group_norm_fwd_apply_kernel", "_gn_conv2d_fwd_kernel"]


@pytest.mark.parametrize("resample", ["none", "up"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_two_part_input_with_groups_across_the_parts(resample, dtype, staged, triton_launches):
    head, tail = _parts(3, 7, 9, 5, 7, dtype)  # 16 channels in 4 groups: the second group spans both parts
    gw, gb, w, b, sw, sb = _block_params(16, 11, dtype)
    temb = torch.randn(3, 11, dtype=dtype)
    args = (head, tail, gw, gb, 4, w, b, resample, temb, sw, sb, 1.25)
    stats = torch.ops.ldmopt.gn_conv2d_stats(head, 4, 1e-5, tail)
    triton_launches.clear()
    with ldmopt.use_backend("triton"):
        out = gn_silu_conv2d((head, tail), gw, gb, 4, 1e-5, w, b, 1, 1, resample=resample, temb=temb,
                             shortcut=((head, tail), sw, sb), output_scale=1.25, stats=stats,
                             shortcut_resample=resample)  # fmt: skip
    ref = _compose(*[a.double() if torch.is_tensor(a) else a for a in args])
    assert_within_torch_error(out, ref, _compose(*args), f"staged parts {resample} {dtype}")
    # one normalisation pass per part into one buffer; the shortcut still reads the parts where they lie
    assert triton_launches == ["_group_norm_fwd_apply_kernel"] * 2 + ["_gn_conv2d_fwd_kernel"]
    with ldmopt.use_backend("triton"):
        assert_close(_fused(*args), out, dtype, "computed statistics")


@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_temporal_conv_with_frame_temb_and_gate(dtype, staged):
    batch, frames, c, c_out, h, w = 2, 5, 9, 12, 3, 5
    view = _video_view(_frames(batch, frames, c, h, w, dtype), batch)  # (video, C, frame, pixel), strided
    gw, gb, w3, b = _params(c, c_out, dtype)
    temb = torch.randn(batch, frames, c_out, dtype=dtype).transpose(1, 2)
    gate = torch.rand(batch, frames)
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(view, gw, gb, 3, 1e-6, w3[..., 0], b, 1, (1, 0), temb=temb, gate=gate)
    x5 = _as_5d(view, h, w)
    ref = _compose_5d(x5.double(), _d(gw), _d(gb), 3, _d(w3), _d(b), 1, temb=_d(temb), gate=gate.double())
    lowp = _compose_5d(x5.float(), gw.float(), gb.float(), 3, w3.float(), b.float(), 1, temb=temb.float(), gate=gate)
    assert_within_torch_error(_as_5d(y, h, w), ref, lowp.to(dtype), f"staged temporal {dtype}")


def test_staged_and_loader_agree_through_backward(monkeypatch):
    """The placement changes only the forward kernel: gradients come from the same recomputation."""
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 20, 3, torch.float32)
    grads = {}
    for placement in ("loader", "staged"):
        monkeypatch.setenv(prologue.ENV, placement)
        leaves = [t.clone().requires_grad_() for t in (x, gw, gb, w, b)]
        with ldmopt.use_backend("triton"):
            y = gn_silu_conv2d(leaves[0], leaves[1], leaves[2], groups, 1e-5, leaves[3], leaves[4])
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        grads[placement] = (y.detach(), [t.grad for t in leaves])
    (y_l, g_l), (y_s, g_s) = grads["loader"], grads["staged"]
    torch.testing.assert_close(y_s, y_l, rtol=1e-5, atol=1e-5)
    for a, c in zip(g_s, g_l):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_info_shows_the_setting(monkeypatch):
    from ldmopt import info

    monkeypatch.delenv(prologue.ENV, raising=False)
    assert info.collect(query_gpu=False)["gn_conv_prologue"].startswith("auto (on a GPU: in the conv's loader where")
    monkeypatch.setenv(prologue.ENV, "loader")
    text = info.format_info(info.collect(query_gpu=False))
    assert "GroupNorm -> conv prologue: loader (forced by LDMOPT_GN_CONV_PROLOGUE)" in text
    monkeypatch.setenv(prologue.ENV, "fast")
    assert "invalid: LDMOPT_GN_CONV_PROLOGUE='fast'" in info.collect(query_gpu=False)["gn_conv_prologue"]


def test_staged_reads_strided_statistics_by_their_strides(staged):
    """Statistics handed in by a caller may be views (here column-major [N, G]): the staged pass reads them as rows."""
    x, gw, gb, groups, w, b = _inputs(3, 12, 5, 7, 20, 3, torch.float32)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, groups, 1e-5)
    strided = tuple(t.t().contiguous().t() for t in (mean, rstd))
    assert not strided[0].is_contiguous()
    with ldmopt.use_backend("triton"):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, stats=strided)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), {}, "staged, strided statistics")


def test_forced_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv(prologue.ENV, "loader")
    with prologue.forced("staged"):
        assert prologue.requested_placement() == "staged"
    assert prologue.requested_placement() == "loader"
    monkeypatch.delenv(prologue.ENV)
    with pytest.raises(ValueError, match="LDMOPT_GN_CONV_PROLOGUE='fastest'"), prologue.forced("fastest"):
        pass
    with prologue.forced("auto"):
        pass
    assert prologue.ENV not in os.environ


def test_staged_pass_runs_on_the_cuda_backend_where_it_takes_the_input(staged, monkeypatch):
    """With ldmopt._C built, the staged normalisation is one C++ op call (group_norm_apply_cuda) instead of a Triton
    launch (two channels-last parts too), unless a backend is forced; the conv itself stays on triton."""
    from ldmopt.ops import gn_conv2d_stats as stats_module
    from ldmopt.ops import group_norm_apply as apply_module

    calls = []

    def cuda_stand_in(*args):  # the C++ op cannot run here: the triton pass computes what it would
        calls.append(args[0].shape)
        return apply_module.apply_triton(*args)

    monkeypatch.setattr(stats_module, "cuda_extension_refusals", lambda *args: [])  # as where ldmopt._C is built
    monkeypatch.setattr(stats_module.STATS, "backends", stats_module.STATS.backends[1:])  # statistics: not the cuda op
    monkeypatch.setattr(apply_module, "_apply_cuda", cuda_stand_in)
    x, gw, gb, groups, w, b = _inputs(2, 12, 7, 5, 20, 3, torch.float32)
    ldmopt.ops.backend_counts.clear()
    y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), {}, "staged through the cuda apply")
    assert calls == [x.shape]
    assert ldmopt.ops.backend_counts[("group_norm_apply", "cuda")] == 1
    assert ldmopt.ops.backend_counts[("gn_conv2d", "triton")] == 1
    with ldmopt.use_backend("triton"):
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1)
    assert len(calls) == 1 and ldmopt.ops.backend_counts[("group_norm_apply", "triton")] == 1
    head, tail = _parts(2, 8, 4, 5, 7, torch.float32)
    gw2, gb2, w2, b2, _, _ = _block_params(12, 6, torch.float32)
    y2 = gn_silu_conv2d((head, tail), gw2, gb2, 4, 1e-5, w2, b2, 1, 1)  # an up block's (hidden, skip): one call too
    assert calls[1:] == [head.shape] and ldmopt.ops.backend_counts[("group_norm_apply", "cuda")] == 2
    with ldmopt.use_backend("torch"):
        ref = gn_silu_conv2d((head, tail), gw2, gb2, 4, 1e-5, w2, b2, 1, 1)
    torch.testing.assert_close(y2, ref, rtol=1e-4, atol=1e-4)


def test_staged_pass_honours_a_backend_forced_for_the_apply_op(staged, monkeypatch):
    from ldmopt.ops import gn_conv2d_stats as stats_module

    monkeypatch.setattr(stats_module, "cuda_extension_refusals", lambda *args: ["ldmopt._C is not built here"])
    x, gw, gb, groups, w, b = _inputs(1, 8, 5, 5, 8, 3, torch.float32)
    refused = pytest.raises(ldmopt.BackendUnavailableError, match=r"ldmopt\._C is not built")
    with ldmopt.use_backend("cuda", ops=["group_norm_apply"]), refused:
        gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1)
    ldmopt.ops.backend_counts.clear()
    with ldmopt.use_backend("torch", ops=["group_norm_apply"]):
        y = gn_silu_conv2d(x, gw, gb, groups, 1e-5, w, b, 1, 1)
    _check(y, (x, gw, gb, groups, w, b, 1, 1), {}, "staged with the reference normalisation")
    assert ldmopt.ops.backend_counts[("group_norm_apply", "torch")] == 1


def test_apply_refuses_statistics_of_another_device_or_shape(monkeypatch):
    from ldmopt.ops import gn_conv2d_stats as stats_module
    from ldmopt.ops.group_norm_apply import group_norm_apply

    monkeypatch.setattr(stats_module, "cuda_extension_refusals", lambda *args: [])  # as where ldmopt._C is built
    x = torch.randn(2, 8, 3, 3, device="meta")
    reasons = stats_module.cuda_one_part_refusals("group_norm_apply_cuda", x, None, torch.zeros(2, 4))
    assert "tensors on more than one device" in reasons
    with pytest.raises(ValueError, match=r"rstd \(2, 3\)"):
        group_norm_apply(torch.randn(2, 8, 3, 3), torch.zeros(2, 4), torch.ones(2, 3), None, None, 4, "")
