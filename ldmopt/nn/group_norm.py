"""``ldmopt.nn.GroupNorm``: torch.nn.GroupNorm with an optional fused activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops._checks import check_activation
from ..ops.group_norm import SUPPORTED_ACTIVATIONS, group_norm


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` (same parameters, same state_dict keys) computed by ldmopt, optionally followed by a
    fused activation (``activation="silu"`` computes ``silu(group_norm(x))`` in one pass)."""

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
        **kwargs,
    ) -> None:
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        # **kwargs: newer torch's keyword-only arguments (bias=False: a weight without a bias).
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype, **kwargs)
        self.activation = activation

    @classmethod
    def from_module(cls, module: torch.nn.GroupNorm, activation: str | None = None) -> GroupNorm:
        """A GroupNorm sharing ``module``'s parameters (no copies)."""
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.num_groups, new.num_channels, new.eps, new.affine = (
            module.num_groups,
            module.num_channels,
            module.eps,
            module.affine,
        )
        new.weight, new.bias = module.weight, module.bias
        new.activation = activation
        return new

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() >= 2 and x.shape[1] != self.num_channels:  # named as the module's setting, not its weight's shape
            raise ValueError(
                f"{type(self).__name__}(num_groups={self.num_groups}, num_channels={self.num_channels}) got an input "
                f"of shape {tuple(x.shape)} with {x.shape[1]} channels"
            )
        if x.numel() == 0:  # an empty batch (the ops refuse it): torch's result, as the stock module returns
            y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
            return F.silu(y) if self.activation == "silu" else y
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")
