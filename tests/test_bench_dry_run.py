"""The GPU benchmarks' own logic, run on the CPU with tiny models and the timing mocked: every provider must produce
a timed row, not a 'failed' one (a GPU run is rare and short; a Python error in a benchmark would waste it)."""

import functools
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

import ldmopt
from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]


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


def test_e2e_step_providers(mocked_timing, monkeypatch):
    pytest.importorskip("diffusers")
    from benchmarks import bench_e2e
    from ldmopt import configs

    def tiny(name, dtype):
        model = configs.build_model(bench_e2e.MODELS[name][0], device="cpu", dtype=torch.float32, tiny=True)
        return model, configs.example_inputs(model, batch=1)

    monkeypatch.setattr(bench_e2e, "_build", tiny)
    with ldmopt.use_backend("torch"):
        for provider in ("eager", "ldmopt", "ldmopt-tuned"):
            bench_e2e.bench_denoising_step("dit-256", provider, mocked_timing)
    providers = [r["provider"] for r in mocked_timing.rows]
    assert providers == ["eager", "eager+graph", "ldmopt", "ldmopt+graph", "ldmopt-tuned", "ldmopt-tuned+graph"]
    assert not _failed(mocked_timing.rows), mocked_timing.rows
    assert "patched" in mocked_timing.rows[2]["note"]
    assert re.match(r"[0-9.]+ it/s tuned: \d+ of \d+ sites kept; tune measured ", mocked_timing.rows[4]["note"])
    table = (harness.RESULTS_DIR / "e2e_tuning_dit-256.txt").read_text()
    assert table.startswith("ldmopt.tune (time.perf_counter") and "adaln" in table
    splits = json.loads((harness.RESULTS_DIR / "e2e_categories.json").read_text())
    assert set(splits["dit-256"]) == {"eager", "ldmopt", "ldmopt-tuned"}
    # the graph-timed provider needs a GPU: on the CPU its row says so
    with ldmopt.use_backend("torch"):
        bench_e2e.bench_denoising_step("dit-256", "ldmopt-tuned-graph", mocked_timing)
    last = mocked_timing.rows[-1]
    assert last["provider"] == "ldmopt-tuned-graph" and last["timing"] is None
    assert "cuda_graph=True needs the model on a GPU" in last["note"]


def test_e2e_patched_unet_step_hands_statistics_over(mocked_timing, monkeypatch):
    """Steps run as diffusers pipelines run them (torch.no_grad): under torch.inference_mode a patched UNet would hand
    no GroupNorm statistics between its blocks, and the benchmark would time statistics passes users do not run."""
    pytest.importorskip("diffusers")
    from benchmarks import bench_e2e
    from ldmopt import configs
    from ldmopt.nn import stats_handover

    def tiny(name, dtype):
        model = configs.build_model(bench_e2e.MODELS[name][0], device="cpu", dtype=torch.float32, tiny=True)
        return model, configs.example_inputs(model, batch=1)

    monkeypatch.setattr(bench_e2e, "_build", tiny)
    stats_handover.handed_over.clear()
    with ldmopt.use_backend("torch"):
        bench_e2e.bench_denoising_step("sd15-512", "ldmopt", mocked_timing)
    assert not _failed(mocked_timing.rows), mocked_timing.rows
    assert sum(stats_handover.handed_over.values()) > 0, dict(stats_handover.handed_over)


def test_e2e_compile_provider_compiles_what_runs(mocked_timing, monkeypatch):
    """A VAE's step calls decode: that bound method is compiled (compiling the module left decode eager)."""
    pytest.importorskip("diffusers")
    from benchmarks import bench_e2e
    from ldmopt import configs

    def tiny(name, dtype):
        model = configs.build_model(bench_e2e.MODELS[name][0], device="cpu", dtype=torch.float32, tiny=True)
        return model, configs.example_inputs(model, batch=1)

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(bench_e2e, "_build", tiny)
    monkeypatch.setattr(bench_e2e.torch, "compile", fake_compile)
    with ldmopt.use_backend("torch"):
        bench_e2e.bench_denoising_step("sdxl-vae-decode-1024", "compile", mocked_timing)
    assert len(compiled) == 1 and getattr(compiled[0], "__name__", None) == "decode", compiled
    assert not _failed(mocked_timing.rows), mocked_timing.rows


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


def test_temporal_block_providers(mocked_timing, monkeypatch):
    pytest.importorskip("diffusers")
    from benchmarks import bench_temporal_block as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "QUICK", True)  # no torch.compile provider
    monkeypatch.setattr(B, "CASES", {"motion": ("motion", 64, 2, 32, 3, 5), "svd": ("svd", 64, 2, 32, 3, 5)})
    monkeypatch.setattr(B, "FRAMES_ANIMATEDIFF", 3)
    monkeypatch.setattr(B, "FRAMES_SVD", 3)
    with ldmopt.use_backend("torch"):  # the benchmark's logic is under test, not the kernels (tested elsewhere)
        for mode in ("fwd", "fwd+bwd"):
            for case in ("motion", "svd"):
                B.bench_temporal_block(case, torch.float32, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 2 * 2 * 3 and not _failed(rows), _failed(rows)
    assert all(r["note"].startswith("max rel err vs eager") for r in rows), [r["note"] for r in rows]
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-5, errs
    fwd = {r["case"]: r["bytes"] for r in rows if r["mode"] == "fwd"}
    assert all(r["bytes"] == 2 * fwd[r["case"]] for r in rows if r["mode"] == "fwd+bwd"), "gradients' bytes too"


def _broken_compile(fn, mode=None, **_):
    def run(*args, **kwargs):
        raise RuntimeError("inductor: lowering failed\nthe rest of its message")

    return run


def test_group_norm_failing_provider_is_a_row(mocked_timing, monkeypatch):
    """An inductor failure is the compile row's note; the ldmopt rows after it still run."""
    from benchmarks import bench_group_norm as B

    monkeypatch.setattr(harness, "compiled", _broken_compile)
    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "SHAPES", {"tiny": (1, 96, 2, 3)})
    for mode in ("fwd", "fwd+bwd"):
        B.bench_group_norm("tiny", torch.float16, "channels_last", mode, mocked_timing)
    rows = mocked_timing.rows
    assert [r["provider"] for r in rows] == ["eager", "compile", "ldmopt-triton", "ldmopt-cuda"] * 2, rows
    assert all(r["note"] == "unavailable: RuntimeError: inductor: lowering failed" for r in rows[1::4]), rows
    assert not _failed(rows, allowed={"compile", "ldmopt-cuda"}), _failed(rows)


def test_linear_failing_provider_is_a_row(mocked_timing, monkeypatch):
    from benchmarks import bench_linear as B

    monkeypatch.setattr(harness, "compiled", _broken_compile)
    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "GEGLU_CASES", {"a": (13, 40, 24)})
    for mode in B.MODES:  # fwd+bwd draws its output gradients from a first call: inside the provider's try too
        B.bench_geglu("a", "fp16", mode, mocked_timing)
    rows = mocked_timing.rows
    assert [r["provider"] for r in rows] == ["ldmopt", "ldmopt-triton-gemm", "eager", "cublas-gemm", "compile"] * 2
    assert all(r["note"] == "unavailable: RuntimeError: inductor: lowering failed" for r in rows[4::5]), rows
    assert not _failed(rows, allowed={"compile"}), _failed(rows)


def test_group_norm_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_group_norm as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "SHAPES", {"tiny": (1, 96, 2, 3)})
    for layout in ("channels_last", "nchw"):
        for mode in ("fwd", "fwd+bwd"):
            B.bench_group_norm("tiny", torch.float16, layout, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 2 * 2 * 4 and not _failed(rows, allowed={"ldmopt-cuda"}), _failed(rows)
    assert all(r["note"].startswith("unavailable") for r in rows if r["provider"] == "ldmopt-cuda")


def test_linear_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_linear as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setenv("LDMOPT_BENCH_QUICK", "1")  # the second case of an op skips its compile provider
    # The "ldmopt" rows as on a GPU (cuBLAS's GEMM, then the epilogue pass), the "-triton-gemm" rows the Triton GEMM
    monkeypatch.setenv("LDMOPT_GEMM_PLACEMENT", "cublas")
    monkeypatch.setattr(B, "GEGLU_CASES", {"a": (13, 40, 24), "b": (5, 24, 40)})
    monkeypatch.setattr(B, "GELU_CASES", {"a": (13, 40, 48), "b": (5, 24, 40)})
    monkeypatch.setattr(B, "GATED_CASES", {"a": (2, 7, 40, 24)})
    monkeypatch.setattr(B, "ADALN_CASES", {"a": (2, 7, 40)})
    monkeypatch.setattr(B, "CONCAT_CASES", {"a": (2, 7, 24, 40, 16)})
    monkeypatch.setattr(B, "BLEND_CASES", {"a": (3, 7, 40)})
    monkeypatch.setattr(B, "LN_QKV_CASES", {"a": (13, 40), "b": (5, 24)})
    monkeypatch.setattr(B, "LN_GEGLU_CASES", {"a": (13, 40, 24)})
    benches = {
        B.bench_geglu: B.GEGLU_CASES,
        B.bench_linear_gelu_tanh: B.GELU_CASES,
        B.bench_linear_gated_residual: B.GATED_CASES,
        B.bench_adaln_modulate: B.ADALN_CASES,
        B.bench_linear_concat_gated: B.CONCAT_CASES,
        B.bench_linear_blend: B.BLEND_CASES,
        B.bench_layer_norm_qkv: B.LN_QKV_CASES,
        B.bench_layer_norm_geglu: B.LN_GEGLU_CASES,
    }
    B.linear_cublas.placement_counts.clear()
    for bench, cases in benches.items():
        for case in cases:
            for mode in B.MODES:
                bench(case, "fp16", mode, mocked_timing)
    # the "ldmopt" rows ran cuBLAS's GEMM (as forced above), the "-triton-gemm" rows the Triton GEMM
    assert set(B.linear_cublas.placement_counts) == {"cublas", "triton"}, B.linear_cublas.placement_counts
    rows = mocked_timing.rows
    skipped = [r for r in rows if r["note"] == "skipped in quick mode"]
    skipped_cases = {("geglu", "b"), ("linear_gelu_tanh", "b"), ("layer_norm_qkv", "b")}
    assert {(r["op"], r["case"]) for r in skipped} == skipped_cases
    assert not _failed([r for r in rows if r not in skipped]), _failed(rows)
    # (cases x providers) x modes, and the GELU-tanh cases' "-gelu-pass" rows (inference only)
    assert len(rows) == 2 * (2 * 5 + 2 * 5 + 5 + 3 + 5 + 4 + 2 * 4 + 5) + 2, len(rows)
    assert [(r["case"], r["mode"]) for r in rows if r["provider"] == "ldmopt-gelu-pass"] == [("a", "fwd"), ("b", "fwd")]


def test_resnet_block_providers(mocked_timing, no_compile, monkeypatch):
    pytest.importorskip("diffusers")
    from benchmarks import bench_resnet_block as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    blocks = {"temb-32to96": (1, 32, 96, 2, 40, 1e-5), "vae-32": (1, 32, 32, 2, None, 1e-6)}
    monkeypatch.setattr(B, "BLOCKS", blocks)
    with ldmopt.use_backend("torch"):  # but for gn_conv2d, which the ldmopt providers force to triton
        for mode in ("fwd", "fwd+bwd"):
            B.bench_resnet_block("temb-32to96", torch.float16, mode, mocked_timing)
        B.bench_resnet_block("vae-32", torch.float16, "fwd", mocked_timing)  # no time embedding, no shortcut
        B.bench_gn_conv2d("temb-32to96", torch.float16, mocked_timing)
    monkeypatch.setattr(B, "SKIP_BLOCKS", {"skip": (1, 40, 24, 32, 3)})
    with ldmopt.use_backend("torch"):
        B.bench_resnet_skip("skip", torch.float16, mocked_timing)
    monkeypatch.setattr(B, "UPSAMPLERS", {"up": (1, 24, 3)})
    with ldmopt.use_backend("torch"):
        B.bench_upsample_conv("up", torch.float16, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 6 + 3 + 6 + 7 + 4 + 4 and not _failed(rows), _failed(rows)
    block = {r["mode"]: r["bytes"] for r in rows if r["op"] == "resnet_block" and r["case"] == "temb-32to96"}
    assert block["fwd+bwd"] > block["fwd"], block  # the gradients' traffic counted too
    assert not [r["note"] for r in rows if r["note"]], "no provider fell back or failed"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_temporal_attention_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_temporal_attention as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "QUICK", False)  # flex-blockdiag and compile too (compiles mocked)
    monkeypatch.setattr(B, "SHAPES", {"tiny": (2, 2, 3, 2, 24)})  # (B, N, F, heads, head_dim)
    for layout in ("bnfc", "bfnc"):
        for mode in ("fwd", "fwd+bwd"):
            B.bench_temporal_attention("tiny", torch.float16, layout, mode, mocked_timing)
    rows = mocked_timing.rows
    cuda_only = {"sdpa-efficient", "sdpa-cudnn", "xformers", "ldmopt-cuda"}
    # FlexAttention has no CPU backward; its forward runs (uncompiled).
    no_cpu_bwd = [r for r in rows if r["provider"] == "flex-blockdiag" and r["mode"] == "fwd+bwd"]
    assert all("backward on CPU" in r["note"] for r in no_cpu_bwd), no_cpu_bwd
    others = [r for r in rows if r not in no_cpu_bwd]
    assert len(rows) == 2 * 2 * 10 and not _failed(others, allowed=cuda_only), _failed(others, allowed=cuda_only)
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows if r["note"].startswith("max|err|")]
    assert len(errs) == 2 * (10 - len(cuda_only)) and max(errs) < 5e-3, [r["note"] for r in rows]


def test_training_providers(mocked_timing, no_compile, monkeypatch):
    pytest.importorskip("diffusers")
    from benchmarks import bench_training as B

    monkeypatch.setattr(B, "TrainStep", functools.partial(B.TrainStep, device="cpu", tiny=True))
    monkeypatch.setattr(B, "QUICK", False)  # every provider, and the batch search (_fits)
    monkeypatch.setattr(B, "CASES", {"sd15": 128})
    monkeypatch.setattr(B, "BATCHES", {"sd15": (1,)})
    monkeypatch.setattr(B, "_EAGER_PEAK", {})
    monkeypatch.delenv("LDMOPT_BENCH_TRAIN_BATCH", raising=False)
    B._batch.cache_clear()
    try:
        with ldmopt.use_backend("torch"):
            for provider in ("eager", "compile", "ldmopt", "ldmopt+compile", "ldmopt-tuned"):
                B.bench_training_step("sd15", provider, mocked_timing)
    finally:
        B._batch.cache_clear()
    rows = mocked_timing.rows
    assert [r["provider"] for r in rows] == ["eager", "compile", "ldmopt", "ldmopt+compile", "ldmopt-tuned"]
    assert not _failed(rows), _failed(rows)
    assert "; tuned: kept " in rows[4]["note"], rows[4]["note"]
    assert (harness.RESULTS_DIR / "training_tuning_sd15-128px-b1.choice.json").exists()
    assert all(r["case"] == "sd15-128px-b1" for r in rows), rows
    assert "top: " in rows[0]["note"] and "vs eager" in rows[2]["note"], [r["note"] for r in rows]
    assert (harness.RESULTS_DIR / "training_profile.md").exists()


def test_host_overhead_providers(mocked_timing, monkeypatch):
    from benchmarks import bench_host_overhead as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "CALLS", 2)
    monkeypatch.setattr(B, "WINDOWS", 3)
    with ldmopt.use_backend("torch"):
        for case in B.CASES:
            B.bench_host_overhead(case, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 4 * len(B.CASES) and not _failed(rows), _failed(rows)
    assert {(r["provider"], r["mode"]) for r in rows} == {
        ("eager", "fwd"),
        ("ldmopt", "fwd"),
        ("eager", "fwd-grad"),
        ("ldmopt", "fwd-grad"),
    }
    assert all(r["note"].endswith("us/call") for r in rows)


def test_host_overhead_cases_compare_the_same_function(monkeypatch):
    from benchmarks import bench_host_overhead as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    tensors = B._tensors(torch.float32)
    with ldmopt.use_backend("torch"):
        for case, (fused, unfused) in B.CASES.items():
            torch.testing.assert_close(fused(tensors), unfused(tensors), rtol=1e-4, atol=1e-4, msg=case)


# Block benchmarks driven by harness.record_block_providers: module (and its bench function) -> tiny settings.
_BLOCK_BENCHES = {
    "bench_wan_block": dict(TEXT_TOKENS=7, CASES={"tiny": (64, 2, 96, (3, 6, 10))}),
    "bench_transformer_block": dict(TEXT_TOKENS=7, CASES={"tiny": (40, 2, 37, 24)}),
    "bench_svd_resnet": dict(BATCH=1, FRAMES=3, TEMB_CHANNELS=16, CASES={"tiny": (64, 3, 5)}),
}


@pytest.mark.parametrize("module", list(_BLOCK_BENCHES))
def test_block_bench_providers(module, mocked_timing, monkeypatch):
    pytest.importorskip("diffusers")
    bench = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "QUICK", True)  # no torch.compile provider
    for name, value in _BLOCK_BENCHES[module].items():
        monkeypatch.setattr(bench, name, value)
    with ldmopt.use_backend("torch"):
        for mode in ("fwd", "fwd+bwd"):
            getattr(bench, module)("tiny", torch.float32, mode, mocked_timing)
    rows = mocked_timing.rows
    assert [r["provider"] for r in rows] == ["eager", "ldmopt"] * 2 and not _failed(rows), rows
    assert rows[2]["bytes"] == 2 * rows[0]["bytes"], rows  # fwd+bwd: the stream's gradient read and written too
    errs = [float(r["note"].split("; ")[0].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-5 and all("fell back" not in r["note"] for r in rows), rows


def test_rms_norm_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_rms_norm as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "SHAPES", {"tiny": (13, 40)})
    monkeypatch.setattr(B, "QUICK", False)  # all four providers (compile is the identity here)
    with ldmopt.use_backend("triton"):
        for mode in ("fwd", "fwd+bwd"):
            B.bench_rms_norm("tiny", torch.float16, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 2 * 4 and not _failed(rows), _failed(rows)
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-2, rows  # fp16 outputs against the fp32 composition


def test_rms_norm_rope_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_rms_norm as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "ROPE_SHAPES", {p: (15, 3, 8, p) for p in ("wan", "flux", "qwen")})
    monkeypatch.setattr(B, "QUICK", False)  # all three providers (compile is the identity here)
    with ldmopt.use_backend("triton"):
        for case in ("wan", "flux", "qwen"):
            for mode in ("fwd", "fwd+bwd"):
                B.bench_rms_norm_rope(case, torch.float32, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 3 * 2 * 3 and not _failed(rows), _failed(rows)
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-5, rows  # fp32: the kernel against diffusers' rotation in fp32


def test_rms_norm_rope_joint_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_rms_norm as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "ROPE_SHAPES", {"flux-1024": (15, 3, 8, "flux")})
    monkeypatch.setattr(B, "FLUX_TEXT_TOKENS", 4)
    monkeypatch.setattr(B, "QUICK", False)
    with ldmopt.use_backend("triton"):
        for mode in ("fwd", "fwd+bwd"):
            B.bench_rms_norm_rope_joint(torch.float32, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 2 * 3 and not _failed(rows), _failed(rows)
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-5, rows  # fp32: the joint kernel against diffusers' two norms, cat and rotation


def test_layer_norm_rope_providers(mocked_timing, no_compile, monkeypatch):
    from benchmarks import bench_rms_norm as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "COGVIDEOX", {"tiny": (3, 11, 2, 8)})
    monkeypatch.setattr(B, "QUICK", False)
    with ldmopt.use_backend("triton"):
        for mode in ("fwd", "fwd+bwd"):
            B.bench_layer_norm_rope("tiny", torch.float32, mode, mocked_timing)
    rows = mocked_timing.rows
    assert len(rows) == 2 * 3 and not _failed(rows), _failed(rows)
    errs = [float(r["note"].rsplit(" ", 1)[1]) for r in rows]
    assert max(errs) < 1e-5, rows  # fp32: the kernel against diffusers' norm, rotation and slice copy


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


def test_count_launches_counts_a_patched_step(capsys):
    """benchmarks/count_launches.py on the tiny SD1.5 UNet in fp16: every transformer's norm1 takes its statistics
    from proj_in's epilogue (no LayerNorm statistics pass), each transformer's GroupNorm from the resnet before it."""
    pytest.importorskip("diffusers")
    from benchmarks import count_launches

    assert count_launches.main(["sd15", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "statistics passes: group_norm " in out and ", layer_norm 0" in out, out
    handed = dict(re.findall(r"(\S+) (\d+)", out.split("handed over: ")[1]))
    assert handed["norm1"] == handed["Transformer2DModel.norm"] == "10", out
