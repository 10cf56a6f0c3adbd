"""The aten ops the fused ops' backward issues around its Triton kernels: on a GPU each small op is one more launch
and its host time (benchmarks/count_backward_ops.py counts a whole training step). Each test pins what one change
removed, so that it fails if the op comes back:
- no zero-filled gradients for the statistics outputs of gn_conv2d / group_norm (autograd materialised two per call);
- GroupNorm's affine gradients summed over the batch in the backward's finalize kernel (two aten.sum per call);
- adaLN / LayerNorm backward's per-chunk column sums reduced in one launch (one aten.sum per gradient);
- a 16-bit bias gradient summed in one op (PyTorch sums fp16/bf16 in fp32), not an fp32 sum and a cast;
- the LayerNorm weight read in its own dtype by layer_norm_linear's backward (no fp32 copy per call).
"""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks.count_backward_ops import OpCounter
from ldmopt.ops.adaln_modulate import _bwd_torch as adaln_bwd_reference
from ldmopt.ops.gn_conv2d import gn_silu_conv2d
from ldmopt.ops.group_norm import group_norm
from ldmopt.ops.layer_norm_linear import layer_norm_linear
from ldmopt.ops.linear import sum_as
from tests.tolerances import assert_close


def _backward_ops(out, grad) -> dict[str, int]:
    counter = OpCounter()
    with counter:
        out.backward(grad)
    return counter.counts


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_gn_conv2d_backward_fills_no_statistics_gradients_and_sums_only_the_biases(triton_launches):
    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    x, gw, gb, w, b, temb = _leaves(x, torch.rand(8) + 0.5, torch.randn(8), torch.randn(6, 8, 3, 3) * 0.2,
                                    torch.randn(6), torch.randn(2, 6))  # fmt: skip
    with ldmopt.use_backend("triton"):
        y, _stats = gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 1, temb=temb, out_stats=(3, 1e-5))
        counts = _backward_ops(y, torch.randn_like(y))
    assert counts["aten.zeros"] == 0, counts  # the unused mean/rstd outputs' gradients are not materialised
    assert counts["aten.sum"] == 2, counts  # d conv bias and d temb; the GroupNorm's affine sums are in its kernels
    assert "_group_norm_bwd_finalize_kernel" in triton_launches


def test_group_norm_backward_issues_no_reductions_or_fills():
    x, w, b = _leaves(torch.randn(3, 8, 5, 5), torch.rand(8) + 0.5, torch.randn(8))
    with ldmopt.use_backend("triton"):
        y = group_norm(x, 4, w, b, 1e-5, "silu")
        counts = _backward_ops(y, torch.randn_like(y))
    assert counts["aten.sum"] == 0 and counts["aten.zeros"] == 0, counts


@pytest.mark.parametrize("n", [1, 3])
def test_group_norm_finalize_loops_over_images_and_chunks(monkeypatch, n):
    # A tile of 4 partial sums (2 channels x 2 chunks): per group, a loop over every image and over its 13 chunks in
    # masked steps (one step each at the usual sizes).
    import ldmopt.kernels.group_norm_bwd as kernels

    monkeypatch.setattr(kernels, "_FINALIZE_ELEMENTS", 4)
    x = torch.randn(n, 6, 40, 40, dtype=torch.float64) * 1.3 + 0.5
    w, b = torch.rand(6, dtype=torch.float64) + 0.5, torch.randn(6, dtype=torch.float64)
    dy = torch.randn_like(x)
    ours = _leaves(x.float(), w.float(), b.float())
    with ldmopt.use_backend("triton"):
        group_norm(ours[0], 3, ours[1], ours[2], 1e-5, "silu").backward(dy.float())
    ref = _leaves(x, w, b)
    F.silu(F.group_norm(ref[0], 3, ref[1], ref[2], 1e-5)).backward(dy)
    assert_close(ours[0].grad, ref[0].grad, torch.float32, "dx")
    # An affine gradient sums 4,800 terms: its rounding error scales with the terms, not with the sum, which may land
    # near zero (CI once saw a dbias of 0.2 off by 3e-5), so the tolerance is relative to the gradient's largest entry.
    for name, got, want in zip(("dweight", "dbias"), ours[1:], ref[1:]):
        error, scale = (got.grad.double() - want.grad).abs().max().item(), want.grad.abs().max().item()
        assert error <= 2e-5 * scale, f"{name}: max error {error:.2e} > 2e-5 x its largest entry {scale:.2f}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_bias_gradient_is_one_sum_accumulated_in_fp32(dtype):
    g = torch.full((4, 3, 50, 50), 0.1, dtype=dtype)  # 10,000 terms per channel: a 16-bit accumulator stalls
    counter = OpCounter()
    with counter:
        got = sum_as(g, (0, 2, 3), dtype)
    assert dict(counter.counts) == {"aten.sum": 1}
    torch.testing.assert_close(got, g.sum((0, 2, 3), dtype=torch.float32).to(dtype), rtol=0, atol=0)


def test_layer_norm_linear_backward_reduces_the_norm_sums_once(triton_launches):
    x, nw, nb, w, b = _leaves(torch.randn(2, 7, 16) + 0.3, torch.rand(16) + 0.5, torch.randn(16),
                              torch.randn(12, 16) * 0.3, torch.randn(12))  # fmt: skip
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, nw, nb, w, b)
        del triton_launches[:]
        counts = _backward_ops(y, torch.randn_like(y))
    assert counts["aten.sum"] == 1, counts  # the Linear's bias; the norm's weight and bias come from the kernels
    assert triton_launches.count("_adaln_bwd_sums_kernel") == 1, triton_launches


def test_layer_norm_linear_half_backward_casts_only_the_norm_gradients():
    x, nw, nb, w, b = _leaves(*(t.half() for t in (torch.randn(2, 7, 16), torch.rand(16) + 0.5, torch.randn(16),
                                                   torch.randn(12, 16) * 0.3, torch.randn(12))))  # fmt: skip
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, nw, nb, w, b)
        counts = _backward_ops(y, torch.randn_like(y))
    # d norm weight and d norm bias (fp32 sums, the op's contract) to fp16; no fp32 copy of the norm's weight and
    # none of the Linear's bias gradient
    assert counts["aten._to_copy"] == 2, counts


@pytest.mark.parametrize("gate", [False, True])
def test_adaln_backward_sums_over_several_chunk_and_column_blocks(monkeypatch, gate):
    import ldmopt.kernels.adaln_modulate as kernels

    # 6 chunks of 16 rows per sample, reduced 2 chunks x 16 columns at a time: 3 masked column blocks of C=40
    monkeypatch.setattr(kernels, "_SUMS_BLOCK_C", 16)
    monkeypatch.setattr(kernels, "_SUMS_ELEMENTS", 32)
    b, t, c = 2, 90, 40
    s, dy = torch.randn(b * t, c), torch.randn(b * t, c)
    mean, rstd = s.mean(1), torch.rsqrt(s.var(1, unbiased=False) + 1e-6)
    scale = torch.randn(b, c) * 0.5
    x, g = (torch.randn(b * t, c), torch.randn(b, c)) if gate else (None, None)
    got = kernels.adaln_bwd(dy, s, mean, rstd, scale, None, x, g)
    want = adaln_bwd_reference(dy, s, mean, rstd, scale, None, x, g)
    for name, ours, ref in zip(("ds", "dscale", "dshift", "dx", "dgate"), got, want):
        assert_close(ours, ref, torch.float32, name)


def test_statistics_outputs_are_not_differentiable():
    # The fused ops' output statistics feed another op, which differentiates through them itself: a gradient sent
    # into them would be dropped, so they do not require grad (and no zero gradients are filled for them).
    from ldmopt.ops.gn_conv2d import gn_silu_conv2d
    from ldmopt.ops.group_norm import group_norm_fwd

    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    gw, w = torch.rand(8, requires_grad=True), torch.randn(6, 8, 3, 3, requires_grad=True)
    y, stats = gn_silu_conv2d(x, gw, None, 4, 1e-5, w, None, 1, 1, out_stats=(3, 1e-5))
    assert y.requires_grad and not any(t.requires_grad for t in stats)
    out, mean, rstd = group_norm_fwd(x, gw, None, 4, 1e-5, "silu")
    assert out.requires_grad and not mean.requires_grad and not rstd.requires_grad
