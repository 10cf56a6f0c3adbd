"""The sites ``tune`` times: each module that a live patch's counted records changed (several rules on one module
are one site), the names of the modules timed for it, and which site encloses which."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .core import _records_in
from .rule import ChildSwapRule
from .targets import models_of
from .tune_timer import SiteKey


@dataclass
class TuneSite:
    key: SiteKey
    module: nn.Module
    rules: list[tuple[str, str]]  # (rule, family) of each counted record at this module
    records: list[Any] = field(default_factory=list)  # those records' (rule, core.Site)
    #: names (in the model) of the modules timed for this site: the site, or the child slots its rules swap
    targets: list[str] = field(default_factory=list)
    #: the modules those rules fuse or bypass, read from the stock tree (:func:`read_touched`)
    touched: list[nn.Module] = field(default_factory=list)


def patched_sites(pipe_or_model: Any) -> list[TuneSite]:
    """The sites of the live patch on ``pipe_or_model``: modules with counted records, in walk order."""
    sites: dict[int, TuneSite] = {}
    seen: set[int] = set()  # a component inside another is walked twice: its records count once
    for label, model in models_of(pipe_or_model, for_patch=False):
        names = {id(m): n for n, m in model.named_modules()}
        for rec in _records_in(model):
            if id(rec) in seen or not rec.rule.counted:
                continue
            seen.add(id(rec))
            site = sites.get(id(rec.site.module))
            if site is None:
                site = sites[id(rec.site.module)] = TuneSite((label, rec.site.name), rec.site.module, [])
            site.rules.append((rec.rule.name, rec.rule.family))
            site.records.append((rec.rule, rec.site))
            if isinstance(rec.rule, ChildSwapRule):  # the slots it swapped, named where they are now
                parent, swapped = rec.data
                site.targets += [".".join(p for p in (names[id(parent)], attr) if p) for attr in swapped]
            else:
                site.targets.append(rec.site.name)
    for site in sites.values():
        # One rule that edits the site module itself: time the whole module. Only child swaps: time their slots.
        site.targets = [site.key[1]] if site.key[1] in site.targets else list(dict.fromkeys(site.targets))
    return list(sites.values())


def read_touched(sites: list[TuneSite]) -> None:
    """Fill in each site's touched modules; call on the stock tree (while patched, a rule's ``touched`` names the
    modules it installed, which a later patch's filter_fn never sees)."""
    for site in sites:
        site.touched = [module for rule, where in site.records for rel, module in rule.touched(where).items() if rel]


def current_targets(pipe_or_model: Any, sites: list[TuneSite]) -> dict[SiteKey, list[nn.Module]]:
    """The modules now at each site's target names: a child swap puts ldmopt's module where the stock one was."""
    models = dict(models_of(pipe_or_model, for_patch=False))
    return {s.key: [models[s.key[0]].get_submodule(name) for name in s.targets] for s in sites}


def enclosing_sites(sites: list[TuneSite]) -> dict[SiteKey, SiteKey | None]:
    """The nearest enclosing site of each site, None at the top: the site of the same model with the longest timed
    target whose module contains it (a child-swap site at a model's root encloses only what is in its slots)."""

    def inside(name: str, target: str) -> bool:
        return target == "" or name.startswith(target + ".")

    parent: dict[SiteKey, SiteKey | None] = {}
    for s in sites:
        enclosing = [
            (len(t), o.key)
            for o in sites
            if o.key[0] == s.key[0] and o.key != s.key
            for t in o.targets
            if inside(s.key[1], t)
        ]
        parent[s.key] = max(enclosing, default=(0, None))[1]
    return parent
