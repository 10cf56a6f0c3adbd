"""`import ldmopt` is light and GPU-free; `ldmopt info` reports backends; every Triton kernel passes the AOT gate."""

import json
import os
import subprocess
import sys

import pytest

import ldmopt.aot


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_import_does_not_initialise_cuda_or_import_triton():
    code = (
        "import sys, torch, ldmopt\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'\n"
        "assert 'triton' not in sys.modules, 'triton imported at import'\n"
        "assert 'diffusers' not in sys.modules, 'diffusers imported at import'\n"
        "print('ok')"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_lazy_patch_is_the_same_callable_package_on_every_access():
    # The first access used to give the function (so ldmopt.patch.FAMILIES failed), later ones the subpackage.
    code = (
        "import ldmopt\n"
        "first = ldmopt.patch\n"
        "print(sorted(first.FAMILIES)[0], first is ldmopt.patch, callable(first), first.__name__)\n"
        "print(ldmopt.unpatch is ldmopt.patch.unpatch, ldmopt.is_patched is ldmopt.patch.is_patched)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    first_line, second_line = result.stdout.splitlines()
    assert first_line.split()[1:] == ["True", "True", "ldmopt.patch"]
    assert second_line == "True True"


def test_subpackages_named_in_the_readme_need_no_import_of_their_own():
    # README: ldmopt.profiler.analyze(...), ldmopt.configs.build_model(...) after a plain `import ldmopt`.
    code = "import ldmopt\nprint(ldmopt.profiler.analyze is ldmopt.analyze, callable(ldmopt.configs.build_model))\n"
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_import_and_reference_ops_work_without_triton():
    # None in sys.modules makes `import triton` raise ImportError: a machine without Triton.
    code = (
        "import sys, torch\n"
        "sys.modules['triton'] = None\n"
        "import ldmopt\n"
        "y = ldmopt.ops.group_norm(torch.randn(2, 8, 3, 3), 4, activation='silu')\n"
        "assert ldmopt.ops.backend_counts[('group_norm', 'torch')] == 1\n"
        "from ldmopt import _env\n"
        "print(_env.triton_status())"
    )
    result = _python(code, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert "triton is not importable" in result.stdout


def test_every_public_op_and_its_backward_runs_without_triton():
    """No backend's refusal check may import a kernel module (which imports triton) before finding Triton missing."""
    code = """
import sys, torch
sys.modules['triton'] = None
from ldmopt import ops
R = lambda *s: torch.randn(*s, requires_grad=True)
x, w, c = R(6, 8), R(8), (torch.rand(6, 4), torch.rand(6, 4))
outs = [
    ops.adaln_modulate(x.view(2, 3, 8), R(2, 8), R(2, 8), residual=R(2, 3, 8), gate=R(2, 8)),
    ops.geglu(x, R(10, 8)),
    ops.gn_silu_conv2d(R(2, 8, 5, 3), w, R(8), 4, 1e-5, R(6, 8, 3, 3)),
    ops.group_norm(R(2, 8, 5, 3), 4, w, R(8), activation="silu"),
    ops.layer_norm_linear(x, w, R(8), R(6, 8), activation="gelu"),
    ops.layer_norm_rope(x, w, R(8), rope=c, rope_layout="pairs", rope_dim=-2),
    ops.linear(x, R(6, 8), R(6), activation="gelu", residual=R(6, 6)),
    ops.rms_norm(x, w, rope=c, rope_layout="pairs", rope_dim=-2),
    ops.rms_norm((R(1, 2, 3, 8), R(1, 4, 3, 8)), (w, R(8)), cat_dim=1),
    ops.temporal_attention(R(2, 3, 4, 2, 8), R(2, 3, 4, 2, 8), R(2, 3, 4, 2, 8)),
]
sum(o.float().square().sum() for o in outs).backward()
print(ops.layer_norm_stats(x.detach()).shape, sorted({b for (_, b) in ops.backend_counts}))
"""
    result = _python(code, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.Size([2, 6]) ['torch']", result.stdout


def test_info_reports_backends():
    result = subprocess.run(
        [sys.executable, "-m", "ldmopt", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["backends_usable"]["torch"] is True
    assert set(info["backends"]) == {"cuda", "triton", "torch"}
    assert "group_norm" in info["ops"]
    for name, usable in info["backends_usable"].items():
        if not usable:
            assert info["backends"][name], f"backend {name} unusable without a reason"


def test_info_kernels_refuses_json_and_a_missing_triton_in_one_line(monkeypatch, capsys):
    """--json --kernels printed the JSON and then the kernel table (not JSON); without Triton --kernels ended in
    the AOT child's traceback."""
    import argparse
    import importlib.util

    from ldmopt import info

    assert info.run_info(argparse.Namespace(json=True, kernels=True)) == 2
    assert capsys.readouterr().err.strip() == "ldmopt info: --kernels prints a table, not JSON; run it without --json"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert info.run_info(argparse.Namespace(json=False, kernels=True)) == 2
    assert capsys.readouterr().err.strip() == (
        "ldmopt info: --kernels compiles the Triton kernels and needs Triton (pip install triton)"
    )


def test_info_without_triton_names_no_triton_cache_directory():
    # It said "on, in Triton's cache directory ~/.triton/cache" on a machine where no Triton kernel can run.
    code = "import sys\nsys.modules['triton'] = None\nfrom ldmopt.cli import main\nsys.exit(main(['info']))"
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "autotune timings cached: off (Triton is not installed)" in result.stdout.splitlines(), result.stdout
    assert ".triton" not in result.stdout and "cache directory" not in result.stdout


def test_every_flag_of_every_subcommand_has_help():
    # `ldmopt profile --help` listed --warmup with no text
    import argparse

    from ldmopt.cli import COMMANDS, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)
    missing = [
        f"ldmopt {name} {action.dest}"
        for name, sub_parser in sub.choices.items()
        for action in sub_parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, missing


@pytest.fixture(scope="module")
def aot_records():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "ldmopt.aot", "--json"], capture_output=True, text=True, env=env, timeout=1500
    )
    assert result.stdout, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_every_kernel_module_has_aot_specs():
    import importlib

    for name in ldmopt.aot.kernel_modules():
        module = importlib.import_module(name)
        assert hasattr(module, "aot_specs") and module.aot_specs(), f"{name} declares no aot_specs()"


def test_aot_module_names_are_checked(capsys, monkeypatch):
    # A name that compiles nothing printed an empty table and exited 0: a gate that passed by checking nothing.
    monkeypatch.setattr(ldmopt.aot, "run_all", lambda modules: pytest.fail("compiled before the check"))
    for name in ("bogus", "ldmopt.ops"):
        with pytest.raises(SystemExit) as exit_info:
            ldmopt.aot.main(["--module", name])
        assert exit_info.value.code == 2
        assert f"--module {name}: not a kernels module; expected one of adaln_modulate" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(ldmopt.aot, "run_all", lambda modules: seen.append(modules) or [])
    ldmopt.aot.main(["--module", "linear", "--module", "ldmopt.kernels.geglu"])
    assert seen == [["ldmopt.kernels.linear", "ldmopt.kernels.geglu"]]


def test_aot_compile_sm80_sm90_without_spills(aot_records):
    assert {r["arch"] for r in aot_records} == {80, 90}
    failures = [f"{r['kernel']} sm_{r['arch']}: {r['problem']}" for r in aot_records if not r["ok"]]
    assert not failures, "\n".join(failures)
    print(ldmopt.aot.format_table([ldmopt.aot.CompileRecord(**r) for r in aot_records]))


def test_aot_gemm_kernels_use_tensor_cores(aot_records):
    # The GEMM tiles must lower to the architecture's tensor-core MMA: wgmma on Hopper (mma.sync there runs at a
    # fraction of the rate), mma.sync on Ampere. fp32 GEMMs count too when they run TF32 as PyTorch's conv does; IEEE
    # fp32 ones (PyTorch's default for matmuls) are CUDA-core products by definition, with no MMA.
    gemm_tiles = ("geglu_fwd", "linear_fwd", "gn_conv2d")
    expected = {80: "mma", 90: "wgmma"}
    wrong = [
        f"{r['kernel']} sm_{r['arch']}: {r['mma'] or 'no MMA'}"
        for r in aot_records
        if r["kernel"].startswith(gemm_tiles)
        and r["mma"] != ("" if "fp32 ieee" in r["kernel"] else expected[r["arch"]])
    ]
    assert not wrong, "\n".join(wrong)
    assert any("fp32 ieee" in r["kernel"] for r in aot_records)  # the IEEE tiles are compiled at all
    # Temporal attention: fp16/bf16 scores and P @ V on tensor cores; fp32 stays IEEE (no TF32 rounding of scores).
    for r in aot_records:
        if r["kernel"].startswith("temporal_attention"):
            assert bool(r["mma"]) == ("fp32" not in r["kernel"]), f"{r['kernel']} sm_{r['arch']}: mma={r['mma']!r}"


#: Statistics loops that must carry no barrier: their per-element accumulators are reduced across rows once, after the
#: loop (a cross-warp reduction per tile put 28 barriers between the GroupNorm partials' loads, 2026-12-04).
BARRIER_FREE_LOOPS = (
    "group_norm_fwd_partial[",
    "group_norm_fwd_onepass[",
    "group_norm_bwd_partial[",
    "linear_bwd[",
    "geglu_bwd[",
)


def test_aot_statistics_loops_carry_no_barriers(aot_records):
    checked = [r for r in aot_records if r["kernel"].startswith(BARRIER_FREE_LOOPS)]
    assert len(checked) >= 2 * len(BARRIER_FREE_LOOPS)
    busy = [
        f"{r['kernel']} sm_{r['arch']}: {r['loop_barriers']} barriers in a loop" for r in checked if r["loop_barriers"]
    ]
    assert not busy, "\n".join(busy)
    # The measure itself finds barriers in loops: the pipelined GEMM main loops wait on their shared-memory stages.
    assert any(r["loop_barriers"] for r in aot_records if r["kernel"].startswith("linear_fwd"))


#: GEMM main loops that must stay bound by the tensor cores, not by instruction issue (ldmopt.aot's issue/mma:
#: issue cycles over MMA cycles <= 1 on sm_80 and sm_90): the plain convs the staged GroupNorm hands its activation
#: to (ldmopt/ops/gn_conv2d_prologue.py), the upsampler, and the GEMMs without a prologue in their loads. The loader
#: prologue's tiles (about 4x on sm_90, 2x on sm_80) are why the staging exists; 64x64 tiles are left out (1.5 on
#: sm_90: four warps carry a quarter of a 128x128 tile's MMA per k-step).
MMA_BOUND_LOOPS = (
    "gn_conv2d[fp16,3x3,staged conv1:temb+stats]",
    "gn_conv2d[bf16,3x3,staged conv1:temb+stats]",
    "gn_conv2d[fp16,3x3,staged conv2:shortcut parts+stats,64x128x64]",
    "gn_conv2d[fp16,3x1,staged temporal conv2",
    "gn_conv2d[fp16,3x3,stride2,plain]",
    "gn_conv2d[fp16,3x3,upsampler]",
    "geglu_fwd[fp16,infer",
    "geglu_fwd[bf16,infer",
    "geglu_fwd[fp16,train",
    "geglu_fwd[bf16,train",
    "linear_fwd[fp16,gelu_tanh",
    "linear_fwd[bf16,gelu_tanh]",
    "linear_fwd[bf16,gate+residual]",
    "linear_fwd[fp16,two-part x",
)


def test_aot_gemm_main_loops_are_bound_by_the_mma(aot_records):
    checked = [r for r in aot_records if r["kernel"].startswith(MMA_BOUND_LOOPS)]
    assert {r["kernel"].split("[")[0] for r in checked} == {"gn_conv2d", "geglu_fwd", "linear_fwd"}
    slow = [
        f"{r['kernel']} sm_{r['arch']}: {r['mma_loop_instructions']} instructions per {r['mma_loop_mmas']} MMA, "
        f"issue/mma {r['mma_loop_issue_ratio']}"
        for r in checked
        if not 0 < r["mma_loop_issue_ratio"] <= 1.0
    ]
    assert not slow, "\n".join(slow)
    # the measure itself: the loader prologue's loop is issue-bound
    loader = [r for r in aot_records if r["kernel"] == "gn_conv2d[fp16,3x3,conv1:temb+stats]"]
    assert loader and all(r["mma_loop_issue_ratio"] > 1.5 for r in loader), loader


def test_issue_ratio_from_sass():
    sass = """
        /*0100*/                   IMAD R1, R2, R3, RZ ;
        /*0110*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
        /*0120*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], R24 ;
        /*0130*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0140*/               @P0 BRA 0x100 ;
        /*0150*/                   EXIT ;
"""
    instructions, mmas = ldmopt.aot.mma_loop(sass)
    assert (instructions, mmas) == (5, ["HGMMA.64x128x16.F32", "HGMMA.64x128x16.F32"])
    # 8 warps: 2 warpgroups x 2 x 262144 FLOP at 4096 per cycle = 256 MMA cycles; 8 x 5 / 4 = 10 issue cycles
    assert ldmopt.aot.issue_ratio(instructions, mmas, 8, 90) == pytest.approx(10 / 256)
    # sm_80: HMMA.16816 per warp, 4096 FLOP at 2048 per cycle; TF32 (1684: k=4) at half the rate
    assert ldmopt.aot.issue_ratio(4, ["HMMA.16816.F32"], 4, 80) == pytest.approx(4 / (4 * 4096 / 2048))
    assert ldmopt.aot.issue_ratio(4, ["HMMA.1684.F32.TF32"], 4, 80) == pytest.approx(4 / (4 * 1024 / 1024))
    assert ldmopt.aot.mma_loop(sass.replace("HGMMA", "FFMA")) == (0, [])


def test_loop_barriers_counts_inside_loop_bodies_only():
    ptx = """
    bar.sync 0;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    bar.sync 0;
    barrier.sync 0;
    @%p1 bra $L__BB0_2;
    bar.sync 0;
$L__BB0_5:                              // =>This Inner Loop Header: Depth=1
    add.s32 %r1, %r1, 1;
    @%p2 bra.uni $L__BB0_5;
"""
    assert ldmopt.aot.loop_barriers(ptx) == 2
    assert ldmopt.aot.loop_barriers(ptx.replace("bra $L__BB0_2;", "bra $L__BB0_9;")) == 0


#: Kernels allowed to read less than 16 bytes per access (name fragment -> why).
NARROW_LOADS_ALLOWED = {
    "group_norm_fwd_finalize": "reads a few KB of fp32 partial statistics",
    "group_norm_bwd_finalize": "reads a few KB of fp32 partial sums",
    ",nchw": "NCHW tiles hold 4 elements per thread (8 B): wider tiles spilled in the sm_90 backward",
    "temporal_attention_bwd[": "fp32 only (checked below): one sequence over 4 warps, 2 floats per thread and row",
}


def test_aot_streaming_kernels_read_16_byte_vectors(aot_records):
    # Memory-bound kernels at real shapes must issue 128-bit loads (ld.global.v4 or 16-byte cp.async): a head dim of
    # 40 or 72 passed at run time once left the fp16 temporal attention on 2-byte loads, 8x the load instructions.
    narrow = [
        f"{r['kernel']} sm_{r['arch']}: widest global load {r['load_bytes']} B"
        for r in aot_records
        if r["load_bytes"] < 16 and not any(key in r["kernel"] for key in NARROW_LOADS_ALLOWED)
    ]
    narrow += [
        f"{r['kernel']} sm_{r['arch']}: widest global load {r['load_bytes']} B"
        for r in aot_records
        if r["kernel"].startswith("temporal_attention_bwd[") and "fp32" not in r["kernel"] and r["load_bytes"] < 16
    ]
    assert not narrow, "\n".join(narrow)


def test_widest_global_load_parses_ptx_forms():
    ptx = """
        @%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
        @%p2 ld.global.L1::evict_last.v2.b32 { %r1, %r2 }, [ %rd2 + 0 ];
    """
    assert ldmopt.aot.widest_global_load(ptx) == 8
    cp_async = "@%p3 cp.async.cg.shared.global [ %r3 + 0 ], [ %rd3 + 0 ], 0x10, %r4;"
    assert ldmopt.aot.widest_global_load(ptx + cp_async) == 16
    assert ldmopt.aot.widest_global_load("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];") == 16
    assert ldmopt.aot.widest_global_load("ld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [ %r5 ];") == 0
    assert ldmopt.aot.widest_global_load("@%p1 ld.global.nc.L1::evict_last.v2.f16x2 { %r1, %r2 }, [ %rd1 ];") == 8
    assert ldmopt.aot.widest_global_load("ld.volatile.global.b32 %r1, [ %rd1 ];") == 4
    assert ldmopt.aot.widest_global_load("cp.async.cg.shared::cta.global.L2::128B [ %r1 ], [ %rd1 ], 16;") == 16
    store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [ %rd1, {%r1, %r2} ], [ %r3 ];"
    assert ldmopt.aot.widest_global_load(store) == 0  # a TMA store reads nothing from global memory
    load = (
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [ %r1 ], [ %rd1, {%r2} ], [ %r3 ];"
    )
    assert ldmopt.aot.widest_global_load(load) == 16


def test_info_lists_every_public_op_with_its_backends():
    from ldmopt import info, ops

    listed = info.public_ops()
    functions = {name for name in ops.__all__ if callable(getattr(ops, name)) and name[0].islower()}
    assert set(listed) == functions - {"use_backend"}, set(listed) ^ functions
    for name in ("group_norm", "temporal_attention", "layer_norm_stats"):  # ldmopt._C serves these too
        assert listed[name] == ("cuda", "triton", "torch"), name
    assert listed["rms_norm_joint"] == ("triton", "torch")
    # its own table, not its module's widest: only layer_norm_linear's statistics have a cuda backend
    assert listed["layer_norm_linear"] == ("triton", "torch")


def test_demo_save_folder_is_made_before_the_run(tmp_path, monkeypatch):
    import ldmopt.demo
    from ldmopt.cli import main

    out = tmp_path / "missing" / "deeper" / "demo.png"
    seen = []
    monkeypatch.setattr(ldmopt.demo, "run_demo", lambda args: seen.append(out.parent.is_dir()) or 0)
    assert main(["demo", "--save", str(out)]) == 0
    assert seen == [True]  # the folder existed before the (long) stock and patched runs started


def test_demo_save_needs_an_image_file_name(tmp_path, capsys, monkeypatch):
    import ldmopt.demo
    from ldmopt.cli import main

    monkeypatch.setattr(ldmopt.demo, "run_demo", lambda args: pytest.fail("the demo ran before the check"))
    for name in ("-", str(tmp_path / "out.jpgx"), str(tmp_path / "out")):
        assert main(["demo", "--save", name]) == 2
        err = capsys.readouterr().err
        assert "must end in one of .png" in err and "Traceback" not in err
    (tmp_path / "shots.png").mkdir()  # an image name that is a folder: PIL's error after the whole run, before
    assert main(["demo", "--save", str(tmp_path / "shots.png")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_demo_save_with_a_denoiser_alone_is_refused_first(tmp_path, capsys, monkeypatch):
    """--save writes the sd pipeline's images; with another --model nothing would be saved, after the whole run."""
    import ldmopt.demo
    from ldmopt.cli import main

    monkeypatch.setattr(ldmopt.demo, "run_demo", lambda args: pytest.fail("the demo ran before the check"))
    out = tmp_path / "new" / "x.png"
    assert main(["demo", "--model", "dit", "--save", str(out)]) == 2
    assert "only the sd pipeline produces images; --model dit" in capsys.readouterr().err
    assert not out.parent.exists()


def test_demo_takes_the_short_dtype_names_of_the_other_commands():
    import ldmopt.demo
    from ldmopt.cli import build_parser

    for short, full in (("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")):
        args = build_parser().parse_args(["demo", "--device", "cpu", "--dtype", short])
        assert ldmopt.demo._resolve(args)[2] == full


def test_demo_takes_the_zoo_name_sd15_for_its_pipeline(capsys):
    from ldmopt.cli import build_parser
    from ldmopt.demo import run_demo

    args = build_parser().parse_args(["demo", "--model", "sd15", "--steps", "0"])  # refused before any work
    assert run_demo(args) == 2 and args.model == "sd"
    capsys.readouterr()


def test_unusable_device_is_a_clear_error_not_a_traceback(capsys, monkeypatch):
    import torch

    from ldmopt.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["demo", "--device", "cuda"], ["profile", "sd15", "--tiny", "--device", "cuda:0"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "no CUDA GPU is available" in err and "Traceback" not in err
    assert main(["demo", "--device", "gpu"]) == 2
    assert "is not a torch device" in capsys.readouterr().err
    # meta runs no kernel: a demo crashed on .item(), tune and profile "measured" Python's time.
    for argv in (["demo", "--device", "meta"], ["tune", "sd15", "--tiny", "--device", "meta"]):
        assert main(argv) == 2
        assert "on cpu or cuda only (figures on meta: ldmopt analyze)" in capsys.readouterr().err


def test_tune_output_files_are_checked_before_the_tuning(tmp_path, capsys, monkeypatch):
    import ldmopt.profiler.measure
    from ldmopt.cli import main

    monkeypatch.setattr(
        ldmopt.profiler.measure, "_resolve_target", lambda *a, **k: pytest.fail("built before the check")
    )
    for option in ("--json", "--save-choice"):
        assert main(["tune", "sd15", "--tiny", option, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{option} {tmp_path} is a folder; give a file name such as" in err and "Traceback" not in err


def test_a_reader_leaving_early_is_no_traceback():
    # `ldmopt info --kernels | head`: the writer gets EPIPE; it exits 141 quietly, also at the flush at exit.
    code = (
        "import sys\n"
        "from ldmopt.cli import exit_quietly_on_broken_pipe\n"
        "def run():\n"
        "    for _ in range(10000):\n"
        "        print('x' * 100)\n"
        "    return 0\n"
        "sys.exit(exit_quietly_on_broken_pipe(run))\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer.stdout.read(10)
    writer.stdout.close()  # the reader leaves
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
