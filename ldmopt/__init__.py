"""ldmopt: fused Triton and CUDA C++ kernels for latent diffusion models.

``import ldmopt`` needs only torch: Triton, the CUDA extension and diffusers are imported when first used, and no
GPU is queried at import.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import nn, ops
from .ops._dispatch import BackendUnavailableError, use_backend

__version__ = "0.1.0"

# Heavier entry points (diffusers, torch.profiler) load on first attribute access. Subpackages (attribute None) are
# given as themselves: the import binds their names to them, so every access must give the same object
# (``ldmopt.patch`` is the callable subpackage).
_LAZY = {
    "patch": ("ldmopt.patch", None),
    "profiler": ("ldmopt.profiler", None),
    "configs": ("ldmopt.configs", None),
    "unpatch": ("ldmopt.patch", "unpatch"),
    "tune": ("ldmopt.patch", "tune"),
    "patch_tuned": ("ldmopt.patch", "patch_tuned"),
    "is_patched": ("ldmopt.patch", "is_patched"),
    "match_optimizer_layout": ("ldmopt.patch", "match_optimizer_layout"),
    "profile": ("ldmopt.profiler", "profile"),
    "analyze": ("ldmopt.profiler", "analyze"),
    "cuda_graphs": ("ldmopt.graphs", "cuda_graphs"),
    "remove_cuda_graphs": ("ldmopt.graphs", "remove_cuda_graphs"),
}

__all__ = ["BackendUnavailableError", "__version__", "nn", "ops", "use_backend", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'ldmopt' has no attribute {name!r}")
