"""The reference backend of the fused GroupNorm -> conv (``ldmopt::gn_conv2d``, gn_conv2d.py): the unfused
composition of PyTorch ops in the statistics dtype (fp32, fp64 for fp64 inputs), rounding the activation to x's dtype
as an unfused model stores it. Its pieces serve the other backends too: the cudnn placement's conv and resampling
(gn_conv2d_cudnn.py), backward's recomputation of what the gate scales (gn_conv2d_backward.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .gn_conv2d_stats import _cat, _stats_dtype, _stats_torch
from .group_norm_apply import normalize_reference as _normalize
from .layer_norm_linear import _stats_torch as _layer_norm_stats_torch


def resample_input(t: Tensor, mode: str) -> Tensor:
    """What ``resample`` does to a conv's input (and ``residual_resample`` to the residual): nearest 2x up, or 2x2
    average pooling down, as diffusers' Upsample2D / Downsample2D without a conv."""
    if mode == "up":
        return F.interpolate(t, scale_factor=2.0, mode="nearest")
    if mode == "down":
        return F.avg_pool2d(t, 2, 2)
    return t


def pixel_rows(y: Tensor) -> Tensor:
    """(N, C, H, W) as the token array [N * H * W, C] (a view of a channels-last y): the rows a LayerNorm reads."""
    return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


def _rows(t: Tensor) -> Tensor:
    """A per-image ([N, C]) or per-output-row ([N, C, OH]) vector as a broadcastable [N, C, OH|1, 1] view."""
    return t[:, :, None, None] if t.dim() == 2 else t[:, :, :, None]


def _channels_last_like(shape, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty(shape, device=x.device, dtype=dtype or x.dtype, memory_format=torch.channels_last)


def _conv(inp: Tensor, w: Tensor, b: Tensor | None, stride: int, padding, fp32_precision: str) -> Tensor:
    """F.conv2d; "matmul" (a pointwise conv): the GEMM over channels nn.Linear runs, at PyTorch's matmul precision."""
    if fp32_precision == "matmul":
        return F.linear(inp.permute(0, 2, 3, 1), w[:, :, 0, 0], b).permute(0, 3, 1, 2)
    return F.conv2d(inp, w, b, stride, list(padding))


def _pre_gate(x, mean, rstd, gw, gb, w, b, temb, sx, sw, sb, groups, act, stride, padding, resample, sc_resample,
              fp32_precision="conv", a=None):  # fmt: skip
    """conv + bias + temb + shortcut in the statistics dtype: what the gate scales. ``a``: the conv's input
    ``act(group_norm(x))`` when the caller has it already."""
    cd = _stats_dtype(x)
    if a is None:
        a = x if mean is None else _normalize(x, mean, rstd, gw, gb, groups, act).to(x.dtype)
    z = _conv(resample_input(a, resample).to(cd), w.to(cd), None, stride, padding, fp32_precision)
    if b is not None:
        z = z + b.to(cd)[:, None, None]
    if temb is not None:
        z = z + _rows(temb.to(cd))
    if sx is not None:
        sb = None if sb is None else sb.to(cd)
        z = z + _conv(resample_input(sx.to(cd), sc_resample), sw.to(cd), sb, 1, (0, 0), fp32_precision)
    return z


def _fwd_torch(x, mean, rstd, gw, gb, w, b, temb, res, sx, sw, sb, gate, groups, act, stride, padding, resample,
               res_resample, sc_resample, output_scale, out_groups, out_eps, x_tail=None, sx_tail=None,
               fp32_precision="conv", out_layer_norm=False, out_channel_sums=False):  # fmt: skip
    """The reference: the unfused composition, rounding the activation to x's dtype as an unfused model stores it."""
    x, sx = _cat(x, x_tail), _cat(sx, sx_tail)
    cd = _stats_dtype(x)
    z = _pre_gate(x, mean, rstd, gw, gb, w, b, temb, sx, sw, sb, groups, act, stride, padding, resample, sc_resample,
                  fp32_precision)  # fmt: skip
    if gate is not None:
        z = z * gate.to(cd)[:, None, :, None]
    if res is not None:
        z = z + resample_input(res.to(cd), res_resample)
    if torch._C._are_functorch_transforms_active():  # vmap: no writes of batched values into an unbatched buffer
        y = (z / output_scale).to(x.dtype)
    else:
        y = _channels_last_like(z.shape, x)
        y.copy_(z / output_scale)
    sums = channel_sums_torch(y) if out_channel_sums else _no_sums(y)
    if out_layer_norm:
        stats = _layer_norm_stats_torch(pixel_rows(y), out_eps)
        return y, stats, x.new_empty((x.shape[0], 0), dtype=torch.float32), sums
    if not out_groups:
        empty = x.new_empty((x.shape[0], 0), dtype=torch.float32)
        return y, empty, empty.clone(), sums
    mean_o, rstd_o = _stats_torch(y, out_groups, out_eps)
    return y, mean_o, rstd_o, sums


def channel_sums_torch(y: Tensor) -> Tensor:
    """[N, C, 2] fp64: per (image, channel) of y, the sum and the sum of squares of its values (what the fused
    conv's epilogue sums with ``out_channel_sums``)."""
    values = y.detach().to(torch.float64).flatten(2)
    return torch.stack([values.sum(2), (values * values).sum(2)], dim=2)


def _no_sums(like: Tensor) -> Tensor:
    return like.new_empty((like.shape[0], 0, 2), dtype=torch.float64)
