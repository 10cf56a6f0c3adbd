#!/usr/bin/env bash
# The one prepared GPU run: install what a bare GPU machine lacks (from local wheels, no network), build ldmopt and its
# CUDA extension, check every kernel on the GPU against the reference at real shapes, run the benchmarks, and print
# the summary table last. Quick mode (default) is sized for ~8 minutes on an H200; --full runs everything.
#   bash benchmarks/run_gpu.sh [--full]
# Prepare the wheels here first (this machine has a package index): bash benchmarks/fetch_wheels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="quick"
[ "${1:-}" = "--full" ] && MODE="full"
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
export LDMOPT_BENCH_DIR="$RESULTS"
PY="${PYTHON:-python3}"
log() { echo "[run_gpu $(date +%H:%M:%S)] $*"; }
# One wall-clock budget for the whole run (the device tool stops a command at 600 s, and a stopped command prints no
# summary): each stage gets at most its own cap and never more than what is left, less a margin for the summary.
START=$(date +%s)
TOTAL="${LDMOPT_RUN_BUDGET:-$([ "$MODE" = "quick" ] && echo 560 || echo 7200)}"
case "$TOTAL" in ''|*[!0-9]*) echo "LDMOPT_RUN_BUDGET must be whole seconds, got '$TOTAL'" >&2; exit 2 ;; esac
stage_budget() {  # stage_budget CAP -> seconds this stage may run
  local left=$(( TOTAL - ($(date +%s) - START) - 25 ))
  [ "$left" -lt "$1" ] && echo $(( left > 10 ? left : 10 )) || echo "$1"
}

log "python: $($PY -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if ! $PY -c "import diffusers" 2>/dev/null; then
  log "installing diffusers from benchmarks/wheels"
  # --no-deps: diffusers declares importlib_metadata, which the image lacks (and whose newest release pulls in
  # lazy-importer), yet imports it only on Python < 3.8; its other requirements are in the image. A resolving
  # install would fail on that one name and every model benchmark would skip.
  $PY -m pip install --no-index --no-deps --find-links benchmarks/wheels diffusers >"$RESULTS/pip_diffusers.log" 2>&1 \
    || log "diffusers install failed (see pip_diffusers.log)"
  $PY -c "import diffusers; from diffusers import UNet2DConditionModel" 2>>"$RESULTS/pip_diffusers.log" \
    && log "diffusers $($PY -c 'import diffusers; print(diffusers.__version__)') ready" \
    || log "diffusers not importable (see pip_diffusers.log); model benchmarks will skip"
fi
log "building ldmopt (+ ldmopt._C) with MAX_JOBS=${MAX_JOBS:-16}"
export MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
if ! timeout -k 5 "$(stage_budget 240)" $PY -m pip install --no-index --no-deps --no-build-isolation -e . \
    >"$RESULTS/build.log" 2>&1; then
  log "build failed; last lines:"; tail -20 "$RESULTS/build.log"
  # Without an install nothing below runs: keep the Triton and reference backends at least.
  log "installing without the CUDA extension (LDMOPT_SKIP_CUDA_BUILD=1)"
  LDMOPT_SKIP_CUDA_BUILD=1 timeout -k 5 "$(stage_budget 120)" \
    $PY -m pip install --no-index --no-deps --no-build-isolation -e . >>"$RESULTS/build.log" 2>&1 \
    || log "install failed again (see build.log)"
fi
$PY -m ldmopt info | tee "$RESULTS/info.txt"

log "GPU correctness at real shapes"
CHECK_ARGS=()
[ "$MODE" = "quick" ] && CHECK_ARGS+=(--quick)
timeout -k 5 "$(stage_budget 180)" $PY benchmarks/check_gpu.py ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} 2>&1 | tee "$RESULTS/check_gpu.txt"
log "CUDA C++ backend vs Triton vs reference"
timeout -k 5 "$(stage_budget 240)" $PY benchmarks/check_cuda_backend.py ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} 2>&1 | tee "$RESULTS/check_cuda_backend.txt"

log "benchmarks ($MODE)"
export LDMOPT_BENCH_QUICK=$([ "$MODE" = "quick" ] && echo 1 || echo 0)
BUDGET=$(stage_budget "$([ "$MODE" = "quick" ] && echo 330 || echo 3600)")
# Per-op benchmarks first, whole models next, so a run cut at the budget still has every kernel's figures; then the
# host-overhead rows (their tiny shapes compile kernel variants of their own); last what lies beyond the issues' lists
# (the UNet transformer block's residual epilogues, the Wan block, RMSNorm, SVD's temporal resnet), so that it can only lose its own rows
# to the budget.
timeout -k 5 "$BUDGET" $PY -m pytest -q -p no:cacheprovider --timeout=300 \
  benchmarks/bench_group_norm.py benchmarks/bench_temporal_attention.py benchmarks/bench_temporal_block.py \
  benchmarks/bench_linear.py benchmarks/bench_resnet_block.py benchmarks/bench_e2e.py benchmarks/bench_training.py \
  benchmarks/bench_host_overhead.py benchmarks/bench_transformer_block.py benchmarks/bench_wan_block.py \
  benchmarks/bench_rms_norm.py benchmarks/bench_svd_resnet.py \
  2>&1 | tail -n 400 >"$RESULTS/pytest.txt"
log "pytest exit: ${PIPESTATUS[0]} (124 = stopped at the ${BUDGET}s budget; rows so far are kept)"
tail -5 "$RESULTS/pytest.txt"
echo
echo "================ summary ================"
CHECKS=("$RESULTS/check_gpu.txt" "$RESULTS/check_cuda_backend.txt")
# Every failure first (a tail of all lines could hide one among the passes), then the checks' own totals.
cat "${CHECKS[@]}" 2>/dev/null | grep -E "FAIL|ERROR|Traceback" | head -60 || true
echo "correctness cases passed: $(cat "${CHECKS[@]}" 2>/dev/null | grep -c "PASS")"
cat "${CHECKS[@]}" 2>/dev/null | grep -E "^(check_gpu|check_cuda_backend):" || true
# From the CSV, so a run stopped at the budget (no pytest session summary) still prints its table.
if [ -f "$RESULTS/results.csv" ]; then
  $PY -m benchmarks.harness "$RESULTS/results.csv" | tee "$RESULTS/summary.md"
else
  echo "no benchmark rows were recorded; the end of pytest's output:"
  tail -30 "$RESULTS/pytest.txt"
  exit 1
fi
