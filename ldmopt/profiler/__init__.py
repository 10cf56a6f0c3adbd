"""Profiler and analytic cost model.

- ``profile(target, ...) -> Profile``: torch.profiler run, device time classified by operator category.
- ``analyze(model_or_name, ...) -> Analysis``: FLOPs, minimum bytes and a roofline projection on meta tensors.
"""

from __future__ import annotations

from .analyze import Analysis, analyze, sweep
from .categories import CATEGORIES, LABELS
from .gpus import GPUS, GPUSpec, get_gpu, register_gpu
from .profile import Profile, profile

__all__ = [
    "CATEGORIES",
    "GPUS",
    "LABELS",
    "Analysis",
    "GPUSpec",
    "Profile",
    "analyze",
    "get_gpu",
    "profile",
    "register_gpu",
    "sweep",
]
