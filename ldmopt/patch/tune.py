"""``ldmopt.tune(pipe, run)``: patch only the modules whose fused forward measured faster than the stock one.

Whether a fused kernel beats cuDNN/cuBLAS depends on the GPU, the shapes, the dtype and the host. On an H200
(2026-12-04, benchmarks/RESULTS.md) the temporal attention kernel ran 3.7-13.6x faster than diffusers' eager path
while the Triton convolution was slower than cuDNN at Stable Diffusion shapes, so a whole-model ``patch`` made an SD1.5
step slower and a video step faster. ``tune`` measures instead of guessing, on the caller's own GPU and inputs:

1. ``patch`` the model as usual. Each *site* (a module a rule patched; several rules on one module are one site) is
   timed by a forward pre-hook and a forward hook while ``run()`` executes: CUDA events on the current stream when
   the model has CUDA parameters (what the site adds to the stream's timeline, host time included where the host
   falls behind), ``time.perf_counter`` otherwise. A site's time leaves out the sites nested in it.
   ``warmup`` calls first (Triton compiles and autotunes there), then the median of ``repeats`` calls.
2. ``unpatch``; the same timing of the stock model.
3. ``patch`` again, only the sites whose fused time was below their stock time (``min_speedup``), and time again: a
   site can lose what a rejected neighbour handed it (GroupNorm statistics summed in the neighbour's epilogue), so
   one that is now no faster is dropped and the rest measured again, up to ``rounds`` times.
4. The whole ``run()`` call, tuned against stock: when the tuned model is not faster, it is left stock.

``min_speedup`` sets the bar for both (a site is kept when stock time > fused time x min_speedup).

The model ends patched with the kept sites (or stock), and the returned :class:`PatchReport` lists every rejected
site among the modules left on the stock path, with the times that decided it, and ``report.tuning`` has the table.
Sites ``run()`` never called are not measured and stay stock. Forward time only: for training, patch with
``training=True`` and time the step yourself. CUDA graphs remove host time, which is most of what small fused calls
lose in eager mode: a captured model may gain from sites tune rejects here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..nn.child_check import observer
from .core import _RECORDS, PatchError, _models_of, is_patched, patch, unpatch
from .report import PatchReport, Skipped

#: (model label, module name) of a site
SiteKey = tuple[str, str]


@dataclass
class _Site:
    key: SiteKey
    module: nn.Module
    rules: list[tuple[str, str]]  # (rule, family) of each counted record at this module
    records: list[Any] = field(default_factory=list)  # those records' (rule, core.Site)
    #: (name in the model, module) of what those rules fuse or bypass, read from the stock tree (:func:`_read_touched`)
    touched: list[tuple[str, nn.Module]] = field(default_factory=list)


@dataclass
class SiteTiming:
    """One site's measurements, milliseconds per ``run()`` call (medians; None where not measured)."""

    model: str
    name: str
    rules: tuple[str, ...]
    calls: int  # forward calls of the site per run() call
    stock_ms: float | None
    fused_ms: float | None  # with every site patched
    tuned_ms: float | None  # in the last round that patched it
    kept: bool
    why: str

    @property
    def where(self) -> str:
        return ".".join(p for p in (self.model, self.name) if p) or "<root>"


@dataclass
class Tuning:
    """What ``tune`` measured: per-site rows and whole-call medians in milliseconds."""

    timer: str
    warmup: int
    repeats: int
    min_speedup: float
    rounds: int  # patched configurations measured (the first patches every site)
    stock_ms: float
    all_patched_ms: float
    tuned_ms: float
    left_stock: bool  # the tuned model was no faster than stock as a whole, so nothing stays patched
    sites: list[SiteTiming] = field(default_factory=list)

    @property
    def kept(self) -> list[SiteTiming]:
        return [s for s in self.sites if s.kept]

    def __str__(self) -> str:
        head = (
            f"ldmopt.tune ({self.timer}; median of {self.repeats} calls after {self.warmup} warm-up, "
            f"{self.rounds} patched configurations): run() {self.stock_ms:.3f} ms stock, "
            f"{self.all_patched_ms:.3f} ms with every site patched, {self.tuned_ms:.3f} ms tuned "
            f"({_ratio(self.stock_ms, self.tuned_ms)}); {len(self.kept)} of {len(self.sites)} sites kept"
        )
        lines = [head]
        if self.left_stock:
            lines.append("  the tuned model was no faster than stock as a whole: every site left stock")
        width = min(max((len(s.where) for s in self.sites), default=4), 64)
        lines.append(
            f"  {'site':<{width}} {'rules':<24} {'calls':>5} {'stock ms':>9} {'fused ms':>9} {'tuned ms':>9}  kept"
        )
        for s in sorted(self.sites, key=lambda s: -(s.stock_ms or 0.0)):
            where = s.where if len(s.where) <= width else "..." + s.where[3 - width :]
            lines.append(
                f"  {where:<{width}} {','.join(s.rules)[:24]:<24} {s.calls:>5} {_ms(s.stock_ms):>9} "
                f"{_ms(s.fused_ms):>9} {_ms(s.tuned_ms):>9}  {'yes' if s.kept else 'no'}"
            )
        return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(stock: float, other: float) -> str:
    return f"{stock / other:.2f}x stock" if other > 0 else "n/a"


# ------------------------------------------------------------------------------------------------ timing

#: what times the sites, by whether the model has CUDA parameters
TIMERS = {True: "CUDA events", False: "time.perf_counter"}


def _enclosing(sites: list[_Site]) -> dict[SiteKey, SiteKey | None]:
    """The nearest enclosing site of each site (same model, module name prefix), None at the top."""
    parent: dict[SiteKey, SiteKey | None] = {}
    for s in sites:
        enclosing = [
            o.key
            for o in sites
            if o.key[0] == s.key[0] and o.key != s.key and (o.key[1] == "" or s.key[1].startswith(o.key[1] + "."))
        ]
        parent[s.key] = max(enclosing, key=lambda k: len(k[1]), default=None)
    return parent


class _SiteTimer:
    """Forward pre-hook/hook pairs on the site modules, accumulating each site's time over one run() call."""

    def __init__(self, sites: list[_Site], cuda: bool, modules: dict[SiteKey, nn.Module] | None = None) -> None:
        self.cuda = cuda
        self.sites = sites
        #: the module now at each site's name: the site module itself, or what a child swap installed in its place
        self.modules = modules or {}
        self._open: dict[SiteKey, list[Any]] = {s.key: [] for s in sites}
        self._spans: dict[SiteKey, list[tuple[Any, Any]]] = {s.key: [] for s in sites}
        self._handles: list[Any] = []
        self.parent = _enclosing(sites)  # a site's time excludes the sites nested in it

    def _stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self) -> _SiteTimer:
        for site in self.sites:
            key = site.key

            def pre(module, args, key=key):
                self._open[key].append(self._stamp())

            def post(module, args, output, key=key):
                if self._open[key]:
                    self._spans[key].append((self._open[key].pop(), self._stamp()))

            # observers: a fused path never treats these as foreign hooks (ldmopt.nn.child_check)
            module = self.modules.get(key, site.module)
            self._handles.append(module.register_forward_pre_hook(observer(pre)))
            self._handles.append(module.register_forward_hook(observer(post)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        for key in self._spans:
            self._spans[key].clear()
            self._open[key].clear()

    def collect(self, whole: frozenset[SiteKey]) -> tuple[dict[SiteKey, float], dict[SiteKey, int]]:
        """(exclusive seconds, calls) of each site since :meth:`reset`; call after the device finished. The sites in
        ``whole`` stay counted in their enclosing site's time too (see :func:`_tune`: its fused forward runs them)."""
        inclusive: dict[SiteKey, float] = {}
        calls: dict[SiteKey, int] = {}
        for key, spans in self._spans.items():
            if self.cuda:
                inclusive[key] = sum(start.elapsed_time(end) for start, end in spans) / 1e3
            else:
                inclusive[key] = sum(end - start for start, end in spans)
            calls[key] = len(spans)
        exclusive = dict(inclusive)
        for key, parent in self.parent.items():
            if parent is not None and key not in whole:
                exclusive[parent] -= inclusive[key]
        return {k: max(v, 0.0) for k, v in exclusive.items()}, calls


@dataclass
class _Measurement:
    site_s: dict[SiteKey, float]  # median exclusive seconds per run() call
    calls: dict[SiteKey, int]
    wall_s: float  # median seconds of a run() call


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _measure(
    run: Callable[[], Any],
    sites: list[_Site],
    modules: dict[SiteKey, nn.Module],
    *,
    warmup: int,
    repeats: int,
    cuda: bool,
    whole: frozenset[SiteKey],
) -> _Measurement:
    """Times ``run()`` and each site in it (``modules``: what is at each site now): ``warmup`` calls, then the
    medians of ``repeats``."""
    per_site: dict[SiteKey, list[float]] = {s.key: [] for s in sites}
    walls: list[float] = []
    calls: dict[SiteKey, int] = {}
    with _SiteTimer(sites, cuda, modules) as timer:
        for _ in range(warmup):
            run()
        for _ in range(repeats):
            timer.reset()
            _synchronize(cuda)
            start = time.perf_counter()
            run()
            _synchronize(cuda)
            walls.append(time.perf_counter() - start)
            seconds, calls = timer.collect(whole)
            for key, value in seconds.items():
                per_site[key].append(value)
    return _Measurement({k: statistics.median(v) for k, v in per_site.items()}, calls, statistics.median(walls))


# ------------------------------------------------------------------------------------------------ sites


def _sites(pipe_or_model: Any) -> list[_Site]:
    """The sites of the live patch on ``pipe_or_model``: modules with counted records, in walk order."""
    sites: dict[int, _Site] = {}
    for label, model in _models_of(pipe_or_model, for_patch=False):
        for holder in model.modules():
            for rec in holder.__dict__.get(_RECORDS, ()):
                if not rec.rule.counted:
                    continue
                site = sites.get(id(rec.site.module))
                if site is None:
                    site = sites[id(rec.site.module)] = _Site((label, rec.site.name), rec.site.module, [])
                site.rules.append((rec.rule.name, rec.rule.family))
                site.records.append((rec.rule, rec.site))
    return list(sites.values())


def _read_touched(sites: list[_Site]) -> None:
    """Fill in each site's touched modules; call on the stock tree (while patched, a rule's ``touched`` names the
    modules it installed, which a later patch's filter_fn never sees)."""
    for site in sites:
        site.touched = [
            (".".join(p for p in (where.name, rel) if p), module)
            for rule, where in site.records
            for rel, module in rule.touched(where).items()
            if rel
        ]


def _current_modules(pipe_or_model: Any, sites: list[_Site]) -> dict[SiteKey, nn.Module]:
    """The module at each site's name now: a child swap puts ldmopt's module where the site's stock module was."""
    models = dict(_models_of(pipe_or_model, for_patch=False))
    return {s.key: models[s.key[0]].get_submodule(s.key[1]) for s in sites}


def _uses_cuda(pipe_or_model: Any) -> bool:
    return any(p.is_cuda for _, model in _models_of(pipe_or_model, for_patch=False) for p in model.parameters())


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ldmopt.tune: {name}={value!r} is not supported; expected an int >= {minimum}")
    return value


# ------------------------------------------------------------------------------------------------ tune


def tune(
    pipe_or_model: Any,
    run: Callable[[], Any],
    *,
    families: Iterable[str] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    min_speedup: float = 1.0,
    rounds: int = 3,
    channels_last_weights: bool | None = None,
) -> PatchReport:
    """Patch ``pipe_or_model`` where the fused forwards measured faster than the stock ones while ``run()`` ran.

    Args:
        pipe_or_model: what :func:`ldmopt.patch` takes (a diffusers pipeline or one ``nn.Module``), unpatched.
        run: a call without arguments that runs the model(s) as they will be used (the same shapes, dtype and
            device): e.g. ``lambda: unet(latents, t, encoder_hidden_states=text)`` under ``torch.no_grad()``, or
            ``lambda: pipe(prompt, num_inference_steps=2)``. It is called ``(warmup + repeats)`` times per
            measured configuration (stock, every site patched, then each refinement round).
        families, filter_fn, channels_last_weights: as for :func:`ldmopt.patch`.
        warmup: calls before each measurement (Triton compiles and autotunes in the first one; statistics are
            handed between fused blocks from a model's second call on).
        repeats: timed calls per configuration; medians decide.
        min_speedup: a site stays patched when its stock time exceeds its fused time times this (1.0: any gain),
            and the tuned model when its run() call does.
        rounds: how many times at most the sites still faster are patched and measured again (each time but the
            last, those no longer faster drop out; the last measurement is the tuned time).

    Returns the :class:`PatchReport` of the final patch, with ``report.tuning`` (:class:`Tuning`): the per-site
    table, and the median time of a ``run()`` call stock, with every site patched, and tuned. Raises
    :class:`PatchError` if the model is already patched (tune patches it itself: ``ldmopt.unpatch`` first). If
    ``run()`` raises, the model is left unpatched and the exception propagates.
    """
    if not callable(run):
        raise TypeError(f"ldmopt.tune: run must be a callable without arguments, got {type(run).__name__}")
    warmup = _check_count("warmup", warmup, 0)
    repeats = _check_count("repeats", repeats, 1)
    rounds = _check_count("rounds", rounds, 1)
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0:
        raise ValueError(f"ldmopt.tune: min_speedup={min_speedup!r} is not supported; expected a number > 0")
    if not math.isfinite(min_speedup):
        raise ValueError(f"ldmopt.tune: min_speedup={min_speedup!r} is not supported; expected a finite number")
    if is_patched(pipe_or_model):
        raise PatchError("ldmopt.tune: the model is already patched; tune patches it itself (ldmopt.unpatch first)")
    options = dict(families=families, channels_last_weights=channels_last_weights)
    first = patch(pipe_or_model, filter_fn=filter_fn, **options)
    try:
        return _tune(pipe_or_model, run, first, filter_fn, options, warmup, repeats, min_speedup, rounds)
    except BaseException:
        if is_patched(pipe_or_model):
            unpatch(pipe_or_model)
        raise


def _where(key: SiteKey) -> str:
    return ".".join(p for p in key if p) or "<root>"


def _faster(fused_s: float, stock_s: float, min_speedup: float) -> bool:
    return fused_s * min_speedup < stock_s


def _tune(
    pipe_or_model: Any,
    run: Callable[[], Any],
    first: PatchReport,
    filter_fn: Callable[[nn.Module, str], bool] | None,
    options: dict,
    warmup: int,
    repeats: int,
    min_speedup: float,
    rounds: int,
) -> PatchReport:
    sites = _sites(pipe_or_model)
    cuda = _uses_cuda(pipe_or_model)
    timer = TIMERS[cuda]
    whole: frozenset[SiteKey] = frozenset()

    def measure() -> _Measurement:
        modules = _current_modules(pipe_or_model, sites)
        return _measure(run, sites, modules, warmup=warmup, repeats=repeats, cuda=cuda, whole=whole)

    fused = measure()
    # A nested site that the patched model never called as a module ran inside its enclosing site's fused forward
    # (e.g. the GEGLU of a transformer block whose fused path reads its weights with the LayerNorm in the loads):
    # its stock time is counted in that site's too, so that both compare the same work, and it follows that site.
    called = {key for key, n in fused.calls.items() if n}
    within: dict[SiteKey, SiteKey] = {}
    tree = _enclosing(sites)
    for s in sites:
        parent = tree[s.key]
        while s.key not in called and parent is not None and parent not in called:
            parent = tree[parent]
        if s.key not in called and parent is not None:
            within[s.key] = parent
    whole = frozenset(within)
    unpatch(pipe_or_model)
    _read_touched(sites)
    stock = measure()
    why: dict[SiteKey, str] = {}
    notes: dict[SiteKey, str] = {}
    kept: set[SiteKey] = set()
    for s in sites:
        f, st = fused.site_s[s.key], stock.site_s[s.key]
        if not stock.calls.get(s.key, 0):
            why[s.key] = "tune: run() never called it, so it was not measured"
        elif s.key not in called and s.key not in within:
            why[s.key] = "tune: run() did not call it with every site patched, so it was not measured"
        elif s.key in within:
            continue  # decided with its enclosing site, below
        elif _faster(f, st, min_speedup):
            kept.add(s.key)
        else:
            why[s.key] = f"tune: fused {f * 1e3:.3f} ms vs stock {st * 1e3:.3f} ms per run() call: no faster"
    for key, parent in within.items():
        if not stock.calls.get(key, 0):
            continue  # not called stock either: not measured (above)
        where = _where(parent)
        if parent in kept:
            kept.add(key)
            notes[key] = f"kept with {where}, whose fused forward runs it in place"
        elif rounds > 1:
            kept.add(key)  # with its enclosing site stock, it runs as a module: measured on its own next round
            notes[key] = f"measured on its own, {where} being stock"
        else:
            why[key] = f"tune: measured only within {where}'s fused forward, which was no faster (rounds=1)"
    tuned_ms: dict[SiteKey, float | None] = {}
    measured_rounds = 1
    report, final = first, stock
    while kept:
        report = patch(pipe_or_model, filter_fn=_keeping(sites, kept, filter_fn), **options)
        final = measure()
        measured_rounds += 1
        for key in kept:
            tuned_ms[key] = final.site_s[key] * 1e3 if final.calls.get(key, 0) else None
        if measured_rounds > rounds:
            break
        # Sites run within a kept site's fused forward (not called as modules) follow it; when it drops out they are
        # measured on their own in the next round.
        dropped = {
            key
            for key in kept
            if final.calls.get(key, 0) and not _faster(final.site_s[key], stock.site_s[key], min_speedup)
        }
        if not dropped:
            break
        for key in dropped:
            first_time = "" if key in within else f"fused {fused.site_s[key] * 1e3:.3f} ms with every site patched, "
            why[key] = (
                f"tune: {first_time}{final.site_s[key] * 1e3:.3f} ms with the slower sites stock (round "
                f"{measured_rounds}): no faster than stock's {stock.site_s[key] * 1e3:.3f} ms per run() call"
            )
        kept -= dropped
        for key, parent in within.items():
            if key in kept and parent in dropped:
                notes[key] = f"measured on its own, {_where(parent)} being stock"
        unpatch(pipe_or_model)
    left_stock = False
    if kept and not _faster(final.wall_s, stock.wall_s, min_speedup):
        left_stock = True
        whole_call = (
            f"tune: the tuned model took {final.wall_s * 1e3:.3f} ms per run() call against "
            f"{stock.wall_s * 1e3:.3f} ms stock, so every site was left stock"
        )
        for key in kept:
            why[key] = whole_call
        kept = set()
        unpatch(pipe_or_model)
    if not kept:
        report, final = first, stock
    report = _final_report(report, first, sites, kept, why)
    report.tuning = Tuning(
        timer=timer,
        warmup=warmup,
        repeats=repeats,
        min_speedup=float(min_speedup),
        rounds=measured_rounds,
        stock_ms=stock.wall_s * 1e3,
        all_patched_ms=fused.wall_s * 1e3,
        tuned_ms=final.wall_s * 1e3,
        left_stock=left_stock,
        sites=[
            SiteTiming(
                model=s.key[0],
                name=s.key[1],
                rules=tuple(rule for rule, _ in s.rules),
                calls=stock.calls.get(s.key, 0),
                stock_ms=stock.site_s[s.key] * 1e3 if stock.calls.get(s.key, 0) else None,
                fused_ms=fused.site_s[s.key] * 1e3 if fused.calls.get(s.key, 0) else None,
                tuned_ms=tuned_ms.get(s.key),
                kept=s.key in kept,
                why=notes.get(s.key, "") if s.key in kept else why[s.key],
            )
            for s in sites
        ],
    )
    return report


def _keeping(
    sites: list[_Site], kept: set[SiteKey], filter_fn: Callable[[nn.Module, str], bool] | None
) -> Callable[[nn.Module, str], bool]:
    """A ``patch`` filter_fn that lets through the kept sites and what their rules fuse, and nothing else (with
    a site left stock, a rule that its rule had claimed a module from could match that module: an unmeasured site).
    """
    allowed = {id(m) for s in sites if s.key in kept for m in (s.module, *(t for _, t in s.touched))}

    def keep(module: nn.Module, qualified: str) -> bool:
        return id(module) in allowed and (filter_fn is None or filter_fn(module, qualified))

    return keep


def _final_report(
    report: PatchReport, first: PatchReport, sites: list[_Site], kept: set[SiteKey], why: dict[SiteKey, str]
) -> PatchReport:
    """``report`` (the final patch's, or ``first`` when nothing stays patched) listing as left on the stock path
    what the plain patch left there (``first``'s reasons) and every rejected site with the times that decided it,
    in place of the exclusions of tune's filter_fn."""
    if report is first:  # nothing patched now: first's replaced modules and weight conversions were undone
        report.replaced = []
        report.converted_weights = {}
        report.kept_weights = {}
    rejected = [s for s in sites if s.key not in kept]
    report.skipped = [
        *first.skipped,
        *(Skipped(s.key[0], s.key[1], rule, family, (why[s.key],)) for s in rejected for rule, family in s.rules),
    ]
    return report


__all__ = ["SiteTiming", "Tuning", "tune"]
