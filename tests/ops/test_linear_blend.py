"""ldmopt.ops.linear with a blended input ``(x_a, x_b)`` and ``mix``: the GEMM reads ``mix * x_a + (1 - mix) * x_b``
per sample (diffusers' AlphaBlender before SVD's container proj_out) without the blend being written. Interpreter and
reference backend, against fp64 of the unfused composition (rule: tests/tolerances.py)."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.linear import linear
from tests.tolerances import assert_close, assert_within_torch_error

# K = 40 is not a multiple of the interpreter's 32-wide K tile (a masked tail); 5 samples of 13 tokens.
B, T, K, N = 5, 13, 40, 24


def _inputs(dtype):
    xa = torch.randn(B, T, K, dtype=dtype)
    xb = torch.randn(B, T, K, dtype=dtype)
    mix = torch.rand(B, 1, 1)
    mix[0] = 1.0  # image-only frames: the spatial input alone
    mix[1] = 0.0
    weight = (torch.randn(N, K, dtype=torch.float64) * K**-0.5).to(dtype)
    bias = (0.5 * torch.randn(N, dtype=torch.float64)).to(dtype)
    residual = torch.randn(B, T, N, dtype=dtype)
    return xa, xb, mix, weight, bias, residual


def _composition(xa, xb, mix, weight, bias, residual):
    """diffusers' AlphaBlender (mix cast to the stream's dtype) then proj_out and the container's residual add."""
    m = mix.to(xa.dtype)
    return F.linear(m * xa + (1.0 - m) * xb, weight, bias) + residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_triton(dtype):
    inputs = _inputs(dtype)
    xa, xb, mix, weight, bias, residual = inputs
    with ldmopt.use_backend("triton"):
        y = linear((xa, xb), weight, bias, residual=residual, mix=mix)
    assert y.shape == (B, T, N) and y.dtype == dtype
    exact = _composition(*(t.double() for t in inputs))
    lowp = _composition(*(t.float() for t in inputs)).to(dtype)
    assert_within_torch_error(y, exact, lowp, f"blend {dtype}")
    plain = F.linear(xa.double(), weight.double(), bias.double()) + residual.double()
    assert_close(y[0], plain[0], dtype, "mix 1 reads x_a alone")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_matches_autograd_of_the_composition(dtype):
    inputs = _inputs(dtype)
    inputs = (*inputs[:2], torch.rand(B, 1, 1), *inputs[3:])
    dy = torch.randn(B, T, N, dtype=dtype)
    grads = {}
    for name, cast in (("ours", None), ("ref", torch.float64), ("lowp", None)):
        # lowp: diffusers' ops in the input dtype (its fp32 blend weight cast to that dtype, as AlphaBlender does)
        leaves = [(t.detach().to(cast) if cast else t.detach().clone()).requires_grad_() for t in inputs]
        if name == "ours":
            with ldmopt.use_backend("triton"):
                out = linear((leaves[0], leaves[1]), leaves[3], leaves[4], residual=leaves[5], mix=leaves[2])
        else:
            out = _composition(*leaves)
        out.backward(dy.to(out.dtype))
        grads[name] = [t.grad for t in leaves]
    names = ("dx_a", "dx_b", "dmix", "dweight", "dbias", "dresidual")
    for name, leaf, ours, ref, lowp in zip(names, inputs, grads["ours"], grads["ref"], grads["lowp"]):
        assert ours.dtype == leaf.dtype and ours.shape == leaf.shape, name
        # dmix, an fp32 gradient, sums products of the GEMM's gradient rounded to x's dtype (PyTorch's rounds its sum
        # to x's dtype too): one rounding step of x's dtype at its magnitude (fp16 failed at 1.3x the fp32 bound)
        ulp_dtype = dtype if name == "dmix" else None
        assert_within_torch_error(ours, ref, lowp.to(leaf.dtype), f"{name} {dtype}", ulp_dtype=ulp_dtype)


def test_gradcheck_reference_fp64():
    xa, xb = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    mix = torch.rand(3, dtype=torch.float64)
    weight, bias = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (xa, xb, mix, weight, bias)]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda a, b, m, w, c: linear((a, b), w, c, mix=m), leaves, fast_mode=True)


def test_opcheck():
    x, xt = torch.randn(12, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    mix = torch.rand(3, requires_grad=True)
    weight, bias = torch.randn(5, 8, requires_grad=True), torch.randn(5)
    args = (x, weight, bias, None, torch.randn(12, 5), "", False, None, xt, mix)
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, args)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    xa, xb, mix, weight, bias, residual = _inputs(torch.float32)
    xa.requires_grad_()

    def fn(a):
        return linear((a, xb), weight, bias, residual=residual, mix=mix)

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(xa)
    assert_close(out, fn(xa).detach().double(), torch.float32, "compiled")
    out.sum().backward()
    assert xa.grad is not None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=lambda a, b: a), "mix blends two inputs of one shape"),
        (dict(x=lambda a, b: (a, b[..., :8])), "mix blends two inputs of one shape"),
        (dict(mix=torch.rand(B + 1)), r"mix must hold one value per sample x.shape\[0\] \(5,\)"),
    ],
)
def test_bad_mix_arguments(kwargs, match):
    xa, xb, mix, weight, bias, _ = _inputs(torch.float32)
    x = kwargs.get("x", lambda a, b: (a, b))(xa, xb)
    with pytest.raises(ValueError, match=match):
        linear(x, weight, bias, mix=kwargs.get("mix", mix))


def test_raw_op_refuses_a_mix_that_does_not_group_the_rows():
    x, xt, w = torch.randn(10, 8), torch.randn(10, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"mix of shape \(3,\) needs x_tail shaped like x"):
        torch.ops.ldmopt.linear_fwd(x, w, None, None, None, "", False, None, xt, torch.rand(3))
