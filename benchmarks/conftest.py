"""pytest plumbing for benchmarks/: the shared recorder fixture and the summary table printed last."""

from __future__ import annotations

import os
import time

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


# A deadline (LDMOPT_BENCH_DEADLINE, seconds since the epoch; run_gpu.sh sets it to its benchmark stage's end) is
# shared out among the benchmark files: a file whose cases have used its share of what was left when it started skips
# the rest, so that one slow file (compiles, autotuning) cannot leave the files after it without a row. What a file
# does not use goes to the ones after it.
_FILE_ORDER: list[str] = []
_FILE_START: dict[str, tuple[float, float]] = {}  # file -> (when its first case started, its share in seconds)


def pytest_collection_finish(session):
    _FILE_ORDER[:] = list(dict.fromkeys(str(item.path) for item in session.items))


def file_share(path: str, now: float, deadline: float) -> float:
    """Seconds ``path`` may take: what is left before ``deadline`` when it starts, over the files left."""
    if path not in _FILE_START:
        left = len(_FILE_ORDER) - _FILE_ORDER.index(path) if path in _FILE_ORDER else 1
        _FILE_START[path] = (now, max(deadline - now, 0.0) / left)
    return _FILE_START[path][1]


def pytest_runtest_setup(item):
    deadline = os.environ.get("LDMOPT_BENCH_DEADLINE")
    if not deadline:
        return
    path, now = str(item.path), time.time()
    share = file_share(path, now, float(deadline))
    spent = now - _FILE_START[path][0]
    if spent > share:
        pytest.skip(f"{item.path.name} used its share of the benchmark budget ({spent:.0f} of {share:.0f} s)")
