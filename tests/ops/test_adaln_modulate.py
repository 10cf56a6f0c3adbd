"""ldmopt.ops.adaln_modulate: residual add + LayerNorm (no affine) + per-sample modulation, against PyTorch and the
diffusers adaLN norms."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle

import ldmopt
from ldmopt.nn.linear import FusedAdaLayerNormContinuous, FusedAdaLayerNormZero, FusedAdaLayerNormZeroSingle
from ldmopt.ops.adaln_modulate import adaln_modulate
from tests.tolerances import assert_close, assert_within_torch_error


def _reference(x, scale, shift, residual=None, eps=1e-6):
    s = x + residual if residual is not None else x
    if x.dim() == 3 and scale.dim() == 2:
        scale, shift = scale[:, None], shift[:, None]
    return F.layer_norm(s, s.shape[-1:], eps=eps) * (1 + scale) + shift, s


CASES = [
    # (x shape, scale shape): C=72 and C=40 are not powers of two
    ((3, 13, 72), (3, 72)),  # [B, T, C] with per-sample [B, C] (AdaLayerNormZero chunks)
    ((3, 13, 72), (3, 1, 72)),  # PixArt's [B, 1, C]
    ((37, 40), (37, 40)),  # 2-D rows, one vector per row
]


def _make(x_shape, s_shape, dtype):
    x = (torch.randn(x_shape, dtype=torch.float64) * 1.5 + 0.7).to(dtype)
    scale = (torch.randn(s_shape, dtype=torch.float64) * 0.5).to(dtype)
    shift = torch.randn(s_shape, dtype=dtype)
    residual = torch.randn(x_shape, dtype=dtype)
    return x, scale, shift, residual


@pytest.mark.parametrize("x_shape,s_shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_forward_triton(x_shape, s_shape, dtype, with_residual):
    x, scale, shift, residual = _make(x_shape, s_shape, dtype)
    residual = residual if with_residual else None
    with ldmopt.use_backend("triton"):
        if with_residual:
            y, s = adaln_modulate(x, scale, shift, residual=residual, return_residual=True)
        else:
            y = adaln_modulate(x, scale, shift)
    assert y.shape == x.shape and y.dtype == dtype
    s_lowp = x + residual if with_residual else x
    ref, _ = _reference(s_lowp.double(), scale.double(), shift.double())
    lowp, _ = _reference(s_lowp.float(), scale.float(), shift.float())
    assert_within_torch_error(y, ref, lowp.to(dtype), f"y {x_shape} {dtype}")
    if with_residual:
        assert torch.equal(s, s_lowp), "the returned sum is x + residual rounded as PyTorch rounds it"


def test_eps_and_large_mean():
    # Mean 100x the spread: a sum/sum-of-squares variance would cancel in fp32.
    x = (torch.randn(2, 5, 48, dtype=torch.float64) * 0.05 + 5.0).float()
    scale, shift = torch.randn(2, 48), torch.randn(2, 48)
    with ldmopt.use_backend("triton"):
        y = adaln_modulate(x, scale, shift, eps=1e-3)
    ref, _ = _reference(x.double(), scale.double(), shift.double(), eps=1e-3)
    # x - mean keeps only ~17 bits of each input here, so even an exact fp32 LayerNorm is ~1e-4 off relative:
    # bound the error by PyTorch's own fp32 error, which a cancelling sum-of-squares variance would far exceed.
    lowp, _ = _reference(x, scale, shift, eps=1e-3)
    assert_within_torch_error(y, ref, lowp, "eps=1e-3, mean 5")


@pytest.mark.parametrize("x_shape,s_shape", CASES[::2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("use_sum", [False, True])
def test_backward_triton_vs_autograd(x_shape, s_shape, dtype, use_sum):
    # use_sum: the returned residual sum also feeds the loss (a DiT block adds it back), so its gradient joins dx.
    inputs = _make(x_shape, s_shape, dtype)
    dy, ds = torch.randn(x_shape, dtype=dtype), torch.randn(x_shape, dtype=dtype)

    def run(x, scale, shift, residual, fused):
        if fused:
            y, s = adaln_modulate(x, scale, shift, residual=residual, return_residual=True)
        else:
            y, s = _reference(x, scale, shift, residual)
        loss = (y * dy.to(y.dtype)).sum()
        return loss + (s * ds.to(s.dtype)).sum() if use_sum else loss

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with ldmopt.use_backend("triton"):
        run(*leaves, fused=True).backward()
    ref = [t.detach().double().requires_grad_() for t in inputs]
    run(*ref, fused=False).backward()
    # PyTorch's own computation in the test dtype (its fp16 path rounds the residual sum to fp16, as the kernel does).
    lowp = [t.detach().clone().requires_grad_() for t in inputs]
    run(*lowp, fused=False).backward()
    for name, got, r, lp in zip(("dx", "dscale", "dshift", "dresidual"), leaves, ref, lowp):
        assert got.grad.dtype == dtype and got.grad.shape == got.shape
        assert_within_torch_error(got.grad, r.grad, lp.grad.to(dtype), f"{name} {x_shape} {dtype}")


def test_backward_without_residual_and_strided_scale():
    # scale/shift as chunks of one [B, 6C] embedding (row stride 6C), as AdaLayerNormZero passes them.
    x = torch.randn(2, 7, 40, requires_grad=True)
    emb = torch.randn(2, 240, requires_grad=True)
    shift, scale = emb.chunk(6, dim=1)[:2]
    with ldmopt.use_backend("triton"):
        y = adaln_modulate(x, scale, shift)
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = [x.grad.clone(), emb.grad.clone()]
    x64, emb64 = x.detach().double().requires_grad_(), emb.detach().double().requires_grad_()
    shift64, scale64 = emb64.chunk(6, dim=1)[:2]
    _reference(x64, scale64, shift64)[0].backward(dy.double())
    assert_close(grads[0], x64.grad, torch.float32, "dx")
    assert_close(grads[1], emb64.grad, torch.float32, "demb")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gradients_of_leaf_input_and_residual_accumulate_separately(backend):
    # x and the residual get the same gradient; as two leaves' .grad they must not share a storage, or a second
    # backward adds into it twice (x.grad and residual.grad came out 3x one pass's after two passes).
    torch.manual_seed(0)
    x0, r0 = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    scale, shift = 0.1 * torch.randn(2, 16), 0.1 * torch.randn(2, 16)
    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    with ldmopt.use_backend(backend):
        for _ in range(2):
            adaln_modulate(x, scale, shift, residual=r, eps=1e-6).pow(2).sum().backward()
    xs, rs = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    stock = F.layer_norm(xs + rs, (16,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    stock.pow(2).sum().backward()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    assert_close(x.grad, 2 * xs.grad, torch.float32)
    assert_close(r.grad, 2 * rs.grad, torch.float32)


@pytest.mark.parametrize("with_residual", [False, True])
def test_gradcheck_reference_fp64(with_residual):
    x, scale, shift, residual = (t.requires_grad_() for t in _make((2, 3, 6), (2, 6), torch.float64))

    def fn(x, scale, shift, residual):
        if with_residual:
            y, s = adaln_modulate(x, scale, shift, residual=residual, eps=1e-5, return_residual=True)
            return y, s
        return adaln_modulate(x, scale, shift, eps=1e-5)

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, (x, scale, shift, residual))


def test_reference_backend_matches_fp64():
    x, scale, shift, residual = _make((3, 13, 72), (3, 72), torch.float32)
    with ldmopt.use_backend("torch"):
        y = adaln_modulate(x, scale, shift, residual=residual)
    ref, _ = _reference((x + residual).double(), scale.double(), shift.double())
    assert_close(y, ref, torch.float32, "torch backend")


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def test_ada_layer_norm_zero_drop_in():
    ref = _randomize(AdaLayerNormZero(72))
    fused = FusedAdaLayerNormZero.from_module(ref)
    assert fused.linear is ref.linear and fused.state_dict().keys() == ref.state_dict().keys()
    x, emb = torch.randn(2, 11, 72), torch.randn(2, 72)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        got = fused(x, emb=emb)
        want = ref.double()(x.double(), emb=emb.double())
    for name, g, w in zip(("x", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp"), got, want):
        assert_close(g, w, torch.float32, f"AdaLayerNormZero {name}")


def test_ada_layer_norm_zero_single_and_continuous_drop_in():
    x = torch.randn(2, 11, 72)
    single = _randomize(AdaLayerNormZeroSingle(72))
    cont = _randomize(AdaLayerNormContinuous(72, 32, elementwise_affine=False, eps=1e-6))
    emb, cond = torch.randn(2, 72), torch.randn(2, 32)
    fused_single = FusedAdaLayerNormZeroSingle.from_module(single)
    fused_cont = FusedAdaLayerNormContinuous.from_module(cont)
    assert fused_cont.eps == 1e-6 and fused_cont.state_dict().keys() == cont.state_dict().keys()
    with torch.no_grad(), ldmopt.use_backend("triton"):
        got_single, got_cont = fused_single(x, emb=emb), fused_cont(x, cond)
        want_single, want_cont = single.double()(x.double(), emb=emb.double()), cont.double()(x.double(), cond.double())
    assert_close(got_single[0], want_single[0], torch.float32, "AdaLayerNormZeroSingle x")
    assert_close(got_single[1], want_single[1], torch.float32, "AdaLayerNormZeroSingle gate")
    assert_close(got_cont, want_cont, torch.float32, "AdaLayerNormContinuous")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("stock_cls", [AdaLayerNormZero, AdaLayerNormZeroSingle])
def test_half_stream_with_fp32_modulation_returns_the_promoted_dtype(stock_cls, backend):
    """An fp16 stream with an fp32 emb/linear (outside autocast): diffusers' norm(x) * (1 + scale) + shift is fp32.
    (AdaLayerNormContinuous casts its conditioning to x's dtype, so there the stock module refuses the mix.)"""
    x, emb = torch.randn(2, 7, 24).half(), torch.randn(2, 24)
    stock = _randomize(stock_cls(24))
    fused_cls = FusedAdaLayerNormZero if stock_cls is AdaLayerNormZero else FusedAdaLayerNormZeroSingle
    fused = fused_cls.from_module(stock)
    with torch.no_grad(), ldmopt.use_backend(backend):
        got, want = fused(x, emb=emb)[0], stock(x, emb=emb)[0]
    assert got.dtype == want.dtype == torch.float32, got.dtype
    assert_close(got, want, torch.float16, fused_cls.__name__)


def test_unsupported_norms_are_refused_with_reason():
    affine = AdaLayerNormContinuous(16, 8, elementwise_affine=True)
    assert "affine parameters" in FusedAdaLayerNormContinuous.unsupported_reason(affine)
    rms = AdaLayerNormContinuous(16, 8, elementwise_affine=False, norm_type="rms_norm")
    assert "not torch's LayerNorm" in FusedAdaLayerNormContinuous.unsupported_reason(rms)
    with pytest.raises(TypeError, match="affine parameters"):
        FusedAdaLayerNormContinuous.from_module(affine)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: adaln_modulate(torch.randn(8), torch.randn(1, 8), torch.randn(1, 8)), "x must have at least 2 dims"),
        (lambda: adaln_modulate(torch.randn(2, 3, 8), torch.randn(3, 8), torch.randn(2, 8)), r"scale must have shape"),
        (lambda: adaln_modulate(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 7)), r"shift must have shape"),
        (lambda: adaln_modulate(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 8)), r"or \(2, 1, 8\)"),
        (
            lambda: adaln_modulate(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), residual=torch.randn(2, 9)),
            r"residual must have x's shape \(2, 8\)",
        ),
        (
            lambda: adaln_modulate(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), return_residual=True),
            "return_residual=True needs a residual",
        ),
        (lambda: adaln_modulate(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), eps=-1.0), "eps must be"),
        (
            lambda: adaln_modulate(torch.randn(2, 8).int(), torch.randn(2, 8), torch.randn(2, 8)),
            "x has dtype torch.int32",
        ),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_residual_of_another_dtype_is_promoted_like_an_add():
    """Under autocast a gated attention output is fp32 while the residual stream is bf16/fp16: s = x + residual is
    computed in the promoted dtype, as the unfused add does."""
    x, scale, shift, residual = _make((2, 5, 24), (2, 24), torch.float32)
    residual = residual.half()
    y, s = adaln_modulate(x, scale, shift, residual=residual, return_residual=True)
    assert y.dtype == s.dtype == torch.float32
    expected_s = x + residual
    torch.testing.assert_close(s, expected_s)
    normed = F.layer_norm(expected_s.double(), (24,), eps=1e-6)
    expected = normed * (1 + scale.double()[:, None]) + shift.double()[:, None]
    assert_close(y, expected, torch.float32, "promoted adaln_modulate")


def test_opcheck():
    x, scale, shift, residual = _make((2, 5, 24), (2, 24), torch.float32)
    x2, r2 = x.reshape(10, 24), residual.reshape(10, 24)
    scale.requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_fwd, (x2, scale, shift, r2, None, 1e-6, True, True))
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_fwd, (x2, scale, shift, None, None, 1e-6, False, False))
    _, s, mean, rstd = torch.ops.ldmopt.adaln_modulate_fwd(x2, scale.detach(), shift, r2, None, 1e-6, True, True)
    dy = torch.randn(10, 24)
    args = (dy, s, mean, rstd, scale.detach())
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_bwd, (*args, torch.randn(10, 24), None, None))
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_bwd, (*args, None, None, None))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    norm = _randomize(AdaLayerNormZero(24))
    fused = FusedAdaLayerNormZero.from_module(norm)

    def block(x, residual, emb):
        h, gate, *_ = fused(x, emb=emb)
        y, s = adaln_modulate(h, gate, gate, residual=residual, return_residual=True)
        return y * s

    x, res, emb = (torch.randn(s, requires_grad=True) for s in ((2, 5, 24), (2, 5, 24), (2, 24)))
    out = torch.compile(block, backend=backend, fullgraph=True)(x, res, emb)
    out.sum().backward()
    grads = [t.grad.clone() for t in (x, res, emb)]
    for t in (x, res, emb):
        t.grad = None
    expect = block(x, res, emb)
    expect.sum().backward()
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    for name, got, t in zip(("dx", "dresidual", "demb"), grads, (x, res, emb)):
        assert_close(got, t.grad.double(), torch.float32, f"compiled {name}")
