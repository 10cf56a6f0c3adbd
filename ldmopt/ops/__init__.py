"""Public fused ops. Each is a ``torch.library.custom_op`` in the ``ldmopt`` namespace with a fake (meta)
implementation, autograd, and a backend table (cuda -> triton -> torch) consulted on real tensors."""

from . import (
    conv_epilogue,  # noqa: F401  (registers the conv epilogue's backend table, which use_backend(ops=...) names)
    gn_conv2d_backward,  # noqa: F401  (registers ldmopt::gn_conv2d's autograd)
    linear_stats,  # noqa: F401  (registers ldmopt::linear_stats_fwd, which ops.linear calls)
)
from ._dispatch import BackendUnavailableError, backend_counts, use_backend
from .adaln_modulate import adaln_modulate
from .geglu import geglu
from .gn_conv2d import gn_silu_conv2d
from .group_norm import group_norm
from .layer_norm_linear import layer_norm_linear, layer_norm_stats
from .linear import linear
from .rms_norm import layer_norm_rope, rms_norm
from .rms_norm_joint import rms_norm_joint
from .temporal_attention import temporal_attention

__all__ = [
    "BackendUnavailableError",
    "adaln_modulate",
    "backend_counts",
    "geglu",
    "gn_silu_conv2d",
    "group_norm",
    "layer_norm_linear",
    "layer_norm_rope",
    "layer_norm_stats",
    "linear",
    "rms_norm",
    "rms_norm_joint",
    "temporal_attention",
    "use_backend",
]
