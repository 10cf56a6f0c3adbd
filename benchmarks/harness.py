"""Shared benchmark harness: timing, measured ceilings, CSV rows and the summary table.

Every figure comes from this machine in this run: the copy-bandwidth and bf16-matmul ceilings are measured, not taken
from a datasheet. Rows go to ``benchmarks/results/results.csv`` (override with LDMOPT_BENCH_CSV) with GPU name,
torch/Triton versions and git commit, and a Markdown summary is printed at the end of the pytest session.
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(os.environ.get("LDMOPT_BENCH_DIR", ROOT / "benchmarks" / "results"))


def _has_gpu() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


#: Apply as ``pytestmark = harness.gpu_only``: benchmarks run only on a GPU.
gpu_only = pytest.mark.skipif(not _has_gpu(), reason="benchmarks measure GPU time; no CUDA device here")


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def time_fn(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, min_reps: int = 5) -> Timing:
    """Median and p20/p80 of ``fn`` in milliseconds (triton.testing.do_bench: L2 flushed between runs).

    ``warmup`` and ``rep`` are milliseconds, as in do_bench, which runs ``rep / estimate`` times: a 100 ms model
    step would get one timed run and meaningless quantiles. So the step is measured first, and the window widened to
    at least ``min_reps`` runs and two warm-ups. That measurement is the second of two calls: the first, untimed, may
    still compile or autotune (a caller's warm-up in another grad mode, say, compiled another variant)."""
    import triton.testing

    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate_ms = (time.perf_counter() - start) * 1e3
    # do_bench's own estimate (5 runs, L2 flush included) is a little longer than this one: one run of slack.
    rep = max(rep, (min_reps + 1) * estimate_ms)
    warmup = max(warmup, 3 * estimate_ms)
    p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return Timing(p50, p20, p80)


def error_note(exc: BaseException, prefix: str = "unavailable") -> str:
    """The note of a provider that could not run: ``prefix: Type: first line of the message``."""
    return f"{prefix}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"


def synchronize(device: str) -> None:
    """Wait for the device's queued work (benchmarks' dry runs pass "cpu", where there is none)."""
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated (bytes) above what was allocated before one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def cuda_graphed(fn: Callable[[], object], warmup_calls: int = 3) -> Callable[[], object]:
    """``fn`` captured once as a CUDA graph; the returned function replays it (same inputs, same output buffers).

    Replays skip the host entirely (no Python, no dispatcher, no launch overhead), so the gap between a provider and
    its graphed row is the host time its eager step adds. Warm-up calls run on a side stream first, as capture
    requires, which also keeps autotuning and lazy initialisation out of the graph. Raises what capture raises
    (host syncs, CPU tensors, unsupported ops)."""
    side = torch.cuda.Stream()
    caller = torch.cuda.current_stream()
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    caller.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # capture_error_mode="thread_local": other threads' CUDA calls (none here) do not invalidate the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception:
        # torch.cuda.graph ends the capture before it restores the stream, so a failed end would leave every later
        # benchmark of this process on the capture stream: put the caller's stream back, then report.
        torch.cuda.set_stream(caller)
        raise
    return graph.replay


def graphed_time(fn: Callable[[], object], calls: int = 10) -> Timing:
    """GPU time per call of ``fn``: ``calls`` back-to-back calls captured in one CUDA graph, replayed and timed, the
    time divided by ``calls``. No host time at all (one graph launch per ``calls`` calls), so an op whose eager row is
    bound by its host time shows its kernels' own time here. The L2 flush happens once per replay: later calls of a
    replay may find their inputs in L2 (an optimistic bias for ops whose data fits in it)."""

    def repeated():
        for _ in range(calls):
            fn()

    timing = time_fn(cuda_graphed(repeated, warmup_calls=1))
    return Timing(timing.median_ms / calls, timing.p20_ms / calls, timing.p80_ms / calls)


def record_graphed(recorder, fn: Callable[[], object], *, device: str, provider: str, **row) -> None:
    """A ``<provider>+graph`` row: :func:`graphed_time` of ``fn`` (a row with the reason where capture fails). Only for
    a benchmark on a CUDA ``device`` (the CPU dry runs of the benchmarks skip it, GPU or not)."""
    if torch.device(device).type != "cuda" or not _has_gpu():
        return
    try:
        timing, note = graphed_time(fn), "GPU time per call (CUDA graph of 10 calls)"
    except Exception as exc:
        timing, note = None, error_note(exc, "capture failed")
    recorder.record(provider=f"{provider}+graph", timing=timing, note=note, **row)


def step_of(fn: Callable[[], torch.Tensor], mode: str, params=(), grad_out=None) -> Callable[[], object]:
    """What a benchmark times for ``mode``: "fwd" runs ``fn`` without autograd; "fwd+bwd" also takes the gradients
    of ``params`` for ``grad_out``."""
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return fn()

        return forward
    return lambda: torch.autograd.grad(fn(), params, grad_out, allow_unused=True)


def default_backends(fn: Callable) -> Callable:
    """``fn`` on the backends a user gets (chosen automatically: ldmopt._C's passes where the extension is built,
    else Triton), its first call checked to have run no op on the reference backend because a preferred one refused:
    that raises, naming the refusals, so the row shows it instead of timing the reference. Later calls run ``fn``
    unchecked (the same inputs choose the same backends), so the check costs the timed calls nothing."""
    from ldmopt.ops._dispatch import fallback_reasons, snapshot_counts

    checked = False

    def run(*args, **kwargs):
        nonlocal checked
        if checked:
            return fn(*args, **kwargs)
        before = snapshot_counts(fallback_reasons)
        out = fn(*args, **kwargs)
        fell = [key for key, n in snapshot_counts(fallback_reasons).items() if n > before.get(key, 0)]
        if fell:
            raise RuntimeError(
                "ran the reference backend: "
                + "; ".join(f"{op}: {backend} refused ({why})" for op, backend, why in fell)
            )
        checked = True
        return out

    return run


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, the note every provider row carries against eager."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def record_patch_providers(
    recorder, module, stock: Callable, reference: torch.Tensor, mode: str, params=(), grad_out=None, *,
    expect: dict[str, int], with_compile: bool, **row,
) -> None:  # fmt: skip
    """One row each for diffusers' ``module`` called by ``stock`` (eager), the same under ``ldmopt.patch`` (patched
    only while timed; ``expect``: rule -> modules it must have replaced) and, ``with_compile``, torch.compile of the
    stock call. A provider that cannot run is a row with the reason; fall-backs go in the note."""
    import ldmopt

    providers = {"eager": (stock, False), "ldmopt": (stock, True)}
    if with_compile:
        providers["compile"] = (compiled(stock, mode="max-autotune-no-cudagraphs"), False)
    for name, (fn, patched) in providers.items():
        run = step_of(fn, mode, params, grad_out)
        report = None
        try:
            if patched:
                report = ldmopt.patch(module, training=mode == "fwd+bwd")
                counts = report.counts()
                assert all(counts.get(rule) == n for rule, n in expect.items()), str(report)
            with torch.no_grad():
                note = f"max rel err vs eager {max_rel_err(fn(), reference):.1e}"
            timing, peak = time_fn(run), peak_memory(run)
            if report is not None and report.fallbacks():
                note += f"; fell back: {report.fallbacks()}"
        except Exception as exc:
            timing, peak, note = None, None, error_note(exc)
        finally:
            if report is not None:
                ldmopt.unpatch(module)
        recorder.record(provider=name, mode=mode, timing=timing, peak_mem=peak, note=note, **row)


def record_block_providers(
    recorder, block, call: Callable, hidden: torch.Tensor, mode: str, *, expect: dict[str, int], with_compile: bool,
    op: str, case: str, dtype: torch.dtype,
) -> None:  # fmt: skip
    """:func:`record_patch_providers` for one transformer block called by ``call()`` on the token stream ``hidden``:
    the eager output is the reference; fwd+bwd differentiates the stream and every parameter. Bytes counted (a lower
    bound): the stream read and written once, and for fwd+bwd also its gradient read and written (weights and saved
    activations not counted)."""
    nbytes = (2 if mode == "fwd" else 4) * hidden.numel() * hidden.element_size()
    with torch.no_grad():
        reference = call()
    params, grad_out = (), None
    if mode == "fwd+bwd":
        block.train()
        hidden.requires_grad_(True)
        grad_out = torch.randn_like(reference)
        params = [hidden, *block.parameters()]
    record_patch_providers(
        recorder, block, call, reference, mode, params, grad_out, expect=expect, with_compile=with_compile, op=op,
        case=case, dtype=str(dtype).removeprefix("torch."), bytes=nbytes,
    )  # fmt: skip


def compiled(fn: Callable, mode: str | None = "max-autotune", **kwargs) -> Callable:
    """torch.compile(fn) with ``mode`` (fullgraph off so baselines compile whatever they can), static shapes.

    A baseline compiled per case: the cases compile the same code objects, so without a reset the second case would
    recompile with symbolic shapes (slower generic kernels, flattering ldmopt) and later ones hit the recompile limit
    and run eagerly. Hence dynamo's caches are reset first and ``dynamic=False``."""
    torch._dynamo.reset()
    return torch.compile(fn, mode=mode, **{"dynamic": False, **kwargs})


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second
    bf16_tflops: float  # large square bf16 matmul


@functools.cache
def ceilings() -> Ceilings:
    """Measured once per process: a 1 GiB device copy and an 8192^3 bf16 matmul."""
    n = 1 << 28  # 256M fp32 = 1 GiB
    return Ceilings(copy_gbps=2 * n * 4 / _time_copy(n) / 1e6, bf16_tflops=2 * 8192**3 / _time_matmul(8192) / 1e9)


def _time_copy(n: int) -> float:
    src = torch.empty(n, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return time_fn(lambda: dst.copy_(src), warmup=5, rep=30).median_ms


def _time_matmul(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return time_fn(lambda: a @ b, warmup=5, rep=30).median_ms


@functools.cache
def environment() -> dict:
    import triton

    # LDMOPT_COMMIT: the commit the tree was copied from (a device machine's copy carries a git history of its own)
    commit = os.environ.get("LDMOPT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if _has_gpu() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
    }


@dataclass
class Row:
    op: str
    case: str
    dtype: str
    mode: str
    provider: str
    median_ms: float | None
    p20_ms: float | None = None
    p80_ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    pct_copy_bw: float | None = None
    pct_bf16_mm: float | None = None
    peak_mem_mb: float | None = None
    note: str = ""
    env: dict = field(default_factory=dict)


class Recorder:
    """Collects rows during a pytest session; appends them to the CSV as they come."""

    def __init__(self, csv_path: Path | None = None) -> None:
        self.rows: list[Row] = []
        self.csv_path = Path(os.environ.get("LDMOPT_BENCH_CSV", csv_path or RESULTS_DIR / "results.csv"))

    def record(
        self,
        *,
        op: str,
        case: str,
        dtype: str,
        mode: str,
        provider: str,
        timing: Timing | None,
        bytes: int | None = None,
        flops: int | None = None,
        peak_mem: int | None = None,
        note: str = "",
    ) -> Row:
        """One measurement. ``timing=None`` records a provider that could not run (say why in ``note``)."""
        row = Row(op, case, dtype, mode, provider, None, note=note, env=environment())
        if timing is not None:
            row.median_ms, row.p20_ms, row.p80_ms = timing.median_ms, timing.p20_ms, timing.p80_ms
            if bytes:
                row.gbps = bytes / timing.median_ms / 1e6
                row.pct_copy_bw = 100 * row.gbps / ceilings().copy_gbps
            if flops:
                row.tflops = flops / timing.median_ms / 1e9
                row.pct_bf16_mm = 100 * row.tflops / ceilings().bf16_tflops
        if peak_mem is not None:
            row.peak_mem_mb = peak_mem / 2**20
        self.rows.append(row)
        self._append_csv(row)
        return row

    def _append_csv(self, row: Row) -> None:
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        flat = {k: v for k, v in asdict(row).items() if k != "env"} | row.env
        new = not self.csv_path.exists()
        with self.csv_path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(flat))
            if new:
                writer.writeheader()
            writer.writerow(flat)

    def summary(self) -> str:
        """Markdown table: one line per row, with the speedup over eager (same op, case, dtype, mode) when present."""
        if not self.rows:
            return ""
        # graph rows against eager's graph row, the others against eager
        eager = {
            (r.op, r.case, r.dtype, r.mode, r.provider.endswith("+graph")): r.median_ms
            for r in self.rows
            if r.provider in ("eager", "eager+graph") and r.median_ms
        }
        env = self.rows[0].env
        ceil = ceilings() if _has_gpu() else None
        lines = [
            f"ldmopt benchmarks: {env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"commit {env['commit']}"
            + (
                f"; measured ceilings: copy {ceil.copy_gbps:.0f} GB/s, bf16 mm {ceil.bf16_tflops:.0f} TFLOP/s"
                if ceil
                else ""
            ),
            "",
            "| op | case | dtype | mode | provider | ms (p20-p80) | GB/s (% copy) | TFLOP/s (% mm) | vs eager | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            ms = f"{r.median_ms:.4f} ({r.p20_ms:.4f}-{r.p80_ms:.4f})" if r.median_ms else "-"
            bw = f"{r.gbps:.0f} ({r.pct_copy_bw:.0f}%)" if r.gbps else "-"
            tf = f"{r.tflops:.1f} ({r.pct_bf16_mm:.0f}%)" if r.tflops else "-"
            base = eager.get((r.op, r.case, r.dtype, r.mode, r.provider.endswith("+graph")))
            speed = f"{base / r.median_ms:.2f}x" if base and r.median_ms else "-"
            lines.append(
                f"| {r.op} | {r.case} | {r.dtype} | {r.mode} | {r.provider} | {ms} | {bw} | {tf} | {speed} | {r.note} |"
            )
        return "\n".join(lines)

    def plot_speedups(self, path: Path) -> Path | None:
        """Bar chart of speed over eager per (op, case) and provider (matplotlib PNG); None without matplotlib/rows."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        eager = {
            (r.op, r.case, r.dtype, r.mode, r.provider.endswith("+graph")): r.median_ms
            for r in self.rows
            if r.provider in ("eager", "eager+graph")
        }
        bars: dict[str, dict[str, float]] = {}
        for r in self.rows:
            base = eager.get((r.op, r.case, r.dtype, r.mode, r.provider.endswith("+graph")))
            if r.provider not in ("eager", "eager+graph") and base and r.median_ms:
                bars.setdefault(f"{r.op} {r.case} {r.dtype} {r.mode}", {})[r.provider] = base / r.median_ms
        if not bars:
            return None
        providers = sorted({p for by in bars.values() for p in by})
        width = 0.8 / len(providers)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(bars) * len(providers)), 4.5))
        for i, provider in enumerate(providers):
            xs = [j + i * width for j in range(len(bars))]
            ax.bar(xs, [by.get(provider, 0.0) for by in bars.values()], width, label=provider)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(bars))], list(bars), rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speed over PyTorch eager (x, measured)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


DURATION_FIELDS = ("test", "phase", "seconds", "outcome", "gpu", "commit")


def append_duration(test: str, phase: str, seconds: float, outcome: str) -> None:
    """One line of ``RESULTS_DIR/durations.csv``: a benchmark's setup, call or teardown and how long it took."""
    path = RESULTS_DIR / "durations.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    try:
        env = environment()
    except Exception:  # (a report hook must not fail the session: no Triton, no git)
        env = {"gpu": "unknown", "commit": "unknown"}
    try:
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(DURATION_FIELDS)
            writer.writerow([test, phase, f"{seconds:.3f}", outcome, env["gpu"], env["commit"]])
    except OSError as exc:  # a full disk or a read-only folder loses a timing, not the benchmark session
        print(f"ldmopt benchmarks: could not append to {path}: {exc}", file=sys.stderr)


def durations_by_test(path: Path) -> dict[str, float]:
    """Seconds per benchmark (its setup, call and teardown summed) from a ``durations.csv``, slowest first (rows of
    every run appended there: run_gpu.sh gives each run its own folder). A line cut short is skipped."""
    totals: dict[str, float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:
                totals[row["test"]] = totals.get(row["test"], 0.0) + float(row["seconds"])
            except (TypeError, ValueError, KeyError):
                continue
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def recorder_from_csv(path: Path) -> Recorder:
    """A Recorder holding the rows of a results CSV (e.g. to print the summary of a run that was cut short)."""
    recorder = Recorder(path)
    numeric = {"median_ms", "p20_ms", "p80_ms", "gbps", "tflops", "pct_copy_bw", "pct_bf16_mm", "peak_mem_mb"}
    env_keys = ("date", "gpu", "torch", "triton", "commit")
    with Path(path).open() as f:
        for raw in csv.DictReader(f):
            fields = {k: (float(v) if v else None) if k in numeric else v for k, v in raw.items() if k not in env_keys}
            recorder.rows.append(Row(**fields, env={k: raw.get(k, "") for k in env_keys}))
    return recorder


if __name__ == "__main__":
    import sys

    # python -m benchmarks.harness RESULTS.csv: the Markdown summary of the rows in a results CSV.
    print(recorder_from_csv(Path(sys.argv[1])).summary())
