"""The fused convolution's "cudnn" placement (ops/gn_conv2d_prologue.py): after the staged GroupNorm + activation,
PyTorch runs the convolution (cuDNN on GPUs) and one pass does the rest of the fused conv's epilogue
(ops/conv_epilogue.py: ldmopt._C's kernel where the extension is built and takes the inputs, else
kernels/conv_epilogue.py's Triton launch). Part of the gn_conv2d op's triton backend, which calls it."""

from __future__ import annotations

import torch
from torch import Tensor

from .conv_epilogue import conv_epilogue
from .gn_conv2d_reference import _conv, resample_input
from .gn_conv2d_stats import _cat


def conv_then_epilogue(a, a_tail, w, b, temb, res, sx, sx_tail, sw, sb, gate, stride, padding, resample,
                       res_resample, sc_resample, output_scale, out_groups, out_eps, fp32_precision, out_layer_norm,
                       out_channel_sums):  # fmt: skip
    """The "cudnn" placement after the staged normalisation: PyTorch's convolution of ``a`` (cuDNN on GPUs; in a's
    dtype with its bias, as the stock block runs it) and of the shortcut, then one pass for the rest of the
    epilogue, in place (ops/conv_epilogue.py)."""
    a = _cat(a, a_tail)  # a two-part input only here when nothing normalises it
    z = _conv(resample_input(a, resample), w, b, stride, padding, fp32_precision)
    z = z.contiguous(memory_format=torch.channels_last)  # what cuDNN gives a channels-last input: no copy
    sc = None
    if sx is not None:
        # Two parts as two GEMMs into one output; not in deterministic mode, where cuBLAS's addmm refuses to run
        # without CUBLAS_WORKSPACE_CONFIG and cuDNN's conv of the concatenation does not
        as_gemms = sx_tail is not None and sc_resample == "none" and sx.dtype != torch.float32
        if as_gemms and not torch.are_deterministic_algorithms_enabled():
            sc = _pointwise_of_parts(sx, sx_tail, sw, sb)
        else:
            sc = _conv(resample_input(_cat(sx, sx_tail), sc_resample), sw, sb, 1, (0, 0), fp32_precision)
    return conv_epilogue(z, temb, gate, sc, res, res_resample, output_scale, out_groups, out_eps, out_layer_norm,
                         out_channel_sums)  # fmt: skip


def _pointwise_of_parts(head: Tensor, tail: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """The 1x1 shortcut conv of an up block's ``cat([hidden, skip], 1)`` as two GEMMs into one output (the second
    accumulates in place), so the concatenation is never written, as the fused conv reads the parts where they lie.
    The head's product (with the bias) is rounded to the dtype before the tail's is added: one rounding more than a
    conv of the concatenation, half an ulp of the head's part. 16-bit only: an fp32 conv's products follow cuDNN's
    TF32 setting, not the matmul's, so fp32 concatenates (so does a resampled shortcut)."""
    n, c_head, h, wd = head.shape
    w2 = w[:, :, 0, 0]

    def rows(t: Tensor) -> Tensor:
        return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])  # a view of a channels-last part

    first = w2[:, :c_head].t()
    out = torch.addmm(b, rows(head), first) if b is not None else rows(head) @ first
    out.addmm_(rows(tail), w2[:, c_head:].t())
    return out.view(n, h, wd, -1).permute(0, 3, 1, 2)
