"""Profiler and analytic cost model.

- ``profile(target, ...) -> Profile``: torch.profiler run, device time classified by operator category.
- ``analyze(model_or_name, ...) -> Analysis``: FLOPs, minimum bytes and a roofline projection on meta tensors.
- ``GPUS`` / ``GPUSpec`` / ``register_gpu``: the GPU spec table of the projection.

Submodules load on first attribute access, so ``ldmopt.profiler.cli`` stays cheap to import for ``ldmopt --help``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "profile": "measure",
    "Profile": "measure",
    "analyze": "cost",
    "Analysis": "cost",
    "sweep": "cost",
    "CATEGORIES": "categories",
    "LABELS": "categories",
    "GPUS": "gpus",
    "GPUSpec": "gpus",
    "get_gpu": "gpus",
    "register_gpu": "gpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
