"""The "cublas" GEMM placement (ops/linear_cublas.py): PyTorch's GEMM (cuBLAS on GPUs), then one Triton pass for the
epilogue (kernels/linear_epilogue.py), for ops.linear, ops.geglu, the linear with row statistics and the LayerNorm
GEMMs. On CPU auto keeps the Triton GEMM; these tests force "cublas" (PyTorch's CPU GEMM, the pass in the interpreter,
whose tiles here are 128 x 128 at N=200: two column tiles, and three row tiles of M=300)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU

import ldmopt
from ldmopt import ops
from ldmopt.ops import linear_cublas
from ldmopt.ops.layer_norm_linear import layer_norm_linear
from tests.tolerances import assert_close, assert_compiled_matches_eager, assert_within_torch_error

#: bf16 too: the pass has no tl.dot, which the interpreter gets wrong for bf16 (the Triton GEMM's tests leave it out)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_ACT = {
    None: lambda z: z,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


@pytest.fixture
def cublas():
    linear_cublas.placement_counts.clear()
    with linear_cublas.forced("cublas"), ldmopt.use_backend("triton"):
        yield linear_cublas.placement_counts


def _reference(x, w, b, act=None, gate=None, residual=None):
    out = _ACT[act](F.linear(x, w, b))
    if gate is not None:
        out = out * gate[:, None, :]
    return out if residual is None else out + residual


def _inputs(shape, n, dtype, gated=False):
    k = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    w = (torch.randn(n, k, dtype=torch.float64) * k**-0.5).to(dtype)
    b = (torch.randn(n, dtype=torch.float64) * 0.5).to(dtype)
    gate = torch.randn(shape[0], n, dtype=dtype) if gated else None
    residual = torch.randn(*shape[:-1], n, dtype=dtype) if gated else None
    return x, w, b, gate, residual


def _double(ts):
    return [None if t is None else t.detach().double() for t in ts]


def _assert_grads_within_torch_error(fused, reference, inputs, dy, names):
    """Gradients of ``fused`` (this placement) against autograd of ``reference`` in fp64, within PyTorch's own error
    (autograd of ``reference`` in the inputs' dtype)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    fused(*leaves).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in inputs]
    reference(*ref).backward(dy.double())
    lowp = [t.detach().clone().requires_grad_() for t in inputs]
    reference(*lowp).backward(dy)
    for name, got, r, lp in zip(names, leaves, ref, lowp):
        assert got.grad.dtype == got.dtype and got.grad.shape == got.shape
        assert_within_torch_error(got.grad, r.grad, lp.grad, f"d{name} {got.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("gated", [False, True])
def test_linear_matches_the_unfused_ops(cublas, dtype, act, gated, triton_launches):
    args = _inputs((3, 100, 40), 200, dtype, gated)
    with torch.no_grad():
        y = ops.linear(*args[:3], activation=act, gate=args[3], residual=args[4])
    assert y.shape == (3, 100, 200) and y.dtype == dtype
    assert_within_torch_error(y, _reference(*_double(args[:3]), act, *_double(args[3:])),
                              _reference(*args[:3], act, *args[3:]), f"{dtype} {act} gated={gated}")  # fmt: skip
    assert cublas == {"cublas": 1}
    # one pass after the GEMM, none when there is nothing to apply
    assert triton_launches == (["_linear_epilogue_kernel"] if act or gated else []), triton_launches


def test_a_column_major_residual_and_a_promoted_output(cublas):
    """An fp32 gate and a [B, T, N] residual whose sample and token axes share no row stride (a transposed patch
    embedding) on fp16 operands: the output takes the promoted dtype, as the unfused ops give it."""
    x, w, b, _, _ = _inputs((2, 13, 40), 72, torch.float16)
    gate = torch.randn(2, 72)
    residual = torch.randn(2, 72, 13, dtype=torch.float16).transpose(1, 2)
    y = ops.linear(x, w, b, activation="silu", gate=gate, residual=residual)
    assert y.dtype == torch.float32
    expect = _reference(*_double((x, w, b)), "silu", gate.double(), residual.double())
    lowp = F.silu(F.linear(x, w, b)).float() * gate[:, None] + residual.float()
    assert_within_torch_error(y, expect, lowp, "promoted")
    # out_dtype: one rounding of the fp32 epilogue to the stream's dtype (Wan's type_as)
    y16 = ops.linear(x, w, b, activation="silu", gate=gate, residual=residual, out_dtype=torch.float16)
    assert y16.dtype == torch.float16
    assert_close(y16, expect, torch.float16, "out_dtype")


def test_fp16_clip_saturates_before_rounding(cublas):
    x, w, b, gate, residual = _inputs((2, 9, 40), 24, torch.float16, gated=True)
    residual[0, 0, :4] = torch.tensor([60000.0, -60000.0, 1.0, float("nan")])
    gate.fill_(1.0)
    w[:4] = 0
    b[:4] = torch.tensor([30000.0, -30000.0, 0.0, 0.0])
    with torch.no_grad():
        y = ops.linear(x, w, b, gate=gate, residual=residual, clip_fp16=True)
    assert y[0, 0, 0] == 65504 and y[0, 0, 1] == -65504 and y[0, 0, 2] == 1 and torch.isnan(y[0, 0, 3])
    assert torch.isfinite(y.view(-1)[4:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_part_input(cublas, dtype, monkeypatch):
    """Flux's proj_out(cat([attention, mlp], -1)): 16-bit parts as two GEMMs into one output, fp32 concatenated."""
    head, tail = torch.randn(2, 11, 24, dtype=dtype), torch.randn(2, 11, 40, dtype=dtype)
    _, w, b, gate, residual = _inputs((2, 11, 64), 56, dtype, gated=True)
    concatenated = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: concatenated.append(a[0][0].shape) or cat(*a, **k))
    with torch.no_grad():
        y = ops.linear((head, tail), w, b, gate=gate, residual=residual)
    monkeypatch.undo()
    # 16-bit parts: two GEMMs, the concatenation never written; fp32 ones concatenated for one GEMM
    assert len(concatenated) == (dtype == torch.float32), concatenated
    joined = torch.cat([head, tail], -1)
    expect = _reference(*_double((joined, w, b)), None, *_double((gate, residual)))
    lowp = _reference(joined, w, b, None, gate, residual)
    assert_within_torch_error(y, expect, lowp, f"two parts {dtype}")


def test_a_blend_stays_in_the_triton_gemm(cublas, triton_launches):
    x, w, b, _, residual = _inputs((2, 5, 40), 24, torch.float32, gated=True)
    y = ops.linear((x, torch.randn_like(x)), w, b, residual=residual, mix=torch.rand(2))
    assert y.shape == (2, 5, 24)
    assert cublas == {"triton": 1} and triton_launches == ["_linear_fwd_kernel"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_matches_autograd_of_the_reference(cublas, dtype):
    inputs = _inputs((3, 21, 40), 72, dtype, gated=True)
    dy = torch.randn(3, 21, 72, dtype=dtype)

    def fused(x, w, b, gate, residual):
        return ops.linear(x, w, b, activation="gelu", gate=gate, residual=residual)

    def reference(x, w, b, gate, residual):
        return _reference(x, w, b, "gelu", gate, residual)

    _assert_grads_within_torch_error(fused, reference, inputs, dy, ("x", "weight", "bias", "gate", "residual"))
    assert set(cublas) == {"cublas"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_matches_diffusers(cublas, dtype, triton_launches):
    mod = GEGLU(40, 72)
    with torch.no_grad():
        mod.proj.weight.normal_(0, 40**-0.5)
        mod.proj.bias.normal_(0, 0.5)
    ref = GEGLU(40, 72).double().requires_grad_(False)
    ref.load_state_dict(mod.state_dict())
    mod = mod.to(dtype)
    x = torch.randn(3, 37, 40, dtype=dtype)
    with torch.no_grad():
        y = ops.geglu(x, mod.proj.weight, mod.proj.bias)
        assert_within_torch_error(y, ref(x.double()), mod(x), f"geglu {dtype}")
    assert cublas == {"cublas": 1} and triton_launches == ["_linear_epilogue_kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_geglu_backward_keeps_the_gemm_output_as_its_pre_activation(cublas, dtype):
    x, w, b = torch.randn(2, 19, 40), torch.randn(144, 40) / 40**0.5, torch.randn(144)
    inputs = (x.to(dtype), w.to(dtype), b.to(dtype))

    def reference(x, w, b):
        h, g = F.linear(x, w, b).chunk(2, -1)
        return h * F.gelu(g)

    _assert_grads_within_torch_error(ops.geglu, reference, inputs, torch.randn(2, 19, 72, dtype=dtype),
                                     ("x", "weight", "bias"))  # fmt: skip
    assert set(cublas) == {"cublas"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_row_statistics_are_those_of_the_stored_output(cublas, dtype, gated, triton_launches):
    x, w, b, gate, residual = _inputs((2, 150, 40), 200, dtype, gated=True)
    gate = gate if gated else None
    with torch.no_grad():
        y, stats = ops.linear(x, w, b, residual=residual, gate=gate, next_norm_eps=1e-5)
        plain = ops.linear(x, w, b, residual=residual, gate=gate)
    torch.testing.assert_close(y, plain, rtol=0, atol=0)
    rows = y.double().reshape(-1, 200)
    assert_close(stats[0], rows.mean(1), torch.float32, "mean")
    assert_close(stats[1], torch.rsqrt(rows.var(1, unbiased=False) + 1e-5), torch.float32, "rstd")
    assert triton_launches == ["_linear_epilogue_kernel"] * 2  # statistics in the pass, none of their own


def test_statistics_alone_only_read_the_gemm_output(cublas, triton_launches):
    x, w, b, _, _ = _inputs((2, 150, 40), 200, torch.float16)
    with torch.no_grad():
        y, stats = ops.linear(x, w, b, next_norm_eps=1e-6)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)  # the GEMM's output as it is
    rows = y.double().reshape(-1, 200)
    assert_close(stats[1], torch.rsqrt(rows.var(1, unbiased=False) + 1e-6), torch.float32, "rstd")
    assert triton_launches == ["_linear_epilogue_kernel"]


def test_statistics_under_deterministic_algorithms_take_their_own_pass(cublas, triton_launches):
    x, w, b, gate, residual = _inputs((2, 15, 40), 72, torch.float32, gated=True)
    torch.use_deterministic_algorithms(True)
    try:
        y, stats = ops.linear(x, w, b, gate=gate, residual=residual, next_norm_eps=1e-5)
    finally:
        torch.use_deterministic_algorithms(False)
    rows = y.double().reshape(-1, 72)
    assert_close(stats[0], rows.mean(1), torch.float32, "mean")
    assert triton_launches == ["_linear_epilogue_kernel", "_row_stats_kernel"], triton_launches


@pytest.mark.parametrize("act", [None, "gelu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_gemms_apply_the_norm_first(cublas, act, dtype):
    x = (torch.randn(3, 37, 72) * 1.7 + 0.7).to(dtype)
    nw, nb = (torch.rand(72) + 0.5).to(dtype), (torch.randn(72) * 0.3).to(dtype)
    w = (torch.randn(96 if act == "geglu" else 48, 72) / 72**0.5).to(dtype)
    b = (torch.randn(w.shape[0]) * 0.2).to(dtype)

    def reference(x, nw, nb, w, b):
        z = F.linear(F.layer_norm(x, (72,), nw, nb, 1e-5), w, b)
        if act == "geglu":
            h, g = z.chunk(2, -1)
            return h * F.gelu(g)
        return F.gelu(z) if act else z

    with torch.no_grad():
        y = layer_norm_linear(x, nw, nb, w, b, eps=1e-5, activation=act)
    assert_within_torch_error(y, reference(*_double((x, nw, nb, w, b))), reference(x, nw, nb, w, b), f"{act}")
    assert cublas == {"cublas": 1}


def test_layer_norm_gemm_with_positions_backward(cublas):
    """AnimateDiff's motion modules: a positional table row per frame added to the norm, gradients through both."""
    table = torch.randn(5, 40) * 0.5
    inputs = (torch.randn(16, 5, 40) * 1.3 + 0.4, torch.rand(40) + 0.5, torch.randn(40) * 0.3,
              torch.randn(24, 40) / 40**0.5, torch.randn(24) * 0.2)  # fmt: skip

    def fused(x, nw, nb, w, b):
        return layer_norm_linear(x, nw, nb, w, b, eps=1e-5, positions=table)

    def reference(x, nw, nb, w, b):
        return F.linear(F.layer_norm(x, (40,), nw, nb, 1e-5) + table.to(x.dtype), w, b)

    _assert_grads_within_torch_error(fused, reference, inputs, torch.randn(16, 5, 24),
                                     ("x", "norm_weight", "norm_bias", "weight", "bias"))  # fmt: skip
    assert set(cublas) == {"cublas"}


def test_direct_op_call_keeping_the_pre_activation_returns_unaliased_outputs(cublas):
    x, w, b, _, _ = _inputs((7, 40), 24, torch.float32)
    y, pre = torch.ops.ldmopt.linear_fwd(x, w, b, None, None, "", True, None)
    assert y.data_ptr() != pre.data_ptr()
    torch.testing.assert_close(y, pre, rtol=0, atol=0)


def test_opcheck_and_compile_fullgraph(cublas):
    x, w, b, gate, residual = _inputs((2, 9, 40), 24, torch.float32, gated=True)
    args = (x.view(-1, 40).clone().requires_grad_(), w.clone().requires_grad_(), b, gate, residual.view(-1, 24),
            "gelu", True, None)  # fmt: skip
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, args)
    # in place into the GEMM's output (no pre-activation kept)
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, (*args[:5], "silu", False, None))
    torch.library.opcheck(torch.ops.ldmopt.geglu_fwd, (x.view(-1, 40), torch.randn(48, 40), torch.randn(48), True))
    torch.library.opcheck(torch.ops.ldmopt.linear_stats_fwd, (*args[:5], "gelu", False, None, 1e-5))
    rows = x.view(-1, 40) + 0.5
    stats = torch.ops.ldmopt.layer_norm_stats(rows, 1e-5)
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_linear_fwd,
                          (rows, stats, torch.rand(40) + 0.5, torch.randn(40), w, b, "geglu", True))  # fmt: skip
    assert set(cublas) == {"cublas"}

    def fn(x):
        h = ops.geglu(x, torch.ones(48, 40) * 0.05, None)
        return ops.linear(h, w[:, :24], b, activation="silu", gate=gate, residual=x[..., :24])

    assert_compiled_matches_eager(fn, [x.clone().requires_grad_()])


def _addmm_tanh_gelu(bias, mat1, mat2, *, use_gelu):
    """What CUDA's torch._addmm_activation computes (the tanh form of GELU), for CPU tensors: the CPU kernel applies
    the erf form, which is why the cublasLt route is CUDA-only (linear_cublas.TANH_GELU_DEVICES)."""
    assert use_gelu and bias.dim() == 1 and mat2.shape == (mat1.shape[1], bias.shape[0])
    return F.gelu(torch.addmm(bias, mat1, mat2), approximate="tanh")


@pytest.fixture
def tanh_gelu_gemm(monkeypatch):
    """CPU tensors take the cuBLASLt GELU route, its GEMM the CUDA kernel's semantics; yields the route's counts."""
    monkeypatch.setattr(linear_cublas, "TANH_GELU_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_addmm_activation", _addmm_tanh_gelu)
    linear_cublas.gelu_epilogue_counts.clear()
    return linear_cublas.gelu_epilogue_counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_tanh_runs_in_the_gemm_epilogue_without_a_pass(cublas, tanh_gelu_gemm, dtype, triton_launches):
    x, w, b, _, _ = _inputs((3, 100, 40), 200, dtype)
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="gelu_tanh")
    assert y.shape == (3, 100, 200) and y.dtype == dtype
    expect = _reference(*_double((x, w, b)), "gelu_tanh")
    assert_within_torch_error(y, expect, _reference(x, w, b, "gelu_tanh"), f"{dtype}")
    assert triton_launches == [] and tanh_gelu_gemm == {"cublaslt": 1} and cublas == {"cublas": 1}


def test_gelu_tanh_with_more_to_apply_or_to_keep_takes_the_pass(cublas, tanh_gelu_gemm, monkeypatch):
    """A gate, a residual, an fp32 output, an erf GELU, no bias, or a pre-activation kept for backward: the pass (a
    plain GELU-tanh counted); LDMOPT_GEMM_GELU=pass keeps the pass for the plain case too."""
    x, w, b, gate, residual = _inputs((2, 9, 40), 72, torch.float16, gated=True)
    with torch.no_grad():
        ops.linear(x, w, b, activation="gelu_tanh", gate=gate, residual=residual)
        ops.linear(x, w, b, activation="gelu_tanh", out_dtype=torch.float32)
        ops.linear(x, w, None, activation="gelu_tanh")
        ops.linear(x, w, b, activation="gelu")
    assert tanh_gelu_gemm == {"pass": 2}
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = ops.linear(*leaves, activation="gelu_tanh")
    assert tanh_gelu_gemm == {"pass": 3}
    _assert_grads_within_torch_error(lambda *t: ops.linear(*t, activation="gelu_tanh"),
                                     lambda *t: _reference(*t, "gelu_tanh"), (x, w, b), torch.randn_like(y),
                                     "x w b")  # fmt: skip
    monkeypatch.setenv(linear_cublas.GELU_ENV, "pass")
    with torch.no_grad():
        ops.linear(x, w, b, activation="gelu_tanh")
    assert tanh_gelu_gemm["cublaslt"] == 0
    monkeypatch.setenv(linear_cublas.GELU_ENV, "cublas")
    with pytest.raises(ValueError, match=r"LDMOPT_GEMM_GELU='cublas'.*'auto', 'pass'"), torch.no_grad():
        ops.linear(x, w, b, activation="gelu_tanh")


def test_layer_norm_gemm_with_gelu_tanh_uses_the_gemm_epilogue(cublas, tanh_gelu_gemm):
    x = torch.randn(2, 9, 40) + 0.5
    nw, nb = 1 + 0.3 * torch.randn(40), 0.1 * torch.randn(40)
    w, b = torch.randn(72, 40) * 40**-0.5, 0.1 * torch.randn(72)
    with torch.no_grad():
        y = layer_norm_linear(x, nw, nb, w, b, activation="gelu_tanh")
    expect = F.gelu(F.linear(F.layer_norm(x.double(), (40,), nw.double(), nb.double()), w.double(), b.double()),
                    approximate="tanh")  # fmt: skip
    assert_close(y, expect, torch.float32, "layer norm + gelu_tanh")
    assert tanh_gelu_gemm == {"cublaslt": 1}


def test_the_variable_chooses_and_names_its_values(monkeypatch):
    x, w, b, _, _ = _inputs((7, 40), 24, torch.float32)
    linear_cublas.placement_counts.clear()
    with ldmopt.use_backend("triton"):
        ops.linear(x, w, b, activation="gelu")  # auto on CPU tensors: the Triton GEMM
        monkeypatch.setenv("LDMOPT_GEMM_PLACEMENT", "cuBLAS ")
        ops.linear(x, w, b, activation="gelu")
        monkeypatch.setenv("LDMOPT_GEMM_PLACEMENT", "cutlass")
        with pytest.raises(ValueError, match=r"LDMOPT_GEMM_PLACEMENT='cutlass'.*'auto', 'triton', 'cublas'"):
            ops.linear(x, w, b, activation="gelu")
    assert linear_cublas.placement_counts == {"triton": 1, "cublas": 1}


def test_info_shows_the_setting(monkeypatch):
    from ldmopt import info

    monkeypatch.delenv(linear_cublas.ENV, raising=False)
    assert info.collect(query_gpu=False)["gemm_placement"].startswith("auto (on a GPU: cublas, PyTorch's GEMM")
    monkeypatch.setenv(linear_cublas.ENV, "triton")
    text = info.format_info(info.collect(query_gpu=False))
    assert "fused linear GEMMs: triton (forced by LDMOPT_GEMM_PLACEMENT)" in text
    monkeypatch.setenv(linear_cublas.ENV, "fast")
    assert "invalid: LDMOPT_GEMM_PLACEMENT='fast'" in info.collect(query_gpu=False)["gemm_placement"]


def test_auto_choice_on_gpu_tensors_and_under_deterministic_algorithms(monkeypatch):
    """auto: cuBLAS for CUDA tensors (asked without a GPU: no tensor is made), but not under deterministic algorithms
    without CUBLAS_WORKSPACE_CONFIG, where PyTorch refuses to run cuBLAS; CPU tensors keep the Triton GEMM."""
    monkeypatch.delenv(linear_cublas.ENV, raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert linear_cublas.gemm_placement(cuda) == "cublas" and linear_cublas.gemm_placement(cpu) == "triton"
    assert linear_cublas.gemm_placement(cuda, blend=True) == "triton"
    torch.use_deterministic_algorithms(True)
    try:
        assert linear_cublas.gemm_placement(cuda) == "triton"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        assert linear_cublas.gemm_placement(cuda) == "cublas"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("placement", ["cublas", "triton"])
def test_a_norm_read_by_three_projections_stacks_them_where_it_pays(placement, monkeypatch):
    """to_q/to_k/to_v after one LayerNorm: M = 10 rows, N = 24 outputs. The Triton GEMMs normalise in their loads
    and stack only for M > N; under cublas each projection on its own writes and reads the norm's output, so three
    of them stack from 3 M > N: one GEMM call where the Triton placement makes three."""
    from ldmopt.nn.layer_norm_input import NormedInput

    monkeypatch.setenv(linear_cublas.ENV, placement)
    linear_cublas.placement_counts.clear()
    norm = torch.nn.LayerNorm(40)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_(0, 0.3)
    layers = [torch.nn.Linear(40, 8) for _ in range(3)]
    x = torch.randn(1, 10, 40)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        got = NormedInput(norm, x, "test").project_all(layers, ["to_q", "to_k", "to_v"])
        expected = [layer(norm(x)) for layer in layers]
    for g, e in zip(got, expected):
        assert_close(g, e.double(), torch.float32, "projection")
    assert linear_cublas.placement_counts == {placement: 1 if placement == "cublas" else 3}


def test_autocast_casts_before_the_gemm_as_f_linear_does(cublas):
    """fp32 parameters under bf16 autocast (mixed-precision training): the operands are cast before the op, the GEMM
    runs in bf16 as F.linear's would, and the output is bf16, as the unfused modules give it."""
    x, w, b, _, _ = _inputs((2, 9, 40), 48, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.linear(x, w, b, activation="gelu_tanh")
        g = ops.geglu(x, w, b)
        expected = F.gelu(F.linear(x, w, b), approximate="tanh")
        h, gt = F.linear(x, w, b).chunk(2, -1)
        expected_geglu = h * F.gelu(gt)
    assert y.dtype == g.dtype == torch.bfloat16
    reference = F.gelu(F.linear(*_double((x.bfloat16(), w.bfloat16(), b.bfloat16()))), approximate="tanh")
    assert_within_torch_error(y, reference, expected, "autocast linear")
    h64, g64 = F.linear(*_double((x.bfloat16(), w.bfloat16(), b.bfloat16()))).chunk(2, -1)
    assert_within_torch_error(g, h64 * F.gelu(g64), expected_geglu, "autocast geglu")
    assert cublas == {"cublas": 2}
