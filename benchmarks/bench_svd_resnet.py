"""SVD's ``SpatioTemporalResBlock`` (spatial ResnetBlock2D, temporal resnet with Conv3d (3, 1, 1), AlphaBlender) at
real SVD shapes: diffusers' forward vs ``ldmopt.patch`` (``resnet`` + ``spatiotemporal_resnet``: the temporal
convs as (3, 1) implicit GEMMs over a (video, C, frame, pixel) view with GroupNorm + SiLU in their loads, the per-frame
time embedding and the blend in their epilogues, channels-last throughout) vs torch.compile of diffusers' block.

Cases (batch 2 = classifier-free guidance, 14 frames, 576x1024 video: 72x128 latent):
- ``svd-72x128x320``: the first level, 320 channels;
- ``svd-36x64x640``: the second level, 640 channels;
- ``svd-9x16x1280``: the deepest level, 1280 channels.
Bytes: the block's input read and its output written once (a lower bound). The row's note carries the max relative
error against eager. What to expect is a projection until measured (benchmarks/RESULTS.md, ANALYTIC):
the temporal half loses its GroupNorm/SiLU passes, the time-embedding and residual adds, the blend's three passes
and diffusers' NCHW round trip. LDMOPT_BENCH_QUICK=1 keeps the first two cases, fp16, forward only, no compile.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
BATCH, FRAMES, TEMB_CHANNELS = 2, 14, 1280
# name: (channels, latent H, latent W)
CASES = {
    "svd-72x128x320": (320, 72, 128),
    "svd-36x64x640": (640, 36, 64),
    "svd-9x16x1280": (1280, 9, 16),
}
QUICK_CASES = ("svd-72x128x320", "svd-36x64x640")


def _setup(case, dtype):
    from diffusers.models.resnet import SpatioTemporalResBlock

    channels, height, width = CASES[case]
    block = SpatioTemporalResBlock(channels, channels, temb_channels=TEMB_CHANNELS, eps=1e-5)
    with torch.no_grad():
        block.time_mixer.mix_factor.fill_(0.3)  # a trained blend, not the init's 0.5
    block = block.to(device=DEVICE, dtype=dtype).eval()
    for p in block.parameters():  # channels-last 2-D conv weights (a 5-D Conv3d weight has no such format)
        if p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)
    frames = BATCH * FRAMES
    hidden = torch.randn(frames, channels, height, width, device=DEVICE, dtype=dtype)
    hidden = hidden.contiguous(memory_format=torch.channels_last)
    temb = torch.randn(frames, TEMB_CHANNELS, device=DEVICE, dtype=dtype)
    indicator = torch.zeros(BATCH, FRAMES, device=DEVICE, dtype=dtype)
    return block, hidden, temb, indicator


@pytest.mark.parametrize("case", [c for c in CASES if not QUICK or c in QUICK_CASES])
@pytest.mark.parametrize(
    "dtype", [torch.float16] if QUICK else [torch.float16, torch.bfloat16], ids=["fp16"] if QUICK else ["fp16", "bf16"]
)
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_svd_resnet(case, dtype, mode, bench_recorder):
    pytest.importorskip("diffusers")

    block, hidden, temb, indicator = _setup(case, dtype)
    harness.record_block_providers(
        bench_recorder, block, lambda: block(hidden, temb, indicator), hidden, mode,
        expect={"resnet": 1, "spatiotemporal_resnet": 1}, with_compile=not QUICK, op="svd_resnet_block", case=case,
        dtype=dtype,
    )  # fmt: skip
