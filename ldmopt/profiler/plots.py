"""Matplotlib figures for the CLI's ``--plot`` (matplotlib is imported only here, when a plot is asked for)."""

from __future__ import annotations

import os
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


def plot_output_problem(path: str) -> str | None:
    """Why ``--plot path`` could not be written (no matplotlib, a format it does not write), checked before the work;
    None when it can."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return "--plot needs matplotlib: pip install matplotlib (or pip install 'ldmopt[bench]')"
    if os.path.isdir(path):
        return f"--plot {path} is a folder; give a file name such as {os.path.join(path, 'plot.png')}"
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in formats:
        return f"--plot {path}: {suffix or 'no'} suffix; matplotlib writes {', '.join(sorted(formats))} (e.g. out.png)"
    return None


def _savefig(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


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
    _savefig(fig, path)
    plt.close(fig)
    return path


def setting_label(a: Analysis) -> str:
    """The setting of one analysis as the sweep table prints it: 576x1024, or 256x256 F16 for a video model."""
    return f"{a.resolution[0]}x{a.resolution[1]}" + (f" F{a.frames}" if a.frames else "")


def _sweep_axes(analyses: list[Analysis]):
    """(x label, x of each analysis, series key of each analysis, series name or None).

    The x axis is the frame count when frames vary, else the resolution; when both vary, each resolution is its own
    series (a line per category and resolution), so points of different resolutions are never joined.
    """
    by_frames = len({a.frames for a in analyses}) > 1
    if by_frames:
        xs = [a.frames for a in analyses]
        keys = [tuple(a.resolution) for a in analyses]
        several = len(set(keys)) > 1
        return "frames", xs, keys, (lambda k: f"{k[0]}x{k[1]}") if several else None
    square = all(a.resolution[0] == a.resolution[1] for a in analyses)
    xs = [a.resolution[0] if square else a.resolution[0] * a.resolution[1] / 1e6 for a in analyses]
    return ("resolution (px)" if square else "megapixels"), xs, [None] * len(analyses), None


def plot_sweep(analyses: list[Analysis], path: str) -> str:
    """Scaling curves: FLOPs per category (log-log) and shares of projected time, against resolution or frames.

    A sweep over resolutions and frames draws one line per category and resolution (line style per resolution) and
    labels each bar with its full setting.
    """
    plt = _pyplot()
    xlabel, xs, keys, series_name = _sweep_axes(analyses)
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    series = list(dict.fromkeys(keys))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ci, c in enumerate(c for c in C.CATEGORIES if any(a.categories[c].flops for a in analyses)):
        color = f"C{ci % 10}"
        for si, key in enumerate(series):
            points = sorted((x, a.categories[c].flops) for x, a, k in zip(xs, analyses, keys) if k == key)
            label = C.LABELS[c] if si == 0 else None
            left.plot([p[0] for p in points], [p[1] for p in points], color=color, label=label,
                      linestyle=styles[si % len(styles)], marker=markers[si % len(markers)])  # fmt: skip
    if series_name is not None:  # one proxy line per resolution for the line styles
        for si, key in enumerate(series):
            left.plot([], [], color="gray", linestyle=styles[si % len(styles)], marker=markers[si % len(markers)],
                      label=series_name(key))  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel(xlabel)
    left.set_ylabel("FLOPs per call (counted)")
    left.legend(fontsize=7)
    order = sorted(range(len(analyses)), key=lambda i: (series.index(keys[i]), xs[i]))
    ordered = [analyses[i] for i in order]
    shares = [a.shares("time") for a in ordered]
    cats = [c for c in C.CATEGORIES if max(s[c] for s in shares) >= 0.001]
    bottom = [0.0] * len(ordered)
    positions = list(range(len(ordered)))
    for c in cats:
        vals = [s[c] * 100 for s in shares]
        right.bar(positions, vals, bottom=bottom, label=C.LABELS[c])
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xticks(positions, [setting_label(a) for a in ordered], rotation=30, ha="right")
    right.set_ylabel(f"share of projected time on {analyses[0].gpu.name} (%)")
    right.set_xlabel("setting")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{analyses[0].model}: scaling (analytic; times are roofline projections, not measured)")
    fig.tight_layout()
    _savefig(fig, path)
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
    _savefig(fig, path)
    plt.close(fig)
    return path
