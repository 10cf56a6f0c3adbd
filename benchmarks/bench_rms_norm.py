"""RMSNorm at query/key-norm shapes: ldmopt's row kernel vs diffusers' RMSNorm (eight eager passes with an fp32 copy)
vs torch's fused ``F.rms_norm`` (what torch.nn.RMSNorm runs: Flux, Wan) vs torch.compile of diffusers' module.

Cases: SD3.5-large per-head q/k norms at 1024 px (2 x 4096 tokens x 38 heads of 64, bf16 weight), a HunyuanVideo-size
per-head norm (1 x 33,000 tokens x 24 heads of 128), and a whole-row norm of 3072. Bytes: x read once, y written once
(forward); x and dy read, dx written (backward part). LDMOPT_BENCH_QUICK=1 keeps the first case, forward only, no
compile.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/test_bench_dry_run.py runs this benchmark's logic on the CPU
SHAPES = {  # name: (rows, C)
    "sd35-qk-1024": (2 * 4096 * 38, 64),
    "hunyuanvideo-qk": (33_000 * 24, 128),
    "row-3072": (2 * 4096, 3072),
}
EPS = 1e-6


def _diffusers_eager(x, w):
    # diffusers.models.normalization.RMSNorm.forward (non-NPU path), half-precision weight
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + EPS)).to(w.dtype) * w


def _providers():
    providers = {
        "eager-diffusers": _diffusers_eager,
        "torch-rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
        "ldmopt": lambda x, w: ldmopt.ops.rms_norm(x, w, None, EPS),
    }
    if not QUICK:  # an inductor compile costs more of the quick run's budget than the row is worth
        providers["compile"] = harness.compiled(_diffusers_eager, mode="max-autotune-no-cudagraphs")
    return providers


@pytest.mark.parametrize("case", list(SHAPES)[:1] if QUICK else list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16] if QUICK else [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_rms_norm(case, dtype, mode, bench_recorder):
    rows, c = SHAPES[case]
    x = torch.randn(rows, c, device=DEVICE, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(c, device=DEVICE)).to(dtype)
    reference = _diffusers_eager(x.float(), weight.float())
    elem = x.element_size() * x.numel()
    if mode == "fwd+bwd":
        x.requires_grad_(True)
        weight.requires_grad_(True)
    dy = torch.randn_like(x)
    for name, fn in _providers().items():
        if mode == "fwd":
            run = lambda fn=fn: fn(x, weight)
            nbytes = 2 * elem
        else:
            run = lambda fn=fn: torch.autograd.grad(fn(x, weight), (x, weight), dy)
            nbytes = 5 * elem  # forward x, y; backward x, dy, dx
        try:
            with torch.no_grad():
                out = fn(x, weight)
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            timing, note = harness.time_fn(run), f"max rel err vs fp32 {err:.1e}"
        except Exception as exc:  # a provider that cannot run is a row with the reason
            timing, note = None, f"unavailable: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
        bench_recorder.record(
            op="rms_norm", case=case, dtype=str(dtype).removeprefix("torch."), mode=mode, provider=name,
            timing=timing, bytes=nbytes, note=note,
        )  # fmt: skip
