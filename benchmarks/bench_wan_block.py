"""One Wan 2.1 transformer block at 480p x 81 frames (21 x 30 x 52 = 32,760 tokens after the 1x2x2 patch embed):
diffusers' forward (fp32 norms, modulation and gated adds around bf16 attention and GEMMs, as the pipeline runs it)
vs ``ldmopt.patch`` (rule ``wan_block``, the GELU feed-forward projection and the self-attention's query/key norm +
RoPE, ``wan_qk_norm_rope``) vs torch.compile of diffusers' block.

Cases (batch 1: Wan's pipeline runs the conditional and unconditional passes as separate calls; 512 text tokens):
- ``wan2.1-1.3b-480p``: dim 1536, 12 heads of 128, ffn 8960;
- ``wan2.1-14b-480p``: dim 5120, 40 heads of 128, ffn 13824.
The block keeps what diffusers keeps in fp32 (``_keep_in_fp32_modules``: scale_shift_table, norm1-3) and runs the
rest in bf16. Bytes: the token stream read and written once (a lower bound). The row's note carries the max relative
error of the provider's output against eager. What to expect is a projection until measured: the elementwise passes
are ~10% of a step at 480p by a bandwidth count, the attention most of the rest.
LDMOPT_BENCH_QUICK=1 keeps the 1.3B case, forward only, no compile.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
TEXT_TOKENS = 512
# name: (dim, heads, ffn_dim, (frames, height, width) of the latent after the VAE's 4x8x8 compression)
CASES = {
    "wan2.1-1.3b-480p": (1536, 12, 8960, (21, 60, 104)),
    "wan2.1-14b-480p": (5120, 40, 13824, (21, 60, 104)),
}
QUICK_CASES = ("wan2.1-1.3b-480p",)


def _setup(case, dtype):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    dim, heads, ffn, (f, h, w) = CASES[case]
    block = WanTransformerBlock(dim, ffn, heads, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=1e-6)
    block = block.to(device=DEVICE, dtype=dtype).eval()
    for name in ("norm1", "norm2", "norm3"):  # as from_pretrained(torch_dtype=bf16) leaves them
        getattr(block, name).float()
    block.scale_shift_table.data = block.scale_shift_table.data.float()
    rope = WanRotaryPosEmbed(dim // heads, (1, 2, 2), 1024).to(DEVICE)
    rotary = rope(torch.empty(1, 16, f, h, w, device=DEVICE))
    tokens = f * (h // 2) * (w // 2)
    hidden = torch.randn(1, tokens, dim, device=DEVICE, dtype=dtype)
    context = torch.randn(1, TEXT_TOKENS, dim, device=DEVICE, dtype=dtype)
    temb = torch.randn(1, 6, dim, device=DEVICE, dtype=torch.float32)  # the time embedder runs in fp32
    return block, (hidden, context, temb, rotary)


@pytest.mark.parametrize("case", [c for c in CASES if not QUICK or c in QUICK_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_wan_block(case, dtype, mode, bench_recorder):
    pytest.importorskip("diffusers")

    block, args = _setup(case, dtype)
    hidden = args[0]
    harness.record_block_providers(
        bench_recorder, block, lambda: block(*args), hidden, mode, expect={"wan_block": 1, "wan_qk_norm_rope": 1},
        with_compile=not QUICK, op="wan_block", case=case, dtype=dtype,
    )  # fmt: skip
