"""Implicit-GEMM 2-D convolution whose loader applies GroupNorm + activation, with a fused epilogue.

Computes ``y = (residual + gate[n, oh] * (conv(act(gn(x)), W) + bias + temb[n, oh] + shortcut)) / output_scale``
(temb and gate per image or per output row) and, optionally, the per-(n, group) statistics of y for the next
GroupNorm. x is NHWC (channels-last; any strides are accepted, channel stride 1 is the fast path), fp32/fp16/bf16;
accumulation, GroupNorm math and statistics in fp32 (statistics sums in fp64). Kernels 1x1, 3x3 and 3x1 (a temporal
conv over a (video, channel, frame, pixel) view), stride 1 or 2, zero padding applied after the activation; nearest
2x upsampling or 2x2 average pooling of the conv input is index arithmetic in the loader; an optional 1x1 "shortcut"
conv of a second input accumulates into the same tile. Either input may come in two channel parts (a UNet up block's
``cat([hidden, skip], 1)``): each channel block lies in one part and is loaded from where that part lies, so the
concatenation is never written.
Algorithm: one program per (image, BM output pixels, BN output channels); ONE flat loop over kh*kw*channel-blocks
stages an [BM, BK] input tile (normalised with per-(n, c) scale/shift [BK] vectors) and a [BK, BN] weight tile into
tl.dot. Output statistics: per-column centred sums of the tile are added in fp64 to a per-(n, c) workspace; the last
program of each image (atomic counter) folds them into per-group mean/rstd. The workspace is a fresh zeroed buffer
per call, so nothing outlives a launch (CUDA graphs, concurrent streams); autotuning zeroes it again before each of its
benchmark launches and before the launch that follows them (reset_to_zero).
fp32 operands: TF32 or IEEE products as PyTorch's convolution (default) or, for a Linear read as a 1x1 conv, its
matmul would compute them (``fp32_precision``, _common.FP32_PRECISIONS).
The @triton.jit kernels are in _gn_conv2d_kernels.py; this module holds the tiles, the autotuner and the launcher.
"""

from __future__ import annotations

import torch
import triton

from ldmopt._env import interpreter_enabled

from . import _gn_conv2d_kernels
from ._common import (
    ACTIVATIONS,
    LAUNCH_OPTIONS,
    autotune,
    cdiv,
    config_tag,
    fp32_dot_precision,
    new_output,
    next_power_of_2,
    prune_by_operand_width,
    tag_config,
    tag_fp32_configs,
)
from ._gemm import row_stats_workspace

# The epilogue's pieces, which kernels/conv_epilogue.py's pass after a cuDNN conv imports from here
from ._gn_conv2d_kernels import _idx, channel_statistics, epilogue_adds  # noqa: F401
from ._tuned_launch import tuned_launch

#: resample codes shared with ldmopt/ops/gn_conv2d.py
RESAMPLE = {"none": 0, "up": 1, "down": 2}
#: offset reach (an operand's largest index x stride sum; per image for the activations, whose batch offsets are
#: always int64) from which every offset is computed in int64: IDX64, see int64_index
INT64_INDEX_FROM = 2**31 - 1


#: Tiles for fp32 operands, each with the (dot precision, arch) pairs where it compiles without spills (ptxas): the
#: 16-bit tiles spill 8-168 bytes per thread with IEEE products (CUDA cores), and no tile is clean everywhere.
CONV_TILES_FP32 = (
    (64, 128, 32, 8, 3, {("ieee", 80), ("ieee", 90), ("tf32", 90)}),
    (128, 64, 32, 8, 3, {("ieee", 80), ("tf32", 80), ("tf32", 90)}),
    (64, 64, 32, 8, 3, {("ieee", 80), ("tf32", 80), ("tf32", 90)}),
)


#: 16-bit tiles (BM, BN, BK, warps, stages) for a conv with the GroupNorm prologue in its loader (NORMALIZE): the
#: normalised A tile passes through registers, so the k-step stays at 32 (64 only for the 64x64 tile) to keep them
#: within 255 with the heaviest epilogues.
CONV_TILES_LOADER = ((128, 128, 32, 8, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (64, 64, 64, 4, 3))
#: 16-bit tiles for a loader under a 2x2 average (RESAMPLE "down", a downsampling resnet's conv1): four normalised
#: taps per A element. Every CONV_TILES_LOADER tile spilled 8-24 bytes on sm_90 with its temb + statistics epilogue
#: (ptxas: Triton 3.8 the 128x64 tile, Triton 3.9 all four); these hold at most 187 registers there, 8 warps sharing
#: the larger tiles' taps.
CONV_TILES_LOADER_DOWN = ((128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 3))
#: 16-bit tiles for a plain conv (statistics staged before it, upsamplers, downsamplers): A goes from shared memory
#: straight into the MMA, and BK=64 halves the loop's overhead per MMA. sm_90 SASS per warp and k-step, 128x128 with
#: temb + statistics: 180 instructions for 4 wgmma at BK=64 against 121 for 2 at BK=32 (8 warps on 4 schedulers: 360
#: issue cycles for 512 tensor-core cycles, against 242 for 256); sm_80: 277 for 64 mma.sync against 171 for 32.
CONV_TILES_PLAIN = ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3))


def _configs() -> list[triton.Config]:
    if interpreter_enabled():
        # The interpreter's cost is per program and per numpy op: one large tile.
        return [triton.Config({"BM": 64, "BN": 128, "BK": 64}, num_warps=4, num_stages=1)]
    tiles = []
    families = (("loader", CONV_TILES_LOADER), ("loader_down", CONV_TILES_LOADER_DOWN), ("plain", CONV_TILES_PLAIN))
    for tile in dict.fromkeys(CONV_TILES_LOADER + CONV_TILES_LOADER_DOWN + CONV_TILES_PLAIN):  # in order, each once
        bm, bn, bk, w, s = tile
        config = triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        tiles.append(tag_config(config, prologues=frozenset(name for name, family in families if tile in family)))
    fp32 = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bm, bn, bk, w, s, _ in
            CONV_TILES_FP32]  # fmt: skip
    return tiles + tag_fp32_configs(fp32, [tile[5] for tile in CONV_TILES_FP32])


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The tiles for the operands' width (_common.prune_by_operand_width); of the 16-bit ones, those for a loader
    with (NORMALIZE; under a 2x2 average its own) or without the GroupNorm prologue."""
    configs = prune_by_operand_width(configs, named_args["x_ptr"], kwargs.get("DOT_PRECISION", "tf32"))
    family = "plain"
    if kwargs.get("NORMALIZE", True):
        family = "loader_down" if kwargs.get("RESAMPLE", 0) == RESAMPLE["down"] else "loader"
    return [c for c in configs if family in config_tag(c, "prologues", (family,))] or configs


# The statistics workspace and arrival counters accumulate across a launch's programs and must be zero when it starts:
# the autotuner zeroes them before each benchmark launch and before the launch after tuning (the launcher's fresh
# buffers cover launches with a tuned key). So they are never the input: without statistics they are empty tensors.
_gn_conv2d_fwd_kernel = autotune(
    configs=_configs(),
    key=["KEY_S", "KEY_CIN", "KEY_COUT", "KH", "KW", "STRIDE", "RESAMPLE", "HAS_SC", "NORMALIZE", "OUT_STATS",
         "OUT_ROW_STATS", "HAS_TEMB", "HAS_RES", "HAS_GATE", "IDX64", "X_TWO_PART", "SC_TWO_PART", "DOT_PRECISION"],
    reset_to_zero=["ws_ptr", "counter_ptr"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_gn_conv2d_kernels._gn_conv2d_fwd_kernel)  # fmt: skip


def _reach(t: torch.Tensor, first_dim: int = 0) -> int:
    """The largest offset of t's elements from its first one, counting dims from ``first_dim``."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape[first_dim:], t.stride()[first_dim:]))


def int64_index(images, others) -> bool:
    """IDX64: whether some offset the kernel forms reaches INT64_INDEX_FROM: within one image of ``images`` (per
    image: their batch offsets are int64 always), or anywhere in ``others`` (weights, temb, gate). A large image, or a
    view with a large stride (e.g. an NCHW residual of C x H x W >= 2^31 elements, whose channel stride is H x W).
    Offsets are int32 otherwise, exact there and lighter on registers."""
    reach = [_reach(t, 1) for t in images if t is not None] + [_reach(t) for t in others if t is not None]
    return max(reach) >= INT64_INDEX_FROM


#: The smallest row tile of any config: the row statistics' counters are allocated for it.
_MIN_BM = min(config.kwargs["BM"] for config in _gn_conv2d_fwd_kernel.configs)


def _stats_workspace(device: torch.device, n: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ws [N*C*2] fp64, counters [N] int32), zeroed: one fresh buffer per call (one memset), so no state outlives
    the call — concurrent streams, CUDA graphs and torch.compile see an ordinary allocation."""
    buffer = torch.zeros(n * c * 2 + (n + 1) // 2, device=device, dtype=torch.float64)
    return buffer[: n * c * 2], buffer[n * c * 2 :].view(torch.int32)[:n]


def output_statistics_buffers(
    device: torch.device,
    n: int,
    c: int,
    s: int,
    out_groups: int,
    out_layer_norm: bool,
    out_channel_sums: bool,
    min_bm: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(out_mean, out_rstd, ws, counters, STATS_BLOCK_G, STATS_BLOCK_CPG) for an epilogue over an [N, C, S-pixel]
    output that sums per-group statistics and/or channel sums (channel_statistics) or LayerNorm row statistics
    (_gemm.row_statistics, one counter per row tile of ``min_bm`` pixels): the fused conv's and the pass after a
    cuDNN conv's (kernels/conv_epilogue.py)."""
    if out_layer_norm and out_groups:
        raise ValueError(f"out_layer_norm with out_groups={out_groups}: one kind of output statistics per call")
    out_mean = new_output((2, n * s) if out_layer_norm else (n, out_groups), device=device, dtype=torch.float32)
    out_rstd = new_output((n, out_groups), device=device, dtype=torch.float32)
    if out_layer_norm:
        ws, counters = row_stats_workspace(device, n * s, n * cdiv(s, min_bm))
        return out_mean, out_rstd, ws, counters, 1, 1
    if out_groups or out_channel_sums:
        ws, counters = _stats_workspace(device, n, c)
        # At least 64 channels per group tile: the finalisation is a few KB per image, and one tile shape for every
        # group size up to 64 means one compiled variant (times the autotune configs) instead of one per size.
        # (Sums alone, out_groups=0, finalise nothing: the same variant as 64 or fewer channels per group.)
        block_cpg = max(64, next_power_of_2(c // out_groups)) if out_groups else 64
        block_g = max(1, min(next_power_of_2(max(out_groups, 1)), 1024 // block_cpg))
        return out_mean, out_rstd, ws, counters, block_g, block_cpg
    # Empty, so the autotuner's reset_to_zero has nothing to clear (never the input), and nothing to read.
    return out_mean, out_rstd, out_mean, out_rstd, 1, 1


def channel_sums_output(ws: torch.Tensor, n: int, c: int, out_channel_sums: bool) -> torch.Tensor:
    """The [N, C, 2] fp64 channel sums the workspace holds when they were asked for, else an empty [N, 0, 2]."""
    if out_channel_sums:
        return ws.view(n, c, 2)
    return torch.empty((n, 0, 2), device=ws.device, dtype=torch.float64)


def nhwc_strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """An [N, C, H, W] tensor's strides in (n, h, w, c) order, the kernels' argument order; zeros for None."""
    return (t.stride(0), t.stride(2), t.stride(3), t.stride(1)) if t is not None else (0, 0, 0, 0)


def temb_gate_strides(temb: torch.Tensor | None, gate: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """(stn, stc, sth, sgn, sgh) of an epilogue's temb ([N, C] or per row [N, C, OH]) and gate ([N, 1] or [N, OH]):
    0 along what they broadcast over, and for an absent one."""
    stn, stc = temb.stride()[:2] if temb is not None else (0, 0)
    sth = temb.stride(2) if temb is not None and temb.dim() == 3 else 0
    sgn, sgh = (gate.stride(0), gate.stride(1) if gate.shape[1] > 1 else 0) if gate is not None else (0, 0)
    return stn, stc, sth, sgn, sgh


def _resampled_size(h: int, w: int, resample: str) -> tuple[int, int]:
    if resample == "up":
        return 2 * h, 2 * w
    if resample == "down":
        return h // 2, w // 2
    return h, w


def conv_output_size(h: int, w: int, kernel: tuple[int, int], stride: int, padding: tuple[int, int], resample: str):
    """(OH, OW) of the conv applied to x (H, W) after ``resample``."""
    hc, wc = _resampled_size(h, w, resample)
    return (hc + 2 * padding[0] - kernel[0]) // stride + 1, (wc + 2 * padding[1] - kernel[1]) // stride + 1


def gn_conv2d_fwd(
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temb: torch.Tensor | None,
    residual: torch.Tensor | None,
    shortcut_x: torch.Tensor | None,
    shortcut_weight: torch.Tensor | None,
    shortcut_bias: torch.Tensor | None,
    gate: torch.Tensor | None,
    num_groups: int,
    activation: str | None,
    stride: int,
    padding: tuple[int, int],
    resample: str,
    residual_resample: str,
    shortcut_resample: str,
    output_scale: float,
    out_groups: int,
    out_eps: float,
    x_tail: torch.Tensor | None = None,
    shortcut_x_tail: torch.Tensor | None = None,
    fp32_precision: str = "conv",
    out_layer_norm: bool = False,
    out_channel_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: (y [N, C_out, OH, OW] channels-last, out_mean [N, out_groups] fp32, out_rstd, channel_sums).

    ``mean is None`` skips the normalisation prologue (plain conv). out_groups=0: no statistics (empty tensors).
    ``out_layer_norm`` (with out_groups=0): out_mean is instead the LayerNorm statistics ``[2, N * OH * OW]`` (means,
    then rstds for ``out_eps``) of y's pixels over their C_out channels, and out_rstd is empty.
    ``out_channel_sums``: channel_sums is the statistics workspace, [N, C_out, 2] fp64 sums of y and of y squared
    per (image, channel), from which any grouping of y's channels (with another tensor's, cat([y, skip], 1) in a UNet
    up block) can be finalised (kernels/group_norm_sums.py); out_groups may then be 0. Otherwise it is empty.
    temb: [N, C_out] or [N, C_out, OH]; gate: [N, 1] or [N, OH] fp32. ``x_tail`` / ``shortcut_x_tail``: the input is
    ``cat([x, x_tail], 1)`` (likewise the shortcut's), read where the parts lie. ``fp32_precision``: whose TF32 setting
    fp32 products follow, PyTorch's "conv" or "matmul" (_common.torch_fp32_precision).
    """
    dot_precision = fp32_dot_precision(x.dtype, fp32_precision)  # first: it validates fp32_precision
    n, c_head, h, w = x.shape
    c_in = c_head + (x_tail.shape[1] if x_tail is not None else 0)
    c_out, _, kh, kw = weight.shape
    # Per-channel vectors and statistics are read with unit stride.
    mean, rstd, gamma, beta, bias, shortcut_bias = (
        None if t is None else t.contiguous() for t in (mean, rstd, gamma, beta, bias, shortcut_bias)
    )
    oh, ow = conv_output_size(h, w, (kh, kw), stride, padding, resample)
    y = new_output((n, c_out, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    s = oh * ow
    out_mean, out_rstd, ws, counters, block_g, block_cpg = output_statistics_buffers(
        x.device, n, c_out, s, out_groups, out_layer_norm, out_channel_sums, _MIN_BM
    )
    normalize = mean is not None
    temb_rows = temb is not None and temb.dim() == 3
    dummy = x
    res_h, res_w = residual.shape[2:] if residual is not None else (1, 1)
    sc_h, sc_w = shortcut_x.shape[2:] if shortcut_x is not None else (1, 1)
    c_sc_head = shortcut_x.shape[1] if shortcut_x is not None else 1
    c_sc = c_sc_head + (shortcut_x_tail.shape[1] if shortcut_x_tail is not None else 0)
    grid = lambda meta: (n * cdiv(s, meta["BM"]) * cdiv(c_out, meta["BN"]),)
    tuned_launch(_gn_conv2d_fwd_kernel)[grid](
        y, ws, counters, out_mean, out_rstd, x, x_tail if x_tail is not None else dummy,
        mean if normalize else dummy, rstd if normalize else dummy,
        gamma if gamma is not None else dummy, beta if beta is not None else dummy,
        weight, bias if bias is not None else dummy, temb if temb is not None else dummy,
        residual if residual is not None else dummy,
        shortcut_x if shortcut_x is not None else dummy,
        shortcut_x_tail if shortcut_x_tail is not None else dummy,
        shortcut_weight if shortcut_weight is not None else dummy,
        shortcut_bias if shortcut_bias is not None else dummy,
        gate if gate is not None else dummy,
        *nhwc_strides(x), *nhwc_strides(x_tail), *weight.stride(), *nhwc_strides(y), *temb_gate_strides(temb, gate),
        *nhwc_strides(residual), *nhwc_strides(shortcut_x), *nhwc_strides(shortcut_x_tail),
        *(shortcut_weight.stride()[:2] if shortcut_weight is not None else (0, 0)),
        h, w, c_in, oh, ow, c_out, num_groups if normalize else 1, res_h, res_w, sc_h, sc_w, c_sc,
        out_groups if out_channel_sums else max(out_groups, 1), c_head, c_sc_head, float(out_eps),
        1.0 / float(output_scale),
        min(next_power_of_2(s), 1 << 16), next_power_of_2(c_in), next_power_of_2(c_out),
        KH=kh, KW=kw, STRIDE=stride, PAD_H=padding[0], PAD_W=padding[1], RESAMPLE=RESAMPLE[resample],
        NORMALIZE=normalize,
        ACTIVATION=ACTIVATIONS[activation][0], HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None,
        HAS_BIAS=bias is not None, HAS_TEMB=temb is not None, TEMB_ROWS=temb_rows, HAS_GATE=gate is not None,
        HAS_RES=residual is not None,
        RES_RESAMPLE=RESAMPLE[residual_resample], HAS_SC=shortcut_x is not None,
        SC_RESAMPLE=RESAMPLE[shortcut_resample], HAS_BIAS2=shortcut_bias is not None,
        OUT_STATS=out_groups > 0 or out_channel_sums,
        STATS_BLOCK_G=block_g, STATS_BLOCK_CPG=block_cpg, OUT_ROW_STATS=out_layer_norm, DOT_PRECISION=dot_precision,
        IDX64=int64_index((x, x_tail, y, residual, shortcut_x, shortcut_x_tail), (weight, shortcut_weight, temb, gate)),
        X_TWO_PART=x_tail is not None, SC_TWO_PART=shortcut_x_tail is not None,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, out_mean, out_rstd, channel_sums_output(ws, n, c_out, out_channel_sums)


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate (kept in _gn_conv2d_specs.py with their rationale)."""
    from ._gn_conv2d_specs import conv_aot_specs

    return conv_aot_specs()
