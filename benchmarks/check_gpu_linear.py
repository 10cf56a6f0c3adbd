"""The GEMM cases of check_gpu.py's ``fused_linear`` check (GEGLU, bias + GELU, gated and blended residual GEMMs,
LayerNorm read in the loads, adaLN modulation), each with its fp64 reference, and the residual GEMM that hands the
next LayerNorm its statistics (``linear_row_stats``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _run_geglu(x, w, b):
    from ldmopt.ops.geglu import geglu

    return geglu(x, w, b)


def _ref_geglu(x, w, b):
    h, g = F.linear(x, w, b).chunk(2, dim=-1)
    return h * F.gelu(g)


def _run_gelu(x, w, b):
    from ldmopt.ops.linear import linear

    return linear(x, w, b, activation="gelu_tanh")


def _ref_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _run_gated(x, w, b, gate, res):
    from ldmopt.ops.linear import linear

    return linear(x, w, b, gate=gate, residual=res)


def _ref_gated(x, w, b, gate, res):
    return res + gate[:, None] * F.linear(x, w, b)


def _run_gated_concat(x, w, b, gate, res):
    """Flux's single-stream proj_out: x read as two parts, [attention | MLP] (a fifth and four fifths), in place."""
    from ldmopt.ops.linear import linear

    split = x.shape[-1] // 5
    return linear((x[..., :split], x[..., split:]), w, b, gate=gate, residual=res)


def _run_blend(x, w, b, mix, res):
    """SVD's container proj_out: the AlphaBlender mix of two token streams (x's halves) formed in the GEMM's loads."""
    from ldmopt.ops.linear import linear

    half = x.shape[-1] // 2
    return linear((x[..., :half], x[..., half:]), w, b, residual=res, mix=mix)


def _ref_blend(x, w, b, mix, res):
    half = x.shape[-1] // 2
    m = mix[:, None, None]
    return F.linear(m * x[..., :half] + (1 - m) * x[..., half:], w, b) + res


def _run_ln_linear(x, nw, nb, w, b):
    """A UNet block's norm -> projection: the LayerNorm read in the GEMM's loads (ops.layer_norm_linear)."""
    from ldmopt.ops.layer_norm_linear import layer_norm_linear

    return layer_norm_linear(x, nw, nb, w, b, activation="geglu" if w.shape[0] > 2 * x.shape[-1] else None)


def _frame_table(x):
    """A fixed sinusoid-like table, 16 frames x C, in x's dtype (AnimateDiff's positions, one row per frame)."""
    c = x.shape[-1]
    return torch.sin(torch.arange(16 * c, device=x.device, dtype=torch.float64).view(16, c) * 0.01).to(x.dtype)


def _run_ln_linear_pos(x, nw, nb, w, b):
    """A motion module's norm1 -> to_q with the frame positions added in the loads (x: 16 frames of T / 16 rows)."""
    from ldmopt.ops.layer_norm_linear import layer_norm_linear

    rows = x.shape[1] // 16
    return layer_norm_linear(x, nw, nb, w, b, positions=_frame_table(x).detach(), position_rows=rows)


def _ref_ln_linear_pos(x, nw, nb, w, b):
    h = F.layer_norm(x, x.shape[-1:], nw, nb).view(x.shape[0], 16, -1, x.shape[-1])
    h = h + _frame_table(x)[None, :, None, :]
    return F.linear(h.view(x.shape), w, b)


def _ref_ln_linear(x, nw, nb, w, b):
    z = F.linear(F.layer_norm(x, x.shape[-1:], nw, nb), w, b)
    if w.shape[0] > 2 * x.shape[-1]:  # GEGLU (I = 4 C in the UNets)
        h, g = z.chunk(2, dim=-1)
        return h * F.gelu(g)
    return z


def _run_adaln(x, scale, shift, res):
    from ldmopt.ops.adaln_modulate import adaln_modulate

    return adaln_modulate(x, scale, shift, residual=res, return_residual=True)[0]


def _ref_adaln(x, scale, shift, res):
    return F.layer_norm(x + res, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def _run_adaln_gated(x, scale, shift, res, gate):
    from ldmopt.ops.adaln_modulate import adaln_modulate

    return adaln_modulate(x, scale, shift, residual=res, gate=gate)


def _ref_adaln_gated(x, scale, shift, res, gate):
    return _ref_adaln(gate[:, None] * x, scale, shift, res)


def _run_gated_wan(x, w, b, gate, res):
    from ldmopt.ops.linear import linear

    return linear(x, w, b, gate=gate, residual=res, out_dtype=res.dtype)


def run_residual_stats(x, w, b, res, eps=1e-5):
    """A UNet block's attention output projection with its residual, also summing its rows' LayerNorm statistics for
    the norm after it (ops.linear(..., next_norm_eps)): (y, mean, rstd)."""
    from ldmopt.ops.linear import linear

    y, stats = linear(x, w, b, residual=res, next_norm_eps=eps)
    return y, stats[0], stats[1]


def ref_residual_stats(x, w, b, res, y, eps=1e-5):
    """fp64: the output, and the statistics of the output as stored (``y``, rounded to its dtype)."""
    rows = y.double().reshape(-1, y.shape[-1])
    return F.linear(x, w, b) + res, rows.mean(1), torch.rsqrt(rows.var(1, unbiased=False) + eps)
