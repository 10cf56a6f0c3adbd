"""Checks of a requested setting (resolution, frames, batch) before ``analyze`` or ``profile`` builds anything.

``configs.example_inputs`` fills in the zoo's defaults and floors what the model cannot take: a batch or frame count
of 0 would become the default, frames on an image model are dropped, and a latent side that is not a multiple of the
transformer's patch is cut down to one. Each of those would print a setting that is not the one analysed, so the
profiler refuses them here with a message saying what the model accepts.
"""

from __future__ import annotations

import contextlib
from typing import Any

ANALYZE_DTYPES = ("fp16", "bf16", "fp32")


def positive(name: str, value: Any) -> None:
    """``value`` is None (the default) or an integer >= 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_dtype(dtype: Any) -> str:
    """The analysed dtype's key ("fp16", "bf16", "fp32") from a torch dtype or a name; others refused."""
    import torch

    from .gpus import dtype_key

    key = None
    if isinstance(dtype, (str, torch.dtype)):
        with contextlib.suppress(ValueError):  # the GPU table's keys: also tf32, fp8, fp64, not analysed in
            key = dtype_key(dtype)
    if key not in ANALYZE_DTYPES:
        raise ValueError(
            f"dtype={dtype!r}: the models are analysed in {', '.join(ANALYZE_DTYPES)} (torch.float16, torch.bfloat16, "
            "torch.float32, or those names)"
        )
    return key


def refuse_setting_with_inputs(inputs, **setting) -> None:
    """Explicit ``inputs`` fix the setting: a resolution, frame count or batch given as well would not be applied (the
    inputs are run as they are) yet would label the result, so it is refused."""
    given = {name: value for name, value in setting.items() if value is not None}
    if inputs is None or not given:
        return
    args = ", ".join(f"{name}={value!r}" for name, value in given.items())
    raise ValueError(
        f"{args} given with explicit inputs: the inputs are run as they are, so the setting would be reported but "
        f"not applied; drop {'it' if len(given) == 1 else 'them'}, or drop inputs to run the zoo's example inputs at "
        f"that setting (configs.example_inputs(model, resolution=..., frames=..., batch=...) makes such inputs)"
    )


def _zoo_entry_and_config(model_or_name, tiny: bool):
    from .. import configs

    if isinstance(model_or_name, str):
        entry = configs.get(model_or_name)
        config = configs.tiny_config(entry.name) if tiny else configs.load_config(entry.name)
    else:
        zoo_name = getattr(model_or_name, "ldmopt_zoo_name", None)
        if zoo_name is None:
            return None, None
        entry, config = configs.get(zoo_name), dict(getattr(model_or_name, "config", {}) or {})
    return entry, (config[0] if isinstance(config, list) else config)


def spatial_multiple(cls: str, config: dict[str, Any]) -> tuple[int, int]:
    """(pixel multiple, spatial patch) a model's resolution must respect: the VAE factor times the patch side.

    UNets and VAEs take any multiple of the VAE factor (diffusers sizes each upsampler to its skip connection).
    The transformers patchify the latent with a stride; Flux packs 2x2 latent pixels per token.
    """
    from .. import configs

    if cls == "FluxTransformer2DModel":
        patch = 2
    else:
        patch = config.get("patch_size") or 1
        patch = int(patch[-1]) if isinstance(patch, (list, tuple)) else int(patch)
    return configs.VAE_SCALE * patch, patch


def check_setting(model_or_name, *, resolution=None, frames=None, batch=None, tiny: bool = False) -> None:
    """Raise ValueError when the setting would be changed or ignored by the model instead of analysed as given."""
    from .. import configs

    positive("batch", batch)
    positive("frames", frames)
    hw = None if resolution is None else configs.resolution_pair(resolution)  # also for models not in the zoo
    entry, config = _zoo_entry_and_config(model_or_name, tiny)
    if entry is None:
        return
    if frames is not None and not entry.is_video:
        raise ValueError(
            f"{entry.name} ({entry.description}) is an image model: it has no frames, so frames={frames} would be "
            f"ignored; drop --frames"
        )
    if hw is None:
        return
    h, w = hw
    if h < 1 or w < 1:
        raise ValueError(f"resolution must be positive, got {h}x{w}")
    multiple, patch = spatial_multiple(entry.cls, config)
    if h % multiple or w % multiple:
        what = "the VAE factor" if patch == 1 else f"the VAE factor 8 x its {patch}x{patch} latent patch"
        fit = f"{h // multiple * multiple}x{w // multiple * multiple}"
        raise ValueError(
            f"{entry.name} needs a resolution that is a multiple of {multiple} px ({what}); got {h}x{w}, which it "
            f"would run as {fit}"
        )
    if entry.cls in configs.SQUARE_ONLY and h != w:
        raise ValueError(
            f"{entry.name} ({entry.cls}) takes square images only; got resolution {h}x{w}: give one side "
            f"(resolution={h}) or equal sides"
        )
