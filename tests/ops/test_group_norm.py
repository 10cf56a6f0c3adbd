"""ldmopt.ops.group_norm: Triton kernels (interpreter) and the reference backend against fp64 PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops import group_norm
from tests.tolerances import assert_close, assert_within_torch_error

CASES = [
    # (shape, groups): channels not a power of two, odd spatial sizes, 5-D video input, batch 1 and 3
    ((3, 96, 7, 7), 32),  # 3 channels per group, H=W=7
    ((1, 40, 9, 9), 8),  # 5 channels per group, H=W=9
    ((3, 40, 3, 5, 5), 8),  # (N, C, F, H, W) with F=3
    ((2, 24, 1, 13), 1),  # one group over all channels, degenerate height
]


def _make(shape, channels_last, dtype):
    x = (torch.randn(shape, dtype=torch.float64) * 1.7 + 0.6).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    c = shape[1]
    weight = (torch.randn(c, dtype=torch.float64) * 0.8 + 1.0).to(dtype)
    bias = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype)
    return x, weight, bias


def _reference(x, groups, weight, bias, activation, eps=1e-5):
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


@pytest.fixture(params=["onepass", "split"])
def forward_path(request, monkeypatch):
    """Run the forward through the single-launch path for small groups, or the split statistics path."""
    import ldmopt.kernels.group_norm as kernels

    monkeypatch.setattr(kernels, "_ONEPASS_MAX_GROUP", 1 << 30 if request.param == "onepass" else 0)
    return request.param


@pytest.mark.parametrize("shape,groups", CASES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_forward_triton(shape, groups, channels_last, dtype, activation, forward_path):
    x, w, b = _make(shape, channels_last, dtype)
    with ldmopt.use_backend("triton"):
        y = group_norm(x, groups, w, b, 1e-5, activation)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    ref = _reference(x.double(), groups, w.double(), b.double(), activation)
    lowp = _reference(x.float(), groups, w.float(), b.float(), activation).to(dtype)
    assert_within_torch_error(y, ref, lowp, f"y {shape} {dtype}")


@pytest.mark.parametrize("shape,groups", CASES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_statistics_fp32(shape, groups, channels_last, dtype, forward_path):
    x, w, b = _make(shape, channels_last, dtype)
    with ldmopt.use_backend("triton"):
        _, mean, rstd = torch.ops.ldmopt.group_norm_fwd(x, w, b, groups, 1e-5, "silu")
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (shape[0], groups)
    xg = x.double().reshape(shape[0], groups, -1)
    assert_close(mean, xg.mean(-1), torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), torch.float32, "rstd")


def test_large_mean_no_cancellation(forward_path):
    # Mean 1e3 times the spread: sum/sum-of-squares statistics would lose the variance in fp32.
    x = torch.randn(2, 16, 11, 11, dtype=torch.float64) * 0.01 + 30.0
    with ldmopt.use_backend("triton"):
        _, _, rstd = torch.ops.ldmopt.group_norm_fwd(x.float(), None, None, 4, 1e-6, "")
    expect = torch.rsqrt(x.reshape(2, 4, -1).var(-1, unbiased=False) + 1e-6)
    torch.testing.assert_close(rstd.double(), expect, rtol=1e-3, atol=0)


@pytest.mark.parametrize("shape,groups", CASES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_backward_triton_vs_autograd(shape, groups, channels_last, dtype, activation):
    x, w, b = _make(shape, channels_last, dtype)
    dy = torch.randn(shape, dtype=dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with ldmopt.use_backend("triton"):
        y = group_norm(leaves[0], groups, leaves[1], leaves[2], 1e-5, activation)
    y.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    _reference(*ref_leaves[:1], groups, *ref_leaves[1:], activation).backward(dy.double())
    lowp_leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    _reference(lowp_leaves[0], groups, *lowp_leaves[1:], activation).backward(dy.float())
    assert leaves[0].grad.stride() == x.stride()
    for name, got, ref, lowp in zip(("dx", "dweight", "dbias"), leaves, ref_leaves, lowp_leaves):
        assert got.grad.dtype == dtype
        assert_within_torch_error(got.grad, ref.grad, lowp.grad.to(dtype), f"{name} {shape} {dtype}")


@pytest.mark.parametrize("trained", ["x", "weight", "bias", "x+bias", "weight+bias"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_of_each_subset_of_leaves(trained, backend):
    # A frozen weight with a trained bias (and the reverse) gets exactly the gradients it asks for: each against
    # autograd of stock in fp64, None where no gradient was asked.
    x, w, b = _make((2, 12, 5, 3), True, torch.float32)
    dy = torch.randn(x.shape)
    names = ("x", "weight", "bias")
    leaves = [t.detach().clone().requires_grad_(n in trained.split("+")) for n, t in zip(names, (x, w, b))]
    with ldmopt.use_backend(backend):
        group_norm(leaves[0], 4, leaves[1], leaves[2], 1e-5, "silu").backward(dy)
    ref = [t.detach().double().requires_grad_(n in trained.split("+")) for n, t in zip(names, (x, w, b))]
    _reference(ref[0], 4, ref[1], ref[2], "silu").backward(dy.double())
    for name, got, want in zip(names, leaves, ref):
        if want.grad is None:
            assert got.grad is None, f"{name} got a gradient it did not ask for"
        else:
            assert got.grad is not None, f"{name} got no gradient ({trained} trained)"
            assert_close(got.grad, want.grad, torch.float32, f"d{name}, {trained} trained, {backend}")


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradcheck_reference_fp64(activation, channels_last):
    x, w, b = _make((2, 6, 3, 5), channels_last, torch.float64)
    inputs = [t.requires_grad_() for t in (x, w, b)]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda x, w, b: group_norm(x, 3, w, b, 1e-5, activation), inputs)


def test_reference_backend_matches_fp64():
    x, w, b = _make((3, 40, 3, 5, 5), True, torch.float32)
    with ldmopt.use_backend("torch"):
        y = group_norm(x, 8, w, b, 1e-5, "silu")
    assert_close(y, _reference(x.double(), 8, w.double(), b.double(), "silu"), torch.float32, "torch backend")


def test_no_affine_and_module(forward_path):
    gn_ref = torch.nn.GroupNorm(4, 12, affine=False)
    gn = ldmopt.nn.GroupNorm(4, 12, affine=False)
    x = torch.randn(2, 12, 5, 3)
    with ldmopt.use_backend("triton"):
        assert_close(gn(x), gn_ref(x.double()), torch.float32, "no affine")


def test_module_is_drop_in():
    ref = torch.nn.GroupNorm(8, 40)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    fused = ldmopt.nn.GroupNorm(8, 40, activation="silu")
    assert fused.state_dict().keys() == ref.state_dict().keys()
    fused.load_state_dict(ref.state_dict())
    shared = ldmopt.nn.GroupNorm.from_module(ref, activation="silu")
    assert shared.weight is ref.weight and shared.bias is ref.bias
    x = torch.randn(3, 40, 9, 9).to(memory_format=torch.channels_last)
    with ldmopt.use_backend("triton"):
        out = shared(x)
    assert_close(out, F.silu(ref.double()(x.double())), torch.float32, "module")
    assert "activation='silu'" in repr(shared)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: group_norm(torch.randn(6), 3), r"x must have shape \(N, C, \*\), got \(6,\)"),
        (lambda: group_norm(torch.randn(2, 10, 4, 4), 3), "C=10 channels, not divisible by num_groups=3"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 3, torch.randn(5)), r"weight must have shape \(6,\)"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 3, None, torch.randn(6, 1)), "bias must have 1 dims"),
        (lambda: group_norm(torch.randint(0, 3, (2, 6, 4, 4)), 3), "x has dtype torch.int64"),
        (lambda: group_norm(torch.randn(0, 6, 4, 4), 3), "x is empty"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 0), "num_groups must be a positive int, got 0"),
        (lambda: group_norm(torch.randn(2, 2, 4, 4), True), "num_groups must be a positive int, got True"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 3, eps=float("nan")), "eps must be a finite non-negative"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 3, eps=-1e-5), "eps must be a finite non-negative"),
        (lambda: group_norm(torch.randn(2, 6, 4, 4), 3, activation="gelu"), "activation='gelu' is not supported"),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("shape", [(3, 24), (2, 6, 1, 3, 2, 3)])  # groups of 8 and 36 elements: well conditioned
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_any_rank_torch_takes(shape, backend):
    """(N, C) and more than three trailing dims, as torch.nn.GroupNorm takes them, with gradients."""
    c = shape[1]
    x, w, b = torch.randn(shape, requires_grad=True), torch.randn(c, requires_grad=True), torch.randn(c)
    with ldmopt.use_backend(backend):
        out = group_norm(x, 3, w, b, activation="silu")
    ref = F.silu(F.group_norm(x.double(), 3, w.double(), b.double()))
    assert out.shape == x.shape
    assert_close(out, ref, torch.float32, f"{len(shape)}-D")
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    want = torch.autograd.grad(ref.square().sum(), (x, w))
    for g, e in zip(grads, want):
        assert_close(g, e, torch.float32, "grad")


def test_forced_backend_that_cannot_serve_raises_with_reasons():
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    with (
        pytest.raises(ldmopt.BackendUnavailableError, match=r"'triton' was forced.*float64"),
        ldmopt.use_backend("triton"),
    ):
        group_norm(x, 3)
    with pytest.raises(ldmopt.BackendUnavailableError, match="'cuda' was forced"), ldmopt.use_backend("cuda"):
        group_norm(x.float(), 3)


def test_env_var_forces_backend(monkeypatch):
    ldmopt.ops.backend_counts.clear()
    monkeypatch.setenv("LDMOPT_BACKEND", "torch")
    group_norm(torch.randn(2, 6, 4, 4), 3)
    assert ldmopt.ops.backend_counts[("group_norm", "torch")] == 1
    monkeypatch.setenv("LDMOPT_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LDMOPT_BACKEND='bogus'"):
        group_norm(torch.randn(2, 6, 4, 4), 3)


def test_automatic_choice_uses_triton_under_interpreter():
    ldmopt.ops.backend_counts.clear()
    group_norm(torch.randn(2, 6, 4, 4), 3)
    assert ldmopt.ops.backend_counts[("group_norm", "triton")] == 1


def test_size_one_dims_take_the_kernel():
    # A one-frame video, (B, F, C, H, W) permuted to (B, C, F, H, W): dense but for the stride of its size-1 frame
    # axis, which no index steps over: the Triton kernel serves it (forced here; a refusal would raise).
    x = torch.randn(2, 1, 12, 5, 3).permute(0, 2, 1, 3, 4)
    w, b = torch.randn(12) * 0.5 + 1, torch.randn(12)
    ldmopt.ops.backend_counts.clear()
    with ldmopt.use_backend("triton"):
        y = group_norm(x, 4, w, b, 1e-5, "silu")
    assert ldmopt.ops.backend_counts[("group_norm", "triton")] == 1
    assert_close(y, _reference(x.double(), 4, w.double(), b.double(), "silu"), torch.float32, "one frame")


def test_non_dense_input_is_made_contiguous():
    base = torch.randn(2, 12, 9, 10)
    x = base[:, :, :, ::2]  # strided view, spatial dims do not flatten
    with ldmopt.use_backend("triton"):
        y = group_norm(x, 4, activation="silu")
    assert_close(y, F.silu(F.group_norm(x.double(), 4)), torch.float32, "strided view")


def test_opcheck():
    x, w, b = _make((2, 12, 5, 3), True, torch.float32)
    args = (x, w.clone().requires_grad_(), b.clone().requires_grad_(), 4, 1e-5, "silu")
    torch.library.opcheck(torch.ops.ldmopt.group_norm_fwd, args)
    _, mean, rstd = torch.ops.ldmopt.group_norm_fwd(x, w, b, 4, 1e-5, "silu")
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.ldmopt.group_norm_bwd, (dy, x, w, b, mean, rstd, 4, "silu"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    module = torch.nn.Sequential(ldmopt.nn.GroupNorm(4, 12, activation="silu"), torch.nn.Conv2d(12, 8, 1))
    x = torch.randn(2, 12, 5, 7, requires_grad=True)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    module(x).sum().backward()
    assert_close(out, module(x).detach().double(), torch.float32, "compiled forward")
    assert_close(grad_compiled, x.grad.double(), torch.float32, "compiled backward")


def test_numpy_eps_is_accepted():
    import numpy as np

    x = torch.randn(2, 6, 4, 4)
    torch.testing.assert_close(group_norm(x, 3, eps=np.float32(1e-3)), F.group_norm(x, 3, eps=1e-3))
