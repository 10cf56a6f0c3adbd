"""Kineto's own log lines, kept out of a profile's output.

torch.profiler's C++ backend (libkineto) writes lines such as ``USDT:2026-12-07 ... profiler_start``, and on a machine
without a GPU ``ERROR:... gpuGetDeviceCount failed with code 35``, straight to file descriptor 2 on every profiler
start and stop, whatever Python's warning filters say. They describe the profiler, not the model, and the ERROR line
reads as a failure where none is. :func:`filtered` sends descriptor 2 to a temporary file while the profiler runs,
then writes back every line but those.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

#: Kineto's trace-event markers (USDT) and stage notes, and the device count a CPU-only machine cannot give.
_NOISE = re.compile(
    r"^(?:(?:USDT|STAGE):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\] .*"
    r"|ERROR:\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code \d+)$"
)


def drop_noise(text: str) -> str:
    """``text`` without kineto's own log lines (a line may end in another's start: its lines lack newlines)."""
    text = re.sub(r"(?<=[^\n])(?=(?:USDT|STAGE|ERROR):\d{4}-\d\d-\d\d )", "\n", text)
    return "".join(line for line in text.splitlines(keepends=True) if not _NOISE.match(line.rstrip("\n")))


@contextlib.contextmanager
def filtered() -> Iterator[None]:
    """Descriptor 2 to a temporary file inside the block, its lines but kineto's written back to it after (Python's
    own stderr output from the block included, later than it was written)."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a daemon): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stderr.flush()
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = drop_noise(sink.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
