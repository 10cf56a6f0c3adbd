"""The emulated kernel tests again, with the emulator built under AddressSanitizer.

The emulator guards dynamic shared memory itself (guard bytes checked after each block, cuda_emu.h), but a kernel's
static ``__shared__`` arrays are function-local statics there: an index past one lands in the next, and a kernel
that writes and reads the same wrong slot still computes the right answer (a ``s_count[kWarps - 1]`` in the conv
epilogue passed every emulated test). AddressSanitizer puts red zones around those statics and around every
tensor the kernels read, and aborts the process on the first out-of-bounds access, so the tests run in a child
process with libasan preloaded (and libstdc++, whose ``__cxa_throw`` ASan must find to intercept the emulator's
error-path exceptions). Left out for time: the whole-model tests and the 2^24-pack grid-stride test (about 4 min
under ASan); the kernels they run are in the other tests at smaller sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.csrc import emulator

HERE = Path(__file__).resolve().parent
FILES = [
    "test_emulated_kernels.py",
    "test_emulated_conv_epilogue.py",
    "test_emulated_row_epilogues.py",
    "test_emulated_adaln.py",
    "test_emulated_placements.py",
]
SLOW = "not whole_ and not past_the_grid_cap"


def _runtime_library(name: str) -> str | None:
    """The host compiler's copy of a runtime library (``g++ -print-file-name`` echoes the bare name when it has
    none)."""
    try:
        path = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_emulated_kernels_under_address_sanitizer():
    reason = emulator.unavailable_reason()
    if reason:
        pytest.skip(reason)
    preload = [_runtime_library("libasan.so"), _runtime_library("libstdc++.so")]
    if None in preload:
        pytest.skip("the host compiler has no libasan.so / libstdc++.so to preload")
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": "detect_leaks=0",  # Python and torch keep allocations until exit
        emulator.ASAN_ENV: "1",
        "TRITON_INTERPRET": "1",
    }
    # -s: ASan writes its report to stderr and ends the process at once, before pytest would print captured output
    command = [sys.executable, "-m", "pytest", *(str(HERE / f) for f in FILES), "-q", "-s", "-x", "-k", SLOW,
               "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts="]  # fmt: skip
    proc = subprocess.run(command, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output, output[-6000:]
    assert " passed" in output and " failed" not in output, output[-3000:]
