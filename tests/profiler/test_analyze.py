"""The analytic cost model: counted FLOPs equal torch's flop counter, known per-model totals, scaling laws, fusions."""

import argparse
import json
import time

import pytest
import torch

from ldmopt import configs
from ldmopt.profiler import GPUS, GPUSpec, analyze, register_gpu
from ldmopt.profiler import categories as C
from ldmopt.profiler.fusions import (
    ADALN,
    CONV_EPILOGUE,
    GATED_RESIDUAL,
    GEGLU,
    GELU_EPILOGUE,
    GN_CONV,
    TEMPORAL_PERMUTES,
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("name", configs.names())
def test_counted_flops_equal_flop_counter_on_every_tiny_model(name):
    a = analyze(name, tiny=True, check_flops=True)
    assert a.total_flops > 0
    assert a.total_flops == a.flop_counter_total
    for by in ("time", "flops", "bytes"):
        assert sum(a.shares(by).values()) == pytest.approx(1.0)
        assert sum(a.shares(by, patched=True).values()) == pytest.approx(1.0)
    assert a.patched_bytes <= a.total_bytes and a.patched_time_s <= a.time_s


def test_sd15_512_batch2_matches_the_known_totals():
    # SD1.5 at 512 px, batch 2: ~1.61 TFLOP per UNet call: conv 0.89, linear 0.47, attention bmm 0.25.
    a = analyze("sd15", resolution=512, batch=2, check_flops=True)
    assert a.total_flops == a.flop_counter_total
    assert a.total_flops / 1e12 == pytest.approx(1.61, rel=0.01)
    assert a.flops_of(C.CONV) / 1e12 == pytest.approx(0.89, rel=0.01)
    assert a.flops_of(C.LINEAR) / 1e12 == pytest.approx(0.47, rel=0.01)
    assert a.flops_of(*C.ATTENTION) / 1e12 == pytest.approx(0.25, rel=0.02)
    assert a.categories[C.ATTN_UNATTRIBUTED].flops == 0 and a.categories[C.ATTN_TEMPORAL].flops == 0
    # Level token counts of SD1.5 at 512: 4096/1024/256/64 queries, 77 text tokens.
    assert {g["q_len"] for g in a.sequence_lengths()} == {4096, 1024, 256, 64}
    assert {g["kv_len"] for g in a.sequence_lengths() if g["kind"] == "cross"} == {77}
    text = a.table()
    assert "PROJECTION" in text and "equal" in text


def test_sdxl_1024_runs_on_meta_in_seconds_without_memory():
    before = _rss_bytes()
    start = time.perf_counter()
    a = analyze("sdxl", resolution=1024)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"{elapsed:.1f} s (a few seconds on an idle core)"
    # 2.57 B fp16 parameters would be 5 GB; activations more. Meta tensors allocate nothing.
    assert _rss_bytes() - before < 1 << 30
    assert not torch.cuda.is_initialized()
    assert a.params == 2_567_463_684
    assert a.total_flops / 1e12 == pytest.approx(13.5, rel=0.02)
    # SDXL at 1024 px, batch 2: 60 transformer blocks at (2, 1024, 1280) with 20 heads of 64, 10 at (2, 4096, 640).
    spatial = [g for g in a.sequence_lengths() if g["kind"] == "spatial"]
    calls = {(g["q_len"], g["head_dim"]): g["calls"] for g in spatial}
    assert calls == {(1024, 64): 60, (4096, 64): 10}


def test_spatial_attention_flops_scale_with_tokens_squared():
    small = analyze("sd15", tiny=True, resolution=128, batch=1)
    large = analyze("sd15", tiny=True, resolution=256, batch=1)  # 4x the tokens at every level
    assert large.flops_of(C.ATTN_SPATIAL) == 16 * small.flops_of(C.ATTN_SPATIAL)
    assert large.flops_of(C.ATTN_CROSS) == 4 * small.flops_of(C.ATTN_CROSS)  # 77-ish text keys stay fixed
    for call in small.attention:
        assert call.flops == 4 * call.batch_heads * call.q_len * call.kv_len * call.head_dim


@pytest.mark.parametrize("name", ["animatediff", "latte", "modelscope"])
def test_temporal_attention_flops_scale_with_frames_squared(name):
    a4 = analyze(name, tiny=True, frames=4, batch=1)
    a8 = analyze(name, tiny=True, frames=8, batch=1)
    assert a4.flops_of(C.ATTN_TEMPORAL) > 0
    assert a8.flops_of(C.ATTN_TEMPORAL) == 4 * a4.flops_of(C.ATTN_TEMPORAL)
    assert a8.flops_of(C.ATTN_SPATIAL) == 2 * a4.flops_of(C.ATTN_SPATIAL)
    assert {g["q_len"] for g in a8.sequence_lengths() if g["kind"] == "temporal"} == {8}


def test_fusion_projection_finds_each_pattern():
    unet = analyze("sd15", tiny=True)
    assert unet.fusions[GN_CONV].count > 0 and unet.fusions[CONV_EPILOGUE].count > 0
    geglu_modules = sum(type(m).__name__ == "GEGLU" for m in configs.build_model("sd15", tiny=True).modules())
    assert unet.fusions[GEGLU].count == geglu_modules
    dit = analyze("dit", tiny=True)
    assert dit.fusions[ADALN].count > 0 and dit.fusions[GELU_EPILOGUE].count > 0
    assert dit.fusions[GATED_RESIDUAL].count > 0
    video = analyze("animatediff", tiny=True)
    assert video.fusions[TEMPORAL_PERMUTES].count > 0
    for a in (unet, dit, video):
        assert a.patched_bytes < a.total_bytes
        assert sum(c.patched_ops for c in a.categories.values()) < a.ops


def test_a_diffusers_model_with_weights_is_rebuilt_on_meta():
    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1)
    a = analyze(model, inputs=inputs, dtype=torch.float32)
    b = analyze("sd15", tiny=True, batch=1, dtype="fp32")
    assert a.total_flops == b.total_flops and a.total_bytes == b.total_bytes
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_inputs_in_another_dtype_are_analysed_in_the_analysis_dtype(input_dtype):
    """A user's fp32 (or bf16) inputs with the default fp16 analysis: the model is rebuilt in fp16, and so are they
    (they once reached it as given: 'Input type (float) and bias type (c10::Half) should be the same')."""
    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1, dtype=input_dtype)
    a = analyze(model, inputs=inputs.kwargs)
    b = analyze("sd15", tiny=True, batch=1)
    assert a.dtype == b.dtype and a.total_flops == b.total_flops and a.total_bytes == b.total_bytes


def test_gpu_table_and_roofline():
    assert {"A100", "H100", "H200"} <= set(GPUS)
    h100 = GPUS["H100"]
    assert h100.op_time(0, 3.35e12, "fp16") == pytest.approx(1.0)
    assert h100.op_time(989.4e12, 1, "fp16") == pytest.approx(1.0)
    slow = GPUSpec("test-gpu", hbm_bytes_per_s=1e12, matmul_flops={"fp16": 100e12}, vector_flops=10e12)
    register_gpu(slow)
    a = analyze("dit", tiny=True, gpu="test-gpu")
    b = analyze("dit", tiny=True, gpu="H200")
    assert a.gpu is slow and a.time_s > b.time_s
    assert a.total_flops == b.total_flops
    with pytest.raises(KeyError, match="register_gpu"):
        analyze("dit", tiny=True, gpu="B300x")


def test_cli_sweep_writes_json_and_plot(tmp_path, capsys):
    from ldmopt.profiler import cli

    parser = argparse.ArgumentParser()
    cli.configure_analyze(parser)
    out_json, out_png = tmp_path / "a.json", tmp_path / "a.png"
    argv = ["animatediff", "--tiny", "--frames", "2,4", "--batch", "1", "--json", str(out_json)]
    if _has_matplotlib():  # matplotlib is in the bench extra, not the test extra
        argv += ["--plot", str(out_png)]
    assert cli.run_analyze(parser.parse_args(argv)) == 0
    assert "scaling sweep" in capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [r["frames"] for r in rows] == [2, 4]
    assert rows[1]["categories"][C.ATTN_TEMPORAL]["flops"] == 4 * rows[0]["categories"][C.ATTN_TEMPORAL]["flops"]
    if _has_matplotlib():
        assert out_png.stat().st_size > 0
    assert cli.run_analyze(parser.parse_args(["sd4"])) == 2


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
