"""Shared libraries the tests build with the host compiler (the frame-stack chunk cache, the CUDA kernel emulator),
cached in the temporary directory by a hash of their sources, so a test session compiles each at most once."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def compile_cached(name: str, sources: Iterable[Path], command: Callable[[Path], list[str]]) -> Path:
    """The library ``command(output)`` builds from ``sources``: the cached one when these sources (paths and bytes)
    built it before, else built now. Raises RuntimeError with the compiler's output when the build fails."""
    digest = hashlib.sha256()
    for path in sources:
        if path.is_file():
            digest.update(path.as_posix().encode())
            digest.update(path.read_bytes())
    lib = Path(tempfile.gettempdir()) / f"ldmopt-{name}-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        cmd = command(tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} build failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        tmp.replace(lib)  # atomic: pytest-xdist workers and concurrent sessions never load a half-written library
    return lib
