"""The real shapes check_cuda_backend.py checks (and, for GroupNorm, attention and the GEMM epilogues, times) per op,
and the subsets ``--quick`` keeps. The GroupNorm cases are benchmarks/bench_group_norm.py's SHAPES. A dry run
(tests/test_check_scripts_dry_run.py) replaces them with tiny ones on check_cuda_backend itself."""

from __future__ import annotations

QUICK_GROUP_NORM = ("sd-64x64x320", "sd-8x8x1280")  # of benchmarks/bench_group_norm.py's SHAPES
# (B*N, F, heads, head_dim) of the temporal attention layers (the models' real shapes at fp16 and CFG batch 2).
ATTENTION_SHAPES = {
    "animatediff-64x64": (8192, 16, 8, 40),
    "animatediff-32x32": (2048, 16, 8, 80),
    "animatediff-16x16": (512, 16, 8, 160),
    "svd-72x128": (18432, 14, 5, 64),
    "svd-xt-36x64": (4608, 25, 10, 64),
    "latte-32x32": (2048, 16, 16, 72),
}
QUICK_ATTENTION = ("animatediff-64x64", "svd-72x128", "latte-32x32")
# (rows, C) of the LayerNorms whose statistics the GEMMs after them read (CFG batch 2; Flux: image + text tokens).
LAYER_NORM_SHAPES = {
    "sd15-64x64": (8192, 320),
    "sdxl-32x32": (2048, 1280),
    "pixart-1024": (8192, 1152),
    "flux-1024": (4608, 3072),
}
QUICK_LAYER_NORM = ("sd15-64x64", "pixart-1024")
# (rows, N, what) of the passes after cuBLAS's GEMM under the "cublas" placement (CFG batch 2): SD1.5's GEGLU at its
# 64x64 level, PixArt's GELU-tanh feed-forward, DiT-XL/2's gated residual over its [2, 256, N] stream with the next
# norm's row statistics, and Flux's clamped fp16 stream.
EPILOGUE_SHAPES = {
    "sd15-geglu-64x64": (8192, 1280, "geglu"),
    "pixart-gelu-tanh": (8192, 4608, "gelu_tanh"),
    "dit-gate-residual-stats": (512, 1152, "gate_residual_stats"),
    "flux-residual-saturate": (4608, 3072, "saturate"),
}
QUICK_EPILOGUE = ("sd15-geglu-64x64", "dit-gate-residual-stats")
# (N, C, H, W, what) of the passes after cuDNN's conv under the "cudnn" placement (CFG batch 2): a resnet's conv1 (temb,
# the next GroupNorm's statistics) and conv2 (shortcut, residual, output scale, channel sums), the VAE decoder's.
CONV_EPILOGUE_SHAPES = {
    "sd15-conv1-64x64x320": (2, 320, 64, 64, "conv1"),
    "sd15-conv2-32x32x640": (2, 640, 32, 32, "conv2"),
    "sdxl-conv1-128x128x320": (2, 320, 128, 128, "conv1"),
    "vae-conv1-512x512x128": (1, 128, 512, 512, "conv1"),
    # SVD's temporal conv over (video, channel, frame, pixel): per-frame temb and blend gate, residual; CFG batch 2
    "svd-temporal-14x4096x320": (2, 320, 14, 4096, "temporal"),
}
QUICK_CONV_EPILOGUE = ("sd15-conv1-64x64x320", "sd15-conv2-32x32x640", "svd-temporal-14x4096x320")
# (N, C head, C tail, pixels, frames) of the GroupNorm statistics an up block's two-part input takes from sums
FROM_SUMS_SHAPES = {
    "sd15-up-32x32-1280+640": (2, 1280, 640, 32 * 32, 1),
    "video-16f-64x64-320+320": (32, 320, 320, 4096, 16),
}
QUICK_FROM_SUMS = ("sd15-up-32x32-1280+640",)
#: (rows M, C, samples B, what) of the adaLN norms (CFG batch 2): DiT-XL/2's and PixArt's modulated norms, Flux's
#: with its residual sum, Wan's gated residual (bench_linear.py times the op at DiT's shape)
ADALN_SHAPES = {"dit-256": (512, 1152, 2, ""), "pixart-1024": (8192, 1152, 2, "residual"),
                "flux-1024": (9216, 3072, 2, "residual"), "wan-gated": (4096, 1536, 2, "gated")}  # fmt: skip
QUICK_ADALN = ("dit-256", "wan-gated")
