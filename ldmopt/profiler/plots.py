"""Matplotlib figures for the CLI's ``--plot`` (matplotlib is imported only here, when a plot is asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import categories as C

if TYPE_CHECKING:
    from .cost import Analysis
    from .measure import Profile


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or pip install 'ldmopt[bench]')") from exc
    return plt


def _used(categories: list[str], values: list[dict[str, float]]) -> list[str]:
    return [c for c in categories if any(v.get(c, 0) for v in values)]


def plot_analysis(a: Analysis, path: str) -> str:
    """Bars of projected time per category, as is and as ldmopt patches it."""
    plt = _pyplot()
    as_is = {k: c.time_s * 1e3 for k, c in a.categories.items()}
    patched = {k: c.patched_time_s * 1e3 for k, c in a.categories.items()}
    cats = _used(list(C.CATEGORIES), [as_is, patched])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(cats))
    ax.bar([x - 0.2 for x in xs], [as_is[c] for c in cats], width=0.4, label="as is")
    ax.bar([x + 0.2 for x in xs], [patched[c] for c in cats], width=0.4, label="as ldmopt patches it")
    ax.set_xticks(list(xs), [C.LABELS[c] for c in cats], rotation=30, ha="right")
    ax.set_ylabel(f"projected ms on {a.gpu.name}")
    ax.set_title(f"{a.setting()} (analytic projection, not measured)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(analyses: list[Analysis], path: str) -> str:
    """Scaling curves: FLOPs per category (log-log) and shares of projected time, against resolution or frames."""
    plt = _pyplot()
    by_frames = len({a.frames for a in analyses}) > 1
    xs = [a.frames if by_frames else a.resolution[0] for a in analyses]
    flops = {c: [a.categories[c].flops for a in analyses] for c in C.CATEGORIES}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in [c for c in C.CATEGORIES if any(flops[c])]:
        left.plot(xs, flops[c], marker="o", label=C.LABELS[c])
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("frames" if by_frames else "resolution (px)")
    left.set_ylabel("FLOPs per call (counted)")
    left.legend(fontsize=7)
    shares = [a.shares("time") for a in analyses]
    cats = [c for c in C.CATEGORIES if max(s[c] for s in shares) >= 0.001]
    bottom = [0.0] * len(analyses)
    labels = [str(x) for x in xs]
    for c in cats:
        vals = [s[c] * 100 for s in shares]
        right.bar(labels, vals, bottom=bottom, label=C.LABELS[c])
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_ylabel(f"share of projected time on {analyses[0].gpu.name} (%)")
    right.set_xlabel(left.get_xlabel())
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{analyses[0].model}: scaling (analytic; times are roofline projections, not measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_profile(p: Profile, path: str) -> str:
    plt = _pyplot()
    cats = [c for c in C.CATEGORIES if p.categories[c].time_us]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(range(len(cats)), [p.categories[c].time_us / 1e3 / max(p.steps, 1) for c in cats])
    ax.set_xticks(range(len(cats)), [C.LABELS[c] for c in cats], rotation=30, ha="right")
    ax.set_ylabel(f"ms per step ({p.time_kind})")
    ax.set_title(f"measured on {p.device}, {p.mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
