"""What a patch rule is, and the helpers rules share to edit module instances reversibly.

A rule is about one kind of diffusers module (its ``targets``, keyed by class in the table): ``match`` says whether
an instance has the structure the fused path reproduces exactly, ``reasons`` why a matching instance must stay on the
stock path anyway, ``touched`` which submodules the fused path bypasses or replaces (the generic guards in
``core.py`` check those for hooks, PEFT/LoRA and quantized weights), ``replace`` edits the instance and returns what
``restore`` needs to put back the very same objects.

Two ways of editing, both keeping the parameter objects (no copies) and the state_dict keys:
- class swap (:class:`ClassSwapRule`): the instance's ``__class__`` becomes a subclass of its own class (from
  :func:`fused_class`) whose ``forward`` runs fused ops and whose ``extra_repr`` says so; hooks, parameters and
  identity stay;
- child swap: a child is replaced by an ldmopt module built with ``from_module`` (sharing the Parameter objects),
  and a child whose work moved into its neighbour by :class:`FusedAway`, which has no state; ``restore_child``
  puts the original back and keeps what was done to the replacement meanwhile (a LoRA loaded after patching).

Children can change after patching (LoRA adapters, offload hooks): a fused path that reads a child's weights instead
of calling it checks the child on every call (ldmopt.nn.child_check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

#: Kernel families a user can select with ``patch(..., families={...})``.
FAMILIES = ("group_norm", "gn_conv", "feed_forward", "adaln", "temporal_layout", "temporal_attention", "svd_attn2")


@dataclass
class Site:
    """One module a rule may patch: its qualified name, the module, and where it hangs (parent, attribute)."""

    name: str
    module: nn.Module
    parent: nn.Module | None
    attr: str | None
    training: bool = False
    #: What the rules' ``prepare`` computed once for the whole model being walked (keyed by rule name).
    context: dict = field(default_factory=dict)


class Rule:
    """Base class of every rule. Subclasses set the class attributes and override the methods they need."""

    name: ClassVar[str]
    family: ClassVar[str]
    #: What the fused path does, for the report and repr.
    description: ClassVar[str]

    def targets(self) -> tuple[type, ...]:
        """The module classes this rule is keyed by (exact classes; diffusers imported here, lazily)."""
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> Any:
        """Computed once per walked model before matching (e.g. which modules are temporal); ``site.context[name]``."""
        return None

    def match(self, site: Site) -> bool:
        """True when the instance is one this rule knows how to fuse (not yet patched)."""
        return True

    def reasons(self, site: Site) -> list[str]:
        """Why this matching instance must stay on the stock path (rule-specific; generic guards are in core)."""
        return []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        """Modules (relative name -> module) whose own forward no longer runs, or that are replaced: ``""`` for the
        instance itself when its forward or identity changes (its children are then listed only if bypassed).
        The guards check a listed child with everything under it; a rule touching a module another rule has
        claimed is passed over."""
        return {}

    def shallow(self, site: Site) -> set[str]:
        """Names in :meth:`touched` whose children still run (checked without them); ``""`` by default."""
        return {""}

    def replace(self, site: Site) -> Any:
        """Edit the instance; return what :meth:`restore` needs."""
        raise NotImplementedError

    def restore(self, site: Site, data: Any) -> None:
        """Undo :meth:`replace` exactly (same objects back in place)."""
        raise NotImplementedError

    def counters(self, data: Any) -> list:
        """Objects :meth:`replace` installed that count per-call fall-backs in ``fallback_reasons`` (the report
        reads them)."""
        return []


def diffusers_classes(*paths: str) -> tuple[type, ...]:
    """The classes ``"module:Class"`` (module relative to ``diffusers.models``) that this diffusers has; a class it
    predates is left out, so a rule keyed by it simply matches nothing there."""
    import importlib

    found = []
    for path in paths:
        module, name = path.split(":")
        try:
            found.append(getattr(importlib.import_module(f"diffusers.models.{module}"), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


# ------------------------------------------------------------------------------------------------ class swap

_FUSED_CLASSES: dict[tuple, type] = {}


def fused_class(base: type, forward: Callable | dict[str, Callable], label: str) -> type:
    """A subclass of ``base`` whose ``forward`` (or the methods in a dict) are replaced, cached per (base, methods);
    repr gains ``ldmopt=<label>``.

    The subclass keeps ``base``'s name so code that reads ``type(m).__name__`` (accelerate's no-split lists,
    diffusers' casting rules) sees the same module.
    """
    methods = forward if isinstance(forward, dict) else {"forward": forward}
    key = (base, *sorted(methods.items(), key=lambda kv: kv[0]))
    cls = _FUSED_CLASSES.get(key)
    if cls is None:

        def extra_repr(self) -> str:
            inner = base.extra_repr(self)
            return f"{inner}, ldmopt={label!r}" if inner else f"ldmopt={label!r}"

        def __reduce_ex__(self, protocol):
            # The class is made at run time: pickle (torch.save, deepcopy) rebuilds it from (base, methods, label).
            return _rebuild_fused, (base, methods, label), self.__dict__

        cls = type(
            base.__name__,
            (base,),
            {
                **methods,
                "extra_repr": extra_repr,
                "__reduce_ex__": __reduce_ex__,
                "_ldmopt_base": base,
                "_ldmopt_label": label,
                "__module__": __name__,
                "__qualname__": f"fused[{base.__qualname__}]",
                "__doc__": f"{base.__name__} patched by ldmopt: {label}.",
            },
        )
        _FUSED_CLASSES[key] = cls
    return cls


def _rebuild_fused(base: type, methods: dict[str, Callable], label: str) -> nn.Module:
    cls = fused_class(base, methods, label)
    return cls.__new__(cls)


def swap_class(module: nn.Module, cls: type) -> type:
    """Point ``module`` at ``cls``; returns the class it had."""
    old = type(module)
    module.__class__ = cls
    return old


class ClassSwapRule(Rule):
    """A rule that edits by class swap: :meth:`methods` gives the fused ``forward`` (or a dict of methods)."""

    def methods(self, site: Site) -> Callable | dict[str, Callable]:
        raise NotImplementedError

    def replace(self, site: Site) -> Any:
        return swap_class(site.module, fused_class(type(site.module), self.methods(site), self.description))

    def restore(self, site: Site, data: Any) -> None:
        swap_class(site.module, data)


# ------------------------------------------------------------------------------------------------ child swap


class FusedAway(nn.Identity):
    """Stands where a module whose work moved into a neighbour was (e.g. a SiLU now applied inside a GroupNorm).

    ``stock`` and ``home=(parent, attr, fused)``: while ``parent.<attr>`` is no longer ``fused`` (a LoRA layer now
    wraps it, and ``fused`` then skips the moved work), the moved work is done here by ``stock``. Neither is a child,
    so ``state_dict`` and ``modules()`` are those of a plain identity.
    """

    def __init__(self, into: str, stock: nn.Module | None = None, home: tuple | None = None) -> None:
        super().__init__()
        self.into = into
        self.__dict__["_ldmopt_stock"] = stock
        self.__dict__["_ldmopt_home"] = home

    def forward(self, x):
        home = self.__dict__.get("_ldmopt_home")
        if home is None or home[0]._modules.get(home[1]) is home[2]:
            return x
        return self._ldmopt_stock(x)

    def extra_repr(self) -> str:
        return f"fused into {self.into} by ldmopt"


def set_child(parent: nn.Module, attr: str, child: nn.Module) -> nn.Module:
    """Replace ``parent.<attr>`` by ``child``; returns the old child."""
    old = parent._modules[attr]
    parent._modules[attr] = child
    return old


def restore_child(parent: nn.Module, attr: str, original: nn.Module, fused: nn.Module) -> None:
    """Put ``original`` back where ``fused`` was installed, keeping what changed while patched: children, parameters
    and buffers of ``fused`` replaced since (a LoRA layer around its projection) move into ``original``, and a
    wrapper installed around ``fused`` (PEFT wraps the very layer a LoRA targets) stays, wrapping ``original``. A
    module put in ``fused``'s place by someone else is left there."""
    for registry in ("_modules", "_parameters", "_buffers"):
        mine, theirs = getattr(fused, registry), getattr(original, registry)
        for name, value in mine.items():
            if name in theirs and theirs[name] is not value:
                theirs[name] = value
    current = parent._modules.get(attr)
    if current is fused:
        parent._modules[attr] = original
        return
    for holder in current.modules() if isinstance(current, nn.Module) else ():
        for name, child in holder._modules.items():
            if child is fused:
                holder._modules[name] = original
                return
