"""Model zoo: the diffusers configs of real diffusion models, shipped as data (no downloads).

Every entry names the diffusers class, its config file(s), the default resolution/frames/batch of the study setting
and how the model is built. Other parts of ldmopt (the cost model, the patcher's tests, the training script) use:

- ``build_model(name, device="meta", dtype=torch.float16)``: the real-size model with random (or no) weights. On the
  ``meta`` device nothing is allocated, so even Flux-dev (11.9B parameters) builds in about a second.
- ``build_model(name, tiny=True, device="cpu")``: a tiny random-weight model of the same family (same block types,
  attention layout and forward signature; a few channels), small enough for CPU tests. ``tiny_config(name)`` returns
  its config.
- ``example_inputs(name_or_model, resolution=..., frames=..., batch=...)``: keyword arguments for one denoiser call
  (or VAE decode) at that setting; ``run_model(model, inputs)`` makes the call.

Resolutions are in pixels; all of these models work on a latent 8x smaller. Frames are video frames; Wan's VAE also
compresses time 4x (81 frames are 21 latent frames), the other video models denoise every frame. ``batch`` counts the
classifier-free-guidance copies (2 for the CFG models, 1 for Flux-dev, which is guidance-distilled, and the VAEs).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from torch import nn

__all__ = [
    "ZOO",
    "ModelInputs",
    "ZooEntry",
    "build_model",
    "example_inputs",
    "get",
    "load_config",
    "names",
    "run_model",
    "tiny_config",
]

VAE_SCALE = 8


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo: what it is, where its config lives, the setting it is usually run at."""

    name: str
    cls: str  # diffusers class
    files: tuple[str, ...]  # config files in this package (AnimateDiff: UNet, then motion adapter)
    resolution: tuple[int, int]  # (height, width) in pixels
    frames: int | None  # None for image models
    batch: int  # default batch (2 = classifier-free guidance)
    text_tokens: int  # length of the text-encoder sequence (0 if none)
    description: str
    build: str  # how it is built, in words
    aliases: tuple[str, ...] = field(default=())

    @property
    def is_video(self) -> bool:
        return self.frames is not None


def _entry(name, cls, files, res, frames, batch, tokens, description, build, aliases=()):
    res = (res, res) if isinstance(res, int) else tuple(res)
    return ZooEntry(name, cls, tuple(files), res, frames, batch, tokens, description, build, tuple(aliases))


_BY_CONFIG = "{cls}.from_config({file})"
ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        _entry("sd15", "UNet2DConditionModel", ["sd15_unet.json"], 512, None, 2, 77,
               "Stable Diffusion 1.5 UNet", _BY_CONFIG, ("sd1.5", "sd-1.5")),
        _entry("sd21", "UNet2DConditionModel", ["sd21_unet.json"], 768, None, 2, 77,
               "Stable Diffusion 2.1 (768-v) UNet", _BY_CONFIG, ("sd2.1",)),
        _entry("sdxl", "UNet2DConditionModel", ["sdxl_unet.json"], 1024, None, 2, 77,
               "Stable Diffusion XL base 1.0 UNet", _BY_CONFIG),
        _entry("sd15-vae", "AutoencoderKL", ["sd15_vae.json"], 512, None, 1, 0,
               "Stable Diffusion 1.5 VAE (decode)", _BY_CONFIG + "; analysed and profiled as .decode(latents)"),
        _entry("sdxl-vae", "AutoencoderKL", ["sdxl_vae.json"], 1024, None, 1, 0,
               "Stable Diffusion XL VAE (decode)", _BY_CONFIG + "; analysed and profiled as .decode(latents)"),
        _entry("dit", "DiTTransformer2DModel", ["dit_xl2_256.json"], 256, None, 2, 0,
               "DiT-XL/2 256 (class-conditional)", _BY_CONFIG + " (legacy Transformer2DModel config)",
               ("dit-xl2",)),
        _entry("pixart-alpha", "PixArtTransformer2DModel", ["pixart_alpha_1024.json"], 1024, None, 2, 120,
               "PixArt-alpha XL-2 1024", _BY_CONFIG + " (legacy Transformer2DModel config)", ("pixart",)),
        _entry("pixart-sigma", "PixArtTransformer2DModel", ["pixart_sigma_1024.json"], 1024, None, 2, 300,
               "PixArt-Sigma XL-2 1024", _BY_CONFIG + " (legacy Transformer2DModel config)"),
        _entry("sd3", "SD3Transformer2DModel", ["sd3_medium.json"], 1024, None, 2, 333,
               "Stable Diffusion 3 medium (MMDiT; 77 CLIP + 256 T5 tokens)", _BY_CONFIG, ("sd3-medium",)),
        _entry("flux", "FluxTransformer2DModel", ["flux_dev.json"], 1024, None, 1, 512,
               "FLUX.1-dev (guidance-distilled, no CFG batch)", _BY_CONFIG, ("flux-dev",)),
        _entry("animatediff", "UNetMotionModel", ["sd15_unet.json", "animatediff_motion_adapter_v152.json"],
               512, 16, 2, 77, "AnimateDiff v1.5.2 on the SD1.5 UNet",
               "UNetMotionModel.from_unet2d(UNet2DConditionModel.from_config(sd15_unet.json), "
               "MotionAdapter.from_config(animatediff_motion_adapter_v152.json)); motion_max_seq_length is raised "
               "to the frame count when more frames are asked for"),
        _entry("svd", "UNetSpatioTemporalConditionModel", ["svd_unet.json"], (576, 1024), 14, 2, 1,
               "Stable Video Diffusion img2vid (14 frames)", _BY_CONFIG),
        _entry("svd-xt", "UNetSpatioTemporalConditionModel", ["svd_xt_unet.json"], (576, 1024), 25, 2, 1,
               "Stable Video Diffusion img2vid-xt (25 frames)", _BY_CONFIG),
        _entry("modelscope", "UNet3DConditionModel", ["modelscope_t2v_unet.json"], 256, 16, 2, 77,
               "ModelScope text-to-video 1.7B", _BY_CONFIG, ("modelscope-t2v",)),
        _entry("latte", "LatteTransformer3DModel", ["latte1.json"], 512, 16, 2, 120,
               "Latte-1 text-to-video", _BY_CONFIG),
        _entry("wan2.1-1.3b", "WanTransformer3DModel", ["wan21_t2v_1.3b.json"], (480, 832), 81, 1, 512,
               "Wan 2.1 text-to-video 1.3B (81 frames = 21 latent frames; one call per guidance branch)",
               _BY_CONFIG + "; what from_pretrained keeps in fp32 (_keep_in_fp32_modules: rotary tables, time "
               "embedder, modulation tables, block norms) stays fp32", ("wan", "wan2.1", "wan2.1-t2v-1.3b")),
    ]
}  # fmt: skip

# Tiny variants: the real config with these keys replaced (block types, attention layout and norm types kept).
_TINY_UNET = {"sample_size": 16, "layers_per_block": 1, "norm_num_groups": 4, "cross_attention_dim": 16}
_TINY: dict[str, dict[str, Any]] = {
    "sd15": {**_TINY_UNET, "block_out_channels": [16, 32, 32, 32], "attention_head_dim": 2},
    "sd21": {**_TINY_UNET, "block_out_channels": [16, 32, 32, 32], "attention_head_dim": [2, 2, 2, 2]},
    "sdxl": {
        **_TINY_UNET,
        "block_out_channels": [16, 32, 64],
        "attention_head_dim": [2, 2, 4],
        "transformer_layers_per_block": [1, 1, 2],
        "cross_attention_dim": 32,
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + 16,  # 6 time ids + pooled text embeds (16)
    },
    "sd15-vae": {"sample_size": 32, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1},
    "sdxl-vae": {"sample_size": 32, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1},
    "dit": {"sample_size": 8, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "norm_num_groups": 4},
    "pixart-alpha": {
        "sample_size": 8,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 12,  # the resolution/aspect-ratio embedders split the width in 3
        "cross_attention_dim": 24,
        "caption_channels": 32,
        "use_additional_conditions": True,
    },
    "pixart-sigma": {
        "sample_size": 8,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 16,
        "caption_channels": 32,
        "use_additional_conditions": False,
    },
    "sd3": {
        "sample_size": 8,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "caption_projection_dim": 16,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 16,
        "pos_embed_max_size": 16,
    },
    "flux": {
        "in_channels": 16,
        "num_layers": 1,
        "num_single_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": [4, 6, 6],
        "joint_attention_dim": 32,
        "pooled_projection_dim": 16,
    },
    "animatediff": {**_TINY_UNET, "block_out_channels": [16, 32, 32, 32], "attention_head_dim": 2},
    "svd": {
        "sample_size": 16,
        "layers_per_block": 1,
        "block_out_channels": [32, 32, 64, 64],
        "num_attention_heads": [2, 2, 2, 2],
        "cross_attention_dim": 16,
        "addition_time_embed_dim": 4,
        "projection_class_embeddings_input_dim": 12,
    },
    "modelscope": {**_TINY_UNET, "block_out_channels": [16, 32, 32, 32], "attention_head_dim": 8},
    "latte": {
        "sample_size": 8,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "cross_attention_dim": 16,
        "caption_channels": 32,
        "video_length": 4,
    },
    "wan2.1-1.3b": {
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 24,  # the rotary embedding splits a head 8 / 8 / 8 over frames, height, width
        "ffn_dim": 56,
        "freq_dim": 16,
        "text_dim": 32,
        "rope_max_seq_len": 64,
    },
}
_TINY["svd-xt"] = _TINY["svd"]
#: Temporal compression of the VAE in front of the denoiser (frames = 1 + factor * (latent frames - 1)); the other
#: video models of the zoo denoise every frame.
_TEMPORAL_FACTOR = {"wan2.1-1.3b": 4}
#: Model classes that take square images only: diffusers' DiT unpatchifies to a square of sqrt(tokens) per side, so
#: any other shape fails inside the forward in a reshape.
SQUARE_ONLY = frozenset({"DiTTransformer2DModel"})
_TINY_FRAMES = {"wan2.1-1.3b": 5}  # two latent frames
_TINY_ADAPTER = {
    "block_out_channels": [16, 32, 32, 32],
    "motion_layers_per_block": 1,
    "motion_num_attention_heads": 2,
    "motion_norm_num_groups": 4,
}
_TINY_TEXT_TOKENS = 7


def names() -> list[str]:
    """Short names of the zoo, in the order of the table."""
    return list(ZOO)


def get(name: str) -> ZooEntry:
    """The zoo entry for a short name or alias (case-insensitive)."""
    key = name.lower()
    if key in ZOO:
        return ZOO[key]
    for entry in ZOO.values():
        if key in entry.aliases:
            return entry
    raise KeyError(f"unknown model {name!r}; the zoo has: {', '.join(ZOO)}")


def _read(file: str) -> dict[str, Any]:
    return json.loads(resources.files(__name__).joinpath(file).read_text())


def load_config(name: str) -> dict[str, Any] | list[dict[str, Any]]:
    """The diffusers config(s) of a zoo model: one dict, or [unet, motion adapter] for AnimateDiff."""
    entry = get(name)
    configs = [_read(f) for f in entry.files]
    return configs if len(configs) > 1 else configs[0]


def tiny_config(name: str) -> dict[str, Any] | list[dict[str, Any]]:
    """Config of a tiny random-weight model of the same family (same block types, few channels)."""
    entry = get(name)
    real = load_config(entry.name)
    if entry.name == "animatediff":
        unet, adapter = real
        return [{**unet, **_TINY["animatediff"]}, {**adapter, **_TINY_ADAPTER}]
    return {**real, **_TINY[entry.name]}


def _diffusers_class(cls_name: str):
    import diffusers

    return getattr(diffusers, cls_name)


def _from_config(cls_name: str, config: dict[str, Any]) -> nn.Module:
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return _diffusers_class(cls_name).from_config(config)


@contextlib.contextmanager
def _quiet_diffusers():
    """Silence diffusers' config warnings (legacy keys in the shipped configs, fp32-module notes on .to())."""
    from diffusers.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        yield
    finally:
        dlogging.set_verbosity(level)


def build_model(
    name: str,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float16,
    *,
    tiny: bool = False,
    frames: int | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """Build a zoo model with random weights (no weights at all on ``device="meta"``).

    ``tiny=True`` builds the tiny variant (``tiny_config``). ``frames`` matters for the models whose temporal
    positional embedding has a fixed length: AnimateDiff (extended when more than ``motion_max_seq_length`` frames are
    asked for) and Latte (``video_length`` set to ``frames``).
    ``config_overrides`` replace keys of the (UNet) config. The model is returned in eval mode with
    ``model.ldmopt_zoo_name`` set, so ``example_inputs(model)`` knows what to feed it.
    """
    entry = get(name)
    config = copy.deepcopy(tiny_config(entry.name) if tiny else load_config(entry.name))
    with torch.device(device), _quiet_diffusers():
        if entry.name == "animatediff":
            unet_cfg, adapter_cfg = config
            unet_cfg.update(config_overrides or {})
            if frames is not None and frames > adapter_cfg["motion_max_seq_length"]:
                adapter_cfg["motion_max_seq_length"] = frames
            unet = _from_config("UNet2DConditionModel", unet_cfg)
            adapter = _from_config("MotionAdapter", adapter_cfg)
            model = _diffusers_class("UNetMotionModel").from_unet2d(unet, adapter, load_weights=str(device) != "meta")
        else:
            if entry.name == "latte" and frames is not None:
                config["video_length"] = frames  # the temporal positional embedding has one row per frame
            config.update(config_overrides or {})
            model = _from_config(entry.cls, config)
    # SVD's mix_factor is made with the legacy torch.Tensor([...]) constructor, which ignores the device context.
    with _quiet_diffusers():
        model = model.to(device=device)
        kept = _kept_in_fp32(model)  # fp32 copies taken before the cast: the cast would round them
        model = model.to(dtype=dtype).eval()
    for store, name, value in kept:
        store[name].data = value
    model.ldmopt_zoo_name = entry.name
    model.ldmopt_tiny = tiny
    return model


def fp32_kept_tensors(model: nn.Module) -> list[tuple[dict, str]]:
    """(parameter or buffer store, name) of every floating tensor under the class's ``_keep_in_fp32_modules``, which
    ``from_pretrained`` keeps in fp32 (matched on dotted name parts; Wan: rotary tables, time embedder, modulation
    tables, block norms)."""
    keys = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    kept = []
    for module_name, module in model.named_modules() if keys else ():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                full = f"{module_name}.{name}" if module_name else name
                if t is not None and t.is_floating_point() and keys & set(full.split(".")):
                    kept.append((store, name))
    return kept


def _kept_in_fp32(model: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """:func:`fp32_kept_tensors` with each one's value in fp32 (a copy)."""
    return [(store, name, store[name].detach().float().clone()) for store, name in fp32_kept_tensors(model)]


@dataclass
class ModelInputs:
    """Arguments of one call: ``getattr(model, method)(**kwargs)``."""

    method: str
    kwargs: dict[str, Any]
    resolution: tuple[int, int]
    frames: int | None
    batch: int

    def to(self, device: str | torch.device) -> ModelInputs:
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            if isinstance(v, dict):
                return {k: move(x) for k, x in v.items()}
            return v

        return ModelInputs(self.method, move(self.kwargs), self.resolution, self.frames, self.batch)


def resolution_pair(value: Any) -> tuple[int, int]:
    """(height, width) from an int or a pair of ints; anything else is refused, naming the argument."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    pair = isinstance(value, (tuple, list)) and len(value) == 2
    if not pair or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"resolution must be an int or a (height, width) pair of ints, got {value!r}")
    return (value[0], value[1])


def _resolution(value: int | tuple[int, int] | None, default: tuple[int, int]) -> tuple[int, int]:
    return default if value is None else resolution_pair(value)


def _model_config(model: nn.Module) -> dict[str, Any]:
    return dict(model.config)


def example_inputs(
    name_or_model: str | nn.Module,
    *,
    resolution: int | tuple[int, int] | None = None,
    frames: int | None = None,
    batch: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    text_tokens: int | None = None,
) -> ModelInputs:
    """Inputs for one denoiser call (VAE: one ``decode``) of a zoo model at the given setting.

    ``name_or_model`` is a zoo name or a model built by ``build_model`` (its dtype/device are then the defaults).
    Tiny models default to a 64-pixel resolution (8x8 latents; 16x16 for the UNets so every level is at least 2x2),
    4 frames and 7 text tokens. Values are random; timesteps are 999 (Flux: 0.999, as FluxPipeline passes t / 1000).
    """
    if isinstance(name_or_model, str):
        entry, model, tiny = get(name_or_model), None, False
        config = load_config(entry.name)
        config = config[0] if isinstance(config, list) else config
    else:
        model = name_or_model
        zoo_name = getattr(model, "ldmopt_zoo_name", None)
        if zoo_name is None:
            raise ValueError(
                f"example_inputs needs a zoo name or a model built by ldmopt.configs.build_model; got "
                f"{type(model).__name__} (pass its inputs explicitly instead)"
            )
        entry, tiny = get(zoo_name), bool(getattr(model, "ldmopt_tiny", False))
        config = _model_config(model)
        param = next(model.parameters())
        # diffusers' model.dtype skips the modules it keeps in fp32 (Wan's scale_shift_table comes first)
        dtype = dtype or getattr(model, "dtype", param.dtype)
        device = device or param.device
    dtype = dtype or torch.float16
    device = device or "meta"
    if tiny:
        unet_like = entry.cls.startswith("UNet")
        default_res = (128, 128) if unet_like else (64, 64)
        if entry.cls == "AutoencoderKL":
            default_res = (64, 64)
        res = _resolution(resolution, default_res)
        frames = frames or _TINY_FRAMES.get(entry.name) or (config.get("video_length", 4) if entry.is_video else None)
        # SVD's context is one CLIP image embedding at any size; the other families get a short text sequence.
        tokens = text_tokens or (entry.text_tokens if entry.text_tokens == 1 else _TINY_TEXT_TOKENS)
    else:
        res = _resolution(resolution, entry.resolution)
        frames = frames or (config.get("video_length") if entry.name == "latte" and model is not None else None)
        frames = frames or entry.frames
        tokens = text_tokens or entry.text_tokens
    batch = batch or entry.batch
    _check_frames(entry, config, frames)
    if res[0] % VAE_SCALE or res[1] % VAE_SCALE:
        raise ValueError(f"resolution {res} must be a multiple of {VAE_SCALE} pixels (the VAE factor)")
    if entry.cls in SQUARE_ONLY and res[0] != res[1]:
        raise ValueError(f"resolution {res[0]}x{res[1]}: DiT takes square images only")
    h, w = res[0] // VAE_SCALE, res[1] // VAE_SCALE
    latent_frames = frames
    if entry.name in _TEMPORAL_FACTOR and frames is not None:
        factor = _TEMPORAL_FACTOR[entry.name]
        if (frames - 1) % factor:
            raise ValueError(
                f"{entry.name} takes 1 + {factor}k frames (its VAE compresses time {factor}x), got {frames}"
            )
        latent_frames = (frames - 1) // factor + 1
    kwargs = _build_kwargs(entry, config, batch, latent_frames, h, w, tokens, dtype, device)
    method = "decode" if entry.cls == "AutoencoderKL" else "forward"
    return ModelInputs(method, kwargs, res, frames, batch)


def _check_frames(entry: ZooEntry, config: dict[str, Any], frames: int | None) -> None:
    """Models with a fixed-length temporal positional table accept only the frame counts they were built for."""
    if entry.name == "latte" and frames != config.get("video_length", 16):
        raise ValueError(
            f"this Latte model was built with video_length={config.get('video_length', 16)} (its temporal positional "
            f"table); for {frames} frames build it with build_model('latte', frames={frames})"
        )
    limit = config.get("motion_max_seq_length")
    if entry.name == "animatediff" and limit is not None and frames > limit:
        raise ValueError(
            f"this AnimateDiff model has motion_max_seq_length={limit}; for {frames} frames build it with "
            f"build_model('animatediff', frames={frames})"
        )


def _build_kwargs(entry, config, b, f, h, w, tokens, dtype, device) -> dict[str, Any]:
    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    def steps(n=b):
        return torch.full((n,), 999, dtype=torch.long, device=device)

    cls = entry.cls
    cross = config.get("cross_attention_dim")
    if cls == "AutoencoderKL":
        return {"z": rand(b, config["latent_channels"], h, w), "return_dict": False}
    if cls == "UNet2DConditionModel":
        kw = {"sample": rand(b, config["in_channels"], h, w), "timestep": steps(),
              "encoder_hidden_states": rand(b, tokens, cross)}  # fmt: skip
        if config.get("addition_embed_type") == "text_time":
            time_dim = config["addition_time_embed_dim"]
            text_dim = config["projection_class_embeddings_input_dim"] - 6 * time_dim
            kw["added_cond_kwargs"] = {"text_embeds": rand(b, text_dim), "time_ids": rand(b, 6)}
        return {**kw, "return_dict": False}
    if cls in ("UNetMotionModel", "UNet3DConditionModel"):
        # AnimateDiff's pipeline repeats the prompt per frame before the UNet; UNet3D repeats it inside.
        n_text = b * f if cls == "UNetMotionModel" else b
        return {"sample": rand(b, config["in_channels"], f, h, w), "timestep": steps(),
                "encoder_hidden_states": rand(n_text, tokens, cross), "return_dict": False}  # fmt: skip
    if cls == "UNetSpatioTemporalConditionModel":
        n_ids = config["projection_class_embeddings_input_dim"] // config["addition_time_embed_dim"]
        return {"sample": rand(b, f, config["in_channels"], h, w), "timestep": steps(),
                "encoder_hidden_states": rand(b, tokens, cross), "added_time_ids": rand(b, n_ids),
                "return_dict": False}  # fmt: skip
    if cls == "DiTTransformer2DModel":
        labels = torch.zeros(b, dtype=torch.long, device=device)
        return {"hidden_states": rand(b, config["in_channels"], h, w), "timestep": steps(), "class_labels": labels,
                "return_dict": False}  # fmt: skip
    if cls == "PixArtTransformer2DModel":
        extra = {"resolution": None, "aspect_ratio": None}
        use_extra = config.get("use_additional_conditions")
        if use_extra is None:  # PixArt's own default
            use_extra = config.get("sample_size") == 128
        if use_extra:
            extra = {"resolution": rand(b, 2), "aspect_ratio": rand(b, 1)}
        return {"hidden_states": rand(b, config["in_channels"], h, w), "timestep": steps(),
                "encoder_hidden_states": rand(b, tokens, config["caption_channels"]),
                "added_cond_kwargs": extra, "return_dict": False}  # fmt: skip
    if cls == "SD3Transformer2DModel":
        return {"hidden_states": rand(b, config["in_channels"], h, w), "timestep": steps(),
                "encoder_hidden_states": rand(b, tokens, config["joint_attention_dim"]),
                "pooled_projections": rand(b, config["pooled_projection_dim"]), "return_dict": False}  # fmt: skip
    if cls == "FluxTransformer2DModel":
        # Latents are packed 2x2: (h/2 * w/2) tokens of 4 * 16 channels.
        n_img = (h // 2) * (w // 2)
        # FluxPipeline passes t / 1000 and the model multiplies by 1000 itself: 999 would be 999,000, inf in fp16.
        kw = {"hidden_states": rand(b, n_img, config["in_channels"]), "timestep": steps().to(dtype) / 1000,
              "encoder_hidden_states": rand(b, tokens, config["joint_attention_dim"]),
              "pooled_projections": rand(b, config["pooled_projection_dim"]),
              "img_ids": torch.zeros(n_img, 3, dtype=dtype, device=device),
              "txt_ids": torch.zeros(tokens, 3, dtype=dtype, device=device), "return_dict": False}  # fmt: skip
        if config.get("guidance_embeds"):
            kw["guidance"] = torch.full((b,), 3.5, dtype=dtype, device=device)
        return kw
    if cls == "WanTransformer3DModel":
        return {"hidden_states": rand(b, config["in_channels"], f, h, w), "timestep": steps(),
                "encoder_hidden_states": rand(b, tokens, config["text_dim"]), "return_dict": False}  # fmt: skip
    if cls == "LatteTransformer3DModel":
        return {"hidden_states": rand(b, config["in_channels"], f, h, w), "timestep": steps(),
                "encoder_hidden_states": rand(b, tokens, config["caption_channels"]), "return_dict": False}  # fmt: skip
    raise ValueError(f"no example inputs for class {cls}")


def run_model(model: nn.Module, inputs: ModelInputs) -> Any:
    """Call ``model`` (or ``model.decode`` for a VAE) with ``inputs``."""
    fn = model if inputs.method == "forward" else getattr(model, inputs.method)
    return fn(**inputs.kwargs)
