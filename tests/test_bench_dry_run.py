"""The GPU benchmarks' own logic, run on the CPU with tiny models and the timing mocked: every provider must produce
a timed row, not a 'failed' one (a GPU run is rare and short; a Python error in a benchmark would waste it)."""

import pytest
import torch

import ldmopt
from benchmarks import harness


class _Rows:
    def __init__(self):
        self.rows = []

    def record(self, **row):
        self.rows.append(row)


@pytest.fixture
def mocked_timing(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "time_fn", lambda fn, **_: (fn(), harness.Timing(1.0, 0.9, 1.1))[1])
    monkeypatch.setattr(harness, "peak_memory", lambda fn: (fn(), 0)[1])
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    return _Rows()


def _failed(rows):
    return [(r["case"], r["provider"], r.get("note")) for r in rows if r["timing"] is None]


def test_e2e_step_providers(mocked_timing, monkeypatch):
    pytest.importorskip("diffusers")
    from benchmarks import bench_e2e
    from ldmopt import configs

    def tiny(name, dtype):
        model = configs.build_model(bench_e2e.MODELS[name][0], device="cpu", dtype=torch.float32, tiny=True)
        return model, configs.example_inputs(model, batch=1)

    monkeypatch.setattr(bench_e2e, "_build", tiny)
    with ldmopt.use_backend("torch"):
        for provider in ("eager", "ldmopt"):
            bench_e2e.bench_denoising_step("dit-256", provider, mocked_timing)
    assert len(mocked_timing.rows) == 2 and not _failed(mocked_timing.rows), mocked_timing.rows
    assert "patched" in mocked_timing.rows[1]["note"]


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
