#!/usr/bin/env bash
# The one prepared GPU run: install what a bare GPU machine lacks (from local wheels, no network), build ldmopt._C
# while check_gpu.py checks the Triton kernels against fp64 at real shapes (in parallel shards: Triton compiles
# serially per process, and the machine has 16 cores), check the CUDA C++ backend, run the benchmarks in what is left
# (never less than BENCH_RESERVE seconds of the budget), and print a compact summary last, the correctness totals its
# final line. Quick mode (default) ends within 480 s (8 minutes: the device lends 15 in all, its start included, and
# stops a command at 600 s), leaving time for one rerun; --full runs everything.
#   bash benchmarks/run_gpu.sh [--full]
# Prepare the wheels here first (this machine has a package index): bash benchmarks/fetch_wheels.sh
# Files (the device tool returns at most 8 from $OUT): run.log, checks.txt, results.csv, summary.md (every row),
# summary.txt (what is printed last), profiles.txt (host time per op call, GPU time per kernel of a patched model)
# and logs.tar.gz (build, pip and pytest logs, plots, durations.csv: each benchmark's seconds as it ended).
# Knobs: LDMOPT_RUN_BUDGET, LDMOPT_BENCH_RESERVE, LDMOPT_CUDA_CHECK_RESERVE (seconds), LDMOPT_CHECK_SHARDS,
# LDMOPT_CHECK_ONLY (check_gpu.py checks to run, space-separated; all by default), LDMOPT_BENCH_FILES,
# LDMOPT_PROFILE_MODELS, PYTHON, MAX_JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=quick
[ "${1:-}" = "--full" ] && MODE=full
QUICK=$([ "$MODE" = quick ] && echo 1 || echo 0)
PY="${PYTHON:-python3}"
RESULTS="${OUT:-benchmarks/results/run-$(date +%Y%m%d-%H%M%S)}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ldmopt-run.XXXXXX")"
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/run.log") 2>&1
TEE_PID=$!
# Python block-buffers output to a file: a stage stopped by timeout would leave nothing of what it printed.
export PYTHONUNBUFFERED=1
# Each process tunes its own tiles: the check shards share the GPU while they tune, and their timings, cached on disk,
# would otherwise choose the benchmarks' tiles.
export LDMOPT_AUTOTUNE_CACHE=0
export LDMOPT_BENCH_DIR="$WORK" LDMOPT_BENCH_CSV="$RESULTS/results.csv"
log() { echo "[run_gpu $(date +%H:%M:%S)] $*"; }
pack() { tar -czf "$RESULTS/logs.tar.gz" -C "$WORK" . 2>/dev/null; }
# At exit: pack the logs, then close our ends of the tee and wait for it, or its last lines (the summary) may be lost.
finally() { pack; exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null; }
# Stopped from outside: each stage's timeout runs in a process group of its own, so stop them (timeout passes the
# signal to its command) rather than leave a benchmark running on the GPU after this script.
stop_stages() { local f; for f in "$WORK"/timeout.*; do [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null; done; }
trap finally EXIT
trap 'stop_stages; exit 143' TERM INT

# One wall-clock budget: each stage runs under timeout until its deadline, the benchmarks keep BENCH_RESERVE seconds
# whatever the stages before them take, and MARGIN is left for the summary.
START=$(date +%s)
TOTAL="${LDMOPT_RUN_BUDGET:-$([ "$QUICK" = 1 ] && echo 480 || echo 7200)}"
BENCH_RESERVE="${LDMOPT_BENCH_RESERVE:-$([ "$QUICK" = 1 ] && echo 300 || echo 3600)}"
SHARDS="${LDMOPT_CHECK_SHARDS:-8}"
for v in TOTAL BENCH_RESERVE SHARDS; do
  case "${!v}" in ''|*[!0-9]*) echo "$v must be a whole number, got '${!v}'" >&2; exit 2 ;; esac
done
MARGIN=$(( TOTAL / 20 < 20 ? TOTAL / 20 : 20 ))
left() { echo $(( TOTAL - MARGIN - ($(date +%s) - START) - ${1:-0} )); }  # seconds left, a reserve of $1 kept
cap() { local l; l=$(left "${2:-0}"); echo $(( l < $1 ? l : $1 )); }  # cap SECONDS [RESERVE]

# Stages run in the background under timeout; each one's exit status goes to stages.tsv (124: stopped at its cap).
STAGES="$WORK/stages.tsv"
: >"$STAGES"
NAMES=() PIDS=() T0S=() CAPS=() ENDED=()
EXIT=0
start() {  # start NAME SECONDS LOGFILE CMD...
  local name=$1 secs=$2 out=$3
  shift 3
  if [ "$secs" -lt 5 ]; then
    log "$name: skipped, ${secs}s left"
    printf '%s\t-1\t0\t%s\n' "$name" "$secs" >>"$STAGES"
    EXIT=1
    return
  fi
  local ended="$WORK/ended.${#NAMES[@]}"  # its exit status and end time: finish may wait for it after others
  local pidfile="$WORK/timeout.${#NAMES[@]}"  # the timeout's pid, for stop_stages
  { timeout -k 5 "$secs" "$@" >"$out" 2>&1 & echo $! >"$pidfile"; wait $!; echo "$? $(date +%s)" >"$ended"; } &
  NAMES+=("$name") PIDS+=($!) T0S+=("$(date +%s)") CAPS+=("$secs") ENDED+=("$ended")
}
finish() {  # finish [NAME]: wait for that stage (or every one still running); record and log each exit status
  local i rc end secs status=0
  for i in "${!NAMES[@]}"; do
    [ -n "${1:-}" ] && [ "${NAMES[i]}" != "$1" ] && continue
    [ -z "${PIDS[i]}" ] && continue
    wait "${PIDS[i]}"
    PIDS[i]=""
    read -r rc end <"${ENDED[i]}" || { rc=137 end=$(date +%s); }
    secs=$(( end - T0S[i] ))
    printf '%s\t%s\t%s\t%s\n' "${NAMES[i]}" "$rc" "$secs" "${CAPS[i]}" >>"$STAGES"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      log "${NAMES[i]}: TIMED OUT at its ${CAPS[i]}s cap (exit $rc); what it printed is kept"
    else
      log "${NAMES[i]}: exit $rc after ${secs}s"
    fi
    [ "$rc" -eq 0 ] || status=1
  done
  [ "$status" -eq 0 ] || EXIT=1
  return "$status"
}

log "mode $MODE, budget ${TOTAL}s (benchmarks keep ${BENCH_RESERVE}s), results in $RESULTS"
log "python: $($PY -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# diffusers is what the image lacks; pytest-timeout and xformers only in some images. --no-deps: diffusers declares
# importlib_metadata, which the image lacks and imports only on Python < 3.8; its other requirements are there.
MISSING=$($PY -c 'import importlib.util as u
print(*[n for n, m in (("diffusers", "diffusers"), ("pytest-timeout", "pytest_timeout"), ("xformers", "xformers"))
        if u.find_spec(m) is None])')
for name in $MISSING; do
  if $PY -m pip install --no-index --no-deps --find-links benchmarks/wheels "$name" >>"$WORK/pip.log" 2>&1; then
    log "installed $name from benchmarks/wheels"
  else
    log "$name not installed (see pip.log in logs.tar.gz): its rows will say so"
  fi
done

# ldmopt itself first, without ldmopt._C (seconds): the shards below import it while the extension builds, and
# ldmopt.kernels exists only once installed (setup.py maps it to kernels/). Should pip refuse (an older setuptools
# than pyproject.toml asks for, say), a link in this throwaway copy serves the same modules from the source tree.
if LDMOPT_SKIP_CUDA_BUILD=1 timeout 120 $PY -m pip install --no-index --no-deps --no-build-isolation -e . \
    >"$WORK/install.log" 2>&1; then
  log "installed ldmopt (editable, no extension yet)"
else
  log "pip could not install ldmopt (install.log in logs.tar.gz): serving it from the source tree"
  [ -e ldmopt/kernels ] || ln -s ../kernels ldmopt/kernels
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
log "building ldmopt._C in place (MAX_JOBS=$MAX_JOBS, arch $TORCH_CUDA_ARCH_LIST) while $SHARDS check_gpu shards run"
# The build stops early enough to leave check_cuda_backend its own CUDA_CHECK_RESERVE seconds after it.
CUDA_CHECK_RESERVE="${LDMOPT_CUDA_CHECK_RESERVE:-$([ "$QUICK" = 1 ] && echo $(( TOTAL * 45 / 480 )) || echo 600)}"
start build "$(cap "$([ "$QUICK" = 1 ] && echo 200 || echo 1200)" $(( BENCH_RESERVE + CUDA_CHECK_RESERVE )))" \
  "$WORK/build.log" \
  $PY setup.py build_ext --inplace
CHECK_ARGS=()
[ "$QUICK" = 1 ] && CHECK_ARGS+=(--quick)
ONLY_ARGS=()
for name in ${LDMOPT_CHECK_ONLY:-}; do ONLY_ARGS+=(--only "$name"); done
# Shards started before the build ends report the cuda backend as a skip; check_cuda_backend.py checks it after.
for ((k = 0; k < SHARDS; k++)); do
  start "check_gpu[$k/$SHARDS]" "$(left "$BENCH_RESERVE")" "$WORK/check_gpu.$k.txt" \
    env OMP_NUM_THREADS=1 $PY benchmarks/check_gpu.py ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} \
    ${ONLY_ARGS[@]+"${ONLY_ARGS[@]}"} --shard "$k/$SHARDS"
done
# xformers from PyPI is built for another CUDA than the image's torch: a crash on import would end the benchmark
# process with every row after it, so it is tried here first and removed if it fails.
if [[ " $MISSING " == *" xformers "* ]] && ! timeout 120 $PY -c "import xformers.ops" >>"$WORK/pip.log" 2>&1; then
  log "xformers does not import here (see pip.log): removed, its rows will say so"
  $PY -m pip uninstall -y xformers >>"$WORK/pip.log" 2>&1
fi
if ! finish build; then
  log "build failed or stopped; its last lines:"
  tail -15 "$WORK/build.log"
  log "going on from the source tree without ldmopt._C"
fi
$PY -m ldmopt info 2>&1 | tee "$WORK/info.txt"
# Correctness only: the benchmarks time the same cuda / triton / eager providers.
start check_cuda_backend "$(left "$BENCH_RESERVE")" "$WORK/check_cuda_backend.txt" \
  $PY benchmarks/check_cuda_backend.py --no-bench ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"}
# ldmopt.cuda_graphs' real capture (the CPU tests stand in for it), beside it: whole models, patched and stock.
start check_cuda_graphs "$(left "$BENCH_RESERVE")" "$WORK/check_cuda_graphs.txt" $PY benchmarks/check_cuda_graphs.py
finish
cat "$WORK"/check_gpu.*.txt "$WORK/check_cuda_backend.txt" "$WORK/check_cuda_graphs.txt" >"$RESULTS/checks.txt" \
  2>/dev/null

export LDMOPT_BENCH_QUICK="$QUICK"
PYTEST_ARGS=(-q -p no:cacheprovider)
if $PY -c "import pytest_timeout" 2>/dev/null; then
  PYTEST_ARGS+=(--timeout=300)
else
  log "no pytest-timeout: a hung benchmark would hold the rest of the budget"
fi
# Per-op benchmarks first, whole models next, so a run cut at the budget still has every kernel's figures; then the
# host-overhead rows (their tiny shapes compile kernel variants of their own); last what lies beyond the issues' lists
# (the UNet transformer block's residual epilogues, the Wan block, RMSNorm, SVD's temporal resnet), so that it can
# only lose its own rows to the budget.
# LDMOPT_BENCH_FILES (space-separated paths) runs a subset, in its order: a follow-up run on what a cut run missed.
ALL_BENCH_FILES="benchmarks/bench_group_norm.py benchmarks/bench_temporal_attention.py \
benchmarks/bench_temporal_block.py benchmarks/bench_linear.py benchmarks/bench_resnet_block.py benchmarks/bench_e2e.py \
benchmarks/bench_training.py benchmarks/bench_host_overhead.py benchmarks/bench_transformer_block.py \
benchmarks/bench_wan_block.py benchmarks/bench_rms_norm.py benchmarks/bench_svd_resnet.py"
# -d '': the whole value, line breaks included (read alone stops at the first: a list wrapped over lines lost files)
read -r -d '' -a BENCH_FILES <<<"${LDMOPT_BENCH_FILES:-}" || true
# none named (unset, empty or blanks): all of them; pytest with no path would run the unit tests instead
[ "${#BENCH_FILES[@]}" -gt 0 ] || read -r -d '' -a BENCH_FILES <<<"$ALL_BENCH_FILES" || true
# Where each fused call's host time goes (cProfile per op, tiny tensors): a host-bound row is explained by it. Then
# where a patched model's GPU time goes, kernel by kernel (ldmopt profile, stock and patched), for each model in
# LDMOPT_PROFILE_MODELS (zoo names; empty: none). Both take from the time before the benchmarks' reserve.
profile() {  # profile NAME SECONDS LOGFILE CMD...: optional, so too little time skips it without failing the run
  if [ "$2" -lt 10 ]; then log "$1: skipped, ${2}s left before the benchmarks' reserve"; return; fi
  start "$@"
  finish "$1"
}
: >"$WORK/host_profile.txt"
profile profile_host "$(cap 45 "$BENCH_RESERVE")" "$WORK/host_profile.txt" $PY benchmarks/profile_host.py
: >"$WORK/model_profile.txt"
for model in ${LDMOPT_PROFILE_MODELS-sd15}; do
  for patched in "" --patched; do
    : >"$WORK/model_profile.part"
    profile "profile[$model${patched:+,patched}]" "$(cap 120 "$BENCH_RESERVE")" "$WORK/model_profile.part" \
      $PY -m ldmopt profile "$model" --device cuda --steps 3 --top 6 $patched
    cat "$WORK/model_profile.part" >>"$WORK/model_profile.txt"
  done
done
cat "$WORK/host_profile.txt" "$WORK/model_profile.txt" >"$RESULTS/profiles.txt" 2>/dev/null
log "benchmarks ($MODE, $(left)s)"
# each file gets a share of the stage's time (benchmarks/conftest.py), so a slow one cannot starve the ones after it
export LDMOPT_BENCH_DEADLINE=$(( $(date +%s) + $(left) ))
start benchmarks "$(left)" "$WORK/pytest.txt" $PY -m pytest "${PYTEST_ARGS[@]}" "${BENCH_FILES[@]}"
finish benchmarks
tail -3 "$WORK/pytest.txt"

# The full table from the CSV (a run stopped at its budget has no pytest session summary), then the compact one.
if [ -f "$RESULTS/results.csv" ]; then
  $PY -m benchmarks.harness "$RESULTS/results.csv" >"$RESULTS/summary.md" 2>>"$WORK/summary.err" \
    || log "the full table failed (summary.err in logs.tar.gz)"
fi
if ! $PY -m benchmarks.summary --csv "$RESULTS/results.csv" --checks "$RESULTS/checks.txt" --status "$STAGES" \
    --durations "$WORK/durations.csv" >"$RESULTS/summary.txt" 2>>"$WORK/summary.err"; then
  {
    echo "benchmarks/summary.py failed: $(tail -1 "$WORK/summary.err")"
    cat "$STAGES"
    grep -hE " FAIL$|^\S+ +ERROR|^[A-Za-z_.]+(Error|Exception)\b" "$RESULTS/checks.txt" | cut -c1-160 | head -20
    echo "correctness: $(grep -c ' PASS$' "$RESULTS/checks.txt") passed, $(grep -c ' FAIL$' "$RESULTS/checks.txt") failed"
  } >"$RESULTS/summary.txt" 2>&1
fi
grep -qE " FAIL$|^\S+ +ERROR" "$RESULTS/checks.txt" 2>/dev/null && EXIT=1
echo
echo "================ summary ================"
cat "$RESULTS/summary.txt"
exit "$EXIT"
