"""The benchmark harness's bookkeeping (CSV rows, derived rates, summary, plot) works without a GPU."""

import csv

import pytest

from benchmarks import harness


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "ceilings", lambda: harness.Ceilings(copy_gbps=4000.0, bf16_tflops=800.0))
    return harness.Recorder(tmp_path / "results.csv")


def test_rows_rates_and_summary(recorder):
    recorder.record(op="gn", case="a", dtype="fp16", mode="fwd", provider="eager", timing=harness.Timing(2.0, 1.9, 2.2))
    row = recorder.record(
        op="gn", case="a", dtype="fp16", mode="fwd", provider="ldmopt", timing=harness.Timing(1.0, 0.9, 1.1),
        bytes=2_000_000_000, flops=400_000_000_000,
    )  # fmt: skip
    recorder.record(op="gn", case="a", dtype="fp16", mode="fwd", provider="compile", timing=None, note="failed: x")
    assert row.gbps == pytest.approx(2000.0) and row.pct_copy_bw == pytest.approx(50.0)
    assert row.tflops == pytest.approx(400.0) and row.pct_bf16_mm == pytest.approx(50.0)
    with recorder.csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["eager", "ldmopt", "compile"]
    assert {"gpu", "torch", "triton", "commit", "date"} <= set(rows[0])
    table = recorder.summary()
    assert "| gn | a | fp16 | fwd | ldmopt |" in table and "2.00x" in table and "failed: x" in table


def test_speedup_plot(recorder, tmp_path):
    pytest.importorskip("matplotlib")
    recorder.record(op="gn", case="a", dtype="fp16", mode="fwd", provider="eager", timing=harness.Timing(2.0, 1.9, 2.2))
    recorder.record(
        op="gn", case="a", dtype="fp16", mode="fwd", provider="ldmopt", timing=harness.Timing(1.0, 0.9, 1.1)
    )
    path = recorder.plot_speedups(tmp_path / "speedups.png")
    assert path is not None and path.stat().st_size > 1000


def test_summary_from_csv_round_trip(recorder):
    # run_gpu.sh prints the table from the CSV, so a run stopped at its time budget still reports its rows.
    recorder.record(op="gn", case="a", dtype="fp16", mode="fwd", provider="eager", timing=harness.Timing(2.0, 1.9, 2.2))
    recorder.record(op="gn", case="a", dtype="fp16", mode="fwd", provider="ldmopt", timing=None, note="failed: y")
    again = harness.recorder_from_csv(recorder.csv_path)
    assert again.summary() == recorder.summary()
