"""``ldmopt.tune(..., by="rule")``: choose what to patch rule by rule, from whole ``run()`` calls, without hooks.

Per-site timing (tune.py) sees forward passes only: module hooks mark where a module's forward starts and ends, not
its backward. A training step's backward runs the fused ops' own backward kernels (often most of a step's time), so
for ``training=True`` tune times whole calls instead: stock, every site patched, then each group of sites with the
same rules patched alone (resnets, transformer blocks, GEGLU projections ...). Groups whose call was faster than
stock are kept; if they are not faster together than the best of them alone, only that one is kept; if every site
patched was faster still (rules that pay only together: one hands the next its statistics), all are kept. A choice no
faster than stock as a whole leaves the model stock. Coarser than
per-site choices (every site of a rule shares its fate), but it measures exactly what the caller runs: forward,
backward, optimizer step, whatever ``run()`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .core import unpatch
from .report import PatchReport
from .tune import SiteTiming, Tuning, _Job, _left_stock_reason
from .tune_sites import TuneSite, read_touched
from .tune_timer import SiteKey, wall_time


@dataclass
class GroupTiming:
    """One rule group's whole-call median, milliseconds per ``run()`` call with only its sites patched."""

    rules: str  # the rules of its sites, joined by "+"
    sites: int
    patched_ms: float
    kept: bool


def tune_by_rule(job: _Job) -> PatchReport:
    pipe_or_model, sites, min_speedup, graph = job.pipe_or_model, job.sites, job.min_speedup, job.graph
    unpatch(pipe_or_model)
    read_touched(sites)
    groups: dict[str, list[TuneSite]] = {}
    for site in sites:
        groups.setdefault("+".join(rule for rule, _ in site.rules), []).append(site)
    measured = 0

    def call_with(keys: set[SiteKey]) -> float:
        nonlocal measured
        if keys:
            job.patch_only(keys)
            measured += 1
        try:
            return wall_time(job.run, job.devices, warmup=job.warmup, repeats=job.repeats, graph=graph)
        finally:
            if keys:
                unpatch(pipe_or_model)

    stock_s = call_with(set())
    all_s = call_with({s.key for s in sites})
    alone = {name: call_with({s.key for s in members}) for name, members in groups.items()}
    faster = sorted((name for name in groups if alone[name] * min_speedup < stock_s), key=alone.get)
    chosen: list[str] = []
    tuned_s = stock_s
    together = None
    if len(faster) == 1:
        chosen, tuned_s = faster, alone[faster[0]]
    elif faster:
        together = call_with({s.key for name in faster for s in groups[name]})
        chosen, tuned_s = (faster, together) if together <= alone[faster[0]] else (faster[:1], alone[faster[0]])
    if all_s < tuned_s and all_s * min_speedup < stock_s:  # rules that pay only together (statistics handed on)
        chosen, tuned_s = list(groups), all_s
    left_stock = bool(chosen) and not tuned_s < stock_s  # min_speedup < 1 lets slower groups through
    why: dict[SiteKey, str] = {}
    if left_stock:
        why.update(dict.fromkeys((s.key for s in sites), _left_stock_reason(tuned_s, stock_s)))
        chosen = []
    for name, members in groups.items():
        if name in chosen or left_stock:
            continue
        with_only = f"with only its rule's {len(members)} sites patched ({name}), run() took {alone[name] * 1e3:.3f} ms"
        if name in faster:
            reason = (
                f"tune: {with_only} against {stock_s * 1e3:.3f} ms stock, but the faster rules together took "
                f"{together * 1e3:.3f} ms, more than {faster[0]} alone ({alone[faster[0]] * 1e3:.3f} ms)"
            )
        else:
            reason = f"tune: {with_only} against {stock_s * 1e3:.3f} ms stock: no faster"
        why.update((s.key, reason) for s in members)
    kept = {s.key for name in chosen for s in groups[name]}
    report = job.finish(kept, why)
    report.tuning = Tuning(
        timer="whole run() calls, a configuration per rule" + (" in a CUDA graph" if graph else ""),
        warmup=job.warmup,
        repeats=job.repeats,
        min_speedup=min_speedup,
        rounds=measured,
        stock_ms=stock_s * 1e3,
        all_patched_ms=all_s * 1e3,
        tuned_ms=tuned_s * 1e3,
        left_stock=left_stock,
        sites=[
            SiteTiming(
                s.key[0], s.key[1], tuple(r for r, _ in s.rules), 0, None, None, None, s.key in kept, why.get(s.key, "")
            )
            for s in sites
        ],
        groups=[GroupTiming(name, len(members), alone[name] * 1e3, name in chosen) for name, members in groups.items()],
    )
    return report
