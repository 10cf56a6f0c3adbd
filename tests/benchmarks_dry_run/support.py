"""Shared by the benchmark dry runs in this folder: the GPU benchmarks' own logic runs on the CPU with tiny
models and the timing mocked, and every provider must produce a timed row, not a 'failed' one (a GPU run is rare
and short; a Python error in a benchmark would waste it). The fixtures (one intra-op thread, the timing mocked,
torch.compile left out) and the filter of failed rows."""

import pytest
import torch

from benchmarks import harness


class _Rows:
    def __init__(self):
        self.rows = []

    def record(self, **row):
        self.rows.append(row)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops gain nothing from threads, and on a loaded 2-core machine each intra-op barrier can wait a time slice.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def mocked_timing(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "time_fn", lambda fn, **_: (fn(), harness.Timing(1.0, 0.9, 1.1))[1])
    monkeypatch.setattr(harness, "peak_memory", lambda fn: (fn(), 2**20)[1])  # nonzero: notes divide by it
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "cuda_graphed", lambda fn, **_: fn)  # capture needs a GPU; replay = the call
    return _Rows()


@pytest.fixture
def no_compile(monkeypatch):
    # torch.compile's own work is not the benchmarks' logic; on the CPU it would only add minutes.
    monkeypatch.setattr(harness, "compiled", lambda fn, mode=None, **_: fn)
    monkeypatch.setattr(torch, "compile", lambda fn=None, **_: fn)


def _failed(rows, allowed=()):
    """Rows without a timing, but for providers in ``allowed`` (those that need CUDA)."""
    return [
        (r["case"], r["provider"], r.get("note")) for r in rows if r["timing"] is None and r["provider"] not in allowed
    ]
