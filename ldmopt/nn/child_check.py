"""Per-call check of a child module that a fused path reads instead of calling.

``ldmopt.patch`` checks every child when it patches, but children can change afterwards: diffusers and PEFT wrap the
projections a LoRA targets (``pipe.load_lora_weights`` on a patched pipeline), accelerate adds offload hooks,
quantizers swap layers or weights. A fused path that kept reading such a child's ``weight`` would drop the LoRA
update or skip the hook without a word, so each one asks :func:`readable` on every call (type checks and three dict
lookups) and otherwise computes the stock composition through the child's own forward, counting why in
``fallback_reasons`` (``PatchReport.fallbacks()`` lists them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _module

from ..ops._dispatch import count_bounded

#: "<where> ran the stock path: <why>" -> calls in this process.
fallback_reasons: Counter[str] = Counter()

#: Weight types a fused kernel may read (a tensor subclass, e.g. a quantized weight, needs the module's own ops).
#: FakeTensor: what a plain parameter is while torch.export traces non-strict (a faked subclass keeps its own type).
PLAIN_WEIGHTS = (nn.Parameter, torch.Tensor, type(None), FakeTensor)


def observer(hook: Callable) -> Callable:
    """Mark a module hook as one of ldmopt's own observers (the profiler's scope hooks): it only watches, so a fused
    path that bypasses the module may ignore it, and profiling a patched model measures the fused path."""
    hook._ldmopt_observer = True
    return hook


class observed:  # lower case: used like a function, in a with statement
    """Runs ``module``'s observer hooks (the profiler's scopes) around work a fused path does in place of calling it,
    with the arguments the module would have been called with, so that a profile attributes that work to the
    module (an attention's kind, its record_function scope). Nothing when no observer is attached."""

    def __init__(self, module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs or {}

    def __enter__(self) -> None:
        for hook_id, hook in self.module._forward_pre_hooks.items():
            if getattr(hook, "_ldmopt_observer", False):
                if self.module._forward_pre_hooks_with_kwargs.get(hook_id):
                    hook(self.module, self.args, self.kwargs)
                else:
                    hook(self.module, self.args)

    def __exit__(self, *exc) -> None:
        for hook_id, hook in self.module._forward_hooks.items():
            if getattr(hook, "_ldmopt_observer", False):
                if self.module._forward_hooks_with_kwargs.get(hook_id):
                    hook(self.module, self.args, self.kwargs, None)
                else:
                    hook(self.module, self.args, None)


def _foreign(hooks: dict) -> bool:
    return any(not getattr(h, "_ldmopt_observer", False) for h in hooks.values())


_GLOBAL_HOOK_REGISTRIES = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def global_hook_registries() -> list[str]:
    """The names of torch's global module hook registries that hold hooks (``register_module_forward_hook`` ...):
    they run around every module call, so around the stock modules a fused path would not call."""
    return [name for name in _GLOBAL_HOOK_REGISTRIES if getattr(_module, name, None)]


def inert_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` on the instance is only its class's own forward bound to it: what accelerate's
    ``remove_hook_from_module`` and diffusers' ``HookRegistry.remove_hook`` leave behind. Calling it is calling the
    class's forward, so it is no hook."""
    f = module.__dict__.get("forward")
    return (
        f is not None
        and getattr(f, "__self__", None) is module
        and getattr(f, "__func__", None) is getattr(type(module), "forward", None)
    )


def wrapped_forward(module: nn.Module) -> bool:
    """Whether a forward set on the instance replaces its class's (a hook wrapper); an inert one does not."""
    return "forward" in module.__dict__ and not inert_forward(module)


def drop_inert_forward(module: nn.Module) -> None:
    """Removes an inert instance forward: before a class swap, where it would pin the old class's forward, and
    before the swap back, where it would keep calling the fused class's."""
    if inert_forward(module):
        del module.__dict__["forward"]


def _live_diffusers_registry(module: nn.Module):
    """A diffusers HookRegistry on ``module`` still holding hooks (an emptied one stays on the module), or None."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry if registry is not None and getattr(registry, "hooks", True) else None


def foreign_hook_registry(module: nn.Module) -> bool:
    """accelerate's ``_hf_hook`` (deleted with the hook) or a diffusers HookRegistry still holding hooks."""
    return hasattr(module, "_hf_hook") or _live_diffusers_registry(module) is not None


def instance_forward_owner(module: nn.Module) -> str:
    """Who replaced or wraps ``module``'s forward, for a skip reason: accelerate, a diffusers hook registry, or the
    wrapper's own module and name (ldmopt's ``install_temporal_blocks``, a user's function)."""
    if hasattr(module, "_hf_hook"):
        return f"an accelerate hook ({type(module._hf_hook).__name__})"
    registry = _live_diffusers_registry(module)
    if registry is not None:
        return f"a diffusers hook registry ({', '.join(map(str, getattr(registry, 'hooks', ()))) or 'hooks'})"
    wrapper = module.__dict__.get("forward")
    target = getattr(wrapper, "__func__", wrapper)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    owner = getattr(target, "__module__", None) or type(target).__module__
    return f"{owner}.{name}"


def _module_hooks(module: nn.Module) -> bool:
    """Forward or backward (pre-)hooks registered on ``module`` (but ldmopt's own observers)."""
    return (
        (bool(module._forward_hooks) and _foreign(module._forward_hooks))
        or (bool(module._forward_pre_hooks) and _foreign(module._forward_pre_hooks))
        or bool(module._backward_hooks or module._backward_pre_hooks)
    )


def attached_hooks(module: nn.Module) -> bool:
    """Whether something is attached to ``module`` itself: forward or backward (pre-)hooks (but ldmopt's own
    observers), or a forward replaced on the instance (accelerate's offload and diffusers' hooks wrap
    ``module.forward``). What unpatch would drop with the module."""
    return _module_hooks(module) or wrapped_forward(module)


_LAYERWISE_CASTING_HOOK = "diffusers.hooks.layerwise_casting.LayerwiseCastingHook"


def layerwise_casting_hooks(module: nn.Module) -> list | None:
    """diffusers' layerwise-casting hooks (``enable_layerwise_casting``) on ``module``, when they are all that is
    attached to it and its instance forward is their wrappers around the class's forward; else None. They keep no
    state but their dtypes, so the same hooks can be attached to another module sharing ``module``'s parameters."""
    registry = _live_diffusers_registry(module)
    names = getattr(registry, "_hook_order", None) if registry is not None else None
    if not names or _module_hooks(module):
        return None
    hooks = [registry.hooks.get(name) for name in names]
    if any(f"{type(h).__module__}.{type(h).__name__}" != _LAYERWISE_CASTING_HOOK for h in hooks):
        return None
    forward = module.__dict__.get("forward")
    for _ in hooks:  # each registered hook wrapped the forward before it (functools.update_wrapper's __wrapped__)
        forward = getattr(forward, "__wrapped__", None)
    bound_to_module = getattr(forward, "__self__", None) is module
    if not bound_to_module or getattr(forward, "__func__", None) is not type(module).forward:
        return None
    return hooks


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's forward: :func:`attached_hooks`, or global module hooks
    (which a fused path that does not call the module would skip too)."""
    # Asked for every child a fused forward reads, on every call: the common case (no hook anywhere, no instance
    # forward) answers from the dicts themselves, without the helpers' calls.
    if (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    ):
        return attached_hooks(module) or bool(global_hook_registries())
    return False


def function_mode_reason() -> str | None:
    """Why an attention kernel must not stand in for ``F.scaled_dot_product_attention`` now: a torch function mode
    from outside torch is active (diffusers' attention-score skip of PAG and SkipLayerGuidance replaces SDPA's result
    this way), which would not see the call the kernel replaces. torch's own modes (torch.device, export) and
    ldmopt's (the profiler's attention regions) only watch."""
    for mode in torch.overrides._get_current_function_mode_stack():
        if type(mode).__module__.partition(".")[0] not in ("torch", "ldmopt"):
            return f"torch function mode {type(mode).__name__} active (it may intercept the attention call)"
    return None


def transform_reason() -> str | None:
    """Why a fused forward must run the stock one now: a torch.func transform (vmap, grad, jvp) is active. vmap
    cannot query the layouts the fused paths choose by, and the ops would run their reference compositions there
    anyway, so the stock forward is exact and no slower."""
    return "under a torch.func transform (vmap, grad, jvp ...)" if torch._C._are_functorch_transforms_active() else None


def dropout_reason(layer: object) -> str | None:
    """Why ``layer``, where a dropout sits, may change its input (None when it is the identity now): it is not a plain
    nn.Dropout (a Monte-Carlo dropout subclass may sample in eval mode too), or its own training flag is set with
    p > 0, as nn.Dropout reads it (Monte-Carlo dropout also trains the layers alone in an eval model)."""
    if type(layer) is not nn.Dropout:
        return f"of class {type(layer).__name__}, not nn.Dropout"
    if layer.training and layer.p > 0:
        return f"p={layer.p} in training mode"
    return None


def plain_weight(module: nn.Module, name: str = "weight") -> bool:
    """Whether the parameter ``name`` is a plain tensor (or absent), not a tensor subclass."""
    return type(module._parameters.get(name)) in PLAIN_WEIGHTS


def readable(layer: object, *kinds: type) -> bool:
    """Whether a fused path may read ``layer``'s parameters in place of calling it: exactly one of ``kinds``
    (default nn.Linear; a LoRA or quantized layer is another class), not :func:`hooked`, and a plain weight tensor
    (torchao-style quantization keeps the class and swaps the weight for a tensor subclass)."""
    if type(layer) not in (kinds or (nn.Linear,)):
        return False
    return not hooked(layer) and plain_weight(layer)


def hooked_children(children: dict[str, nn.Module | None], *, deep: bool) -> list[str]:
    """The names of ``children`` (modules a fused path computes itself instead of calling; None for absent ones)
    that are :func:`hooked`; ``deep`` also looks inside each one (for children whose whole subtree the fused path
    replaces, e.g. an Upsample2D and its conv)."""
    names = []
    for name, child in children.items():
        if isinstance(child, nn.Module) and any(hooked(m) for m in (child.modules() if deep else (child,))):
            names.append(name)
    return names


def bypassed_hook_reason(name: str, *, deep: bool = False) -> str:
    """The report's words for a hooked child named by :func:`hooked_children`."""
    inside = " (or a module in it)" if deep else ""
    return f"{name}{inside} has hooks (forward, backward or global) or a wrapped forward the fused path would bypass"


def qualified_name(cls: type) -> str:
    """``module.Class`` (builtins without their module)."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def unreadable_reason(name: str, layer: object) -> str:
    """Why :func:`readable` refused ``layer`` (for the report)."""
    if isinstance(layer, nn.Module):
        if hooked(layer):
            return (
                f"{name} has hooks (forward, backward or global) or a wrapped forward (accelerate/diffusers hooks) "
                "the fused path would bypass"
            )
        if not plain_weight(layer):
            return f"{name}.weight is a {qualified_name(type(layer.weight))} (a quantized tensor?), not a plain tensor"
    kind = qualified_name(type(layer))
    if type(layer).__module__.split(".")[0] == "ldmopt":
        # A narrower family patched first (families=["group_norm"], then the rest): its module is not the plain one.
        return (
            f"{name} is a {kind}, from an earlier ldmopt.patch call; unpatch, then patch once with every family "
            "wanted, to fuse it here"
        )
    return f"{name} is a {kind} (a LoRA/PEFT or quantized layer?), not the plain torch layer the fused path reads"


def counting() -> bool:
    """Whether per-call counters update: in eager calls only. A compiled call does not count: Dynamo cannot replay
    a Python side effect inside a gradient-checkpointed region, and a fullgraph compile would fail there."""
    return not torch.compiler.is_compiling()


def tally(counter: Counter, key: object) -> None:
    """``count_bounded(counter, key)`` when :func:`counting`."""
    if counting():
        count_bounded(counter, key)


def count_reason(where: str, reason: str) -> None:
    tally(fallback_reasons, f"{where} ran the stock path: {reason}")


def count_stock(where: str, name: str, layer: object) -> None:
    count_reason(where, unreadable_reason(name, layer))


def stock_class(module: nn.Module) -> type:
    """The module's own class, past the patcher's class swaps (``fused_class`` gives its subclasses ``_ldmopt_base``).
    Attribute lookups only, no walk over ``__mro__``: torch.compile(fullgraph=True) traces this in fused forwards."""
    cls = type(module)
    for _ in range(4):  # a swap of a swap at most in practice; bounded so that tracing unrolls it
        base = getattr(cls, "_ldmopt_base", None)
        if base is None or base is cls:
            break
        cls = base
    return cls


def stock(module: nn.Module, name: str = "forward") -> Callable:
    """The stock method ``name`` of ``module``, bound to it: the base class's for a class-swapped module, through
    ``super()`` (diffusers marks its blocks allow_in_graph, and torch.compile(fullgraph=True) cannot read a method off
    such a class object), else the class's own (a module with an instance-level forward installed)."""
    cls = type(module)
    if "_ldmopt_base" in cls.__dict__:
        return getattr(super(cls, module), name)
    return getattr(cls, name).__get__(module, cls)
