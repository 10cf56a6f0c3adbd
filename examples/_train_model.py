"""Models for examples/train_ldm.py: the small built-in configs, zoo configs via ``ldmopt.configs``, a ``Denoiser``
wrapper that feeds each diffusers model family its conditioning from class labels, an EMA of the weights, and
DDPM/DDIM sampling with classifier-free guidance."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
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
SUPPORTED_CLASSES = ("UNet2DConditionModel", "UNet2DModel", "DiTTransformer2DModel")
COND_TOKENS = 4  # cross-attention tokens per class label


def model_names() -> list[str]:
    names = list(SMALL_MODELS)
    try:
        from ldmopt import configs

        names += [n for n in configs.names() if configs.get(n).cls in SUPPORTED_CLASSES]
    except ImportError:
        pass
    return names


class Denoiser(nn.Module):
    """``denoiser(x_t, t, labels)`` -> the model's prediction (epsilon or v) with x_t's shape.

    Labels in ``[0, num_classes)`` are classes; ``num_classes`` is the null label (classifier-free guidance). Each
    family gets its conditioning from learned embeddings of the label: cross-attention tokens (and SDXL's pooled
    text embedding and size ids) for UNet2DConditionModel, ``class_labels`` for UNet2DModel and DiT. A DiT's learned
    variance channels are dropped.
    """

    def __init__(self, model: nn.Module, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.model, self.num_classes = model, num_classes
        cfg = model.config
        self.kind = type(model).__name__
        if self.kind == "UNet2DConditionModel":
            dim = cfg.cross_attention_dim
            dim = dim[0] if isinstance(dim, (list, tuple)) else dim
            self.tokens = nn.Embedding(num_classes + 1, COND_TOKENS * dim)
            nn.init.normal_(self.tokens.weight, std=1.0)
            self.token_shape = (COND_TOKENS, dim)
            self.pooled = None
            if cfg.addition_embed_type == "text_time":
                pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
                self.pooled = nn.Embedding(num_classes + 1, pooled)
                ids = torch.tensor([image_size, image_size, 0, 0, image_size, image_size], dtype=torch.float32)
                self.register_buffer("time_ids", ids, persistent=False)
            if cfg.class_embed_type is not None or cfg.addition_embed_type not in (None, "text_time"):
                raise SystemExit(f"UNet2DConditionModel with class/addition embedding {cfg.class_embed_type!r}/"
                                 f"{cfg.addition_embed_type!r} is not supported by this script")  # fmt: skip
        elif self.kind == "UNet2DModel":
            self.conditional = cfg.num_class_embeds is not None
            if self.conditional and cfg.num_class_embeds < num_classes + 1:
                raise SystemExit(f"UNet2DModel has {cfg.num_class_embeds} class embeddings; need {num_classes + 1}")
        elif self.kind == "DiTTransformer2DModel":
            if cfg.num_embeds_ada_norm < num_classes:
                raise SystemExit(f"DiT has {cfg.num_embeds_ada_norm} classes; the data has {num_classes}")
            from diffusers.models.embeddings import LabelEmbedding

            # The label drop is done here, once per sample and deterministically, not by each block's embedder.
            for m in model.modules():
                if isinstance(m, LabelEmbedding):
                    m.dropout_prob = 0.0
            self.dit_null = cfg.num_embeds_ada_norm
        else:
            raise SystemExit(f"{self.kind} is not supported by this script ({', '.join(SUPPORTED_CLASSES)})")

    @property
    def supports_guidance(self) -> bool:
        return self.kind != "UNet2DModel" or self.conditional

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.kind == "UNet2DConditionModel":
            ehs = self.tokens(labels).view(labels.shape[0], *self.token_shape)
            added = None
            if self.pooled is not None:
                added = {"text_embeds": self.pooled(labels), "time_ids": self.time_ids.expand(labels.shape[0], 6)}
            out = self.model(x, t, ehs, added_cond_kwargs=added, return_dict=False)[0]
        elif self.kind == "UNet2DModel":
            out = self.model(x, t, class_labels=labels if self.conditional else None, return_dict=False)[0]
        else:
            dit_labels = torch.where(labels == self.num_classes, self.dit_null, labels)
            out = self.model(x, timestep=t, class_labels=dit_labels, return_dict=False)[0]
        return out[:, : x.shape[1]]


def build_denoiser(name: str, num_classes: int, resolution: int, latent_factor: int, tiny: bool):
    """(Denoiser with random fp32 weights, pixels-to-model spatial factor, model input channels).

    Built-in configs denoise pixels (factor 1); zoo models (``ldmopt.configs``) denoise latents ``latent_factor``
    times smaller. Built-in UNet2DModels get ``num_classes + 1`` class embeddings (the last is the null label).
    """
    if name in SMALL_MODELS:
        import diffusers

        cls, cfg = SMALL_MODELS[name]
        extra = {"num_class_embeds": num_classes + 1} if cls == "UNet2DModel" else {}
        model = getattr(diffusers, cls)(sample_size=resolution, in_channels=3, out_channels=3, **cfg, **extra)
        factor = 1
    else:
        try:
            from ldmopt import configs
        except ImportError as exc:
            raise SystemExit(f"--model {name}: ldmopt.configs is not available ({exc})") from exc
        try:
            entry = configs.get(name)
        except KeyError as exc:
            raise SystemExit(f"--model {name}: unknown; choose one of {', '.join(model_names())}") from exc
        if entry.cls not in SUPPORTED_CLASSES:
            raise SystemExit(
                f"--model {name}: a {entry.cls} is not trainable by this script (image models only: "
                f"{', '.join(SUPPORTED_CLASSES)}); choose one of {', '.join(model_names())}"
            )
        model = configs.build_model(entry.name, device="cpu", dtype=torch.float32, tiny=tiny).train()
        factor = latent_factor
        if entry.cls == "DiTTransformer2DModel" and resolution // factor != model.config.sample_size:
            raise SystemExit(
                f"--model {name}: DiT's positional embedding is fixed to {model.config.sample_size}x"
                f"{model.config.sample_size} latents; use --resolution {model.config.sample_size * factor}"
            )
    return Denoiser(model, num_classes, resolution), factor, model.config.in_channels


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
) -> torch.Tensor:
    """Latents for ``labels`` by DDIM or DDPM ancestral sampling, with classifier-free guidance when > 1."""
    from diffusers import DDIMScheduler, DDPMScheduler

    device = labels.device
    sched = (DDIMScheduler if sampler == "ddim" else DDPMScheduler).from_config(scheduler_config)
    sched.set_timesteps(steps, device=device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((labels.shape[0], *latent_shape), generator=g).to(device) * sched.init_noise_sigma
    use_cfg = guidance != 1.0 and denoiser.supports_guidance
    null = torch.full_like(labels, denoiser.num_classes)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for t in sched.timesteps:
        inp = torch.cat([x, x]) if use_cfg else x
        lab = torch.cat([labels, null]) if use_cfg else labels
        with autocast():
            out = denoiser(inp.contiguous(memory_format=fmt), t.expand(inp.shape[0]), lab).float()
        if use_cfg:
            cond, uncond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        x = sched.step(out, t, x, generator=g).prev_sample
    return x
