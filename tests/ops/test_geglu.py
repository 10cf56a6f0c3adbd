"""ldmopt.ops.geglu: the dual-accumulator Triton GEMM (interpreter) and the torch backend against diffusers' GEGLU."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU
from diffusers.models.attention import FeedForward

import ldmopt
from ldmopt.nn.linear import FusedGEGLU
from ldmopt.ops.geglu import geglu
from tests.tolerances import assert_close, assert_within_torch_error

CASES = [
    # (x shape, I): K and I not multiples of the 32-wide interpreter tiles, M with a 5-row tail
    ((37, 40), 72),  # 2-D rows, K=40, I=72 (gate rows start at 72, inside a tile)
    ((2, 5, 40), 72),  # 3-D [B, T, K]
    ((3, 24), 8),  # I smaller than one tile
]


def _module(k, i, dtype, bias=True):
    mod = GEGLU(k, i, bias=bias)
    with torch.no_grad():
        mod.proj.weight.normal_(0, k**-0.5)
        if bias:
            mod.proj.bias.normal_(0, 0.5)
    return mod.to(dtype)


def _reference(x, weight, bias):
    h, g = F.linear(x, weight, bias).chunk(2, dim=-1)
    return h * F.gelu(g)


@pytest.mark.parametrize("shape,i", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_triton_matches_diffusers(shape, i, dtype, bias):
    mod = _module(shape[-1], i, dtype, bias)
    x = torch.randn(shape, dtype=dtype)
    with ldmopt.use_backend("triton"), torch.no_grad():
        y = geglu(x, mod.proj.weight, mod.proj.bias)
        ref = _module(shape[-1], i, torch.float64, bias).requires_grad_(False)
        ref.load_state_dict(mod.state_dict())
        expect = ref(x.double())
        lowp = mod(x)
    assert y.shape == (*shape[:-1], i) and y.dtype == dtype
    assert_within_torch_error(y, expect, lowp, f"geglu {shape} {dtype}")


@pytest.mark.parametrize("shape,i", CASES[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_triton_vs_autograd(shape, i, dtype):
    mod = _module(shape[-1], i, dtype)
    x = torch.randn(shape, dtype=dtype)
    dy = torch.randn((*shape[:-1], i), dtype=dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (x, mod.proj.weight, mod.proj.bias)]
    with ldmopt.use_backend("triton"):
        geglu(*leaves).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    _reference(*ref).backward(dy.double())
    # PyTorch's own error in this dtype: the unfused module's autograd in `dtype`.
    lowp = [t.detach().clone().requires_grad_() for t in leaves]
    _reference(*lowp).backward(dy)
    for name, got, r, lp in zip(("dx", "dweight", "dbias"), leaves, ref, lowp):
        assert got.grad.dtype == dtype and got.grad.shape == got.shape
        assert_within_torch_error(got.grad, r.grad, lp.grad, f"{name} {shape} {dtype}")


def test_non_contiguous_operands():
    # x as a transposed view and the weight as a column slice: the kernel reads both through their strides.
    x = torch.randn(40, 37).t()
    weight = torch.randn(144, 50)[:, 5:45] * 0.2
    bias = torch.randn(144)
    with ldmopt.use_backend("triton"):
        y = geglu(x, weight, bias)
    assert_close(y, _reference(x.double(), weight.double(), bias.double()), torch.float32, "strided")


def test_inference_writes_no_pre_activation():
    x, w, b = torch.randn(5, 8), torch.randn(12, 8), torch.randn(12)
    with ldmopt.use_backend("triton"):
        y, pre = torch.ops.ldmopt.geglu_fwd(x, w, b, False)
        y2, pre2 = torch.ops.ldmopt.geglu_fwd(x, w, b, True)
    assert pre.numel() == 0 and pre2.shape == (5, 12)
    assert torch.equal(y, y2)
    assert_close(pre2, F.linear(x.double(), w.double(), b.double()), torch.float32, "pre")


def test_recomputes_when_pre_was_not_saved():
    x, w, b = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((4, 6), (10, 6), (10,)))
    y, _ = torch.ops.ldmopt.geglu_fwd(x, w, b, False)
    y.sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    _reference(x, w, b).sum().backward()
    for got, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(got, t.grad)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_autocast_casts_operands_like_diffusers(backend):
    mod = _module(24, 8, torch.float32)
    x = torch.randn(3, 24)
    with torch.autocast("cpu", dtype=torch.float16), ldmopt.use_backend(backend):
        y = geglu(x, mod.proj.weight, mod.proj.bias)
        expect = mod(x)
    assert y.dtype == expect.dtype == torch.float16
    y.float().sum().backward()
    assert mod.proj.weight.grad.dtype == torch.float32
    ref = _reference(*(t.detach().half().double() for t in (x, mod.proj.weight, mod.proj.bias)))
    assert_within_torch_error(y, ref, expect, f"autocast {backend}")


def test_gradcheck_reference_fp64():
    inputs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((2, 3, 6), (10, 6), (10,))]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(geglu, inputs)
        assert torch.autograd.gradcheck(lambda x, w: geglu(x, w), inputs[:2])


def test_reference_backend_matches_fp64():
    mod = _module(40, 72, torch.float32)
    x = torch.randn(3, 7, 40)
    with ldmopt.use_backend("torch"), torch.no_grad():
        y = geglu(x, mod.proj.weight, mod.proj.bias)
        assert_close(y, mod.double()(x.double()), torch.float32, "torch backend")


def test_module_is_drop_in_for_feedforward():
    ff = FeedForward(40, mult=2, activation_fn="geglu").eval()
    fused = FusedGEGLU.from_module(ff.net[0])
    assert fused.proj is ff.net[0].proj
    assert fused.state_dict().keys() == ff.net[0].state_dict().keys() == {"proj.weight", "proj.bias"}
    fresh = FusedGEGLU(40, 80)
    fresh.load_state_dict(ff.net[0].state_dict())
    x = torch.randn(2, 9, 40)
    with torch.no_grad():
        expect = ff.double()(x.double())
        ff.float()
        ff.net[0] = fused
        with ldmopt.use_backend("triton"):
            out = ff(x)
            out_fresh = ff.net[2](fresh(x))
    assert_close(out, expect, torch.float32, "FeedForward with FusedGEGLU")
    assert_close(out_fresh, expect, torch.float32, "fresh FusedGEGLU")


def test_module_refuses_wrapped_projection():
    mod = GEGLU(8, 4)
    mod.proj = torch.nn.Sequential(mod.proj)
    assert "not a plain nn.Linear" in FusedGEGLU.unsupported_reason(mod)
    with pytest.raises(TypeError, match=r"not a plain nn\.Linear"):
        FusedGEGLU.from_module(mod)
    hooked = GEGLU(8, 4)
    hooked.proj.register_forward_pre_hook(lambda m, a: None)
    assert "hooks" in FusedGEGLU.unsupported_reason(hooked)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: geglu(torch.randn(3, 8), torch.randn(12, 7)), r"weight has shape \(12, 7\), expected \(N, 8\)"),
        (lambda: geglu(torch.randn(3, 8), torch.randn(11, 8)), "11 rows, expected a multiple of 2"),
        (lambda: geglu(torch.randn(3, 8), torch.randn(12, 8), torch.randn(6)), r"bias must have shape \(12,\)"),
        (lambda: geglu(torch.randn(3, 8), torch.randn(12, 8).half()), "weight has dtype torch.float16 but x has"),
        (lambda: geglu(torch.randint(0, 3, (3, 8)), torch.randn(12, 8)), "x has dtype torch.int64"),
        (lambda: geglu(torch.randn(0, 8), torch.randn(12, 8)), "x is empty"),
        (lambda: geglu(torch.randn(3, 8), torch.randn(12)), "weight must have 2 dims"),
        (lambda: geglu(torch.tensor(1.0), torch.randn(4, 1)), "geglu: x must have at least 1 dim"),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_forced_triton_refuses_fp64_with_reason():
    with (
        pytest.raises(ldmopt.BackendUnavailableError, match=r"'triton' was forced.*float64"),
        ldmopt.use_backend("triton"),
    ):
        geglu(torch.randn(3, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64))


def test_opcheck():
    x = torch.randn(5, 24)
    w = (torch.randn(40, 24) * 0.2).requires_grad_()
    b = torch.randn(40).requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.geglu_fwd, (x, w, b, True))
    torch.library.opcheck(torch.ops.ldmopt.geglu_fwd, (x, w, None, False))
    _, pre = torch.ops.ldmopt.geglu_fwd(x, w.detach(), b.detach(), True)
    torch.library.opcheck(torch.ops.ldmopt.geglu_bwd, (torch.randn(5, 20), pre))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    module = torch.nn.Sequential(FusedGEGLU(24, 20), torch.nn.Linear(20, 8))
    x = torch.randn(2, 5, 24, requires_grad=True)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    grads = [x.grad.clone(), module[0].proj.weight.grad.clone()]
    x.grad = None
    module.zero_grad()
    expect = module(x)
    expect.sum().backward()
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    assert_close(grads[0], x.grad.double(), torch.float32, "compiled dx")
    assert_close(grads[1], module[0].proj.weight.grad.double(), torch.float32, "compiled dweight")
