"""GroupNorm(+SiLU) at Stable Diffusion shapes: ldmopt backends vs PyTorch eager vs torch.compile.

Bytes counted: x read once, y written once (forward); x and dy read, dx written (backward part), so GB/s is the
minimum traffic over time. Targets (H200): forward >= 80% of measured copy bandwidth at 64x64, >= 2x eager on
channels-last inputs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks import harness

pytestmark = harness.gpu_only

DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
SHAPES = {
    # name: (N, C, H, W)
    "sd-64x64x320": (2, 320, 64, 64),
    "sd-32x32x640": (2, 640, 32, 32),
    "sd-16x16x1280": (2, 1280, 16, 16),
    "sd-8x8x1280": (2, 1280, 8, 8),
    "vae-512x512x128": (1, 128, 512, 512),
}
GROUPS = 32


def _eager(x, w, b):
    return F.silu(F.group_norm(x, GROUPS, w, b, 1e-5))


def _ldmopt(backend):
    def fn(x, w, b):
        with ldmopt.use_backend(backend):
            return ldmopt.ops.group_norm(x, GROUPS, w, b, 1e-5, "silu")

    return fn


def _providers(case: str):
    providers = {"eager": _eager}
    # Quick mode compiles the baseline for the first shape only: a max-autotune compile per case (each after a
    # dynamo reset) took this first file's whole share of the budget.
    if case == next(iter(SHAPES)) or os.environ.get("LDMOPT_BENCH_QUICK") != "1":
        providers["compile"] = harness.compiled(_eager, mode="max-autotune-no-cudagraphs")
    for backend in ("triton", "cuda"):
        providers[f"ldmopt-{backend}"] = _ldmopt(backend)
    return providers


@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def bench_group_norm(case, dtype, layout, mode, bench_recorder):
    n, c, h, w = SHAPES[case]
    x = torch.randn(n, c, h, w, device=DEVICE, dtype=dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    weight = torch.randn(c, device=DEVICE, dtype=dtype)
    bias = torch.randn(c, device=DEVICE, dtype=dtype)
    elem = x.element_size() * x.numel()
    if mode == "fwd+bwd":
        x.requires_grad_(True)
        weight.requires_grad_(True)
        bias.requires_grad_(True)
    dy = torch.randn_like(x)
    for name, fn in _providers(case).items():
        if mode == "fwd":
            run = lambda fn=fn: fn(x, weight, bias)
            nbytes = 2 * elem
        else:
            run = lambda fn=fn: torch.autograd.grad(fn(x, weight, bias), (x, weight, bias), dy)
            nbytes = 5 * elem  # forward x, y; backward x, dy, dx
        try:
            timing, note = harness.time_fn(run), ""
        except Exception as exc:  # no ldmopt._C, an inductor failure: a row with the reason, the other providers run
            timing, note = None, harness.error_note(exc)
        bench_recorder.record(
            op="group_norm_silu",
            case=f"{case}-{layout}",
            dtype=str(dtype).removeprefix("torch."),
            mode=mode,
            provider=name,
            timing=timing,
            bytes=nbytes,
            note=note,
        )
