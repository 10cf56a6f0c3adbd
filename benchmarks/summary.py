"""run_gpu.sh's closing summary, printed last: per op the best ldmopt provider against eager, torch.compile and the
best SDPA backend, the stages' exit statuses, the check failures with their exception lines, and the correctness
totals as the very last line. The device tool returns only the last 12,000 characters of a run's output, so the whole
summary stays under ``--limit`` characters (case lines are dropped first); the full table is summary.md.

    python -m benchmarks.summary --csv results.csv --checks checks.txt --status stages.tsv
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from pathlib import Path

from benchmarks.harness import Row, durations_by_test, recorder_from_csv

#: ldmopt variants that do less than the op (statistics handed in, no norm), skip the host (graph replay) or are not
#: what a user gets by default (GroupNorm forced into the conv's loader, the conv or a GEMM forced into ldmopt's
#: kernel, a pass forced onto Triton, GELU-tanh forced into the pass after cuBLAS): shown in summary.md, never "the
#: best ldmopt".
PARTIAL = ("+stats", "-plain", "+graph", "-loader", "-staged", "-triton-gemm", "-triton-pass", "-gelu-pass")
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _timed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.median_ms]


def _fastest(rows: list[Row]) -> Row | None:
    return min(_timed(rows), key=lambda r: r.median_ms, default=None)


def _compare(rows: list[Row]) -> tuple[Row | None, dict[str, Row | None], Row | None]:
    """(best ldmopt row, {"e": eager, "c": compile, "s": best SDPA}, an untimed ldmopt row) of one case."""
    ldmopt = [r for r in rows if r.provider.startswith("ldmopt") and not any(p in r.provider for p in PARTIAL)]
    baselines = {
        "e": _fastest([r for r in rows if r.provider == "eager" or r.provider.startswith("eager-")]),
        "c": _fastest([r for r in rows if r.provider == "compile"]),
        "s": _fastest([r for r in rows if r.provider.startswith("sdpa-")]),
    }
    return _fastest(ldmopt), baselines, next((r for r in ldmopt if not r.median_ms), None)


def _case_line(key: tuple[str, str, str], rows: list[Row]) -> str | None:
    case, dtype, mode = key
    best, baselines, failed = _compare(rows)
    head = f"  {case} {DTYPES.get(dtype, dtype)} {mode}"
    if best is None:
        return f"{head}  ldmopt -: {failed.note[:70]}" if failed is not None else None
    speeds = " ".join(f"{k}{b.median_ms / best.median_ms:.2f}" for k, b in baselines.items() if b is not None)
    bandwidth = f" {best.pct_copy_bw:.0f}%bw" if best.pct_copy_bw else ""
    return f"{head}  {best.provider} {best.median_ms:.4g}ms {speeds}{bandwidth}".rstrip()


def _op_header(op: str, cases: dict) -> str:
    speeds = []
    for rows in cases.values():
        best, baselines, _ = _compare(rows)
        if best is not None and baselines["e"] is not None:
            speeds.append(baselines["e"].median_ms / best.median_ms)
    if not speeds:
        return f"{op}: no ldmopt row against eager ({len(cases)} cases)"
    geomean = math.exp(sum(map(math.log, speeds)) / len(speeds))
    return f"{op}: ldmopt {geomean:.2f}x eager (geomean of {len(speeds)}, {min(speeds):.2f}x-{max(speeds):.2f}x)"


def benchmark_lines(rows: list[Row], limit: int) -> list[str]:
    """Per op a header (geomean speed over eager) and, while ``limit`` characters allow, one line per case."""
    if not rows:
        return ["no benchmark rows were recorded"]
    by_op: dict[str, dict[tuple[str, str, str], list[Row]]] = {}
    for r in rows:
        by_op.setdefault(r.op, {}).setdefault((r.case, r.dtype, r.mode), []).append(r)
    env = rows[0].env
    lines = [
        f"benchmarks: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, commit "
        f"{env.get('commit')}, {env.get('date')}; {len(rows)} rows (full table: summary.md)",
        "per case: best ldmopt provider, its median, speed over e(ager) c(ompile) s(best SDPA), % of copy bandwidth",
    ]
    headers = {op: _op_header(op, cases) for op, cases in by_op.items()}
    pending = {op: [line for line in map(_case_line, cases, cases.values()) if line] for op, cases in by_op.items()}
    total = sum(map(len, pending.values()))
    used = sum(len(s) + 1 for s in [*lines, *headers.values()]) + 70  # 70: the dropped-lines note
    # Case lines in rounds, one per op each, so that a long op cannot crowd out the ones after it.
    chosen: dict[str, list[str]] = {op: [] for op in by_op}
    while any(pending.values()):
        for op, queue in pending.items():
            if queue and used + len(queue[0]) + 1 <= limit:
                used += len(queue[0]) + 1
                chosen[op].append(queue.pop(0))
            else:
                queue.clear()
    for op in by_op:
        lines += [headers[op], *chosen[op]]
    dropped = total - sum(map(len, chosen.values()))
    if dropped:
        lines.append(f"(+{dropped} case lines left out for length: summary.md has every row)")
    untimed = Counter(r.provider for r in rows if not r.median_ms)
    if untimed:
        listed = ", ".join(f"{p} {n}" for p, n in untimed.most_common(8))
        lines.append(f"rows without a time (their notes are in summary.md): {listed}")
    return lines


def _status_text(rc: int, seconds: int, cap: int) -> str:
    if rc == 0:
        return f"ok {seconds}s"
    if rc == 124:
        return f"TIMED OUT at its {cap}s cap"
    if rc == 137:
        return f"KILLED after its {cap}s cap"
    if rc == -1:
        return "skipped: no time left"
    return f"exit {rc} after {seconds}s"


def stage_line(status: str) -> str:
    """One line for the stages ("name<TAB>rc<TAB>seconds<TAB>cap" each); sharded stages ("check_gpu[3/8]") grouped."""
    groups: dict[str, list[tuple[str, int, int, int]]] = {}
    for line in status.splitlines():
        if line.strip():
            name, rc, seconds, cap = line.split("\t")
            groups.setdefault(name.split("[")[0], []).append((name, int(rc), int(seconds), int(cap)))
    parts = []
    for group, members in groups.items():
        if len(members) == 1:
            parts.append(f"{group} {_status_text(*members[0][1:])}")
            continue
        bad = [m for m in members if m[1] != 0]
        text = f"{group} {len(members) - len(bad)}/{len(members)} ok (longest {max(m[2] for m in members)}s)"
        parts.append(text + "".join(f", {m[0][len(group) :]} {_status_text(*m[1:])}" for m in bad))
    return "stages: " + (" | ".join(parts) if parts else "none recorded")


def check_lines(text: str, max_failures: int = 15, width: int = 160) -> list[str]:
    """The failures (FAIL rows, ERROR lines, each traceback's exception line) and the totals, the totals last."""
    passed = failed = errors = skipped = 0
    failures: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        line = line.rstrip()
        if line.endswith(" PASS"):
            passed += 1
        elif line.endswith(" FAIL"):
            failed += 1
            failures.append(line)
        elif line.startswith("  skip "):
            skipped += 1
        elif re.match(r"^\S+\s+ERROR\b", line):
            errors += 1
            failures.append(line)
        elif line.startswith("Traceback (most recent call last)"):
            # The exception is the block's first unindented line; a check's ERROR line above already holds it.
            exc = next((s for s in lines[i + 1 :] if s.strip() and not s[0].isspace()), "(no exception line)")
            if not (failures and exc.split(": ", 1)[-1][:60] in failures[-1]):
                errors += 1
                failures.append(f"  crashed: {exc}")
    out = ["check failures:"] + [f"  {f[:width]}" for f in failures[:max_failures]] if failures else []
    if len(failures) > max_failures:
        out.append(f"  (+{len(failures) - max_failures} more in checks.txt)")
    finals = Counter(
        re.sub(r" \(shard \d+/\d+\)$", "", s) for s in lines if re.match(r"^(check_gpu|check_cuda_backend):", s)
    )
    scripts = "; ".join(f"{s}" + (f" (x{n})" if n > 1 else "") for s, n in finals.items()) or "no script finished"
    out.append(f"correctness: {passed} passed, {failed} failed, {errors} errors, {skipped} skipped | {scripts}")
    return out


def durations_line(path: Path | None, top: int = 6) -> list[str]:
    """The slowest benchmarks of the run (setup, call and teardown), to choose quick mode's subset by."""
    if path is None or not path.exists():
        return []
    totals = durations_by_test(path)
    if not totals:
        return []
    slowest = "; ".join(f"{test.removeprefix('benchmarks/')} {sec:.0f}s" for test, sec in list(totals.items())[:top])
    return [f"benchmark time: {sum(totals.values()):.0f}s in {len(totals)} tests; slowest: {slowest}"]


def summary(csv: Path | None, checks: str, status: str, limit: int = 9500, durations: Path | None = None) -> str:
    tail = [stage_line(status), *durations_line(durations), *check_lines(checks)]
    rows = recorder_from_csv(csv).rows if csv is not None and csv.exists() else []
    head = benchmark_lines(rows, limit - sum(len(s) + 1 for s in tail))
    return "\n".join(head + tail)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--checks", type=Path, nargs="*", default=[], help="the check scripts' outputs")
    parser.add_argument("--status", type=Path, help="stages, one 'name<TAB>rc<TAB>seconds<TAB>cap' a line")
    parser.add_argument("--limit", type=int, default=9500, help="characters at most")
    parser.add_argument("--durations", type=Path, help="the benchmarks' durations.csv")
    args = parser.parse_args(argv)
    checks = "\n".join(p.read_text(errors="replace") for p in args.checks if p.exists())
    status = args.status.read_text() if args.status is not None and args.status.exists() else ""
    print(summary(args.csv, checks, status, args.limit, args.durations))


if __name__ == "__main__":
    main()
