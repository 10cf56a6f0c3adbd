"""benchmarks/check_gpu.py and benchmarks/check_cuda_backend.py run on the CPU with tiny shapes: every registered check
must pass its own bounds on the Triton backend (interpreter) and report the unavailable cuda backend as a skip, so a
Python error in them cannot waste a rare GPU run. bf16 is left out: tl.dot in bf16 is wrong in Triton 3.8's
interpreter (the GPU run still checks it)."""

import re
import sys

import pytest
import torch

from benchmarks import bench_group_norm, check_cuda_backend, check_gpu, check_gpu_norms, harness
from benchmarks import check_gpu_linear as L
from benchmarks import check_gpu_norms as N
from ldmopt.ops import linear_cublas
from tests.benchmarks_dry_run.support import _one_thread  # noqa: F401 (an autouse fixture: one intra-op thread)
from tests.ops.test_linear_cublas import _addmm_tanh_gelu

_ROW = re.compile(r"^(\S+)\s+(\S+)\s+(float32|float16)\s+(triton\S*|cuda)\s+([-+.e\d ]+?)\s+(PASS|FAIL)$")
# The cuda backend's reason: "not on a CUDA device" where ldmopt._C is built (CI), the build's own reason where not.
_SKIP = re.compile(r"^  skip (\S+) (\S+) torch\.(float32|float16) cuda: .*(not on a CUDA device|skipped: )")


def _parse(text):
    rows = [m.groups() for m in map(_ROW.match, text.splitlines()) if m]
    skips = [m.groups() for m in map(_SKIP.match, text.splitlines()) if m]
    return rows, skips


def test_check_gpu_tables():
    assert set(check_gpu.CASES) == set(check_gpu.CHECKS)
    names = {case for cases in check_gpu.CASES.values() for case in cases}
    assert check_gpu.FULL_ONLY.issubset(names)
    for name in check_gpu.CHECKS:
        assert not set(check_gpu._cases(name, True)) & check_gpu.FULL_ONLY
        assert check_gpu._cases(name, False) == check_gpu.CASES[name]


def test_check_gpu_every_check(monkeypatch, capsys):
    pytest.importorskip("diffusers")
    from ldmopt.nn import resnet

    C = check_gpu
    monkeypatch.setattr(C, "DEVICE", "cpu")
    # fp16 alone, as the GPU runs fp16 and bf16 (whose tl.dot the interpreter gets wrong): the checks' logic is the
    # same for each dtype, and a second one doubled the cost of this test
    monkeypatch.setattr(C, "DTYPES", (torch.float16,))
    monkeypatch.setattr(C, "MOTION_FRAMES", 3)
    monkeypatch.setattr(C, "SVD_FRAMES", 3)
    monkeypatch.setattr(C, "SVD_CONTEXT_DIM", 24)
    monkeypatch.setattr(C, "REF_SEQUENCES", 4)  # the reference slices the sequences
    monkeypatch.setattr(check_gpu_norms, "FLUX_TEXT", 3)  # text tokens of the joint q/k case
    # the GELU-tanh case's inference row takes the cuBLASLt route on CPU tensors too, its GEMM CUDA's semantics
    monkeypatch.setattr(linear_cublas, "TANH_GELU_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_addmm_activation", _addmm_tanh_gelu)
    linear_cublas.gelu_epilogue_counts.clear()
    cases = {
        "group_norm_silu": {"gn-96": (2, 96, 3, 5)},
        "resnet_block": {"temb-32to96": (1, 32, 96, 3, 40), "vae-64to32": (1, 64, 32, 2, None)},
        "svd_resnet_block": {"svd-64": (2, 3, 64, 3, 2, 16)},
        "resnet_skip": {"skip-40+24to32": (1, 40, 24, 32, 3, 16)},
        "upsample_conv": {"up-24": (2, 24, 3)},
        "fused_linear": {
            "geglu": (L._run_geglu, L._ref_geglu, 2, 7, 40, 48),
            "gelu_tanh": (L._run_gelu, L._ref_gelu, 2, 7, 40, 24),
            "gated": (L._run_gated, L._ref_gated, 2, 7, 40, 24),
            "adaln": (L._run_adaln, L._ref_adaln, 2, 7, 40, None),
            "adaln-gated": (L._run_adaln_gated, L._ref_adaln_gated, 2, 7, 40, None),
            "gated-out_dtype": (L._run_gated_wan, L._ref_gated, 2, 7, 40, 24),
            "blend": (L._run_blend, L._ref_blend, 3, 7, 40, 24),
            "ln-linear": (L._run_ln_linear, L._ref_ln_linear, 2, 7, 40, 24),
            "ln-geglu": (L._run_ln_linear, L._ref_ln_linear, 2, 7, 40, 160),
            "ln-positions": (L._run_ln_linear_pos, L._ref_ln_linear_pos, 2, 32, 40, 24),
            "rms_norm": (N._run_rms_norm, N._ref_rms_norm, 2, 7, 40, 0),
            "rms_rope": (N._run_rms_norm_rope, N._ref_rms_norm_rope, 2, 7, 40, 0),
            "rms_rope-heads": (N._run_rms_norm_rope_heads, N._ref_rms_norm_rope_heads, 2, 7, 40, 8),
            "rms_rope-complex": (N._run_rms_norm_rope_complex, N._ref_rms_norm_rope_complex, 2, 7, 40, 8),
            "rms_rope-joint": (N._run_rms_norm_rope_joint, N._ref_rms_norm_rope_joint, 2, 7, 40, 8),
            "ln_rope": (N._run_layer_norm_rope, N._ref_layer_norm_rope, 2, 7, 40, 8),
        },
        "linear_row_stats": {"attn-out": (2, 37, 40, 72, 40.0)},  # 3 row and 3 column tiles of the interpreter's 32
        "conv_row_stats": {"proj_in": (2, 64, 200, 9)},  # 81 pixels, 200 channels: 2 row and 2 column tiles of 64x128
        "channel_sums": {"proj_out": (2, 39, 25, 9)},  # 81 pixels: 2 row tiles of 64; groups of 2 straddle at 39
        "temporal_attention": {"ta": (2, 5, 6, 2, 24)},
        "temporal_layout": {"motion": (C._motion, 96, 3, 2), "svd": (C._svd, 64, 2, 2)},
    }
    monkeypatch.setattr(C, "CASES", cases)
    monkeypatch.setattr(C, "FULL_ONLY", {"vae-64to32"})
    resnet.fallback_reasons.clear()
    failures = C.run_checks(quick=False)
    out = capsys.readouterr().out
    assert failures == 0, out
    assert out.rstrip().endswith("check_gpu: all passed"), out
    assert not resnet.fallback_reasons, dict(resnet.fallback_reasons)
    rows, skips = _parse(out)
    assert all(r[5] == "PASS" and r[3].startswith("triton") for r in rows), out
    placed = ("resnet_block", "resnet_skip", "conv_row_stats")  # staged before cuDNN's or ldmopt's conv, or loader
    assert {r[3] for r in rows if r[0] in placed} == {"triton/cudnn", "triton/staged", "triton/loader"}, out
    plain = ("upsample_conv", "channel_sums")  # cuDNN's conv or ldmopt's
    assert {r[3] for r in rows if r[0] in plain} == {"triton/cudnn", "triton/staged"}, out
    # cuBLAS's GEMM then the epilogue pass, or ldmopt's Triton GEMM
    gemms = {("linear_row_stats", "attn-out")} | {
        ("fused_linear", case) for case, spec in cases["fused_linear"].items() if spec[0] in C._GEMM_RUNS
    }
    assert len(gemms) == 8 and {r[3] for r in rows if r[:2] in gemms} == {"triton/cublas", "triton/gemm",
                                                                           "triton/cublaslt"}, out  # fmt: skip
    assert [r[:2] for r in rows if r[3] == "triton/cublaslt"] == [("fused_linear", "gelu_tanh")], out
    assert linear_cublas.gelu_epilogue_counts["cublaslt"] == 1, linear_cublas.gelu_epilogue_counts
    lt_rows = {("fused_linear", "gelu_tanh")}  # and GELU in cuBLASLt's epilogue, in inference
    for name, by_case in cases.items():
        for case in by_case:
            three = name in placed or (name, case) in lt_rows
            expect = 3 if three else 2 if name in plain or (name, case) in gemms else 1
            if name == "temporal_attention":
                continue  # below
            assert sum(r[:2] == (name, case) for r in rows) == expect, (name, case, out)
    # temporal attention: autotuned, then each candidate tile forced (the CUDA backend skips on CPU)
    tiles = [r[3] for r in rows if r[0] == "temporal_attention"]
    assert tiles == ["triton", "triton:P4xD32w4", "triton:P8xD32w8", "triton:P2xD32w2"], out
    assert sorted(s[0] for s in skips) == ["group_norm_silu", "temporal_attention"], out


def test_check_gpu_poison_check_covers_every_sequence(monkeypatch, capsys):
    """The fp64 reference covers REF_SEQUENCES sequences; an unwritten (NaN) output past them must still fail."""
    C = check_gpu
    monkeypatch.setattr(C, "DEVICE", "cpu")
    monkeypatch.setattr(C, "DTYPES", (torch.float32,))
    monkeypatch.setattr(C, "REF_SEQUENCES", 4)
    monkeypatch.setattr(C, "CASES", {**C.CASES, "temporal_attention": {"ta": (2, 5, 6, 2, 24)}})  # N = 6 > 4
    module = sys.modules["ldmopt.ops.temporal_attention"]
    real = module.temporal_attention

    def last_sequence_unwritten(q, k, v, **kwargs):
        out = real(q, k, v, **kwargs)
        return out + torch.where(torch.arange(out.shape[2]) == 5, float("nan"), 0.0)[None, None, :, None, None]

    monkeypatch.setattr(module, "temporal_attention", last_sequence_unwritten)
    assert C.run_checks(quick=False, only=["temporal_attention"]) == 1
    out = capsys.readouterr().out
    fails = [line.split()[3:] for line in out.splitlines() if line.endswith("FAIL")]
    assert len(fails) == 1 and fails[0][:2] == ["triton", "nan"], out  # the output flagged, its gradients finite


def test_check_gpu_shards_split_the_cases(monkeypatch):
    """run_gpu.sh's parallel shards: each (check, case) pair in exactly one of them."""
    for quick in (True, False):
        whole = sorted((name, case) for name in check_gpu.CASES for case in check_gpu._cases(name, quick))
        seen = []
        for k in range(3):
            monkeypatch.setattr(check_gpu, "SHARD", (k, 3))
            seen += [(name, case) for name in check_gpu.CASES for case in check_gpu._cases(name, quick)]
        monkeypatch.setattr(check_gpu, "SHARD", (0, 1))
        assert sorted(seen) == whole and len(whole) > 3, (seen, whole)


def test_check_gpu_main_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert check_gpu.main(["--quick"]) == 0
    assert capsys.readouterr().out == "check_gpu: no CUDA device; nothing to check\n"


def test_check_gpu_refuses_an_unknown_check_name(capsys):
    # A misspelt --only (LDMOPT_CHECK_ONLY in run_gpu.sh) ran nothing and printed "all passed".
    with pytest.raises(SystemExit) as exit_info:
        check_gpu.main(["--only", "fused_linear", "--only", "fused_linaer"])
    assert exit_info.value.code == 2
    assert "--only fused_linaer: no such check; expected some of group_norm_silu" in capsys.readouterr().err


@pytest.fixture
def cuda_backend_cpu(monkeypatch, tmp_path):
    C = check_cuda_backend
    monkeypatch.setattr(C, "DEVICE", "cpu")
    monkeypatch.setattr(C, "DTYPES", (torch.float32, torch.float16))
    monkeypatch.setattr(bench_group_norm, "SHAPES", {"gn-96": (1, 96, 3, 2), "gn-64": (2, 64, 2, 3)})
    monkeypatch.setattr(C, "QUICK_GROUP_NORM", ("gn-64",))
    monkeypatch.setattr(C, "ATTENTION_SHAPES", {"ta-a": (6, 5, 2, 24), "ta-b": (5, 3, 3, 40)})
    monkeypatch.setattr(C, "QUICK_ATTENTION", ("ta-b",))
    monkeypatch.setattr(C, "LAYER_NORM_SHAPES", {"ln-a": (7, 40), "ln-b": (5, 24)})
    monkeypatch.setattr(C, "QUICK_LAYER_NORM", ("ln-a",))
    monkeypatch.setattr(C, "EPILOGUE_SHAPES", {"geglu": (6, 40, "geglu"), "gate": (8, 24, "gate_residual_stats"),
                                               "tanh": (5, 16, "gelu_tanh"), "clamp": (4, 8, "saturate")})  # fmt: skip
    monkeypatch.setattr(C, "QUICK_EPILOGUE", ("gate",))
    monkeypatch.setattr(C, "CONV_EPILOGUE_SHAPES", {"c1": (2, 64, 5, 3, "conv1"), "c2": (1, 40, 4, 4, "conv2"),
                                                    "c3": (2, 64, 3, 5, "temporal")})  # fmt: skip
    monkeypatch.setattr(C, "QUICK_CONV_EPILOGUE", ("c1",))
    monkeypatch.setattr(C, "FROM_SUMS_SHAPES", {"s1": (2, 48, 16, 9, 1), "s2": (6, 32, 32, 5, 3)})
    monkeypatch.setattr(C, "QUICK_FROM_SUMS", ("s1",))
    monkeypatch.setattr(
        C, "ADALN_SHAPES", {"a1": (6, 40, 2, ""), "a2": (8, 24, 4, "residual"), "a3": (4, 16, 2, "gated")}
    )
    monkeypatch.setattr(C, "QUICK_ADALN", ("a3",))
    monkeypatch.setenv("LDMOPT_POISON_OUTPUTS", "1")  # the script sets it; restored afterwards
    monkeypatch.delenv("LDMOPT_BENCH_CSV", raising=False)
    monkeypatch.setattr(harness, "time_fn", lambda fn, **_: (fn(), harness.Timing(1.0, 0.9, 1.1))[1])
    monkeypatch.setattr(harness, "ceilings", lambda: harness.Ceilings(copy_gbps=1000.0, bf16_tflops=100.0))
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    return C


def test_check_cuda_backend_checks(cuda_backend_cpu, capsys):
    assert cuda_backend_cpu.run_checks(quick=False) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("check_cuda_backend: all checks passed"), out
    rows, skips = _parse(out)
    assert all(r[5] == "PASS" and r[3] == "triton" for r in rows), out
    gn = [r for r in rows if r[0] == "group_norm_silu"]
    gn_stats = [r for r in rows if r[0] == "gn_stats"]
    gn_apply = [r for r in rows if r[0] == "gn_apply"]
    gn_apply_parts = [r for r in rows if r[0] == "gn_apply_parts"]
    attn = [r for r in rows if r[0] == "temporal_attention"]
    ln = [r for r in rows if r[0] == "ln_stats"]
    ln_apply = [r for r in rows if r[0] == "ln_apply"]
    epilogues = [r for r in rows if r[0] in ("linear_epilogue", "conv_epilogue")]
    from_sums = [r for r in rows if r[0] == "stats_from_sums"]
    adaln = [r for r in rows if r[0] == "adaln_modulate"]
    assert len(adaln) == 3 * 2, out  # shapes x dtypes
    assert len(from_sums) == 2, out  # its two cases, fp32 statistics
    assert len(gn) == len(gn_stats) == 2 * 2 * 2 and len(attn) == len(ln) == len(ln_apply) == 2 * 2, out
    assert len(epilogues) == (4 + 3) * 2, out  # shapes x dtypes
    assert len(gn_apply) == 2 * 2 and all("channels_last" in r[1] for r in gn_apply), out  # channels-last only
    assert [r[1:4] for r in gn_apply_parts] == [r[1:4] for r in gn_apply], out  # the same cases, as two parts
    kinds = (gn, gn_stats, gn_apply, gn_apply_parts, ln, ln_apply, epilogues, from_sums, adaln, attn)
    assert len(rows) == sum(map(len, kinds)), out
    # every cuda case is a skip on the CPU
    assert len(skips) == sum(map(len, kinds)) - len(gn_apply) - len(gn_apply_parts), out


def test_check_cuda_backend_benchmarks(cuda_backend_cpu, capsys, tmp_path):
    assert cuda_backend_cpu.run_checks(quick=True) == 0
    cuda_backend_cpu.run_benchmarks(quick=True)
    out = capsys.readouterr().out
    assert "side by side" in out and "| op | case |" in out, out
    rows = harness.recorder_from_csv(tmp_path / "results.csv").rows
    # quick: one group norm case (fwd, fwd+bwd), one attention case and one epilogue case (fwd), three providers each
    assert len(rows) == 4 * 3, [(r.case, r.provider, r.mode) for r in rows]
    assert all(r.op.startswith(cuda_backend_cpu.OP_PREFIX) for r in rows), [r.op for r in rows]  # not the bench rows
    failed = [(r.case, r.provider, r.note) for r in rows if r.median_ms is None and r.provider != "ldmopt-cuda"]
    assert not failed, failed
    assert all(r.note.startswith("unavailable: BackendUnavailableError") for r in rows if r.provider == "ldmopt-cuda")
    assert "| ldmopt-triton |" in harness.recorder_from_csv(tmp_path / "results.csv").summary()  # run_gpu.sh's table


def test_check_cuda_backend_main_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert check_cuda_backend.main(["--quick"]) == 0
    assert capsys.readouterr().out == "check_cuda_backend: no CUDA device; nothing to check\n"


def test_check_scripts_report_failures(monkeypatch, capsys):
    """A check that fails its bound or raises is a FAIL or ERROR line and counts, and the other checks still run."""

    def bad(quick):
        yield "case", torch.float16, "triton", [torch.ones(3)], [torch.zeros(3) + 2]
        raise RuntimeError("boom")

    def good(quick):
        yield "case", torch.float32, "triton", [torch.ones(3)], [torch.ones(3)]

    monkeypatch.setattr(check_gpu, "CHECKS", {"bad": bad, "good": good})
    assert check_gpu.run_checks(quick=True) == 2
    assert check_gpu.run_checks(quick=True, only=["good"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" in out and "bad                    ERROR RuntimeError: boom\n" in out, out  # the summary's line
    assert "check_gpu: 2 failed" in out and "check_gpu: all passed" in out, out

    monkeypatch.setattr(check_cuda_backend, "check_group_norm", lambda quick: (("op", *r) for r in bad(quick)))
    for name in ("check_group_norm_parts", "check_stats_from_sums", "check_layer_norm_stats", "check_layer_norm_apply",
                 "check_linear_epilogue", "check_conv_epilogue", "check_adaln", "check_attention"):  # fmt: skip
        monkeypatch.setattr(check_cuda_backend, name, lambda quick: (("op", *r) for r in good(quick)))
    assert check_cuda_backend.run_checks(quick=True) == 2
    out = capsys.readouterr().out
    assert "FAIL" in out and "<lambda> ERROR RuntimeError: boom\n" in out, out
    assert "check_cuda_backend: 2 checks failed" in out, out


def test_check_scripts_main_with_cuda(monkeypatch, capsys):
    """main() past the CUDA test, with the checks stubbed: arguments, the extension test and exit codes."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check_gpu, "run_checks", lambda quick, only: calls.append(("gpu", quick, only)) or 1)
    monkeypatch.setattr(check_gpu, "SHARD", (0, 1))
    assert check_gpu.main(["--quick", "--only", "fused_linear", "--only", "temporal_layout", "--shard", "2/3"]) == 1
    assert calls == [("gpu", True, ["fused_linear", "temporal_layout"])] and check_gpu.SHARD == (2, 3)
    with pytest.raises(SystemExit):
        check_gpu.main(["--shard", "3/3"])

    C = check_cuda_backend
    monkeypatch.setattr(C, "run_checks", lambda quick: calls.append(("checks", quick)) or 0)
    monkeypatch.setattr(C, "run_benchmarks", lambda quick: calls.append(("bench", quick)))
    monkeypatch.setattr(C._env, "cuda_extension_status", lambda: (True, "ldmopt._C loaded"))
    assert C.main([]) == 0 and C.main(["--quick", "--no-bench"]) == 0
    assert calls[1:] == [("checks", False), ("bench", False), ("checks", True)]
    monkeypatch.setattr(C._env, "cuda_extension_status", lambda: (False, "not built"))
    assert C.main(["--quick"]) == 1 and len(calls) == 4
    assert "the CUDA extension is not loaded" in capsys.readouterr().out
