"""ldmopt.ops.linear: GEMM + bias + activation and the gated residual (interpreter and reference backend)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward

import ldmopt
from ldmopt.nn.linear import FusedGELU, FusedLinear
from ldmopt.ops.linear import linear
from tests.tolerances import assert_close, assert_within_torch_error

ACTIVATIONS = [None, "gelu", "gelu_tanh", "silu"]
_TORCH_ACT = {
    None: lambda z: z,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def _reference(x, weight, bias, activation=None, gate=None, residual=None):
    out = _TORCH_ACT[activation](F.linear(x, weight, bias))
    if gate is not None:
        out = out * (gate.unsqueeze(1) if x.dim() == 3 and gate.dim() == 2 else gate)
    return out + residual if residual is not None else out


def _inputs(x_shape, n, dtype, gated, bias=True):
    k = x_shape[-1]
    x = torch.randn(x_shape, dtype=dtype)
    weight = (torch.randn(n, k, dtype=torch.float64) * k**-0.5).to(dtype)
    b = (torch.randn(n, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    gate = residual = None
    if gated:
        gate = torch.randn((x_shape[0], n), dtype=dtype)
        residual = torch.randn((*x_shape[:-1], n), dtype=dtype)
    return x, weight, b, gate, residual


SHAPES = [
    # (x shape, N): K=40 and N=72 not multiples of the 32-wide interpreter tiles, M=37 with a 5-row tail
    ((37, 40), 72),  # 2-D rows (a gate is then one vector per row)
    ((3, 13, 40), 72),  # 3-D [B, T, K]: the gate is per sample, broadcast over 13 tokens
]


@pytest.mark.parametrize("shape,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
def test_forward_triton(shape, n, dtype, activation, gated):
    x, w, b, gate, res = _inputs(shape, n, dtype, gated)
    with ldmopt.use_backend("triton"):
        y = linear(x, w, b, activation=activation, gate=gate, residual=res)
    assert y.shape == (*shape[:-1], n) and y.dtype == dtype
    as64 = [t.double() if t is not None else None for t in (x, w, b, gate, res)]
    expect = _reference(*as64[:3], activation, *as64[3:])
    lowp = _reference(x, w, b, activation, gate, res)
    assert_within_torch_error(y, expect, lowp, f"linear {shape} {dtype} {activation} gated={gated}")


def test_gate_shaped_b1n_and_no_bias():
    x, w, _, gate, res = _inputs((3, 13, 40), 72, torch.float32, True, bias=False)
    with ldmopt.use_backend("triton"):
        y = linear(x, w, gate=gate[:, None, :], residual=res)
        y_gate_only = linear(x, w, gate=gate)
    assert_close(y, _reference(x.double(), w.double(), None, None, gate.double(), res.double()), torch.float32)
    assert_close(y_gate_only, _reference(x.double(), w.double(), None, None, gate.double()), torch.float32)


def _channels_major_residual(b, t, n, dtype):
    """[B, T, N] with strides (N*T, 1, T): a transposed [B, N, T] tensor (Latte's patch embedding output), whose
    sample and token axes have no common row stride."""
    res = torch.randn(b, n, t, dtype=dtype).transpose(1, 2)
    with pytest.raises(RuntimeError):
        res.view(-1, n)
    return res


class _NoCopies(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func.__name__.split(".")[0] not in ("clone", "copy_", "contiguous"), func
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_residual_read_in_place(dtype):
    # The kernel addresses the residual by sample and token strides: no copy of it, forward or backward.
    x, w, b, gate, _ = _inputs((3, 13, 40), 72, dtype, True)
    res = _channels_major_residual(3, 13, 72, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, gate)] + [res.detach().requires_grad_()]
    dy = torch.randn(3, 13, 72, dtype=dtype)
    with ldmopt.use_backend("triton"):
        with _NoCopies():
            y = linear(*leaves[:3], gate=leaves[3], residual=leaves[4])
        y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    expect = _reference(*ref[:3], None, *ref[3:])
    expect.backward(dy.double())
    lowp = [t.detach().clone().requires_grad_() for t in leaves]
    stock = _reference(*lowp[:3], None, *lowp[3:])
    stock.backward(dy)
    assert_within_torch_error(y, expect, stock, f"strided residual {dtype}")
    assert leaves[4].grad.shape == res.shape
    for name, got, r, lp in zip(("dx", "dweight", "dbias", "dgate", "dresidual"), leaves, ref, lowp):
        assert_within_torch_error(got.grad, r.grad, lp.grad, f"{name} {dtype}")
    with ldmopt.use_backend("torch"):
        assert_close(linear(x, w, b, gate=gate, residual=res), expect, dtype, "reference backend")


@pytest.mark.parametrize("shape,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,gated", [("gelu_tanh", False), (None, True), ("gelu", True), ("silu", False)])
def test_backward_triton_vs_autograd(shape, n, dtype, activation, gated):
    inputs = _inputs(shape, n, dtype, gated)
    dy = torch.randn((*shape[:-1], n), dtype=dtype)
    names = ("dx", "dweight", "dbias", "dgate", "dresidual")
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    with ldmopt.use_backend("triton"):
        linear(leaves[0], leaves[1], leaves[2], activation=activation, gate=leaves[3], residual=leaves[4]).backward(dy)
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    _reference(*ref[:3], activation, *ref[3:]).backward(dy.double())
    lowp = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    _reference(*lowp[:3], activation, *lowp[3:]).backward(dy)
    for name, got, r, lp in zip(names, leaves, ref, lowp):
        if got is None:
            continue
        assert got.grad.dtype == dtype and got.grad.shape == got.shape
        assert_within_torch_error(got.grad, r.grad, lp.grad, f"{name} {shape} {dtype} {activation}")


def test_gate_without_grad_skips_pre_activation():
    # No activation and a gate that needs no gradient: backward needs neither z nor a d(gate) reduction.
    x, w, b, gate, res = _inputs((3, 5, 24), 16, torch.float32, True)
    x.requires_grad_()
    with ldmopt.use_backend("triton"):
        linear(x, w, b, gate=gate, residual=res).sum().backward()
    x64 = x.detach().double().requires_grad_()
    _reference(x64, w.double(), b.double(), None, gate.double(), res.double()).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
def test_gradcheck_reference_fp64(activation, gated):
    x, w, b, gate, res = (t.requires_grad_() for t in _inputs((2, 3, 6), 5, torch.float64, True))

    def fn(x, w, b, gate, res):
        return linear(x, w, b, activation=activation, gate=gate if gated else None, residual=res if gated else None)

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, (x, w, b, gate, res))


def test_reference_backend_matches_fp64():
    x, w, b, gate, res = _inputs((3, 7, 40), 72, torch.float32, True)
    with ldmopt.use_backend("torch"):
        y = linear(x, w, b, activation="gelu_tanh", gate=gate, residual=res)
    as64 = [t.double() for t in (x, w, b, gate, res)]
    assert_close(y, _reference(*as64[:3], "gelu_tanh", *as64[3:]), torch.float32, "torch backend")


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_fused_gelu_is_drop_in_for_feedforward(approximate):
    activation_fn = "gelu-approximate" if approximate == "tanh" else "gelu"
    ff = FeedForward(40, dim_out=24, mult=2, activation_fn=activation_fn).eval()
    assert isinstance(ff.net[0], GELU)
    fused = FusedGELU.from_module(ff.net[0])
    assert fused.proj is ff.net[0].proj and fused.approximate == approximate
    assert fused.state_dict().keys() == ff.net[0].state_dict().keys()
    x = torch.randn(2, 9, 40)
    with torch.no_grad():
        expect = ff.double()(x.double())
        ff.float()
        ff.net[0] = fused
        with ldmopt.use_backend("triton"):
            out = ff(x)
    assert_close(out, expect, torch.float32, f"FeedForward({activation_fn}) with FusedGELU")


def test_fused_linear_module_shares_parameters():
    ref = torch.nn.Linear(40, 24)
    fused = FusedLinear.from_module(ref, activation="gelu_tanh")
    assert fused.weight is ref.weight and fused.bias is ref.bias
    assert fused.state_dict().keys() == ref.state_dict().keys()
    assert "activation='gelu_tanh'" in repr(fused)
    x, gate, res = torch.randn(2, 5, 40), torch.randn(2, 24), torch.randn(2, 5, 24)
    with ldmopt.use_backend("triton"), torch.no_grad():
        out = fused(x, gate=gate, residual=res)
        expect = res + gate[:, None] * F.gelu(ref(x), approximate="tanh")
    assert_close(out, expect.double(), torch.float32, "FusedLinear")
    with pytest.raises(ValueError, match="activation='relu' is not supported"):
        FusedLinear(4, 4, activation="relu")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: linear(torch.randn(3, 8), torch.randn(5, 7)), r"weight has shape \(5, 7\), expected \(N, 8\)"),
        (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(4)), r"bias must have shape \(5,\)"),
        (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), activation="relu"), "activation='relu' is not supp"),
        (
            lambda: linear(torch.randn(2, 3, 8), torch.randn(5, 8), gate=torch.randn(3, 5)),
            r"gate must have shape \(2, 5\)",
        ),
        (lambda: linear(torch.randn(2, 3, 8), torch.randn(5, 8), gate=torch.randn(2, 3, 5)), r"or \(2, 1, 5\)"),
        (lambda: linear(torch.randn(8), torch.randn(5, 8), gate=torch.randn(1, 5)), "gate needs x with a sample axis"),
        (lambda: linear(torch.randn(2, 8), torch.randn(5, 8), residual=torch.randn(2, 4)), r"output's shape \(2, 5\)"),
        (lambda: linear(torch.randn(2, 8), torch.randn(5, 8), residual=torch.randn(2, 5, device="meta")), "on meta"),
        (lambda: linear(torch.randn(2, 8).half(), torch.randn(5, 8)), "weight has dtype torch.float32 but x has"),
        (lambda: linear(torch.randn(2, 8), torch.randn(5, 8), torch.randn(5).bool()), "bias has dtype torch.bool"),
        (lambda: linear(torch.tensor(1.0), torch.randn(5, 1)), r"linear: x must have at least 1 dim \(\[\.\.\., K\]\)"),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_fp32_residual_stream_promotes_output():
    # fp16 GEMM into an fp32 residual stream (AMP training): the output and d(residual) stay fp32, like the eager ops.
    x, w, b, gate, res = _inputs((3, 13, 40), 72, torch.float16, True)
    leaves = [x, w, b, gate.float(), res.float()]
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    with ldmopt.use_backend("triton"):
        y = linear(*leaves[:3], activation="gelu", gate=leaves[3], residual=leaves[4])
    assert y.dtype == torch.float32
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    _reference(*ref[:3], "gelu", *ref[3:]).backward(dy.double())
    lowp = [t.detach().clone().requires_grad_() for t in leaves]
    expect_lowp = _reference(*lowp[:3], "gelu", *lowp[3:])
    expect_lowp.backward(dy)
    assert_within_torch_error(y, _reference(*[t.detach() for t in ref[:3]], "gelu", *[t.detach() for t in ref[3:]]),
                              expect_lowp.detach(), "y")  # fmt: skip
    for name, got, r, lp in zip(("dx", "dweight", "dbias", "dgate", "dresidual"), leaves, ref, lowp):
        assert got.grad.dtype == got.dtype
        assert_within_torch_error(got.grad, r.grad, lp.grad, name)


def test_autocast_casts_operands_like_f_linear():
    x = torch.randn(2, 5, 24)
    w = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16), ldmopt.use_backend("triton"):
        y = linear(x, w, b, activation="silu")
        expect = F.silu(F.linear(x, w, b))
    assert y.dtype == expect.dtype == torch.float16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    ref = F.silu(F.linear(*(t.detach().half().double() for t in (x, w, b))))
    assert_within_torch_error(y, ref, expect, "autocast")


def test_one_dim_input_like_nn_linear():
    x, w, b = torch.randn(8), torch.randn(5, 8), torch.randn(5)
    with ldmopt.use_backend("triton"):
        y = linear(x, w, b, activation="silu")
    assert y.shape == (5,)
    assert_close(y, F.silu(F.linear(x.double(), w.double(), b.double())), torch.float32, "1-D x")


def test_opcheck():
    x, w, b, gate, res = _inputs((2, 5, 24), 16, torch.float32, True)
    x2, res2 = x.reshape(10, 24), res.reshape(10, 16)
    w.requires_grad_()
    gate.requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, (x2, w, b, gate, res2, "gelu", True, None))
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, (x2, w, b, gate, res2, "gelu", True, torch.float16))
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, (x2, w, None, None, None, "", False, None))
    strided = _channels_major_residual(2, 5, 16, torch.float32).requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, (x2, w, b, gate, strided, "", False, None))
    _, pre = torch.ops.ldmopt.linear_fwd(x2, w.detach(), b, gate.detach(), res2, "gelu", True, None)
    dy = torch.randn(10, 16)
    torch.library.opcheck(torch.ops.ldmopt.linear_bwd, (dy, pre, gate.detach(), "gelu", True))
    torch.library.opcheck(torch.ops.ldmopt.linear_bwd, (dy, None, gate.detach(), "", False))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    proj = FusedLinear(24, 16, activation="gelu_tanh")
    out_proj = FusedLinear(16, 16)

    def block(x, gate):
        return out_proj(proj(x), gate=gate, residual=x[..., :16])

    x = torch.randn(2, 5, 24, requires_grad=True)
    gate = torch.randn(2, 16, requires_grad=True)
    out = torch.compile(block, backend=backend, fullgraph=True)(x, gate)
    out.sum().backward()
    grads = [x.grad.clone(), gate.grad.clone(), proj.weight.grad.clone()]
    x.grad = gate.grad = proj.weight.grad = None
    expect = block(x, gate)
    expect.sum().backward()
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    for name, got, want in zip(("dx", "dgate", "dweight"), grads, (x.grad, gate.grad, proj.weight.grad)):
        assert_close(got, want.double(), torch.float32, f"compiled {name}")


def test_strided_bias_is_read_with_its_stride():
    x, w, b = torch.randn(5, 8), torch.randn(12, 8), torch.randn(24)[::2]
    with ldmopt.use_backend("triton"):
        y = linear(x, w, b)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", [(2, 9, 40), (23, 40)])
def test_out_dtype_rounds_the_fp32_epilogue_once(backend, shape):
    """Wan's feed-forward residual: fp16 stream, fp32 gate, ``(h.float() + ff.float() * gate).type_as(h)``. With
    out_dtype the output stays in the stream's dtype (the promoted dtype would be fp32), forward and backward."""
    n = 72
    x, w, b, _, _ = _inputs(shape, n, torch.float16, False)
    gate = torch.randn((shape[0], 1, n) if len(shape) == 3 else (shape[0], n), dtype=torch.float32)
    res = torch.randn((*shape[:-1], n), dtype=torch.float16)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, gate, res)]
    with ldmopt.use_backend(backend):
        y = linear(leaves[0], leaves[1], leaves[2], gate=leaves[3], residual=leaves[4], out_dtype=torch.float16)
    assert y.dtype == torch.float16 and y.shape == res.shape
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b, gate, res)]
    expect = ref_leaves[4] + F.linear(*ref_leaves[:3]) * ref_leaves[3]
    wan = (res.float() + F.linear(x, w, b).float() * gate).to(torch.float16)  # the stock ops, in fp16/fp32
    assert_within_torch_error(y, expect, wan, f"out_dtype fp16 {shape}")
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y.float() * dy.float()).sum(), leaves)
    want = torch.autograd.grad((expect * dy.double()).sum(), ref_leaves)
    for name, g, e, leaf in zip(("dx", "dw", "db", "dgate", "dres"), got, want, leaves):
        assert g.dtype == leaf.dtype, name
        torch.testing.assert_close(g.double(), e, atol=3e-2 * e.abs().max().item(), rtol=3e-2, msg=name)


def test_out_dtype_must_be_a_float_dtype():
    x, w, b, _, _ = _inputs((4, 8), 6, torch.float32, False)
    for bad in (torch.int32, torch.float8_e5m2):  # fp8 would need a scale the epilogue does not apply
        with pytest.raises(TypeError, match=f"out_dtype must be None or one of .*, got {bad}"):
            linear(x, w, b, out_dtype=bad)
