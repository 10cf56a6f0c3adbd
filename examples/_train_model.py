"""Models for examples/train_ldm.py: the small built-in configs, every zoo denoiser via ``ldmopt.configs`` (wrapped
by the per-family ``Denoiser`` classes of _train_families.py), an EMA of the weights, and DDPM/DDIM sampling with
classifier-free guidance."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from _train_families import FAMILIES, VIDEO_CLASSES, Denoiser, make_denoiser, to_layout
from torch import nn

# Built-in configs (pixel space unless the zoo says otherwise); sample_size is set from --resolution.
SMALL_MODELS: dict[str, tuple[str, dict]] = {
    # Class-conditional through cross-attention tokens: resnets, GroupNorm, attention, GEGLU (what patch fuses).
    "unet-small": (
        "UNet2DConditionModel",
        dict(
            block_out_channels=(64, 128, 256),
            layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=256,
            attention_head_dim=32,
            norm_num_groups=32,
        ),
    ),
    "unet-tiny": (
        "UNet2DConditionModel",
        dict(
            block_out_channels=(16, 32),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=8,
            norm_num_groups=4,
        ),
    ),
    # Class-conditional through the time embedding (num_class_embeds), no cross-attention.
    "unet2d-small": (
        "UNet2DModel",
        dict(
            block_out_channels=(64, 128, 256),
            layers_per_block=2,
            down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=32,
            norm_num_groups=32,
        ),
    ),
}


def _zoo():
    try:
        from ldmopt import configs
    except ImportError:
        return None
    return configs


def model_names() -> list[str]:
    """Built-in configs, then every zoo denoiser (the zoo's VAEs are codecs: ``--vae``)."""
    configs = _zoo()
    zoo = [n for n in configs.names() if configs.get(n).cls in FAMILIES] if configs else []
    return list(SMALL_MODELS) + zoo


def is_video_model(name: str) -> bool:
    configs = _zoo()
    if name in SMALL_MODELS or configs is None:
        return False
    try:
        return configs.get(name).cls in VIDEO_CLASSES
    except KeyError:
        return False


def build_denoiser(name: str, num_classes: int, resolution: int, latent_factor: int, tiny: bool, frames: int):
    """(Denoiser with random fp32 weights, pixels-to-model spatial factor, latent channels).

    Built-in configs denoise pixels (factor 1); zoo models (``ldmopt.configs``) denoise latents ``latent_factor``
    times smaller. Built-in UNet2DModels get ``num_classes + 1`` class embeddings (the last is the null label).
    Video models are built for ``frames`` frames (AnimateDiff's and Latte's temporal tables have a fixed length).
    """
    if name in SMALL_MODELS:
        import diffusers

        cls, cfg = SMALL_MODELS[name]
        extra = {"num_class_embeds": num_classes + 1} if cls == "UNet2DModel" else {}
        model = getattr(diffusers, cls)(sample_size=resolution, in_channels=3, out_channels=3, **cfg, **extra)
        denoiser = make_denoiser(model, num_classes, resolution)
        denoiser.check_resolution(resolution, 1, name)
        return denoiser, 1, 3
    configs = _zoo()
    if configs is None:
        raise SystemExit(f"--model {name}: ldmopt.configs is not available")
    try:
        entry = configs.get(name)
    except KeyError as exc:
        raise SystemExit(f"--model {name}: unknown; choose one of {', '.join(model_names())}") from exc
    if entry.cls == "AutoencoderKL":
        raise SystemExit(
            f"--model {name}: {entry.description} is the latent codec, not a denoiser; use it as --vae {name} "
            f"(random weights) or --vae PATH (a trained one) with one of {', '.join(model_names())}"
        )
    if entry.cls not in FAMILIES:
        raise SystemExit(f"--model {name}: a {entry.cls} is not trainable by this script ({', '.join(FAMILIES)})")
    model = configs.build_model(
        entry.name, device="cpu", dtype=torch.float32, tiny=tiny, frames=frames if entry.is_video else None
    ).train()
    denoiser = make_denoiser(model, num_classes, resolution)
    denoiser.check_resolution(resolution, latent_factor, name)
    return denoiser, latent_factor, denoiser.latent_channels


FINAL_CONDITIONING = "conditioning.safetensors"
FINAL_META = "denoiser.json"


def save_final(denoiser: Denoiser, path: Path, meta: dict) -> None:
    """``denoiser.model.save_pretrained(path)``, plus what the wrapper adds to it: its own parameters and persistent
    buffers (label tokens, pooled embeddings; not the ones it rebuilds from the config) in conditioning.safetensors,
    and denoiser.json (``meta`` with the classes needed to rebuild it: ``load_final``)."""
    from safetensors.torch import save_file

    path = Path(path)
    denoiser.model.save_pretrained(path)
    extra = {k: v.detach().cpu().contiguous() for k, v in denoiser.state_dict().items() if not k.startswith("model.")}
    save_file(extra, path / FINAL_CONDITIONING)
    info = {
        **meta, "diffusers_class": denoiser.kind, "denoiser_class": type(denoiser).__name__,
        "num_classes": denoiser.num_classes, "image_size": denoiser.image_size,
    }  # fmt: skip
    (path / FINAL_META).write_text(json.dumps(info, indent=2))


def load_final(path: Path) -> Denoiser:
    """The Denoiser that ``save_final`` wrote to ``path`` (fp32, on the CPU, stock diffusers forward)."""
    import diffusers
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / FINAL_META).read_text())
    model = getattr(diffusers, meta["diffusers_class"]).from_pretrained(path)
    denoiser = make_denoiser(model, meta["num_classes"], meta["image_size"])
    missing, unexpected = denoiser.load_state_dict(load_file(path / FINAL_CONDITIONING), strict=False)
    missing = [k for k in missing if not k.startswith("model.")]  # the model came from from_pretrained
    if missing or unexpected:
        raise KeyError(f"{path / FINAL_CONDITIONING}: missing {missing}, unexpected {unexpected}")
    return denoiser


class EMA:
    """Exponential moving average of the trainable parameters, in fp32, with the usual warm-up
    ``decay_t = min(decay, (1 + t) / (10 + t))``."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay = decay
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for _, p in self.named]

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for _, p in self.named], 1.0 - decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: s for (n, _), s in zip(self.named, self.shadow)}}

    def load_state_dict(self, state: dict) -> None:
        missing = [n for n, _ in self.named if n not in state["shadow"]]
        if missing:
            raise KeyError(f"EMA state lacks {len(missing)} parameters, e.g. {missing[:3]}")
        self.shadow = [state["shadow"][n].to(s.device) for (n, _), s in zip(self.named, self.shadow)]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily load the EMA weights into the module (for sampling); the training weights come back."""
        backup = [p.detach().clone() for _, p in self.named]
        with torch.no_grad():
            for (_, p), s in zip(self.named, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), b in zip(self.named, backup):
                    p.copy_(b)


@torch.no_grad()
def sample(
    denoiser: Denoiser,
    scheduler_config: dict,
    labels: torch.Tensor,
    latent_shape: tuple[int, ...],
    *,
    sampler: str = "ddim",
    steps: int = 50,
    guidance: float = 3.0,
    seed: int = 0,
    autocast=contextlib.nullcontext,
    channels_last: bool = False,
    first_frame: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latents for ``labels`` by DDIM or DDPM ancestral sampling, with classifier-free guidance when > 1.

    ``first_frame``: the conditioning frame latents of image-to-video models (SVD), one per label."""
    from diffusers import DDIMScheduler, DDPMScheduler

    device = labels.device
    sched = (DDIMScheduler if sampler == "ddim" else DDPMScheduler).from_config(scheduler_config)
    sched.set_timesteps(steps, device=device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((labels.shape[0], *latent_shape), generator=g).to(device) * sched.init_noise_sigma
    use_cfg = guidance != 1.0 and denoiser.supports_guidance
    null = torch.full_like(labels, denoiser.num_classes)
    first = torch.cat([first_frame, first_frame]) if use_cfg and first_frame is not None else first_frame
    for t in sched.timesteps:
        inp = torch.cat([x, x]) if use_cfg else x
        lab = torch.cat([labels, null]) if use_cfg else labels
        with autocast():
            out = denoiser(to_layout(inp, channels_last), t.expand(inp.shape[0]), lab, first).float()
        if use_cfg:
            cond, uncond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        x = sched.step(out, t, x, generator=g).prev_sample
    return x
