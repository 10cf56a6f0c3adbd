"""pytest plumbing for benchmarks/: the shared recorder fixture and the summary table printed last."""

from __future__ import annotations

import os

import pytest

from benchmarks import harness
from benchmarks.harness import Recorder

_RECORDER = Recorder()


@pytest.fixture(scope="session")
def bench_recorder() -> Recorder:
    return _RECORDER


def pytest_runtest_logreport(report):
    """Each benchmark's wall time (setup, call and teardown: model builds and autotuning included), appended to
    ``durations.csv`` beside the other side files as each test ends, so that a run stopped at its budget still says
    what every finished case cost: the data to choose quick mode's subset by."""
    harness.append_duration(report.nodeid, report.when, report.duration, report.outcome)


def pytest_terminal_summary(terminalreporter):
    table = _RECORDER.summary()
    if table:
        terminalreporter.write_sep("=", "ldmopt benchmark summary")
        terminalreporter.write_line(table)
        # Beside the other side files, not the CSV: run_gpu.sh keeps $OUT (at most 8 files come back) for its own.
        out = harness.RESULTS_DIR / "summary.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
        plot = _RECORDER.plot_speedups(harness.RESULTS_DIR / "speedups.png")
        terminalreporter.write_line(
            f"(rows appended to {_RECORDER.csv_path}; table written to {out}" + (f"; plot {plot})" if plot else ")")
        )


# Quick mode (LDMOPT_BENCH_QUICK=1, set by run_gpu.sh): a bf16 or NCHW case is left out when the same case in fp16
# or channels-last runs, to fit the ~8-minute budget; cases that exist only in bf16 (Wan, the RoPE norms) still run.
# Matched on test ids: a dtype parameter needs ids=["fp16", "bf16"] (pytest's own ids, dtype0/dtype1, match nothing;
# tests/benchmarks_dry_run/test_scripts_and_hooks.py checks that no benchmark has them).
_QUICK_SIBLINGS = (("bfloat16", "float16"), ("bf16", "fp16"), ("nchw", "channels_last"))


def quick_sibling(nodeid: str) -> str | None:
    """The fp16 / channels-last twin of a bf16 / NCHW case's id, or None for a case that is neither."""
    twin = nodeid
    for slow, fast in _QUICK_SIBLINGS:
        twin = twin.replace(slow, fast)
    return twin if twin != nodeid else None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LDMOPT_BENCH_QUICK") != "1":
        return
    ids = {item.nodeid for item in items}
    keep, drop = [], []
    for item in items:
        (drop if quick_sibling(item.nodeid) in ids else keep).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
