"""``FusedLayerNormLinear``: nn.LayerNorm followed by nn.Linear (and an activation, or GEGLU) as one GEMM that reads
the norm in its loads (``ldmopt.ops.layer_norm_linear``), for training scripts and hand-written blocks."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops._checks import check_activation
from ..ops.layer_norm_linear import SUPPORTED_ACTIVATIONS, layer_norm_linear
from ..ops.linear import activation_torch
from .child_check import count_reason, readable, unreadable_reason
from .layer_norm_input import norm_reason


class FusedLayerNormLinear(nn.Module):
    """``act(proj(norm(x)))`` with the LayerNorm formed in the GEMM's loads: its output is never written.

    Submodules ``norm`` (nn.LayerNorm over ``in_features``) and ``proj`` (nn.Linear), so the state_dict keys are
    ``norm.weight``, ``norm.bias``, ``proj.weight``, ``proj.bias``. ``activation``: None, "gelu", "gelu_tanh",
    "silu", or "geglu" (diffusers' GEGLU: ``proj`` has ``2 * out_features`` rows, value rows first, and the output
    is ``h * gelu(g)``). ``forward(x, stats=None)``: ``stats`` from :func:`ldmopt.ops.layer_norm_stats` of the same
    x and eps shares one statistics pass between several such layers reading one norm (q, k and v: build them with
    :meth:`from_modules` and one shared ``norm``). Tolerance: ``ops.layer_norm_linear``'s (the norm rounded once to
    the weight's dtype, as the unfused norm's output is). Checked on every call: a ``proj`` wrapped by a LoRA or
    quantizer, hooks on either submodule or a replaced ``norm`` run the submodules' own forwards instead (counted in
    the patch report's fall-backs), as does an empty ``x``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        rows = 2 * out_features if activation == "geglu" else out_features
        affine = elementwise_affine
        self.norm = nn.LayerNorm(in_features, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
        self.proj = nn.Linear(in_features, rows, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    @classmethod
    def from_modules(cls, norm: nn.LayerNorm, proj: nn.Linear, activation: str | None = None) -> FusedLayerNormLinear:
        """A FusedLayerNormLinear sharing ``norm`` and ``proj`` (no copies): exactly nn.LayerNorm over the last axis
        and nn.Linear of matching width."""
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        if type(norm) is not nn.LayerNorm or len(norm.normalized_shape) != 1:
            raise TypeError(f"FusedLayerNormLinear.from_modules: norm must be nn.LayerNorm over one axis, got {norm}")
        if type(proj) is not nn.Linear or proj.in_features != norm.normalized_shape[0]:
            raise TypeError(
                f"FusedLayerNormLinear.from_modules: proj must be an nn.Linear with in_features="
                f"{norm.normalized_shape[0]}, got {proj}"
            )
        if activation == "geglu" and proj.out_features % 2:
            raise ValueError(f"FusedLayerNormLinear.from_modules: GEGLU needs an even proj.out_features, got {proj}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.norm, new.proj, new.activation = norm, proj, activation
        return new

    def forward(self, x: Tensor, stats: Tensor | None = None) -> Tensor:
        norm, proj = self.norm, self.proj
        if x.numel():  # the ops refuse empty inputs; the stock modules return them
            reason = norm_reason(norm, x)
            if reason is None and not readable(proj):
                reason = unreadable_reason("proj", proj)
            if reason is None:
                return layer_norm_linear(x, norm.weight, norm.bias, proj.weight, proj.bias, eps=norm.eps,
                                         activation=self.activation, stats=stats)  # fmt: skip
            # A LoRA or quantized layer, hooks (accelerate offload), a replaced norm: the modules must run.
            count_reason("FusedLayerNormLinear", reason)
        return self._stock(x)

    def _stock(self, x: Tensor) -> Tensor:
        """``act(proj(norm(x)))`` through the submodules' own forwards."""
        h = self.proj(self.norm(x))
        if self.activation == "geglu":
            value, gate = h.chunk(2, dim=-1)
            return value * F.gelu(gate)
        return activation_torch(self.activation, h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
