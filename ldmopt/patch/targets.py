"""What ``patch`` / ``unpatch`` walk: the torch models of a diffusers pipeline (or one model), refusing compiled and
FSDP-sharded ones for a patch, and the models a pipeline's patches reached that it no longer holds."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn


class PatchError(RuntimeError):
    """``patch`` or ``unpatch`` refused the whole call (a compiled or FSDP-sharded model, ``strict=True`` with
    modules it would skip, hooks attached to ldmopt's modules)."""


#: pipeline -> (component name, weak ref to the model) for each model a patch of that pipeline changed, so that
#: ``unpatch(pipe)`` also reaches one the pipeline no longer holds (``pipe.unet = other_unet`` after the patch).
#: Kept here, not on the pipeline: weak refs do not pickle.
_PATCHED_VIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_compiled_wrapper(m: Any) -> bool:
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    return optimized is not None and isinstance(m, optimized.OptimizedModule)


def fsdp_sharding(model: nn.Module) -> tuple[str, str] | None:
    """(where, "FullyShardedDataParallel" or "fully_shard") when FSDP already manages parameters of ``model``, else
    None. FSDP1 is seen by its wrappers or by the parameters it flattened (``model`` may be the module inside one)."""
    if "torch.distributed.fsdp" not in sys.modules:  # never import torch.distributed here
        return None
    fsdp = sys.modules["torch.distributed.fsdp"]
    fsdp1, fsdp2 = getattr(fsdp, "FullyShardedDataParallel", ()), getattr(fsdp, "FSDPModule", ())
    for name, module in model.named_modules():
        if isinstance(module, fsdp1) or any(getattr(p, "_fsdp_flattened", False) for p in module._parameters.values()):
            return name, "FullyShardedDataParallel"
        if isinstance(module, fsdp2):
            return name, "fully_shard"
    return None


def models_of(obj: Any, *, for_patch: bool) -> list[tuple[str, nn.Module]]:
    """(component name, model) of each torch model of a pipeline's ``components`` (or ``("", obj)`` for a model),
    a compiled wrapper's model in its place; each model once. ``for_patch``: refuse compiled and sharded models."""
    if isinstance(obj, nn.Module):
        models = [("", obj)]
    elif isinstance(getattr(obj, "components", None), dict):
        models = [(k, v) for k, v in obj.components.items() if isinstance(v, nn.Module)]
    else:
        raise TypeError(f"ldmopt.patch: expected a diffusers pipeline or a torch.nn.Module, got {type(obj).__name__}")
    out = []
    for name, model in models:
        label = name or type(model).__name__
        if is_compiled_wrapper(model):
            if for_patch:
                raise PatchError(
                    f"ldmopt.patch: {label} is already compiled (torch.compile returned an OptimizedModule); patch "
                    "first, then compile: `ldmopt.patch(model); model = torch.compile(model)`"
                )
            model = model._orig_mod
        elif for_patch:
            for sub_name, sub in model.named_modules():
                if is_compiled_wrapper(sub) or sub.__dict__.get("_compiled_call_impl") is not None:
                    where = f"{label}.{sub_name}" if sub_name else label
                    raise PatchError(
                        f"ldmopt.patch: {where} is already compiled (torch.compile / Module.compile); patch first, "
                        "then compile"
                    )
            sharded = fsdp_sharding(model)
            if sharded is not None:  # its fused modules would read parameters FSDP flattened, sharded or freed
                where = ".".join(p for p in (label, sharded[0]) if p)
                raise PatchError(
                    f"ldmopt.patch: {where} is already sharded by FSDP ({sharded[1]}); patch the model before wrapping "
                    f"it: `ldmopt.patch(model, training=True)`, then {sharded[1]}"
                )
        if all(model is not seen for _, seen in out):  # one model under two component names is walked once
            out.append((name, model))
    return out


def _patched_via(pipe: Any, *, create: bool = False) -> list[tuple[str, weakref.ref]] | None:
    """The models patches of ``pipe`` changed (``create``: an entry for it when there is none yet)."""
    if isinstance(pipe, nn.Module):
        return None
    try:
        return _PATCHED_VIA.setdefault(pipe, []) if create else _PATCHED_VIA.get(pipe)
    except TypeError:  # a pipeline-like object that is unhashable or takes no weak reference: its components only
        return None


def remember_patched(pipe: Any, models: list[tuple[str, nn.Module]]) -> None:
    """Note the models a patch of ``pipe`` changed (nothing for a model: unpatch reaches all of its own tree)."""
    refs = _patched_via(pipe, create=True) if models else None
    if refs is None:
        return
    known = {id(ref()) for _, ref in refs}
    refs.extend((name, weakref.ref(model)) for name, model in models if id(model) not in known)


def former_components(pipe: Any, current: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The models earlier patches of ``pipe`` changed that are not among its ``current`` models any more."""
    refs = _patched_via(pipe)
    if not refs:
        return []
    present = {id(model) for _, model in current}
    former = [(name, ref()) for name, ref in refs]
    return [(name, model) for name, model in former if model is not None and id(model) not in present]


def forget_patched(pipe: Any) -> None:
    """After ``unpatch(pipe)``: its patches are undone, wherever their models went."""
    if _patched_via(pipe) is not None:
        del _PATCHED_VIA[pipe]
