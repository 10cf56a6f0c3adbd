"""End-to-end denoising steps of real-size models (random weights from the embedded configs, no downloads).

Providers per model: diffusers eager (SDPA, channels-last), ldmopt.patch, each also replayed by ``ldmopt.cuda_graphs``
(``eager-cuda-graphs``, ``ldmopt-cuda-graphs``: what a user's eager pipeline gets, static-buffer copies included),
ldmopt.tune (patched only where each
module's fused forward measured faster on this GPU, the step itself as tune's run(); its per-site table is written
to results/e2e_tuning_<model>.txt, and its choice, for ``ldmopt.patch_tuned``, to .choice.json beside it;
``ldmopt-tuned-graph``: timed as CUDA graph replays, the choice for a captured model, whose ``+graph`` row is the one
to read), torch.compile(max-autotune) and ldmopt.patch + torch.compile; each is also timed captured as a CUDA graph
(``<provider>+graph`` rows: the step without any host overhead). Figures: ms
per step, it/s, peak memory, and the operator-category split before and after patching from ldmopt.profile
(written to results/e2e_categories.json and plotted). On CPU the GPU benchmarks skip and
`test_analytic_projection_cpu` checks the analytic model of the same settings instead.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

import ldmopt
from benchmarks import harness
from ldmopt import configs
from ldmopt.graphs import GRAPHED

# (zoo name, resolution, frames, batch); the settings of issue 9.
MODELS = {
    "sd15-512": ("sd15", 512, None, 2),
    "sdxl-1024": ("sdxl", 1024, None, 2),
    "sdxl-vae-decode-1024": ("sdxl-vae", 1024, None, 1),
    "dit-256": ("dit", 256, None, 2),
    "pixart-1024": ("pixart-alpha", 1024, None, 2),
    "animatediff-512x16": ("animatediff", 512, 16, 2),
    "svd-576x1024x14": ("svd", (576, 1024), 14, 2),
}
QUICK = ("sd15-512", "dit-256", "animatediff-512x16")
PROVIDERS = (
    "eager", "ldmopt", "eager-cuda-graphs", "ldmopt-cuda-graphs", "ldmopt-tuned", "ldmopt-tuned-graph", "compile",
    "ldmopt+compile",
)  # fmt: skip
# Quick mode (run_gpu.sh's ~8-minute budget): max-autotune compiles of whole UNets take minutes each, so only the
# eager, patched, graphed and tuned providers run, the cheap ones first (tune times ~4 configurations of 5 steps
# each), so that a run cut at its budget still has them; --full runs all eight.
QUICK_PROVIDERS = ("eager", "ldmopt", "eager-cuda-graphs", "ldmopt-cuda-graphs", "ldmopt-tuned", "ldmopt-tuned-graph")
_CATEGORY_SPLITS: dict[str, dict] = {}


def _quick() -> bool:
    return os.environ.get("LDMOPT_BENCH_QUICK") == "1"


def _models() -> list[str]:
    return list(QUICK) if _quick() else list(MODELS)


def _build(name: str, dtype: torch.dtype):
    zoo, resolution, frames, batch = MODELS[name]
    model = configs.build_model(zoo, device="cuda", dtype=dtype, frames=frames)
    with contextlib.suppress(Exception):  # models without conv layers ignore the format
        model = model.to(memory_format=torch.channels_last)
    inputs = configs.example_inputs(model, resolution=resolution, frames=frames, batch=batch)
    return model, inputs


def _provider(model, inputs, provider: str, name: str = ""):
    call = model if inputs.method == "forward" else getattr(model, inputs.method)

    def eager_step():
        # torch.no_grad, as diffusers pipelines run their denoising loop: inference tensors (torch.inference_mode)
        # keep no version counter, so a patched model would hand no GroupNorm statistics between its blocks.
        # The method is looked up per call, as a pipeline does (vae.decode(...)): ldmopt.cuda_graphs replaces it.
        with torch.no_grad():
            return (model if inputs.method == "forward" else getattr(model, inputs.method))(**inputs.kwargs)

    if provider in ("ldmopt", "ldmopt+compile", "ldmopt-cuda-graphs"):
        report = ldmopt.patch(model)
        note = f"patched {report.total} modules"
    elif provider in ("ldmopt-tuned", "ldmopt-tuned-graph"):
        graph = provider.endswith("graph")  # timed as CUDA graph replays: the choice for a captured model
        report = ldmopt.tune(model, eager_step, warmup=2, repeats=3, cuda_graph=graph)
        tuning = report.tuning
        note = (
            f"tuned: {len(tuning.kept)} of {len(tuning.sites)} sites kept; tune measured {tuning.stock_ms:.2f} ms "
            f"stock, {tuning.all_patched_ms:.2f} all patched, {tuning.tuned_ms:.2f} tuned; kept per rule: "
            f"{tuning.kept_per_rule_text()}"
        )
        harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stem = f"e2e_tuning_{name or 'model'}{'-graph' if graph else ''}"
        (harness.RESULTS_DIR / f"{stem}.txt").write_text(str(tuning) + "\n")
        tuning.save(harness.RESULTS_DIR / f"{stem}.choice.json")  # ldmopt.patch_tuned applies it on this GPU again
    else:
        note = ""
    if provider.endswith("cuda-graphs"):  # what a user's eager pipeline gets from ldmopt.cuda_graphs, copies included
        ldmopt.cuda_graphs(model, method=inputs.method)
    if not provider.endswith("compile"):
        return eager_step, note
    # The bound method itself (a VAE's decode): compiling the module would leave decode running eagerly.
    compiled = torch.compile(call, mode="max-autotune-no-cudagraphs", dynamic=False)  # static, as harness.compiled

    def step():
        with torch.no_grad():
            return compiled(**inputs.kwargs)

    return step, note


@harness.gpu_only
@pytest.mark.parametrize("provider", QUICK_PROVIDERS if _quick() else PROVIDERS)
@pytest.mark.parametrize("name", _models())
def bench_denoising_step(name, provider, bench_recorder):
    dtype = torch.float16
    torch._dynamo.reset()
    model, inputs = _build(name, dtype)
    try:
        step, note = _provider(model, inputs, provider, name)
        step()  # compile / autotune / first-call costs stay out of the timing
        timing = harness.time_fn(step, warmup=3, rep=20)
        peak = harness.peak_memory(step)
    except Exception as exc:  # a provider that cannot run this model is a row with the reason, not a crash
        bench_recorder.record(op="e2e-step", case=name, dtype="fp16", mode="fwd", provider=provider, timing=None,
                              note=f"failed: {type(exc).__name__}: {str(exc)[:100]}")  # fmt: skip
        return
    graphed = model.__dict__.get(GRAPHED)  # the cuda-graphs providers' wrapper
    if graphed is not None:  # one line: how many graphs, and any call that ran eagerly with its reason
        note += " " + "; ".join(line.strip() for line in graphed.summary().splitlines())
        ldmopt.remove_cuda_graphs(model)
    bench_recorder.record(
        op="e2e-step", case=name, dtype="fp16", mode="fwd", provider=provider, timing=timing, peak_mem=peak,
        note=f"{1000 / timing.median_ms:.2f} it/s {note}".strip(),
    )  # fmt: skip
    if graphed is None:  # a capture of a step that replays graphs itself would nest them
        _record_graphed(name, provider, step, bench_recorder)
    if provider in ("eager", "ldmopt", "ldmopt-tuned"):  # the split before, patched and tuned
        prof = ldmopt.profile(step, steps=3, warmup=1, modules=model)
        _CATEGORY_SPLITS.setdefault(name, {})[provider] = {k: v for k, v in prof.shares().items() if v > 0}
        _write_category_splits()
    if provider.startswith("ldmopt"):
        ldmopt.unpatch(model)


def _record_graphed(name: str, provider: str, step, bench_recorder) -> None:
    """The same step captured as a CUDA graph, on the model already built (a row with the reason if capture fails)."""
    try:
        replay = harness.cuda_graphed(step)
        timing = harness.time_fn(replay, warmup=3, rep=20)
    except Exception as exc:
        bench_recorder.record(op="e2e-step", case=name, dtype="fp16", mode="fwd", provider=f"{provider}+graph",
                              timing=None, note=f"capture failed: {type(exc).__name__}: {str(exc)[:100]}")  # fmt: skip
        return
    bench_recorder.record(
        op="e2e-step", case=name, dtype="fp16", mode="fwd", provider=f"{provider}+graph", timing=timing,
        note=f"{1000 / timing.median_ms:.2f} it/s",
    )  # fmt: skip


def _write_category_splits() -> None:
    harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (harness.RESULTS_DIR / "e2e_categories.json").write_text(json.dumps(_CATEGORY_SPLITS, indent=2))
    with contextlib.suppress(ImportError):
        _plot_category_splits(harness.RESULTS_DIR / "e2e_categories.png")


def _plot_category_splits(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m, p, s) for m, by_provider in _CATEGORY_SPLITS.items() for p, s in by_provider.items()]
    categories = sorted({c for _, _, s in rows for c in s})
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    for i, (_, _, shares) in enumerate(rows):
        left = 0.0
        for j, cat in enumerate(categories):
            width = 100 * shares.get(cat, 0.0)
            ax.barh(i, width, left=left, color=plt.cm.tab20(j % 20), label=cat if i == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), [f"{m} / {p}" for m, p, _ in rows])
    ax.set_xlabel("% of measured GPU time (ldmopt.profile)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def test_analytic_projection_cpu():
    """Runs everywhere: the analytic model of the benchmarked settings is consistent (labelled a projection)."""
    analysis = ldmopt.analyze("sd15", resolution=512, batch=2)
    shares = analysis.shares()
    assert abs(sum(shares.values()) - 1.0) < 1e-6
    assert 1.4e12 < analysis.total_flops < 1.8e12, analysis.total_flops
