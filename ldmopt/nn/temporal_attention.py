"""diffusers attention processors for temporal attention, and the functions that install them per module.

- :class:`TemporalAttnProcessor` runs ``ldmopt.ops.temporal_attention`` on strided views of the projections:
  ``to_q(x)`` of shape (B*N, F, C) is read as (B*N, F, 1, heads, head_dim), a fused ``to_qkv(x)`` as three slices
  of (B*N, F, 3, heads, head_dim); the result comes back as (B*N, F, C) for ``to_out`` with no permute and no copy.
  It computes what the processor it replaces computes (:func:`stock_semantics`): AttnProcessor2_0 and its fused
  variant apply per-head ``norm_q``/``norm_k`` and SDPA's default scale (ignoring ``Attention.scale``), AttnProcessor
  and XFormersAttnProcessor apply ``Attention.scale`` and no q/k norms; ``residual_connection``,
  ``rescale_output_factor``, ``norm_cross`` and fused projections (``to_qkv``/``to_kv``) as diffusers does.
  Anything else runs the module's previous (stock) processor, and the reason is counted in ``fallback_reasons``.
- :class:`SingleKeyAttnProcessor` is the exact shortcut for cross-attention over ONE key (every ``attn2`` of Stable
  Video Diffusion): softmax over one score is 1, so the output is ``to_out(to_v(context))`` broadcast over queries.

Interface for the patcher (``ldmopt.patch``):

- ``find_temporal_attention(model) -> list[(name, Attention)]``: the self-attention modules over frames (AnimateDiff
  ``motion_modules``, UNet3D/I2VGen ``transformer_in`` and ``temp_attentions``, SVD and Latte
  ``temporal_transformer_blocks``), in ``named_modules`` order, names relative to ``model``;
- ``find_single_key_cross_attention(model) -> list[(name, Attention)]``: SVD's ``attn2`` modules;
- ``unsupported_reason(attn) -> str | None``: why a module must keep its stock processor (static checks; per-call
  conditions such as masks fall back inside the processor);
- ``install_processors(model, temporal=True, single_key=True) -> ProcessorInstall`` sets one processor per module
  with ``Attention.set_processor``, keeping the previous processor object as the fallback and in
  ``ProcessorInstall.previous`` (name -> processor), the new ones in ``.installed``, ``.skipped`` maps name ->
  reason, ``.report()`` counts kernel calls and fallback reasons per module;
- ``uninstall_processors(install)`` puts every previous processor object back (identity preserved); idempotent.

Whole temporal blocks and containers run in (B, F, N, C) order, with no permuted copy at all, live in
``ldmopt.nn.temporal_layout``.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..ops.temporal_attention import MAX_FRAMES, MAX_HEAD_DIM, temporal_attention
from .attention_residual import project_out_and_stats
from .child_check import (
    bypassed_hook_reason,
    counting,
    dropout_reason,
    function_mode_reason,
    hooked,
    hooked_children,
    tally,
)
from .layer_norm_input import NormedInput, apply

#: Container class name -> attribute holding its temporal blocks (None: every Attention under the container).
TEMPORAL_CONTAINERS = {
    "AnimateDiffTransformer3D": None,
    "TransformerTemporalModel": None,
    "TransformerSpatioTemporalModel": "temporal_transformer_blocks",
    "LatteTransformer3DModel": "temporal_transformer_blocks",
}
#: Containers whose cross-attention (``attn2``) always has one key: SVD's image embedding.
SINGLE_KEY_CONTAINERS = ("TransformerSpatioTemporalModel",)
#: Processors the kernels may replace; anything else (IP-Adapter, custom LoRA processors, ...) stays.
STOCK_PROCESSORS = ("AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "XFormersAttnProcessor")


def _is_attention(module: nn.Module) -> bool:
    from diffusers.models.attention_processor import Attention

    return isinstance(module, Attention)


def _default_processor(attn):
    """The processor diffusers gives ``attn`` when built without one (Attention.__init__): AttnProcessor2_0 for the
    default scale, else AttnProcessor (which honours ``attn.scale``)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    return AttnProcessor2_0() if attn.scale_qk else AttnProcessor()


def _per_head_norm(norm: nn.Module | None, head_dim: int) -> bool:
    """True when a q/k norm acts over the last axis of size head_dim (as the stock processors apply it)."""
    if isinstance(norm, nn.LayerNorm):
        return tuple(norm.normalized_shape) == (head_dim,)
    if type(norm).__name__ == "RMSNorm" and hasattr(norm, "dim"):
        return tuple(norm.dim) == (head_dim,)
    return type(norm).__name__ == "LpNorm" and getattr(norm, "dim", None) == -1


def _head_dim(attn) -> int:
    return attn.inner_dim // attn.heads


def unsupported_reason(attn) -> str | None:
    """Why ``attn`` cannot run :class:`TemporalAttnProcessor` at all (None when it can)."""
    if attn.spatial_norm is not None:
        return "spatial_norm on the input"
    if attn.group_norm is not None:
        return "group_norm on the input"
    if attn.added_kv_proj_dim is not None or attn.only_cross_attention:
        return "added key/value projections"
    if attn.to_out is None or attn.to_k is None:
        return "no output or key projection (pre_only / only_cross_attention)"
    if attn.inner_kv_dim != attn.inner_dim:
        return f"grouped key/value heads (kv dim {attn.inner_kv_dim} != {attn.inner_dim})"
    if attn.inner_dim % attn.heads:
        return f"inner_dim {attn.inner_dim} not divisible by heads {attn.heads}"
    if getattr(attn, "is_causal", False):
        return "causal attention"
    if _head_dim(attn) > MAX_HEAD_DIM:
        return f"head_dim {_head_dim(attn)} > {MAX_HEAD_DIM}"
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name)
        if norm is not None and not _per_head_norm(norm, _head_dim(attn)):
            return f"{name} ({type(norm).__name__}) is not a per-head norm over head_dim"
    return None


#: Stock processors that call SDPA: they apply norm_q/norm_k and SDPA's default scale, ignoring ``attn.scale``.
#: AttnProcessor and XFormersAttnProcessor apply ``attn.scale`` and no q/k norms.
_SDPA_PROCESSORS = ("AttnProcessor2_0", "FusedAttnProcessor2_0")


@dataclass(frozen=True)
class StockSemantics:
    """What the stock processor ldmopt stands in for computes: projections read, softmax scale, q/k norms."""

    fused_projections: bool
    scale: float
    qk_norm: bool


def stock_semantics(attn) -> StockSemantics:
    """The semantics of ``attn``'s stock processor (that of ldmopt's own processor: its fallback).

    ``fused_projections`` alone does not say whether ``to_qkv`` is read: ``unfuse_qkv_projections`` puts the previous
    processors back but leaves the flag and a stale ``to_qkv``; only FusedAttnProcessor2_0 reads it."""
    processor = attn.processor
    if isinstance(processor, _FallbackProcessor):
        processor = processor.stock_processor(attn)
    kind = type(processor).__name__
    sdpa = kind in _SDPA_PROCESSORS
    return StockSemantics(
        fused_projections=bool(attn.fused_projections) and kind == "FusedAttnProcessor2_0",
        scale=_head_dim(attn) ** -0.5 if sdpa else float(attn.scale),
        qk_norm=sdpa,
    )


def temporal_self_attention(*args, **kwargs) -> Tensor:
    """What an Attention module computes on token-major activations: :func:`temporal_self_attention_and_stats`'s
    output (same arguments but ``next_norm``)."""
    return temporal_self_attention_and_stats(*args, **kwargs)[0]


def temporal_self_attention_and_stats(
    attn,
    x: Tensor | NormedInput,
    context: Tensor | None,
    bfn: tuple[int, int, int],
    residual: Tensor | None = None,
    gate: Tensor | None = None,
    name: str = "attn",
    next_norm: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(What an Attention module computes on token-major activations ``x`` of shape (..., C), with the attention over
    frames done by the strided kernel: ``x.view(*bfn, C)`` must index tokens as (B, F, N); ``context`` (same shape)
    gives the keys and values instead of ``x`` when not None. Projections (fused or not), per-head norm_q/norm_k and
    the scale as the stock processor applies them (:func:`stock_semantics`), to_out, residual_connection and
    rescale_output_factor; no copies.
    ``residual`` (the block's token stream, x's shape) is added in to_out's GEMM epilogue when given, after the
    per-sample ``gate`` ((B, 1, C), adaLN blocks) when given. ``x`` may be a :class:`NormedInput` (a block's norm,
    read in the projections' loads; ``name``: the attention's attribute, for the report). ``next_norm``: the
    LayerNorm that reads the output next, whose statistics to_out's epilogue then sums (None when it cannot).)
    """
    heads, c = attn.heads, attn.inner_dim
    stock = stock_semantics(attn)
    fused = stock.fused_projections
    if context is None and fused and getattr(attn, "to_qkv", None) is not None:
        qkv = apply(attn.to_qkv, x, f"{name}.to_qkv")
        q, k, v = qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :]
    elif context is None and isinstance(x, NormedInput) and not fused:  # one GEMM over the three, the norm read once
        q, k, v = x.project_all([attn.to_q, attn.to_k, attn.to_v], [f"{name}.to_{p}" for p in "qkv"])
    else:
        source = x if context is None else context
        if context is not None and attn.norm_cross:
            source = attn.norm_encoder_hidden_states(source)
        q = apply(attn.to_q, x, f"{name}.to_q")
        if fused and getattr(attn, "to_kv", None) is not None:
            kv = apply(attn.to_kv, source, f"{name}.to_kv")
            k, v = kv[..., :c], kv[..., c:]
        else:
            k, v = apply(attn.to_k, source, f"{name}.to_k"), apply(attn.to_v, source, f"{name}.to_v")
    # (..., C) -> (B, F, N, heads, head_dim): a view (the last axis of every slice is contiguous).
    q, k, v = (t.view(*bfn, heads, c // heads) for t in (q, k, v))
    if stock.qk_norm and attn.norm_q is not None:
        q = attn.norm_q(q)
    if stock.qk_norm and attn.norm_k is not None:
        k = attn.norm_k(k)
    out = temporal_attention(q, k, v, scale=stock.scale)
    # The output is torch.empty_like(q): token-major whenever q is a dense view or a qkv slice.
    core = out.reshape(*x.shape[:-1], c)
    return project_out_and_stats(attn, core, x, residual, "temporal attention", gate, next_norm)


#: The children of an Attention that the single-key shortcut never calls (the norms of the query side included: the
#: stock processors apply group_norm and spatial_norm to hidden_states, which only the queries read here).
SINGLE_KEY_SKIPS = ("to_q", "to_k", "norm_q", "norm_k", "group_norm", "spatial_norm")


def single_key_attention(attn, context: Tensor, queries: Tensor | None = None) -> Tensor:
    """Cross-attention over one key per batch item: ``to_out(to_v(norm_cross(context)))``, unexpanded.

    The shortcut skips the query path (to_q, to_k, norm_q/norm_k and whatever produced ``queries``), whose gradient
    is exactly zero on the stock path. When autograd records, the result is tied to those parameters and to
    ``queries`` with weight zero, so they receive the same zero gradients as on the stock path instead of none:
    DistributedDataParallel (without find_unused_parameters) and optimizers' weight decay expect every trainable
    parameter to get a gradient.
    """
    if attn.norm_cross:
        context = attn.norm_encoder_hidden_states(context)
    out = attn.to_out[0](attn.to_v(context))
    for layer in attn.to_out[1:]:
        out = layer(out)
    if torch.is_grad_enabled():
        skipped = [getattr(attn, name, None) for name in SINGLE_KEY_SKIPS]
        out = zero_gradient_anchor(out, skipped, queries)
    return out


def zero_gradient_anchor(out: Tensor, modules, tensor: Tensor | None = None) -> Tensor:
    """``out`` with its value unchanged, joined to the trainable parameters of ``modules`` (and to ``tensor``) with
    weight zero, so that backward gives them exact zero gradients. One element of each is read, and the joint is a
    ``where`` that never selects them, not a product with 0: the scalar's gradient is the sum of ``out``'s whole
    gradient, which can overflow fp16 under loss scaling, and 0 * inf is NaN (as 0 * a NaN weight would be in the
    forward); the result adds one zero scalar to ``out``."""
    picks = [p.reshape(-1)[0] for m in modules if m is not None for p in m.parameters() if p.requires_grad]
    if tensor is not None and tensor.requires_grad and tensor.numel():
        picks.append(tensor[(0,) * tensor.dim()])
    if not picks:
        return out
    joined = torch.stack([x.float() for x in picks]).sum()
    never = torch.zeros((), dtype=torch.bool, device=joined.device)
    return out + torch.where(never, joined, 0.0).to(out.dtype)


def single_key_structure_reason(attn) -> str | None:
    """Why ``attn`` cannot take the single-key shortcut ``to_out(to_v(context))`` whatever the call."""
    if attn.added_kv_proj_dim is not None or attn.to_out is None or attn.to_v is None:
        return "added key/value projections or no output projection"
    return None


def _single_key_module_reason(attn) -> str | None:
    reason = single_key_structure_reason(attn)
    if reason is not None:
        return reason
    dropout = attn.to_out[1] if len(attn.to_out) > 1 else None
    if dropout is not None and dropout_reason(dropout) is not None:
        return "active output dropout (would be shared across queries)"
    return None


def _stock_or_ours(processor) -> bool:
    return isinstance(processor, _FallbackProcessor) or type(processor).__name__ in STOCK_PROCESSORS


class _FallbackProcessor:
    """Common part: the previous processor to fall back to (None: the one diffusers would give the module), and
    counters of what ran."""

    def __init__(self, fallback=None) -> None:
        self.fallback = fallback
        self.kernel_calls = 0
        self.fallback_reasons: Counter[str] = Counter()

    def stock_processor(self, attn):
        """The processor this one stands in for on ``attn``, whose results it reproduces."""
        return self.fallback if self.fallback is not None else _default_processor(attn)

    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        temb: Tensor | None = None,
        *args,
        **kwargs,
    ) -> Tensor:
        """The kernel path (``_run``) when ``_call_reason`` finds nothing against these inputs, else the fallback."""
        reason = self._call_reason(attn, hidden_states, encoder_hidden_states, attention_mask) or function_mode_reason()
        if reason is not None:
            tally(self.fallback_reasons, reason)
            stock = self.stock_processor(attn)
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if counting():
            self.kernel_calls += 1
        return self._run(attn, hidden_states, encoder_hidden_states)

    def __repr__(self) -> str:
        fallback = "diffusers' default" if self.fallback is None else type(self.fallback).__name__
        return f"{type(self).__name__}(fallback={fallback})"


class TemporalAttnProcessor(_FallbackProcessor):
    """Self-attention over frames with ldmopt's strided temporal attention kernel (see the module docstring).

    Output equals the stock processor's within the kernel's tolerance (fp32 scores and softmax; within 2x the error
    of PyTorch's own SDPA in the activation dtype). Falls back to ``fallback`` (the module's previous processor) for
    attention masks, 4-D inputs, key lengths different from the frame count, F > 64, and modules that
    :func:`unsupported_reason` rejects.
    """

    def _call_reason(self, attn, hidden_states, encoder_hidden_states, attention_mask) -> str | None:
        if attention_mask is not None:
            return "attention mask"
        if hidden_states.ndim != 3:
            return f"{hidden_states.ndim}-D input (expects (B*N, F, C))"
        if encoder_hidden_states is not None and encoder_hidden_states.shape[:2] != hidden_states.shape[:2]:
            return f"cross-attention with {encoder_hidden_states.shape[1]} keys for {hidden_states.shape[1]} queries"
        if hidden_states.shape[1] > MAX_FRAMES:
            return f"F={hidden_states.shape[1]} frames > {MAX_FRAMES}"
        return unsupported_reason(attn)

    def _run(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None) -> Tensor:
        bn, f, _ = hidden_states.shape
        return temporal_self_attention(attn, hidden_states, encoder_hidden_states, (bn, f, 1))


class SingleKeyAttnProcessor(_FallbackProcessor):
    """Cross-attention over a single key, exactly: ``to_out(to_v(norm_cross(context)))`` broadcast over queries.

    softmax over one key is exactly 1 whatever the query, the key, ``scale`` or ``norm_q/norm_k`` are, so the query
    and key projections and the attention are skipped. The result is an expanded (stride-0) view over the queries
    when there is no residual connection and no output rescaling (diffusers' blocks only add it out of place), and
    a tensor of its own when forward hooks on the module (or global ones) see it: a hook may edit it in place.
    Falls back for masks, 4-D inputs, contexts longer than one token, added projections and dropout in training.
    """

    @staticmethod
    def reads_queries(attn) -> bool:
        """Whether the kernel path reads the queries' values, not only their shape: only for ``residual_connection``
        (ldmopt.nn.attention_residual skips the norm before the attention otherwise)."""
        return bool(attn.residual_connection)

    def _call_reason(self, attn, hidden_states, encoder_hidden_states, attention_mask) -> str | None:
        if encoder_hidden_states is None:
            return "self-attention (no encoder_hidden_states)"
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[1] != 1:
            return f"context of shape {tuple(encoder_hidden_states.shape)}, not one key per batch item"
        if attention_mask is not None:
            return "attention mask"
        if hidden_states.ndim != 3:
            return f"{hidden_states.ndim}-D input"
        if encoder_hidden_states.shape[0] != hidden_states.shape[0]:
            return f"context batch {encoder_hidden_states.shape[0]} != query batch {hidden_states.shape[0]}"
        # The skipped modules' values cannot change the result, but their hooks (accelerate's offload, a user's)
        # expect to run. (An SVD block in token order checks them with its other bypassed children: svd_bypassed.)
        skipped = hooked_children({name: getattr(attn, name, None) for name in SINGLE_KEY_SKIPS}, deep=True)
        if skipped:
            return bypassed_hook_reason(skipped[0], deep=True)
        return _single_key_module_reason(attn)

    def _run(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None) -> Tensor:
        out = single_key_attention(attn, encoder_hidden_states, queries=hidden_states)
        out = out.expand(hidden_states.shape[0], hidden_states.shape[1], out.shape[-1])
        if hooked(attn) and not (attn.residual_connection or attn.rescale_output_factor != 1.0):
            out = out.contiguous()  # the hooks get what the stock processor returns: writable elements
        if attn.residual_connection:
            out = out + hidden_states
        if attn.rescale_output_factor != 1.0:
            out = out / attn.rescale_output_factor
        return out


# ------------------------------------------------------------------------------------------------ finding, installing


def _attention_under(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{prefix}.{n}" if n else prefix, m) for n, m in module.named_modules() if _is_attention(m)]


def _scoped(model: nn.Module, containers) -> list[tuple[str, nn.Module]]:
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in containers:
            continue
        attr = containers[kind] if isinstance(containers, dict) else None
        scope = getattr(module, attr, None) if attr else module
        if scope is None:
            continue
        prefix = ".".join(p for p in (name, attr) if p)
        for sub_name, attn in _attention_under(prefix, scope):
            found.setdefault(id(attn), (sub_name, attn))
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    return sorted(found.values(), key=lambda item: order[id(item[1])])


def find_temporal_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, Attention) of every self-attention over frames in ``model``, in ``named_modules`` order."""
    return [(n, m) for n, m in _scoped(model, TEMPORAL_CONTAINERS) if not m.is_cross_attention]


def find_single_key_cross_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, Attention) of the cross-attention modules whose context is always one token (SVD's ``attn2``)."""
    return [(n, m) for n, m in _scoped(model, dict.fromkeys(SINGLE_KEY_CONTAINERS)) if m.is_cross_attention]


@dataclass
class ProcessorInstall:
    """What :func:`install_processors` did: per module name, the previous processor (restored by
    :func:`uninstall_processors`) and the installed one, and the modules left alone with the reason."""

    modules: dict[str, nn.Module] = field(default_factory=dict)
    previous: dict[str, object] = field(default_factory=dict)
    installed: dict[str, _FallbackProcessor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    active: bool = True

    def report(self) -> dict[str, Counter]:
        """name -> Counter of what ran since installation: "kernel" calls and each fallback reason."""
        return {
            name: Counter({"kernel": proc.kernel_calls, **proc.fallback_reasons})
            for name, proc in self.installed.items()
        }


@functools.cache
def _register_for_layer_skip() -> None:
    """Register ldmopt's processors with diffusers' attention layer skip (SkipLayerGuidance, PAG, caches' guiders),
    which looks processors up by exact class and otherwise raises "not registered": with the metadata of the stock
    processor they stand in for (skipping returns the block's input, as for any self-attention)."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry
        from diffusers.models.attention_processor import AttnProcessor2_0

        metadata = AttentionProcessorRegistry.get(AttnProcessor2_0)
    except Exception:  # a diffusers without the registry, or one whose registry cannot load
        return
    for cls in (TemporalAttnProcessor, SingleKeyAttnProcessor):
        AttentionProcessorRegistry.register(cls, copy.copy(metadata))


def install_processor(attn: nn.Module, processor_cls: type[_FallbackProcessor]) -> tuple[object | None, str | None]:
    """Set ``processor_cls(fallback=<current processor>)`` on one Attention module.

    Returns (previous processor, None), or (None, reason) when the module is left alone.
    """
    _register_for_layer_skip()
    current = attn.processor
    if isinstance(current, _FallbackProcessor):
        return None, f"already runs {type(current).__name__}"
    if type(current).__name__ not in STOCK_PROCESSORS:
        return None, f"custom processor {type(current).__name__} left in place"
    if processor_cls is TemporalAttnProcessor:
        reason = unsupported_reason(attn)
        if reason is not None:
            return None, reason
    attn.set_processor(processor_cls(fallback=current))
    return current, None


def install_processors(model: nn.Module, *, temporal: bool = True, single_key: bool = True) -> ProcessorInstall:
    """Install :class:`TemporalAttnProcessor` on the temporal self-attention modules of ``model`` and
    :class:`SingleKeyAttnProcessor` on SVD's single-key cross-attention modules."""
    install = ProcessorInstall()
    plan = []
    if temporal:
        plan += [(n, m, TemporalAttnProcessor) for n, m in find_temporal_attention(model)]
    if single_key:
        plan += [(n, m, SingleKeyAttnProcessor) for n, m in find_single_key_cross_attention(model)]
    for name, attn, cls in plan:
        previous, reason = install_processor(attn, cls)
        if reason is not None:
            install.skipped[name] = reason
            continue
        install.modules[name] = attn
        install.previous[name] = previous
        install.installed[name] = attn.processor
    return install


def uninstall_processors(install: ProcessorInstall) -> None:
    """Put back the very processor objects :func:`install_processors` replaced (a second call does nothing)."""
    if not install.active:
        return
    for name, previous in install.previous.items():
        install.modules[name].set_processor(previous)
    install.active = False
