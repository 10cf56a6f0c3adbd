"""``patch`` / ``unpatch``: walk a pipeline's models (or one model), apply the rule table, remember how to undo it.

The walk is planned before anything is edited (so ``strict=True`` raises with every reason and leaves the model
untouched), pre-order, so a rule on a block claims the submodules it fuses before a rule on those submodules sees
them. Several rules may patch one instance when they touch different parts of it (a block's forward and a child
module); a rule whose touched modules an earlier rule already claimed is passed over. Undo records live on each
patched model in ``model._ldmopt_records`` (a plain attribute: not a parameter, not in state_dict; deepcopy carries
it along).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..graphs import graphed_models
from ..nn import stats_handover
from .guards import generic_reasons, read_in_place_reasons
from .report import PatchReport, Replaced, Skipped, _where
from .rule import FAMILIES, REPLACED, ChildSwapRule, Rule, Site, restore_child, swap_class
from .rules_attention import companion_actions, installed_processor, restore_unrecorded_processors
from .targets import PatchError, forget_patched, former_components, fsdp_sharding, models_of, remember_patched
from .weight_layout import weight_bytes, weight_layout_action

_RECORDS = "_ldmopt_records"
#: Every module a live patch touched -> the model that holds its records (a patch of an enclosing model leaves no
#: records in a submodule's own tree: this is how a later patch/unpatch of that submodule sees it).
#: Values are weak too: the model holds every key, so a strong value would keep a patched model (never unpatched)
#: and its weights alive for the life of the process.
_CLAIMED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: One patch/unpatch at a time in the process: a patch plans on the model as it finds it and records its edits only
#: at the end, so two threads patching one model at once (a server's first requests) would both fuse it. A
#: ``filter_fn`` runs under it (it may call patch again in its thread, not wait on another thread that does).
_LOCK = threading.RLock()


def _serialized(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)

    return locked


def _claimant(module: nn.Module) -> nn.Module | None:
    """The live model whose patch touched ``module``, if any."""
    ref = _CLAIMED_BY.get(module)
    return ref() if ref is not None else None


def _records_in(model: nn.Module) -> list[Any]:
    """The patch records held anywhere in ``model``'s tree (each with the module whose patch call made it)."""
    return [rec for m in model.modules() for rec in m.__dict__.get(_RECORDS, ())]


def _unrecorded_fused(model: nn.Module) -> list[nn.Module]:
    """Modules of ``model``'s tree in a fused class that neither a record in this tree nor the registry accounts
    for: part of a copy of a patched model (deepcopy, torch.save/load), whose records are with the copy's root."""
    recorded = {id(t) for rec in _records_in(model) for t in rec.rule.touched(rec.site).values()}
    return [
        m
        for m in model.modules()
        if "_ldmopt_base" in type(m).__dict__ and id(m) not in recorded and _claimant(m) is None
    ]


@dataclass
class _Record:
    rule: Rule
    site: Site
    data: Any
    #: the modules the patch registered as claimed, kept: a child wrapped while patched (a LoRA layer loaded, a
    #: split-inference wrapper) is no longer what ``rule.touched`` finds at unpatch, and its claim would outlive it
    claimed: tuple[nn.Module, ...] = ()


@functools.cache
def _rules() -> tuple[Rule, ...]:
    from .rules_attention import RULES as attention_rules
    from .rules_blocks import RULES as block_rules
    from .rules_downsample import RULES as downsample_rules
    from .rules_flux_attention import RULES as flux_attention_rules
    from .rules_gn_conv import RULES as gn_conv_rules
    from .rules_group_norm import RULES as group_norm_rules
    from .rules_hunyuan_attention import RULES as hunyuan_attention_rules
    from .rules_layer_norm_attention import RULES as layer_norm_attention_rules
    from .rules_linear import RULES as linear_rules
    from .rules_ltx_attention import RULES as ltx_attention_rules
    from .rules_qwen_attention import RULES as qwen_attention_rules
    from .rules_residual import RULES as residual_rules
    from .rules_rms_norm import RULES as rms_norm_rules
    from .rules_temporal_layout import RULES as temporal_layout_rules
    from .rules_up_block import RULES as up_block_rules
    from .rules_upsample import RULES as upsample_rules
    from .rules_wan import RULES as wan_rules
    from .rules_wan_attention import RULES as wan_attention_rules

    # Temporal layout before the attention processors: its containers claim the attention modules they bypass.
    return (
        *gn_conv_rules,
        *up_block_rules,
        *upsample_rules,
        *downsample_rules,
        *block_rules,
        *residual_rules,
        *wan_rules,
        *linear_rules,
        *group_norm_rules,
        *rms_norm_rules,
        *wan_attention_rules,
        *flux_attention_rules,
        *qwen_attention_rules,
        *hunyuan_attention_rules,
        *layer_norm_attention_rules,
        *ltx_attention_rules,
        *temporal_layout_rules,
        *attention_rules,
    )


@functools.cache
def _table() -> dict[type, tuple[Rule, ...]]:
    table: dict[type, list[Rule]] = {}
    for rule in _rules():
        for cls in rule.targets():
            table.setdefault(cls, []).append(rule)
    return {cls: tuple(rules) for cls, rules in table.items()}


def rule_table() -> dict[type, tuple[Rule, ...]]:
    """The table: diffusers (or torch) module class -> the rules keyed by it, in priority order."""
    return dict(_table())


# ------------------------------------------------------------------------------------------------ plan and apply


def _patches_at(owners: Iterable[nn.Module], modules: set[int]) -> int:
    """How many counted patches the ``owners``' records made at the modules with ids in ``modules`` (the sites, not
    the children the patches touched)."""
    records = (rec for owner in owners for rec in _records_in(owner))
    # A class swap's site is the fused module; a child swap's is its parent, the modules it installed are the fused.
    return sum(
        rec.rule.counted
        and (id(rec.site.module) in modules or any(id(m) in modules for m in rec.rule.installed(rec.data)))
        for rec in records
    )


def _plan(
    label: str,
    model: nn.Module,
    families: frozenset[str],
    filter_fn: Callable[[nn.Module, str], bool] | None,
    training: bool,
    report: PatchReport,
    planned: set[int],
    walked: set[int],
) -> list[tuple[Rule, Site, tuple[str, ...]]]:
    """The (rule, site, stock parts) to apply to ``model``, reasons for the rest in ``report``; the stock parts: why
    parts of the fused path will run stock per call (Rule.read_in_place). ``planned`` / ``walked``:
    the modules that earlier models of this call fuse / have walked (shared modules are planned and reported once);
    this model's are added."""
    table = _table()
    named = list(model.named_modules())
    earlier = set(walked)  # walked for an earlier model of this call: planned or reported there
    walked.update(id(m) for _, m in named)
    parents: dict[int, tuple[nn.Module, str]] = {}
    for _, m in named:
        for attr, child in m._modules.items():
            if child is not None:
                parents.setdefault(id(child), (m, attr))
    # Earlier patch calls (on this model or a submodule): their modules stay claimed, their (rule, module) done.
    prior = _records_in(model)
    report.already_patched += sum(rec.rule.counted and id(rec.site.module) not in earlier for rec in prior)
    report._families_already.update(rec.rule.family for rec in prior if rec.rule.family in families)
    # claimed: modules some rule fuses or replaces; inside: those fused into a module around them (never visited).
    claimed: set[int] = set()
    inside: set[int] = set()
    for rec in prior:
        for rel, t in rec.rule.touched(rec.site).items():
            claimed.add(id(t))
            if rel:
                inside.add(id(t))
        claimed.update(id(t) for t in rec.rule.claims(rec.site).values())
    done = {(rec.rule.name, id(rec.site.module)) for rec in prior}
    # Modules a patch of an enclosing model touched: already fused, their records are not in this tree.
    own = {id(m) for m in model.modules()}
    owners: dict[int, nn.Module] = {}
    enclosing = []
    for m in model.modules():
        owner = _claimant(m)
        if owner is not None and id(owner) not in own:
            enclosing.append(m)
            owners[id(owner)] = owner
    report.already_patched += _patches_at(owners.values(), {id(m) for m in enclosing} - earlier)
    # In a copy of a patched model, fused modules (and what they fused) whose records are with the copy's root.
    fused_copies = _unrecorded_fused(model) + [m for _, _, m in _unrecorded_swaps(model)]
    report.already_patched += sum(id(m) not in earlier for m in fused_copies)  # the fused modules, not what is in them
    enclosing += [inner for m in fused_copies for inner in m.modules()]
    # Modules that an earlier model of this same call shares with this one: that model's plan fuses them.
    enclosing += [m for m in model.modules() if id(m) in planned]
    claimed.update(id(m) for m in enclosing)
    inside.update(id(m) for m in enclosing)
    context = {rule.name: rule.prepare(model) for rule in _rules() if rule.family in families}
    actions: list[tuple[Rule, Site, tuple[str, ...]]] = []
    for name, m in named:
        if id(m) in inside or id(m) in earlier:
            continue
        parent, attr = parents.get(id(m), (None, None))
        site = Site(name, m, parent, attr, training, context)
        for rule in table.get(getattr(type(m), "_ldmopt_base", type(m)), ()):
            if rule.family not in families or (rule.name, id(m)) in done or not rule.match(site):
                continue
            qualified = ".".join(p for p in (label, name) if p)
            if filter_fn is not None and not filter_fn(m, qualified):
                report.skipped.append(Skipped(label, name, rule.name, rule.family, ("excluded by filter_fn",), True))
                continue
            touched = rule.touched(site)
            if any(id(t) in claimed for t in touched.values()):
                continue  # an earlier rule on this module already fuses that part
            # filter_fn also speaks for the children the fused forward would bypass or replace.
            excluded = [
                rel for rel, t in touched.items() if rel and filter_fn and not filter_fn(t, f"{qualified}.{rel}")
            ]
            if excluded:
                why = f"excluded by filter_fn: {', '.join(excluded)} (which this rule bypasses or replaces)"
                report.skipped.append(Skipped(label, name, rule.name, rule.family, (why,), True))
                continue
            # The generic guards first: a LoRA, quantized or hooked child is what every rule's own check of that
            # child would name again, in other words.
            reasons = generic_reasons(site, touched, rule.shallow(site)) or rule.reasons(site)
            if reasons:
                report.skipped.append(Skipped(label, name, rule.name, rule.family, tuple(reasons)))
                continue
            # Children read in place are no condition of the rule (a LoRA on one costs that part per call), nor is
            # an attention's processor it does not mirror: said now, or the report would count a module as fused
            # whose every call takes that part's stock path.
            stock_parts = read_in_place_reasons(rule.read_in_place(site)) + rule.stock_part_reasons(site)
            actions.append((rule, site, tuple(stock_parts)))
            planned.update(id(t) for t in touched.values())
            claimed.update(id(t) for t in touched.values())
            claimed.update(id(t) for t in rule.claims(site).values())
            inside.update(id(t) for rel, t in touched.items() if rel)
    return actions


def _restore(records: list[_Record], *, best_effort: bool = False) -> list[str]:
    """Undo ``records``, newest first. best_effort (rolling back a failed patch): a restore that raises is reported
    in the returned list and the others still run, so the caller's own exception is the one that surfaces."""
    failed = []
    for rec in reversed(records):
        try:
            rec.rule.restore(rec.site, rec.data)
        except Exception as error:
            if not best_effort:
                raise
            failed.append(f"{rec.site.name or '<root>'} [{rec.rule.name}]: {type(error).__name__}: {error}")
        for touched in (*rec.claimed, *rec.rule.touched(rec.site).values(), *rec.rule.installed(rec.data)):
            _CLAIMED_BY.pop(touched, None)
    return failed


@_serialized
def patch(
    pipe_or_model: Any,
    *,
    families: Iterable[str] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    strict: bool = False,
    training: bool = False,
    channels_last_weights: bool | None = None,
) -> PatchReport:
    """Swap ldmopt's fused kernels into a diffusers pipeline's models (or one model), in place and reversibly.

    Args:
        pipe_or_model: a diffusers pipeline (every torch module among ``pipe.components``: unet / transformer /
            vae ...) or one ``nn.Module``. A model already compiled (``torch.compile`` wrapper, ``Module.compile``)
            is refused: patch first, then compile; so is one FSDP already shards (patch before FSDP/fully_shard).
        families: kernel families to apply (default: all); see ``ldmopt.patch.FAMILIES``.
        filter_fn: ``filter_fn(module, qualified_name) -> bool``; False leaves that module alone, and so every
            rule that would bypass or replace it as part of a module around it (names are prefixed with the
            pipeline component, e.g. ``"unet.down_blocks.0.resnets.0"``). It runs while patch holds the lock that
            serializes patch/unpatch across threads: it must not wait on another thread that patches.
        strict: raise :class:`PatchError` listing every module that would stay on the stock path (for reasons
            other than ``filter_fn``) and every fused module part of which would (a LoRA, quantized or hooked child
            it reads in place, an attention whose processor it does not mirror: ``PatchReport.partly_stock``), before
            changing anything.
        training: the model will be trained: modules whose fused path would skip a dropout with p > 0 stay on
            the stock path. (With the default False, such modules fall back to the stock forward while in
            train mode.)
        channels_last_weights: convert the weights of the Conv2d/Conv3d modules the model's fused forwards read
            to channels-last in place (same Parameters, values and keys; unpatch restores the strides unless the
            whole model went channels-last while patched), the layout
            the fused convolutions read in vectors (ldmopt/patch/weight_layout.py). Default (None): when
            ``training`` is False; FSDP's fully_shard refuses non-contiguous parameters, so a training patch leaves
            the layout to the caller unless this is True. The report says what was converted or left.

    Parameters are shared with the stock modules (the same objects, no copies; conv weights may be re-laid out,
    above), state_dict keys do not change, patching twice is a no-op, a module that several components share is
    patched once, a rule that raises leaves every model of the call as it was, and ``unpatch`` restores module
    types, forwards, processors, parameter strides and state_dict exactly.
    """
    if families is None:
        selected = frozenset(FAMILIES)
    else:
        selected = frozenset([families] if isinstance(families, str) else families)
        unknown = selected - set(FAMILIES)
        if unknown:
            raise ValueError(f"ldmopt.patch: unknown families {sorted(unknown)}; expected a subset of {FAMILIES}")
    if channels_last_weights is not None and not isinstance(channels_last_weights, bool):
        raise TypeError(
            f"ldmopt.patch: channels_last_weights={channels_last_weights!r} is not supported; expected None, True or "
            "False"
        )
    models = models_of(pipe_or_model, for_patch=True)
    _refuse_graphed(models, "patch")
    available = {r.family for r in _rules()}
    report = PatchReport(
        families=tuple(f for f in FAMILIES if f in selected and f in available),
        descriptions={r.name: r.description for r in _rules()},
    )
    report.count_from_now()
    plans = []
    planned: set[int] = set()  # modules the plans so far fuse: a module two components share is planned once
    walked: set[int] = set()
    for label, model in models:
        report.models[label] = type(model).__name__
        plans.append((label, model, _plan(label, model, selected, filter_fn, training, report, planned, walked)))
    if strict:
        refused = [f"  {s.where} [{s.rule}]: {'; '.join(s.reasons)}" for s in report.skipped if not s.by_user]
        # A LoRA, quantized or hooked child that a fused forward reads in place: that part runs stock on every call.
        partly = [
            f"  {_where(label, site.name)} [{rule.name}]: {'; '.join(parts)}"
            for label, _, actions in plans
            for rule, site, parts in actions
            if parts
        ]
        if refused or partly:
            sections = [f"{len(refused)} modules would stay stock:", *refused] if refused else []
            if partly:
                sections += [f"{len(partly)} fused modules would run parts stock on every call:", *partly]
            raise PatchError("ldmopt.patch(strict=True): " + "\n".join(sections))
    # All or nothing across the pipeline's models: a replace that raises undoes this call's earlier ones too.
    wanted_layout = (not training) if channels_last_weights is None else bool(channels_last_weights)
    applied: list[tuple[nn.Module, list[_Record]]] = []
    try:
        for label, model, actions in plans:
            records: list[_Record] = []
            applied.append((model, records))
            for rule, site, stock_parts in actions:
                data = rule.replace(site)
                claimed = (*rule.touched(site).values(), *rule.installed(data))
                records.append(_Record(rule, site, data, claimed))
                for touched in claimed:
                    _CLAIMED_BY[touched] = weakref.ref(model)
                report.replaced.append(Replaced(label, site.name, rule.name, rule.family, stock_parts))
                report._counters.extend(rule.counters(data))
            for rule, site in companion_actions(model):  # fuse nothing: not reported as patched modules
                records.append(_Record(rule, site, rule.replace(site)))
            earlier = [(rec.rule, rec.site) for rec in _records_in(model)]
            planned_now = [(rule, site) for rule, site, _ in actions]
            layout, left = weight_layout_action(label, model, earlier + planned_now, filter_fn, wanted_layout)
            if layout is not None:
                rule, site = layout
                records.append(_Record(rule, site, rule.replace(site)))
                convs = site.context["convs"]
                report.converted_weights[label] = (len(convs), weight_bytes(convs))
            elif left:
                report.kept_weights[label] = (len(left), weight_bytes(left))
                why = "training=True" if channels_last_weights is None else "channels_last_weights=False"
                report.kept_weights_reason = why
    except BaseException:
        failed = [why for _, records in reversed(applied) for why in _restore(records, best_effort=True)]
        if failed:
            warnings.warn(
                "ldmopt.patch failed and could not undo every change; these modules may stay modified:\n  "
                + "\n  ".join(failed),
                RuntimeWarning,
                stacklevel=2,
            )
        raise
    for model, records in applied:
        if records:
            model.__dict__.setdefault(_RECORDS, []).extend(records)
    remember_patched(pipe_or_model, [named for named, (_, records) in zip(models, applied) if records])
    return report


def _refuse_graphed(models: list[tuple[str, nn.Module]], verb: str) -> None:
    """A model ``ldmopt.cuda_graphs`` wraps replays the kernels it captured: a patch or unpatch under it would not
    reach its replays."""
    graphed = graphed_models(model for _, model in models)
    if graphed:
        raise PatchError(
            f"ldmopt.{verb}: {type(graphed[0]).__name__} is wrapped by ldmopt.cuda_graphs, whose graphs would keep "
            f"replaying what they captured; remove them first (`graphs.remove()` or "
            f"`ldmopt.remove_cuda_graphs(pipe)`), {verb}, then graph again"
        )


@_serialized
def unpatch(pipe_or_model: Any) -> int:
    """Undo every ``patch`` on the pipeline's models (or the model), also on a model a patch of this pipeline changed
    that the pipeline no longer holds (``pipe.unet = other`` since): the same module objects, classes, processors
    and forwards are back, so state_dict is bit-for-bit what it was. Returns how many patches were undone. Raises
    :class:`PatchError`, restoring nothing, when hooks, wrapped forwards or parametrizations were attached to
    ldmopt's modules while patched (they would be lost, or keep calling ldmopt's forward)."""
    undone = 0
    models = models_of(pipe_or_model, for_patch=False)
    # A model this pipeline's patch changed and the user since replaced (pipe.unet = other): still undone here.
    models += former_components(pipe_or_model, models)
    _refuse_graphed(models, "unpatch")
    in_call = {id(m) for _, model in models for m in model.modules()}  # records anywhere here are undone here
    for _, model in models:  # a submodule of a patched model: its records are with that model
        claimants = (_claimant(m) for m in model.modules())
        roots = [root for root in claimants if root is not None and id(root) not in in_call]
        if roots:
            raise PatchError(
                f"ldmopt.unpatch: modules of this {type(model).__name__} were patched by ldmopt.patch of an enclosing "
                f"{type(roots[0]).__name__}; unpatch that model (or pipeline) instead, which also undoes any patch "
                "of this one"
            )
    for name, model in models:
        sharded = fsdp_sharding(model)
        if sharded is not None and is_patched(model):
            # FSDP gathers and frees the parameters of the modules it was given (ldmopt's, and classes it subclassed
            # from ldmopt's): the stock modules unpatch would put back would compute with stale or sharded ones.
            at = f" at '{sharded[0]}'" if sharded[0] else ""
            raise PatchError(
                f"ldmopt.unpatch: {name or type(model).__name__} is sharded by FSDP ({sharded[1]}{at}), which "
                "manages the parameters of ldmopt's modules and would not see the stock modules unpatch puts back. "
                "Save the FSDP model's state_dict (its keys are the stock model's) and load it into an unpatched model"
            )
    problems = [
        problem
        for _, model in models
        for rec in _records_in(model)
        for problem in rec.rule.changed_since_patch(rec.site, rec.data)
    ]
    if problems:
        # Checked before anything is restored: the model stays fully patched, and nothing is half undone.
        raise PatchError(
            "unpatch would drop what was attached to ldmopt's modules while patched, or leave a wrapped forward "
            "calling ldmopt's: remove those hooks/parametrizations first (e.g. accelerate's remove_hook_from_module "
            "or pipe.remove_all_hooks()), or attach them after unpatch:\n  " + "\n  ".join(problems)
        )
    for _, model in reversed(models):  # the reverse of patch's order, as models may share modules
        # Statistics its fused producers learned to hand on: a model patched again (tune's configurations) would
        # otherwise compute them for consumers that may now be stock.
        stats_handover.forget_modules(model.modules())
        # Copies of patched blocks (deepcopy, torch.load, PEFT's modules_to_save) whose records are not here: their
        # fused class is all a class-swap rule changed in them (its guards aside), so they go back to their own.
        copies = _unrecorded_fused(model)
        holders = [m for m in model.modules() if _RECORDS in m.__dict__]
        originals = {}
        try:
            for holder in holders:
                # One record at a time, newest first, each dropped once restored: a restore that raises (or a
                # KeyboardInterrupt) leaves the rest recorded, so the model still says it is patched and a later
                # unpatch finishes the job.
                records = holder.__dict__[_RECORDS]
                while records:
                    rec = records[-1]
                    stand_ins = rec.rule.stand_ins(rec.data)
                    _restore([rec])
                    originals.update((id(new), old) for new, old in stand_ins)
                    records.pop()
                    undone += rec.rule.counted
                del holder.__dict__[_RECORDS]
        finally:
            _restore_saved_processors(model, originals)
        for module in copies:
            swap_class(module, type(module)._ldmopt_base)
            module.__dict__.pop("_ldmopt_guards", None)
            undone += 1
        # What is left of the other kinds of edit in such copies: ldmopt modules swapped in as children (each holds
        # the module it replaced) and attention processors (each holds the one it stands in for).
        for parent, attr, fused in _unrecorded_swaps(model):
            restore_child(parent, attr, fused.__dict__.pop(REPLACED), fused)
            undone += 1
        undone += restore_unrecorded_processors(model)
    forget_patched(pipe_or_model)
    return undone


def _unrecorded_swaps(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of each child-swapped ldmopt module in ``model``'s tree that no record here or
    live patch elsewhere accounts for: part of a copy of a patched block (its record stayed with the original)."""
    recorded = {
        id(fused)
        for rec in _records_in(model)
        if isinstance(rec.rule, ChildSwapRule)
        for _, fused in rec.data[1].values()
    }
    return [
        (parent, attr, child)
        for parent in model.modules()
        for attr, child in parent._modules.items()
        if child is not None and REPLACED in child.__dict__ and id(child) not in recorded and _claimant(child) is None
    ]


def _restore_saved_processors(model: nn.Module, originals: dict[int, Any]) -> None:
    """diffusers' ``fuse_qkv_projections`` saves the processors of the moment in ``original_attn_processors`` for
    ``unfuse_qkv_projections`` to put back; saved while patched, they would bring ldmopt's processors back into the
    unpatched model. Each one ldmopt installed becomes the processor it stood in for."""
    if not originals:
        return
    for m in model.modules():
        saved = m.__dict__.get("original_attn_processors")
        if isinstance(saved, dict):
            for name, processor in saved.items():
                if id(processor) in originals:
                    saved[name] = originals[id(processor)]


def is_patched(pipe_or_model: Any) -> bool:
    """True when any model of the pipeline (or the model) carries ldmopt patches, or runs fused modules patched as
    part of an enclosing model (then ``unpatch`` that model), also in a copy of one."""
    return any(
        _RECORDS in m.__dict__
        or _claimant(m) is not None
        or "_ldmopt_base" in type(m).__dict__
        or REPLACED in m.__dict__
        or installed_processor(m)
        for _, model in models_of(pipe_or_model, for_patch=False)
        for m in model.modules()
    )


__all__ = ["FAMILIES", "PatchError", "is_patched", "patch", "rule_table", "unpatch"]
