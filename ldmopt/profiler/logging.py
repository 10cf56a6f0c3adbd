"""Optional logging of a ``Profile`` to TensorBoard or Weights & Biases (imported only when asked for)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from . import categories as C

if TYPE_CHECKING:
    from .measure import Profile


class LoggingUnavailableError(ImportError):
    pass


def check_logging_available(*, tensorboard: str | None = None, wandb: Any = None) -> None:
    """Fail before profiling, with the install command, when a requested logger is not installed."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise LoggingUnavailableError(
            f"TensorBoard logging was requested (tensorboard={tensorboard!r}) but the 'tensorboard' package is not "
            "installed: pip install tensorboard (or pip install 'ldmopt[test]')"
        )
    if wandb and importlib.util.find_spec("wandb") is None:
        raise LoggingUnavailableError(
            "Weights & Biases logging was requested (wandb=...) but the 'wandb' package is not installed: "
            "pip install wandb"
        )


def _scalars(profile: Profile) -> dict[str, float]:
    shares = profile.shares()
    out: dict[str, float] = {}
    for key, cat in profile.categories.items():
        out[f"ldmopt/share/{key}"] = shares[key]
        out[f"ldmopt/time_ms_per_step/{key}"] = cat.time_us / 1e3 / max(profile.steps, 1)
    out["ldmopt/launches_per_step"] = profile.launches / max(profile.steps, 1)
    out["ldmopt/wall_ms_per_step"] = profile.wall_s * 1e3 / max(profile.steps, 1)
    if profile.data_wait_s:
        out["ldmopt/data_wait_ms_per_step"] = profile.data_wait_s * 1e3 / max(profile.steps, 1)
    return out


def log_profile(profile: Profile, *, tensorboard: str | None = None, wandb: Any = None, step: int = 0) -> None:
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=tensorboard) as writer:
            for tag, value in _scalars(profile).items():
                writer.add_scalar(tag, value, step)
            writer.add_text("ldmopt/profile", "```\n" + profile.table() + "\n```", step)
    if wandb:
        import wandb as wandb_module

        if wandb_module.run is None:
            kwargs = wandb if isinstance(wandb, dict) else {"project": wandb} if isinstance(wandb, str) else {}
            wandb_module.init(**kwargs)
        rows = [[C.LABELS[k], c.time_us, s] for (k, c), s in zip(profile.categories.items(), profile.shares().values())]
        table = wandb_module.Table(columns=["category", "time_us", "share"], data=rows)
        wandb_module.log({**_scalars(profile), "ldmopt/categories": table}, step=step)
