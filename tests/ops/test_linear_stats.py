"""ops.linear(..., next_norm_eps=eps): the residual GEMM also returns its output rows' LayerNorm statistics, summed in
the epilogue (fp64 across column tiles, the last tile finalising), so the LayerNorm that reads the output next runs no
statistics pass (interpreter: 32x32 tiles, so N=72 spans three column tiles and M=74 three row tiles)."""

import pytest
import torch

import ldmopt
from ldmopt import ops
from tests.tolerances import assert_close


def _inputs(dtype, offset=0.0, gated=False):
    x = torch.randn(2, 37, 40, dtype=dtype)
    w = (torch.randn(72, 40, dtype=torch.float64) * 40**-0.5).to(dtype)
    b = torch.randn(72, dtype=dtype)
    residual = (torch.randn(2, 37, 72, dtype=torch.float64) * 0.7 + offset).to(dtype)
    gate = torch.randn(2, 72, dtype=dtype) if gated else None
    return x, w, b, residual, gate


def _stats_of(y, eps):
    rows = y.double().reshape(-1, y.shape[-1])
    mean = rows.mean(1)
    return mean, torch.rsqrt(rows.var(1, unbiased=False) + eps)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_statistics_are_those_of_the_stored_output(backend, dtype, gated, triton_launches):
    x, w, b, residual, gate = _inputs(dtype, gated=gated)
    with ops.use_backend(backend):
        y, stats = ops.linear(x, w, b, residual=residual, gate=gate, next_norm_eps=1e-5)
        plain = ops.linear(x, w, b, residual=residual, gate=gate)
    assert stats.shape == (2, 74) and stats.dtype == torch.float32
    torch.testing.assert_close(y, plain, rtol=0, atol=0)  # the same GEMM and epilogue
    mean, rstd = _stats_of(y, 1e-5)
    assert_close(stats[0], mean, torch.float32, "mean")
    assert_close(stats[1], rstd, torch.float32, "rstd")
    if backend == "triton":  # one GEMM launch with its statistics, no statistics pass (but gated on fp32 tiles)
        second = "_row_stats_kernel" if gated and dtype == torch.float32 else "_linear_fwd_kernel"  # then the plain one
        assert triton_launches[:2] == ["_linear_fwd_kernel", second], triton_launches


def test_statistics_of_rows_whose_mean_dwarfs_their_spread():
    # Rows around 1e3 with a spread of 0.7: the per-tile centred sums keep the variance that sums of squares lose.
    x, w, b, residual, _ = _inputs(torch.float32, offset=1e3)
    with ops.use_backend("triton"):
        y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=1e-6)
    _, rstd = _stats_of(y, 1e-6)
    torch.testing.assert_close(stats[1].double(), rstd, rtol=1e-3, atol=0)


def test_an_fp64_output_takes_the_reference_backend():
    x, w, b, residual, _ = _inputs(torch.float32)
    y, stats = ops.linear(x, w, b, residual=residual, out_dtype=torch.float64, next_norm_eps=1e-5)
    assert y.dtype == stats.dtype == torch.float64  # what layer_norm_linear takes for an fp64 input
    with pytest.raises(ops.BackendUnavailableError, match="an fp64 output"), ops.use_backend("triton"):
        ops.linear(x, w, b, residual=residual, out_dtype=torch.float64, next_norm_eps=1e-5)


def test_deterministic_algorithms_take_the_statistics_pass(triton_launches):
    x, w, b, residual, _ = _inputs(torch.float32)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with ops.use_backend("triton"):
            y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=1e-5)
    finally:
        torch.use_deterministic_algorithms(was)
    assert triton_launches == ["_linear_fwd_kernel", "_row_stats_kernel"], triton_launches
    mean, rstd = _stats_of(y, 1e-5)
    assert_close(stats[0], mean, torch.float32, "mean")
    assert_close(stats[1], rstd, torch.float32, "rstd")


def test_a_layer_norm_gemm_reading_them_gives_the_stock_result():
    x, w, b, residual, _ = _inputs(torch.float32)
    norm = torch.nn.LayerNorm(72)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    proj = torch.nn.Linear(72, 24)
    with ops.use_backend("triton"):
        y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=norm.eps)
        out = ops.layer_norm_linear(y, norm.weight, norm.bias, proj.weight, proj.bias, eps=norm.eps, stats=stats)
    expect = proj(norm(y.double().float()))
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_is_the_linear_backward(backend):
    x, w, b, residual, gate = _inputs(torch.float32, gated=True)
    leaves = [t.requires_grad_() for t in (x, w, b, residual, gate)]
    dy = torch.randn(2, 37, 72)
    grads = {}
    for stats in (False, True):
        with ops.use_backend(backend):
            out = ops.linear(x, w, b, residual=residual, gate=gate, activation="gelu",
                             next_norm_eps=1e-5 if stats else None)  # fmt: skip
        y = out[0] if stats else out
        if stats:  # marked as carrying no gradient, as the fused conv's output statistics are
            assert y.requires_grad and not out[1].requires_grad
        grads[stats] = torch.autograd.grad((y * dy).sum(), leaves)
    for got, want in zip(grads[True], grads[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_opcheck_and_fake():
    x, w, b, residual, gate = _inputs(torch.float32, gated=True)
    x2, res2 = x.reshape(74, 40), residual.reshape(74, 72)
    w.requires_grad_()
    op = torch.ops.ldmopt.linear_stats_fwd
    torch.library.opcheck(op, (x2, w, b, gate, res2, "gelu", True, None, 1e-5))
    torch.library.opcheck(op, (x2, w, None, None, res2, "", False, torch.float16, 1e-6))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, w, b, residual, _ = _inputs(torch.float32)
    norm = torch.nn.LayerNorm(72)
    proj = torch.nn.Linear(72, 24)

    def block(x, residual):
        y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=norm.eps)
        return ops.layer_norm_linear(y, norm.weight, norm.bias, proj.weight, proj.bias, eps=norm.eps, stats=stats)

    with ops.use_backend("triton"):
        out = torch.compile(block, backend="aot_eager", fullgraph=True)(x, residual)
        expect = block(x, residual)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    x, w, b, residual, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="next_norm_eps needs a single input tensor"):
        ops.linear((x, x), torch.randn(72, 80), next_norm_eps=1e-5)
    with pytest.raises(ValueError, match="eps"):
        ops.linear(x, w, b, residual=residual, next_norm_eps=-1.0)
    with pytest.raises(ldmopt.ops.BackendUnavailableError), ops.use_backend("cuda", ops=["linear"]):
        ops.linear(x, w, b, residual=residual, next_norm_eps=1e-5)
