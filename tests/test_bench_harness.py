"""The benchmark harness's bookkeeping (CSV rows, derived rates, summary tables, plot, timing window) and run_gpu.sh's
closing summary work without a GPU."""

import ast
import contextlib
import csv
import time
from pathlib import Path

import pytest
import torch

from benchmarks import harness, summary

ROOT = Path(__file__).resolve().parents[1]


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


def test_graph_rows_compare_with_eagers_graph_row(recorder):
    for provider, ms in (("eager", 2.0), ("ldmopt", 4.0), ("eager+graph", 0.5), ("ldmopt+graph", 0.25)):
        recorder.record(op="conv", case="a", dtype="fp16", mode="fwd", provider=provider,
                        timing=harness.Timing(ms, ms, ms))  # fmt: skip
    lines = {line.split(" | ")[4]: line for line in recorder.summary().splitlines() if line.startswith("| conv")}
    assert "| 0.50x |" in lines["ldmopt"] and "| 2.00x |" in lines["ldmopt+graph"], lines


def test_graphed_time_divides_one_replay_by_the_calls_in_it(monkeypatch):
    calls = []
    monkeypatch.setattr(harness, "cuda_graphed", lambda fn, warmup_calls: fn)
    monkeypatch.setattr(harness, "time_fn", lambda fn: (fn(), harness.Timing(5.0, 4.0, 6.0))[1])
    timing = harness.graphed_time(lambda: calls.append(1), calls=10)
    assert len(calls) == 10 and timing == harness.Timing(0.5, 0.4, 0.6)


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


def test_time_fn_sizes_its_window_on_a_second_call(monkeypatch):
    """The first call may compile or autotune (another grad mode than the caller's warm-up): it must not size the
    timing window, or a fast op would get a window sized for a compile."""
    import triton.testing

    calls, windows = [], []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)  # a compile

    def do_bench(fn, warmup, rep, quantiles):
        windows.append((warmup, rep))
        return [1.0, 0.9, 1.1]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    assert harness.time_fn(fn) == harness.Timing(1.0, 0.9, 1.1)
    assert len(calls) == 2 and windows == [(25, 100)], (calls, windows)


def test_compiled_baselines_are_static_and_start_fresh(monkeypatch):
    compiles, resets = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiles.append(kwargs) or fn)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    harness.compiled(len, mode="max-autotune-no-cudagraphs")
    assert compiles == [{"mode": "max-autotune-no-cudagraphs", "dynamic": False}] and resets == [1]


def test_every_torch_compile_in_the_benchmarks_is_static():
    """A compiled baseline recompiled with symbolic shapes from its second case on runs generic kernels."""
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.compile" and path.name != "harness.py":
                dynamic = {k.arg: k.value for k in node.keywords}.get("dynamic")
                found.append((path.name, node.lineno, isinstance(dynamic, ast.Constant) and dynamic.value is False))
    assert found and all(static for *_, static in found), found


def _case_rows(recorder, op, case, times, mode="fwd", dtype="float16"):
    for provider, ms in times.items():
        timing = harness.Timing(ms, ms, ms) if ms else None
        recorder.record(op=op, case=case, dtype=dtype, mode=mode, provider=provider, timing=timing,
                        bytes=4_000_000_000, note="" if ms else "unavailable: RuntimeError: boom")  # fmt: skip


def test_compact_summary_compares_the_best_full_ldmopt_provider(recorder):
    times = {"eager": 2.0, "compile": 1.5, "sdpa-flash": 3.0, "sdpa-math": 9.0, "ldmopt-triton": 1.0}
    variants = {"ldmopt-cuda": 1.25, "ldmopt+stats": 0.5, "eager+graph": 0.1, "ldmopt-loader": 0.2}
    _case_rows(recorder, "attn", "a", {**times, **variants})
    _case_rows(recorder, "attn", "b", {"eager": 2.0, "ldmopt": None})
    text = summary.summary(recorder.csv_path, "", "")
    assert "  a fp16 fwd  ldmopt-triton 1ms e2.00 c1.50 s3.00 100%bw" in text, text
    assert "  b fp16 fwd  ldmopt -: unavailable: RuntimeError: boom" in text, text
    assert "attn: ldmopt 2.00x eager (geomean of 1, 2.00x-2.00x)" in text, text
    assert "rows without a time (their notes are in summary.md): ldmopt 1" in text, text


def test_compact_summary_fits_the_output_tail(recorder):
    """~450 rows (a quick GPU run) and a failing check: under the limit, every op's header kept, the totals last."""
    for i in range(150):
        _case_rows(recorder, f"op{i % 15}", f"a-rather-long-case-name-{i}", {"eager": 2.0, "compile": 1.5, "ldmopt": 1})
    checks = "\n".join(["fused_linear  geglu  float16  triton  1.00e-03  PASS"] * 40 + _FAILING_CHECKS)
    status = "build\t0\t95\t200\ncheck_gpu[0/2]\t0\t80\t180\ncheck_gpu[1/2]\t124\t180\t180\nbenchmarks\t0\t290\t300\n"
    text = summary.summary(recorder.csv_path, checks, status, limit=9500)
    lines = text.splitlines()
    assert len(text) <= 9500 and all(f"op{i}: ldmopt 2.00x eager" in text for i in range(15)), len(text)
    assert "case lines left out for length" in text, text[-2000:]
    assert lines[-1] == "correctness: 40 passed, 1 failed, 2 errors, 1 skipped | check_gpu: 1 failed", lines[-1]
    stages = (
        "stages: build ok 95s | check_gpu 1/2 ok (longest 180s), [1/2] TIMED OUT at its 180s cap | benchmarks ok 290s"
    )
    assert lines[-6] == stages, lines[-6]


_FAILING_CHECKS = [
    "fused_linear  gated  bfloat16  triton  3.10e-01  FAIL",
    "  skip temporal_attention ta torch.float16 cuda: ldmopt._C was not built",
    "resnet_block           ERROR AssertionError: fell back",
    "Traceback (most recent call last):",
    '  File "check_gpu.py", line 1, in run_checks',
    "AssertionError: fell back",
    "check_gpu: 1 failed",
    "Traceback (most recent call last):",
    '  File "benchmarks/check_cuda_backend.py", line 30, in <module>',
    "    import ldmopt",
    "ModuleNotFoundError: No module named 'ldmopt'",
]


def test_check_lines_show_each_exception():
    lines = summary.check_lines("\n".join(_FAILING_CHECKS))
    assert lines == [
        "check failures:",
        "  fused_linear  gated  bfloat16  triton  3.10e-01  FAIL",
        "  resnet_block           ERROR AssertionError: fell back",
        "    crashed: ModuleNotFoundError: No module named 'ldmopt'",
        "correctness: 0 passed, 1 failed, 2 errors, 1 skipped | check_gpu: 1 failed",
    ], lines


def test_compact_summary_names_the_slowest_benchmarks(recorder, tmp_path):
    path = tmp_path / "durations.csv"
    path.write_text(
        "test,phase,seconds,outcome,gpu,commit\n"
        "benchmarks/bench_e2e.py::bench_step[sd15],setup,40.0,passed,H200,abc\n"
        "benchmarks/bench_e2e.py::bench_step[sd15],call,35.5,passed,H200,abc\n"
        "benchmarks/bench_linear.py::bench_geglu[fwd],call,4.0,passed,H200,abc\n"
        "benchmarks/bench_e2e.py::bench_step[sdxl],ca\n"  # a line cut short by a stopped run
    )
    _case_rows(recorder, "attn", "a", {"eager": 2.0, "ldmopt": 1.0})
    status = "benchmarks\t0\t290\t300\n"
    lines = summary.summary(recorder.csv_path, "", status, durations=path).splitlines()
    slowest = "bench_e2e.py::bench_step[sd15] 76s; bench_linear.py::bench_geglu[fwd] 4s"
    assert f"benchmark time: 80s in 2 tests; slowest: {slowest}" in lines, lines
    absent = summary.summary(recorder.csv_path, "", status, durations=tmp_path / "absent.csv")
    assert "benchmark time" not in absent


def test_default_backend_rows_raise_on_a_reference_fallback_and_check_only_their_first_call():
    import ldmopt
    from ldmopt.ops._dispatch import fallback_reasons

    x, w, b = torch.randn(3, 5, 8), torch.randn(24, 8), torch.randn(24)
    calls = []

    def geglu():
        calls.append(1)
        return ldmopt.ops.geglu(x, w, b)

    row = harness.default_backends(geglu)
    before = dict(fallback_reasons)
    with pytest.MonkeyPatch.context() as mp:  # Triton refuses these inputs: the reference runs
        mp.setattr("ldmopt._env.triton_status", lambda: (False, "Triton missing here"))
        with pytest.raises(RuntimeError, match="ran the reference backend: geglu: triton refused \\(Triton missing"):
            row()
        fell = harness.default_backends(geglu)
    assert dict(fallback_reasons) != before
    with ldmopt.use_backend("torch"):  # forced by the user: not a fall-back
        out = fell()
    with pytest.MonkeyPatch.context() as mp:  # checked once: later calls run unchecked
        mp.setattr("ldmopt._env.triton_status", lambda: (False, "Triton missing here"))
        assert torch.equal(fell(), out)
    assert len(calls) == 3


def test_the_linear_benchmarks_ldmopt_rows_run_the_default_backends():
    """The "ldmopt" rows time what a user gets (ldmopt._C's passes where built), not a backend forced for every op;
    only rows named as partial in the summary force one."""
    import benchmarks.bench_linear as bench

    forced = []

    def forcing(*args, **kwargs):
        forced.append(args)
        return contextlib.nullcontext()

    for fn in (bench._default(bench.geglu), bench._triton(bench.geglu)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("ldmopt.use_backend", forcing)
            fn(torch.randn(4, 8), torch.randn(16, 8), torch.randn(16))
    assert forced == [("triton",)]
