"""What ``ldmopt.tune`` chose, kept as JSON and applied again without measuring: ``ldmopt.patch_tuned``.

Tuning calls the model dozens of times. A service that restarts, a second process of the same job, or every rank of
a data-parallel run needs the same decision, not a new measurement (the ranks must agree: different patches on
different ranks are different kernels and different rounding). So ``report.tuning.choice()`` returns the decision as
plain data (the sites kept and left stock, with the rules each had and why, and where it was measured), ``Tuning.save``
writes it, and ``patch_tuned(pipe, choice)`` patches exactly the kept sites of an identical model. The choice names
sites by their module names: a model whose patch finds other sites (another architecture, another ldmopt version)
is refused, never patched halfway.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from .core import PatchError, is_patched, patch, unpatch
from .report import PatchReport
from .targets import models_of
from .tune import Tuning, _final_report, _keeping, _where
from .tune_sites import patched_sites, read_touched

FORMAT = "ldmopt.tune choice"
VERSION = 1


def make_choice(tuning: Any, measured_on: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready decision of ``tuning`` (a :class:`ldmopt.patch.tune.Tuning`)."""
    families = tuning.families
    if families is not None:
        families = [families] if isinstance(families, str) else list(families)
    return {
        "format": FORMAT,
        "version": VERSION,
        "families": families,
        "training": bool(tuning.training),
        "channels_last_weights": tuning.channels_last_weights,
        "filtered": bool(tuning.filtered),
        "measured_on": dict(measured_on),
        "timer": tuning.timer,
        "stock_ms": _finite(tuning.stock_ms),
        "tuned_ms": _finite(tuning.tuned_ms),
        "sites": [
            {"model": s.model, "name": s.name, "rules": list(s.rules), "kept": bool(s.kept), "why": s.why}
            for s in tuning.sites
        ],
    }


def _finite(value: float) -> float | None:
    """None for NaN/inf (nothing measured): strict JSON has no NaN."""
    return value if math.isfinite(value) else None


def device_names(devices: set) -> str:
    """The GPUs' names, comma-separated, or "cpu" without any."""
    import torch

    def name(device) -> str:
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # not queryable here: the device as torch names it
            return str(device)

    return ", ".join(sorted({name(d) for d in devices})) if devices else "cpu"


def parameter_dtypes(pipe_or_model: Any) -> str:
    """The floating-point dtypes of the models' parameters, comma-separated ("float16"), "" without any."""
    dtypes = {
        str(p.dtype).removeprefix("torch.")
        for _, model in models_of(pipe_or_model, for_patch=False)
        for p in model.parameters()
        if p.is_floating_point()
    }
    return ", ".join(sorted(dtypes))


def measured_on(devices: set, dtypes: str = "") -> dict[str, Any]:
    """Where a tuning ran: the GPU's name (or "cpu"), the parameters' dtypes, library versions and the date."""
    import torch

    from .. import __version__
    from ..info import _version

    return {
        "device": device_names(devices),
        "dtype": dtypes,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "ldmopt": __version__,
        "date": datetime.date.today().isoformat(),
    }


def save(choice: dict[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice, indent=2, allow_nan=False) + "\n")
    return path


def load(source: Any) -> dict[str, Any]:
    """A choice from a Tuning, a PatchReport of ``tune``, a dict, or the path of a saved one; checked."""
    if isinstance(source, PatchReport):
        if source.tuning is None:
            raise ValueError("ldmopt.patch_tuned: choice is the report of ldmopt.patch, not of ldmopt.tune")
        source = source.tuning
    if isinstance(source, Tuning):
        return source.choice()
    if isinstance(source, (str, os.PathLike)):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"ldmopt.patch_tuned: choice={str(source)!r} could not be read: {error}") from None
    if not isinstance(source, dict):
        raise TypeError(
            "ldmopt.patch_tuned: choice must be a Tuning, the report of ldmopt.tune, a dict from Tuning.choice() or "
            f"the path of a saved one, got {type(source).__name__}"
        )
    if source.get("format") != FORMAT or source.get("version") != VERSION:
        raise ValueError(
            f"ldmopt.patch_tuned: choice has format={source.get('format')!r} version={source.get('version')!r}; "
            f"supported: format={FORMAT!r} version={VERSION} (from Tuning.choice())"
        )
    sites = source.get("sites")
    if not isinstance(sites, list) or not all(_is_site(s) for s in sites):
        raise ValueError(
            "ldmopt.patch_tuned: choice['sites'] must be a list of {'model': str, 'name': str, 'rules': [str], "
            "'kept': bool, 'why': str}"
        )
    keys = [(s["model"], s["name"]) for s in sites]
    if len(set(keys)) != len(keys):
        twice = sorted({_where(k) for k in keys if keys.count(k) > 1})
        raise ValueError(f"ldmopt.patch_tuned: choice['sites'] names {', '.join(twice[:5])} more than once")
    families = source.get("families")
    if families is not None and not (isinstance(families, list) and all(isinstance(f, str) for f in families)):
        raise ValueError(f"ldmopt.patch_tuned: choice['families']={families!r}; expected null or a list of strings")
    for flag in ("training", "filtered"):
        if not isinstance(source.get(flag, False), bool):
            raise ValueError(f"ldmopt.patch_tuned: choice[{flag!r}]={source[flag]!r}; expected true or false")
    measured = source.get("measured_on", {})
    if not isinstance(measured, dict) or not all(isinstance(measured.get(k, ""), str) for k in ("device", "dtype")):
        raise ValueError(
            f"ldmopt.patch_tuned: choice['measured_on']={measured!r}; expected an object such as "
            "{'device': 'NVIDIA H100 80GB HBM3', 'dtype': 'float16', 'torch': ..., 'date': ...} (from "
            "Tuning.choice())"
        )
    if not any(source.get("channels_last_weights") is v for v in (None, True, False)):  # 1 == True: not a flag
        raise ValueError(
            f"ldmopt.patch_tuned: choice['channels_last_weights']={source['channels_last_weights']!r}; expected "
            "null, true or false"
        )
    defaults = {"families": None, "training": False, "filtered": False, "channels_last_weights": None}
    return {**defaults, **source}


def _is_site(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("model"), str)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("rules"), list)
        and all(isinstance(r, str) for r in entry["rules"])
        and isinstance(entry.get("kept"), bool)
        and isinstance(entry.get("why", ""), str)
    )


def patch_tuned(
    pipe_or_model: Any,
    choice: Any,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    channels_last_weights: bool | None = None,
    training: bool | None = None,
) -> PatchReport:
    """Patch ``pipe_or_model`` where ``choice`` (what an earlier :func:`ldmopt.tune` kept) says, without measuring.

    Args:
        pipe_or_model: the model tuned, or an identical one (same architecture and ldmopt version: another process,
            another rank), unpatched.
        choice: ``report.tuning`` or the report of ``tune``, ``report.tuning.choice()``, or the path of the JSON
            that ``report.tuning.save(path)`` wrote.
        filter_fn: as for :func:`ldmopt.patch`: leaves chosen sites stock. A choice made by a tune call with a
            filter_fn needs the same filter_fn (it decided which sites there were).
        channels_last_weights: as for :func:`ldmopt.patch`; None: as tune patched. The choice's families are the
            ones tune patched with.
        training: None patches as tune did; True or False checks that the choice was made for that use (a choice
            timed on forward passes says nothing about a training step's backward) and raises PatchError if not.

    The model is patched at the kept sites, as the tuned one ended; the report lists every other site with the reason
    tune recorded. A choice made for a pipeline whose sites are all in one model applies to that model alone, and
    the reverse. Raises :class:`PatchError` when the model is already patched, or when this model's patch finds
    sites other than those of the choice (another model, or a version of ldmopt that patches it differently: tune
    it again); the model is then left unpatched.
    The choice says where it was measured (``choice['measured_on']``: the GPU, the parameters' dtypes, versions);
    on another GPU or at another precision other sites may pay, and a RuntimeWarning says so.
    """
    choice = load(choice)
    if is_patched(pipe_or_model):
        raise PatchError("ldmopt.patch_tuned: the model is already patched (ldmopt.unpatch first)")
    if training is not None and bool(training) != choice["training"]:
        made, asked = ("training", "inference") if choice["training"] else ("inference", "training")
        raise PatchError(
            f"ldmopt.patch_tuned: training={training!r}, but the choice was made for {made} (tune's training="
            f"{choice['training']}): tune for {asked} (ldmopt.tune(..., training={not choice['training']}))"
        )
    filtered = choice["filtered"]
    if filtered and filter_fn is None:
        raise PatchError(
            "ldmopt.patch_tuned: the choice was made by a tune call with a filter_fn, which decides the sites: pass "
            "the same filter_fn"
        )
    if channels_last_weights is None:
        channels_last_weights = choice["channels_last_weights"]
    options = dict(families=choice["families"], training=choice["training"])
    options["channels_last_weights"] = channels_last_weights
    # The sites are compared under the filter_fn tune ran with, else under none: a caller's filter then only leaves
    # chosen sites stock, listed as its exclusions (not as a mismatch).
    first = patch(pipe_or_model, filter_fn=filter_fn if filtered else None, **options)
    try:
        sites = patched_sites(pipe_or_model)
        wanted = _relabelled(choice["sites"], {s.key[0] for s in sites})
        found = {s.key: tuple(rule for rule, _ in s.rules) for s in sites}
        recorded = {(e["model"], e["name"]): tuple(e["rules"]) for e in wanted}
        if found != recorded:
            raise PatchError(f"ldmopt.patch_tuned: {_mismatch(found, recorded, _where)}")
        unpatch(pipe_or_model)
        kept = {(e["model"], e["name"]) for e in wanted if e["kept"]}
        why = {
            (e["model"], e["name"]): e.get("why") or "left stock by the tuning choice" for e in wanted if not e["kept"]
        }
        excluded: set = set()
        if filter_fn is not None and not filtered:  # the kept sites the caller's filter leaves stock (or a child of)
            patch(pipe_or_model, filter_fn=filter_fn, **options)
            excluded = kept - {s.key for s in patched_sites(pipe_or_model)}
            unpatch(pipe_or_model)
            kept -= excluded
            why.update(dict.fromkeys(excluded, "excluded by filter_fn (the tuning choice kept it)"))
        read_touched(sites)
        report = patch(pipe_or_model, filter_fn=_keeping(sites, kept, filter_fn), **options) if kept else first
        report = _final_report(report, first, sites, kept, why)
        _warn_if_measured_elsewhere(choice, pipe_or_model)
    except BaseException:
        if is_patched(pipe_or_model):
            unpatch(pipe_or_model)
        raise
    report.skipped = [
        dataclasses.replace(s, by_user=True) if (s.model, s.name) in excluded else s for s in report.skipped
    ]
    return report


def _warn_if_measured_elsewhere(choice: dict, pipe_or_model: Any) -> None:
    """A choice measured on another kind of device may keep the wrong sites: said, not refused (the same decision on
    every rank or replica is often what matters most)."""
    from .tune import _cuda_devices

    then = choice.get("measured_on", {}).get("device")
    now = device_names(_cuda_devices(pipe_or_model))
    # Only GPU against GPU: a model offloaded to the CPU (or not yet moved) says "cpu" here, and a tune by rule of
    # an offloaded model recorded "cpu" for work that ran on a GPU.
    if then and "cpu" not in (then, now) and now != then:
        warnings.warn(
            f"ldmopt.patch_tuned: the choice was measured on {then}; this model is on {now}, where other fused "
            "modules may pay (ldmopt.tune measures here)",
            RuntimeWarning,
            stacklevel=3,
        )
    # Another precision moves twice or half the bytes, and fp32 runs other GEMM paths (TF32 or not): other sites may
    # pay. Choices saved before the dtype was recorded say nothing.
    then_dtype, now_dtype = choice.get("measured_on", {}).get("dtype"), parameter_dtypes(pipe_or_model)
    if then_dtype and now_dtype and then_dtype != now_dtype:
        warnings.warn(
            f"ldmopt.patch_tuned: the choice was measured with {then_dtype} parameters; this model's are "
            f"{now_dtype}, where other fused modules may pay (ldmopt.tune measures here)",
            RuntimeWarning,
            stacklevel=3,
        )


def _relabelled(entries: list[dict], labels: set[str]) -> list[dict]:
    """The choice's sites, with its one model's label replaced by the target's when both have sites in one model
    only (a choice made on ``pipe`` applied to ``pipe.unet`` or the reverse)."""
    chosen = {e["model"] for e in entries}
    if len(chosen) == 1 and len(labels) == 1 and chosen != labels:
        (label,) = labels
        return [{**e, "model": label} for e in entries]
    return entries


def _mismatch(found: dict, recorded: dict, where: Callable) -> str:
    def listed(keys: set, limit: int = 5) -> str:
        names = sorted(where(k) for k in keys)
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more

    parts = []
    if missing := set(recorded) - set(found):
        parts.append(f"the choice names {len(missing)} site(s) this model's patch does not find ({listed(missing)})")
    if extra := set(found) - set(recorded):
        parts.append(f"this model's patch finds {len(extra)} site(s) the choice does not name ({listed(extra)})")
    if changed := {k for k in set(found) & set(recorded) if found[k] != recorded[k]}:
        parts.append(f"{len(changed)} site(s) have other rules now ({listed(changed)})")
    return (
        "; ".join(parts) + ". The choice was made for another model, or another version of ldmopt patches this one "
        "differently: tune it again (ldmopt.tune)"
    )
