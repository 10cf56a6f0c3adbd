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
