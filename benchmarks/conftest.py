"""pytest plumbing for benchmarks/: the shared recorder fixture and the summary table printed last."""

from __future__ import annotations

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
        terminalreporter.write_line(f"(rows appended to {_RECORDER.csv_path}; table written to {out})")
