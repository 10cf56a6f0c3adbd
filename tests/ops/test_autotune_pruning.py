"""Autotune pruning (runs on GPUs only, so checked here with stand-in tensors): fp32 operands get the fp32 tiles that
compile clean for their tl.dot precision and arch, 16-bit operands the others, and the ahead-of-time gate compiles
every (precision, arch) an fp32 tile is claimed clean for."""

import inspect
import json
from types import SimpleNamespace

import pytest
import torch
import triton
from ldmopt.kernels import _common, _gemm, geglu, gn_conv2d, linear

from ldmopt.ops import gn_conv2d_prologue as prologue


def _operand(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return SimpleNamespace(device=torch.device("cuda", 0), element_size=lambda: size)


@pytest.fixture
def compiled_configs(monkeypatch):
    """The configs a GPU process builds (the interpreter's single tile otherwise)."""
    monkeypatch.setattr(_gemm, "_interpreting", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def on(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return on


def _tiles(configs, prefix="BLOCK_"):
    return {(c.kwargs[prefix + "M"], c.kwargs[prefix + "N"], c.kwargs[prefix + "K"], c.num_warps, c.num_stages)
            for c in configs}  # fmt: skip


def _spec_tile(spec: dict) -> tuple:
    """(BM, BN, BK, warps, stages) an ahead-of-time spec of the conv compiles."""
    return (*(spec["constexprs"][k] for k in ("BM", "BN", "BK")), spec["num_warps"], spec["num_stages"])


def _linear_prune(capability, x_dtype, w_dtype, precision, on):
    on(capability)
    configs = _gemm.gemm_configs(linear.LINEAR_TILES, linear.LINEAR_TILES_FP32)
    args = {"x_ptr": _operand(x_dtype), "w_ptr": _operand(w_dtype)}
    return _tiles(linear._prune_linear(configs, args, INPUT_PRECISION=precision))


def test_linear_picks_tiles_by_operand_width(compiled_configs):
    sixteen = {tuple(t) for t in linear.LINEAR_TILES}
    fp32 = {tuple(t[:5]) for t in linear.LINEAR_TILES_FP32}
    assert _linear_prune((9, 0), torch.float16, torch.float16, "tf32", compiled_configs) == sixteen
    for capability in ((8, 0), (8, 6), (9, 0), (10, 0)):
        for precision in ("ieee", "tf32"):
            assert _linear_prune(capability, torch.float32, torch.float32, precision, compiled_configs) == fp32
    # an fp32 stream rounded to an fp16 weight in the loads takes 16-bit tiles, without 128x128x64 below sm_90
    wide = _linear_prune((8, 0), torch.float32, torch.float16, "ieee", compiled_configs)
    assert wide == {t for t in sixteen if t[0] * t[1] * t[2] < 128 * 128 * 64}


def test_geglu_fp32_ieee_on_sm80_keeps_the_one_clean_tile(compiled_configs):
    configs = _gemm.gemm_configs(geglu.GEGLU_TILES, geglu.GEGLU_TILES_FP32)
    args = {"x_ptr": _operand(torch.float32), "w_ptr": _operand(torch.float32)}
    compiled_configs((8, 0))
    assert _tiles(geglu._prune(configs, args, INPUT_PRECISION="ieee")) == {(64, 64, 32, 8, 3)}
    assert len(geglu._prune(configs, args, INPUT_PRECISION="tf32")) == 3
    compiled_configs((9, 0))
    assert len(geglu._prune(configs, args, INPUT_PRECISION="ieee")) == 3
    # 16-bit operands on sm_80: the 16-bit tiles not reserved for sm_90
    args = {"x_ptr": _operand(torch.bfloat16), "w_ptr": _operand(torch.bfloat16)}
    compiled_configs((8, 0))
    kept = _tiles(geglu._prune(configs, args, INPUT_PRECISION="tf32"))
    assert kept == {tuple(t[:5]) for t in geglu.GEGLU_TILES if t[5] <= 80}


def test_gn_conv2d_fp32_tiles_per_precision_and_arch(compiled_configs):
    configs = gn_conv2d._configs()
    compiled_configs((9, 0))
    ieee = _tiles(gn_conv2d._prune_configs(configs, {"x_ptr": _operand(torch.float32)}, DOT_PRECISION="ieee"), "B")
    assert ieee == {(64, 128, 32, 8, 3)}
    half = gn_conv2d._prune_configs(configs, {"x_ptr": _operand(torch.float16)}, DOT_PRECISION="tf32")
    assert len(half) == 4 and all(_common.config_tag(c, "fp32_clean") is None for c in half)
    compiled_configs((8, 0))
    tf32 = _tiles(gn_conv2d._prune_configs(configs, {"x_ptr": _operand(torch.float32)}, DOT_PRECISION="tf32"), "B")
    assert tf32 == {(128, 64, 32, 8, 3), (64, 64, 32, 8, 3)}


def test_gn_conv2d_16bit_tiles_follow_the_prologue_and_the_gate_compiles_each(compiled_configs):
    configs = gn_conv2d._configs()
    compiled_configs((9, 0))
    half = {"x_ptr": _operand(torch.float16)}
    loader = _tiles(gn_conv2d._prune_configs(configs, half, DOT_PRECISION="tf32", NORMALIZE=True), "B")
    plain = _tiles(gn_conv2d._prune_configs(configs, half, DOT_PRECISION="tf32", NORMALIZE=False), "B")
    assert loader == set(gn_conv2d.CONV_TILES_LOADER) and plain == set(gn_conv2d.CONV_TILES_PLAIN)
    down = gn_conv2d.RESAMPLE["down"]
    loader_down = gn_conv2d._prune_configs(configs, half, DOT_PRECISION="tf32", NORMALIZE=True, RESAMPLE=down)
    assert _tiles(loader_down, "B") == set(gn_conv2d.CONV_TILES_LOADER_DOWN)  # a 2x2 average of normalised taps
    up = _tiles(gn_conv2d._prune_configs(configs, half, NORMALIZE=True, RESAMPLE=gn_conv2d.RESAMPLE["up"]), "B")
    assert up == loader
    plain_down = gn_conv2d._prune_configs(configs, half, DOT_PRECISION="tf32", NORMALIZE=False, RESAMPLE=down)
    assert _tiles(plain_down, "B") == plain
    assert all(tile[2] == 64 for tile in plain)  # A from shared memory: the wider k-step
    fp32 = gn_conv2d._prune_configs(configs, {"x_ptr": _operand(torch.float32)}, DOT_PRECISION="tf32", NORMALIZE=False)
    assert fp32 and all(_common.config_tag(c, "fp32_clean") for c in fp32)  # fp32 tiles serve both
    specs = gn_conv2d.aot_specs()
    compiled = {(*_spec_tile(s), s["constexprs"]["NORMALIZE"]) for s in specs}
    assert {(*t, True) for t in gn_conv2d.CONV_TILES_LOADER} <= compiled
    downsampling = {
        _spec_tile(s) for s in specs if s["constexprs"]["NORMALIZE"] and s["constexprs"]["RESAMPLE"] == down
    }
    assert downsampling == set(gn_conv2d.CONV_TILES_LOADER_DOWN)
    assert {(*t, False) for t in gn_conv2d.CONV_TILES_PLAIN} <= compiled
    # the placement policy (which cannot import Triton) counts recomputation with the loader's widest tile
    assert max(t[1] for t in gn_conv2d.CONV_TILES_LOADER + gn_conv2d.CONV_TILES_LOADER_DOWN) == prologue.WIDEST_BN


def test_cpu_tensors_keep_every_config():
    configs = _gemm.gemm_configs(linear.LINEAR_TILES, linear.LINEAR_TILES_FP32)
    cpu = torch.empty(1)
    assert _common.prune_by_operand_width(configs, cpu, "ieee") == configs


@pytest.mark.parametrize(
    "module,tiles",
    [(linear, "LINEAR_TILES_FP32"), (geglu, "GEGLU_TILES_FP32"), (gn_conv2d, "CONV_TILES_FP32")],
    ids=["linear", "geglu", "gn_conv2d"],
)
def test_the_gate_compiles_every_claimed_fp32_pair(module, tiles):
    specs = module.aot_specs()
    for *tile, clean in getattr(module, tiles):
        bm, bn, bk, warps, stages = tile
        for precision, arch in clean:
            covering = [
                s for s in specs
                if f"fp32 {precision}," in s["name"] and arch in s.get("archs", (80, 90))
                and (s["constexprs"].get("BLOCK_M", s["constexprs"].get("BM")),
                     s["constexprs"].get("BLOCK_N", s["constexprs"].get("BN")),
                     s["constexprs"].get("BLOCK_K", s["constexprs"].get("BK")), s["num_warps"], s["num_stages"])
                == (bm, bn, bk, warps, stages)
            ]  # fmt: skip
            assert covering, (tiles, tile, precision, arch)


def _tuned_configs(monkeypatch) -> dict[str, list]:
    """Every autotuned kernel's configs as a GPU process builds them."""
    monkeypatch.setattr(_gemm, "_interpreting", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return {
        "gn_conv2d": gn_conv2d._configs(),
        "linear": _gemm.gemm_configs(linear.LINEAR_TILES, linear.LINEAR_TILES_FP32),
        "geglu": _gemm.gemm_configs(geglu.GEGLU_TILES, geglu.GEGLU_TILES_FP32),
    }


def test_configs_survive_tritons_autotune_disk_cache(monkeypatch):
    """Triton's autotune disk cache (ldmopt's default; TRITON_CACHE_AUTOTUNING=1 for any kernel) writes each config's
    __dict__ as JSON and rebuilds it with Config(**fields): the tiles' pruning tags must not live on the configs
    (a frozenset there failed the write, on the first tuning of every kernel on a GPU)."""
    for name, configs in _tuned_configs(monkeypatch).items():
        written = json.dumps({"configs_timings": [(c.__dict__, [1.0, 1.0, 1.0]) for c in configs]})
        rebuilt = [triton.Config(**fields) for fields, _ in json.loads(written)["configs_timings"]]
        assert [c.all_kwargs() for c in rebuilt] == [c.all_kwargs() for c in configs], name
    # The tags are still there for pruning: fp32 tiles, lowest archs and the conv's prologue families.
    configs = _tuned_configs(monkeypatch)
    assert any(_common.config_tag(c, "fp32_clean") for c in configs["linear"])
    assert {_common.config_tag(c, "prologues") for c in configs["gn_conv2d"]} >= {frozenset({"loader"})}


def test_autotuned_kernels_cache_their_timings_on_disk(monkeypatch):
    made = []
    monkeypatch.setattr(triton, "autotune", lambda **kwargs: made.append(kwargs))
    _common.autotune(configs=[], key=[])
    monkeypatch.setenv("LDMOPT_AUTOTUNE_CACHE", "0")
    _common.autotune(configs=[], key=[])
    assert made[0].get("cache_results") is True and "cache_results" not in made[1]
    for module in (gn_conv2d, linear, geglu):  # each kernel module tunes through _common.autotune
        assert "autotune(" in inspect.getsource(module) and "triton.autotune(" not in inspect.getsource(module)


def test_info_shows_the_autotune_cache(monkeypatch, tmp_path):
    from ldmopt import info

    monkeypatch.delenv("LDMOPT_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    text = info.format_info(info.collect(query_gpu=False))
    assert f"autotune timings cached: on, in Triton's cache directory {tmp_path}" in text
    monkeypatch.setenv("LDMOPT_AUTOTUNE_CACHE", "0")
    assert info.collect(query_gpu=False)["autotune_cache"].startswith("off (LDMOPT_AUTOTUNE_CACHE=0")
