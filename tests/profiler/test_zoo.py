"""The model zoo: every config builds on meta with the documented parameter count; tiny variants run on CPU."""

import pytest
import torch

from ldmopt import configs

# Parameter counts from ldmopt/configs/SOURCES.md (diffusers 0.42).
PARAMS = {
    "sd15": 859_520_964,
    "sdxl": 2_567_463_684,
    "dit": 749_826_464,
    "pixart-alpha": 611_349_152,
    "svd": 1_524_623_082,
    "latte": 1_057_246_880,
    "wan2.1-1.3b": 1_418_996_800,
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_real_configs_build_on_meta_with_documented_size(name):
    model = configs.build_model(name)
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert sum(p.numel() for p in params) == PARAMS[name]
    assert model.ldmopt_zoo_name == name


def test_registry_lists_every_model_and_resolves_aliases():
    assert configs.names() == [
        "sd15", "sd21", "sdxl", "sd15-vae", "sdxl-vae", "dit", "pixart-alpha", "pixart-sigma", "sd3", "flux",
        "animatediff", "svd", "svd-xt", "modelscope", "latte", "wan2.1-1.3b",
    ]  # fmt: skip
    assert configs.get("Wan").name == "wan2.1-1.3b"
    assert configs.get("SD1.5").name == "sd15"
    assert configs.get("animatediff").cls == "UNetMotionModel"
    unet, adapter = configs.load_config("animatediff")
    assert adapter["_class_name"] == "MotionAdapter" and unet["_class_name"] == "UNet2DConditionModel"
    with pytest.raises(KeyError, match="the zoo has: sd15"):
        configs.get("sd4")


@pytest.mark.parametrize("name", ["sd15", "sdxl-vae", "pixart-alpha", "flux", "animatediff", "latte"])
def test_tiny_variants_run_on_cpu(name):
    model = configs.build_model(name, tiny=True, device="cpu", dtype=torch.float32, frames=2)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    inputs = configs.example_inputs(model, resolution=64, frames=2, batch=1)
    with torch.no_grad():
        out = configs.run_model(model, inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out.sample
    assert torch.isfinite(out).all()


def test_frames_beyond_the_positional_table_extend_it():
    model = configs.build_model("animatediff", frames=64)
    pe = next(m for n, m in model.named_modules() if n.endswith("pos_embed"))
    assert pe.pe.shape[1] == 64
    latte = configs.build_model("latte", frames=24)
    assert latte.temp_pos_embed.shape[1] == 24
    assert configs.example_inputs(latte).frames == 24
    with pytest.raises(ValueError, match=r"build_model\('latte', frames=16\)"):
        configs.example_inputs(latte, frames=16)


def test_example_inputs_follow_the_study_settings():
    svd = configs.example_inputs("svd")
    assert svd.kwargs["sample"].shape == (2, 14, 8, 72, 128)
    flux = configs.example_inputs("flux")
    assert flux.kwargs["hidden_states"].shape == (1, 4096, 64) and flux.batch == 1
    vae = configs.example_inputs("sd15-vae", resolution=256)
    assert vae.method == "decode" and vae.kwargs["z"].shape == (1, 4, 32, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        configs.example_inputs("sd15", resolution=500)
    with pytest.raises(ValueError, match="resolution 256x512: DiT takes square images only"):
        configs.example_inputs("dit", resolution=(256, 512))
    assert configs.example_inputs("pixart", resolution=(256, 512)).kwargs["hidden_states"].shape[-2:] == (32, 64)


def test_wan_keeps_what_from_pretrained_keeps_in_fp32_and_compresses_time():
    model = configs.build_model("wan", dtype=torch.bfloat16)
    block = model.blocks[0]
    keeps_rope = "rope" in type(model)._keep_in_fp32_modules  # diffusers 0.36 and newer
    fp32 = [
        *([model.rope.freqs_cos] if keeps_rope else []),
        block.scale_shift_table,
        block.norm2.weight,
        model.condition_embedder.time_embedder.linear_1.weight,
    ]
    assert all(t.dtype == torch.float32 for t in fp32)
    assert block.attn1.to_q.weight.dtype == block.attn1.norm_q.weight.dtype == torch.bfloat16
    half, exact = (
        configs.build_model("wan", tiny=True, device="cpu", dtype=d) for d in (torch.bfloat16, torch.float32)
    )
    if keeps_rope:
        assert torch.equal(half.rope.freqs_cos, exact.rope.freqs_cos)  # kept tables are not rounded through bf16
    inputs = configs.example_inputs(model)
    assert inputs.kwargs["hidden_states"].shape == (1, 16, 21, 60, 104) and inputs.frames == 81
    assert inputs.kwargs["encoder_hidden_states"].shape == (1, 512, 4096)
    with pytest.raises(ValueError, match="takes 1 \\+ 4k frames"):
        configs.example_inputs(model, frames=16)
    tiny = configs.build_model("wan", tiny=True, device="cpu", dtype=torch.float32)
    assert sum(p.numel() for p in tiny.parameters()) < 3_000_000
    with torch.no_grad():
        out = configs.run_model(tiny, configs.example_inputs(tiny))[0]
    assert out.shape == (1, 16, 2, 8, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_example_inputs_follow_the_model_dtype_past_fp32_kept_modules(dtype):
    """Wan keeps scale_shift_table in fp32 and it is its first parameter: the inputs once came out fp32 and even the
    stock model failed on them."""
    model = configs.build_model("wan2.1-1.3b", tiny=True, device="cpu", dtype=dtype)
    inputs = configs.example_inputs(model)
    assert inputs.kwargs["hidden_states"].dtype == dtype
    with torch.no_grad():
        configs.run_model(model, inputs)
