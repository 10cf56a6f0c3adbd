"""The row-norm cases of check_gpu.py's ``fused_linear`` check: RMSNorm, its RoPE variants (Wan, Flux, Qwen-Image),
Flux's two-stream joint norm and CogVideoX's LayerNorm + RoPE, each with its fp64 reference."""

from __future__ import annotations

import math

import torch


def _run_rms_norm(x, weight, bias):
    from ldmopt.ops.rms_norm import rms_norm

    return rms_norm(x, weight, bias, eps=1e-6)


def _ref_rms_norm(x, weight, bias):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight + bias


def _wan_angles(positions, channels, device):
    """Wan-like RoPE tables (cos, sin) [positions, half] fp32 for heads of gcd(channels, 128) (128 at real shapes)."""
    half = math.gcd(channels, 128) // 2
    theta = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(half, device=device, dtype=torch.float64) / half)
    )
    return theta.cos().float(), theta.sin().float()


def _run_rms_norm_rope(x, weight):
    from ldmopt.ops.rms_norm import rms_norm

    angles = _wan_angles(x.shape[-2], x.shape[-1], x.device)
    return rms_norm(x, weight, None, eps=1e-6, rope=angles, rope_layout="pairs")


def _ref_rms_norm_rope(x, weight):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    cos, sin = (t.double() for t in _wan_angles(x.shape[-2], x.shape[-1], x.device))
    pairs = y.unflatten(-1, (-1, cos.shape[1], 2))  # [B, T, heads, half, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-3)


def _flux_tables(positions, head, device):
    """Flux-layout tables (cos, sin) [positions, head] fp32, one value per element (each element its own angle)."""
    theta = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(head, device=device, dtype=torch.float64) / head)
    )
    return theta.cos().float(), theta.sin().float()


def _run_rms_norm_rope_heads(x, weight):
    from ldmopt.ops.rms_norm import rms_norm

    heads = x.unflatten(-1, (-1, weight.numel()))  # [B, T, H, D]: Flux's per-head norm
    tables = _flux_tables(x.shape[-2], weight.numel(), x.device)
    return rms_norm(heads, weight, None, eps=1e-6, rope=tables, rope_layout="elements", rope_dim=-3).flatten(-2)


def _ref_rms_norm_rope_heads(x, weight, head=None):
    """Per-head norm and Flux's rotation; ``weight`` [D], or per token [T, 1, D] (with ``head`` = D)."""
    head = head or weight.numel()
    heads = x.unflatten(-1, (-1, head))
    y = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    cos, sin = (t.double()[:, None] for t in _flux_tables(x.shape[-2], head, x.device))
    real, imag = y.unflatten(-1, (-1, 2)).unbind(-1)
    return (y * cos + torch.stack((-imag, real), dim=-1).flatten(-2) * sin).flatten(-2)


def _run_layer_norm_rope(x, weight, bias):
    """CogVideoX's per-head query LayerNorm (affine) + RoPE in one kernel (every token rotated here)."""
    from ldmopt.ops import layer_norm_rope

    heads = x.unflatten(-1, (-1, weight.numel()))
    tables = _flux_tables(x.shape[-2], weight.numel(), x.device)
    return layer_norm_rope(heads, weight, bias, 1e-6, rope=tables, rope_layout="elements", rope_dim=-3).flatten(-2)


def _ref_layer_norm_rope(x, weight, bias):
    heads = x.unflatten(-1, (-1, weight.numel()))
    centred = heads - heads.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * weight + bias
    cos, sin = (t.double()[:, None] for t in _flux_tables(x.shape[-2], weight.numel(), x.device))
    real, imag = normed.unflatten(-1, (-1, 2)).unbind(-1)
    return (normed * cos + torch.stack((-imag, real), dim=-1).flatten(-2) * sin).flatten(-2)


FLUX_TEXT = 512  # text tokens before the image tokens of Flux's joint sequence


def _run_rms_norm_rope_joint(x, w_text, w_image):
    """Flux's double-stream q: [text | image] normalised with their own weights, joined and rotated in one kernel."""
    from ldmopt.ops.rms_norm import rms_norm

    heads = x.unflatten(-1, (-1, w_text.numel()))
    tables = _flux_tables(x.shape[-2], w_text.numel(), x.device)
    parts = (heads[:, :FLUX_TEXT], heads[:, FLUX_TEXT:])
    return rms_norm(parts, (w_text, w_image), eps=1e-6, rope=tables, rope_layout="elements", cat_dim=1).flatten(-2)


def _ref_rms_norm_rope_joint(x, w_text, w_image):
    d = w_text.numel()
    per_token = torch.cat([w_text.expand(FLUX_TEXT, d), w_image.expand(x.shape[1] - FLUX_TEXT, d)])[:, None]
    return _ref_rms_norm_rope_heads(x, per_token, d)


def _qwen_freqs(positions, half, device):
    """Qwen-Image-layout tables: complex64 [positions, half], one unit rotation per pair."""
    theta = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(half, device=device, dtype=torch.float64) / half)
    )
    return torch.polar(torch.ones_like(theta), theta).to(torch.complex64)


def _run_rms_norm_rope_complex(x, weight):
    """Qwen-Image's layout: per-head rows, complex tables [T, D/2] read as cos/sin views (one angle per pair)."""
    from ldmopt.ops.rms_norm import rms_norm

    pairs = torch.view_as_real(_qwen_freqs(x.shape[-2], weight.numel() // 2, x.device))
    heads = x.unflatten(-1, (-1, weight.numel()))
    tables = (pairs[..., 0], pairs[..., 1])
    return rms_norm(heads, weight, None, eps=1e-6, rope=tables, rope_layout="pairs", rope_dim=-3).flatten(-2)


def _ref_rms_norm_rope_complex(x, weight):
    heads = x.unflatten(-1, (-1, weight.numel()))
    y = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    freqs = _qwen_freqs(x.shape[-2], weight.numel() // 2, x.device).to(torch.complex128)[:, None]
    return torch.view_as_real(torch.view_as_complex(y.unflatten(-1, (-1, 2)).contiguous()) * freqs).flatten(-3)
