"""GroupNorm + activation fused into a 2-D convolution's input loads, with a fused epilogue.

``y = (conv2d(resample(act(group_norm(x))), W) + b + temb[n] + conv1x1(resample(x_sc), W_sc) + b_sc
+ resample(residual)) / output_scale``, and optionally the per-(n, group) mean/rstd of y for the next GroupNorm.

Custom ops: ``ldmopt::gn_conv2d`` (the fused conv, with autograd) and, in gn_conv2d_stats.py,
``ldmopt::gn_conv2d_stats`` (GroupNorm statistics of an input, two launches).
Backends: triton (kernels/gn_conv2d.py) and torch, the reference: the unfused composition in fp32 math (fp64 for fp64
inputs). The triton backend applies GroupNorm + activation in the conv's loader or, where the conv would normalise each
input element several times over, in one staged pass before a plain conv; on GPUs that conv, and any conv without a
norm but a Linear's, is PyTorch's (cuDNN) followed by the epilogue as a Triton pass (gn_conv2d_cudnn.py).
gn_conv2d_prologue.py chooses per call; ``LDMOPT_GN_CONV_PROLOGUE`` overrides. Backward (gn_conv2d_backward.py)
recomputes ``act(group_norm(x))`` from the saved input and statistics (group_norm_apply.py: one fused pass where
Triton runs) and uses PyTorch's convolution backward, so no activation beyond the op's inputs is kept alive.
``fp32_precision="matmul"`` (a Linear read as a 1x1 conv): fp32 products follow PyTorch's matmul precision instead of
its convolution's, in the kernel, and the reference and backward run nn.Linear's GEMMs.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor

from ._autocast import autocast_enabled, autocast_operands
from ._checks import check_activation, check_eps, check_same_device, check_tensor, check_vector
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    fallback_reasons,  # noqa: F401  (every op's fall-back record, also read as ldmopt.ops.gn_conv2d.fallback_reasons)
    statistics_source,
    triton_refusals,
)
from .gn_conv2d_prologue import choose_placement, placement_counts
from .gn_conv2d_reference import _channels_last_like, _fwd_torch, channel_sums_torch, pixel_rows
from .gn_conv2d_reference import resample_input as resample_input
from .gn_conv2d_stats import _TRITON_DTYPES, _check_tail, _stats_dtype, gn_conv2d_stats
from .gn_conv2d_stats import same_but_channels as same_but_channels
from .group_norm_apply import staged_apply
from .layer_norm_linear import layer_norm_stats_op

SUPPORTED_ACTIVATIONS = (None, "silu")
RESAMPLES = ("none", "up", "down")
#: whose fp32 precision (TF32 or IEEE) the products follow: PyTorch's convolution or its matmul (as
#: kernels/_common.FP32_PRECISIONS, which ldmopt.ops does not import: it imports Triton)
FP32_PRECISIONS = ("conv", "matmul")


#: How often the triton backend copied a conv weight into channels-last before its kernel, by weight shape (read by
#: PatchReport.layout_copies): the kernel's weight tiles run along the input channels, and from a contiguous
#: [C_out, C_in, KH, KW] weight each element would be its own 2-byte load (ldmopt/patch/weight_layout.py has what
#: that does to the main loop); a copy per call, as cuDNN makes for a channels-last input, costs far less.
#: ``ldmopt.patch`` converts a model's conv weights once, so an inference patch makes none.
layout_conversions: Counter[str] = Counter()


def _is_channels_last(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


def _unit_channel_stride(w: Tensor) -> bool:
    """Whether the kernel reads ``w``'s input channels in vectors (unit stride, or a single channel)."""
    return w.stride(1) == 1 or w.shape[1] == 1


def _autocast_weight_channels_last(x: Tensor, w: Tensor) -> Tensor:
    """Under torch.autocast, a weight autocast_operands would cast and the triton backend would then copy to
    channels-last (_weight_for_kernel), cast into channels-last at once; ``w`` itself otherwise."""
    device = x.device.type
    if _unit_channel_stride(w) or not autocast_enabled(device):
        return w
    dtype = torch.get_autocast_dtype(device)
    if not w.is_floating_point() or w.dtype in (dtype, torch.float64):
        return w
    return w.to(dtype, memory_format=torch.channels_last)


def _weight_for_kernel(w: Tensor) -> Tensor:
    """``w`` with unit input-channel stride (channels-last), copied (and counted) when it has another layout."""
    if _unit_channel_stride(w):
        return w
    layout_conversions[f"conv weight {list(w.shape)} copied to channels-last (the model's is not)"] += 1
    return w.contiguous(memory_format=torch.channels_last)


def conv_output_size(h: int, w: int, kernel, stride: int, padding, resample: str) -> tuple[int, int]:
    """(OH, OW) of a ``kernel`` (int or (kh, kw)) conv with ``padding`` (int or (ph, pw)) applied to an (h, w) input
    after ``resample``."""
    (kh, kw), (ph, pw) = _pair(kernel), _pair(padding)
    hc, wc = {"up": (2 * h, 2 * w), "down": (h // 2, w // 2)}.get(resample, (h, w))
    return (hc + 2 * ph - kh) // stride + 1, (wc + 2 * pw - kw) // stride + 1


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _check_fp32_precision(value: str, weight: Tensor, stride: int, padding, resample: str) -> None:
    """fp32_precision is one of FP32_PRECISIONS; "matmul" (GEMMs in the reference and backward) only for a pointwise
    conv: what a Linear read as a 1x1 conv is."""
    check_activation("fp32_precision", value, FP32_PRECISIONS)  # the generic one-of-these check, despite its name
    kernel = tuple(weight.shape[2:])
    if value == "matmul" and (kernel != (1, 1) or stride != 1 or tuple(padding) != (0, 0) or resample != "none"):
        raise ValueError(
            "fp32_precision='matmul' is for a Linear read as a 1x1 conv (kernel 1x1, stride 1, padding 0, resample "
            f"'none'); got kernel {kernel}, stride {stride}, padding {tuple(padding)}, resample {resample!r}"
        )


# ------------------------------------------------------------------------------------------------ fused conv op


def _triton_refuse(x, mean, rstd, gw, gb, w, b, temb, res, sx, sw, sb, gate, groups, act, stride, padding,
                   resample, res_resample, sc_resample, output_scale, out_groups, out_eps, x_tail=None,
                   sx_tail=None, fp32_precision="conv", out_layer_norm=False,
                   out_channel_sums=False) -> list[str]:  # fmt: skip
    reasons = triton_refusals(x, w, sx, x_tail, sx_tail, dtypes=_TRITON_DTYPES, matmul=True)
    for name, t in (("x", x), ("x_tail", x_tail)):
        if t is not None and not _is_channels_last(t):
            reasons.append(f"{name} (strides {t.stride()}) is not channels-last; the loader reads NHWC channel vectors")
    kh, kw = w.shape[2:]
    if (kh, kw) not in ((1, 1), (3, 3), (3, 1)):
        reasons.append(f"kernel {kh}x{kw}: the triton kernel serves 1x1, 3x3 and 3x1 (temporal)")
    if stride not in (1, 2) or padding[0] > kh // 2 or padding[1] > kw // 2:
        reasons.append(
            f"stride={stride}, padding={tuple(padding)} with a {kh}x{kw} kernel (served: stride 1/2, padding<=k//2)"
        )
    if resample != "none" and stride != 1:
        reasons.append(f"resample={resample!r} with stride {stride} (resampling is served with stride 1)")
    for name, t in (
        ("weight", w),
        ("shortcut_x", sx),
        ("shortcut_weight", sw),
        ("x_tail", x_tail),
        ("shortcut_x_tail", sx_tail),
    ):
        if t is not None and t.dtype != x.dtype:
            reasons.append(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
    if mean is not None and (mean.dtype != torch.float32 or rstd.dtype != torch.float32):
        reasons.append(f"statistics dtype {mean.dtype} (the kernel reads fp32 mean/rstd)")
    return reasons


def _fwd_triton(x, mean, rstd, gw, gb, w, b, temb, res, sx, sw, sb, gate, groups, act, stride, padding, resample,
                res_resample, sc_resample, output_scale, out_groups, out_eps, x_tail=None, sx_tail=None,
                fp32_precision="conv", out_layer_norm=False, out_channel_sums=False):  # fmt: skip
    from ldmopt.kernels.gn_conv2d import gn_conv2d_fwd
    from ldmopt.kernels.group_norm import group_norm_stats

    placement = choose_placement(x.device, tuple(w.shape[2:]), w.shape[0], stride, resample, mean is not None,
                                 fp32_precision == "matmul")  # fmt: skip
    if mean is not None or placement == "cudnn":
        placement_counts[placement] += 1
    if mean is not None and placement in ("staged", "cudnn"):
        # act(group_norm(x)) written once, then a plain conv (gn_conv2d_prologue.py)
        x = staged_apply(x, mean, rstd, gw, gb, groups, act, x_tail)
        x_tail = mean = rstd = gw = gb = act = None
    gate = None if gate is None else gate.float()
    # The epilogue's output statistics are fp64 atomic sums, added in the order the tiles finish; under
    # torch.use_deterministic_algorithms a statistics pass over the output sums them in a fixed order instead. So do
    # fp32 operands' row statistics: with the row sums the 64x128x32 IEEE tile spills on sm_80.
    deterministic = torch.are_deterministic_algorithms_enabled()
    in_epilogue = out_groups if not deterministic else 0
    # (The spill is the Triton conv's: the cudnn placement's epilogue pass sums fp32 rows too.)
    rows_in_epilogue = out_layer_norm and not deterministic and (placement == "cudnn" or x.dtype != torch.float32)
    sums_in_epilogue = out_channel_sums and not deterministic
    if placement == "cudnn":
        from .gn_conv2d_cudnn import conv_then_epilogue

        y, out_mean, out_rstd, sums = conv_then_epilogue(x, x_tail, w, b, temb, res, sx, sx_tail, sw, sb, gate,
                                                         stride, padding, resample, res_resample, sc_resample,
                                                         output_scale, in_epilogue, out_eps, fp32_precision,
                                                         rows_in_epilogue, sums_in_epilogue)  # fmt: skip
    else:
        y, out_mean, out_rstd, sums = gn_conv2d_fwd(x, mean, rstd, gw, gb, _weight_for_kernel(w), b, temb, res, sx,
                                                    sw, sb, gate, groups, act, stride, tuple(padding), resample,
                                                    res_resample, sc_resample, output_scale, in_epilogue, out_eps,
                                                    x_tail, sx_tail, fp32_precision, rows_in_epilogue,
                                                    sums_in_epilogue)  # fmt: skip
    if out_groups and not in_epilogue:
        out_mean, out_rstd = group_norm_stats(y, out_groups, out_eps)
    if out_layer_norm and not rows_in_epilogue:
        out_mean = call(layer_norm_stats_op, pixel_rows(y), out_eps)
    if out_channel_sums and not sums_in_epilogue:
        sums = channel_sums_torch(y)  # in a fixed order
    return y, out_mean, out_rstd, sums


FORWARD = BackendTable("gn_conv2d", [Backend("triton", _fwd_triton, _triton_refuse), Backend("torch", _fwd_torch)])


def reads_parts_in_place(head: Tensor, tail: Tensor) -> bool:
    """Whether the fused conv would read ``(head, tail)`` where they lie: the Triton backend can run (not forced
    off, channels-last parts it takes). Otherwise the reference backend concatenates in every op it runs, and a caller
    that makes several calls on the pair (a resnet block: statistics, conv1, shortcut) should concatenate once."""
    if FORWARD.forced() not in (None, "triton"):
        return False
    layouts_ok = _is_channels_last(head) and _is_channels_last(tail)
    return layouts_ok and not triton_refusals(head, tail, dtypes=_TRITON_DTYPES, matmul=True)


@torch.library.custom_op("ldmopt::gn_conv2d", mutates_args=())
def gn_conv2d_op(
    x: Tensor,
    mean: Tensor | None,
    rstd: Tensor | None,
    gn_weight: Tensor | None,
    gn_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    temb: Tensor | None,
    residual: Tensor | None,
    shortcut_x: Tensor | None,
    shortcut_weight: Tensor | None,
    shortcut_bias: Tensor | None,
    gate: Tensor | None,
    num_groups: int,
    activation: str,
    stride: int,
    padding: list[int],
    resample: str,
    residual_resample: str,
    shortcut_resample: str,
    output_scale: float,
    out_groups: int,
    out_eps: float,
    x_tail: Tensor | None = None,
    shortcut_x_tail: Tensor | None = None,
    fp32_precision: str = "conv",
    out_layer_norm: bool = False,
    out_channel_sums: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y channels-last in x's dtype, out_mean [N, out_groups] fp32, out_rstd, channel_sums); mean=None: no
    normalisation. ``out_channel_sums``: channel_sums is [N, C_out, 2] fp64, per (image, channel) the sum and the sum
    of squares of y (``channel_sums_torch``; empty [N, 0, 2] otherwise), for ``group_norm_stats_from_sums``.
    ``out_layer_norm`` (out_groups=0): out_mean is instead the LayerNorm statistics [2, N * OH * OW] (``eps``
    out_eps) of y's pixels over their channels, what ``layer_norm_stats`` gives for y as a token array, and out_rstd
    is empty ([N, 0]).
    ``x_tail`` / ``shortcut_x_tail``: the input is ``cat([x, x_tail], 1)`` (the shortcut's likewise), never written
    (a staged normalisation writes the normalised concatenation).
    ``fp32_precision``: "conv" or "matmul", whose TF32 setting fp32 products follow (see gn_silu_conv2d)."""
    _check_tail("x_tail", x, x_tail)
    _check_tail("shortcut_x_tail", shortcut_x, shortcut_x_tail)
    _check_fp32_precision(fp32_precision, weight, stride, padding, resample)
    # The output-sized operands, checked for direct calls too (the kernels would read past a smaller one).
    out_size = conv_output_size(*x.shape[2:], weight.shape[2:], stride, padding, resample)
    for name, t, mode in (("residual", residual, residual_resample), ("shortcut_x", shortcut_x, shortcut_resample)):
        if t is not None and (t.dim() != 4 or conv_output_size(*t.shape[2:], 1, 1, 0, mode) != out_size):
            raise ValueError(f"gn_conv2d: {name} of shape {tuple(t.shape)} with {mode!r} resampling does not give the "
                             f"output's {out_size[0]}x{out_size[1]} pixels")  # fmt: skip
    n, c_out = x.shape[0], weight.shape[0]
    if temb is not None and tuple(temb.shape) not in ((n, c_out), (n, c_out, out_size[0])):
        raise ValueError(f"gn_conv2d: temb of shape {tuple(temb.shape)} is not ({n}, {c_out}) or ({n}, {c_out}, "
                         f"{out_size[0]})")  # fmt: skip
    if gate is not None and tuple(gate.shape) not in ((n, 1), (n, out_size[0])):
        raise ValueError(f"gn_conv2d: gate of shape {tuple(gate.shape)} is not ({n}, 1) or ({n}, {out_size[0]})")
    if out_layer_norm and out_groups:
        raise ValueError(f"gn_conv2d: out_layer_norm with out_groups={out_groups}: one kind of output statistics")
    if out_layer_norm and out_channel_sums:
        # the row statistics and the channel sums would share the epilogue's one workspace
        raise ValueError("gn_conv2d: out_layer_norm with out_channel_sums: one kind of output statistics")
    y, out_mean, out_rstd, sums = FORWARD(
        x, mean, rstd, gn_weight, gn_bias, weight, bias, temb, residual, shortcut_x, shortcut_weight,
        shortcut_bias, gate, num_groups, activation or None, stride, padding, resample, residual_resample,
        shortcut_resample, output_scale, out_groups, out_eps, x_tail, shortcut_x_tail, fp32_precision, out_layer_norm,
        out_channel_sums,
    )  # fmt: skip
    return y, out_mean, out_rstd, sums


@gn_conv2d_op.register_fake
def _(x, mean, rstd, gn_weight, gn_bias, weight, bias, temb, residual, shortcut_x, shortcut_weight, shortcut_bias,
      gate, num_groups, activation, stride, padding, resample, residual_resample, shortcut_resample, output_scale,
      out_groups, out_eps, x_tail=None, shortcut_x_tail=None, fp32_precision="conv", out_layer_norm=False,
      out_channel_sums=False):  # fmt: skip
    oh, ow = conv_output_size(x.shape[2], x.shape[3], weight.shape[2:], stride, padding, resample)
    y = _channels_last_like((x.shape[0], weight.shape[0], oh, ow), x)
    stats = x.new_empty((x.shape[0], out_groups), dtype=torch.float32 if out_groups == 0 else _stats_dtype(x))
    sums = x.new_empty((x.shape[0], weight.shape[0] if out_channel_sums else 0, 2), dtype=torch.float64)
    if out_layer_norm:
        return y, x.new_empty((2, x.shape[0] * oh * ow), dtype=_stats_dtype(x)), stats, sums
    return y, stats, torch.empty_like(stats), sums


# ------------------------------------------------------------------------------------------------ public function


def _channel_parts(name: str, x) -> tuple[Tensor, Tensor | None]:
    """(head, tail) of an input given as a tensor or as the pair ``(head, tail)`` standing for their channel
    concatenation; the pair must agree in everything but the channel count."""
    if isinstance(x, Tensor):
        return x, None
    if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, Tensor) for t in x)):
        raise TypeError(f"{name} must be a tensor or a pair (head, tail) of tensors concatenated along channels")
    head, tail = x
    check_tensor(f"{name}[0]", head, ndim=(4,))
    check_tensor(f"{name}[1]", tail, ndim=(4,))
    check_same_device(f"{name}[1]", tail, head)
    if not same_but_channels(head, tail) or head.dtype != tail.dtype:
        raise ValueError(
            f"{name}: the parts of a channel concatenation must agree in batch, spatial size and dtype; got "
            f"{tuple(head.shape)} {head.dtype} and {tuple(tail.shape)} {tail.dtype}"
        )
    return head, tail


def _channels(head: Tensor, tail: Tensor | None) -> int:
    return head.shape[1] + (0 if tail is None else tail.shape[1])


def _check_conv_dtypes(x: Tensor, **params: Tensor | None) -> None:
    """A convolution's weight and bias in its input's dtype, as F.conv2d requires outside autocast (inside it,
    autocast_operands has already cast them): the kernel would otherwise read them as x's dtype."""
    for name, t in params.items():
        if t is not None and t.dtype != x.dtype:
            raise TypeError(
                f"{name} dtype {t.dtype} differs from the input's {x.dtype}; cast it (or run under torch.autocast) "
                "as F.conv2d would require"
            )


def _check_resample(name: str, value: str) -> str:
    if value not in RESAMPLES:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(RESAMPLES)}")
    return value


def gn_silu_conv2d(
    x: Tensor | tuple[Tensor, Tensor],
    gn_weight: Tensor | None,
    gn_bias: Tensor | None,
    num_groups: int,
    eps: float,
    conv_weight: Tensor,
    conv_bias: Tensor | None = None,
    stride: int = 1,
    padding: int | tuple[int, int] = 1,
    *,
    activation: str | None = "silu",
    normalize: bool = True,
    stats: tuple[Tensor, Tensor] | None = None,
    resample: str = "none",
    temb: Tensor | None = None,
    residual: Tensor | None = None,
    residual_resample: str = "none",
    gate: Tensor | None = None,
    shortcut: tuple[Tensor | tuple[Tensor, Tensor], Tensor, Tensor | None] | None = None,
    shortcut_resample: str = "none",
    output_scale: float | None = None,
    out_stats: tuple[int, float] | None = None,
    fp32_precision: str = "conv",
    next_norm_eps: float | None = None,
    out_channel_sums: bool = False,
) -> Tensor | tuple:
    """Convolution of ``act(group_norm(x))`` with everything around it fused into one kernel.

    Math (x is (N, C_in, H, W), best channels-last; every sum in fp32)::

        a = resample(act((x - mean) * rstd * gn_weight + gn_bias))    # per (n, group) mean/rstd; zero padding after
        z = (conv2d(a, conv_weight, conv_bias, stride, padding)       #   the activation
             + temb[:, :, None, None]                                 # temb: (N, C_out), e.g. a time embedding,
             + conv2d(resample_sc(shortcut_x), shortcut_weight, shortcut_bias))    # or (N, C_out, OH): per row
        y = (resample_res(residual) + gate[:, None, :, None] * z) / output_scale  # gate: (N,) or (N, OH)

    ``resample``: "none", "up" (nearest 2x) or "down" (2x2 average pool) of the conv input, done by index arithmetic.
    ``stats=(mean, rstd)`` ([N, G] fp32, e.g. from a previous call's ``out_stats``) skips the statistics pass; they
    must be x's own statistics (backward differentiates through them as such). ``normalize=False`` makes it a plain
    conv (gn_* and num_groups ignored). ``out_stats=(groups, eps)`` also returns ``(mean, rstd)`` of y for the next
    GroupNorm, produced by the conv's epilogue; autograd treats them as constants. ``next_norm_eps`` instead returns
    ``(y, stats)`` with the LayerNorm statistics of y's pixels over their channels for that eps: ``layer_norm_stats``
    of y as a token array [N * OH * OW, C_out] ([2, M]: means, then rstds), what a transformer's first LayerNorm reads
    after its proj_in (``layer_norm_linear(..., stats=stats)``), summed in the epilogue as ``ops.linear``'s are
    (16-bit inputs, and fp32 under the "cudnn" placement; other fp32 ones, and any under deterministic algorithms,
    take a statistics pass over y instead).
    ``out_channel_sums=True`` appends y's per-(image, channel) sum and sum of squares, [N, C_out, 2] fp64, summed in
    the same epilogue (a pass over y under deterministic algorithms), to what is returned (``(y, sums)``, ``(y,
    (mean, rstd), sums)``): ``ops.group_norm_sums.group_norm_stats_from_sums`` turns them into GroupNorm statistics
    for any grouping of y's channels, or of their concatenation with another tensor's, as a UNet up block's first
    GroupNorm reads ``cat([hidden, skip], 1)`` (ldmopt.nn.stats_handover). Constants to autograd, as out_stats.

    Temporal convolutions: a (3, 1) kernel with ``padding=(1, 0)`` over a (video, channel, frame, pixel) view of
    channels-last frames is a Conv3d with kernel (3, 1, 1); GroupNorm statistics of that view are per video, as a
    5-D GroupNorm's are. A per-frame ``temb`` (N, C_out, frames) and ``gate`` (N, frames) serve SVD's temporal
    resnet and its blend with the spatial path (ldmopt.nn.temporal_resnet). The gate is applied in fp32; its
    gradient recomputes the convolution once in backward.

    A UNet up block's ``cat([hidden, skip], 1)``: pass ``x=(hidden, skip)`` (and the shortcut's input likewise); the
    statistics pass and the loaders read each channel block where its part lies, so the concatenation is never
    written (backward materialises it transiently, where a gradient needs it; a staged normalisation, see below,
    writes ``act(group_norm(cat))`` as one buffer, one pass per part). The parts must agree in batch, spatial
    size and dtype.

    Under torch.autocast, x, conv weight/bias, temb, residual and the shortcut's tensors are cast to the autocast
    dtype first (the identity residual is thereby rounded to it, where diffusers would add it in its own dtype).

    Returns y (channels-last, x's dtype) or ``(y, (mean, rstd))``. Tolerance versus an fp64 reference: within 2x the
    error of PyTorch's own unfused computation in x's dtype. The Triton kernel serves channels-last fp32/fp16/bf16 with
    1x1/3x3/3x1 kernels, stride 1/2; other inputs run the reference backend (``fallback_reasons`` records why).
    Output statistics sum in fp64 atomics, so they can differ in the last bit between runs. On a GPU, convs that
    would normalise each input element 3 or more times in the loader (every stride-1 3x3 conv) write
    ``act(group_norm(x))`` once in x's dtype and run cuDNN's conv on it, then the epilogue as a Triton pass; so does
    every conv without a norm but a Linear read as one (ldmopt.ops.gn_conv2d_prologue: the reasoning, and
    ``LDMOPT_GN_CONV_PROLOGUE=loader|staged|cudnn`` to force one); the results agree within rounding.

    fp32 inputs on GPUs use TF32 tensor cores or IEEE fp32 products as PyTorch would: ``fp32_precision="conv"`` as its
    convolution (TF32 unless ``torch.backends.cudnn.allow_tf32`` / ``torch.backends.cudnn.conv.fp32_precision`` say
    otherwise); ``"matmul"``, for a Linear read as a 1x1 conv (kernel 1x1, stride 1, padding 0, no resample), as its
    matmul, i.e. nn.Linear (IEEE unless ``torch.set_float32_matmul_precision("high")`` /
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"``), in the kernel, the reference and backward alike (which
    then run nn.Linear's GEMMs instead of a convolution).
    """
    # None, not a float default: one Dynamo graph input shared by every call (pytorch/pytorch#193194)
    output_scale = 1.0 if output_scale is None else output_scale
    x, x_tail = _channel_parts("x", x)
    check_tensor("x", x, ndim=(4,))
    check_tensor("conv_weight", conv_weight, ndim=(4,))
    # Under torch.autocast the conv operands are cast as F.conv2d casts them; GroupNorm math stays fp32 regardless.
    # The weight's cast writes the layout the triton kernel reads (one copy, not a cast and then a re-layout).
    conv_weight = _autocast_weight_channels_last(x, conv_weight)
    x, conv_weight, conv_bias, temb, residual, x_tail = autocast_operands(
        x, conv_weight, conv_bias, temb, residual, x_tail
    )
    sx_tail = None
    if shortcut is not None:
        if not (isinstance(shortcut, (tuple, list)) and len(shortcut) == 3):
            raise TypeError("shortcut must be (shortcut_x, shortcut_weight, shortcut_bias or None)")
        sx_head, sx_tail = _channel_parts("shortcut_x", shortcut[0])
        shortcut = autocast_operands(sx_head, *shortcut[1:], sx_tail)
        shortcut, sx_tail = shortcut[:3], shortcut[3]
    n, _, h, w = x.shape
    c_in = _channels(x, x_tail)
    c_out = conv_weight.shape[0]
    if conv_weight.shape[1] != c_in:
        raise ValueError(
            f"conv_weight has shape {tuple(conv_weight.shape)}: expected ({c_out}, {c_in}, kh, kw) for x with "
            f"C={c_in} channels (grouped convolutions are not supported)"
        )
    check_vector("conv_bias", conv_bias, c_out, x)
    _check_conv_dtypes(x, conv_weight=conv_weight, conv_bias=conv_bias)
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive int, got {stride!r}")
    pads = (padding,) * 2 if isinstance(padding, int) else tuple(padding) if isinstance(padding, (tuple, list)) else ()
    if len(pads) != 2 or not all(isinstance(p, int) and p >= 0 for p in pads):
        raise ValueError(f"padding must be a non-negative int or a pair of them, got {padding!r}")
    for name, value in (("resample", resample), ("residual_resample", residual_resample)):
        _check_resample(name, value)
    _check_resample("shortcut_resample", shortcut_resample)
    _check_fp32_precision(fp32_precision, conv_weight, stride, pads, resample)
    check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
    mean = rstd = None
    if normalize:
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0 or c_in % num_groups:
            raise ValueError(f"num_groups={num_groups!r} must be a positive int dividing C={c_in}")
        eps = check_eps(eps)
        check_vector("gn_weight", gn_weight, c_in, x)
        check_vector("gn_bias", gn_bias, c_in, x)
        if stats is None:
            tail = None if x_tail is None else statistics_source(x_tail)
            mean, rstd = call(gn_conv2d_stats, statistics_source(x), num_groups, float(eps), tail)
        else:
            if not (isinstance(stats, (tuple, list)) and len(stats) == 2):
                raise TypeError(f"stats must be a (mean, rstd) pair from out_stats=, got {type(stats).__name__}")
            mean, rstd = stats
            for name, t in (("stats[0] (mean)", mean), ("stats[1] (rstd)", rstd)):
                check_tensor(name, t, ndim=(2,))
                if tuple(t.shape) != (n, num_groups):
                    raise ValueError(f"{name} must have shape ({n}, {num_groups}), got {tuple(t.shape)}")
                check_same_device(name, t, x)
    else:
        gn_weight = gn_bias = None
        num_groups = 0
    oh, ow = conv_output_size(h, w, conv_weight.shape[2:], stride, pads, resample)
    if oh <= 0 or ow <= 0:
        raise ValueError(f"x of spatial size {h}x{w} is too small for this convolution (output {oh}x{ow})")
    finite = torch.compiler.is_compiling() or math.isfinite(output_scale)  # a symbolic float under dynamic=True
    if not output_scale or not finite:
        raise ValueError(f"output_scale={output_scale!r}: the output is divided by it, so it must be finite, non-zero")
    check_same_device("conv_weight", conv_weight, x)
    operands = (("temb", temb), ("residual", residual), ("gate", gate))
    for name, t in (*operands, *zip(("shortcut_x", "shortcut_weight"), shortcut or ())):
        check_same_device(name, t, x)
    if temb is not None:
        check_tensor("temb", temb, ndim=(2, 3))
        if tuple(temb.shape) not in ((n, c_out), (n, c_out, oh)):
            raise ValueError(
                f"temb must have shape ({n}, {c_out}) or, per output row, ({n}, {c_out}, {oh}); got {tuple(temb.shape)}"
            )
    if gate is not None:
        check_tensor("gate", gate, ndim=(1, 2))
        if tuple(gate.shape) not in ((n,), (n, 1), (n, oh)):
            raise ValueError(f"gate must have shape ({n},) or, per output row, ({n}, {oh}); got {tuple(gate.shape)}")
        gate = gate.reshape(n, -1)
    if residual is not None:
        check_tensor("residual", residual, ndim=(4,))
        rh, rw = conv_output_size(*residual.shape[2:], 1, 1, 0, residual_resample)
        if tuple(residual.shape[:2]) != (n, c_out) or (rh, rw) != (oh, ow):
            raise ValueError(
                f"residual of shape {tuple(residual.shape)} with residual_resample={residual_resample!r} does not "
                f"match the output ({n}, {c_out}, {oh}, {ow})"
            )
    sx = sw = sb = None
    if shortcut is not None:
        sx, sw, sb = shortcut
        check_tensor("shortcut_x", sx, ndim=(4,))
        check_tensor("shortcut_weight", sw, ndim=(4,))
        sh, sww = conv_output_size(*sx.shape[2:], 1, 1, 0, shortcut_resample)
        c_sc = _channels(sx, sx_tail)
        if sx.shape[0] != n or (sh, sww) != (oh, ow) or tuple(sw.shape) != (c_out, c_sc, 1, 1):
            raise ValueError(
                f"shortcut (x {(n, c_sc, *sx.shape[2:])}, weight {tuple(sw.shape)}, "
                f"shortcut_resample={shortcut_resample!r}) must be a 1x1 conv to the output ({n}, {c_out}, {oh}, {ow})"
            )
        check_vector("shortcut_bias", sb, c_out, x)
        _check_conv_dtypes(sx, shortcut_weight=sw, shortcut_bias=sb)
    if out_stats is not None and not (isinstance(out_stats, (tuple, list)) and len(out_stats) == 2):
        raise TypeError(f"out_stats must be a (groups, eps) pair for the next GroupNorm, got {out_stats!r}")
    out_groups, out_eps = (0, 0.0) if out_stats is None else out_stats
    if out_stats is not None:
        if isinstance(out_groups, bool) or not isinstance(out_groups, int) or out_groups <= 0 or c_out % out_groups:
            raise ValueError(f"out_stats groups={out_groups!r} must be a positive int dividing C_out={c_out}")
        out_eps = check_eps(out_eps)
    if next_norm_eps is not None:
        if out_stats is not None:
            raise ValueError("gn_silu_conv2d: out_stats (GroupNorm) and next_norm_eps (LayerNorm) exclude each other")
        if out_channel_sums:
            raise ValueError("gn_silu_conv2d: out_channel_sums and next_norm_eps (LayerNorm) exclude each other")
        try:
            out_eps = check_eps(next_norm_eps)
        except ValueError:
            raise ValueError(f"next_norm_eps must be a finite non-negative float, got {next_norm_eps!r}") from None
    y, out_mean, out_rstd, sums = call(
        gn_conv2d_op, x, mean, rstd, gn_weight, gn_bias, conv_weight, conv_bias, temb, residual, sx, sw, sb, gate,
        num_groups, activation or "", stride, list(pads), resample, residual_resample, shortcut_resample,
        float(output_scale), out_groups, float(out_eps), x_tail, sx_tail, fp32_precision, next_norm_eps is not None,
        bool(out_channel_sums),
    )  # fmt: skip
    if next_norm_eps is not None:
        out = (y, out_mean)
    else:
        out = (y,) if out_stats is None else (y, (out_mean, out_rstd))
    return (*out, sums) if out_channel_sums else out if len(out) > 1 else y
