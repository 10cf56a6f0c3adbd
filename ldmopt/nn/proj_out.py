"""A transformer's last step over a channels-last map, ``proj_out(tokens) + residual``, offered to what reads it next.

UNet transformers (diffusers' ``Transformer2DModel``, AnimateDiff's motion modules) end in a pointwise projection of
their token array plus the map they were given. In a channels-last (N, C, H, W) map the pixels' channel vectors are
already the token rows, so the add goes into the projection's epilogue and the result is the next block's map. What
reads it next is usually a GroupNorm: the next resnet's norm1, or an up block's first resnet, with its skip.

:func:`proj_out_residual` runs it as ``ops.linear``'s GEMM with the residual in its epilogue, and offers the output
(ldmopt.nn.stats_handover). Once its consumer asked for its GroupNorm statistics or for its channel sums, it runs as
a 1x1 ``gn_silu_conv2d`` over the tokens' channels-last view instead, whose epilogue sums them per image (the GEMM's
row tiles may span two images, so its epilogue cannot): the consumer skips its statistics pass. The producer is the
proj_out module: the transformer itself produces proj_in's output, whose first block's norm1 asks for LayerNorm
statistics. Under autograd (training) it stays the GEMM: a gradient-checkpointing recompute must run the ops of the
forward it replays, and a request learned in between would switch them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops._autocast import autocast_enabled
from ..ops.gn_conv2d import gn_silu_conv2d
from ..ops.linear import linear
from . import stats_handover as handover


def pointwise_as_conv(proj: nn.Module) -> tuple[Tensor, Tensor | None, str]:
    """(weight as a 1x1 conv's, bias, fp32_precision) of a Linear or 1x1 Conv2d: a Linear's fp32 products follow
    PyTorch's matmul precision (IEEE by default, as nn.Linear's), a 1x1 Conv2d's its convolution's (TF32 by
    default)."""
    weight = proj.weight
    if weight.dim() == 2:
        return weight[:, :, None, None], proj.bias, "matmul"
    return weight, proj.bias, "conv"


def proj_out_residual(proj_out: nn.Module, tokens: Tensor, residual: Tensor) -> Tensor:
    """``proj_out(tokens) + residual`` as channels-last (N, C, H, W) like ``residual``, which must be channels-last;
    ``tokens`` hold N * H * W rows in (n, h, w) order (any leading shape), proj_out is a plain Linear or 1x1 Conv2d
    from their width to C. Offered to the next consumer; summed by a conv's epilogue once one asked (see above),
    outside autocast and with tokens, residual and weight of one dtype (the conv adds the residual as the GEMM
    does then). Either way fp32 products follow PyTorch's matmul precision, as ``ops.linear``'s do."""
    config = handover.wanted_group_norm(proj_out, residual)
    sums = handover.wants_sums(proj_out, residual)
    n, c, h, w = residual.shape
    uniform = tokens.dtype == residual.dtype == proj_out.weight.dtype and not autocast_enabled(tokens.device.type)
    # Under autograd the GEMM stays: a (non-reentrant) gradient-checkpointing recompute must save what the forward it
    # replays saved, and a request learned in between would switch the op (a reentrant checkpoint's forward runs
    # without autograd: its recompute may differ by rounding only).
    if (config is None and not sums) or not uniform or torch.is_grad_enabled():
        weight = proj_out.weight if proj_out.weight.dim() == 2 else proj_out.weight.flatten(1)
        res_tokens = residual.permute(0, 2, 3, 1).reshape(n, h * w, c)  # a view: channels-last memory is token order
        out = linear(tokens.reshape(n, h * w, -1), weight, proj_out.bias, residual=res_tokens)
        out = out.view(n, h, w, c).permute(0, 3, 1, 2)
        handover.offer(out, proj_out)
        return out
    x = tokens.reshape(n, h, w, -1).permute(0, 3, 1, 2)  # channels-last (N, C_inner, H, W): the tokens' own memory
    weight, bias, _ = pointwise_as_conv(proj_out)
    # fp32 products at the GEMM's precision (PyTorch's matmul setting) for a 1x1 Conv2d too: the result must not
    # change between the call that teaches the consumer's request and the calls that serve it
    out = gn_silu_conv2d(
        x, None, None, 0, 0.0, weight, bias, 1, 0, normalize=False, activation=None, residual=residual,
        fp32_precision="matmul", out_stats=config, out_channel_sums=sums,
    )  # fmt: skip
    return handover.offer_result(out, proj_out, config, sums)
