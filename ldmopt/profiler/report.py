"""Plain-text tables for ``Analysis`` and ``Profile`` (the CLI and ``str()`` use them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import categories as C

if TYPE_CHECKING:
    from .cost import Analysis


def si(value: float, unit: str = "") -> str:
    """1.61e12 -> '1.61 T'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def render_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """Fixed-width text table; ``align`` is one char per column ('l' or 'r')."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def format_analysis(a: Analysis) -> str:
    out = [
        f"ldmopt analyze: {a.setting()}  [{a.model_class}, {si(a.params)} parameters]",
        "ANALYTIC (meta tensors, no GPU ran): FLOPs are counted; bytes are minimum HBM traffic; times are roofline "
        f"PROJECTIONS on {a.gpu.name} datasheet peaks",
    ]
    forward_flops = a.flops_of(*C.CATEGORIES, phase="forward")
    check = ""
    if a.flop_counter_total is not None:
        same = a.flop_counter_total == forward_flops
        of = " of the forward" if a.training else ""
        check = (f"  (torch.utils.flop_counter{of}: {si(a.flop_counter_total, 'FLOP')}, "
                 f"{'equal' if same else 'DIFFERS'})")  # fmt: skip
    if a.training:
        backward = a.flops_of(*C.CATEGORIES, phase="backward")
        out.append(f"FLOPs per training step: {si(a.total_flops, 'FLOP')} (forward {si(forward_flops, 'FLOP')}, "
                   f"backward {si(backward, 'FLOP')}){check}")  # fmt: skip
    else:
        out.append(f"FLOPs per call: {si(a.total_flops, 'FLOP')}{check}")
    phases = ""
    if a.training:
        phases = " (" + ", ".join(f"{p} {a.phase_time_s(p) * 1e3:.2f}" for p in a.phases) + ")"
    out.append(
        f"projected time on {a.gpu.name}: {a.time_s * 1e3:.2f} ms as is{phases}, {a.patched_time_s * 1e3:.2f} ms as "
        f"ldmopt patches it; minimum bytes {si(a.total_bytes, 'B')} -> {si(a.patched_bytes, 'B')}; "
        f"{a.ops} ops -> {sum(c.patched_ops for c in a.categories.values())}"
    )
    shares_t, shares_f, shares_p = a.shares("time"), a.shares("flops"), a.shares("time", patched=True)
    rows = []
    for key, cost in a.categories.items():
        if not cost.ops:
            continue
        rows.append([
            C.LABELS[key], si(cost.flops), pct(shares_f[key]), si(cost.bytes, "B"), f"{cost.time_s * 1e3:.3f}",
            pct(shares_t[key]), si(cost.patched_bytes, "B"), f"{cost.patched_time_s * 1e3:.3f}", pct(shares_p[key]),
        ])  # fmt: skip
    headers = ["category", "FLOPs", "share", "bytes", "proj. ms", "share", "patched B", "patched ms", "share"]
    out += ["", render_table(headers, rows)]
    if a.training:
        out += ["", "training step by phase (projected ms; share of the step as is):", _phase_table(a)]
    split = a.attention_split("time")
    if any(split.values()):
        out.append("")
        out.append(
            "attention (projected time): "
            + ", ".join(f"{k} {pct(v).strip()}" for k, v in split.items() if v or k != "unattributed")
        )
        layers = a.attention_layer_split()
        out.append(
            "attention modules incl. projections (projected time): "
            + ", ".join(f"{k} {pct(v).strip()}" for k, v in layers.items())
        )
    seq = a.sequence_lengths()
    if seq:
        rows = [
            [g["kind"], f"{g['q_len']} x {g['kv_len']}", str(g["head_dim"]), str(g["calls"]), str(g["batch_heads"]),
             pct(g["flops_share"])]
            for g in seq[:12]
        ]  # fmt: skip
        headers = ["kind", "q x kv", "head dim", "calls", "batch*heads", "FLOPs share"]
        out += ["", "attention sequence lengths (query x key tokens):", render_table(headers, rows, "llrrrr")]
        if len(seq) > 12:
            out.append(f"... {len(seq) - 12} more shapes")
    rows = [
        [name, str(s.count), si(s.bytes_saved, "B"), str(s.ops_removed)] for name, s in a.fusions.items() if s.count
    ]
    if rows:
        out += ["", f"ldmopt fusions (PROJECTION from the recorded data flow, placement '{a.placement['mode']}'):",
                render_table(["fusion", "sites", "bytes saved", "ops removed"], rows)]  # fmt: skip
    out += ["", *(f"note: {n}" for n in a.notes)]
    return "\n".join(out)


def _phase_table(a: Analysis) -> str:
    shares = a.step_shares()
    rows = []
    for key in a.categories:
        costs = [a.phases[p].get(key) for p in a.phases]
        if not any(c is not None and c.ops for c in costs):
            continue
        cells = []
        for phase, cost in zip(a.phases, costs):
            ms = f"{cost.time_s * 1e3:.3f}" if cost is not None and cost.ops else "-"
            cells += [ms, pct(shares.get((phase, key), 0.0)) if ms != "-" else "-"]
        rows.append([C.LABELS[key], *cells])
    headers = ["category"] + [h for p in a.phases for h in (p, "share")]
    return render_table(headers, rows)


def format_profile(p, top: int = 3) -> str:
    out = [
        f"ldmopt profile: MEASURED {p.time_kind} on {p.device}, {p.mode}, {p.steps} active steps"
        + (f": {p.setting}" if p.setting else ""),
        f"total {p.total_us / 1e3:.2f} ms ({p.total_us / 1e3 / max(p.steps, 1):.2f} ms per step); "
        f"{p.launches} {'kernel launches' if p.device == 'cuda' else 'operator calls'}; "
        f"wall {p.wall_s * 1e3:.1f} ms; classified {100 * p.classified_share():.1f}%",
    ]
    if p.device != "cuda":
        out.append(f"host time outside operators: {p.host_overhead_s * 1e3:.1f} ms (not in the shares)")
    if p.data_wait_s:
        out.append(
            f"data loading: {p.data_wait_s * 1e3:.1f} ms ({100 * p.data_wait_s / max(p.wall_s, 1e-12):.1f}% of wall)"
        )
    shares = p.shares()
    rows = []
    for key, cat in p.categories.items():
        if not cat.count:
            continue
        names = "; ".join(f"{n} {t / 1e3:.2f} ms x{c}" for n, t, c in p.top(key, top))
        rows.append([C.LABELS[key], f"{cat.time_us / 1e3:.3f}", pct(shares[key]), str(cat.count), names[:110]])
    out += ["", render_table(["category", "ms", "share", "calls", f"top {top}"], rows, "lrrrl")]
    split = p.attention_split()
    if any(split.values()):
        out += ["", "attention: " + ", ".join(f"{k} {pct(v).strip()}" for k, v in split.items() if v)]
    if p.trace_path:
        out.append(f"chrome trace: {p.trace_path}")
    if p.tensorboard_dir:
        out.append(f"tensorboard: {p.tensorboard_dir}")
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out)
