"""Per-call check of a child module that a fused path reads instead of calling.

``ldmopt.patch`` checks every child when it patches, but children can change afterwards: diffusers and PEFT wrap the
projections a LoRA targets (``pipe.load_lora_weights`` on a patched pipeline), accelerate adds offload hooks,
quantizers swap layers or weights. A fused path that kept reading such a child's ``weight`` would drop the LoRA
update or skip the hook without a word, so each one asks :func:`readable` on every call (type checks and three dict
lookups) and otherwise computes the stock composition through the child's own forward, counting why in
``fallback_reasons`` (``PatchReport.fallbacks()`` lists them).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

#: "<where> ran the stock path: <why>" -> calls in this process.
fallback_reasons: Counter[str] = Counter()


_PLAIN_WEIGHTS = (nn.Parameter, torch.Tensor, type(None))


def readable(layer: object, *kinds: type) -> bool:
    """Whether a fused path may read ``layer``'s parameters in place of calling it: exactly one of ``kinds``
    (default nn.Linear; a LoRA or quantized layer is another class), no forward hooks, and a plain weight tensor
    (torchao-style quantization keeps the class and swaps the weight for a tensor subclass)."""
    if type(layer) not in (kinds or (nn.Linear,)):
        return False
    if layer._forward_hooks or layer._forward_pre_hooks:
        return False
    return type(layer._parameters.get("weight")) in _PLAIN_WEIGHTS


def unreadable_reason(name: str, layer: object) -> str:
    """Why :func:`readable` refused ``layer`` (for the report)."""
    if isinstance(layer, nn.Module):
        if layer._forward_hooks or layer._forward_pre_hooks:
            return f"{name} has forward hooks (e.g. accelerate offload) that reading its weights would bypass"
        weight = layer._parameters.get("weight")
        if type(weight) not in _PLAIN_WEIGHTS:
            return f"{name}.weight is a {type(weight).__name__} (a quantized tensor?), not a plain tensor"
    return f"{name} is {type(layer).__name__} (a LoRA/PEFT or quantized layer added after patch?)"


def count_stock(where: str, name: str, layer: object) -> None:
    fallback_reasons[f"{where} ran the stock path: {unreadable_reason(name, layer)}"] += 1
