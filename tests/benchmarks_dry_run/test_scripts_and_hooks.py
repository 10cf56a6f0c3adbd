"""The benchmark session's tooling on the CPU: benchmarks/conftest.py's quick mode and durations hook, run_gpu.sh end
to end with its stages stubbed, and benchmarks/profile_host.py."""

import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]


def _collect(quick: bool) -> list[str]:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "benchmarks/"],
        capture_output=True, text=True, env={**os.environ, "LDMOPT_BENCH_QUICK": "1" if quick else "0"}, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    return [line for line in collected.stdout.splitlines() if "::bench_" in line]


def test_quick_mode_keeps_cases_that_exist_only_in_bf16():
    from benchmarks.conftest import quick_sibling

    assert quick_sibling("b.py::bench_geglu[fwd-bf16-sdxl]") == "b.py::bench_geglu[fwd-fp16-sdxl]"
    assert (
        quick_sibling("b.py::bench_group_norm[fwd-nchw-fp16-sd]") == "b.py::bench_group_norm[fwd-channels_last-fp16-sd]"
    )
    assert quick_sibling("b.py::bench_geglu[fwd-fp16-sdxl]") is None
    quick = _collect(quick=True)
    functions = {line.split("[")[0] for line in quick}
    assert {
        "benchmarks/bench_wan_block.py::bench_wan_block",
        "benchmarks/bench_rms_norm.py::bench_rms_norm_rope",
    } <= functions
    # Quick mode matches twins by id: pytest's own dtype ids (dtype0, dtype1) would keep every bf16 twin.
    for ids in (quick, _collect(quick=False)):
        assert not [i for i in ids if re.search(r"[\[-]dtype\d", i)], "parametrize dtypes with ids=['fp16', 'bf16']"
    kept = set(quick)
    assert not [i for i in quick if quick_sibling(i) in kept], "a bf16 / NCHW twin survived quick mode"
    assert not [i for i in quick if "group_norm" in i and ("bf16" in i or "nchw" in i)], quick


def test_each_benchmark_file_gets_a_share_of_the_deadline(monkeypatch):
    """With a deadline, a file whose cases used its share of what was left when it began skips the rest, and time a
    file leaves goes to the files after it."""
    from benchmarks import conftest

    monkeypatch.setattr(conftest, "_FILE_ORDER", ["a.py", "b.py", "c.py"])
    monkeypatch.setattr(conftest, "_FILE_START", {})
    clock = [1000.0]
    monkeypatch.setattr(conftest.time, "time", lambda: clock[0])
    monkeypatch.setenv("LDMOPT_BENCH_DEADLINE", "1300")

    class Item:
        def __init__(self, path):
            self.path = Path(path)

    conftest.pytest_runtest_setup(Item("a.py"))  # a: 300 s left over 3 files: 100 s
    clock[0] = 1090.0
    conftest.pytest_runtest_setup(Item("a.py"))
    clock[0] = 1101.0
    with pytest.raises(pytest.skip.Exception, match=r"a.py used its share of the benchmark budget \(101 of 100 s\)"):
        conftest.pytest_runtest_setup(Item("a.py"))
    clock[0] = 1120.0  # b starts with 180 s left over 2 files
    conftest.pytest_runtest_setup(Item("b.py"))
    clock[0] = 1200.0
    conftest.pytest_runtest_setup(Item("b.py"))  # 80 s of its 90
    clock[0] = 1210.0  # c: 90 s left, all its own
    conftest.pytest_runtest_setup(Item("c.py"))
    assert conftest._FILE_START["c.py"] == (1210.0, 90.0)
    monkeypatch.delenv("LDMOPT_BENCH_DEADLINE")
    clock[0] = 2000.0  # no deadline (a plain pytest benchmarks/ run): nothing is skipped
    conftest.pytest_runtest_setup(Item("a.py"))


def test_benchmark_durations_are_appended_as_each_test_ends(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks.conftest import pytest_runtest_logreport

    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "none", "commit": "abc1234"})
    for nodeid, when, seconds in (("b.py::fast", "setup", 0.5), ("b.py::slow", "setup", 30.0),
                                  ("b.py::fast", "call", 1.25), ("b.py::slow", "call", 12.0)):  # fmt: skip
        pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, duration=seconds, outcome="passed"))
    path = tmp_path / "durations.csv"
    assert path.read_text().splitlines()[0] == ",".join(harness.DURATION_FIELDS)
    assert path.read_text().splitlines()[1] == "b.py::fast,setup,0.500,passed,none,abc1234"
    assert harness.durations_by_test(path) == {"b.py::slow": 42.0, "b.py::fast": 1.75}
    assert list(harness.durations_by_test(path)) == ["b.py::slow", "b.py::fast"]

    def broken():
        raise ImportError("no triton")

    monkeypatch.setattr(harness, "environment", broken)  # a report hook must never fail the session
    pytest_runtest_logreport(SimpleNamespace(nodeid="b.py::x", when="call", duration=0.1, outcome="failed"))
    assert path.read_text().splitlines()[-1] == "b.py::x,call,0.100,failed,unknown,unknown"


# run_gpu.sh's python, faked: pip (the build), `ldmopt info` and the version line stubbed, the stages run _STUB_STAGES,
# everything else (the summaries) the real interpreter.
_FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  "-m pip "*) echo "fake pip $*"; exit 0 ;;
  "setup.py "*) echo "fake build $*"; exit 0 ;;
  *benchmarks/profile_host.py*) echo "fake host profile"; exit 0 ;;
  "-m ldmopt profile "*) echo "fake model profile $*"; exit 0 ;;
  "-m ldmopt info"*) echo "fake ldmopt info"; exit 0 ;;
  *torch.__version__*) echo "fake versions"; exit 0 ;;
  *benchmarks/check_*.py*|"-m pytest "*) exec "{python}" "{stub}" "$@" ;;
  *) exec "{python}" "$@" ;;
esac
"""
_STUB_STAGES = """import os, sys, time
args = sys.argv[1:]
if args[0].endswith("check_gpu.py"):
    k = args[args.index("--shard") + 1].split("/")[0]
    print("check_gpu args:", " ".join(args[1:]))
    print(f"fused_linear           geglu-{k}       float16   triton  1.00e-03  PASS")
    if k != "0":
        time.sleep(300)  # stopped at its cap: the line above must survive in checks.txt
    print("fused_linear           gated       bfloat16  triton  3.10e-01  FAIL")
    print("check_gpu: 1 failed (shard 0/2)")
elif args[0].endswith("check_cuda_backend.py"):
    print("Traceback (most recent call last):")
    print('  File "benchmarks/check_cuda_backend.py", line 30, in <module>')
    print("ModuleNotFoundError: No module named 'ldmopt._C'")
    sys.exit(1)
else:  # -m pytest: ~450 rows through the real recorder
    print("pytest paths:", [a for a in args if a.startswith("benchmarks/")])
    if "LDMOPT_BENCH_DEADLINE" in os.environ:  # the benchmarks stage (not a pytest check stage)
        print("benchmark seconds to the deadline:", int(os.environ["LDMOPT_BENCH_DEADLINE"]) - int(time.time()))
    sys.path.insert(0, os.getcwd())
    from benchmarks import harness

    harness.ceilings = lambda: harness.Ceilings(4000.0, 800.0)
    recorder = harness.Recorder()
    for i in range(150):
        for provider, ms in (("eager", 2.0), ("compile", 1.5), ("ldmopt-triton", 1.0)):
            recorder.record(op=f"op{i % 15}", case=f"a-rather-long-case-name-{i}", dtype="float16", mode="fwd",
                            provider=provider, timing=harness.Timing(ms, ms, ms), bytes=10**9)
"""


def _fake_run_env(tmp_path, **knobs: str) -> tuple[dict, Path]:
    """The environment for run_gpu.sh with its python faked (stages stubbed) and ``knobs`` (LDMOPT_* variables), and
    its $OUT folder."""
    stub, fake = tmp_path / "stages.py", tmp_path / "python"
    stub.write_text(_STUB_STAGES)
    fake.write_text(_FAKE_PYTHON.format(python=sys.executable, stub=stub))
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LDMOPT_", "PYTHONUNBUFFERED"))}
    return env | {"OUT": str(out), "PYTHON": str(fake), "TMPDIR": str(tmp_path), **knobs}, out


def test_run_gpu_script(tmp_path):
    """run_gpu.sh end to end with its stages stubbed: a check stopped at its cap keeps what it printed and is
    reported TIMED OUT, the benchmarks keep their reserved time, at most 8 files land in $OUT (the device tool returns
    no more), and the summary printed last fits the 12,000-character output tail, the correctness totals last."""
    env, out = _fake_run_env(
        tmp_path, LDMOPT_RUN_BUDGET="36", LDMOPT_BENCH_RESERVE="24", LDMOPT_CHECK_SHARDS="2",
        # wrapped over lines, as RESULTS.md's command is (read alone kept the first line's files)
        LDMOPT_BENCH_FILES=" benchmarks/bench_e2e.py\n  benchmarks/bench_linear.py",
        LDMOPT_CHECK_ONLY=" fused_linear\nlinear_row_stats",
    )  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr  # a check failed
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and {
        "summary.txt",
        "summary.md",
        "results.csv",
        "checks.txt",
        "run.log",
        "profiles.txt",
    } <= set(files)
    checks = (out / "checks.txt").read_text()
    assert "geglu-1       float16   triton  1.00e-03  PASS" in checks, checks  # printed before its timeout
    assert "check_gpu args: --quick --only fused_linear --only linear_row_stats --shard 1/2" in checks, checks
    summary = run.stdout.split("================ summary ================\n")[-1]
    assert summary == (out / "summary.txt").read_text() and len(summary) < 10_000, len(summary)
    assert "check_gpu 1/2 ok" in summary and "[1/2] TIMED OUT" in summary and "benchmarks ok" in summary, summary
    assert "crashed: ModuleNotFoundError: No module named 'ldmopt._C'" in summary, summary
    assert "op14: ldmopt 2.00x eager" in summary, summary
    last = summary.rstrip().splitlines()[-1]
    assert last.startswith("correctness: 2 passed, 1 failed, 1 errors, 0 skipped | check_gpu: 1 failed"), last
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"./pytest.txt", "./stages.tsv", "./pip.log"} <= set(tar.getnames()), tar.getnames()
        pytest_log = tar.extractfile("./pytest.txt").read().decode()
    # LDMOPT_BENCH_FILES, blanks and all, is the benchmarks' path list
    assert "pytest paths: ['benchmarks/bench_e2e.py', 'benchmarks/bench_linear.py']" in pytest_log, pytest_log[:500]
    # the benchmarks' deadline, shared out among the files, is the stage's end (the reserve, less the margin)
    deadline = int(pytest_log.split("benchmark seconds to the deadline: ")[1].split()[0])
    assert 15 <= deadline <= 24, pytest_log[:500]
    # The checks took the time before the benchmarks' reserve: the optional profiles are skipped, not failed.
    log = (out / "run.log").read_text()
    assert "profile_host: skipped" in log and "profile[sd15,patched]: skipped" in log, log[-2000:]
    assert (out / "profiles.txt").read_text() == ""


def test_run_gpu_script_follow_up_run_profiles_first(tmp_path):
    """A follow-up run (no check shards, chosen benchmark files) has the time before the benchmarks' reserve for the
    host and model profiles, which land in profiles.txt."""
    env, out = _fake_run_env(
        tmp_path, LDMOPT_RUN_BUDGET="90", LDMOPT_BENCH_RESERVE="20", LDMOPT_CHECK_SHARDS="0",
        LDMOPT_PROFILE_MODELS="sd15 dit", LDMOPT_BENCH_FILES="benchmarks/bench_e2e.py",
    )  # fmt: skip
    run = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    profiles = (out / "profiles.txt").read_text()
    assert profiles.startswith("fake host profile"), run.stdout[-3000:]
    for model in ("sd15", "dit"):
        assert f"fake model profile -m ldmopt profile {model} --device cuda --steps 3 --top 6\n" in profiles
        assert f"fake model profile -m ldmopt profile {model} --device cuda --steps 3 --top 6 --patched" in profiles
    assert "profile 4/4 ok" in (out / "summary.txt").read_text()


def test_run_gpu_script_stops_its_stages_when_stopped(tmp_path):
    """TERM to run_gpu.sh (the device tool stopping it) stops the stages too: each runs under a timeout in a process
    group of its own, which a kill of the script's group would not reach, and a check or benchmark left running
    would hold the GPU past the run."""
    env, _ = _fake_run_env(tmp_path, LDMOPT_RUN_BUDGET="200", LDMOPT_BENCH_RESERVE="24", LDMOPT_CHECK_SHARDS="2")
    stub = tmp_path / "stages.py"

    def running_stages() -> list[str]:
        ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
        return [line for line in ps.splitlines() if str(stub) in line and "ps -eo" not in line]

    script = subprocess.Popen(["bash", "benchmarks/run_gpu.sh"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not running_stages() and time.monotonic() < deadline:  # shard 1 sleeps 300 s
            time.sleep(0.5)
        assert running_stages(), "the check shards never started"
        script.terminate()
        assert script.wait(timeout=30) == 143
        deadline = time.monotonic() + 15
        while running_stages() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not running_stages(), running_stages()
    finally:
        script.kill()
        for line in running_stages():
            os.kill(int(line.split()[0]), signal.SIGKILL)


def test_profile_host_splits_a_call_by_function_on_the_cpu(capsys, monkeypatch):
    from benchmarks import bench_host_overhead, profile_host

    # a few timed calls: the kernels run in the interpreter (the timing's logic, not its figures, is under test)
    monkeypatch.setattr(bench_host_overhead, "CALLS", 4)
    monkeypatch.setattr(bench_host_overhead, "WINDOWS", 2)

    assert profile_host.main(["--calls", "3", "--top", "3", "--case", "geglu", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== geglu\nldmopt: ") and "\neager: " in out, out
    rows = out.split("calls/call  function\n")[1].strip().splitlines()
    assert len(rows) == 3 and all(float(row.split()[0]) >= 0 for row in rows), out


def test_profile_host_times_ldmopts_own_host_code_with_launches_stubbed(capsys):
    from benchmarks import profile_host

    assert profile_host.main(["--calls", "3", "--top", "2", "--case", "gn_silu_conv2d+temb", "--stub-launches"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[1]
    # the input statistics (two launches) and the conv: the backend that ran was Triton's, its launches stubbed
    assert first.startswith("ldmopt (launches stubbed): ") and first.endswith(", 3 launches/call"), out
    with pytest.raises(SystemExit):
        profile_host.main(["--stub-launches", "--device", "cuda"])
