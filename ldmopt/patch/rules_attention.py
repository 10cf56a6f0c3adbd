"""Attention-processor rules: temporal self-attention (``temporal_attention``) and SVD's single-key cross-attention
(``svd_attn2``), using ldmopt.nn.temporal_attention.

- ``temporal_attention``: every self-attention over frames (AnimateDiff motion modules, UNet3D ``transformer_in``
  and ``temp_attentions``, SVD and Latte ``temporal_transformer_blocks``, as ``find_temporal_attention`` finds them)
  gets a ``TemporalAttnProcessor``: the strided temporal kernel reads (B*N, F, heads, head_dim) views of the
  projections, no permute copies.
- ``svd_attn2``: SVD's cross-attention over its one image-embedding token gets ``SingleKeyAttnProcessor``, the exact
  shortcut ``to_out(to_v(context))`` broadcast over the queries (softmax over one key is 1).

The Attention module itself and its projections (LoRA-wrapped or not) are still called; only the processor object
changes. Each installed processor keeps the previous one as its fall-back for calls it does not serve (masks, F > 64,
...). ``unpatch`` puts the previous processor object back, unless the module's processor was changed after patching
(e.g. by ``fuse_qkv_projections``/``set_attn_processor``), in which case the user's choice stays; a new instance of
one of ldmopt's processor classes (diffusers' IP-adapter unloading re-creates every processor by its class) is
replaced by the processor it stands in for. Tolerance: the
temporal kernel's (fp32 scores and softmax; within 2x the error of PyTorch's SDPA in the activation dtype); the
shortcut is exact up to the projections' rounding.

diffusers' ``set_default_attn_processor`` accepts only its own processor classes, so a model that received these
processors gets an instance attribute of that name for as long as it is patched (:class:`DefaultProcessorMethod`):
it judges and resets the model as it would the unpatched one.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

from torch import nn

from ..nn import temporal_attention as T
from .rule import Rule, Site

#: The attention processors ldmopt installs.
_OURS = (T.TemporalAttnProcessor, T.SingleKeyAttnProcessor)


class _ProcessorRule(Rule):
    processor_cls: type

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.attention_processor import Attention

        return (Attention,)

    def _find(self, model: nn.Module) -> list:
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> Any:
        return {id(m) for _, m in self._find(model)}

    def match(self, site: Site) -> bool:
        return id(site.module) in site.context[self.name]

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        current = attn.processor
        if isinstance(current, _OURS):
            return [f"already runs {type(current).__name__} (installed outside ldmopt.patch)"]
        if type(current).__name__ not in T.STOCK_PROCESSORS:
            return [f"custom processor {type(current).__name__} left in place"]
        if self.processor_cls is T.TemporalAttnProcessor:
            reason = T.unsupported_reason(attn)
            if reason:
                return [reason]
        return []

    def replace(self, site: Site) -> Any:
        previous, reason = T.install_processor(site.module, self.processor_cls)
        if reason is not None:
            raise RuntimeError(f"ldmopt.patch: {site.name}: {reason}")
        site.module.processor.__dict__[_PATCHED] = True  # travels with copies; install_processors' are not ours
        return previous, site.module.processor

    def restore(self, site: Site, data: Any) -> None:
        previous, installed = data
        current = site.module.processor
        if current is installed:
            site.module.set_processor(previous)
        elif isinstance(current, _OURS):
            # Replaced since by another of ldmopt's processors: diffusers' IP-adapter unloading re-instantiates every
            # processor by its class (``p.__class__()``). Unpatched, the model runs stock again.
            site.module.set_processor(current.stock_processor(site.module))

    def counters(self, data: Any) -> list:
        return [data[1]]

    def stand_ins(self, data: Any) -> list[tuple[Any, Any]]:
        previous, installed = data
        return [(installed, previous)]


class TemporalAttentionRule(_ProcessorRule):
    name = "temporal_attention"
    family = "temporal_attention"
    description = "temporal self-attention: strided kernel over (B*N, F, heads, d) views, no permute copies"
    processor_cls = T.TemporalAttnProcessor

    def _find(self, model: nn.Module) -> list:
        return T.find_temporal_attention(model)


class SingleKeyCrossAttentionRule(_ProcessorRule):
    name = "svd_attn2"
    family = "svd_attn2"
    description = "SVD cross-attention over one key: exact shortcut to_out(to_v(context)), no attention"
    processor_cls = T.SingleKeyAttnProcessor

    def _find(self, model: nn.Module) -> list:
        return T.find_single_key_cross_attention(model)


RULES: list[Rule] = [TemporalAttentionRule(), SingleKeyCrossAttentionRule()]


#: Set on the processors patch installs: those installed by ldmopt.nn.install_processors are the user's to keep.
_PATCHED = "_ldmopt_patched"


def installed_processor(module: nn.Module) -> bool:
    """Whether ``module`` runs an attention processor that ``ldmopt.patch`` installed (here or in the original of a
    copy)."""
    processor = module.__dict__.get("processor")
    return isinstance(processor, _OURS) and processor.__dict__.get(_PATCHED, False)


def restore_unrecorded_processors(model: nn.Module) -> int:
    """Put back the processor each of ldmopt's stands in for, in the modules of ``model`` no record accounts for (a
    copy of a patched block: the record stayed with the original; unpatch calls this after the records). Returns how
    many."""
    restored = 0
    for module in model.modules():
        if installed_processor(module):
            module.set_processor(module.processor.stock_processor(module))
            restored += 1
    return restored


_DEFAULT_METHOD = "set_default_attn_processor"


class _DefaultProcessorCall:
    """``model.set_default_attn_processor`` while ldmopt's processors are installed: diffusers checks every processor's
    exact class against its own, so it would refuse the patched model. The stock processors they stand in for are put
    back for the call; diffusers then resets every processor (ours too: the user's choice, which unpatch keeps), or
    raises as it would without ldmopt, and ours come back. It holds its model weakly (no reference cycle keeps a
    dropped model's memory until the garbage collector runs); a deepcopy or pickle of the model carries one bound to
    the copy."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def __deepcopy__(self, memo: dict) -> _DefaultProcessorCall:
        return type(self)(copy.deepcopy(self._model(), memo))  # the model's copy (memo), not the original

    def __reduce__(self):
        return type(self), (self._model(),)

    def __call__(self, *args, **kwargs):
        model = self._model()
        swapped = []
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if isinstance(processor, _OURS):
                module.processor = processor.stock_processor(module)
                swapped.append((module, processor))
        try:
            return getattr(type(model), _DEFAULT_METHOD)(model, *args, **kwargs)
        except BaseException:
            for module, processor in swapped:
                if module.processor is not processor:
                    module.processor = processor
            raise


class DefaultProcessorMethod(Rule):
    """Not in the rule table: ``patch`` adds it to a model whose Attention modules got ldmopt's processors (see
    :func:`companion_actions`); it fuses nothing and is not reported as a patched module."""

    name = "default_attn_processor_method"
    family = "temporal_attention"
    description = "set_default_attn_processor that sees the stock processors behind ldmopt's"
    counted = False

    def targets(self) -> tuple[type, ...]:
        return ()

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {}

    def replace(self, site: Site) -> Any:
        call = _DefaultProcessorCall(site.module)
        site.module.__dict__[_DEFAULT_METHOD] = call
        return call

    def restore(self, site: Site, data: Any) -> None:
        if site.module.__dict__.get(_DEFAULT_METHOD) is data:
            del site.module.__dict__[_DEFAULT_METHOD]


_DEFAULT_PROCESSOR_METHOD = DefaultProcessorMethod()


def companion_actions(model: nn.Module) -> list[tuple[Rule, Site]]:
    """Model-level edits that go with the ones a patch call applied: the set_default_attn_processor method above when
    the model (a class that has one) now runs processors patch installed, in this call or an earlier patch of its
    blocks, and no earlier patch gave it ours."""
    if not callable(getattr(type(model), _DEFAULT_METHOD, None)) or _DEFAULT_METHOD in model.__dict__:
        return []
    if not any(installed_processor(m) for m in model.modules()):
        return []
    return [(_DEFAULT_PROCESSOR_METHOD, Site("", model, None, None))]
