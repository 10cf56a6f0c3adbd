"""Direct calls of the custom ops (torch.ops.ldmopt.*) with inputs the public functions never pass: the same result
on every backend, or a clear refusal."""

import pytest
import torch

import ldmopt


def test_direct_backward_op_calls_with_a_strided_pre_activation():
    # Only a direct call of the op passes a strided pre; the Triton launchers read it as contiguous.
    dy, pre, gate = torch.randn(6, 10), torch.randn(10, 6).t(), torch.randn(2, 10)
    pre2 = torch.randn(20, 6).t()
    results = {}
    for backend in ("triton", "torch"):
        with ldmopt.use_backend(backend):
            results[backend] = (
                torch.ops.ldmopt.linear_bwd(dy, pre, gate, "gelu", True)[0],
                torch.ops.ldmopt.geglu_bwd(dy, pre2)[0],
            )
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_direct_adaln_call_with_mixed_dtypes_is_refused():
    x, residual, scale = torch.randn(6, 16, dtype=torch.float16), torch.randn(6, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"residual dtype torch\.float32 differs from x's torch\.float16"):
        torch.ops.ldmopt.adaln_modulate_fwd(x, scale.half(), scale.half(), residual, None, 1e-6, True, True)


def test_every_op_records_why_it_ran_its_reference_backend():
    # A reference run the user did not force is a fall-back: PatchReport.fallbacks() lists each refusing backend's
    # reason, for every op (here a GEMM and a GroupNorm in fp64, which their kernels do not serve).
    from ldmopt.ops import _dispatch
    from ldmopt.ops.group_norm import group_norm
    from ldmopt.ops.linear import linear
    from ldmopt.patch.report import PatchReport, fallback_counts

    report = PatchReport(_fallbacks_at_patch=fallback_counts())  # as patch() makes it: counts from here on
    x = torch.randn(5, 8, dtype=torch.float64)
    linear(x, torch.randn(3, 8, dtype=torch.float64), None)
    group_norm(torch.randn(2, 8, 3, 3, dtype=torch.float64), 4, None, None, 1e-5)
    keys = [key for key in _dispatch.fallback_reasons if key[1] == "triton" and "float64" in key[2]]
    assert {op for op, _, _ in keys} >= {"linear", "group_norm"}, dict(_dispatch.fallback_reasons)
    expected = "linear ran the reference backend (triton refused: dtype torch.float64"
    assert any(line.startswith(expected) for line in report.fallbacks()), report.fallbacks()
    with ldmopt.use_backend("torch"):  # forced: the user's choice, not a fall-back
        before = dict(_dispatch.fallback_reasons)
        linear(x, torch.randn(3, 8, dtype=torch.float64), None)
    assert dict(_dispatch.fallback_reasons) == before


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_direct_calls_return_no_alias_of_an_input(backend):
    # linear's backward with no activation and no gate passes dy through in value, but as a new tensor: a custom op's
    # output may not alias its inputs.
    dy = torch.randn(4, 8)
    with ldmopt.use_backend(backend):
        dz, *_ = torch.ops.ldmopt.linear_bwd(dy, None, None, "", False)
        torch.library.opcheck(torch.ops.ldmopt.linear_bwd, (dy, None, None, "", False))
    assert torch.equal(dz, dy) and dz.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", ["triton", "torch", "cuda"])
def test_direct_adaln_call_storing_a_sum_without_a_residual_is_refused(backend):
    # The sum would be x: the kernels write none (the Triton one left it uninitialised; the C++ one refused it).
    x, scale, shift = torch.randn(4, 8), 0.3 * torch.randn(1, 8), torch.randn(1, 8)
    with ldmopt.use_backend(backend), pytest.raises(ValueError, match="store_sum=True needs a residual"):
        torch.ops.ldmopt.adaln_modulate_fwd(x, scale, shift, None, None, 1e-5, True, False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_direct_geglu_call_without_the_saved_pre_activation_differentiates_x(backend):
    # save_pre=False with a frozen weight: the backward recomputes the pre-activation from x, which it must keep.
    x = torch.randn(6, 8, requires_grad=True)
    w, b = torch.randn(10, 8) * 8**-0.5, torch.randn(10)
    dy = torch.randn(6, 5)
    with ldmopt.use_backend(backend):
        y, _pre = torch.ops.ldmopt.geglu_fwd(x, w, b, False)
        y.backward(dy)
    ref_x = x.detach().double().requires_grad_()
    hidden, gate = torch.nn.functional.linear(ref_x, w.double(), b.double()).chunk(2, dim=-1)
    (hidden * torch.nn.functional.gelu(gate)).backward(dy.double())
    torch.testing.assert_close(x.grad, ref_x.grad.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_direct_calls_missing_what_they_read_are_refused(backend):
    # Arguments the public functions always pass consistently: a direct call gets a ValueError naming them, not an
    # AttributeError, a made-up gradient or a read past a tensor.
    dy, s = torch.randn(6, 40), torch.randn(4, 24)
    mean, rstd = s.mean(1), torch.rsqrt(s.var(1, unbiased=False) + 1e-5)
    x = torch.randn(1, 8, 4, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    small = torch.randn(1, 8, 2, 2).contiguous(memory_format=torch.channels_last)  # "up" gives 4x4, not 4x5
    calls = {
        "activation='gelu', need_dgate=False read the pre-activation": lambda: torch.ops.ldmopt.linear_bwd(
            dy, None, None, "gelu", False
        ),
        "need_dgate=True needs the gate": lambda: torch.ops.ldmopt.linear_bwd(dy, dy.clone(), None, "gelu", True),
        r"gate of shape \(4, 40\) is not \[B, 40\] with B dividing M": lambda: torch.ops.ldmopt.linear_bwd(
            dy, None, torch.randn(4, 40), "", False
        ),
        "with a gate, x .* must have s's shape": lambda: torch.ops.ldmopt.adaln_modulate_bwd(
            torch.randn(4, 24), s, mean, rstd, torch.randn(2, 24), None, None, torch.randn(2, 24), False
        ),
        "residual of shape .* does not give the output's 4x5 pixels": lambda: torch.ops.ldmopt.gn_conv2d(
            x, None, None, None, None, w, None, None, small, None, None, None, None, 0, "", 1, [1, 1], "none", "up",
            "none", 1.0, 0, 0.0,
        ),
        r"temb of shape \(1, 7\) is not \(1, 8\) or \(1, 8, 4\)": lambda: torch.ops.ldmopt.gn_conv2d(
            x, None, None, None, None, w, None, torch.randn(1, 7), None, None, None, None, None, 0, "", 1, [1, 1],
            "none", "none", "none", 1.0, 0, 0.0,
        ),
        r"gate of shape \(1, 3\) is not \(1, 1\) or \(1, 4\)": lambda: torch.ops.ldmopt.gn_conv2d(
            x, None, None, None, None, w, None, None, None, None, None, None, torch.randn(1, 3), 0, "", 1, [1, 1],
            "none", "none", "none", 1.0, 0, 0.0,
        ),
    }  # fmt: skip
    for match, call in calls.items():
        with ldmopt.use_backend(backend), pytest.raises(ValueError, match=match):
            call()
