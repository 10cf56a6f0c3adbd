"""``ldmopt.tune(pipe, run)``: patch only the modules whose fused forward measured faster than the stock one.

Whether a fused kernel beats cuDNN/cuBLAS depends on the GPU, the shapes, the dtype and the host. On an H200
(2026-12-04, benchmarks/RESULTS.md) the temporal attention kernel ran 3.7-13.6x faster than diffusers' eager path
while the Triton convolution was slower than cuDNN at Stable Diffusion shapes, so a whole-model ``patch`` made an SD1.5
step slower and a video step faster. ``tune`` measures instead of guessing, on the caller's own GPU and inputs:

1. ``patch`` the model as usual. Each *site* (a module a rule patched; several rules on one module are one site) is
   timed while ``run()`` executes (ldmopt/patch/tune_timer.py: CUDA events on the stream of the device the work is
   on, ``time.perf_counter`` for CPU work; a site's time leaves out the sites that run inside it). ``warmup`` calls
   first (Triton compiles and autotunes there), then the medians of ``repeats`` calls.
2. ``unpatch``; the same timing of the stock model.
3. ``patch`` again, only the sites whose fused time was below their stock time (by ``min_speedup``), and time again:
   a site can lose what a rejected neighbour handed it (GroupNorm statistics summed in the neighbour's epilogue),
   so one that is now no faster drops out and the rest are measured again, up to ``rounds`` times.
4. The whole ``run()`` call, tuned against stock, timed without any hook: when the tuned model is not faster, it is
   left stock.

The model ends patched with the kept sites (or stock). The returned :class:`PatchReport` lists every rejected site
among the modules left on the stock path, with the times that decided it; ``report.tuning`` has the table. Sites
``run()`` never called are not measured and stay stock. Rounds only drop sites: a site rejected because work that
pays off in a neighbour (statistics for the next GroupNorm) is charged to it is not tried again on its own; but when
every site patched ran faster than the choice, the whole call is timed with every site patched too, and that is kept
if it is faster still. Per-site timing sees forward passes only: ``training=True`` times whole training steps rule by
rule instead (tune_rules.py). CUDA graphs remove host time, which is most of what small fused calls lose in eager
mode: a captured model may gain from sites tune rejects here (``cuda_graph=True``). ``report.tuning.choice()`` keeps
the decision, and :func:`ldmopt.patch_tuned` applies it to an identical model without measuring (tune_choice.py).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .core import PatchError, is_patched, patch, unpatch
from .report import PatchReport, Skipped
from .targets import models_of
from .tune_sites import TuneSite, current_targets, enclosing_sites, patched_sites, read_touched
from .tune_timer import Measurement, SiteKey, measure, measure_graphed, wall_time


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
        return _where((self.model, self.name))


@dataclass
class Tuning:
    """What ``tune`` measured: per-site rows and whole-call medians in milliseconds. ``stock_ms`` and ``tuned_ms``
    come from the hook-free comparison of the two (when sites were kept; else both are the stock call, hooks
    attached), ``all_patched_ms`` from the first measurement, hooks attached."""

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
    #: by="rule": each group of sites with the same rules, timed patched alone (tune_rules.GroupTiming)
    groups: list[Any] = field(default_factory=list)
    #: what tune patched with (patch's families and training arguments) and where it measured (tune_choice)
    families: tuple[str, ...] | None = None
    training: bool = False
    channels_last_weights: bool | None = None
    filtered: bool = False  # a filter_fn decided which sites there were
    measured_on: dict[str, Any] = field(default_factory=dict)

    def choice(self) -> dict[str, Any]:
        """The decision as plain JSON-ready data, for :func:`ldmopt.patch_tuned` on an identical model (another
        process, every rank of a data-parallel run) without measuring again: the sites kept and left stock, with
        their rules and reasons, the patch options, and where it was measured."""
        from .tune_choice import make_choice

        return make_choice(self, self.measured_on)

    def save(self, path: Any) -> Any:
        """Write :meth:`choice` as JSON to ``path``; returns the path (a ``pathlib.Path``)."""
        from .tune_choice import save

        return save(self.choice(), path)

    @property
    def kept(self) -> list[SiteTiming]:
        return [s for s in self.sites if s.kept]

    def kept_per_rule(self) -> dict[str, tuple[int, int]]:
        """{rules of a site, joined by "+": (sites kept, sites)}."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.sites:
            kept, total = out.get("+".join(s.rules), (0, 0))
            out["+".join(s.rules)] = (kept + s.kept, total + 1)
        return dict(sorted(out.items()))

    def kept_per_rule_text(self) -> str:
        """:meth:`kept_per_rule` as "rules kept/sites, ..."."""
        return ", ".join(f"{rule} {kept}/{total}" for rule, (kept, total) in self.kept_per_rule().items())

    def __str__(self) -> str:
        if not self.sites:
            return "ldmopt.tune: patch fuses no module of this model: nothing to tune"
        head = (
            f"ldmopt.tune ({self.timer}; median of {self.repeats} calls after {self.warmup} warm-up, "
            f"{self.rounds} patched configurations): run() {self.stock_ms:.3f} ms stock, "
            f"{self.all_patched_ms:.3f} ms with every site patched, {self.tuned_ms:.3f} ms tuned "
            f"({_ratio(self.stock_ms, self.tuned_ms)}); {len(self.kept)} of {len(self.sites)} sites kept"
        )
        lines = [head, f"  kept per rule: {self.kept_per_rule_text()}"]
        if self.left_stock:
            lines.append("  the tuned model was no faster than stock as a whole: every site left stock")
        if self.groups:
            width = max(len(g.rules) for g in self.groups)
            lines.append(f"  {'rules (patched alone)':<{width}} {'sites':>5} {'run() ms':>9}  kept")
            for g in sorted(self.groups, key=lambda g: g.patched_ms):
                lines.append(f"  {g.rules:<{width}} {g.sites:>5} {g.patched_ms:>9.3f}  {'yes' if g.kept else 'no'}")
            return "\n".join(lines)
        width = min(max(len(s.where) for s in self.sites), 64)
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


def _cuda_devices(pipe_or_model: Any) -> set[torch.device]:
    return {p.device for _, model in models_of(pipe_or_model, for_patch=False) for p in model.parameters() if p.is_cuda}


def _meta_models(pipe_or_model: Any) -> list[str]:
    """Labels of the models with parameters on the meta device, where calls run no kernels and time nothing real."""
    return [
        label or type(model).__name__
        for label, model in models_of(pipe_or_model, for_patch=False)
        if any(p.is_meta for p in model.parameters())
    ]


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"ldmopt.tune: {name}={value!r} is not supported; expected an int >= {minimum}")
    return int(value)


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
    cuda_graph: bool = False,
    training: bool = False,
    by: str | None = None,
    channels_last_weights: bool | None = None,
) -> PatchReport:
    """Patch ``pipe_or_model`` where the fused forwards measured faster than the stock ones while ``run()`` ran.

    Args:
        pipe_or_model: what :func:`ldmopt.patch` takes (a diffusers pipeline or one ``nn.Module``), unpatched.
        run: a call without arguments that runs the model(s) as they will be used (the same shapes, dtype and
            device): e.g. ``lambda: unet(latents, t, encoder_hidden_states=text)`` under ``torch.no_grad()``, or
            ``lambda: pipe(prompt, num_inference_steps=2)``. It is called ``(warmup + repeats)`` times per
            measured configuration (every site patched, stock, each refinement round), and twice that for the
            final comparison. Site modules must be called as modules (``model(...)``, not ``model.forward(...)``).
        families, filter_fn, channels_last_weights: as for :func:`ldmopt.patch`.
        warmup: calls before each measurement (Triton compiles and autotunes in the first one; statistics are
            handed between fused blocks from a model's second call on).
        repeats: timed calls per configuration; medians decide.
        min_speedup: a site stays patched when its stock time exceeds its fused time times this (1.0: any gain).
            The tuned model as a whole must only be faster than stock.
        rounds: how many times at most the sites still faster are patched and measured again (each time but the
            last, those no longer faster drop out; the last measurement is the tuned one).
        cuda_graph: time each configuration captured as a CUDA graph and replayed (GPU time, no host time), for a
            model that will run captured (``torch.cuda.graph``); ``run()`` must then be capturable: GPU tensors,
            no host synchronisation, the same input buffers each call. The model must be on a GPU.
        training: patch as ``ldmopt.patch(..., training=True)`` does, for a ``run()`` that is a training step
            (forward, backward, optionally the optimizer step: tune calls it many times, so an optimizer step
            trains the model meanwhile). Implies ``by="rule"``.
        by: "site" (default without training): time each site's forward with hooks and choose site by site.
            "rule" (tune_rules.py): time whole ``run()`` calls with each rule's sites patched alone (then the
            faster rules together, and every site patched), which counts backward passes too; ``rounds`` does not
            apply.

    Returns the :class:`PatchReport` of the final patch, with ``report.tuning`` (:class:`Tuning`): the per-site
    table, and the median time of a ``run()`` call stock, with every site patched, and tuned. Its backend and
    fall-back counts start after tune's own calls. Raises :class:`PatchError` if the model is already patched (tune
    patches it itself: ``ldmopt.unpatch`` first). If ``run()`` raises, the model is left unpatched and the exception
    propagates. Do not call the model from other threads while it is being tuned.
    """
    if not callable(run):
        raise TypeError(f"ldmopt.tune: run must be a callable without arguments, got {type(run).__name__}")
    warmup = _check_count("warmup", warmup, 0)
    repeats = _check_count("repeats", repeats, 1)
    rounds = _check_count("rounds", rounds, 1)
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, numbers.Real) or not min_speedup > 0:
        raise ValueError(f"ldmopt.tune: min_speedup={min_speedup!r} is not supported; expected a number > 0")
    if not math.isfinite(min_speedup):
        raise ValueError(f"ldmopt.tune: min_speedup={min_speedup!r} is not supported; expected a finite number")
    if is_patched(pipe_or_model):
        raise PatchError("ldmopt.tune: the model is already patched; tune patches it itself (ldmopt.unpatch first)")
    on_meta = _meta_models(pipe_or_model)
    if on_meta:
        raise ValueError(
            f"ldmopt.tune: {', '.join(on_meta)} has parameters on the meta device, where a call runs no kernel and its "
            "time is only Python's; load or build the model on cpu or cuda (FLOPs and bytes on meta: ldmopt.analyze)"
        )
    gpus = _cuda_devices(pipe_or_model)
    if cuda_graph and len(gpus) != 1:
        where = f"on {sorted(map(str, gpus))}" if gpus else "not on CUDA"
        raise ValueError(
            "ldmopt.tune: cuda_graph=True needs the model on a GPU, one (a CUDA graph holds the work of one GPU); its "
            f"parameters are {where}"
        )
    by = by or ("rule" if training else "site")
    if by not in ("site", "rule"):
        raise ValueError(f"ldmopt.tune: by={by!r} is not supported; expected 'site' or 'rule'")
    if training and by == "site":
        raise ValueError(
            "ldmopt.tune: by='site' times forward passes only (module hooks do not see backward); with "
            "training=True, tune times whole training steps: by='rule' (the default for training)"
        )
    if families is not None and not isinstance(families, str):
        families = tuple(families)  # every patch call below reads it: a generator would be spent by the first
    options = dict(families=families, channels_last_weights=channels_last_weights, training=bool(training))
    first = patch(pipe_or_model, filter_fn=filter_fn, **options)
    try:
        sites = patched_sites(pipe_or_model)
        job = _Job(
            pipe_or_model, run, first, sites, gpus, filter_fn, options, warmup, repeats, float(min_speedup),
            bool(cuda_graph),
        )  # fmt: skip
        if not sites:  # nothing to measure
            unpatch(pipe_or_model)
            report = job.finish(set(), {})
            report.tuning = Tuning("none", warmup, repeats, job.min_speedup, 0, math.nan, math.nan, math.nan, False)
        elif by == "rule":
            from .tune_rules import tune_by_rule

            report = tune_by_rule(job)
        else:
            report = _tune(job, rounds)
    except BaseException:
        try:
            if is_patched(pipe_or_model):
                unpatch(pipe_or_model)
        except Exception as error:  # the caller's exception is the one to see
            warnings.warn(f"ldmopt.tune failed and could not unpatch the model: {error}", RuntimeWarning, stacklevel=2)
        raise
    from .tune_choice import measured_on, parameter_dtypes

    report.tuning.families = (families,) if isinstance(families, str) else families
    report.tuning.training = bool(training)
    report.tuning.channels_last_weights = channels_last_weights
    report.tuning.filtered = filter_fn is not None
    report.tuning.measured_on = measured_on(gpus, parameter_dtypes(pipe_or_model))
    report.count_from_now()  # what ran since patch: from here on, not tune's own calls
    return report


def _where(key: SiteKey) -> str:
    return ".".join(p for p in key if p) or "<root>"


@dataclass
class _Job:
    """What both ways of tuning (by site here, by rule in tune_rules.py) work from."""

    pipe_or_model: Any
    run: Callable[[], Any]
    first: PatchReport  # the plain patch's report: its reasons for what it left stock
    sites: list[TuneSite]
    devices: set[torch.device]  # the CUDA devices of the model's parameters
    filter_fn: Callable[[nn.Module, str], bool] | None
    options: dict  # patch's other arguments
    warmup: int
    repeats: int
    min_speedup: float
    graph: bool

    def patch_only(self, kept: set[SiteKey]) -> PatchReport:
        """Patch the ``kept`` sites, and nothing else."""
        return patch(self.pipe_or_model, filter_fn=_keeping(self.sites, kept, self.filter_fn), **self.options)

    def finish(self, kept: set[SiteKey], why: dict[SiteKey, str]) -> PatchReport:
        """The stock model patched at the ``kept`` sites; its report lists the others with ``why``."""
        report = self.patch_only(kept) if kept else self.first
        return _final_report(report, self.first, self.sites, kept, why)


def _left_stock_reason(tuned_s: float, stock_s: float) -> str:
    """Why every site stayed stock: the tuned model as a whole was no faster (both ways of tuning say it so)."""
    return (
        f"tune: the tuned model took {tuned_s * 1e3:.3f} ms per run() call against {stock_s * 1e3:.3f} ms stock, "
        "so every site was left stock"
    )


def _faster(fused_s: float, stock_s: float, min_speedup: float) -> bool:
    return fused_s * min_speedup < stock_s


def _tune(job: _Job, rounds: int) -> PatchReport:
    pipe_or_model, sites, min_speedup, graph = job.pipe_or_model, job.sites, job.min_speedup, job.graph
    whole: frozenset[SiteKey] = frozenset()
    timers: set[str] = set()

    def timed() -> Measurement:
        targets = current_targets(pipe_or_model, sites)
        result = (measure_graphed if graph else measure)(
            job.run, targets, job.devices, warmup=job.warmup, repeats=job.repeats, whole=whole
        )
        timers.update(name for name, used in (("CUDA events", result.cuda), ("time.perf_counter", result.cpu)) if used)
        return result

    fused = timed()
    # A nested site that the patched model never called as a module ran inside its enclosing site's fused forward
    # (a fused path that reads its weights instead): its stock time stays in that site's too, so that both compare
    # the same work (tune_timer), and it follows that site.
    called = {key for key, n in fused.calls.items() if n}
    within: dict[SiteKey, SiteKey] = {}
    tree = enclosing_sites(sites)
    for s in sites:
        parent = tree[s.key]
        while s.key not in called and parent is not None and parent not in called:
            parent = tree[parent]
        if s.key not in called and parent is not None:
            within[s.key] = parent
    whole = frozenset(within)
    unpatch(pipe_or_model)
    read_touched(sites)
    stock = timed()
    why: dict[SiteKey, str] = {}
    notes: dict[SiteKey, str] = {}
    kept: set[SiteKey] = set()
    for s in sites:
        f, st = fused.site_s[s.key], stock.site_s[s.key]
        if not stock.calls.get(s.key, 0):
            why[s.key] = "tune: run() never called it on the stock model, so it was not measured"
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
        if parent in kept:
            kept.add(key)
            notes[key] = f"kept with {_where(parent)}, whose fused forward runs it in place"
        elif rounds > 1:
            kept.add(key)  # with its enclosing site stock, it runs as a module: measured on its own next round
            notes[key] = f"measured on its own, {_where(parent)} being stock"
        else:
            why[key] = f"tune: measured only within {_where(parent)}'s fused forward, which was no faster (rounds=1)"
    tuned_ms: dict[SiteKey, float | None] = {}
    measured_rounds = 1
    tuned_hooked_s = stock.wall_s  # the last measured configuration's whole call, hooks attached
    while kept:
        job.patch_only(kept)
        final = timed()
        tuned_hooked_s = final.wall_s
        measured_rounds += 1
        for key in kept:
            tuned_ms[key] = final.site_s[key] * 1e3 if final.calls.get(key, 0) else None
        # Where each site run in place ran this round: inside its nearest enclosing site called as a module (a
        # parent left stock may run it inside a grandparent's fused forward), or on its own, measured (no longer
        # "within" anything).
        for key in [k for k in within if k in kept]:
            if final.calls.get(key, 0):
                del within[key]
                continue
            parent = tree[key]
            while parent is not None and not final.calls.get(parent, 0):
                parent = tree[parent]
            if parent is not None:
                within[key] = parent
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
            first_time = "" if key in whole else f"fused {fused.site_s[key] * 1e3:.3f} ms with every site patched, "
            why[key] = (
                f"tune: {first_time}{final.site_s[key] * 1e3:.3f} ms with the slower sites stock (round "
                f"{measured_rounds}): no faster than stock's {stock.site_s[key] * 1e3:.3f} ms per run() call"
            )
        kept -= dropped
        last = measured_rounds + 1 > rounds  # the next measurement is the tuned one, and checks nothing
        for key, parent in within.items():
            if key in kept and parent in dropped:
                if last:  # measured only within the parent so far, and no round left to check it on its own
                    kept.discard(key)
                    why[key] = (
                        f"tune: measured only within {_where(parent)}'s fused forward, which dropped out in the "
                        "last round"
                    )
                else:
                    notes[key] = f"measured on its own, {_where(parent)} being stock"
        unpatch(pipe_or_model)
    for key in kept:
        if tuned_ms.get(key) is not None and not _faster(tuned_ms[key] / 1e3, stock.site_s[key], min_speedup):
            notes[key] = "kept: faster in an earlier round; the last (tuned) measurement checks nothing"
    if not kept:  # the choice is stock, whatever the dropped configurations measured
        tuned_hooked_s = stock.wall_s
    stock_s = tuned_s = stock.wall_s
    left_stock = False
    if kept:  # the whole call, without hooks: tuned (warm from the last measurement), then stock
        tuned_s = wall_time(job.run, job.devices, warmup=1 if graph else 0, repeats=job.repeats, graph=graph)
    # Sites that pay only together (a producer's epilogue statistics are its consumer's gain) are each no faster on
    # their own: when every site patched ran faster than the choice, hooks attached, the whole call decides.
    every = {s.key for s in sites if stock.calls.get(s.key, 0)}
    if kept != every and fused.wall_s < tuned_hooked_s and _faster(fused.wall_s, stock.wall_s, min_speedup):
        if is_patched(pipe_or_model):
            unpatch(pipe_or_model)
        job.patch_only(every)
        every_s = wall_time(job.run, job.devices, warmup=job.warmup, repeats=job.repeats, graph=graph)
        measured_rounds += 1
        if not kept or every_s < tuned_s:
            if kept:
                together = (
                    f"kept: with every site patched run() took {every_s * 1e3:.3f} ms, less than with only the "
                    f"sites faster on their own ({tuned_s * 1e3:.3f} ms): they pay together"
                )
            else:
                together = (
                    "kept: no site was faster on its own, but every site patched was faster as a whole "
                    f"({every_s * 1e3:.3f} ms per run() call, no hooks): they pay together"
                )
            for key in every:  # the first measurement's configuration: its per-site times are the tuned ones
                why.pop(key, None)
                notes[key] = together
                tuned_ms[key] = fused.site_s[key] * 1e3 if fused.calls.get(key, 0) else None
            kept, tuned_s = set(every), every_s
    if kept:
        if is_patched(pipe_or_model):
            unpatch(pipe_or_model)
        stock_s = wall_time(job.run, job.devices, warmup=job.warmup, repeats=job.repeats, graph=graph)
        if not tuned_s < stock_s:
            left_stock = True
            why.update(dict.fromkeys(kept, _left_stock_reason(tuned_s, stock_s)))
            kept = set()
    report = job.finish(kept, why)
    report.tuning = Tuning(
        timer=" and ".join(sorted(timers)) + (" in a CUDA graph" if graph else "") if timers else "none",
        warmup=job.warmup,
        repeats=job.repeats,
        min_speedup=min_speedup,
        rounds=measured_rounds,
        stock_ms=stock_s * 1e3,
        all_patched_ms=fused.wall_s * 1e3,
        tuned_ms=tuned_s * 1e3,
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
    sites: list[TuneSite], kept: set[SiteKey], filter_fn: Callable[[nn.Module, str], bool] | None
) -> Callable[[nn.Module, str], bool]:
    """A ``patch`` filter_fn that lets through the kept sites and what their rules fuse, and nothing else (with
    a site left stock, a rule that its rule had claimed a module from could match that module: an unmeasured site).
    """
    allowed = {id(m) for s in sites if s.key in kept for m in (s.module, *s.touched)}

    def keep(module: nn.Module, qualified: str) -> bool:
        return id(module) in allowed and (filter_fn is None or filter_fn(module, qualified))

    return keep


def _final_report(
    report: PatchReport, first: PatchReport, sites: list[TuneSite], kept: set[SiteKey], why: dict[SiteKey, str]
) -> PatchReport:
    """``report`` (the final patch's, or ``first`` when nothing stays patched) listing as left on the stock path
    what the plain patch left there (``first``'s reasons), what the caller's filter_fn excluded from a kept site
    that the plain patch had not (``patch_tuned`` compares sites without it: a rule of a site with several), and
    every rejected site with the times that decided it, in place of the exclusions of tune's filter_fn."""
    listed = {(s.model, s.name, s.rule) for s in first.skipped}
    # The final patch's filter lets every module of a kept site through but for the caller's exclusions.
    callers = [
        s
        for s in (report.skipped if report is not first else ())
        if s.by_user and (s.model, s.name) in kept and (s.model, s.name, s.rule) not in listed
    ]
    if report is first:  # nothing patched now: what first's patch did was undone
        report.replaced = []
        report.converted_weights = {}
        report.kept_weights = {}
        report.kept_weights_reason = ""
        report._counters = []
    rejected = [s for s in sites if s.key not in kept]
    report.skipped = [
        *first.skipped,
        *callers,
        *(Skipped(s.key[0], s.key[1], rule, family, (why[s.key],)) for s in rejected for rule, family in s.rules),
    ]
    return report


__all__ = ["SiteTiming", "Tuning", "tune"]
