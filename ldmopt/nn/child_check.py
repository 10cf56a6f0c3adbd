"""Per-call check of a child module that a fused path reads instead of calling.

``ldmopt.patch`` checks every child when it patches, but children can change afterwards: diffusers and PEFT wrap the
projections a LoRA targets (``pipe.load_lora_weights`` on a patched pipeline), accelerate adds offload hooks,
quantizers swap layers. A fused path that kept reading such a child's ``weight`` would drop the LoRA update or skip
the hook without a word, so each one asks :func:`readable` on every call (a type check and two dict lookups) and
otherwise computes the stock composition through the child's own forward, counting why in ``fallback_reasons``
(``PatchReport.fallbacks()`` lists them).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

#: "<where> ran the stock path: <why>" -> calls in this process.
fallback_reasons: Counter[str] = Counter()


def readable(layer: object, *kinds: type) -> bool:
    """Whether a fused path may read ``layer``'s parameters in place of calling it: exactly one of ``kinds``
    (default nn.Linear; a LoRA or quantized layer is another class) with no forward hooks."""
    if type(layer) not in (kinds or (nn.Linear,)):
        return False
    return not (layer._forward_hooks or layer._forward_pre_hooks)


def unreadable_reason(name: str, layer: object) -> str:
    """Why :func:`readable` refused ``layer`` (for the report)."""
    if isinstance(layer, nn.Module) and (layer._forward_hooks or layer._forward_pre_hooks):
        return f"{name} has forward hooks (e.g. accelerate offload) that reading its weights would bypass"
    return f"{name} is {type(layer).__name__} (a LoRA/PEFT or quantized layer added after patch?)"


def count_stock(where: str, name: str, layer: object) -> None:
    fallback_reasons[f"{where} ran the stock path: {unreadable_reason(name, layer)}"] += 1
