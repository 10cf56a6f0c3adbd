"""Drop-in nn.Modules backed by ldmopt's fused ops (same parameters and state_dict keys as the modules they replace)."""

from .group_norm import GroupNorm
from .resnet import FusedResnetBlock2D, fused_resnet_forward

__all__ = ["FusedResnetBlock2D", "GroupNorm", "fused_resnet_forward"]
