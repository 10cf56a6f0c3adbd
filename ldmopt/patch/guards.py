"""Reasons any rule's site stays stock, whatever the rule: hooks, instance-level forwards, PEFT/LoRA layers,
quantized weights, and dropout that a training patch would skip. ``patch`` asks these before a rule's own reasons;
and, for a site it patches, :func:`read_in_place_reasons`: which parts of the fused path will run stock per call."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..nn.child_check import (
    foreign_hook_registry,
    global_hook_registries,
    instance_forward_owner,
    readable,
    unreadable_reason,
    wrapped_forward,
)
from .rule import Site

#: Modules of these packages quantize (ModelOpt's QuantLayerNorm keeps LayerNorm's parameters and quantizes its input).
_QUANT_MODULE_PREFIXES = (
    "bitsandbytes", "torchao", "optimum.quanto", "gguf", "auto_gptq", "awq", "hqq", "modelopt", "diffusers.quantizers",
)  # fmt: skip


def _peft_layer_class() -> type | None:
    # peft layers can only exist if peft was imported; never import it here.
    if "peft" not in sys.modules:
        return None
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return BaseTunerLayer


def _hook_names(hooks: dict) -> str:
    return ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks.values())


def quantized_reason(where: str, m: nn.Module) -> str | None:
    """Why ``m``'s parameters are not plain floating-point tensors a kernel can read, if they are not."""
    cls_module = type(m).__module__ or ""
    if cls_module.startswith(_QUANT_MODULE_PREFIXES):
        return f"{where} is a quantized layer ({cls_module}.{type(m).__name__})"
    for name, t in m._parameters.items():
        if t is None:
            continue
        if type(t) not in (nn.Parameter, torch.Tensor):
            return f"{where}.{name} is a {type(t).__name__} (quantized or tensor subclass)"
        if not t.is_floating_point() or t.element_size() == 1:
            return f"{where}.{name} has dtype {t.dtype} (quantized, or fp8 storage such as layerwise casting)"
    return None


def generic_reasons(site: Site, touched: dict[str, nn.Module], shallow: set[str]) -> list[str]:
    """Hooks, instance-level forwards, PEFT/LoRA, quantized weights, training dropout on the touched modules."""
    reasons = []
    peft_cls = _peft_layer_class()
    registries = global_hook_registries()
    if touched and registries:
        reasons.append(f"global module hooks are registered ({', '.join(registries)})")
    for rel, top in touched.items():
        # A bypassed child is checked with everything under it; a shallow entry (the site itself, by default) keeps
        # its children running, so only it is checked.
        for sub_rel, m in [("", top)] if rel in shallow else top.named_modules():
            where = ".".join(p for p in (site.name, rel, sub_rel) if p) or "the module"
            if m._forward_hooks or m._forward_pre_hooks:
                hooks = {**m._forward_pre_hooks, **m._forward_hooks}
                reasons.append(f"{where} has forward hooks/pre-hooks ldmopt does not understand ({_hook_names(hooks)})")
            if m._backward_hooks or m._backward_pre_hooks:
                reasons.append(f"{where} has backward hooks")
            if wrapped_forward(m) or foreign_hook_registry(m):
                reasons.append(f"{where} has its forward wrapped on the instance by {instance_forward_owner(m)}")
            if peft_cls is not None and isinstance(m, peft_cls):
                reasons.append(f"{where} is a PEFT/LoRA layer ({type(m).__name__})")
            quant = quantized_reason(where, m)
            if quant:
                reasons.append(quant)
            if site.training and isinstance(m, nn.Dropout) and m.p > 0:
                reasons.append(f"{where} is dropout with p={m.p} and patch(training=True)")
    return list(dict.fromkeys(reasons))


#: The layers a fused path reads in place of calling them (ldmopt.nn.child_check.readable's kinds).
_READ_KINDS = (nn.Linear, nn.Conv2d)


def read_in_place_reasons(children: dict[str, nn.Module]) -> list[str]:
    """Why parts of a patched module's fused path will run stock on every call: children it reads in place of calling
    (Rule.read_in_place) that the per-call check (readable) refuses now. PEFT/LoRA layers, the usual case (a LoRA
    loaded before patch), are named together per layer class; a LoRA loaded after patch is found per call instead."""
    peft_cls = _peft_layer_class()
    lora: dict[str, list[str]] = {}
    others = []
    for name, child in children.items():
        if readable(child, *_READ_KINDS):
            continue
        if peft_cls is not None and isinstance(child, peft_cls):
            lora.setdefault(type(child).__name__, []).append(name)
        else:
            others.append(unreadable_reason(name, child))
    return [f"{_peft_layers(names)} ({kind})" for kind, names in lora.items()] + others


def _peft_layers(names: list[str]) -> str:
    if len(names) == 1:
        return f"{names[0]} is a PEFT/LoRA layer"
    return f"{', '.join(names[:-1])} and {names[-1]} are PEFT/LoRA layers"
