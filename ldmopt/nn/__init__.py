"""Drop-in nn.Modules backed by ldmopt's fused ops (same parameters and state_dict keys as the modules they replace)."""

from .group_norm import GroupNorm
from .layer_norm_linear import FusedLayerNormLinear
from .linear import (
    FusedAdaLayerNormContinuous,
    FusedAdaLayerNormZero,
    FusedAdaLayerNormZeroSingle,
    FusedGEGLU,
    FusedGELU,
    FusedLinear,
)
from .resnet import FusedResnetBlock2D, fused_resnet_forward
from .temporal_attention import (
    SingleKeyAttnProcessor,
    TemporalAttnProcessor,
    find_single_key_cross_attention,
    find_temporal_attention,
    install_processors,
    uninstall_processors,
)
from .temporal_layout import (
    TemporalBlockBFNC,
    TemporalContainerBFNC,
    install_temporal_blocks,
    uninstall_temporal_blocks,
)

__all__ = [
    "FusedAdaLayerNormContinuous",
    "FusedAdaLayerNormZero",
    "FusedAdaLayerNormZeroSingle",
    "FusedGEGLU",
    "FusedGELU",
    "FusedLayerNormLinear",
    "FusedLinear",
    "FusedResnetBlock2D",
    "GroupNorm",
    "SingleKeyAttnProcessor",
    "TemporalAttnProcessor",
    "TemporalBlockBFNC",
    "TemporalContainerBFNC",
    "find_single_key_cross_attention",
    "find_temporal_attention",
    "fused_resnet_forward",
    "install_processors",
    "install_temporal_blocks",
    "uninstall_processors",
    "uninstall_temporal_blocks",
]
