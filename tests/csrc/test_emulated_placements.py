"""The "cublas" GEMM placement with ldmopt._C's row kernels, end to end on the CPU: ops.linear, ops.geglu, the linear
with the next norm's statistics and the LayerNorm GEMMs run PyTorch's GEMM, then their passes through the cuda
backends of ``linear_epilogue`` and ``layer_norm_apply``, whose C++ ops are stood in for by the fiber emulator running
the same kernels (tests/csrc/emulator.py). So the Python wiring (argument order, in-place writes, the statistics
buffer, the refusals that let the C++ ops run) is checked against the unfused modules, as a GPU would run it."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt import ops
from ldmopt.ops import layer_norm_apply as apply_module
from ldmopt.ops import linear_cublas
from ldmopt.ops import linear_epilogue as epilogue_module
from ldmopt.ops._dispatch import backend_counts
from ldmopt.ops.layer_norm_linear import layer_norm_linear
from tests.csrc import emulator
from tests.tolerances import assert_close, assert_within_torch_error

pytestmark = pytest.mark.skipif(emulator.unavailable_reason() is not None, reason=str(emulator.unavailable_reason()))


@pytest.fixture(scope="module")
def emu():
    return emulator.Emulator(emulator.build())


@pytest.fixture
def emulated_cuda(emu, monkeypatch):
    """The cuda backends of the two passes accept CPU tensors and run the emulated kernels; the GEMM placement is
    "cublas" (on CPU, PyTorch's GEMM). Yields a function returning the (op, backend) calls counted since."""

    def linear_epilogue_cuda(z, y, gate, residual, stats, activation, glu, saturate, write, eps):
        _, got = emu.linear_epilogue(z, activation or None, gate, residual, glu=glu, saturate=saturate,
                                     y=y if write else None, stats=stats is not None, eps=eps, write=write)  # fmt: skip
        if stats is not None:
            stats.copy_(got)

    def layer_norm_apply_cuda(x, stats, weight, bias, positions, position_rows):
        return emu.layer_norm_apply(x, stats, weight, bias, positions, position_rows)

    for module in (epilogue_module, apply_module):
        monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])
    monkeypatch.setattr(torch.ops.ldmopt, "linear_epilogue_cuda", linear_epilogue_cuda, raising=False)
    monkeypatch.setattr(torch.ops.ldmopt, "layer_norm_apply_cuda", layer_norm_apply_cuda, raising=False)
    before = dict(backend_counts)
    with linear_cublas.forced("cublas"), ldmopt.use_backend("auto"):
        yield lambda: {k: v - before.get(k, 0) for k, v in backend_counts.items() if v != before.get(k, 0)}


def _inputs(m, k, n, dtype):
    x = torch.randn(2, m, k, dtype=torch.float64).to(dtype)
    w = (torch.randn(n, k, dtype=torch.float64) * k**-0.5).to(dtype)
    b = (torch.randn(n, dtype=torch.float64) * 0.5).to(dtype)
    return x, w, b


def _check(y, reference, inputs, name):
    assert_within_torch_error(y, reference(*[t.double() for t in inputs]), reference(*inputs), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_linear_gelu_tanh_gated_residual_and_geglu(emulated_cuda, dtype):
    x, w, b = _inputs(37, 40, 72, dtype)
    gate = torch.randn(2, 72, dtype=dtype)
    residual = torch.randn(2, 37, 72, dtype=dtype)
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="gelu_tanh", gate=gate, residual=residual)
        _check(y, lambda x, w, b, g, r: r + g[:, None] * F.gelu(F.linear(x, w, b), approximate="tanh"),
               (x, w, b, gate, residual), "gated residual")  # fmt: skip
        wg, bg = torch.cat([w, w.flip(0)]), torch.cat([b, b.flip(0)])
        y = ops.geglu(x, wg, bg)
        _check(y, lambda x, w, b: (lambda h, g: h * F.gelu(g))(*F.linear(x, w, b).chunk(2, -1)), (x, wg, bg), "geglu")
    assert emulated_cuda() == {("linear", "triton"): 1, ("geglu", "triton"): 1, ("linear_epilogue", "cuda"): 2}


def test_linear_with_the_next_norms_statistics(emulated_cuda):
    x, w, b = _inputs(15, 40, 24, torch.float16)
    residual = torch.randn(2, 15, 24, dtype=torch.float16)
    with torch.no_grad():
        y, stats = ops.linear(x, w, b, residual=residual, next_norm_eps=1e-5)
        y_alone, stats_alone = ops.linear(x, w, b, next_norm_eps=1e-6)  # only reads the GEMM's output
    for out, st, eps in ((y, stats, 1e-5), (y_alone, stats_alone, 1e-6)):
        rows = out.double().reshape(-1, 24)
        assert_close(st[0], rows.mean(1), torch.float32, "mean")
        assert_close(st[1], torch.rsqrt(rows.var(1, unbiased=False) + eps), torch.float32, "rstd")
    torch.testing.assert_close(y_alone, F.linear(x, w, b), rtol=0, atol=0)
    assert emulated_cuda()[("linear_epilogue", "cuda")] == 2


@pytest.mark.parametrize("act", [None, "gelu", "geglu"])
def test_layer_norm_gemms_apply_the_norm_through_the_cuda_kernel(emulated_cuda, act):
    x = (torch.randn(3, 37, 72) * 1.7 + 0.7).half()
    nw, nb = (torch.rand(72) + 0.5).half(), (torch.randn(72) * 0.3).half()
    w = (torch.randn(96 if act == "geglu" else 48, 72) / 72**0.5).half()
    b = (torch.randn(w.shape[0]) * 0.2).half()

    def reference(x, nw, nb, w, b):
        z = F.linear(F.layer_norm(x, (72,), nw, nb, 1e-5), w, b)
        if act == "geglu":
            h, g = z.chunk(2, -1)
            return h * F.gelu(g)
        return F.gelu(z) if act else z

    with torch.no_grad():
        y = layer_norm_linear(x, nw, nb, w, b, eps=1e-5, activation=act)
    _check(y, reference, (x, nw, nb, w, b), f"{act}")
    assert emulated_cuda()[("layer_norm_apply", "cuda")] == 1
    assert emulated_cuda().get(("linear_epilogue", "cuda"), 0) == (act is not None)


def test_inputs_the_cuda_kernels_refuse_take_the_triton_pass(emulated_cuda):
    """A residual in another dtype than the GEMM output (fp32 stream, fp16 GEMM) goes to the Triton pass, with the
    output promoted as PyTorch promotes it."""
    x, w, b = _inputs(9, 40, 24, torch.float16)
    residual = torch.randn(2, 9, 24)
    with torch.no_grad():
        y = ops.linear(x, w, b, residual=residual)
    assert y.dtype == torch.float32
    _check(y, lambda x, w, b, r: r + F.linear(x, w, b), (x, w, b, residual), "promoted")
    assert emulated_cuda() == {("linear", "triton"): 1, ("linear_epilogue", "triton"): 1}
