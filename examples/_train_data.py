"""Data for examples/train_ldm.py: procedural coloured shapes (still, or moving over F frames for video models) or an
image folder, a resumable sharded sampler, and per-sample diffusion randomness (noise, timestep, label drop) drawn
from (seed, epoch, index).

Drawing the randomness per sample instead of per process makes training independent of the number of processes: a
global batch holds the same samples with the same noise whether it is split over 1 or N ranks, so a checkpoint
written by N ranks resumes on M ranks and continues with the same loss (up to float summation order).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps
from torch.utils.data import Dataset, DistributedSampler, Sampler

#: GIF and TIFF train on their first frame (page)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 80, 230), "yellow": (235, 210, 40)}


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> float (3, H, W) in [-1, 1]."""
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return arr.float().div(127.5).sub(1.0)


class ShapesDataset(Dataset):
    """One coloured shape on a dim, textured background; the label is ``shape * len(COLOURS) + colour``.

    Sample ``i`` is a pure function of ``(seed, i)`` (position, size, rotation, background), so every process and
    every epoch sees the same image for the same index.
    """

    def __init__(self, resolution: int, length: int = 10_000, seed: int = 0) -> None:
        self.resolution, self.length, self.seed = resolution, length, seed
        self.num_classes = len(SHAPES) * len(COLOURS)
        self.class_names = [f"{c} {s}" for s in SHAPES for c in COLOURS]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int, epoch: int = 0) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(self.num_classes))
        return _to_tensor(self.render(label, rng)), label

    def render(self, label: int, rng: np.random.Generator) -> Image.Image:
        s = self.resolution * 4
        background = self.background(rng)
        r = rng.uniform(0.18, 0.34) * s
        cx, cy = rng.uniform(r, s - r, size=2)
        return self.draw(background, label, r, cx, cy, rng.uniform(0, 2 * math.pi))

    def background(self, rng: np.random.Generator) -> np.ndarray:
        """A dim colour ramp with blocky noise, at 4x the resolution (shapes are drawn at 4x and downsampled, so
        edges are anti-aliased at every resolution)."""
        s = self.resolution * 4
        bg = rng.uniform(0, 70, size=3)
        ramp = np.linspace(0.6, 1.4, s)[:, None, None] * bg[None, None, :]
        n = -(-s // 8)  # 8-pixel blocks covering the image (a side that is no multiple of 8 crops the last ones)
        noise = rng.normal(0, 6, size=(n, n, 1)).repeat(8, 0).repeat(8, 1)[:s, :s]
        return np.clip(ramp + noise, 0, 255).astype(np.uint8)

    def draw(self, background: np.ndarray, label: int, r: float, cx: float, cy: float, angle: float) -> Image.Image:
        """The label's shape of radius ``r`` centred at (cx, cy) on ``background`` (4x coordinates), downsampled."""
        canvas = Image.fromarray(background)
        draw = ImageDraw.Draw(canvas)
        shape, colour = SHAPES[label // len(COLOURS)], list(COLOURS.values())[label % len(COLOURS)]
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
        elif shape == "cross":
            w = r / 3
            for a in (angle, angle + math.pi / 2):
                dx, dy = math.cos(a), math.sin(a)
                pts = [(cx + dx * r * u - dy * w * v, cy + dy * r * u + dx * w * v) for u, v in _RECT]
                draw.polygon(pts, fill=colour)
        else:
            n = 4 if shape == "square" else 3
            pts = [
                (cx + r * math.cos(angle + 2 * math.pi * k / n), cy + r * math.sin(angle + 2 * math.pi * k / n))
                for k in range(n)
            ]
            draw.polygon(pts, fill=colour)
        return canvas.resize((self.resolution, self.resolution), Image.Resampling.BOX)


class VideoShapesDataset(ShapesDataset):
    """Clips of ``frames`` frames: the label's shape moves in a straight line, bouncing off the edges, and spins.

    Start, velocity, size, spin and background are a pure function of ``(seed, index)``; an item is
    ``((frames, 3, H, W), label)``. ``clip(label, i)`` renders extra clips (indices past the dataset) for the
    conditioning frames of image-to-video sampling.
    """

    def __init__(self, resolution: int, frames: int, length: int = 10_000, seed: int = 0) -> None:
        super().__init__(resolution, length, seed)
        self.frames = frames

    def __getitem__(self, index: int, epoch: int = 0) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(self.num_classes))
        return self.render_clip(label, rng), label

    def clip(self, label: int, i: int) -> torch.Tensor:
        return self.render_clip(label, np.random.default_rng([self.seed, self.length + i]))

    def render_clip(self, label: int, rng: np.random.Generator) -> torch.Tensor:
        s = self.resolution * 4
        background = self.background(rng)
        r = rng.uniform(0.14, 0.26) * s  # smaller than the still images' shapes, so they have room to move
        pos = rng.uniform(r, s - r, size=2)
        heading = rng.uniform(0, 2 * math.pi)
        vel = rng.uniform(0.03, 0.08) * s * np.array([math.cos(heading), math.sin(heading)])
        angle, spin = rng.uniform(0, 2 * math.pi), rng.uniform(-0.3, 0.3)
        out = []
        for k in range(self.frames):
            out.append(_to_tensor(self.draw(background, label, r, pos[0], pos[1], angle + spin * k)))
            pos = pos + vel
            # Reflect off the walls; one reflection suffices (a step is < 0.1 of the free range 1 - 2 * 0.26).
            low, high = pos < r, pos > s - r
            pos = np.where(low, 2 * r - pos, np.where(high, 2 * (s - r) - pos, pos))
            vel = np.where(low | high, -vel, vel)
        return torch.stack(out)


_RECT = ((-1, -1), (1, -1), (1, 1), (-1, 1))


def scan_images(root: Path) -> tuple[list[Path], list[str]]:
    """Image files under ``root`` (sorted), and the files with an image suffix that were left out, with why.

    Symlinked folders are followed, each real folder once (no loops); hidden files and folders (``.git``, macOS
    ``._name.png`` resource forks) are skipped; each file's header is read once, so a file that is no image is
    reported now rather than crashing training when its index comes up (a truncated image body still would).
    """
    found: list[Path] = []
    skipped: list[str] = []
    visited: set[str] = set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in visited:
            dirs[:] = []
            continue
        visited.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(folder, name)
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if name.startswith("."):
                skipped.append(f"{path} (hidden file)")
                continue
            try:
                Image.open(path).close()  # parses the header only: cheap, and catches what is no image at all
            except Exception as exc:  # PIL raises many kinds (UnidentifiedImageError, SyntaxError, struct.error)
                skipped.append(f"{path} (not a readable image: {type(exc).__name__}: {exc})")
                continue
            found.append(path)
    return sorted(found), skipped


def _white_level(values: np.ndarray, mode: str) -> tuple[float, float]:
    """(black, white) of a single-channel image PIL's convert would clip instead of scaling: 16-bit modes span
    0-65535; 32-bit ints and floats carry no bit depth, so the range their values use decides: [0, 1] floats, 8-bit
    or 16-bit values, else the image's own minimum and maximum (HDR or signed data: stretched, never clipped)."""
    if mode.startswith("I;16"):
        return 0.0, 65535.0
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    if lo >= 0.0:
        for white in ((1.0,) if mode == "F" else ()) + (255.0, 65535.0):
            if hi <= white:
                return 0.0, white
    return lo, hi if hi > lo else lo + 1.0


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode.startswith("I") or im.mode == "F":  # PIL's convert clips these to 0-255 instead of scaling
        values = np.asarray(im, dtype=np.float64)
        black, white = _white_level(values, im.mode)
        grey = np.nan_to_num((values - black) * (255.0 / (white - black)))
        im = Image.fromarray(np.clip(np.rint(grey), 0, 255).astype(np.uint8), "L")
    return im.convert("RGB")


class ImageFolderDataset(Dataset):
    """Images under ``root`` (recursively), resized on the short side and centre-cropped to ``resolution``.

    If ``root`` has sub-folders that hold images, each sub-folder is a class and images directly in ``root`` are
    left out (torchvision's ImageFolder convention); otherwise there is one class. ``skipped`` lists the files left
    out, with why. ``hflip`` mirrors half of the images, chosen from (seed, epoch, index).
    """

    def __init__(self, root: str | Path, resolution: int, hflip: bool = False, seed: int = 0) -> None:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"--data {str(root)!r} is not a folder")
        files, self.skipped = scan_images(root)
        folders = sorted({p.relative_to(root).parts[0] for p in files if p.parent != root})
        if folders:
            self.skipped += [f"{p} (directly in --data while its sub-folders are the classes)" for p in files
                             if p.parent == root]  # fmt: skip
            files = [p for p in files if p.parent != root]
        if not files:
            left_out = f"; left out: {'; '.join(self.skipped[:5])}" if self.skipped else ""
            raise FileNotFoundError(
                f"--data {str(root)!r} holds no readable images ({', '.join(IMAGE_SUFFIXES)}){left_out}"
            )
        self.files = files
        self.class_names = folders or ["image"]
        index = {name: i for i, name in enumerate(folders)}
        self.labels = [index[p.relative_to(root).parts[0]] if folders else 0 for p in files]
        self.num_classes = len(self.class_names)
        self.resolution, self.hflip, self.seed = resolution, hflip, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int, epoch: int = 0) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as im:
            # A camera's portrait photo is stored sideways with an EXIF orientation tag that viewers apply: so do we.
            img = _to_rgb(ImageOps.exif_transpose(im))
        scale = self.resolution / min(img.size)
        w, h = max(self.resolution, round(img.width * scale)), max(self.resolution, round(img.height * scale))
        img = img.resize((w, h), Image.Resampling.BICUBIC)
        left, top = (w - self.resolution) // 2, (h - self.resolution) // 2
        img = img.crop((left, top, left + self.resolution, top + self.resolution))
        if self.hflip and np.random.default_rng([self.seed, epoch, index]).random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _to_tensor(img), self.labels[index]


def _sample_seed(*key: int) -> int:
    return int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> 1)


class DiffusionSamples(Dataset):
    """Wraps an image or video dataset; item ``(epoch, index)`` is a dict with the image (or clip), its label (replaced
    by the null label ``num_classes`` with probability ``cond_drop``), and the sample's own noise and timestep."""

    def __init__(
        self, base: Dataset, latent_shape: tuple[int, ...], num_timesteps: int, cond_drop: float, seed: int
    ) -> None:
        self.base, self.latent_shape, self.num_timesteps = base, tuple(latent_shape), num_timesteps
        self.cond_drop, self.seed = cond_drop, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        image, label = self.base.__getitem__(index, epoch)
        g = torch.Generator().manual_seed(_sample_seed(self.seed, epoch, index))
        noise = torch.randn(self.latent_shape, generator=g)
        posterior_noise = torch.randn(self.latent_shape, generator=g)
        timestep = int(torch.randint(self.num_timesteps, (), generator=g))
        if float(torch.rand((), generator=g)) < self.cond_drop:
            label = self.base.num_classes
        return {
            "image": image,
            "label": label,
            "noise": noise,
            "posterior_noise": posterior_noise,
            "timestep": timestep,
        }


class EpochSampler(Sampler):
    """A DistributedSampler that yields ``(epoch, index)`` keys and can start mid-epoch (exact resume).

    ``set_epoch(epoch, skip)`` reshuffles for ``epoch`` and skips this rank's first ``skip`` indices.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True) -> None:
        self.inner = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner) - self.skip

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for i, index in enumerate(self.inner):
            if i >= self.skip:
                yield self.epoch, index


class PatchLatents(torch.nn.Module):
    """A fixed linear patch autoencoder standing in for a VAE when the model expects latents and no --vae is given.

    Each ``factor x factor`` RGB patch maps to ``channels`` numbers: the first three are the patch's mean colour, the
    next (up to the patch's 3 x factor^2 values) seeded random directions orthogonal to them (fine texture), any more
    seeded random unit directions, all divided by ``factor`` so latents stay near unit scale. Nothing is trained;
    decoding is the pseudo-inverse, so sample images stay viewable (blocky).
    """

    def __init__(self, channels: int, factor: int, seed: int = 0) -> None:
        super().__init__()
        dim = 3 * factor * factor
        means = torch.zeros(dim, 3, dtype=torch.float64)
        for c in range(3):  # pixel_unshuffle orders features channel-major
            means[c * factor * factor : (c + 1) * factor * factor, c] = 1.0
        g = torch.Generator().manual_seed(seed)
        basis, _ = torch.linalg.qr(torch.cat([means, torch.randn(dim, dim, generator=g, dtype=torch.float64)], 1))
        rows = basis[:, : min(channels, dim)].T
        if channels > dim:  # more channels than patch values: unit-norm random rows (latents stay near unit scale)
            extra = torch.randn(channels - dim, dim, generator=g, dtype=torch.float64)
            rows = torch.cat([rows, extra / extra.norm(dim=1, keepdim=True)])
        weight = rows.float() / factor
        self.factor = factor
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("pinv", torch.linalg.pinv(weight.double()).float(), persistent=False)

    def encode(self, x: torch.Tensor, posterior_noise: torch.Tensor | None = None) -> torch.Tensor:
        patches = torch.nn.functional.pixel_unshuffle(x.float(), self.factor)
        return torch.einsum("ck,bkhw->bchw", self.weight, patches)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        patches = torch.einsum("kc,bchw->bkhw", self.pinv, z.float())
        return torch.nn.functional.pixel_shuffle(patches, self.factor).clamp(-1, 1)


class VaeLatents(torch.nn.Module):
    """A frozen diffusers AutoencoderKL: latents are a sample of the posterior (``mean + std * posterior_noise``) times
    the VAE's scaling factor.

    ``path`` is a local folder (``--vae PATH``) or a zoo VAE name (``--vae sd15-vae``: that config with random weights,
    its tiny variant with ``tiny``), which makes the latents meaningless but costs what the real VAE costs.
    """

    def __init__(self, path: str, tiny: bool = False) -> None:
        super().__init__()
        from diffusers import AutoencoderKL

        zoo = _zoo_vae(path)
        if zoo is not None and not Path(path).is_dir():
            from ldmopt import configs

            self.vae = configs.build_model(zoo, device="cpu", dtype=torch.float32, tiny=tiny)
            if os.environ.get("RANK", "0") == "0":  # once, not per torchrun process
                print(f"--vae {path}: the zoo's {'tiny ' if tiny else ''}config with RANDOM weights (throughput only)")
        elif Path(path).is_dir():
            self.vae = AutoencoderKL.from_pretrained(path, local_files_only=True)
        else:
            from ldmopt import configs

            zoo_vaes = [n for n in configs.names() if _zoo_vae(n) is not None]
            raise SystemExit(f"--vae {path!r} is neither a folder holding a diffusers AutoencoderKL nor a zoo VAE "
                             f"({', '.join(zoo_vaes)})")  # fmt: skip
        self.vae.requires_grad_(False).eval()
        self.scale = float(self.vae.config.scaling_factor)
        self.factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    @torch.no_grad()
    def encode(self, x: torch.Tensor, posterior_noise: torch.Tensor | None = None) -> torch.Tensor:
        dist = self.vae.encode(x.to(self.vae.dtype)).latent_dist
        z = dist.mean if posterior_noise is None else dist.mean + dist.std * posterior_noise.to(dist.mean)
        return z.float() * self.scale

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode((z / self.scale).to(self.vae.dtype)).sample.float().clamp(-1, 1)


def _zoo_vae(name: str) -> str | None:
    try:
        from ldmopt import configs

        entry = configs.get(name)
    except (ImportError, KeyError):
        return None
    return entry.name if entry.cls == "AutoencoderKL" else None


class Framewise(torch.nn.Module):
    """Applies an image codec to every frame: (B, F, 3, H, W) videos <-> (B, F, C, h, w) latents."""

    def __init__(self, codec: torch.nn.Module) -> None:
        super().__init__()
        self.codec, self.factor = codec, codec.factor

    def encode(self, x: torch.Tensor, posterior_noise: torch.Tensor | None = None) -> torch.Tensor:
        pn = None if posterior_noise is None else posterior_noise.flatten(0, 1)
        return self.codec.encode(x.flatten(0, 1), pn).unflatten(0, x.shape[:2])

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(z.flatten(0, 1)).unflatten(0, z.shape[:2])


class PixelSpace(torch.nn.Module):
    """Identity 'autoencoder' for models that denoise RGB pixels directly."""

    factor = 1

    def encode(self, x: torch.Tensor, posterior_noise: torch.Tensor | None = None) -> torch.Tensor:
        return x.float()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z.float().clamp(-1, 1)


def latent_codec(args, factor: int, in_channels: int, vae: VaeLatents | None) -> torch.nn.Module:
    if factor == 1:
        if in_channels != 3 or vae is not None:
            raise SystemExit(f"--model {args.model} denoises pixels (3 channels); it takes no --vae")
        return PixelSpace()
    if vae is not None:
        if vae.vae.config.latent_channels != in_channels:
            raise SystemExit(
                f"--vae {args.vae}: {vae.vae.config.latent_channels} latent channels, the model takes {in_channels}"
            )
        return vae
    return PatchLatents(in_channels, factor, seed=args.seed)


def save_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> Path:
    """Save (N, 3, H, W) images in [-1, 1] as one PNG grid with a 2-pixel border, ``nrow`` images per row."""
    images = images.detach().float().cpu().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    n, _, h, w = images.shape
    nrow = nrow or max(1, math.ceil(math.sqrt(n)))
    ncol = math.ceil(n / nrow)
    grid = torch.zeros(3, ncol * (h + 2) + 2, nrow * (w + 2) + 2, dtype=torch.uint8)
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[:, 2 + r * (h + 2) : 2 + r * (h + 2) + h, 2 + c * (w + 2) : 2 + c * (w + 2) + w] = images[i]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid.permute(1, 2, 0).numpy()).save(path)
    return path
