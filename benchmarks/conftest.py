"""pytest plumbing for benchmarks/: the shared recorder fixture and the summary table printed last."""

from __future__ import annotations

import os

import pytest

from benchmarks.harness import Recorder

_RECORDER = Recorder()


@pytest.fixture(scope="session")
def bench_recorder() -> Recorder:
    return _RECORDER


def pytest_terminal_summary(terminalreporter):
    table = _RECORDER.summary()
    if table:
        terminalreporter.write_sep("=", "ldmopt benchmark summary")
        terminalreporter.write_line(table)
        out = _RECORDER.csv_path.with_name("summary.md")
        out.write_text(table + "\n")
        plot = _RECORDER.plot_speedups(_RECORDER.csv_path.with_name("speedups.png"))
        terminalreporter.write_line(
            f"(rows appended to {_RECORDER.csv_path}; table written to {out}" + (f"; plot {plot})" if plot else ")")
        )


# Quick mode (LDMOPT_BENCH_QUICK=1, set by run_gpu.sh): fp16 and channels-last only, to fit the ~8-minute budget.
_SLOW_PARAMS = ("bfloat16", "bf16", "nchw")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LDMOPT_BENCH_QUICK") != "1":
        return
    keep, drop = [], []
    for item in items:
        (drop if any(p in item.nodeid for p in _SLOW_PARAMS) else keep).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
