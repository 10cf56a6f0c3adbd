"""The case tables of check_gpu.py: the real shapes each check runs (OP_CASES; check_gpu.CASES adds the
temporal_layout cases, whose module builders live there), those only a full run covers (FULL_ONLY, left out by
--quick), the variants a case runs under (the conv's GroupNorm placements, the fused linear layers' GEMM placements)
and the inputs of each fused_linear case. A dry run (tests/test_check_scripts_dry_run.py) replaces the shapes with
tiny ones."""

from __future__ import annotations

import torch

from benchmarks.check_gpu_linear import (
    _ref_adaln,
    _ref_adaln_gated,
    _ref_blend,
    _ref_gated,
    _ref_geglu,
    _ref_gelu,
    _ref_ln_linear,
    _ref_ln_linear_pos,
    _run_adaln,
    _run_adaln_gated,
    _run_blend,
    _run_gated,
    _run_gated_concat,
    _run_gated_wan,
    _run_geglu,
    _run_gelu,
    _run_ln_linear,
    _run_ln_linear_pos,
)
from benchmarks.check_gpu_norms import (
    _ref_layer_norm_rope,
    _ref_rms_norm,
    _ref_rms_norm_rope,
    _ref_rms_norm_rope_complex,
    _ref_rms_norm_rope_heads,
    _ref_rms_norm_rope_joint,
    _run_layer_norm_rope,
    _run_rms_norm,
    _run_rms_norm_rope,
    _run_rms_norm_rope_complex,
    _run_rms_norm_rope_heads,
    _run_rms_norm_rope_joint,
)

#: where the fused conv applies GroupNorm + SiLU and who runs the conv (ldmopt/ops/gn_conv2d_prologue.py); a GPU's
#: auto choice is "cudnn" for these 3x3 convs, so each is checked explicitly
PLACEMENTS = ("cudnn", "staged", "loader")
#: for a conv that normalises nothing: cuDNN's conv and the epilogue pass, or ldmopt's Triton conv
PLAIN_PLACEMENTS = ("cudnn", "staged")


#: Wan keeps its modulation (scale, shift, gate) in fp32 while the stream is bf16/fp16: these inputs stay fp32.
_FP32_INPUTS = {_run_adaln_gated: (1, 2, 4), _run_gated_wan: (3,), _run_blend: (3,)}


#: who runs a fused linear layer's GEMM (ldmopt/ops/linear_cublas.py): cuBLAS then the epilogue pass (a GPU's auto
#: choice), or ldmopt's Triton GEMM with the epilogue on its accumulator; the check's backend column names it
GEMM_PLACEMENTS = {"cublas": "triton/cublas", "triton": "triton/gemm"}
#: the fused_linear cases whose op runs a GEMM under either placement (the blend's stays in the Triton GEMM)
_GEMM_RUNS = (_run_geglu, _run_gelu, _run_gated, _run_gated_wan, _run_gated_concat, _run_ln_linear, _run_ln_linear_pos)


def fused_linear_inputs(run, bsz: int, t: int, k: int, n: int | None, dtype: torch.dtype, device) -> list:
    """The inputs of a fused_linear case (run, reference, B, T, K, N), in ``dtype`` but for those _FP32_INPUTS keeps."""
    x = torch.randn(bsz, t, k, device=device)
    if run is _run_rms_norm:  # (x, weight, bias): the norm's affine is near 1, as trained ones are
        inputs = [x, 1 + 0.3 * torch.randn(k, device=device), 0.1 * torch.randn(k, device=device)]
    elif run in (_run_rms_norm_rope, _run_rms_norm_rope_heads, _run_rms_norm_rope_complex):  # fixed tables
        width = k if run is _run_rms_norm_rope else n  # a per-head norm's weight: one head (N)
        inputs = [x, 1 + 0.3 * torch.randn(width, device=device)]
    elif run is _run_layer_norm_rope:  # tokens off zero mean; per-head affine near (1, 0)
        inputs = [x + 0.5, 1 + 0.3 * torch.randn(n, device=device), 0.1 * torch.randn(n, device=device)]
    elif run is _run_rms_norm_rope_joint:  # one weight per stream
        inputs = [x, *(1 + 0.3 * torch.randn(n, device=device) for _ in range(2))]
    elif n is None:
        scale, shift = torch.randn(bsz, k, device=device) * 0.5, torch.randn(bsz, k, device=device)
        inputs = [x, scale, shift, torch.randn_like(x)]
        if run is _run_adaln_gated:
            inputs.append(torch.randn(bsz, k, device=device))
    elif run in (_run_ln_linear, _run_ln_linear_pos):  # a token stream off zero mean; the norm's affine near 1
        inputs = [x + 0.5, 1 + 0.3 * torch.randn(k, device=device), 0.1 * torch.randn(k, device=device),
                  torch.randn(n, k, device=device) * k**-0.5, torch.randn(n, device=device) * 0.1]  # fmt: skip
    elif run is _run_blend:  # two [bsz, t, k] streams as x's halves; one blend weight per frame
        inputs = [torch.randn(bsz, t, 2 * k, device=device), torch.randn(n, k, device=device) * k**-0.5,
                  torch.randn(n, device=device) * 0.1, torch.rand(bsz, device=device),
                  torch.randn(bsz, t, n, device=device)]  # fmt: skip
    else:
        inputs = [x, torch.randn(n, k, device=device) * k**-0.5, torch.randn(n, device=device) * 0.1]
        if run in (_run_gated, _run_gated_wan, _run_gated_concat):
            inputs += [torch.randn(bsz, n, device=device), torch.randn(bsz, t, n, device=device)]
    keep = _FP32_INPUTS.get(run, ())
    return [v if i in keep else v.to(dtype) for i, v in enumerate(inputs)]


# Real shapes per check but temporal_layout (check_gpu.CASES); the cases in FULL_ONLY run only without --quick.
OP_CASES: dict[str, dict[str, tuple]] = {
    "group_norm_silu": {  # (N, C, H, W)
        "sd-64x64x320": (2, 320, 64, 64),
        "sd-8x8x1280": (2, 1280, 8, 8),
        "vae-512": (1, 128, 512, 512),
    },
    "resnet_block": {  # (N, C_in, C_out, H = W, temb channels)
        "sd-64x64x320": (2, 320, 320, 64, 1280),
        "sd-32x32x320-640": (2, 320, 640, 32, 1280),
        "vae-128x128x256-128": (1, 256, 128, 128, None),
    },
    "resnet_skip": {  # (N, C hidden, C skip, C_out, H = W, temb channels): SD1.5 / SDXL up-block resnets
        "sd15-up3-64x64-640+320": (2, 640, 320, 320, 64, 1280),
        "sd15-up1-16x16-1280+640": (2, 1280, 640, 1280, 16, 1280),
        "sdxl-up2-128x128-320+320": (2, 320, 320, 320, 128, 1280),
    },
    "upsample_conv": {  # (N, C, H = W of the input)
        "sd15-unet-16to32x1280": (2, 1280, 16),
        "vae1024-dec-256to512x512": (1, 512, 256),
    },
    "svd_resnet_block": {  # (videos, frames, C, H, W, temb channels)
        "svd-36x64x640": (2, 14, 640, 36, 64, 1280),
        "svd-72x128x320": (2, 14, 320, 72, 128, 1280),
    },
    # (fused, reference, B, T, K, N); GEMM weights are [N, K] (GEGLU: N = 2I); adaLN and RMSNorm use C = K (the
    # per-head RMSNorm + RoPE: heads of N).
    "fused_linear": {
        "geglu-sd15-l0": (_run_geglu, _ref_geglu, 2, 4096, 320, 2560),
        "geglu-sdxl": (_run_geglu, _ref_geglu, 2, 1024, 1280, 10240),
        "gelu_tanh-pixart": (_run_gelu, _ref_gelu, 2, 4096, 1152, 4608),
        "gated-pixart": (_run_gated, _ref_gated, 2, 4096, 1152, 1152),
        "gated-two-part-flux-single": (_run_gated_concat, _ref_gated, 1, 2048, 15360, 3072),
        "blend-svd-proj_out": (_run_blend, _ref_blend, 28, 2304, 640, 640),  # 14 frames x 2 (CFG), level 2
        "ln-q-sd15-l0": (_run_ln_linear, _ref_ln_linear, 2, 4096, 320, 320),
        "ln-geglu-sdxl-l1": (_run_ln_linear, _ref_ln_linear, 2, 4096, 640, 5120),
        "ln-q-positions-animatediff": (_run_ln_linear_pos, _ref_ln_linear_pos, 2, 16 * 1024, 320, 320),
        "adaln-pixart": (_run_adaln, _ref_adaln, 2, 4096, 1152, None),
        "adaln-gated-wan14b": (_run_adaln_gated, _ref_adaln_gated, 1, 8192, 5120, None),
        "gated-wan1.3b-ffn": (_run_gated_wan, _ref_gated, 1, 8192, 8960, 1536),
        "rms_norm-sd35-qk": (_run_rms_norm, _ref_rms_norm, 2, 4096 * 24, 64, 0),
        "rms_norm-c3072": (_run_rms_norm, _ref_rms_norm, 1, 4096, 3072, 0),
        "rms_rope-wan1.3b": (_run_rms_norm_rope, _ref_rms_norm_rope, 1, 8192, 1536, 0),
        "rms_rope-wan14b": (_run_rms_norm_rope, _ref_rms_norm_rope, 1, 4096, 5120, 0),
        "rms_rope-flux-heads": (_run_rms_norm_rope_heads, _ref_rms_norm_rope_heads, 1, 4608, 3072, 128),
        "rms_rope-flux-joint": (_run_rms_norm_rope_joint, _ref_rms_norm_rope_joint, 1, 4608, 3072, 128),
        "ln_rope-cogvideox5b": (_run_layer_norm_rope, _ref_layer_norm_rope, 1, 17_776, 3072, 64),
        "rms_rope-qwen-complex": (_run_rms_norm_rope_complex, _ref_rms_norm_rope_complex, 1, 7145, 3072, 128),
    },
    # (B, T, K, N, residual offset): attention output projections of UNet transformer blocks (N = K = C); 2 x 1125
    # rows end in a partial row tile; a stream far off zero tests the centred sums
    "linear_row_stats": {
        "attn-out-sd15-l0": (2, 4096, 320, 320, 0.5),
        "attn-out-sdxl-l2": (2, 1024, 1280, 1280, 0.5),
        "partial-rows-mean-40": (2, 1125, 320, 320, 40.0),
    },
    # (N, C, C_out, H = W): Transformer2DModel proj_in at SD1.5 level 0 (3 column tiles) and SDXL level 2 (10)
    "conv_row_stats": {
        "proj_in-sd15-64x64x320": (2, 320, 320, 64),
        "proj_in-sdxl-32x32x1280": (2, 1280, 1280, 32),
    },
    # (N, C, C skip, H = W): SD1.5 level-0 proj_out with its skip (groups of 20), a 1280 + 640 up-block concat at
    # level 2 (groups of 60 straddle the parts)
    "channel_sums": {
        "proj_out-sd15-64x64x320+320": (2, 320, 320, 64),
        "proj_out-sd15-16x16x1280+640": (2, 1280, 640, 16),
    },
    "temporal_attention": {  # (B, F, N, heads, head_dim)
        "animatediff-512-l0": (2, 16, 4096, 8, 40),
        "svd-576x1024-l0": (2, 14, 9216, 5, 64),
        "latte-512": (2, 16, 1024, 16, 72),
        "animatediff-l2-d160": (2, 16, 256, 8, 160),
        "animatediff-sdxl-1024": (2, 16, 16384, 8, 80),
    },
}
FULL_ONLY = {
    "vae1024-dec-256to512x512",
    "sdxl-up2-128x128-320+320",
    "rms_rope-wan14b",
    "svd-72x128x320",
    "vae-512",
    "vae-128x128x256-128",
    "geglu-sdxl",
    "latte-512",
    "animatediff-64x64x320",
}
