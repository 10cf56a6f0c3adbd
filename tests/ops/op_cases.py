"""One call of every public op on small fp64 inputs (channels not a power of two, channels-last, gates, residuals,
two-part inputs, rotary tables), shared by the tests that run each op under a mode or transform."""

import torch

from ldmopt import ops


def op_cases():
    """(name, fn(list of inputs) -> output, inputs), fresh inputs each call (seeded)."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x4 = r(2, 12, 5, 3).to(memory_format=torch.channels_last)
    tables = (torch.rand(6, 4, generator=g, dtype=torch.float64), torch.rand(6, 4, generator=g, dtype=torch.float64))
    yield "group_norm", lambda t: ops.group_norm(t[0], 3, t[1], t[2], activation="silu"), [x4, r(12), r(12)]
    yield (
        "gn_silu_conv2d",  # statistics computed by the op from x: derivatives must flow through them
        lambda t: ops.gn_silu_conv2d(t[0], t[1], t[2], 3, 1e-5, t[3], t[4], temb=t[5], residual=t[6]),
        [x4, r(12), r(12), r(7, 12, 3, 3), r(7), r(2, 7), r(2, 7, 5, 3)],
    )
    yield "geglu", lambda t: ops.geglu(t[0], t[1], t[2]), [r(2, 5, 12), r(14, 12), r(14)]
    yield (
        "linear",
        lambda t: ops.linear(t[0], t[1], t[2], activation="gelu_tanh", gate=t[3], residual=t[4]),
        [r(2, 5, 12), r(7, 12), r(7), r(2, 7), r(2, 5, 7)],
    )
    yield (
        "layer_norm_linear",  # statistics from a separate op (layer_norm_stats): they must carry the tangent too
        lambda t: ops.layer_norm_linear(t[0], t[1], t[2], t[3], t[4], activation="gelu"),
        [r(2, 5, 12), 1 + r(12), r(12), r(7, 12), r(7)],
    )
    yield (
        "adaln_modulate",
        lambda t: ops.adaln_modulate(t[0], t[1], t[2], residual=t[3], gate=t[4]),
        [r(2, 5, 12), r(2, 12), r(2, 12), r(2, 5, 12), r(2, 12)],
    )
    yield (
        "rms_norm_rope",
        lambda t: ops.rms_norm(t[0], t[1], rope=tables, rope_layout="pairs", rope_dim=-2),
        [r(6, 8), 1 + r(8)],
    )
    yield (
        "rms_norm_joint",
        lambda t: ops.rms_norm((t[0], t[1]), (t[2], t[3]), cat_dim=1),
        [r(1, 2, 3, 8), r(1, 4, 3, 8), 1 + r(8), 1 + r(8)],
    )
    yield "temporal_attention", lambda t: ops.temporal_attention(t[0], t[1], t[2]), [r(2, 6, 3, 2, 8) for _ in "qkv"]
