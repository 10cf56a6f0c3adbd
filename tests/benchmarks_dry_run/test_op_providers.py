"""The op and block benchmarks on the CPU with tiny shapes and the timing mocked: every provider gives a timed row
(those that need CUDA say why not), a provider that fails is a row of its own, and the fused results match eager."""

import importlib
import re

import pytest
import torch

import ldmopt
from benchmarks import harness
from tests.benchmarks_dry_run.support import _failed


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
    assert len(rows) == 2 * (2 * 5 + 2 * 5 + 5 + 4 + 5 + 4 + 2 * 4 + 5) + 2, len(rows)
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
    assert len(rows) == 2 * 2 * 11 and not _failed(others, allowed=cuda_only), _failed(others, allowed=cuda_only)
    errs = [float(m[1]) for r in rows if (m := re.match(r"max\|err\| vs fp32 SDPA (\S+?)(;|$)", r["note"]))]
    assert len(errs) == 2 * (11 - len(cuda_only)) and max(errs) < 5e-3, [r["note"] for r in rows]
    # the Triton rows name the tiles they launched: on CPU tensors both run the heuristic one (nothing autotunes)
    triton_rows = [r for r in rows if r["provider"].startswith("ldmopt-triton")]
    tiles = {(r["provider"], r["mode"]): r["note"].split("; ")[-1] for r in triton_rows}
    assert set(tiles.values()) == {"tile P4xD32w4", "tile P4xD32w4, backward P4xD32w4"}, tiles
    assert len(tiles) == 4, tiles


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
