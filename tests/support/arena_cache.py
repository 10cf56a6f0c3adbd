"""Install tests/support/arena_cache.c in front of CPython's arena allocator (see that file for why): compiled with
the host C compiler on first use (cached by a hash of the source), skipped with a reason when there is none."""

from __future__ import annotations

import ctypes
import shutil
import sys
from pathlib import Path

from .compile_cached import compile_cached

SOURCE = Path(__file__).with_name("arena_cache.c")


class _ArenaAllocator(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


def _build() -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    return compile_cached(
        "arena-cache", [SOURCE], lambda out: [compiler, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(out)]
    )


def install() -> str | None:
    """Put the cache in front of the current arena allocator, once per process. None when installed, else why not."""
    if getattr(sys, "_ldmopt_arena_cache", None) is not None:
        return None
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return "the frame data stack it serves is CPython 3.11+'s"
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "the GIL is disabled (the cache relies on it instead of a lock)"
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as e:
        return f"could not build or load it: {e}"
    api = ctypes.pythonapi
    current = _ArenaAllocator()
    api.PyObject_GetArenaAllocator(ctypes.byref(current))
    lib.arena_cache_set_previous(
        ctypes.c_void_p(current.ctx), ctypes.c_void_p(current.alloc), ctypes.c_void_p(current.free)
    )
    ours = _ArenaAllocator(
        None,
        ctypes.cast(lib.arena_cache_alloc, ctypes.c_void_p).value,
        ctypes.cast(lib.arena_cache_free, ctypes.c_void_p).value,
    )
    api.PyObject_SetArenaAllocator(ctypes.byref(ours))
    sys._ldmopt_arena_cache = lib  # keeps the library loaded for the life of the process
    return None
