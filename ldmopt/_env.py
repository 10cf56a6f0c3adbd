"""What this process can run: Triton, the interpreter, the CUDA extension, a GPU.

Every probe is lazy and cached; nothing here runs at import, and nothing queries a GPU unless asked. The probes that
fused forwards consult (backend choice in Python code that torch.compile traces) are constants to Dynamo, which
cannot trace an import: it calls them once while tracing and bakes in the answer.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import warnings
from pathlib import Path

_BUILD_INFO = Path(__file__).with_name("_build_info.json")


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _constant_probe(fn):
    """functools.cache for a probe without arguments, marked constant to Dynamo as torch.compiler.assume_constant_result
    marks it (that function imports torch._dynamo, and Triton with it: not at ldmopt's import). A plain function:
    Dynamo traces past a functools.cache wrapper (with a warning) and would then trace the import inside."""
    results = []

    @functools.wraps(fn)
    def probe():
        if not results:
            results.append(fn())
        return results[0]

    probe.cache_clear = results.clear
    probe._dynamo_marked_constant = True
    return probe


@_constant_probe
def triton_status() -> tuple[bool, str]:
    """(importable, reason or version)."""
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising something else
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}"


def triton_available() -> bool:
    return triton_status()[0]


@_constant_probe
def cuda_extension_status() -> tuple[bool, str]:
    """(loaded, reason). A failed load is a warning naming the cause, never an ImportError."""
    try:
        importlib.import_module("ldmopt._C")
    except ModuleNotFoundError:
        info = build_info()
        reason = info.get("reason", "ldmopt._C was not built") if info else "ldmopt._C was not built"
        return False, reason
    except Exception as exc:  # e.g. undefined symbol after a torch upgrade
        message = f"ldmopt._C failed to load ({type(exc).__name__}: {exc}); rebuild with the installed torch"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False, message
    return True, "ldmopt._C loaded"


def cuda_extension_available() -> bool:
    return cuda_extension_status()[0]


def build_info() -> dict:
    """What setup.py built (written at install time), or {} when unknown."""
    try:
        return json.loads(_BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}


def gpu_status() -> tuple[bool, str]:
    """(a CUDA device is usable, description). Queries the driver: call only when asked."""
    import torch

    if not torch.backends.cuda.is_built():
        return False, f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return True, f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
