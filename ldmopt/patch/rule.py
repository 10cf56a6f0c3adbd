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
- child swap (:class:`ChildSwapRule`): a child is replaced by an ldmopt module built with ``from_module`` (sharing
  the Parameter objects), and a child whose work moved into its neighbour by :class:`FusedAway`; ``restore_child``
  puts the original back and keeps what was done to the replacement meanwhile (a LoRA loaded after patching).

Children can change after patching (LoRA adapters, offload hooks): a fused path that reads a child's weights instead
of calling it checks the child on every call (ldmopt.nn.child_check).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from ..nn.child_check import (
    attached_hooks,
    count_reason,
    drop_inert_forward,
    hooked,
    layerwise_casting_hooks,
    qualified_name,
    stock,
    transform_reason,
    unreadable_reason,
    wrapped_forward,
)

#: Kernel families a user can select with ``patch(..., families={...})``.
FAMILIES = (
    "group_norm",
    "gn_conv",
    "feed_forward",
    "adaln",
    "residual",
    "rms_norm",
    "temporal_layout",
    "temporal_attention",
    "svd_attn2",
)


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
    #: False for a model-level edit that goes with others and fuses nothing (not counted as a patched module).
    counted: ClassVar[bool] = True

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

    def claims(self, site: Site) -> dict[str, nn.Module]:
        """Children the fused forward reads in place of calling them where it can (checking them per call, and
        calling them otherwise), kept from other rules, which would replace them with something it does not read.
        Unlike :meth:`touched`, they are no condition of the rule: a hook on one costs only that per-call fusion, and
        ``filter_fn`` is not asked about them (it decides for the module the rule patches); one another rule already
        took is left to it."""
        return {}

    def shallow(self, site: Site) -> set[str]:
        """Names in :meth:`touched` whose children still run (checked without them); ``""`` by default."""
        return {""}

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        """Children outside :meth:`touched` whose weights the fused forward reads in place of calling them while they
        are plain layers (ldmopt.nn.child_check.readable, asked per call; otherwise that part runs stock: a norm is
        computed, an attention or a residual add runs as diffusers' does). No condition of the rule: one that is a
        LoRA/PEFT, quantized or hooked layer at patch time costs only that part, and the report names it
        (``PatchReport.partly_stock``)."""
        return {}

    def stock_part_reasons(self, site: Site) -> list[str]:
        """Parts of the fused path that will run stock on every call for a reason other than a child read in place,
        known now (an attention whose processor the fused path does not mirror): no condition of the rule either,
        and named with :meth:`read_in_place`'s in ``PatchReport.partly_stock``."""
        return []

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

    def installed(self, data: Any) -> list[nn.Module]:
        """Modules :meth:`replace` put into the tree (besides the touched ones): claimed for the model like them."""
        return []

    def changed_since_patch(self, site: Site, data: Any) -> list[str]:
        """What was attached while patched to what :meth:`restore` takes out again, and would be lost with it (unpatch
        refuses then): hooks, a forward wrapped on the instance, a parametrization (which changes the class)."""
        return []

    def stand_ins(self, data: Any) -> list[tuple[Any, Any]]:
        """(installed object, what it stood in for) pairs that a model may have saved copies of while patched
        (diffusers' ``original_attn_processors``): unpatch puts the originals there too."""
        return []


def diffusers_classes(*paths: str) -> tuple[type, ...]:
    """The classes ``"module:Class"`` (module relative to ``diffusers.models``) that this diffusers has; a class it
    predates is left out, so a rule keyed by it simply matches nothing there."""
    found = []
    for path in paths:
        module, name = path.split(":")
        try:
            found.append(getattr(importlib.import_module(f"diffusers.models.{module}"), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def attention_reads(attn: nn.Module | None, name: str, normed: str | None) -> dict[str, nn.Module]:
    """What a fused block path reads of ``attn`` in place (:meth:`Rule.read_in_place`; ldmopt.nn.attention_residual,
    temporal_attention): ``to_out.0``, whose epilogue adds the residual, and the projections that read the block's
    norm in their loads: ``normed`` "self" (to_q, to_k, to_v, or to_qkv once fused), "cross" (to_q), None (none)."""
    if attn is None:
        return {}
    out = {}
    processor = type(getattr(attn, "processor", None)).__name__
    fused = getattr(attn, "fused_projections", False) and processor == "FusedAttnProcessor2_0"
    if normed == "self":
        names = ("to_qkv",) if fused and getattr(attn, "to_qkv", None) is not None else ("to_q", "to_k", "to_v")
        out.update({f"{name}.{p}": getattr(attn, p, None) for p in names})
    elif normed == "cross":
        out[f"{name}.to_q"] = getattr(attn, "to_q", None)
    to_out = getattr(attn, "to_out", None)
    if isinstance(to_out, nn.ModuleList) and len(to_out):
        out[f"{name}.to_out.0"] = to_out[0]
    return {k: v for k, v in out.items() if isinstance(v, nn.Module)}


def feed_forward_reads(ff: nn.Module, name: str = "ff") -> dict[str, nn.Module]:
    """What a fused block path reads of a diffusers FeedForward ``[act, dropout, Linear]`` in place: the activation's
    projection (the norm before it read in its loads) and ``net.2`` (the residual in its epilogue)."""
    net = getattr(ff, "net", None)
    if not isinstance(net, nn.ModuleList) or len(net) != 3:
        return {}  # another feed-forward runs as a module whatever its layers are
    out = {f"{name}.net.0.proj": getattr(net[0], "proj", None), f"{name}.net.2": net[2]}
    return {k: v for k, v in out.items() if isinstance(v, nn.Module)}


@functools.cache
def diffusers_at_least(version: str) -> bool:
    """Whether the installed diffusers is ``version`` or newer (release numbers only: 0.39.0.dev0 counts as 0.39.0),
    for the few places where a stock processor's behaviour changed between releases."""
    import diffusers

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])

    return release(diffusers.__version__) >= release(version)


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
        guarded = {name: _guarded(base, name, fn) for name, fn in methods.items()}

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
                **guarded,
                "extra_repr": extra_repr,
                "__reduce_ex__": __reduce_ex__,
                "_ldmopt_base": base,
                "_ldmopt_label": label,
                "__module__": __name__,
                "__qualname__": f"fused[{base.__qualname__}]",
                "__doc__": f"{base.__name__} patched by ldmopt: {label}.",
            },
        )
        made, cls = cls, _FUSED_CLASSES.setdefault(key, cls)  # one class per key, also if two threads get here
        if cls is made:
            _mirror_block_registry(base, cls)
    return cls


def _mirror_block_registry(base: type, cls: type) -> None:
    """Register ``cls`` wherever diffusers registered ``base`` as a transformer block: its block-level hooks
    (FirstBlockCache, MagCache, layer skip, SkipLayerGuidance) look blocks up by exact class."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:
        return
    try:
        metadata = TransformerBlockRegistry.get(base)
    except Exception:  # not a registered block (ValueError), or a diffusers whose registry cannot load
        return
    TransformerBlockRegistry.register(cls, copy.copy(metadata))


def _guarded(base: type, name: str, fn: Callable) -> Callable:
    """``fn``, or ``base``'s own method under a torch.func transform or while a child the fused path bypasses changed
    since patching (see :meth:`ClassSwapRule.guarded`)."""

    def method(self, *args, **kwargs):
        why = transform_reason() or changed_guard_reason(self)
        if why is not None:
            count_reason(type(self).__name__, why)
            return stock(self, name)(*args, **kwargs)
        return fn(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = fn.__doc__
    # The base method's signature: diffusers' hooks read arguments by name through it (TransformerBlockMetadata).
    method.__signature__ = inspect.signature(getattr(base, name))
    return method


def _same_stock_class(now: type, then: type) -> bool:
    """``now is then``, or one is ldmopt's class swap of the other (another rule of the same patch swapped it)."""
    return now is then or now.__dict__.get("_ldmopt_base") is then or then.__dict__.get("_ldmopt_base") is now


def changed_guard_reason(module: nn.Module) -> str | None:
    """Why a child that ``module``'s fused methods bypass (see :meth:`ClassSwapRule.guarded`) no longer is what they
    stand in for: replaced, hooked, or of another class than at patch time (a quantizer's class swap, e.g.
    ModelOpt's QuantLayerNorm, which quantizes the norm's input); None while all are unchanged."""
    for parent, attr, child, where, cls in module.__dict__.get("_ldmopt_guards", ()):
        now = parent._modules.get(attr)
        if now is not child:
            return f"{where} was replaced after patch"
        if not _same_stock_class(type(now), cls):
            return f"{where} became a {qualified_name(type(now))} after patch (a quantizer's or a parametrization's)"
        if hooked(now):
            return unreadable_reason(where, now)
    return None


def _rebuild_fused(base: type, methods: dict[str, Callable], label: str) -> nn.Module:
    cls = fused_class(base, methods, label)
    return cls.__new__(cls)


def swap_class(module: nn.Module, cls: type) -> type:
    """Point ``module`` at ``cls``; returns the class it had. An inert instance forward (the old class's forward
    bound to it, left by a removed accelerate/diffusers hook) goes first: it would pin the old class's forward."""
    old = type(module)
    drop_inert_forward(module)
    module.__class__ = cls
    return old


class ClassSwapRule(Rule):
    """A rule that edits by class swap: :meth:`methods` gives the fused ``forward`` (or a dict of methods).

    The children the fused methods bypass can change after patching (diffusers' layer-skip guidance hooks ``ff``,
    accelerate wraps a norm's forward, a module is replaced): every call of a fused method first checks the
    :meth:`guarded` children and runs the stock method when one was replaced or hooked."""

    #: Touched children whose fused use the forward checks itself per call (ldmopt.nn.child_check.readable), so
    #: that a LoRA on them costs only that one fusion, not the whole block's.
    checked_in_forward: tuple[str, ...] = ()

    def methods(self, site: Site) -> Callable | dict[str, Callable]:
        raise NotImplementedError

    def guarded(self, site: Site) -> dict[str, nn.Module]:
        """Children checked before each fused call: the touched ones but the module itself."""
        return {k: v for k, v in self.touched(site).items() if k and k not in self.checked_in_forward}

    def replace(self, site: Site) -> Any:
        guards = []
        for name, child in self.guarded(site).items():
            parent_name, _, attr = name.rpartition(".")
            guards.append((site.module.get_submodule(parent_name), attr, child, name, type(child)))
        site.module.__dict__["_ldmopt_guards"] = tuple(guards)
        return swap_class(site.module, fused_class(type(site.module), self.methods(site), self.description))

    def restore(self, site: Site, data: Any) -> None:
        swap_class(site.module, data)
        site.module.__dict__.pop("_ldmopt_guards", None)

    def changed_since_patch(self, site: Site, data: Any) -> list[str]:
        # patch skips modules with instance forwards, so one now was added while patched and calls the fused forward.
        where = site.name or "the model"
        if wrapped_forward(site.module):
            return [f"{where}: its forward was wrapped while patched (accelerate/diffusers hook) and calls ldmopt's"]
        if type(site.module) is data:  # already restored: a copy of this block unpatched on its own
            return []
        if "_ldmopt_base" not in type(site.module).__dict__:
            return [f"{where}: its class became {type(site.module).__name__} while patched (a parametrization?)"]
        return []


# ------------------------------------------------------------------------------------------------ child swap


class MovedWork:
    """The link between a module that took over its neighbour's work (a GroupNorm applying the SiLU after it,
    ``proj_mlp`` the GELU) and the :class:`FusedAway` left in the neighbour's place.

    Both ask :meth:`intact` on every call: while both still sit in their parent's slots, of the classes patch gave
    them, without hooks, the producer does the work and the FusedAway passes through; otherwise (a LoRA wraps the
    producer, either was replaced, hooked or given another class, as the "GroupNorm32" upcast does with
    ``m.__class__ = ...``) the producer computes only its own part, if its forward is still patch's, and the
    FusedAway runs ``stock``, the module it replaced, so every hook sees what it would see on the stock model.
    """

    def __init__(self, parent: nn.Module, producer: str, away: str, stock: nn.Module) -> None:
        self.parent, self.producer_attr, self.away_attr, self.stock = parent, producer, away, stock
        self.producer: nn.Module | None = None
        self.away: nn.Module | None = None
        self.classes: tuple[type, type] | None = None  # (producer's, away's) as installed

    def intact(self) -> bool:
        slots = self.parent._modules
        producer, away = slots.get(self.producer_attr), slots.get(self.away_attr)
        return (
            producer is self.producer
            and away is self.away
            and (type(producer), type(away)) == self.classes
            and not (hooked(producer) or hooked(away))
        )

    def __deepcopy__(self, memo: dict) -> MovedWork:
        # Copied with its parent (a whole-model copy): a link between the copies. Copied without it (peft's
        # modules_to_save copies the one layer it wraps): the same link, so the copy sees that it is not the one
        # in the parent's slot and leaves the moved work to the FusedAway.
        if id(self.parent) not in memo:
            return self
        new = MovedWork.__new__(MovedWork)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def link_moved_work(parent: nn.Module, producer_attr: str, producer: nn.Module, away_attr: str) -> nn.Module:
    """Link ``producer`` (already built, not yet installed) to a new FusedAway for ``parent.<away_attr>``; returns
    the FusedAway. Neither holds the link as a child, so state_dict and modules() are unchanged."""
    link = MovedWork(parent, producer_attr, away_attr, parent._modules[away_attr])
    away = FusedAway(producer_attr, link)
    link.producer, link.away = producer, away
    link.classes = (type(producer), type(away))
    producer.__dict__["_ldmopt_link"] = link
    return away


def moved_work_intact(producer: nn.Module) -> bool:
    """For a producer's forward: whether to do the moved work (True also when it was built without a link)."""
    link = producer.__dict__.get("_ldmopt_link")
    return link is None or link.intact()


class FusedAway(nn.Identity):
    """Stands where a module whose work moved into a neighbour was (e.g. a SiLU now applied inside a GroupNorm);
    runs that module itself while the :class:`MovedWork` link says the neighbour no longer does the work."""

    def __init__(self, into: str, link: MovedWork | None = None) -> None:
        super().__init__()
        self.into = into
        self.__dict__["_ldmopt_link"] = link

    def forward(self, x):
        link = self.__dict__.get("_ldmopt_link")
        if link is None or link.intact():
            return x
        why = f"{link.away_attr} ran on its own: {link.producer_attr} was wrapped, replaced or hooked after patch"
        count_reason(type(link.parent).__name__, why)
        return link.stock(x)

    def extra_repr(self) -> str:
        return f"fused into {self.into} by ldmopt"


#: The instance attribute of a child-swapped module that holds the module it replaced.
REPLACED = "_ldmopt_replaced"


def set_child(parent: nn.Module, attr: str, child: nn.Module) -> nn.Module:
    """Replace ``parent.<attr>`` by ``child``; returns the old child."""
    old = parent._modules[attr]
    parent._modules[attr] = child
    return old


def restore_child(parent: nn.Module, attr: str, original: nn.Module, fused: nn.Module) -> None:
    """Put ``original`` back where ``fused`` was installed, keeping what changed while patched: children, parameters
    and buffers of ``fused`` replaced since (a LoRA layer around its projection) move into ``original``, and a
    wrapper installed around ``fused`` (PEFT wraps the very layer a LoRA targets) stays, wrapping ``original``. A
    module put in ``fused``'s place by someone else is left there. ``original`` takes ``fused``'s train/eval mode
    (``model.train()``/``eval()`` while patched reached ``fused`` only)."""
    original.train(fused.training)
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


class ChildSwapRule(Rule):
    """A rule that edits by child swap: :meth:`swaps` builds the new children (ldmopt modules sharing the originals'
    parameters, FusedAways) of one parent; restoring puts the originals back through :func:`restore_child`."""

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        """(parent, {attribute: new child}); built before any is installed."""
        raise NotImplementedError

    def replace(self, site: Site) -> Any:
        parent, children = self.swaps(site)
        for attr, child in children.items():  # in the mode of the module it replaces (model.eval() before patch)
            child.train(parent._modules[attr].training)
            # Outside the tree (state_dict unchanged): a copy of the block without its record (deepcopy of a block,
            # PEFT's modules_to_save) carries the original along, for unpatch (core._unrecorded_swaps).
            child.__dict__[REPLACED] = parent._modules[attr]
        return parent, {attr: (set_child(parent, attr, child), child) for attr, child in children.items()}

    def restore(self, site: Site, data: Any) -> None:
        parent, swapped = data
        for attr, (original, fused) in swapped.items():
            carried = layerwise_casting_hooks(fused) or ()
            restore_child(parent, attr, original, fused)
            fused.__dict__.pop(REPLACED, None)
            if carried:  # enabled while patched: the original (same parameters, stored cast) takes the same hooks
                from diffusers.hooks.layerwise_casting import apply_layerwise_casting_hook

                for hook in carried:
                    apply_layerwise_casting_hook(original, hook.storage_dtype, hook.compute_dtype, hook.non_blocking)

    def installed(self, data: Any) -> list[nn.Module]:
        return [fused for _, fused in data[1].values()]

    def changed_since_patch(self, site: Site, data: Any) -> list[str]:
        problems = []
        for attr, (_, fused) in data[1].items():
            where = f"{site.name or 'the model'}: ldmopt's {fused._get_name()} (.{attr})"
            # Global hooks are not the module's: unpatch drops nothing of them. Layerwise casting moves to the original.
            if attached_hooks(fused) and layerwise_casting_hooks(fused) is None:
                problems.append(f"{where} got hooks or a wrapped forward while patched")
            elif not type(fused).__module__.startswith("ldmopt."):
                problems.append(f"{where} became a {type(fused).__name__} while patched (a parametrization?)")
        return problems
