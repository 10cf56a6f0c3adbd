"""Public fused ops. Each is a ``torch.library.custom_op`` in the ``ldmopt`` namespace with a fake (meta)
implementation, autograd, and a backend table (cuda -> triton -> torch) consulted on real tensors."""

from ._dispatch import BackendUnavailableError, backend_counts, use_backend
from .gn_conv2d import gn_silu_conv2d
from .group_norm import group_norm

__all__ = ["BackendUnavailableError", "backend_counts", "gn_silu_conv2d", "group_norm", "use_backend"]
