"""ldmopt.ops.layer_norm_linear / layer_norm_stats: a LayerNorm read in the GEMM's loads (Triton interpreter and the
torch backend) against F.layer_norm -> F.linear (-> activation / GEGLU) in fp64 and in the input dtype."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.layer_norm_linear import layer_norm_linear, layer_norm_stats
from tests.tolerances import assert_close, assert_within_torch_error

EPS = 1e-5


def _inputs(shape, n, dtype, affine=True, act=None, offset=0.7):
    k = shape[-1]
    # Rows off zero mean and off unit scale, so neither the centring nor the scaling is a no-op.
    x = (torch.randn(shape) * 1.7 + offset).to(dtype)
    nw = (torch.rand(k) + 0.5).to(dtype) if affine else None
    nb = (torch.randn(k) * 0.3).to(dtype) if affine else None
    rows = 2 * n if act == "geglu" else n
    w = (torch.randn(rows, k) / k**0.5).to(dtype)
    b = (torch.randn(rows) * 0.2).to(dtype)
    return x, nw, nb, w, b


def _reference(x, nw, nb, w, b, act, eps=EPS):
    z = F.linear(F.layer_norm(x, (x.shape[-1],), nw, nb, eps), w, b)
    if act == "geglu":
        h, g = z.chunk(2, dim=-1)
        return h * F.gelu(g)
    return {None: z, "gelu": F.gelu(z) if act == "gelu" else z, "silu": F.silu(z)}[act]


def _double(ts):
    return [None if t is None else t.detach().double() for t in ts]


CASES = [((37, 72), 48), ((2, 5, 40), 24), ((3, 100), 8)]  # K, N off the 32-wide interpreter tiles; row tails


@pytest.mark.parametrize("shape,n", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", [None, "gelu", "geglu"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward_matches_layer_norm_then_linear(shape, n, dtype, act, backend):
    args = _inputs(shape, n, dtype, act=act)
    with ldmopt.use_backend(backend), torch.no_grad():
        y = layer_norm_linear(*args[:3], *args[3:], eps=EPS, activation=act)
    expect = _reference(*_double(args), act)
    lowp = _reference(*args, act)
    assert y.shape == lowp.shape and y.dtype == dtype
    assert_within_torch_error(y, expect, lowp, f"{shape} {dtype} {act} {backend}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_affine_and_bias(dtype):
    x, _, _, w, _ = _inputs((2, 9, 56), 40, dtype, affine=False)
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, None, None, w, None, activation="silu")
    expect = _reference(*_double((x, None, None, w, None)), "silu")
    assert_within_torch_error(y, expect, _reference(x, None, None, w, None, "silu"), f"no affine {dtype}")


def test_statistics_far_from_zero_mean():
    # Rows at mean 1000 with unit spread: a one-pass E[x^2] - E[x]^2 in fp32 would lose the variance entirely.
    x = torch.randn(19, 300) + 1000.0
    with ldmopt.use_backend("triton"):
        stats = layer_norm_stats(x, EPS)
    xd = x.double()
    assert stats.dtype == torch.float32 and stats.shape == (2, 19)
    assert_close(stats[0], xd.mean(-1), torch.float32, "mean")
    torch.testing.assert_close(stats[1].double(), torch.rsqrt(xd.var(-1, unbiased=False) + EPS), rtol=1e-4, atol=0)


def test_shared_statistics_serve_several_projections():
    # diffusers' to_q / to_k / to_v read one norm: one statistics pass, three GEMMs, each as if unfused.
    x, nw, nb, _, _ = _inputs((2, 7, 48), 32, torch.float32)
    with ldmopt.use_backend("triton"):
        stats = layer_norm_stats(x, EPS)
        for _ in range(3):
            w = torch.randn(32, 48) * 0.2
            y = layer_norm_linear(x, nw, nb, w, eps=EPS, stats=stats)
            assert_close(y, _reference(*_double((x, nw, nb, w, None)), None), torch.float32, "shared stats")


def test_strided_input():
    # x as a transposed view: the statistics pass and the GEMM both read it through its strides.
    x = torch.randn(40, 37).t() + 0.5
    _, nw, nb, w, b = _inputs((37, 40), 24, torch.float32)
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, nw, nb, w, b, activation="gelu")
    assert_close(y, _reference(*_double((x, nw, nb, w, b)), "gelu"), torch.float32, "strided")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", [None, "gelu", "geglu"])
def test_backward_triton_vs_autograd(dtype, act):
    args = _inputs((2, 6, 40), 24, dtype, act=act)
    dy_shape = (2, 6, 24)
    dy = torch.randn(dy_shape, dtype=dtype)
    leaves = [t.detach().clone().requires_grad_() for t in args]
    with ldmopt.use_backend("triton"):
        layer_norm_linear(*leaves, eps=EPS, activation=act).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    _reference(*ref, act).backward(dy.double())
    lowp = [t.detach().clone().requires_grad_() for t in leaves]
    _reference(*lowp, act).backward(dy)
    for name, got, r, lp in zip(("dx", "dnorm_weight", "dnorm_bias", "dweight", "dbias"), leaves, ref, lowp):
        assert got.grad is not None and got.grad.dtype == dtype and got.grad.shape == got.shape, name
        assert_within_torch_error(got.grad, r.grad, lp.grad, f"{name} {dtype} {act}")


@pytest.mark.parametrize("act", [None, "gelu_tanh", "geglu"])
def test_gradcheck_reference_fp64(act):
    args = [t.requires_grad_() for t in _inputs((2, 3, 12), 6, torch.float64, act=act)]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda *a: layer_norm_linear(*a, eps=EPS, activation=act), tuple(args))


def test_gradient_with_shared_statistics_sums_over_the_projections():
    # Three GEMMs on one stats tensor: x's gradient is the sum of three LayerNorm backwards, as autograd's would be.
    x, nw, nb, _, _ = [t.requires_grad_() if t is not None else t for t in _inputs((2, 5, 24), 8, torch.float64)]
    ws = [torch.randn(8, 24, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    with ldmopt.use_backend("torch"):
        stats = layer_norm_stats(x, EPS)
        total = sum((layer_norm_linear(x, nw, nb, w, eps=EPS, stats=stats) * (i + 1)).sum() for i, w in enumerate(ws))
    grads = torch.autograd.grad(total, [x, nw, nb, *ws])
    normed = F.layer_norm(x, (24,), nw, nb, EPS)
    expect = sum((F.linear(normed, w) * (i + 1)).sum() for i, w in enumerate(ws))
    for got, want in zip(grads, torch.autograd.grad(expect, [x, nw, nb, *ws])):
        torch.testing.assert_close(got, want)


def test_autocast_reads_the_fp32_stream_and_rounds_the_norm_once():
    x = torch.randn(2, 5, 24) + 0.3
    nw, nb = torch.rand(24) + 0.5, torch.randn(24) * 0.1
    w = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16), ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, nw, nb, w, b, activation="gelu")
        expect = F.gelu(F.linear(F.layer_norm(x, (24,), nw, nb, EPS), w, b))
    assert y.dtype == expect.dtype == torch.float16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    ref = _reference(*_double((x, nw, nb, w.half(), b.half())), "gelu")
    assert_within_torch_error(y, ref, expect, "autocast")


def test_opcheck():
    x, nw, nb, w, b = _inputs((10, 24), 16, torch.float32)
    stats = layer_norm_stats(x, EPS)
    w.requires_grad_()
    nw.requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_stats, (x, EPS))
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_linear_fwd, (x, stats, nw, nb, w, b, "gelu", True))
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_linear_fwd, (x, stats, None, None, w, None, "", False))
    wg = torch.randn(32, 24, requires_grad=True)
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_linear_fwd, (x, stats, nw, nb, wg, None, "geglu", True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    x, nw, nb, w, b = [t.requires_grad_() for t in _inputs((2, 5, 24), 32, torch.float32, act="geglu")]
    wq = torch.randn(8, 24, requires_grad=True)

    def block(x, nw, nb, w, b, wq):
        stats = layer_norm_stats(x, EPS)
        q = layer_norm_linear(x, nw, nb, wq, eps=EPS, stats=stats)
        return layer_norm_linear(x, nw, nb, w, b, eps=EPS, activation="geglu", stats=stats)[..., :8] + q

    leaves = (x, nw, nb, w, b, wq)
    out = torch.compile(block, backend=backend, fullgraph=True)(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    expect = block(*leaves)
    want = torch.autograd.grad(expect.sum(), leaves)
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    for i, (got, ref) in enumerate(zip(grads, want)):
        assert_close(got, ref.double(), torch.float32, f"compiled grad {i}")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(norm_weight=torch.randn(5)), ValueError, r"norm_weight must be a \(24,\) tensor"),
        (dict(weight=torch.randn(16, 20)), ValueError, r"weight has shape \(16, 20\), expected \(N, 24\)"),
        (dict(weight=torch.randn(16, 24, dtype=torch.float64)), TypeError, "weight has dtype torch.float64"),
        (dict(activation="relu"), ValueError, "activation"),
        (dict(stats=torch.randn(2, 9)), ValueError, r"stats must be layer_norm_stats\(x\) of shape \(2, 10\)"),
        (dict(activation="geglu", weight=torch.randn(15, 24)), ValueError, "multiple of 2"),
        (dict(x=torch.tensor(1.0)), ValueError, "layer_norm_linear: x must have at least 1 dim"),
    ],
)
def test_bad_input_messages(kwargs, error, match):
    args = dict(x=torch.randn(2, 5, 24), norm_weight=None, norm_bias=None, weight=torch.randn(16, 24))
    args.update(kwargs)
    x, nw, nb, w = (args.pop(k) for k in ("x", "norm_weight", "norm_bias", "weight"))
    with pytest.raises(error, match=match):
        layer_norm_linear(x, nw, nb, w, **args)


def test_stats_refuse_bad_eps():
    with pytest.raises(ValueError, match="eps"):
        layer_norm_stats(torch.randn(3, 4), -1.0)


@pytest.mark.parametrize("act", [None, "geglu"])
def test_k_tail_without_affine_stays_finite(act):
    # A constant row (variance 0) at 100 with eps=1e-6: -mean * rstd = -1e5 overflows fp16 in the K tail's padding
    # unless the tail is zeroed (K=40 leaves a tail in the 32-wide interpreter tiles); no norm weight zeroes it.
    x, _, _, w, b = _inputs((3, 40), 8, torch.float16, affine=False, act=act)
    x[1] = 100.0
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, None, None, w, b, eps=1e-6, activation=act)
    expect = _reference(*_double((x, None, None, w, b)), act, eps=1e-6)
    assert_within_torch_error(y, expect, _reference(x, None, None, w, b, act, eps=1e-6), f"constant row {act}")


def test_statistics_of_a_row_slice():
    # stats for rows 6: of a larger batch, as a strided [2, M] slice: the GEMM reads the right rows' statistics.
    x, nw, nb, w, b = _inputs((12, 40), 16, torch.float32)
    stats = layer_norm_stats(x, EPS)[:, 6:]
    for backend in ("triton", "torch"):
        with ldmopt.use_backend(backend):
            y = layer_norm_linear(x[6:], nw, nb, w, b, eps=EPS, stats=stats)
        assert_close(y, _reference(*_double((x[6:], nw, nb, w, b)), None), torch.float32, backend)
    # and backward (the slice's statistics read as rows there too), the Triton backend forced
    leaves = [t.clone().requires_grad_() for t in (x[6:], nw, nb, w, b)]
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(*leaves, eps=EPS, stats=stats, activation="gelu")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    expect = torch.autograd.grad(_reference(*ref, "gelu"), ref, dy.double())
    for name, g, e in zip(("dx", "dnorm_weight", "dnorm_bias", "dweight", "dbias"), got, expect):
        assert_close(g, e, torch.float32, f"{name} of a row slice's statistics")


def _with_positions(x, nw, nb, w, b, table, rows_per, act=None):
    # F.layer_norm, then table[(m // rows_per) % P] added to row m (diffusers' sinusoidal embedding over frames).
    h = F.layer_norm(x, (x.shape[-1],), nw, nb, EPS)
    index = torch.arange(h.shape[0]) // rows_per % table.shape[0]
    z = F.linear(h + table[index], w, b)
    return F.gelu(z) if act == "gelu" else z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_positions_added_to_the_norm_per_frame(dtype, backend):
    # 3 frames of 5 tokens, repeating over 2 videos: 30 rows; K=40 leaves a tail in the interpreter's tiles.
    x, nw, nb, w, b = _inputs((30, 40), 24, dtype)
    table = torch.randn(3, 40).to(dtype)
    with ldmopt.use_backend(backend), torch.no_grad():
        y = layer_norm_linear(x, nw, nb, w, b, eps=EPS, activation="gelu", positions=table, position_rows=5)
    expect = _with_positions(*_double((x, nw, nb, w, b, table)), 5, "gelu")
    lowp = _with_positions(x, nw, nb, w, b, table, 5, "gelu")
    assert_within_torch_error(y, expect, lowp, f"positions {dtype} {backend}")


def test_positions_backward_vs_autograd():
    x, nw, nb, w, b = _inputs((30, 40), 24, torch.float32)
    table = torch.randn(3, 40)
    leaves = [t.detach().clone().requires_grad_() for t in (x, nw, nb, w, b)]
    dy = torch.randn(30, 24)
    with ldmopt.use_backend("triton"):
        layer_norm_linear(*leaves, eps=EPS, activation="gelu", positions=table, position_rows=5).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    _with_positions(*ref, table.double(), 5, "gelu").backward(dy.double())
    for name, got, want in zip(("dx", "dnw", "dnb", "dw", "db"), leaves, ref):
        assert_close(got.grad, want.grad, torch.float32, name)


def test_positions_with_geglu_run_the_torch_backend():
    x, nw, nb, w, b = _inputs((12, 40), 8, torch.float32, act="geglu")
    table = torch.randn(4, 40)
    y = layer_norm_linear(x, nw, nb, w, b, activation="geglu", positions=table, position_rows=3)
    z = _with_positions(*_double((x, nw, nb, w, b, table)), 3)
    h, g = z.chunk(2, dim=-1)
    assert_close(y, h * F.gelu(g), torch.float32, "geglu + positions")
    with ldmopt.use_backend("triton"), pytest.raises(ldmopt.BackendUnavailableError, match="positions with GEGLU"):
        layer_norm_linear(x, nw, nb, w, b, activation="geglu", positions=table, position_rows=3)


@pytest.mark.parametrize(
    "positions,rows,match",
    [
        (torch.randn(3, 7), 1, r"positions must be a fixed \[P, 40\] table"),
        (torch.randn(3, 40, requires_grad=True), 1, "requires_grad=True"),
        (torch.randn(3, 40), 0, "position_rows must be a positive int"),
    ],
)
def test_bad_positions(positions, rows, match):
    x, nw, nb, w, b = _inputs((6, 40), 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        layer_norm_linear(x, nw, nb, w, b, positions=positions, position_rows=rows)


def test_opcheck_with_positions():
    x, nw, nb, w, b = _inputs((12, 24), 16, torch.float32)
    stats = layer_norm_stats(x, EPS)
    w.requires_grad_()
    table = torch.randn(4, 24)
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_linear_fwd, (x, stats, nw, nb, w, b, "gelu", True, table, 3))
