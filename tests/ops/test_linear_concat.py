"""ldmopt.ops.linear with a two-part input ``(x_head, x_tail)``: the GEMM reads the concatenation along channels
(Flux's single-stream ``proj_out(cat([attn, mlp], -1))``) without it being written. Interpreter and reference
backend, against fp64 on the materialised concatenation."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.linear import linear
from tests.tolerances import assert_close, assert_within_torch_error

# K1 = 24 and K2 = 40: neither a multiple of the interpreter's 32-wide K tile, so both K loops run a masked tail.
K1, K2, N = 24, 40, 72


def _inputs(shape, dtype, gated=True):
    head = torch.randn((*shape, K1), dtype=dtype)
    tail = torch.randn((*shape, K2), dtype=dtype)
    weight = (torch.randn(N, K1 + K2, dtype=torch.float64) * (K1 + K2) ** -0.5).to(dtype)
    bias = (0.5 * torch.randn(N, dtype=torch.float64)).to(dtype)
    gate = torch.randn((shape[0], 1, N) if len(shape) == 2 else (shape[0], N), dtype=dtype) if gated else None
    residual = torch.randn((*shape, N), dtype=dtype) if gated else None
    return head, tail, weight, bias, gate, residual


def _reference(head, tail, weight, bias, gate, residual, activation=None):
    out = F.linear(torch.cat([head, tail], -1), weight, bias)
    if activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    if gate is not None:
        out = out * gate
    return out if residual is None else out + residual


def _fused(head, tail, weight, bias, gate, residual, activation=None):
    return linear((head, tail), weight, bias, activation=activation, gate=gate, residual=residual)


@pytest.mark.parametrize("shape", [(3, 13), (37,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,gated", [(None, True), ("gelu_tanh", False), ("gelu_tanh", True)])
def test_forward_triton(shape, dtype, activation, gated):
    inputs = _inputs(shape, dtype, gated)
    with ldmopt.use_backend("triton"):
        y = _fused(*inputs, activation)
    assert y.shape == (*shape, N) and y.dtype == dtype
    exact = _reference(*(t.double() if t is not None else None for t in inputs), activation)
    assert_within_torch_error(y, exact, _reference(*inputs, activation), f"{shape} {dtype} {activation} {gated}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_triton_vs_autograd(dtype):
    inputs = _inputs((3, 13), dtype)
    dy = torch.randn(3, 13, N, dtype=dtype)
    names = ("dhead", "dtail", "dweight", "dbias", "dgate", "dresidual")
    leaves = [t.clone().requires_grad_() for t in inputs]
    with ldmopt.use_backend("triton"):
        _fused(*leaves, "gelu_tanh").backward(dy)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _reference(*exact, "gelu_tanh").backward(dy.double())
    stock = [t.detach().clone().requires_grad_() for t in inputs]
    _reference(*stock, "gelu_tanh").backward(dy)
    for name, got, e, s in zip(names, leaves, exact, stock):
        assert got.grad.shape == got.shape and got.grad.dtype == dtype
        assert_within_torch_error(got.grad, e.grad, s.grad, f"{name} {dtype}")


def test_gradcheck_reference_fp64():
    inputs = [t.requires_grad_() for t in _inputs((2, 3), torch.float64)]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda *t: _fused(*t, "gelu_tanh"), inputs)


def test_reference_backend_and_strided_parts():
    # Parts that are views with a row stride (slices of wider tensors) are read in place by the kernel.
    head, tail, w, b, gate, res = _inputs((3, 13), torch.float32)
    wide = torch.randn(3, 13, K2 + 8)
    tail = wide[..., 8:]
    exact = _reference(head.double(), tail.double(), w.double(), b.double(), gate.double(), res.double())
    for backend in ("triton", "torch"):
        with ldmopt.use_backend(backend):
            assert_close(_fused(head, tail, w, b, gate, res), exact, torch.float32, backend)


@pytest.mark.parametrize("tail_k", [K2, 80])
def test_parts_with_different_column_strides(tail_k):
    # A column-strided tail (the transpose of a [K, M] tensor) beside a dense head: each part's K loop steps with its
    # own column stride; 80 columns need more than one 32-wide K tile, so the tail's loop steps at least once.
    head = torch.randn(13, K1)
    tail = torch.randn(tail_k, 13).t()
    w = torch.randn(N, K1 + tail_k) * (K1 + tail_k) ** -0.5
    b = torch.randn(N)
    exact = F.linear(torch.cat([head, tail], -1).double(), w.double(), b.double())
    for backend in ("triton", "torch"):
        with ldmopt.use_backend(backend):
            assert_close(linear((head, tail), w, b), exact, torch.float32, f"{backend} tail of {tail_k} columns")


def test_opcheck():
    head, tail, w, b, gate, res = _inputs((10,), torch.float32)
    w.requires_grad_()
    tail.requires_grad_()
    op = torch.ops.ldmopt.linear_fwd
    torch.library.opcheck(op, (head, w, b, gate, res, "gelu_tanh", True, None, tail))
    torch.library.opcheck(op, (head, w, None, None, None, "", False, torch.float16, tail))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    inputs = [t.requires_grad_() for t in _inputs((2, 5), torch.float32)]
    compiled = torch.compile(lambda *t: _fused(*t, "gelu_tanh"), backend="aot_eager", fullgraph=True)
    out = compiled(*inputs)
    got = torch.autograd.grad(out.sum(), inputs)
    expect = _reference(*inputs, "gelu_tanh")
    want = torch.autograd.grad(expect.sum(), inputs)
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    for name, g, e in zip(("dhead", "dtail", "dw", "db", "dgate", "dres"), got, want):
        assert_close(g, e.double(), torch.float32, f"compiled {name}")


@pytest.mark.parametrize(
    "parts,weight,match",
    [
        ((torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4)), torch.randn(5, 16), "a pair of tensors"),
        ((torch.randn(2, 8), torch.randn(3, 4)), torch.randn(5, 12), r"x\[1\] has shape \(3, 4\)"),
        ((torch.randn(2, 8), torch.randn(2, 4)), torch.randn(5, 8), r"weight has shape \(5, 8\), expected \(N, 12\)"),
        ((torch.randn(2, 8), torch.randn(2, 4, device="meta")), torch.randn(5, 12), r"x\[1\] is on meta"),
    ],
)
def test_bad_parts_raise(parts, weight, match):
    with pytest.raises((ValueError, TypeError), match=match):
        linear(parts, weight)


def test_parts_of_different_dtypes_promote_as_cat_does():
    # torch.cat promotes (fp32, fp16) to fp32; under autocast both parts take the autocast dtype, as F.linear's input.
    head, tail, w, b = torch.randn(5, K1), torch.randn(5, K2).half(), torch.randn(N, K1 + K2), torch.randn(N)
    with ldmopt.use_backend("triton"):
        y = linear((head, tail), w, b)
        with torch.autocast("cpu", dtype=torch.float16):
            y_amp = linear((head, tail), w, b)
            stock_amp = F.linear(torch.cat([head, tail], -1), w, b)
    assert y.dtype == torch.float32 and y_amp.dtype == stock_amp.dtype == torch.float16
    exact = F.linear(torch.cat([head.double(), tail.double()], -1), w.double(), b.double())
    assert_close(y, exact, torch.float32, "promoted parts")
    assert_within_torch_error(y_amp, exact, stock_amp, "parts under autocast")


# ------------------------------------------------------------------------------------------------ clip_fp16


def _overflowing(dtype):
    """Flux-like fp16 stream values near the top of fp16's range: residual + gate * out passes 65504 on some rows
    (past 65520 it would round to inf), stays below on others; one row NaN."""
    head, tail, weight, bias, gate, residual = _inputs((2, 5), dtype)
    residual = residual.double() * 1000
    residual[0, :2] = 6.5e4
    residual[1, 3] = -6.5e4
    residual[1, 4, 7] = float("nan")
    gate = (gate.double().abs() * 1e3 + 1e3).to(dtype)
    return head, tail, weight, bias, gate, residual.to(dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_clip_fp16_saturates_in_the_epilogue(backend):
    args = _overflowing(torch.float16)
    with ldmopt.use_backend(backend), torch.no_grad():
        clipped = linear((args[0], args[1]), *args[2:4], gate=args[4], residual=args[5], clip_fp16=True)
        unclipped = _fused(*args)
    ref = _reference(*(t.double() for t in args)).clamp(-65504, 65504)
    assert torch.isinf(unclipped).any(), "the case must overflow fp16"
    finite = ~torch.isnan(ref)
    assert torch.equal(torch.isnan(clipped), ~finite) and clipped.abs()[finite].max() <= 65504
    assert (clipped.abs() == 65504).any()
    # Where the stock fp16 ops do not overflow on the way, within their error of the clipped fp64 result.
    lowp = _reference(*args).clip(-65504, 65504)
    keep = finite & (lowp.abs() < 65504)
    assert_within_torch_error(clipped[keep], ref[keep], lowp[keep], "clip_fp16 unclipped rows")
    assert torch.equal(clipped[finite & (ref.abs() >= 65520)], ref[finite & (ref.abs() >= 65520)].half())


def test_clip_fp16_leaves_other_dtypes_and_keeps_gradients():
    args = [t.float() for t in _overflowing(torch.float16)]
    args[5][1, 4, 7] = 0.0
    with ldmopt.use_backend("triton"), torch.no_grad():
        y = linear((args[0], args[1]), *args[2:4], gate=args[4], residual=args[5], clip_fp16=True)
    assert y.abs().max() > 65504  # fp32: nothing clipped
    half = [t.half().requires_grad_() for t in args]
    with ldmopt.use_backend("triton"):
        y = linear((half[0], half[1]), *half[2:4], gate=half[4], residual=half[5], clip_fp16=True)
        with torch.no_grad():  # the fp16 result before the clamp: torch.clip's gradient passes strictly inside
            passes = _fused(*half).abs() < 65504
    assert not passes.all() and passes.any()
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y.float() * dy.float()).sum(), half)
    ref_leaves = [t.detach().double().requires_grad_() for t in half]
    expect = torch.autograd.grad((_reference(*ref_leaves) * (dy.double() * passes)).sum(), ref_leaves)
    assert torch.equal(got[5], dy * passes)  # the residual's gradient: dy where not clamped, else 0
    for name, g, e in zip(("x_head", "x_tail", "weight", "bias", "gate"), got, expect):
        # The gates are ~1e3: fp16 gradients of that scale, compared relative to their largest element.
        err, scale = (g.double() - e).abs().max().item(), e.abs().max().item()
        assert torch.isfinite(g).all() and err <= 4e-3 * scale, f"clip_fp16 grad {name}: {err:.3g} vs {scale:.3g}"


def test_saturate_op_has_no_backward_and_passes_opcheck():
    x, tail = torch.randn(6, K1, dtype=torch.float16), torch.randn(6, K2, dtype=torch.float16)
    weight = torch.randn(N, K1 + K2, dtype=torch.float16)
    args = (x, weight, None, None, None, "", False, None, tail, None, True)
    torch.library.opcheck(torch.ops.ldmopt.linear_fwd, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="saturate=True has no backward"):
        torch.ops.ldmopt.linear_fwd(x.requires_grad_(), *args[1:])


def test_clip_fp16_compiles_fullgraph():
    torch._dynamo.reset()
    args = _overflowing(torch.float16)

    def fn(head, tail, weight, bias, gate, residual):
        return linear((head, tail), weight, bias, gate=gate, residual=residual, clip_fp16=True)

    with torch.no_grad(), ldmopt.use_backend("triton"):
        eager = fn(*args)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    assert torch.equal(torch.isnan(compiled), torch.isnan(eager))
    finite = ~torch.isnan(eager)
    assert torch.equal(compiled[finite], eager[finite]) and compiled[finite].abs().max() <= 65504
