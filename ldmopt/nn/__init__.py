"""Drop-in nn.Modules backed by ldmopt's fused ops (same parameters and state_dict keys as the modules they replace)."""

from .group_norm import GroupNorm

__all__ = ["GroupNorm"]
