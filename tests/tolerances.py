"""Per-dtype tolerances and the comparison rule the kernel tests share.

Rule (from flash-attention's tests): against an fp64 reference, a kernel's error must be at most
``FACTOR`` x the error PyTorch's own computation makes in the same low precision, plus a small absolute floor.
"""

from __future__ import annotations

import torch

#: (atol, rtol) for direct comparisons with an fp64 reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
FACTOR = 2.0
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, name: str = ""
) -> None:
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    assert not torch.isnan(actual).any(), f"{name}: NaN in output (unwritten elements?)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def assert_within_torch_error(
    actual: torch.Tensor,
    reference64: torch.Tensor,
    torch_lowp: torch.Tensor,
    name: str = "",
    ulp_dtype: torch.dtype | None = None,
) -> None:
    """max|actual - ref| <= FACTOR * max|torch_lowp - ref| + FLOOR[dtype] + one ulp of max|ref| in the dtype.

    The ulp term: both results are rounded to the low-precision dtype at different points (a fused kernel once, the
    unfused ops after each op), so at the largest magnitudes they may differ by a rounding step that PyTorch's own
    error did not happen to show (seen: a temb gradient of magnitude 20 in fp16, where one ulp is 0.0156, reduced
    in a different order when the machine was loaded). ``ulp_dtype``: the dtype whose rounding step that term uses
    when it is not ``actual``'s (an fp32 gradient summed from products of fp16-rounded activations)."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in output (unwritten elements?)"
    ours = (actual.double() - reference64).abs().max().item()
    theirs = (torch_lowp.double() - reference64).abs().max().item()
    ulp = torch.finfo(ulp_dtype or actual.dtype).eps * reference64.abs().max().item()
    bound = FACTOR * theirs + FLOOR[actual.dtype] + ulp
    assert ours <= bound, f"{name}: max error {ours:.3e} > {FACTOR} x PyTorch's {theirs:.3e} + floor + 1 ulp {ulp:.1e}"


def assert_compiled_matches_eager(fn, leaves) -> None:
    """``torch.compile(fn, fullgraph=True)`` (aot_eager: the custom ops' fakes and autograd registrations, no
    codegen) gives eager's output and the gradients of ``leaves`` within fp32 tolerance."""
    torch._dynamo.reset()
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
    got = torch.autograd.grad(out.sum(), leaves)
    expect_out = fn(*leaves)
    expect = torch.autograd.grad(expect_out.sum(), leaves)
    assert_close(out, expect_out.detach().double(), torch.float32, "compiled")
    for g, e in zip(got, expect):
        assert_close(g, e.double(), torch.float32, "compiled grads")
