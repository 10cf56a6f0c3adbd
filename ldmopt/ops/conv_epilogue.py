"""The fused convolution's epilogue pass after a convolution PyTorch ran (the "cudnn" placement,
ops/gn_conv2d_prologue.py and gn_conv2d_cudnn.py).

``y = (residual + gate[n, oh] * (z + shortcut + temb)) / output_scale`` in place over the conv output z, and, from
the values as stored, the next GroupNorm's statistics, the per-channel sums a two-part GroupNorm finalises, or the
LayerNorm statistics of y's pixels. Internal: a step of the gn_conv2d op's triton backend (never traced by itself),
chosen like any op:

- cuda: ldmopt._C's ``conv_epilogue_cuda`` (csrc/conv_epilogue), one C++ op call for what Stable Diffusion's UNets
  and VAEs hand it (temb per image, shortcut, residual at the output's size, the scale, group statistics or channel
  sums) and the video models' temporal convs (temb and an fp32 gate per output row: per frame) on channels-last
  operands with their pixels at one stride, in one dtype; no zeroing launch, no atomics (deterministic). A
  transformer's proj_in that only hands its pixels' LayerNorm statistics to the first block's norm1 reads them
  through ``linear_epilogue_cuda`` (the output's pixels are its rows);
- triton: kernels/conv_epilogue.py's launch, everything (a resampled residual, a projection's LayerNorm statistics
  with more to add, any strides and dtypes).

Both compute in fp32 and round once, and take the statistics from the values as stored; they agree to rounding (the
statistics: Welford partials merged per chunk against the Triton pass's fp64 sums).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._dispatch import Backend, BackendTable, cuda_extension_refusals

#: what ldmopt._C's kernel takes (csrc/conv_epilogue)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the widest output whose statistics the CUDA finalisation holds (csrc/conv_epilogue/conv_epilogue.h kMaxChannels)
CUDA_MAX_STATS_CHANNELS = 8192


def _epilogue_triton(z, temb, gate, shortcut, residual, residual_resample, output_scale, out_groups, out_eps,
                     out_layer_norm, out_channel_sums):  # fmt: skip
    from ldmopt.kernels.conv_epilogue import conv_epilogue as launch

    return launch(z, temb, gate, shortcut, residual, residual_resample, output_scale, out_groups, out_eps,
                  out_layer_norm, out_channel_sums)  # fmt: skip


def _epilogue_cuda(z, temb, gate, shortcut, residual, residual_resample, output_scale, out_groups, out_eps,
                   out_layer_norm, out_channel_sums):  # fmt: skip
    if out_layer_norm:  # only the statistics of the pixels (cuda_refusals): rows of a channels-last z
        n, c = z.shape[:2]
        stats = z.new_empty((2, z.numel() // c), dtype=torch.float32)
        rows = z.permute(0, 2, 3, 1).reshape(-1, c)  # a view: z is contiguous channels-last
        torch.ops.ldmopt.linear_epilogue_cuda(rows, rows, None, None, stats, "", False, False, False, float(out_eps))
        return z, stats, z.new_empty((n, 0), dtype=torch.float32), z.new_empty((n, 0, 2), dtype=torch.float64)
    write = any(t is not None for t in (temb, gate, shortcut, residual)) or output_scale != 1.0
    mean, rstd, sums = torch.ops.ldmopt.conv_epilogue_cuda(
        z, shortcut, residual, temb, gate, 1.0 / float(output_scale), write, out_groups, out_channel_sums,
        float(out_eps),
    )  # fmt: skip
    return z, mean, rstd, sums


def pixels_at_one_stride(t: Tensor) -> bool:
    """Channels-last with pixel p = oh * OW + ow at p * (stride over W): what cuDNN writes (csrc/conv_epilogue's
    pixel_rows)."""
    _, c, oh, ow = t.shape
    return (c == 1 or t.stride(1) == 1) and (oh == 1 or ow == 1 or t.stride(2) == ow * t.stride(3))


def cuda_refusals(z, temb, gate, shortcut, residual, residual_resample, output_scale, out_groups, out_eps,
                  out_layer_norm, out_channel_sums) -> list[str]:  # fmt: skip
    """What csrc/conv_epilogue refuses (its TORCH_CHECKs stay as the last guard)."""
    if out_layer_norm:
        return _row_statistics_refusals(z, temb, gate, shortcut, residual, output_scale)
    reasons = cuda_extension_refusals("conv_epilogue_cuda", z, temb, gate, shortcut, residual)
    if reasons:
        return reasons
    if z.dtype not in CUDA_DTYPES:
        reasons.append(f"z dtype {z.dtype} (the CUDA kernel serves fp32/fp16/bf16)")
    for name, t in (("temb", temb), ("shortcut", shortcut), ("residual", residual)):
        if t is not None and t.dtype != z.dtype:
            reasons.append(f"{name} dtype {t.dtype} differs from the conv output's {z.dtype}")
    for name, t in (("z", z), ("shortcut", shortcut), ("residual", residual)):
        if t is not None and t.shape != z.shape:
            reasons.append(f"{name} of shape {tuple(t.shape)}, not the output's {tuple(z.shape)}")
        elif t is not None and not pixels_at_one_stride(t):
            reasons.append(f"{name} strides {t.stride()}: the CUDA kernel reads channels-last pixels at one stride")
    n, c, oh = z.shape[:3]
    if temb is not None and tuple(temb.shape) not in ((n, c), (n, c, oh)):
        reasons.append(f"temb of shape {tuple(temb.shape)}, not [N, C] = {[n, c]} or [N, C, OH] = {[n, c, oh]}")
    elif temb is not None and c > 1 and temb.stride(1) != 1:
        reasons.append(f"temb strides {temb.stride()}: the CUDA kernel reads unit channel stride")
    if gate is not None and (gate.dim() != 2 or gate.shape[0] != n or gate.shape[1] not in (1, oh)):
        reasons.append(f"gate of shape {tuple(gate.shape)}, not [N, 1] or [N, OH] = {[n, oh]}")
    elif gate is not None and gate.dtype != torch.float32:
        reasons.append(f"gate dtype {gate.dtype} (the CUDA kernel reads an fp32 gate)")
    per_row = gate is not None or (temb is not None and temb.dim() == 3)
    pixels = oh * z.shape[3]
    if per_row and pixels > 2**31 - 1:
        reasons.append(f"a per-row temb or gate over {pixels} pixels per image (the CUDA kernel's row index is 32-bit)")
    if residual_resample != "none":
        reasons.append(f"a residual read through resample={residual_resample!r} (the Triton pass resamples it)")
    if (out_groups or out_channel_sums) and z.shape[1] > CUDA_MAX_STATS_CHANNELS:
        reasons.append(f"statistics of {z.shape[1]} channels (the CUDA finalisation holds {CUDA_MAX_STATS_CHANNELS})")
    if not math.isfinite(1.0 / float(output_scale)):
        reasons.append(f"output_scale={output_scale}")
    return reasons


def _row_statistics_refusals(z, temb, gate, shortcut, residual, output_scale) -> list[str]:
    """The LayerNorm statistics of the output's pixels through linear_epilogue_cuda: only those (nothing to add or
    scale: a proj_in's), of a contiguous channels-last fp32/fp16/bf16 z."""
    reasons = cuda_extension_refusals("linear_epilogue_cuda", z, temb, gate, shortcut, residual)
    if reasons:
        return reasons
    if any(t is not None for t in (temb, gate, shortcut, residual)) or output_scale != 1.0:
        reasons.append("LayerNorm statistics of an output with more to add or scale: the Triton pass does both")
    if z.dtype not in CUDA_DTYPES:
        reasons.append(f"z dtype {z.dtype} (the CUDA kernel serves fp32/fp16/bf16)")
    if not z.is_contiguous(memory_format=torch.channels_last):
        reasons.append(f"z strides {z.stride()}: its pixels' statistics read a contiguous channels-last z as rows")
    return reasons


EPILOGUE = BackendTable(
    "conv_epilogue",
    [Backend("cuda", _epilogue_cuda, cuda_refusals), Backend("triton", _epilogue_triton)],
)


def conv_epilogue(z: Tensor, temb: Tensor | None, gate: Tensor | None, shortcut: Tensor | None,
                  residual: Tensor | None, residual_resample: str, output_scale: float, out_groups: int,
                  out_eps: float, out_layer_norm: bool = False,
                  out_channel_sums: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(y, out_mean, out_rstd, channel_sums) as kernels/conv_epilogue.conv_epilogue returns them (which this
    dispatches to or stands in for): y is z, written in place when there is anything to add or scale."""
    return EPILOGUE(z, temb, gate, shortcut, residual, residual_resample, output_scale, out_groups, out_eps,
                    out_layer_norm, out_channel_sums)  # fmt: skip
