"""Drop-in modules for diffusers' feed-forward projections and adaLN norms, backed by ldmopt's fused linear ops.

| diffusers module (0.42)                                  | ldmopt module                | state_dict keys      |
|----------------------------------------------------------|------------------------------|----------------------|
| ``GEGLU`` (``FeedForward.net[0]`` in SD/SDXL/SVD UNets)  | ``FusedGEGLU``               | proj.weight, .bias   |
| ``GELU`` (``approximate`` "tanh" or "none"; DiT, PixArt) | ``FusedGELU``                | proj.weight, .bias   |
| ``nn.Linear`` + activation / gated residual (Flux        | ``FusedLinear``              | weight, bias         |
| ``proj_mlp`` + ``act_mlp``, DiT ``to_out`` / ``ff``)     |                              |                      |
| ``AdaLayerNormZero``                                     | ``FusedAdaLayerNormZero``    | emb.*, linear.*      |
| ``AdaLayerNormZeroSingle``                               | ``FusedAdaLayerNormZeroSingle`` | linear.*          |
| ``AdaLayerNormContinuous`` (layer_norm, no affine)       | ``FusedAdaLayerNormContinuous`` | linear.*          |

Every class has ``from_module(module)``, which shares the module's parameters and submodules (no copies, same
state_dict keys, checkpoints load unchanged), and ``unsupported_reason(module) -> str | None``, which the patcher asks
first: a LoRA/PEFT-wrapped or quantized projection (anything but a plain ``nn.Linear``), or a projection with forward
hooks (accelerate offload), stays on the stock path with that reason. The forward signatures match diffusers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops._checks import check_activation
from ..ops.adaln_modulate import adaln_modulate
from ..ops.geglu import geglu
from ..ops.linear import SUPPORTED_ACTIVATIONS, activation_torch, linear
from .child_check import count_reason, count_stock, hooked, plain_weight, qualified_name, readable
from .layer_norm_input import NormedInput, as_tensor

_GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}


def diffusers_module_reason(module: nn.Module, class_name: str, fused: type, methods=("forward",)) -> str | None:
    """None when ``module`` computes what diffusers' ``class_name`` does: that class, a subclass keeping its
    ``methods``, or ldmopt's ``fused`` stand-in; otherwise why not. A module with the same children but another
    computation (SwiGLU's SiLU gate, a plain GELU for GEGLU) must not be converted."""
    if isinstance(module, fused):
        return None
    cls = type(module)
    for base in cls.__mro__:
        if base.__name__ == class_name and base.__module__.startswith("diffusers."):
            changed = [m for m in methods if getattr(cls, m, None) is not getattr(base, m, None)]
            return f"{cls.__name__} overrides {class_name}.{changed[0]}" if changed else None
    return f"{cls.__module__}.{cls.__qualname__} is not diffusers' {class_name}"


def plain_linear_reason(name: str, layer: object) -> str | None:
    """Why ``layer`` cannot be read as a bare (weight, bias) pair, or None when it can."""
    if type(layer) is not nn.Linear:
        kind = qualified_name(type(layer))
        return f"{name} is a {kind}, not a plain nn.Linear (LoRA/quantized layers keep the stock path)"
    if hooked(layer):  # ldmopt's own observers (the profiler's module scopes) aside: they only watch
        return f"{name} has hooks or a wrapped forward (e.g. accelerate offload) that a fused kernel would bypass"
    if not layer.weight.is_floating_point():
        return f"{name}.weight has dtype {layer.weight.dtype}"
    return None


def plain_layer_norm_reason(name: str, norm: object) -> str | None:
    """Why ``norm`` is not the affine-free nn.LayerNorm that adaLN blocks modulate (None when it is)."""
    if type(norm) is not nn.LayerNorm:
        return f"{name} is a {qualified_name(type(norm))}, not a plain nn.LayerNorm"
    if norm.weight is not None or norm.bias is not None:
        return f"{name} has affine parameters (adaLN blocks use LayerNorm without them)"
    return None


def feed_forward_shape_reason(ff: object, name: str = "ff") -> str | None:
    """Why ``ff`` is not laid out as diffusers' FeedForward [act, dropout, Linear] (None when it is)."""
    net = getattr(ff, "net", None)
    if not isinstance(net, nn.ModuleList) or len(net) != 3:
        return f"{name} is not [act, dropout, Linear] (final_dropout or a custom feed-forward)"
    return None


def feed_forward_reasons(ff: object, name: str = "ff") -> list[str]:
    """Why a diffusers FeedForward cannot end in :func:`ff_gated_residual`'s GEMM epilogue (empty when it can);
    ``name``: its attribute in the block, for the messages."""
    reason = feed_forward_shape_reason(ff, name) or plain_linear_reason(f"{name}.net.2", ff.net[2])
    return [reason] if reason else []


def stock_gated_residual(y: Tensor, gate: Tensor | None, residual: Tensor | None) -> Tensor:
    """``residual + gate * y`` as diffusers computes it, gate shaped as :func:`ldmopt.ops.linear` takes it (either
    may be None)."""
    if gate is not None:
        if y.dim() > 2:
            gate = gate.reshape(gate.shape[0], *([1] * (y.dim() - 2)), gate.shape[-1])
        y = gate * y
    return y if residual is None else residual + y


def gated_residual_linear(
    layer: nn.Module,
    x: Tensor | tuple[Tensor, Tensor],
    gate: Tensor,
    residual: Tensor,
    where: str,
    name: str,
    out_dtype=None,
    clip_fp16: bool = False,
) -> Tensor:
    """``residual + gate * layer(x)``: one GEMM with the bias, gate and residual in its epilogue while ``layer`` is a
    plain nn.Linear, else ``layer``'s own forward and the stock ops (see child_check). ``x``: a tensor, or two read as
    their concatenation along channels (the GEMM reads them in place; the stock path concatenates). ``out_dtype``:
    the result's dtype (the stock path computes in the promoted dtype, then casts, as Wan's ``.type_as(h)``).
    ``clip_fp16``: an fp16 result clipped to [-65504, 65504] as Flux clips its stream (in the epilogue when fused)."""
    if readable(layer):
        return linear(x, layer.weight, layer.bias, gate=gate, residual=residual, out_dtype=out_dtype,
                      clip_fp16=clip_fp16)  # fmt: skip
    count_stock(where, name, layer)
    out = stock_gated_residual(layer(x if isinstance(x, Tensor) else torch.cat(x, dim=-1)), gate, residual)
    out = out if out_dtype is None else out.to(out_dtype)
    return out.clip(-65504, 65504) if clip_fp16 and out.dtype == torch.float16 else out


def ff_gated_residual(
    ff: nn.Module, x: Tensor | NormedInput, gate: Tensor, residual: Tensor, name: str = "ff", out_dtype=None,
    clip_fp16: bool = False,
) -> Tensor:  # fmt: skip
    """``residual + gate * ff(x)`` with the output projection's bias, gate and residual in one GEMM epilogue
    (``name``: the feed-forward's attribute in its block, for the report; ``out_dtype`` and ``clip_fp16`` as in
    gated_residual_linear). ``x`` may be a NormedInput (ldmopt.nn.layer_norm_input): the first projection then reads
    the norm in its loads."""
    h = _ff_hidden(ff, x, name)
    return gated_residual_linear(ff.net[2], h, gate, residual, "FeedForward", f"{name}.net.2", out_dtype, clip_fp16)


def _ff_hidden(ff: nn.Module, x: Tensor | NormedInput, name: str) -> Tensor:
    """What ``ff.net[2]`` reads: net[1](net[0](x)), the first projection reading a NormedInput's norm in its loads."""
    first = x.activate(ff.net[0], f"{name}.net.0") if isinstance(x, NormedInput) else ff.net[0](x)
    return ff.net[1](first)


def ff_residual(ff: nn.Module, x: Tensor | NormedInput, residual: Tensor) -> Tensor:
    """``ff(x) + residual``, the add in ``ff.net[2]``'s GEMM epilogue when ``ff`` is diffusers' FeedForward
    [act, dropout, Linear] without hooks, checked per call (else the stock call and add: final_dropout, a hooked or
    replaced feed-forward; a wrapped ``net[2]`` is counted in ``fallback_reasons`` by ff_gated_residual)."""
    return ff_residual_and_stats(ff, x, residual)[0]


def ff_residual_and_stats(
    ff: nn.Module, x: Tensor | NormedInput, residual: Tensor, next_norm_eps: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """(:func:`ff_residual`, the output rows' ``layer_norm_stats`` for ``next_norm_eps`` summed in ``net[2]``'s
    epilogue when asked for and the fused GEMM runs; None otherwise)."""
    # Structure only: a wrapped or hooked net[2] is gated_residual_linear's per-call check (which, unlike the
    # patch-time feed_forward_reasons, lets the profiler's observer hooks through).
    if type(ff).__name__ != "FeedForward":
        reason = f"ff is {type(ff).__name__}, not diffusers' FeedForward"
    else:
        reason = feed_forward_shape_reason(ff) or ("ff has hooks or a wrapped forward" if hooked(ff) else None)
    if reason is not None:
        count_reason("FeedForward", reason)
        return ff(as_tensor(x)) + residual, None
    if next_norm_eps is None or not readable(ff.net[2]):
        return ff_gated_residual(ff, x, None, residual), None
    out = ff.net[2]
    return linear(_ff_hidden(ff, x, "ff"), out.weight, out.bias, residual=residual, next_norm_eps=next_norm_eps)


def _stock_gelu(x: Tensor, approximate: str) -> Tensor:
    """diffusers' GELU/GEGLU activation, including its fp32 upcast of fp16 on MPS (the stock fall-back path)."""
    if x.device.type == "mps" and x.dtype == torch.float16:
        return F.gelu(x.float(), approximate=approximate).to(x.dtype)
    return F.gelu(x, approximate=approximate)


def _shell(cls):
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    return new


class FusedGEGLU(nn.Module):
    """diffusers ``GEGLU`` (``h, g = proj(x).chunk(2, -1); h * gelu(g)``, erf GELU) as one GEMM writing I columns.

    Same submodule ``proj`` = nn.Linear(dim_in, 2 * dim_out), so state_dict keys are ``proj.weight``/``proj.bias``.
    Tolerance: within 2x the error of diffusers' GEGLU in the input dtype (fp32 accumulation and epilogue).
    """

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias, device=device, dtype=dtype)

    @staticmethod
    def unsupported_reason(module: nn.Module) -> str | None:
        reason = diffusers_module_reason(module, "GEGLU", FusedGEGLU, ("forward", "gelu"))
        reason = reason or plain_linear_reason("proj", getattr(module, "proj", None))
        if reason is None and module.proj.out_features % 2:
            reason = f"proj has {module.proj.out_features} output features, not an even count"
        return reason

    @classmethod
    def from_module(cls, module: nn.Module) -> FusedGEGLU:
        """A FusedGEGLU sharing ``module.proj`` (a diffusers GEGLU's projection; no copies)."""
        reason = cls.unsupported_reason(module)
        if reason:
            raise TypeError(f"FusedGEGLU.from_module: {reason}")
        new = _shell(cls)
        new.proj = module.proj
        return new

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        # *args/**kwargs: diffusers' deprecated `scale` argument, ignored as diffusers ignores it.
        if hidden_states.numel():  # the ops refuse empty inputs; the stock path returns them
            if readable(self.proj):
                return geglu(hidden_states, self.proj.weight, self.proj.bias)
            count_stock("GEGLU", "proj", self.proj)
        h, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return h * _stock_gelu(gate, "none")


class FusedGELU(nn.Module):
    """diffusers ``GELU`` (``gelu(proj(x), approximate)``) as one GEMM with a bias + GELU epilogue.

    Same submodule ``proj`` and attribute ``approximate`` ("none" = erf, "tanh"). Tolerance: within 2x the error of
    diffusers' GELU module in the input dtype.
    """

    def __init__(
        self, dim_in: int, dim_out: int, approximate: str = "none", bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        if approximate not in _GELU_APPROXIMATE:
            raise ValueError(f"approximate={approximate!r} is not supported; expected one of {list(_GELU_APPROXIMATE)}")
        self.proj = nn.Linear(dim_in, dim_out, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    @staticmethod
    def unsupported_reason(module: nn.Module) -> str | None:
        reason = diffusers_module_reason(module, "GELU", FusedGELU, ("forward", "gelu"))
        if reason:
            return reason
        approximate = getattr(module, "approximate", None)
        if approximate not in _GELU_APPROXIMATE:
            return f"approximate={approximate!r} (supported: {list(_GELU_APPROXIMATE)})"
        return plain_linear_reason("proj", getattr(module, "proj", None))

    @classmethod
    def from_module(cls, module: nn.Module) -> FusedGELU:
        """A FusedGELU sharing ``module.proj`` (a diffusers GELU's projection; no copies)."""
        reason = cls.unsupported_reason(module)
        if reason:
            raise TypeError(f"FusedGELU.from_module: {reason}")
        new = _shell(cls)
        new.proj = module.proj
        new.approximate = module.approximate
        return new

    def forward(self, hidden_states: Tensor) -> Tensor:
        if hidden_states.numel():  # the ops refuse empty inputs; the stock path returns them
            if readable(self.proj):
                activation = _GELU_APPROXIMATE[self.approximate]
                return linear(hidden_states, self.proj.weight, self.proj.bias, activation=activation)
            count_stock("GELU", "proj", self.proj)
        return _stock_gelu(self.proj(hidden_states), self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class FusedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and keys) with a fused epilogue: ``residual + gate[b] * act(x W^T + b)``.

    ``activation`` (None, "gelu", "gelu_tanh", "silu") is fixed at construction; ``gate`` and ``residual`` are
    optional forward arguments (see :func:`ldmopt.ops.linear` for their shapes). Use it for Flux single blocks
    (``proj_mlp`` with ``activation="gelu_tanh"``, replacing ``act_mlp`` by nn.Identity) or a DiT block's gated
    residual (``to_out[0](attn, gate=gate_msa, residual=hidden_states)``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        self.activation = activation

    @staticmethod
    def unsupported_reason(module: nn.Module) -> str | None:
        return plain_linear_reason("the layer", module)

    @classmethod
    def from_module(cls, module: nn.Linear, activation: str | None = None) -> FusedLinear:
        """A FusedLinear sharing ``module``'s weight and bias (no copies)."""
        reason = cls.unsupported_reason(module)
        if reason:
            raise TypeError(f"FusedLinear.from_module: {reason}")
        check_activation("activation", activation, SUPPORTED_ACTIVATIONS)
        new = _shell(cls)
        new.in_features, new.out_features = module.in_features, module.out_features
        new.weight, new.bias = module.weight, module.bias
        new.activation = activation
        return new

    def forward(self, x: Tensor, *, gate: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        return self.compute(x, self.activation, gate, residual)

    def compute(self, x: Tensor, activation: str | None, gate: Tensor | None, residual: Tensor | None) -> Tensor:
        """The fused GEMM, or with a weight that is a tensor subclass (a quantized weight, whose own F.linear must
        run) the unfused ops."""
        if x.numel():  # the ops refuse empty inputs; torch returns them
            if plain_weight(self):
                return linear(x, self.weight, self.bias, activation=activation, gate=gate, residual=residual)
            count_stock("FusedLinear", "the layer", self)
        return stock_gated_residual(activation_torch(activation, F.linear(x, self.weight, self.bias)), gate, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")


#: diffusers' FP32LayerNorm: torch's LayerNorm computed in fp32, as the row kernels compute any dtype.
_FP32_LAYER_NORM = ("diffusers.models.normalization", "FP32LayerNorm")


def _row_kernel_layer_norm(norm: object) -> bool:
    """Whether the adaLN row kernels compute ``norm`` exactly: torch's LayerNorm or diffusers' FP32LayerNorm. Any
    other subclass (ModelOpt's QuantLayerNorm) computes more. Compared by name: no diffusers import per call."""
    cls = type(norm)
    return cls is nn.LayerNorm or (cls.__module__, cls.__name__) == _FP32_LAYER_NORM


def _layer_norm_eps(norm: object) -> tuple[float | None, str | None]:
    """(eps, None) for a LayerNorm without affine parameters over the last dim, else (None, reason)."""
    if not _row_kernel_layer_norm(norm):
        return None, f"norm is {qualified_name(type(norm))}, not torch's LayerNorm (RMSNorm, subclasses: not fused)"
    if norm.weight is not None or norm.bias is not None:
        return None, "norm has affine parameters (ldmopt fuses LayerNorm without affine, as in adaLN)"
    if len(norm.normalized_shape) != 1:
        return None, f"norm normalizes over {tuple(norm.normalized_shape)}, not one channel dim"
    return float(norm.eps), None


def modulation_batch_reason(x: Tensor, *modulations: Tensor | None) -> str | None:
    """Why the row kernels cannot take these per-sample modulations for ``x``: a batch other than x's (or 1), which
    the stock expression broadcasts (x of batch 1 against a modulation of batch N gives N samples: diffusers' caches
    that halve the token batch but not the conditioning do this)."""
    for t in modulations:
        if t is not None and t.dim() >= 1 and t.shape[0] not in (1, x.shape[0]):
            return f"modulation batch {t.shape[0]} for a token batch {x.shape[0]} (broadcast by the stock expression)"
    return None


class _FusedAdaLN(nn.Module):
    """Shared construction for the adaLN norms: keep ``silu``, ``linear``, ``norm`` (and ``emb``) as they are.

    ``FusedX(*args, **kwargs)`` takes diffusers' ``X`` arguments (it builds that module and adopts its submodules);
    ``FusedX.from_module(module)`` adopts an existing one's."""

    _submodules = ("silu", "linear", "norm")

    def __init__(self, *args, **kwargs) -> None:
        from diffusers.models import normalization

        stock_name = type(self).__name__.removeprefix("Fused")
        stock = getattr(normalization, stock_name)(*args, **kwargs)
        super().__init__()
        self._adopt(stock)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        missing = [name for name in cls._submodules if not hasattr(module, name)]
        if missing:
            return f"{type(module).__name__} has no {missing}"
        return _layer_norm_eps(module.norm)[1]

    @classmethod
    def from_module(cls, module: nn.Module):
        """A fused norm sharing every submodule of ``module`` (no copies, same state_dict keys)."""
        new = _shell(cls)
        new._adopt(module, "from_module")
        return new

    @property
    def eps(self) -> float | None:
        """The epsilon of ``self.norm`` as it is now (None when it is no longer a LayerNorm the kernel reproduces)."""
        return _layer_norm_eps(self.norm)[0]

    def modulate(self, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
        """``norm(x) * (1 + scale) + shift`` in one row kernel; through ``self.norm``'s own call (and the stock ops)
        when ``norm`` changed after patching in a way the kernel would not reproduce: replaced by another norm (affine,
        RMSNorm ...), or given hooks or a wrapped forward. Its eps is read per call."""
        eps, reason = _layer_norm_eps(self.norm)
        width = getattr(self.norm, "normalized_shape", (x.shape[-1],))
        if reason is None and tuple(width) != (x.shape[-1],):  # named as the norm's setting, as torch names it
            raise ValueError(
                f"{type(self).__name__}: norm has normalized_shape={list(width)} but x has shape {tuple(x.shape)}"
            )
        if reason is None and hooked(self.norm):
            reason = "norm has hooks or a wrapped forward"
        if reason is None and not x.numel():
            reason = "empty input (the fused ops need at least one element)"
        if reason is None:
            reason = modulation_batch_reason(x, scale, shift)
        if reason is not None:
            count_reason(type(self).__name__, reason)
            return self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        wider = torch.promote_types(x.dtype, torch.promote_types(scale.dtype, shift.dtype))
        if wider != x.dtype:  # the stock expression returns the promoted dtype (fp16 stream, fp32 modulation: fp32)
            x = x.to(wider)
        return adaln_modulate(x, scale, shift, eps=eps)

    def _adopt(self, module: nn.Module, how: str = "__init__") -> None:
        reason = self.unsupported_reason(module)
        if reason:
            raise TypeError(f"{type(self).__name__}.{how}: {reason}")
        for name in self._submodules:
            setattr(self, name, getattr(module, name))


class FusedAdaLayerNormZero(_FusedAdaLN):
    """diffusers ``AdaLayerNormZero`` with ``norm(x) * (1 + scale_msa) + shift_msa`` in one row kernel.

    Returns ``(x, gate_msa, shift_mlp, scale_mlp, gate_mlp)`` as diffusers does.
    """

    _submodules = ("emb", "silu", "linear", "norm")

    def forward(
        self,
        x: Tensor,
        timestep: Tensor | None = None,
        class_labels: torch.LongTensor | None = None,
        hidden_dtype: torch.dtype | None = None,
        emb: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        return self.modulate(x, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class FusedAdaLayerNormZeroSingle(_FusedAdaLN):
    """diffusers ``AdaLayerNormZeroSingle`` (Flux single blocks): returns ``(x, gate_msa)``."""

    def forward(self, x: Tensor, emb: Tensor | None = None) -> tuple[Tensor, Tensor]:
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return self.modulate(x, scale_msa, shift_msa), gate_msa


class FusedAdaLayerNormContinuous(_FusedAdaLN):
    """diffusers ``AdaLayerNormContinuous`` with ``norm_type="layer_norm"`` and no affine (SD3, Flux ``norm_out``)."""

    def forward(self, x: Tensor, conditioning_embedding: Tensor) -> Tensor:
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        return self.modulate(x, scale, shift)
