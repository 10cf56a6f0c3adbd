"""The whole-model benchmarks on the CPU with tiny models and the timing mocked: bench_e2e's denoising steps,
bench_training's training steps, and count_launches.py on a patched step."""

import functools
import json
import re

import pytest
import torch

import ldmopt
from benchmarks import harness
from tests.benchmarks_dry_run.support import _failed


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


def test_e2e_cuda_graphs_providers(mocked_timing, monkeypatch):
    """ldmopt.cuda_graphs around the stock and the patched step (a VAE's decode too), with the CPU stand-in for the
    capture: each row's note says what was graphed, no ``+graph`` row nests a capture, and the models end unpatched."""
    pytest.importorskip("diffusers")
    from benchmarks import bench_e2e
    from ldmopt import configs
    from tests.support.replaying_graphs import replaying_backend

    built = []

    def tiny(name, dtype):
        model = configs.build_model(bench_e2e.MODELS[name][0], device="cpu", dtype=torch.float32, tiny=True)
        built.append(model.eval())
        return model, configs.example_inputs(model, batch=1)

    monkeypatch.setattr(bench_e2e, "_build", tiny)
    backend = replaying_backend(monkeypatch)
    with ldmopt.use_backend("torch"):
        for name in ("dit-256", "sdxl-vae-decode-1024"):
            for provider in ("eager-cuda-graphs", "ldmopt-cuda-graphs"):
                bench_e2e.bench_denoising_step(name, provider, mocked_timing)
    rows = mocked_timing.rows
    assert [r["provider"] for r in rows] == ["eager-cuda-graphs", "ldmopt-cuda-graphs"] * 2
    assert not _failed(rows), rows
    for row in rows:
        assert re.search(r"(UNet|Transformer|DiT|Autoencoder)\w*: 1 graphs held \(1 captured", row["note"]), row["note"]
        assert "eager calls" in row["note"] and "eager x" not in row["note"]
    assert "patched" in rows[1]["note"] and "patched" not in rows[0]["note"]
    assert backend.captures == 4
    for model in built:
        assert not ldmopt.is_patched(model) and ldmopt.graphs.GRAPHED not in model.__dict__


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


def test_count_launches_as_a_gpu_with_the_extension(capsys):
    """--as-gpu: the GPUs' placements with ldmopt._C's ops stood in for. The passes around cuDNN's conv and cuBLAS's
    GEMM are C++ op calls then (the Triton-only count has them as launches), and the placements restored after."""
    pytest.importorskip("diffusers")
    from benchmarks import count_launches
    from ldmopt.ops import linear_cublas

    dtype = torch.float32
    plain = count_launches.count_step("sd15", None, None, dtype, tiny=True)
    gpu = count_launches.count_step("sd15", None, None, dtype, tiny=True, as_gpu=True)
    cpp = gpu["cpp_calls"]
    assert cpp["conv_epilogue_cuda"] > 0 and cpp["linear_epilogue_cuda"] > 0 and cpp["layer_norm_apply_cuda"] > 0, cpp
    assert not plain["cpp_calls"] and sum(gpu["launches"].values()) < sum(plain["launches"].values()), (plain, gpu)
    assert "_conv_epilogue_kernel" not in gpu["launches"] and "_linear_epilogue_kernel" not in gpu["launches"], gpu
    # the staged GroupNorms, an up block's (hidden, skip) pairs too, are C++ op calls
    assert "_group_norm_fwd_apply_kernel" not in gpu["launches"] and cpp["group_norm_apply_cuda"] > 0, gpu
    # and so are the statistics of the last up block's pair, whose skip (conv_in's output) sums nothing: no GroupNorm
    # launch is left, in fp32 or fp16 (the full SD1.5 at 128 px in fp16 makes no Triton launch at all: RESULTS.md)
    assert not [k for k in gpu["launches"] if "group_norm" in k] and cpp["group_norm_stats_cuda"] > 0, gpu
    assert linear_cublas.gemm_placement(torch.device("cpu")) == "triton"  # the CPU's own choice is back
    assert count_launches.main(["sd15", "--tiny", "--dtype", "fp32", "--as-gpu"]) == 0
    assert "as-gpu" in capsys.readouterr().out
    assert count_launches.main(["sd15", "--tiny", "--as-gpu"]) == 0  # fp16: the stand-ins keep the dtypes
    half = count_launches.count_step("sd15", None, None, torch.float16, tiny=True, as_gpu=True)
    assert not [k for k in half["launches"] if "group_norm" in k], half
    # a DiT's adaLN norms are C++ op calls too: no Triton launch is left in its step
    dit = count_launches.count_step("dit", None, None, torch.float16, tiny=True, as_gpu=True)
    assert not dit["launches"] and dit["cpp_calls"]["adaln_modulate_cuda"] > 0, dit


def test_host_step_times_and_counts_both_steps():
    """benchmarks/host_step.py: the stock and the patched step of a tiny zoo model, with the GPUs' placements and
    compute stubbed in both; the stand-ins are gone afterwards."""
    pytest.importorskip("diffusers")
    import torch.nn.functional as F

    from benchmarks import host_step

    stock_conv = F.conv2d
    row = host_step.measure("dit", None, None, steps=2, stub_compute=True)
    assert F.conv2d is stock_conv
    assert row["modules"] > 0 and row["stock_calls"] > 0 and row["patched_calls"] > 0, row
    assert row["stock_ms"] > 0 and row["patched_ms"] > 0, row
    assert "| dit | " in host_step.table([row])
