"""The patched projection models the placement a GPU runs by default ("auto": cudnn conv, cublas GEMMs) or ldmopt's
Triton kernels ("triton"), and says which (ldmopt/profiler/placements.py)."""

import json

import pytest

from ldmopt.profiler import analyze
from ldmopt.profiler.fusions import CONV_EPILOGUE, GEGLU, GELU_EPILOGUE, GN_CONV, plan_fusions, single_key_paths
from ldmopt.profiler.placements import Placements

ENVS = ("LDMOPT_GN_CONV_PROLOGUE", "LDMOPT_GEMM_PLACEMENT", "LDMOPT_GEMM_GELU")


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for env in ENVS:
        monkeypatch.delenv(env, raising=False)


@pytest.fixture(scope="module")
def sd15():
    return analyze("sd15", tiny=True, placement="triton")  # the records do not depend on the placement


def _plan(a, mode):
    return plan_fusions(a.records, single_key_paths(a.attention), Placements(mode))


def test_geglu_saves_the_tail_passes_under_cublas_and_the_half_write_under_triton(sd15):
    sites = [r for r in sd15.records if r.base == "gelu" and r.consumers]
    per_mode = {}
    for mode in ("auto", "triton"):
        saved, rule, removed, stats = _plan(sd15, mode)
        geglu = [g for g in sites if rule.get(g.index) == GEGLU]
        assert geglu and stats[GEGLU].count == len(geglu)
        per_mode[mode] = stats[GEGLU].bytes_saved
        for gelu in geglu:
            mul, gemm = sd15.records[gelu.consumers[0]], sd15.records[gelu.producers[0]]
            half = gelu.out_bytes  # M x I elements of the model's dtype
            assert gemm.out_bytes == 2 * half and gelu.bytes == 2 * half and mul.bytes == 3 * half
            if mode == "auto":
                # cuBLAS writes the 2I-wide projection; one pass reads it and writes I: only gelu's pass goes.
                assert saved[gelu.index] == 2 * half and saved[mul.index] == 0 and gemm.index not in saved
                assert gelu.index in removed and mul.index not in removed
            else:
                # One GEMM with two accumulators writes I columns: the gelu and mul passes and half the write go.
                assert saved[gelu.index] + saved[mul.index] + saved[gemm.index] == (2 + 3 + 1) * half
    half_total = sum(g.out_bytes for g in sites if _plan(sd15, "triton")[1].get(g.index) == GEGLU)
    assert per_mode == {"auto": 2 * half_total, "triton": 6 * half_total}


def test_resnet_conv_stages_the_norm_and_reads_its_output_back_under_cudnn(sd15):
    convs = [r for r in sd15.records if r.base == "convolution" and r.path.endswith("resnets.0.conv1")]
    assert convs
    for mode in ("auto", "triton"):
        saved, rule, removed, _stats = _plan(sd15, mode)
        for conv in convs:
            silu = sd15.records[conv.producers[0]]
            gn = sd15.records[silu.producers[0]]
            add = sd15.records[conv.consumers[0]]  # + temb
            assert (gn.base, silu.base, add.base) == ("native_group_norm", "silu", "add")
            assert rule[gn.index] == GN_CONV and rule[add.index] == CONV_EPILOGUE
            x, temb = gn.in_bytes[0], min(add.in_bytes)
            assert saved[silu.index] == silu.bytes == 2 * x and silu.index in removed
            if mode == "auto":
                assert conv.conv[:2] == (3, 3)  # a 3x3 conv normalises each element 9+ times: staged, cuDNN
                # statistics pass (x) + staged pass (x read, act(gn(x)) written): 3x where stock moved gn.bytes
                assert saved[gn.index] == gn.bytes - 3 * x
                # the epilogue pass reads the conv's output back and writes the sum: the add's bytes stay
                assert saved[add.index] == 0 and add.index not in removed
            else:
                assert saved[gn.index] == gn.bytes - x
                assert saved[add.index] == add.bytes - temb and add.index in removed


def test_auto_honours_the_environment_overrides(monkeypatch, sd15):
    default = analyze("sd15", tiny=True)
    triton = analyze("sd15", tiny=True, placement="triton")
    assert default.patched_bytes > triton.patched_bytes  # cudnn and cublas move more than the Triton kernels
    monkeypatch.setenv("LDMOPT_GN_CONV_PROLOGUE", "loader")
    monkeypatch.setenv("LDMOPT_GEMM_PLACEMENT", "triton")
    forced = analyze("sd15", tiny=True)
    assert forced.patched_bytes == triton.patched_bytes
    assert forced.placement["overrides"] == {"LDMOPT_GN_CONV_PROLOGUE": "loader", "LDMOPT_GEMM_PLACEMENT": "triton"}
    assert "LDMOPT_GEMM_PLACEMENT=triton" in forced.placement_line


def test_gelu_tanh_runs_in_cublaslt_unless_the_pass_is_forced(monkeypatch):
    auto = analyze("dit", tiny=True).fusions[GELU_EPILOGUE]
    triton = analyze("dit", tiny=True, placement="triton").fusions[GELU_EPILOGUE]
    assert auto.count == triton.count > 0 and auto.bytes_saved == triton.bytes_saved > 0
    monkeypatch.setenv("LDMOPT_GEMM_GELU", "pass")
    forced = analyze("dit", tiny=True).fusions[GELU_EPILOGUE]
    assert forced.count == auto.count and forced.bytes_saved == 0 and forced.ops_removed == 0


def test_the_table_and_json_name_the_placement(capsys):
    from ldmopt.profiler.cli import configure_analyze, run_analyze

    a = analyze("sd15", tiny=True)
    assert "placement 'auto'" in a.table() and "conv 'cudnn'" in a.table() and "GEMM 'cublas'" in a.table()
    data = a.to_dict()["placement"]
    assert data["mode"] == "auto" and data["device"] == "cuda" and data["sites"]["GEMM"] == {"cublas": 70}
    assert "GPU defaults" in data["description"]
    with pytest.raises(ValueError, match="placement"):
        analyze("sd15", tiny=True, placement="cudnn")

    import argparse

    parser = argparse.ArgumentParser()
    configure_analyze(parser)
    assert run_analyze(parser.parse_args(["sd15", "--tiny", "--placement", "triton", "--json", "-"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"]["mode"] == "triton" and set(out["placement"]["sites"]["conv"]) == {"loader"}


def test_a_patched_recording_models_the_triton_placement_and_refuses_another(capsys):
    from ldmopt.profiler.cli import configure_analyze, run_analyze

    recorded = analyze("sd15", tiny=True, patched=True)  # each fused op recorded as one kernel
    assert recorded.placement["mode"] == "triton" and "Triton placement" in " ".join(recorded.notes)
    assert analyze("sd15", tiny=True, patched=True, placement="triton").time_s == recorded.time_s
    with pytest.raises(ValueError, match=r"placement='auto' with patched=True"):
        analyze("sd15", tiny=True, patched=True, placement="auto")
    import argparse

    parser = argparse.ArgumentParser()
    configure_analyze(parser)
    assert run_analyze(parser.parse_args(["sd15", "--tiny", "--patched", "--json", "-"])) == 0
    assert json.loads(capsys.readouterr().out)["placement"]["mode"] == "triton"


def test_svd_blended_proj_out_keeps_the_residual_in_the_triton_gemm_epilogue():
    # ops.linear with a mix runs the Triton GEMM under either placement (gemm_placement(blend=True)): no cublas pass
    from ldmopt.profiler.fusions import BLEND_GEMM, RESIDUAL

    svd = analyze("svd", tiny=True, placement="triton")
    R = svd.records
    placements = Placements("auto")
    saved, rule, removed, _stats = plan_fusions(R, single_key_paths(svd.attention), placements)
    blended = [g for g in R if g.path.endswith(".proj_out") and any(rule.get(p) == BLEND_GEMM for p in g.producers)]
    assert blended
    for gemm in blended:
        container = gemm.path.rpartition(".")[0]
        add = next(R[i] for i, r in rule.items() if r == RESIDUAL and R[i].base == "add" and R[i].path == container)
        assert saved[add.index] == add.bytes - add.out_bytes and add.index in removed  # the GEMM's write, its read
    assert placements.used[("GEMM", "triton")] == len(blended)


@pytest.mark.parametrize("model", ["dit", "sd3"])
def test_a_patch_embedding_conv_and_its_positional_add_are_not_claimed(model):
    """ldmopt does not patch PatchEmbed: its conv + positional add is no conv epilogue under either placement."""
    a = analyze(model, tiny=True, placement="triton")
    for mode in ("auto", "triton"):
        _, rule, _, stats = _plan(a, mode)
        assert CONV_EPILOGUE not in stats or stats[CONV_EPILOGUE].count == 0
        convs = [r for r in a.records if r.base == "convolution"]
        assert convs and all(rule.get(c.consumers[0]) is None for c in convs if c.consumers)
