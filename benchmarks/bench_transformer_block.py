"""One UNet transformer block (diffusers' ``BasicTransformerBlock``, norm_type "layer_norm") at real SD1.5 and SDXL
shapes: diffusers' forward vs ``ldmopt.patch`` (``residual_block``: the attention and feed-forward residual adds in
the output GEMMs' epilogues, and the GEGLU rule) vs torch.compile of diffusers' block.

Cases (batch 2 = classifier-free guidance, 77 text tokens):
- ``sd15-64x64``: SD1.5's first level at 512 px, dim 320, 8 heads of 40, 4096 tokens, context 768;
- ``sdxl-64x64``: SDXL's 1024 px middle level, dim 640, 10 heads of 64, 4096 tokens, context 2048;
- ``sdxl-32x32``: SDXL's deepest level, dim 1280, 20 heads of 64, 1024 tokens, context 2048.
Bytes: the token stream read and written once (a lower bound). The row's note carries the max relative error of the
provider's output against eager. What to expect is a projection until measured: each attention residual saves four
passes over the token stream (the div by rescale_output_factor and the add), the feed-forward's two.
LDMOPT_BENCH_QUICK=1 keeps the SD1.5 case, forward only, no compile.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
BATCH, TEXT_TOKENS = 2, 77
# name: (dim, heads, tokens, context dim)
CASES = {
    "sd15-64x64": (320, 8, 4096, 768),
    "sdxl-64x64": (640, 10, 4096, 2048),
    "sdxl-32x32": (1280, 20, 1024, 2048),
}
QUICK_CASES = ("sd15-64x64",)


def _setup(case, dtype):
    from diffusers.models.attention import BasicTransformerBlock

    dim, heads, tokens, context_dim = CASES[case]
    block = BasicTransformerBlock(dim, heads, dim // heads, cross_attention_dim=context_dim, activation_fn="geglu")
    block = block.to(device=DEVICE, dtype=dtype).eval()
    hidden = torch.randn(BATCH, tokens, dim, device=DEVICE, dtype=dtype)
    context = torch.randn(BATCH, TEXT_TOKENS, context_dim, device=DEVICE, dtype=dtype)
    return block, (hidden, context)


@pytest.mark.parametrize("case", [c for c in CASES if not QUICK or c in QUICK_CASES])
@pytest.mark.parametrize(
    "dtype", [torch.float16] if QUICK else [torch.float16, torch.bfloat16], ids=["fp16"] if QUICK else ["fp16", "bf16"]
)
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_transformer_block(case, dtype, mode, bench_recorder):
    pytest.importorskip("diffusers")

    block, (hidden, context) = _setup(case, dtype)
    harness.record_block_providers(
        bench_recorder, block, lambda: block(hidden, encoder_hidden_states=context), hidden, mode,
        expect={"geglu": 1, "residual_block": 1}, with_compile=not QUICK, op="transformer_block", case=case,
        dtype=dtype,
    )  # fmt: skip
