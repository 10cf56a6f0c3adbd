"""Host time per call: each fused op against the unfused PyTorch ops it replaces, on tiny tensors.

With tiny tensors the GPU work is a few microseconds, so the time per call is what the host spends issuing it
(Python, dispatcher, backend choice, kernel launches). Small models are bound by it: a DiT-XL/2 step at 256 px makes
about 110 fused calls and little GPU work, so a fused op that costs more host time than the aten ops it replaces
makes the patched step slower however fast its kernel is. Rows: microseconds per call (in the ms columns: ms), eager
(the aten composition) vs ldmopt (automatic backend) vs ldmopt with autograd recording (fwd+grad mode).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks import harness

pytestmark = harness.gpu_only

DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
CALLS = 200  # per timed window
WINDOWS = 7


def _tensors(dtype):
    def r(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    return {
        "x4": r(1, 64, 4, 4).to(memory_format=torch.channels_last),
        "c64": r(64),
        "c64b": r(64),
        "w3": r(64, 64, 3, 3).to(memory_format=torch.channels_last),
        "temb": r(1, 64),
        "x3": r(1, 16, 64),
        "w": r(64, 64),
        "w2": r(128, 64),
        "b2": r(128),
        "gate": r(1, 64),
        "res": r(1, 16, 64),
        "scale": r(1, 64),
        "shift": r(1, 64),
        "q": r(1, 8, 4, 2, 32),
    }


def _temporal_eager(q):
    b, f, n, h, d = q.shape
    t = q.permute(0, 2, 3, 1, 4).reshape(b * n, h, f, d)
    return F.scaled_dot_product_attention(t, t, t).reshape(b, n, h, f, d).permute(0, 3, 1, 2, 4)


def _triton_pass(fn, *args, **kwargs):
    """``fn`` with the pass after cuBLAS's GEMM forced to Triton's launch (ldmopt._C's kernel runs it where built):
    the A/B of that pass's host time on a GPU (entering the context costs a few us of its own)."""
    with ldmopt.use_backend("triton", ops=["linear_epilogue"]):
        return fn(*args, **kwargs)


#: name -> (ldmopt call, the unfused PyTorch composition it replaces), both on _tensors()
CASES = {
    "group_norm_silu": (
        lambda t: ldmopt.ops.group_norm(t["x4"], 8, t["c64"], t["c64b"], activation="silu"),
        lambda t: F.silu(F.group_norm(t["x4"], 8, t["c64"], t["c64b"])),
    ),
    "gn_silu_conv2d+temb": (
        lambda t: ldmopt.ops.gn_silu_conv2d(t["x4"], t["c64"], t["c64b"], 8, 1e-5, t["w3"], t["c64"], temb=t["temb"]),
        lambda t: (
            F.conv2d(F.silu(F.group_norm(t["x4"], 8, t["c64"], t["c64b"])), t["w3"], t["c64"], padding=1)
            + t["temb"][:, :, None, None]
        ),
    ),
    "geglu": (
        lambda t: ldmopt.ops.geglu(t["x3"], t["w2"], t["b2"]),
        lambda t: (lambda h, g: h * F.gelu(g))(*F.linear(t["x3"], t["w2"], t["b2"]).chunk(2, -1)),
    ),
    "geglu (triton pass)": (
        lambda t: _triton_pass(ldmopt.ops.geglu, t["x3"], t["w2"], t["b2"]),
        lambda t: (lambda h, g: h * F.gelu(g))(*F.linear(t["x3"], t["w2"], t["b2"]).chunk(2, -1)),
    ),
    "linear_gelu_tanh": (
        lambda t: ldmopt.ops.linear(t["x3"], t["w"], t["c64"], activation="gelu_tanh"),
        lambda t: F.gelu(F.linear(t["x3"], t["w"], t["c64"]), approximate="tanh"),
    ),
    "linear_gated_residual": (
        lambda t: ldmopt.ops.linear(t["x3"], t["w"], t["c64"], gate=t["gate"], residual=t["res"]),
        lambda t: t["res"] + t["gate"][:, None] * F.linear(t["x3"], t["w"], t["c64"]),
    ),
    "linear_gated_residual (triton pass)": (
        lambda t: _triton_pass(ldmopt.ops.linear, t["x3"], t["w"], t["c64"], gate=t["gate"], residual=t["res"]),
        lambda t: t["res"] + t["gate"][:, None] * F.linear(t["x3"], t["w"], t["c64"]),
    ),
    "adaln_modulate": (
        lambda t: ldmopt.ops.adaln_modulate(t["x3"], t["scale"], t["shift"]),
        lambda t: F.layer_norm(t["x3"], (64,), eps=1e-6) * (1 + t["scale"][:, None]) + t["shift"][:, None],
    ),
    "temporal_attention": (
        lambda t: ldmopt.ops.temporal_attention(t["q"], t["q"], t["q"]),
        lambda t: _temporal_eager(t["q"]),
    ),
}


def us_per_call(fn) -> harness.Timing:
    """Median (p20, p80) over WINDOWS windows of CALLS calls, in ms per call, the device synchronised around each
    window: in this regime the host issues the calls no faster than this."""
    fn()
    per_call = []
    for _ in range(WINDOWS):
        harness.synchronize(DEVICE)
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        harness.synchronize(DEVICE)
        per_call.append((time.perf_counter() - start) * 1e3 / CALLS)
    q = statistics.quantiles(per_call, n=5)
    return harness.Timing(statistics.median(per_call), q[0], q[3])


@pytest.mark.parametrize("case", list(CASES))
def bench_host_overhead(case, bench_recorder):
    fused, unfused = CASES[case]
    tensors = _tensors(torch.float16)
    graded = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
    runs = {
        "eager": lambda: unfused(tensors),
        "ldmopt": lambda: fused(tensors),
        "eager(grad)": lambda: unfused(graded),
        "ldmopt(grad)": lambda: fused(graded),
    }
    for provider, run in runs.items():
        with torch.inference_mode(provider in ("eager", "ldmopt")):
            try:
                timing, note = us_per_call(run), ""
            except Exception as exc:  # a provider that cannot run is a row with the reason
                timing, note = None, f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        if timing is not None:
            note = f"{timing.median_ms * 1e3:.1f} us/call"
        # Recorded under mode "fwd" (inference) and "fwd-grad" (autograd recording), each against its eager.
        mode = "fwd-grad" if provider.endswith("(grad)") else "fwd"
        bench_recorder.record(
            op="host-per-call", case=case, dtype="fp16", mode=mode, provider=provider.removesuffix("(grad)"),
            timing=timing, note=note,
        )  # fmt: skip
