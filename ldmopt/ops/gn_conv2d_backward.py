"""Backward of the fused GroupNorm -> conv op ``ldmopt::gn_conv2d`` (ops/gn_conv2d.py), registered here.

It recomputes the conv's input ``act(group_norm(x))`` from the saved input and statistics (group_norm_apply.py: one
fused pass where Triton runs) and uses PyTorch's convolution backward (nn.Linear's GEMMs for a Linear read as a 1x1
conv), then GroupNorm's fused backward: no activation beyond the op's inputs is kept alive. Bias, temb, gate and the
shortcut's gradients are sums of the output gradient, in the compute dtype. A two-part input is concatenated here,
for backward only and only where a gradient needs it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import call, register_autograd_keeping_backend
from .gn_conv2d import _is_channels_last, gn_conv2d_op
from .gn_conv2d_reference import _pre_gate, resample_input
from .gn_conv2d_stats import _cat, _stats_dtype
from .group_norm import group_norm_bwd
from .group_norm_apply import group_norm_apply
from .linear import sum_as


def _resample_backward(grad: Tensor, mode: str, like: Tensor) -> Tensor:
    """Gradient with respect to the input (shaped like ``like``) of ``resample_input(input, mode)``."""
    if mode == "up":
        # Each input pixel fed a 2x2 block: its sum. (aten's upsample_nearest2d_backward gives the same, but
        # inductor cannot lower it with symbolic sizes: a compiled training step with dynamic shapes failed.)
        h2, w2 = grad.shape[2:]
        blocks = grad.unflatten(3, (w2 // 2, 2)).unflatten(2, (h2 // 2, 2)).sum((3, 5))
        layout = torch.channels_last if _is_channels_last(grad) else torch.contiguous_format
        return blocks.contiguous(memory_format=layout)
    if mode == "down":
        return torch.ops.aten.avg_pool2d_backward(grad, like, [2, 2], [2, 2], [0, 0], False, True, None)
    return grad


#: the op's arguments after its 23 required ones, as their defaults
_OPTIONAL_DEFAULTS = (None, None, "conv", False, False)


def _setup_context(ctx, inputs, output):
    (x, mean, rstd, gw, gb, w, b, temb, res, sx, sw, sb, gate, groups, act, stride, padding, resample, res_resample,
     sc_resample, output_scale, _out_groups, _out_eps, x_tail, sx_tail, fp32_precision, _out_layer_norm,
     _out_channel_sums) = (*inputs, *_OPTIONAL_DEFAULTS[len(inputs) - 23 :])  # fmt: skip
    # The gate's gradient needs what it scaled: bias, temb and the shortcut's bias are kept only then.
    keep = gate is not None and ctx.needs_input_grad[12]
    ctx.save_for_backward(x, mean, rstd, gw, gb, w, sx, sw, gate, *((b, temb, sb) if keep else (None,) * 3), x_tail,
                          sx_tail)  # fmt: skip
    ctx.conf = (groups, act or None, stride, tuple(padding), resample, res_resample, sc_resample, output_scale,
                fp32_precision)  # fmt: skip
    ctx.meta = {
        "bias": None if b is None else b.dtype,
        "temb": None if temb is None else (temb.dtype, temb.dim()),
        "sb": None if sb is None else sb.dtype,
        "res": None if res is None else tuple(res.shape),
        "gate": None if gate is None else (gate.dtype, tuple(gate.shape)),
    }
    # The output statistics take no gradient (the next op's backward differentiates through them itself): not
    # differentiable outputs (a gradient sent into them would be lost), so no zero-filled gradients for them (two
    # fill launches per call), and a None dy when y itself had no gradient.
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    ctx.set_materialize_grads(False)


def _conv_backward(g, inp, w, stride, padding, mask, fp32_precision="conv"):
    """(d input, d weight) with PyTorch's convolution backward, or for "matmul" (a pointwise conv) nn.Linear's backward
    GEMMs, at PyTorch's matmul precision (traced as such under torch.compile); CPU half precision runs in fp32."""
    if g.device.type == "cpu" and g.dtype in (torch.float16, torch.bfloat16):
        gi, gw, _ = _conv_backward(g.float(), inp.float(), w.float(), stride, padding, mask, fp32_precision)
        return (
            None if gi is None else gi.to(g.dtype),
            None if gw is None else gw.to(w.dtype),
            None,
        )
    if fp32_precision == "matmul":
        g_rows, w_mat = g.permute(0, 2, 3, 1), w[:, :, 0, 0].to(g.dtype)  # [N, H, W, C_out], [C_out, C_in]
        gi = torch.matmul(g_rows, w_mat).permute(0, 3, 1, 2) if mask[0] else None
        if mask[1]:
            inp_rows = inp.to(g.dtype).permute(0, 2, 3, 1).reshape(-1, w.shape[1])
            gw = torch.matmul(g_rows.reshape(-1, w.shape[0]).t(), inp_rows)[:, :, None, None]
        else:
            gw = None
        return gi, gw, None
    return torch.ops.aten.convolution_backward(
        g, inp.to(g.dtype), w.to(g.dtype), None, [stride] * 2, list(padding), [1, 1], False, [0, 0], 1,
        [*mask, False],
    )  # fmt: skip


def _strided_like(grad: Tensor | None, like: Tensor) -> Tensor | None:
    """A weight's gradient in the weight's own strides, size-1 dims included: the convolution backward returns the
    input's memory format, and DDP's gradient buckets (which compare strides exactly) warn and copy otherwise."""
    if grad is None or grad.stride() == like.stride():
        return grad
    if not (like.is_contiguous() or like.is_contiguous(memory_format=torch.channels_last)):
        return grad
    return torch.empty_strided(like.shape, like.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def _split_channels(grad: Tensor | None, head: Tensor, tail: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(d head, d tail) of a gradient with respect to ``cat([head, tail], 1)``."""
    if grad is None or tail is None:
        return grad, None
    return grad[:, : head.shape[1]], grad[:, head.shape[1] :]


def _backward(ctx, dy, _dmean, _drstd, _dsums):
    x_head, mean, rstd, gw, gb, w, sx_head, sw, gate, b, temb, sb, x_tail, sx_tail = ctx.saved_tensors
    groups, act, stride, padding, resample, res_resample, sc_resample, output_scale, fp32_precision = ctx.conf
    given = len(ctx.needs_input_grad)  # 23 when a caller leaves out the optional arguments
    if dy is None:
        return (None,) * given
    need = [*ctx.needs_input_grad, *(False,) * len(_OPTIONAL_DEFAULTS)][:28]
    need[0] = need[0] or need[23]
    need[9] = need[9] or need[24]
    # A two-part input is concatenated here, for backward only and only where a gradient needs it (the unfused block
    # keeps its concatenation alive all the way).
    gate_grad = gate is not None and need[12]
    x = _cat(x_head, x_tail) if x_tail is None or gate_grad or need[0] or need[3] or need[4] or need[5] else None
    sx = _cat(sx_head, sx_tail) if sx_tail is None or gate_grad or need[9] or need[10] else None
    g = dy if output_scale == 1.0 else dy / output_scale
    grads = [None] * 28
    if need[8]:
        grads[8] = _resample_backward(g, res_resample, g.new_empty(ctx.meta["res"]))
    normalize = mean is not None
    need_da = need[0] or (normalize and (need[3] or need[4]))
    a = x  # the conv's input
    if normalize and (gate_grad or need_da or need[5]):
        # the conv's input again, in one fused pass where Triton runs (the reference composition is ~7 fp32 passes)
        a = call(group_norm_apply, x, mean, rstd, gw, gb, groups, act or "")
    if gate is not None:
        if need[12]:
            # d gate[n, oh] = sum over (c, ow) of g * (conv + bias + temb + shortcut), recomputed: one more conv.
            z = _pre_gate(x, mean, rstd, gw, gb, w, b, temb, sx, sw, sb, groups, act, stride, padding, resample,
                          sc_resample, fp32_precision, a)  # fmt: skip
            # fp64 sums: the gate (SVD's blend factor) sees every element of the tensor.
            dgate = (g.to(z.dtype) * z).sum((1, 3), dtype=torch.float64)
            dtype, shape = ctx.meta["gate"]
            grads[12] = (dgate.sum(1, keepdim=True) if shape[1] == 1 else dgate).to(dtype)
        g = (g.to(_stats_dtype(x_head)) * gate.to(_stats_dtype(x_head))[:, None, :, None]).to(g.dtype)
    if need[6]:
        grads[6] = sum_as(g, (0, 2, 3), ctx.meta["bias"])
    if need[7]:
        dtype, dims = ctx.meta["temb"]
        grads[7] = sum_as(g, (2, 3) if dims == 2 else (3,), dtype)
    if need_da or need[5]:
        da_r, dw = _conv_backward(
            g, resample_input(a, resample), w, stride, padding, [need_da, need[5]], fp32_precision
        )[:2]
        grads[5] = _strided_like(dw, w)
        if need_da:
            da = _resample_backward(da_r, resample, x)
            if normalize:
                dx, dgw, dgb = call(group_norm_bwd, da, x, gw, gb, mean, rstd, groups, act or "")
                grads[0] = dx
                grads[3] = dgw.to(gw.dtype) if gw is not None and need[3] else None
                grads[4] = dgb.to(gb.dtype) if gb is not None and need[4] else None
            else:
                grads[0] = da.to(x.dtype)
    if sx is not None and (need[9] or need[10]):
        sx_r = resample_input(sx, sc_resample)
        dsx_r, dsw = _conv_backward(g, sx_r, sw, 1, (0, 0), [need[9], need[10]], fp32_precision)[:2]
        grads[9] = _resample_backward(dsx_r, sc_resample, sx) if need[9] else None
        grads[10] = _strided_like(dsw, sw)
    if need[11]:
        grads[11] = sum_as(g, (0, 2, 3), ctx.meta["sb"])
    grads[0], grads[23] = _split_channels(grads[0], x_head, x_tail)
    grads[9], grads[24] = _split_channels(grads[9], sx_head, sx_tail)
    return tuple(grads[:given])


register_autograd_keeping_backend(gn_conv2d_op, _backward, _setup_context)
