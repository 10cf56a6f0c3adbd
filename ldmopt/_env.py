"""What this process can run: Triton, the interpreter, the CUDA extension, a GPU.

Every probe is lazy and cached; nothing here runs at import, and nothing queries a GPU unless asked. The probes that
fused forwards consult (backend choice in Python code that torch.compile traces) are constants to Dynamo, which
cannot trace an import: it calls them once while tracing and bakes in the answer.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import torch

_BUILD_INFO = Path(__file__).with_name("_build_info.json")


def _posix_environ_data() -> dict | None:
    data = getattr(os.environ, "_data", None)
    return data if os.name == "posix" and isinstance(data, dict) else None


_ENVIRON_DATA = _posix_environ_data()
_ENCODED_NAMES: dict[str, bytes] = {}
_DECODED_VALUES: dict[bytes, str] = {}


def read_per_call(*names: str) -> None:
    """Declare variables that fused forwards read with :func:`getenv` (at import): their encoded names are cached
    before any torch.compile traces a read, so the cache never changes under a compiled graph's guards (a name
    first added while tracing failed the guard on the next call: one recompile)."""
    for name in names:
        _ENCODED_NAMES.setdefault(name, os.fsencode(name))


read_per_call("LDMOPT_BACKEND", "TRITON_INTERPRET", "LDMOPT_POISON_OUTPUTS")


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` for the variables read on every op call (LDMOPT_BACKEND, ...), without
    os.environ's key encoding per read (about 1.6 us against 0.1 on the CI machine's CPU; a fused call read up to ten).
    On POSIX os.environ keeps its items in a dict of bytes that every write through os.environ updates (setenv in
    tests included), so a change is seen at the next read, as with os.environ.get (and under torch.compile, a guard
    on that dict retraces). The caches are not written while Dynamo traces (see :func:`read_per_call`)."""
    if _ENVIRON_DATA is None:
        return os.environ.get(name, default)
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = os.fsencode(name)
        if not torch.compiler.is_compiling():
            _ENCODED_NAMES[name] = key
    raw = _ENVIRON_DATA.get(key)
    if raw is None:
        return default
    value = _DECODED_VALUES.get(raw)
    if value is None:
        value = os.fsdecode(raw)
        if not torch.compiler.is_compiling():
            if len(_DECODED_VALUES) > 64:  # values set and unset over a process's life: keep the table small
                _DECODED_VALUES.clear()
            _DECODED_VALUES[raw] = value
    return value


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return getenv("TRITON_INTERPRET", "0") == "1"


def dynamo_constant(fn):
    """``fn`` marked constant to Dynamo as torch.compiler.assume_constant_result marks it (torch 2.11 to 2.14): called
    once while tracing, its result baked into the graph. That function imports torch._dynamo, and Triton with it: not
    at ldmopt's import."""
    fn._dynamo_marked_constant = True
    return fn


def _constant_probe(fn):
    """functools.cache for a probe without arguments, marked :func:`dynamo_constant`. A plain function: Dynamo traces
    past a functools.cache wrapper (with a warning) and would then trace the import inside."""
    results = []

    @functools.wraps(fn)
    def probe():
        if not results:
            results.append(fn())
        return results[0]

    probe.cache_clear = results.clear
    return dynamo_constant(probe)


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
    """(loaded, reason). A failed load is a warning naming the cause, never an ImportError. A library that the last
    install did not build (skipped, failed or interrupted, per _build_info.json) is left from an earlier build of
    other sources: it is not loaded, with a warning."""
    info = build_info()
    if info.get("built") is False:
        spec = importlib.util.find_spec("ldmopt._C")
        if spec is not None:
            message = (
                f"{spec.origin} is left from an earlier build: the last install did not build ldmopt._C "
                f"({info.get('reason', 'no reason recorded')}), so it may not match these sources; not loaded "
                "(reinstall to rebuild it, or delete the file)"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return False, message
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


def build_info() -> dict:
    """What setup.py built (written at install time), or {} when unknown."""
    try:
        return json.loads(_BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}


#: ldmopt._C's kernels use sm_80 features (bf16 WMMA, cp.async-era shared memory limits).
MIN_CUDA_EXTENSION_CAPABILITY = (8, 0)


def runs_cuda_extension_on(capability: tuple[int, int], arch_list: str | None) -> str | None:
    """Why ldmopt._C's kernels cannot run on a GPU of ``capability``, or None: sm_80 at least, and a cubin built for
    its major version at or below its minor, or PTX built for a lower capability (``arch_list`` as
    TORCH_CUDA_ARCH_LIST wrote it, e.g. "8.0;9.0+PTX"; None when unknown: only the minimum is checked)."""
    if capability < MIN_CUDA_EXTENSION_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]}: ldmopt._C's kernels need 8.0 or newer"
    if not arch_list:
        return None
    unreadable = False
    for entry in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        ptx = entry.endswith("+PTX")
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)", entry.removesuffix("+PTX"))
        if match is None:
            unreadable = True  # "Hopper" style names, "native": cannot tell, keep looking
            continue
        major, minor, variant = int(match[1]), int(match[2]), match[3]
        if variant == "a":  # sm_90a: that chip's own instructions (wgmma), code and PTX for it alone
            if capability == (major, minor):
                return None
        elif capability[0] == major and capability[1] >= minor:
            return None  # a plain or family ("f") cubin runs on the later minors of its major
        elif ptx and not variant and capability >= (major, minor):
            return None  # plain PTX: the driver compiles it for any later GPU
    if unreadable:
        return None  # an entry this cannot read may cover the GPU: only the minimum is checked, as for no list
    return (
        f"compute capability {capability[0]}.{capability[1]}: ldmopt._C was built for TORCH_CUDA_ARCH_LIST="
        f"{arch_list!r} (no cubin or PTX for it; rebuild with it in the list)"
    )


@functools.cache
def cuda_extension_device_refusal(index: int) -> str | None:
    """:func:`runs_cuda_extension_on` for CUDA device ``index``, read once per device."""
    import torch

    capability = torch.cuda.get_device_capability(index)
    return runs_cuda_extension_on(tuple(capability), build_info().get("arch_list"))


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
