"""Each op as check_cuda_backend.py's correctness and speed parts run it: ldmopt's op on one backend
(``_ldmopt_*``), PyTorch eager as diffusers runs it today (``_eager_*``, the speed part's baseline) and the fp64
reference (``_*_reference``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ldmopt

GROUPS = 32


def _ldmopt_group_norm(backend, x, w, b):
    from ldmopt.ops.group_norm import group_norm

    with ldmopt.use_backend(backend):
        return group_norm(x, GROUPS, w, b, 1e-5, "silu")


def _eager_group_norm(x, w, b):
    return F.silu(F.group_norm(x, GROUPS, w, b, 1e-5))


def _epilogue_reference(z, activation, gate, residual, glu, saturate):
    zd = z.double()
    n = zd.shape[1] // 2 if glu else zd.shape[1]
    if glu:
        out = zd[:, :n] * F.gelu(zd[:, n:])
    else:
        out = F.gelu(zd, approximate="tanh") if activation == "gelu_tanh" else zd
    if gate is not None:
        out = out * gate.double().repeat_interleave(zd.shape[0] // gate.shape[0], dim=0)
    if residual is not None:
        out = out + residual.double().reshape(out.shape)
    if saturate:
        out = out.clamp(-torch.finfo(z.dtype).max, torch.finfo(z.dtype).max)
    return out


def _ldmopt_epilogue(backend, z, activation, gate, residual, kwargs, stats):
    from ldmopt.ops.linear_epilogue import linear_epilogue

    out_stats = torch.empty(2, z.shape[0], device=z.device) if stats else None
    with ldmopt.use_backend(backend):
        y = linear_epilogue(z, activation, gate, residual, z.dtype, out_stats=out_stats, out_eps=1e-6, **kwargs)
    return y, out_stats


def _eager_epilogue(z, activation, gate, residual, kwargs, stats):
    """The unfused modules' passes: diffusers' GELU / GEGLU product, gate product, residual add (and clamp)."""
    n = z.shape[1] // 2 if kwargs["glu"] else z.shape[1]
    out = z[:, :n] * F.gelu(z[:, n:]) if kwargs["glu"] else z
    if activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    if gate is not None:
        out = (out.view(gate.shape[0], -1, n) * gate[:, None]).view(-1, n)
    if residual is not None:
        out = out + residual.reshape(out.shape)
    if kwargs["saturate"]:
        out = out.clamp(-65504, 65504)
    return out


def _ldmopt_conv_epilogue(backend, z, kwargs):
    from ldmopt.ops.conv_epilogue import conv_epilogue

    args = {"temb": None, "gate": None, "shortcut": None, "residual": None, "output_scale": 1.0, **kwargs}
    with ldmopt.use_backend(backend):
        return conv_epilogue(z, args["temb"], args["gate"], args["shortcut"], args["residual"], "none",
                             args["output_scale"], args["out_groups"], 1e-6,
                             out_channel_sums=args.get("out_channel_sums", False))  # fmt: skip


def _attention_reference(q, k, v, scale):
    q, k, v = (t.double().squeeze(2).transpose(1, 2) for t in (q, k, v))  # (B*N, heads, F, head_dim)
    out = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    return out.transpose(1, 2).unsqueeze(2)


def _ldmopt_attention(backend, q, k, v, scale):
    from ldmopt.ops.temporal_attention import temporal_attention

    with ldmopt.use_backend(backend):
        return temporal_attention(q, k, v, scale=scale)


def _eager_attention(q, k, v, scale):
    # What diffusers does today: heads to the front, SDPA, back to (B*N, F, heads*head_dim).
    bn, f, _, h, d = q.shape
    q, k, v = (t.view(bn, f, h, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(bn, f, h * d)
