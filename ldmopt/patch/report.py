"""PatchReport: what ``ldmopt.patch`` replaced (per rule, with counts), what it skipped and why, what of the replaced
will run stock per call as the model stands (a LoRA loaded before patch), what ran since."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..ops._dispatch import snapshot_counts


def _where(model: str, name: str) -> str:
    """A module's place for the report: model and name joined, ``<root>`` for a bare model itself."""
    return ".".join(p for p in (model, name) if p) or "<root>"


@dataclass(frozen=True)
class Replaced:
    """One module patched by one rule. ``stock_parts``: why parts of its fused path will run stock on every call (a
    child it reads in place is a LoRA/PEFT, quantized or hooked layer at patch time, an attention runs a processor the
    fused path does not mirror); empty when none will."""

    model: str
    name: str
    rule: str
    family: str
    stock_parts: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return _where(self.model, self.name)


@dataclass(frozen=True)
class Skipped:
    """One module a rule matched but left on the stock path; ``by_user`` when filter_fn excluded it."""

    model: str
    name: str
    rule: str
    family: str
    reasons: tuple[str, ...]
    by_user: bool = False

    @property
    def where(self) -> str:
        return _where(self.model, self.name)


@dataclass
class PatchReport:
    """The outcome of one ``patch`` call. ``str(report)`` is the human summary; the fields are for code and tests.

    ``backends()`` reads ldmopt's process-wide backend counters and returns, per op, how often each backend ran
    since this patch call (all models in the process, so read it right after running the patched model).
    """

    models: dict[str, str] = field(default_factory=dict)
    replaced: list[Replaced] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    already_patched: int = 0
    #: The families this call was asked to apply (that exist); :attr:`matched_families` says which found a module.
    families: tuple[str, ...] = ()
    descriptions: dict[str, str] = field(default_factory=dict)
    _counts_at_patch: Counter = field(default_factory=Counter, repr=False)
    _fallbacks_at_patch: Counter = field(default_factory=Counter, repr=False)
    _fallback_calls_at_patch: Counter = field(default_factory=Counter, repr=False)
    _layout_copies_at_patch: Counter = field(default_factory=Counter, repr=False)
    _handovers_at_patch: Counter = field(default_factory=Counter, repr=False)
    #: Per model: (convs, bytes) whose weights this call made channels-last (``patch(channels_last_weights=)``).
    converted_weights: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Per model with fused convolutions: (convs, bytes) whose weights stay contiguous, and why (the argument).
    kept_weights: dict[str, tuple[int, int]] = field(default_factory=dict)
    kept_weights_reason: str = ""
    #: Objects this call installed that count their own fall-backs (``fallback_reasons``), e.g. processors.
    _counters: list = field(default_factory=list, repr=False)
    #: What ``ldmopt.tune`` measured to choose the patched modules (ldmopt.patch.tune.Tuning); None for ``patch``.
    tuning: Any = None
    #: Families of the modules found already patched by an earlier call (counted in ``already_patched``).
    _families_already: set = field(default_factory=set, repr=False)

    def count_from_now(self) -> None:
        """Start :meth:`backends`, :meth:`fallbacks`, :meth:`layout_copies` and :meth:`handovers` from the counters'
        values now."""
        from ..nn.stats_handover import handed_over
        from ..ops._dispatch import backend_counts, fallback_calls

        self._counts_at_patch = snapshot_counts(backend_counts)
        self._fallbacks_at_patch = fallback_counts()
        self._fallback_calls_at_patch = snapshot_counts(fallback_calls)
        self._layout_copies_at_patch = layout_copy_counts()
        self._handovers_at_patch = snapshot_counts(handed_over)

    def counts(self, model: str | None = None) -> dict[str, int]:
        """{rule name: modules replaced}, over all models or one (its component name, "" for a bare model)."""
        c = Counter(r.rule for r in self.replaced if model is None or r.model == model)
        return dict(sorted(c.items()))

    def skipped_counts(self) -> dict[str, int]:
        """{rule name: modules left on the stock path}, over all models (``skipped`` has each one's reason)."""
        return dict(sorted(Counter(s.rule for s in self.skipped).items()))

    @property
    def total(self) -> int:
        return len(self.replaced)

    @property
    def partly_stock(self) -> list[Replaced]:
        """The patched modules part of whose fused path will run stock on every call (``stock_parts`` says why): known
        at patch time, where :meth:`fallbacks` counts the calls once the model ran."""
        return [r for r in self.replaced if r.stock_parts]

    @property
    def matched_families(self) -> tuple[str, ...]:
        """The requested families with a rule that matched a module in this call: patched it, left it on the stock
        path (``skipped``) or found it already patched."""
        found = {r.family for r in self.replaced} | {s.family for s in self.skipped} | self._families_already
        return tuple(f for f in self.families if f in found)

    @property
    def unmatched_families(self) -> tuple[str, ...]:
        """The requested families that found nothing to patch in these models (e.g. temporal_attention on SD1.5)."""
        matched = set(self.matched_families)
        return tuple(f for f in self.families if f not in matched)

    def backends(self) -> dict[str, dict[str, int]]:
        """{op: {backend: calls}} since the patch call, from ldmopt.ops._dispatch.backend_counts."""
        from ..ops._dispatch import backend_counts

        out: dict[str, dict[str, int]] = {}
        for (op, backend), n in sorted(snapshot_counts(backend_counts).items()):
            delta = n - self._counts_at_patch.get((op, backend), 0)
            if delta > 0:
                out.setdefault(op, {})[backend] = delta
        return out

    def handovers(self) -> dict[str, int]:
        """{consumer: calls} since the patch call: fused norms that ran no statistics pass of their own because the
        module that wrote their input summed its statistics in an epilogue and handed them over
        (ldmopt.nn.stats_handover; plain eager calls only, e.g. under torch.no_grad, not torch.inference_mode),
        process-wide. Statistics passed on within one fused block or temporal container are not counted here."""
        from ..nn.stats_handover import handed_over

        return _increase(dict(sorted(snapshot_counts(handed_over).items())), self._handovers_at_patch)

    def layout_copies(self) -> dict[str, int]:
        """{what: calls} since the patch call: fused calls that first copied their input to channels-last (e.g. a
        ResnetBlock2D given an NCHW tensor by a video model's temporal container) or their conv weight (a model
        whose weights patch left contiguous), process-wide."""
        return _increase(layout_copy_counts(), self._layout_copies_at_patch)

    def fallbacks(self) -> dict[str, int]:
        """{reason: calls} since the patch call: patched modules that ran the stock path for a call (e.g. a
        ResnetBlock2D in training with dropout) and ops that ran their reference backend because the kernels
        refused an input (fp64, no Triton, a layout ...: each refusing backend's reason), process-wide. Which
        backend each op ran is in :meth:`backends`."""
        return self._fallbacks(_FALLBACK_COUNTERS)

    def _fallbacks(self, counters) -> dict[str, int]:
        """:meth:`fallbacks` from the module counters ``counters`` (and the installed processors')."""
        out = _increase(fallback_counts(counters), self._fallbacks_at_patch)
        for proc in self._counters:
            for reason, n in snapshot_counts(getattr(proc, "fallback_reasons", {})).items():
                key = f"{type(proc).__name__} ran the stock processor: {reason}"
                out[key] = out.get(key, 0) + n
        return out

    def _fallback_summary(self) -> dict[str, int]:
        """:meth:`fallbacks` with one line per op call instead of one per refusing backend: the ops' lines come from
        the per-call record (``fallback_calls``), each listing every backend's reason that call met."""
        from ..ops._dispatch import OTHER_REASONS, fallback_calls

        summary = self._fallbacks(_NOT_OP_COUNTERS)
        for key, n in _increase(snapshot_counts(fallback_calls), self._fallback_calls_at_patch).items():
            if key == OTHER_REASONS:
                text = f"an op ran the reference backend: {key}"
            else:
                op, refusals = key
                text = f"{op} ran the reference backend ({'; '.join(f'{b} refused: {r}' for b, r in refusals)})"
            summary[text] = summary.get(text, 0) + n
        return summary

    def __str__(self) -> str:
        models = ", ".join(f"{k or 'model'} ({v})" for k, v in self.models.items()) or "none"
        partly = len(self.partly_stock)
        lines = [
            f"ldmopt.patch: {self.total} modules patched"
            + (f" ({partly} with parts that run stock on every call)" if partly else "")
            + f", {len(self.skipped)} left on the stock path"
            + (f", {self.already_patched} already patched" if self.already_patched else "")
            + f"; models: {models}; {self._families_line()}"
        ]
        for model in self.models:
            counts = self.counts(model)
            if not counts:
                continue
            lines.append(f"  {model or 'model'}:")
            for rule, n in counts.items():
                lines.append(f"    {rule:<24} {n:>4}  {self.descriptions.get(rule, '')}")
        if self.converted_weights:
            lines.append(
                "  conv weights made channels-last, the layout the fused convolutions read (unpatch restores; "
                "safetensors' save_file refuses them while patched, save_pretrained does not): "
                + _weights(self.converted_weights)
            )
        if self.kept_weights:
            lines.append(
                f"  conv weights left contiguous ({self.kept_weights_reason}): {_weights(self.kept_weights)}; on "
                "the triton backend each fused convolution copies its weight to channels-last per call, the layout "
                "its kernel reads. Unless FSDP will shard the model: patch(..., channels_last_weights=True) (patch "
                "again to convert them now)"
            )
        if partly:
            lines.append("  patched, but parts run stock on every call (layers the fused path reads in place):")
            lines += _grouped((r.rule, r.stock_parts, r.where) for r in self.partly_stock)
        if self.skipped:
            lines.append("  left on the stock path:")
            lines += _grouped((s.rule, s.reasons, s.where) for s in self.skipped)
        ran = self.backends()
        if ran:
            lines.append("  backends that ran since patch (process-wide):")
            for op, per in ran.items():
                lines.append(f"    {op:<24} " + ", ".join(f"{b} x{n}" for b, n in per.items()))
        else:
            lines.append("  backends: nothing has run since patch (run the model, then print the report)")
        handed = self.handovers()
        if handed:
            lines.append(
                "  statistics passes skipped since patch (the norm's input came with its statistics): "
                + ", ".join(f"{consumer} x{n}" for consumer, n in handed.items())
            )
        copies = self.layout_copies()
        if copies:
            lines.append("  fused calls that first copied their input or weight to channels-last since patch:")
            for what, n in sorted(copies.items(), key=lambda kv: -kv[1]):
                lines.append(f"    x{n:<5} {what}")
        fell_back = self._fallback_summary()
        if fell_back:
            lines.append("  calls that took the stock or reference path since patch:")
            for reason, n in sorted(fell_back.items(), key=lambda kv: -kv[1]):
                lines.append(f"    x{n:<5} {reason}")
        if self.tuning is not None:
            lines.append(str(self.tuning))
        return "\n".join(lines)

    def _families_line(self) -> str:
        if not self.families:
            return "families: none"
        unmatched = self.unmatched_families
        if len(unmatched) == len(self.families):
            return f"families: {', '.join(self.families)} (requested; none matched a module here)"
        line = f"families: {', '.join(self.matched_families)}"
        return line + (f" (matched nothing here: {', '.join(unmatched)})" if unmatched else "")


def _grouped(entries) -> list[str]:
    """One line per (rule, reasons), naming two of its modules: (rule, reasons, where) entries."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for rule, reasons, where in entries:
        groups.setdefault((rule, reasons), []).append(where)
    lines = []
    for (rule, reasons), where in groups.items():
        more = f" (+{len(where) - 2} more)" if len(where) > 2 else ""
        lines.append(f"    {', '.join(where[:2])}{more} [{rule}]: {'; '.join(reasons)}")
    return lines


def _increase(now: dict, before: dict) -> dict:
    """The counts in ``now`` that grew since ``before``, by how much, in ``now``'s order."""
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


def _weights(per_model: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{m or 'model'} {n} ({size / 2**20:.1f} MiB)" for m, (n, size) in per_model.items())


def _module_fallback(reason: str) -> str:
    return f"ResnetBlock2D ran diffusers' forward: {reason}"


def _op_fallback(key: tuple[str, str, str] | str) -> str:
    if isinstance(key, str):  # OTHER_REASONS
        return f"an op ran the reference backend: {key}"
    op, backend, reason = key
    return f"{op} ran the reference backend ({backend} refused: {reason})"


def _layout_fallback(key: tuple[str, str] | str) -> str:
    if isinstance(key, str):  # OTHER_REASONS
        return f"a temporal layer ran diffusers' forward: {key}"
    kind, reason = key
    return f"{kind} ran diffusers' forward: {reason}"


# Per-call fall-back counters of the fused modules and ops: (module, attribute, formatter of a key).
_FALLBACK_COUNTERS = (
    ("ldmopt.nn.resnet", "fallback_reasons", _module_fallback),
    ("ldmopt.ops._dispatch", "fallback_reasons", _op_fallback),
    ("ldmopt.nn.temporal_layout", "fallback_reasons", _layout_fallback),
    ("ldmopt.nn.child_check", "fallback_reasons", str),
)
#: The module counters but the ops' per-backend one (the summary lists the ops' per-call record instead).
_NOT_OP_COUNTERS = tuple(c for c in _FALLBACK_COUNTERS if c[0] != "ldmopt.ops._dispatch")
# Per-call layout-copy counters: (module, attribute, label prefix).
_LAYOUT_COUNTERS = (
    ("ldmopt.ops.gn_conv2d", "fused conv: "),
    ("ldmopt.nn.resnet", "ResnetBlock2D: "),
    ("ldmopt.nn.temporal_layout", ""),
    ("ldmopt.nn.temporal_resnet", ""),
)


def layout_copy_counts() -> Counter:
    """{description: count} of the layout copies the fused modules loaded so far made before fusing."""
    out: Counter = Counter()
    for module_name, prefix in _LAYOUT_COUNTERS:
        for what, n in snapshot_counts(getattr(sys.modules.get(module_name), "layout_conversions", None) or {}).items():
            out[f"{prefix}{what}"] += n
    return out


def fallback_counts(counters=_FALLBACK_COUNTERS) -> Counter:
    """{description: count} from the fall-back counters of the ldmopt modules loaded so far. Each counter is copied
    first (snapshot_counts): other threads may be adding keys while it is read."""
    out: Counter = Counter()
    for module_name, attr, describe in counters:
        for key, n in snapshot_counts(getattr(sys.modules.get(module_name), attr, None) or {}).items():
            out[describe(key)] += n
    return out
