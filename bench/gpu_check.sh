#!/usr/bin/env bash
# One command for a fresh GPU machine without network: build the extension, run the tests on
# the GPU, run the benchmarks, and leave every log, CSV, markdown and PNG in one folder.
#   bash bench/gpu_check.sh [OUT_DIR]      (default: bench/out/gpu_check)
# Uses the python3 and torch already installed there (no downloads). Finishes in < 8 min: each
# step has its own time limit (build 105 s, tests 95, kernel benchmarks 75, block benchmark 140,
# memory 35: 450 s, plus the environment step). The benchmark steps are interrupted with SIGINT,
# on which `remat bench` and `remat memory` write the results they have so far (SIGKILL 10 s
# later if one does not stop). While the tests run, every attention autotuning candidate is
# compiled into Triton's cache by other processes, and compute-sanitizer's memcheck runs the
# CUDA extension's kernels, so the benchmarks' tuner only times and the time limits hold.
# GPU_CHECK_RACECHECK=1 adds compute-sanitizer's racecheck at the end (slow).
# When $ARCHIVE_DIR is set, everything is also packed into $ARCHIVE_DIR/gpu_check.tar.gz with
# summary.txt beside it (for runners that bring back only a few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-bench/out/gpu_check}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python3}
# Attention block sizes tuned by the benchmarks land in the output folder with the results.
export REMAT_CACHE_DIR=${REMAT_CACHE_DIR:-$OUT_DIR/autotune}

step() { echo "== $1 ($(date +%T))"; }

sanitize() {  # sanitize TOOL LIMIT: the CUDA extension's kernels under compute-sanitizer
    timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 3 "$PYTHON" bench/sanitize_check.py \
        > "$OUT_DIR/sanitizer_$1.log" 2>&1
    local rc=$?
    echo "compute-sanitizer $1: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all ops ran" "$OUT_DIR/sanitizer_$1.log" | tail -n 2 | tr '\n' ' ')"
    return $rc
}

main() {
    local status=0
    step "environment"
    { nvidia-smi; "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } \
        > "$OUT_DIR/environment.txt" 2>&1
    tail -n 1 "$OUT_DIR/environment.txt"

    step "build (sm_90 only)"
    if ! TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} timeout 105 \
        "$PYTHON" -m pip install --no-build-isolation --no-deps -e . > "$OUT_DIR/build.log" 2>&1; then
        echo "build failed: see build.log"; tail -n 30 "$OUT_DIR/build.log"; return 1
    fi
    "$PYTHON" -m remat info | tee "$OUT_DIR/backends.txt"

    step "tests on the GPU; meanwhile attention kernels compiled into Triton's cache, and memcheck"
    timeout 90 "$PYTHON" bench/warm_triton_cache.py --jobs 6 > "$OUT_DIR/warm_triton_cache.log" 2>&1 &
    local warm=$!
    local memcheck=""
    if command -v compute-sanitizer > /dev/null; then
        sanitize memcheck 90 > "$OUT_DIR/memcheck_summary.txt" &
        memcheck=$!
    else
        echo "compute-sanitizer not found: memory checks skipped"
    fi
    # The ahead-of-time compile checks need no GPU and already run in CI: skipped here for time.
    # Several workers when pytest-xdist is there: most of the time is Triton's compiler, on the CPU.
    local parallel
    parallel=$("$PYTHON" -c "import xdist" 2> /dev/null && echo "-n 8")
    # SIGINT: pytest stops, still prints its summary and writes the junit XML of what ran.
    timeout -k 10 -s INT 95 "$PYTHON" -m pytest -q $parallel --durations=30 --junitxml="$OUT_DIR/pytest.xml" -k "not compiles_without_spills" \
        --ignore tests/test_cuda_compile.py --ignore tests/test_triton_aot.py > "$OUT_DIR/pytest.log" 2>&1 || status=1
    tail -n 5 "$OUT_DIR/pytest.log"
    wait "$warm"; tail -n 1 "$OUT_DIR/warm_triton_cache.log"
    if [ -n "$memcheck" ]; then
        wait "$memcheck" || status=1
        cat "$OUT_DIR/memcheck_summary.txt"
    fi

    step "kernel benchmarks (attention first)"
    timeout -k 10 -s INT 75 "$PYTHON" -m remat bench attention layernorm gelu mlp --quick --dtype bf16 \
        --no-progress --out "$OUT_DIR/bench" > "$OUT_DIR/bench.log" 2>&1 || status=1

    step "block benchmark (2 layers: per-layer figures do not depend on the depth)"
    timeout -k 10 -s INT 140 "$PYTHON" -m remat bench block --quick --no-progress --out "$OUT_DIR/block" \
        > "$OUT_DIR/block.log" 2>&1 || status=1

    step "memory policies"
    timeout -k 10 -s INT 35 "$PYTHON" -m remat memory --model gpt2-medium --batch 8 --seq 1024 --budget 20 \
        --out "$OUT_DIR/memory" > "$OUT_DIR/memory.log" 2>&1 || status=1

    if [ "${GPU_CHECK_RACECHECK:-0}" = 1 ] && command -v compute-sanitizer > /dev/null; then
        step "compute-sanitizer racecheck"
        sanitize racecheck 120 || status=1
    fi

    step "summary"
    grep -E "bfloat16" "$OUT_DIR/bench/bench.md" 2>/dev/null | head -n 80
    grep -E "^\| gpt_block" "$OUT_DIR/block/bench.md" 2>/dev/null
    tail -n 16 "$OUT_DIR/memory.log" 2>/dev/null
    return $status
}

# The pipeline ends only when tee has written everything: the archive has the whole summary.
main 2>&1 | tee "$OUT_DIR/summary.txt"
status=${PIPESTATUS[0]}
if [ -n "${ARCHIVE_DIR:-}" ]; then
    mkdir -p "$ARCHIVE_DIR"
    tar czf "$ARCHIVE_DIR/gpu_check.tar.gz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
    cp "$OUT_DIR/summary.txt" "$ARCHIVE_DIR/"
fi
exit $status
