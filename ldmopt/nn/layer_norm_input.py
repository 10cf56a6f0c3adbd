"""A LayerNorm's output that the GEMMs after it read through their loads instead of from memory.

diffusers' UNet transformer blocks (``BasicTransformerBlock``, norm_type "layer_norm") hand each LayerNorm's output
to GEMMs only: norm1 to the self-attention's to_q, to_k and to_v, norm2 to the cross-attention's to_q, norm3 to the
feed-forward's first projection (GEGLU or GELU). :class:`NormedInput` stands for ``norm(x)`` in those calls: every
GEMM that can normalises x in its loads (``ops.layer_norm_linear``) from one statistics pass they share, so the
norm's output is never written. Anything else asks for :meth:`NormedInput.tensor`, the norm module's own output,
computed once.

Checked per call (else the stock modules run, the reason counted in ``fallback_reasons``): the norm is exactly
nn.LayerNorm over the last axis with plain parameters and no hooks; each projection is :func:`readable` (a LoRA,
hooks or a quantized weight keep that one projection stock); the feed-forward's first layer is ldmopt's fused GEGLU
or GELU (the feed_forward family) without hooks. Tolerance: ``ops.layer_norm_linear``'s (the norm rounded once to
the weight's dtype, as the stock norm's output is).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..ops.layer_norm_linear import layer_norm_linear, layer_norm_stats
from ..ops.linear_cublas import cublas_gemms
from .child_check import count_reason, count_stock, hooked, observed, plain_weight, readable


def norm_reason(norm: object, x: Tensor, name: str = "norm") -> str | None:
    """Why ``norm(x)`` cannot be read in a GEMM's loads (None when it can)."""
    return _width_reason(norm, x.shape[-1], name)


def _width_reason(norm: object, width: int, name: str) -> str | None:
    if type(norm) is not nn.LayerNorm:
        return f"{name} is {type(norm).__name__}, not nn.LayerNorm"
    if hooked(norm):
        return f"{name} has hooks or a wrapped forward"
    if tuple(norm.normalized_shape) != (width,):
        return f"{name} normalises over {tuple(norm.normalized_shape)}, not the last axis ({width},)"
    if not plain_weight(norm) or not plain_weight(norm, "bias"):
        return f"{name}'s parameters are not plain tensors"
    return None


def fused_norm_eps(norm: object, width: int) -> float | None:
    """The eps for which a producer of ``width``-wide rows should sum their statistics (``layer_norm_stats``) for
    ``norm`` to read next, when norm will be read in GEMM loads (see norm_reason); None when it will not."""
    return norm.eps if _width_reason(norm, width, "norm") is None else None


def sinusoidal_table(pos_embed: object, length: int) -> Tensor | None:
    """diffusers' SinusoidalPositionalEmbedding table for ``length`` positions ([length, C], a view), or None when
    ``pos_embed`` is something else, hooked, or too short (the caller then adds it as a module)."""
    cls = type(pos_embed)
    if cls.__name__ != "SinusoidalPositionalEmbedding" or not cls.__module__.startswith("diffusers."):
        return None
    pe = getattr(pos_embed, "pe", None)
    if hooked(pos_embed) or not isinstance(pe, Tensor) or pe.dim() != 3 or pe.shape[1] < length:
        return None
    return pe[0, :length]


class NormedInput:
    """``norm(x)``, read by the GEMMs after it in their loads (see the module docstring). ``where``: the block's
    class name, for fall-back reasons. ``positions`` = (table [P, C], rows per table row R): a positional embedding
    added to the norm's output, row m of x's rows taking table[(m // R) % P], in the loads too; ``finish`` adds it
    to the norm module's output on the stock path (e.g. the SinusoidalPositionalEmbedding module). ``stats``: x's
    ``layer_norm_stats`` with the norm's eps when its producer summed them (no statistics pass then)."""

    def __init__(
        self,
        norm: nn.Module,
        x: Tensor,
        where: str,
        name: str = "norm",
        positions: tuple[Tensor, int] | None = None,
        finish: Callable[[Tensor], Tensor] | None = None,
        stats: Tensor | None = None,
    ) -> None:
        self.norm, self.x, self.where, self.name = norm, x, where, name
        self.positions, self.finish = positions, finish
        self.reason = norm_reason(norm, x, name)
        self._out: Tensor | None = None
        # Statistics handed over with x (layer_norm_stats(x, norm.eps), e.g. from the residual GEMM that wrote x)
        self._stats: Tensor | None = stats
        self._rows: Tensor | None = None if stats is None else x.reshape(-1, x.shape[-1])
        self._counted = False

    @property
    def shape(self):
        return self.x.shape

    @property
    def device(self) -> torch.device:
        return self.x.device

    def dim(self) -> int:
        return self.x.dim()

    def tensor(self) -> Tensor:
        """The norm module's output (the stock call), computed once."""
        if self._out is None:
            out = self.norm(self.x)
            self._out = out if self.finish is None else self.finish(out)
        return self._out

    def _fused_ok(self) -> bool:
        if self.reason is not None:
            if not self._counted:
                count_reason(self.where, self.reason)
                self._counted = True
            return False
        return self._out is None  # once written (a consumer needed it), GEMMs read it as the stock ones do

    def _statistics(self) -> tuple[Tensor, Tensor]:
        """(x as [M, C] rows, their statistics), once: rows whose leading axes do not merge are copied here, once,
        as the stock norm copies them internally, not by every GEMM."""
        if self._stats is None:
            self._rows = self.x.reshape(-1, self.x.shape[-1])
            with observed(self.norm, (self.x,)):  # a profile attributes the statistics pass to the norm
                self._stats = layer_norm_stats(self._rows, self.norm.eps)
        return self._rows, self._stats

    def _normed_gemm(
        self, modules: Sequence[nn.Module], weight: Tensor, bias: Tensor | None, activation: str | None
    ) -> Tensor:
        rows, stats = self._statistics()
        table, per = self.positions if self.positions is not None else (None, 1)
        with contextlib.ExitStack() as scopes:
            for module in modules:  # a profile attributes the GEMM to the modules it stands for
                scopes.enter_context(observed(module, (self,)))
            y = layer_norm_linear(rows, self.norm.weight, self.norm.bias, weight, bias, eps=self.norm.eps,
                                  activation=activation, stats=stats, positions=table, position_rows=per)  # fmt: skip
        return y.view(*self.x.shape[:-1], y.shape[-1])

    def project(self, layer: nn.Module, name: str) -> Tensor:
        """``layer(norm(x))`` for an nn.Linear ``layer`` (``name``: its path in the block, for the report)."""
        if self._fused_ok():
            if readable(layer):
                return self._normed_gemm((layer,), layer.weight, layer.bias, None)
            count_stock(self.where, name, layer)
        return layer(self.tensor())

    def _joining_pays(self, layers: Sequence[nn.Module]) -> bool:
        """Stacking the weights copies them (read and written: 2 N K elements for N output features in all). With the
        Triton GEMMs, which normalise in their loads, that saves two reads of x (2 M K): it pays for M > N rows.
        Under the cublas placement (ops/linear_cublas.py, GPUs' default) each projection on its own also writes the
        norm's output and reads it back (3 M K with the GEMM's read), so stacking saves 6 M K: it pays for 3 M > N.
        Always in training, where the backward's single norm recomputation and LayerNorm backward save far more."""
        if torch.is_grad_enabled() and any(layer.weight.requires_grad for layer in layers):
            return True
        passes_saved = 3 if cublas_gemms(self.x.device.type) else 1
        return passes_saved * (self.x.numel() // self.x.shape[-1]) > sum(layer.weight.shape[0] for layer in layers)

    def project_all(self, layers: Sequence[nn.Module], names: Sequence[str]) -> list[Tensor]:
        """``[layer(norm(x)) for layer in layers]`` (the self-attention's to_q, to_k, to_v) as ONE GEMM over their
        weights concatenated by rows, whose output columns are split into views: x is read once, the norm formed
        once per tile, one call instead of three, and in backward one recomputation of the norm and one LayerNorm
        backward where three would run and be summed. Layer by layer (:meth:`project`) unless every layer is a
        readable nn.Linear, all with a bias or none, weights of one dtype, and the stacking pays
        (:meth:`_joining_pays`)."""
        if self._fused_ok() and _joinable(layers) and self._joining_pays(layers):
            weights = [layer.weight for layer in layers]
            weight = torch.cat(weights)
            bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
            with _stacked_weight_recomputed(weight, weights):
                y = self._normed_gemm(layers, weight, bias, None)
            return list(y.split([layer.weight.shape[0] for layer in layers], dim=-1))
        return [self.project(layer, name) for layer, name in zip(layers, names)]

    def activate(self, act: nn.Module, name: str) -> Tensor:
        """``act(norm(x))`` for a feed-forward's first layer (``name``: its path, for the report). Read in the loads
        when it is ldmopt's FusedGEGLU or FusedGELU; another layer (the feed_forward family off) gets the norm's
        output, as does a fused one that would itself run stock (it counts why)."""
        from .linear import _GELU_APPROXIMATE, FusedGEGLU, FusedGELU  # nn.linear imports this module

        if type(act) in (FusedGEGLU, FusedGELU) and self._fused_ok():
            if hooked(act):
                count_reason(self.where, f"{name} has hooks or a wrapped forward")
            elif readable(act.proj) and (type(act) is FusedGEGLU or act.approximate in _GELU_APPROXIMATE):
                activation = "geglu" if type(act) is FusedGEGLU else _GELU_APPROXIMATE[act.approximate]
                return self._normed_gemm((act,), act.proj.weight, act.proj.bias, activation)
        return act(self.tensor())


def normed_with_positions(
    norm: nn.Module,
    x: Tensor,
    where: str,
    name: str,
    pos_embed: nn.Module | None,
    length: int,
    rows_per_position: int,
    add_positions: Callable[[Tensor], Tensor],
    stats: Tensor | None = None,
) -> Tensor | NormedInput:
    """``norm(x)``, plus ``pos_embed``'s first ``length`` positions when it is set, as a NormedInput the GEMMs read
    in their loads: row m of x's rows takes position (m // rows_per_position) % length. ``add_positions`` adds them
    to a tensor as the stock path does; a positional embedding that is not diffusers' sinusoidal table (or is
    hooked) is added that way to the norm module's output, so ``add_positions`` must call the module's forward when
    it is hooked (its hooks, e.g. accelerate's offload of the ``pe`` buffer, run there and nowhere else). ``stats``:
    as NormedInput's."""
    if pos_embed is None:
        return NormedInput(norm, x, where, name, stats=stats)
    table = sinusoidal_table(pos_embed, length)
    # Under torch.jit.trace the rows per position are a traced size (a 0-d tensor), which the op's int argument would
    # bake in: the trace adds the positions as the stock path does, valid at every size.
    if table is None or torch._C._get_tracing_state() is not None:
        return add_positions(norm(x))
    return NormedInput(norm, x, where, name, positions=(table, rows_per_position), finish=add_positions, stats=stats)


class _Stacked:
    """What the GEMM's backward gets back for the stacked weight: the parameters, stacked again."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.weights, self.versions = weights, [w._version for w in weights]

    def unpack(self) -> Tensor:
        if [w._version for w in self.weights] != self.versions:
            raise RuntimeError(
                "ldmopt: a projection weight (to_q/to_k/to_v) was modified in place between the forward and the "
                "backward that needs it (as autograd refuses for any saved tensor)"
            )
        return torch.cat(self.weights)


def _stacked_weight_recomputed(weight: Tensor, weights: list[Tensor]):
    """Saved-tensor hooks that keep the parameters instead of their stacked copy for the GEMM's backward (stacked
    again there): the copy would otherwise live until the backward, weights' worth of activation memory per
    attention (0.6 GiB in an SDXL training step). Only outside compiled graphs and where no other saved-tensor hooks
    are active (activation offloading, checkpointing: theirs stay in charge), unless those only watch (marked with
    child_check.observer: benchmarks/saved_activations.py's count), which then see every other saved tensor."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: False)
    if top is None or not torch.is_grad_enabled() or not weight.requires_grad or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    outer = top(False) if enabled() else None
    if not enabled() or (outer is not None and not all(getattr(h, "_ldmopt_observer", False) for h in outer)):
        return contextlib.nullcontext()
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
    storage = weight.untyped_storage()._cdata

    def pack(t: Tensor):
        if t.untyped_storage()._cdata == storage and t.shape == weight.shape:
            return _Stacked(weights)
        return outer_pack(t)

    def unpack(packed):
        return packed.unpack() if isinstance(packed, _Stacked) else outer_unpack(packed)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _joinable(layers: Sequence[nn.Module]) -> bool:
    if len(layers) < 2 or not all(readable(layer) for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    same_bias = all(b is None for b in biases) or all(b is not None and b.dtype == weights[0].dtype for b in biases)
    return same_bias and all(w.dtype == weights[0].dtype and w.device == weights[0].device for w in weights)


def apply(layer: nn.Module, x: Tensor | NormedInput, name: str) -> Tensor:
    """``layer(x)`` for a tensor or a :class:`NormedInput` (whose norm the GEMM then reads in its loads)."""
    return x.project(layer, name) if isinstance(x, NormedInput) else layer(x)


def as_tensor(x: Tensor | NormedInput) -> Tensor:
    """The tensor ``x`` stands for (a NormedInput's norm output, computed once)."""
    return x.tensor() if isinstance(x, NormedInput) else x
