"""Triton's CPU interpreter multiplies bf16 tl.dot operands as raw bits (triton-lang/triton#11584): every kernel with a
matrix product refuses bf16 there, so the automatic choice runs the reference backend (right answers, the reason
recorded) and a forced Triton backend is an error naming the cause instead of garbage. Elementwise and reduction
kernels (GroupNorm, adaLN, RMSNorm) keep running bf16 in the interpreter."""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt import _env
from ldmopt.ops import _dispatch
from ldmopt.ops._dispatch import INTERPRETER_BF16_DOT, BackendUnavailableError

pytestmark = pytest.mark.skipif(not _env.interpreter_enabled(), reason="the interpreter is not on")

BF16 = torch.bfloat16


def _conv_inputs():
    x = torch.randn(2, 10, 5, 7).to(BF16).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.randn(10).to(BF16) * 0.5 + 1, torch.randn(10).to(BF16) * 0.5
    w = (torch.randn(6, 10, 3, 3) * 0.2).to(BF16).contiguous(memory_format=torch.channels_last)
    return x, gw, gb, w, torch.randn(6).to(BF16)


CALLS = {
    "linear": lambda: ldmopt.ops.linear(torch.randn(5, 24).to(BF16), torch.randn(16, 24).to(BF16), None),
    "geglu": lambda: ldmopt.ops.geglu(torch.randn(5, 24).to(BF16), torch.randn(32, 24).to(BF16), None),
    "gn_conv2d": lambda: ldmopt.ops.gn_silu_conv2d(*_conv_inputs()[:3], 5, 1e-5, *_conv_inputs()[3:], 1, 1),
    "temporal_attention": lambda: ldmopt.ops.temporal_attention(*torch.randn(3, 2, 3, 4, 2, 8).to(BF16)),
}


@pytest.mark.parametrize("op", list(CALLS))
def test_bf16_matrix_products_run_the_reference_backend_in_the_interpreter(op):
    _dispatch.backend_counts.clear()
    out = CALLS[op]()
    assert torch.isfinite(out).all() and out.abs().max() < 1e3  # the bit-pattern products reach ~1e10
    ran = {backend for (name, backend) in _dispatch.backend_counts if not name.endswith("stats")}
    assert ran == {"torch"}, _dispatch.backend_counts
    with ldmopt.use_backend("triton"), pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        CALLS[op]()


def test_linear_bf16_reference_matches_and_fp16_still_runs_the_kernel():
    x, w = torch.randn(5, 24), torch.randn(16, 24)
    got = ldmopt.ops.linear(x.to(BF16), w.to(BF16), None)
    torch.testing.assert_close(got.float(), F.linear(x.to(BF16).float(), w.to(BF16).float()), atol=0.1, rtol=0.02)
    assert INTERPRETER_BF16_DOT in _dispatch.triton_refusals(x.to(BF16), w.to(BF16), matmul=True)
    assert not _dispatch.triton_refusals(x.to(BF16), w.to(BF16))  # kernels without tl.dot keep bf16
    _dispatch.backend_counts.clear()
    ldmopt.ops.linear(x.half(), w.half(), None)
    assert {b for (_, b) in _dispatch.backend_counts} == {"triton"}
