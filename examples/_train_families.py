"""Per-family conditioning for examples/train_ldm.py: one small ``Denoiser`` class per diffusers model class turns
``(x_t, t, labels)`` into that model's call and its output back into a prediction shaped like ``x_t``.

Every family is conditioned on the class label the same way: learned embeddings of the label (the last row is the
null label for classifier-free guidance) become its text tokens, pooled text embedding or class label. Names,
shapes and dtypes of each model's inputs follow ``ldmopt.configs.example_inputs``.

Latents in the training loop are (B, C, h, w) for image models and (B, F, C, h, w) for video models (frames first,
as the per-frame codec makes them); each video family permutes to its own order. With channels-last on, video latents
lie in memory as (B, F, h, w, C), so both (B, C, F, h, w) (channels_last_3d) and SVD's flattened (B*F, C, h, w)
(channels_last) are views, and the fused temporal layers get channels-last activations without a copy.
"""

from __future__ import annotations

import torch
from torch import nn

COND_TOKENS = 4  # cross-attention tokens per class label
SVD_TIME_IDS = (6.0, 127.0, 0.02)  # fps - 1, motion bucket id, noise augmentation strength: the pipeline's defaults
FLUX_GUIDANCE = 1.0  # guidance distillation is not trained here: CFG at sampling time does the guiding


def to_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Latents in the memory layout the model is trained in: NCHW or NHWC; (B, F, C, h, w) videos as (B, F, h, w, C)."""
    if not channels_last or x.dim() not in (4, 5):
        return x.contiguous()
    if x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


def channels_last_(module: nn.Module) -> nn.Module:
    """``module.to(memory_format=torch.channels_last)`` that also takes 5-D weights (video models' Conv3d), which
    become channels_last_3d; parameters keep their identity."""
    for t in (*module.parameters(), *module.buffers()):
        if t.dim() in (4, 5):
            t.data = t.data.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    return module


def _label_embedding(num_classes: int, width: int) -> nn.Embedding:
    emb = nn.Embedding(num_classes + 1, width)
    nn.init.normal_(emb.weight, std=1.0)
    return emb


class Denoiser(nn.Module):
    """``denoiser(x_t, t, labels, first_frame=None)`` -> the model's prediction (epsilon or v) with x_t's shape.

    Labels in ``[0, num_classes)`` are classes; ``num_classes`` is the null label. ``first_frame`` (B, C, h, w) is
    the clean latent of each video's first frame, used by image-to-video models (``needs_first_frame``). Learned
    variance channels (DiT, PixArt, Latte) are dropped.
    """

    video = False
    needs_first_frame = False

    def __init__(self, model: nn.Module, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.model, self.num_classes, self.image_size = model, num_classes, image_size
        self.kind = type(model).__name__

    @property
    def latent_channels(self) -> int:
        return self.model.config.in_channels

    @property
    def supports_guidance(self) -> bool:
        return True

    def check_resolution(self, resolution: int, factor: int, name: str) -> None:
        """SystemExit with the sizes that work when the model cannot take ``resolution`` pixels."""

    def _tokens(self, dim: int, count: int = COND_TOKENS) -> None:
        self.tokens = _label_embedding(self.num_classes, count * dim)
        self.token_shape = (count, dim)

    def text(self, labels: torch.Tensor) -> torch.Tensor:
        return self.tokens(labels).view(labels.shape[0], *self.token_shape)

    def _patch_multiple(self, resolution: int, factor: int, name: str, limit: int | None = None) -> None:
        """Patch-embedded transformers: latent side a multiple of the patch size, and at most ``limit`` patches."""
        patch, latent = self.model.config.patch_size, resolution // factor
        if latent % patch or (limit is not None and latent // patch > limit):
            most = f", at most {limit * patch * factor}" if limit is not None else ""
            raise SystemExit(
                f"--model {name}: {resolution}px is {latent}x{latent} latents; {self.kind} needs a multiple of its "
                f"{patch}x{patch} patches{most} (--resolution a multiple of {patch * factor}{most})"
            )


class UNet2DConditionDenoiser(Denoiser):
    """Cross-attention tokens; SDXL's pooled text embedding and size ids (``addition_embed_type="text_time"``)."""

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        cfg = model.config
        if cfg.class_embed_type is not None or cfg.addition_embed_type not in (None, "text_time"):
            raise SystemExit(f"{self.kind} with class/addition embedding {cfg.class_embed_type!r}/"
                             f"{cfg.addition_embed_type!r} is not supported by this script")  # fmt: skip
        dim = cfg.cross_attention_dim
        self._tokens(dim[0] if isinstance(dim, (list, tuple)) else dim)
        self.pooled = None
        if cfg.addition_embed_type == "text_time":
            pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
            self.pooled = nn.Embedding(num_classes + 1, pooled)
            ids = torch.tensor([image_size, image_size, 0, 0, image_size, image_size], dtype=torch.float32)
            self.register_buffer("time_ids", ids, persistent=False)

    def forward(self, x, t, labels, first_frame=None):
        added = None
        if self.pooled is not None:
            added = {"text_embeds": self.pooled(labels), "time_ids": self.time_ids.expand(labels.shape[0], 6)}
        return self.model(x, t, self.text(labels), added_cond_kwargs=added, return_dict=False)[0]


class UNet2DDenoiser(Denoiser):
    """``class_labels`` through the time embedding (``num_class_embeds``), or unconditional."""

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self.conditional = model.config.num_class_embeds is not None
        if self.conditional and model.config.num_class_embeds < num_classes + 1:
            raise SystemExit(
                f"UNet2DModel has {model.config.num_class_embeds} class embeddings; need {num_classes + 1}"
            )

    @property
    def supports_guidance(self) -> bool:
        return self.conditional

    def check_resolution(self, resolution, factor, name):
        # UNet2DModel concatenates each up block's input with its skip: every downsampling must halve evenly.
        multiple = 2 ** (len(self.model.config.block_out_channels) - 1)
        side = resolution // factor
        if side % multiple:
            raise SystemExit(
                f"--model {name}: {side}x{side} inputs do not halve evenly through its {multiple}x downsampling; "
                f"use a --resolution multiple of {multiple * factor}"
            )

    def forward(self, x, t, labels, first_frame=None):
        return self.model(x, t, class_labels=labels if self.conditional else None, return_dict=False)[0]


class DiTDenoiser(Denoiser):
    """``class_labels``; the null label is the model's own (``num_embeds_ada_norm``)."""

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        if model.config.num_embeds_ada_norm < num_classes:
            raise SystemExit(f"DiT has {model.config.num_embeds_ada_norm} classes; the data has {num_classes}")
        from diffusers.models.embeddings import LabelEmbedding

        # The label drop is done here, once per sample and deterministically, not by each block's embedder.
        for m in model.modules():
            if isinstance(m, LabelEmbedding):
                m.dropout_prob = 0.0
        self.dit_null = model.config.num_embeds_ada_norm

    def check_resolution(self, resolution, factor, name):
        size = self.model.config.sample_size
        if resolution // factor != size:
            raise SystemExit(f"--model {name}: DiT's positional embedding is fixed to {size}x{size} latents; use "
                             f"--resolution {size * factor}")  # fmt: skip

    def forward(self, x, t, labels, first_frame=None):
        labels = torch.where(labels == self.num_classes, self.dit_null, labels)
        return self.model(x, timestep=t, class_labels=labels, return_dict=False)[0][:, : x.shape[1]]


class PixArtDenoiser(Denoiser):
    """Caption tokens (``caption_channels`` wide); resolution and aspect ratio when the config uses them."""

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self._tokens(model.config.caption_channels)
        self.register_buffer("size_ids", torch.tensor([float(image_size)] * 2), persistent=False)

    def check_resolution(self, resolution, factor, name):
        self._patch_multiple(resolution, factor, name)

    def forward(self, x, t, labels, first_frame=None):
        b = labels.shape[0]
        extra = {"resolution": None, "aspect_ratio": None}
        if self.model.use_additional_conditions:  # square images: aspect ratio 1
            extra = {"resolution": self.size_ids.expand(b, 2), "aspect_ratio": self.size_ids.new_ones(b, 1)}
        out = self.model(
            x, encoder_hidden_states=self.text(labels), timestep=t, added_cond_kwargs=extra, return_dict=False
        )
        return out[0][:, : x.shape[1]]


class SD3Denoiser(Denoiser):
    """Joint-attention tokens and a pooled projection; the learned positional table is cropped, so it caps the size."""

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self._tokens(model.config.joint_attention_dim)
        self.pooled = _label_embedding(num_classes, model.config.pooled_projection_dim)

    def check_resolution(self, resolution, factor, name):
        self._patch_multiple(resolution, factor, name, limit=self.model.config.pos_embed_max_size)

    def forward(self, x, t, labels, first_frame=None):
        text, pooled = self.text(labels), self.pooled(labels)
        return self.model(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t, return_dict=False)[0]


class FluxDenoiser(Denoiser):
    """Joint-attention tokens and a pooled projection on 2x2-packed latents (``in_channels / 4`` latent channels) with
    RoPE position ids; timesteps in [0, 1] (the model scales by 1000), a constant distilled-guidance input."""

    @property
    def latent_channels(self) -> int:
        return self.model.config.in_channels // 4

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self._tokens(model.config.joint_attention_dim)
        self.pooled = _label_embedding(num_classes, model.config.pooled_projection_dim)

    def check_resolution(self, resolution, factor, name):
        latent = resolution // factor
        if latent % 2:
            raise SystemExit(f"--model {name}: Flux packs 2x2 latents; {resolution}px gives {latent}x{latent}: use "
                             f"a --resolution that is a multiple of {2 * factor}")  # fmt: skip

    def forward(self, x, t, labels, first_frame=None):
        b, c, h, w = x.shape
        packed = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        img_ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
        img_ids[..., 1] = torch.arange(h // 2, device=x.device)[:, None]
        img_ids[..., 2] = torch.arange(w // 2, device=x.device)[None, :]
        text = self.text(labels)
        extra = {}
        if self.model.config.guidance_embeds:
            extra["guidance"] = torch.full((b,), FLUX_GUIDANCE, device=x.device)
        out = self.model(
            packed, encoder_hidden_states=text, pooled_projections=self.pooled(labels), timestep=t.float() / 1000,
            img_ids=img_ids.reshape(-1, 3), txt_ids=text.new_zeros(text.shape[1], 3), return_dict=False, **extra,
        )[0]  # fmt: skip
        out = out.reshape(b, h // 2, w // 2, -1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, h, w)
        return out[:, :c]


# ------------------------------------------------------------------------------------------------ video families


def _cfhw(x: torch.Tensor) -> torch.Tensor:
    """(B, F, C, h, w) -> (B, C, F, h, w), a view (channels_last_3d when ``x`` is laid out by ``to_layout``)."""
    return x.permute(0, 2, 1, 3, 4)


class MotionDenoiser(Denoiser):
    """AnimateDiff (UNetMotionModel): (B, C, F, h, w) latents; the tokens repeated per frame, as its pipeline does."""

    video = True

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        cfg = model.config
        if cfg.addition_embed_type is not None or cfg.encoder_hid_dim_type is not None:
            raise SystemExit(f"{self.kind} with addition embedding {cfg.addition_embed_type!r} is not supported")
        self._tokens(cfg.cross_attention_dim)

    def forward(self, x, t, labels, first_frame=None):
        text = self.text(labels).repeat_interleave(x.shape[1], dim=0)
        return _cfhw(self.model(_cfhw(x), t, text, return_dict=False)[0])


class UNet3DDenoiser(Denoiser):
    """ModelScope (UNet3DConditionModel): (B, C, F, h, w) latents; the model repeats the tokens per frame."""

    video = True

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self._tokens(model.config.cross_attention_dim)

    def forward(self, x, t, labels, first_frame=None):
        return _cfhw(self.model(_cfhw(x), t, self.text(labels), return_dict=False)[0])


class SVDDenoiser(Denoiser):
    """Stable Video Diffusion (image-to-video): (B, F, 2C, h, w) input = the noisy latents next to the clean first
    frame's latent on every frame; one image-embedding token from the label; fixed ``added_time_ids``. The null
    label also zeroes the conditioning frame, as the pipeline's unconditional branch does."""

    video = True
    needs_first_frame = True

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        cfg = model.config
        n_ids = cfg.projection_class_embeddings_input_dim // cfg.addition_time_embed_dim
        if n_ids != len(SVD_TIME_IDS) or cfg.in_channels != 2 * cfg.out_channels:
            raise SystemExit(f"{self.kind} with {n_ids} time ids and {cfg.in_channels} -> {cfg.out_channels} "
                             "channels is not supported (SVD has 3 ids and twice the output channels in)")  # fmt: skip
        self._tokens(cfg.cross_attention_dim, count=1)
        self.register_buffer("time_ids", torch.tensor(SVD_TIME_IDS), persistent=False)

    @property
    def latent_channels(self) -> int:
        return self.model.config.out_channels

    def forward(self, x, t, labels, first_frame=None):
        if first_frame is None:
            raise ValueError("SVD is image-to-video: pass the first frame's latent")
        keep = (labels != self.num_classes).to(first_frame.dtype).view(-1, 1, 1, 1)
        cond = (first_frame * keep)[:, None].expand_as(x)
        # Concatenate along the innermost (channel) axis in memory, keeping x's channels-last layout when it has one.
        sample = torch.cat([x.permute(0, 1, 3, 4, 2), cond.permute(0, 1, 3, 4, 2)], dim=-1).permute(0, 1, 4, 2, 3)
        ids = self.time_ids.expand(labels.shape[0], -1)
        return self.model(sample, t, self.text(labels), added_time_ids=ids, return_dict=False)[0]


class LatteDenoiser(Denoiser):
    """Latte: (B, C, F, h, w) latents, caption tokens; its temporal positional table is built for ``--frames``."""

    video = True

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        self._tokens(model.config.caption_channels)

    def check_resolution(self, resolution, factor, name):
        self._patch_multiple(resolution, factor, name)

    def forward(self, x, t, labels, first_frame=None):
        out = self.model(_cfhw(x), timestep=t, encoder_hidden_states=self.text(labels), return_dict=False)[0]
        return _cfhw(out[:, : x.shape[2]])


class WanDenoiser(Denoiser):
    """Wan 2.1/2.2 text-to-video: (B, C, F, h, w) latents (``--frames`` counts latent frames here), text tokens of
    ``text_dim``; the model patches 1 x 2 x 2 and reads positions through its rotary embedding (any frame count)."""

    video = True

    def __init__(self, model, num_classes, image_size):
        super().__init__(model, num_classes, image_size)
        if model.config.image_dim is not None:
            raise SystemExit(f"{self.kind} with an image encoder input (image-to-video) is not supported")
        self._tokens(model.config.text_dim)

    def check_resolution(self, resolution, factor, name):
        patch, latent = self.model.config.patch_size[1], resolution // factor
        if latent % patch:
            raise SystemExit(f"--model {name}: {resolution}px is {latent}x{latent} latents; Wan patches "
                             f"{patch}x{patch}: use a --resolution that is a multiple of {patch * factor}")  # fmt: skip

    def forward(self, x, t, labels, first_frame=None):
        return _cfhw(self.model(_cfhw(x), timestep=t, encoder_hidden_states=self.text(labels), return_dict=False)[0])


FAMILIES: dict[str, type[Denoiser]] = {
    "UNet2DConditionModel": UNet2DConditionDenoiser,
    "UNet2DModel": UNet2DDenoiser,
    "DiTTransformer2DModel": DiTDenoiser,
    "PixArtTransformer2DModel": PixArtDenoiser,
    "SD3Transformer2DModel": SD3Denoiser,
    "FluxTransformer2DModel": FluxDenoiser,
    "UNetMotionModel": MotionDenoiser,
    "UNet3DConditionModel": UNet3DDenoiser,
    "UNetSpatioTemporalConditionModel": SVDDenoiser,
    "LatteTransformer3DModel": LatteDenoiser,
    "WanTransformer3DModel": WanDenoiser,
}
VIDEO_CLASSES = tuple(name for name, cls in FAMILIES.items() if cls.video)


def make_denoiser(model: nn.Module, num_classes: int, image_size: int) -> Denoiser:
    kind = type(model).__name__
    if kind not in FAMILIES:
        raise SystemExit(f"{kind} is not supported by this script ({', '.join(FAMILIES)})")
    return FAMILIES[kind](model, num_classes, image_size)
