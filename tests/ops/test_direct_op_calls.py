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
