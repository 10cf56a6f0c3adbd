"""Where the fused convolution applies its GroupNorm + activation: in the conv's loader, or in a staged pass.

"loader": the conv's input loads normalise each [BM, BK] tile in registers before the MMA; the activation is never
written. Every input element is then normalised once per time the conv reads it: R = KH x KW taps x ceil(C_out / BN)
output-channel tiles (x4 under a nearest 2x upsample, / stride^2), and the prologue's instructions sit in the main
loop. "staged": one elementwise pass (group_norm_apply.py: ldmopt._C's where built, else Triton's; the statistics
already known) writes act(group_norm(x)) in x's dtype, and the conv reads it as a plain conv (A tiles straight from
shared memory into the MMA, no register round trip): one extra write and read of the activation, whatever R is.

Why staging from R >= 3 (read from the compiled code: a projection until measured on a GPU). Per warp and k-step, the
SASS of the loader tile (128x128x32, 8 warps, temb + statistics epilogue) issues 507 instructions for 2 m64n128k16
wgmma per warpgroup on sm_90 (~256 tensor-core cycles per SM) and 496 for 32 mma.sync on sm_80 (~512 cycles on an
A100); with 8 warps on 4 schedulers that loop is issue-bound at about 4x (sm_90) and 2x (sm_80) its MMA time. The plain
tile a staged conv runs (128x128x64) issues 180 for 4 wgmma (sm_90; 277 for 64 mma.sync on sm_80): MMA-bound. One
in-loader normalisation of an element costs ~(507 - 121) x 8 warps / 4096 elements ~ 0.74 warp-instructions, ~0.7 ps on
an H200 (4 issues per cycle, 132 SMs, ~1.9 GHz) and ~1 ps on an A100; staging costs 4 bytes of traffic per element (8
for fp32), ~0.9 ps at an H200's ~4.25 TB/s copy bandwidth and ~2 ps on an A100. So staging pays from about 1.3 (H200)
to 2 (A100) normalisations per element, 3 leaving a margin for the estimate's error; a stride-1 3x3 conv has R >= 9, a
1x1 conv to at most 256 channels R <= 2. Without an activation (GroupNorm before a projection, as the temporal
transformers' proj_in) the loader issues 317 instead of 507, ~0.4 ps per normalisation, which the threshold of 3 still
covers.
"cudnn": staged as above, but the conv is PyTorch's (cuDNN on GPUs) and what the fused conv's epilogue does (temb, gate,
shortcut and residual adds, the output scale, the next norm's statistics or channel sums) runs as one pass after it
(ops/conv_epilogue.py: ldmopt._C's kernel where it is built, else kernels/conv_epilogue.py's), in place; with only
statistics to take, that pass only reads. Why it is auto's choice on GPUs wherever the loader is not: the measured
Triton implicit-GEMM conv ran slower than cuDNN at Stable Diffusion shapes (benchmarks/RESULTS.md, H200, 2026-12-04: a
patched SD1.5 step 0.37x stock as a CUDA graph, the VAE's upsampler conv 0.83x cuDNN), so the conv stays cuDNN's and
ldmopt fuses what surrounds it. It costs one launch and one read and write of the output more than "staged" (none more
with nothing to add); the plain convs (upsamplers, downsamplers) take it too, and a Linear read as a 1x1 conv where the
GEMMs are cuBLAS's (see choose_placement).
``LDMOPT_GN_CONV_PROLOGUE`` = auto (default) | loader | staged | cudnn overrides the choice ("loader" and "staged"
also put plain convs in the Triton kernel); benchmarks time them. On CPU tensors (the Triton interpreter, tests)
auto keeps the Triton kernel, whose code the tests cover; they force the others to cover them.
"""

from __future__ import annotations

import torch

from ._placement import PlacementSwitch

ENV = "LDMOPT_GN_CONV_PROLOGUE"
PLACEMENTS = ("auto", "loader", "staged", "cudnn")
#: normalisations per input element from which auto stages (see the module docstring)
STAGE_FROM_RECOMPUTE = 3
#: the widest output-channel tile the conv's autotuner picks from (kernels/gn_conv2d.py): R is counted with it, so
#: the estimate is the fewest normalisations any tile makes
WIDEST_BN = 128
_SWITCH = PlacementSwitch(ENV, PLACEMENTS)
#: placement -> number of fused-conv calls on the Triton backend that used it in this process (normalising ones, and
#: plain ones that "cudnn" took)
placement_counts = _SWITCH.counts
#: The placement ``LDMOPT_GN_CONV_PROLOGUE`` asks for ("auto" when unset), read at each call.
requested_placement = _SWITCH.requested
#: Within the block, fused convs use the given placement (one of PLACEMENTS), for benchmarks and checks.
forced = _SWITCH.forced


def recompute_factor(kernel: tuple[int, int], c_out: int, stride: int, resample: str) -> float:
    """How many times the loader normalises each input element: once per tap that reads it and per output-channel
    tile, times 4 under a nearest 2x upsample (each input pixel feeds four conv inputs), over stride^2."""
    taps = kernel[0] * kernel[1] * (4 if resample == "up" else 1) / (stride * stride)
    return taps * -(-c_out // WIDEST_BN)


def choose_placement(
    device: torch.device,
    kernel: tuple[int, int],
    c_out: int,
    stride: int,
    resample: str,
    normalize: bool = True,
    linear: bool = False,
) -> str:
    """ "loader", "staged" or "cudnn" for a conv on ``device``, normalising its input or not (see the module
    docstring; for a plain conv "loader" and "staged" both mean the Triton kernel). ``linear``: a Linear read as a 1x1
    conv (fp32_precision "matmul"). One that normalises nothing follows the fused GEMM it stands in for
    (nn/proj_out.py switches between the two and must not change its result): where that GEMM is cuBLAS's with an
    epilogue pass (ops/linear_cublas.py, auto's choice on GPUs), "cudnn" runs the same GEMM (F.linear over the
    channels-last rows) and rounds its product before the residual's add as that pass does; where it is the Triton
    GEMM, the Triton kernel rounds once after the add as that GEMM does."""
    requested = requested_placement()
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "loader"
    if linear and not normalize:
        from .linear_cublas import gemm_placement  # (it imports the conv ops' modules' neighbours: imported late)

        return "cudnn" if gemm_placement(device) == "cublas" else "loader"
    if normalize and recompute_factor(kernel, c_out, stride, resample) < STAGE_FROM_RECOMPUTE:
        return "loader"
    return "cudnn"
