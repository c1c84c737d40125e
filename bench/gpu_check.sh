#!/usr/bin/env bash
# One command for a fresh GPU machine without network: build the extension, run the tests on
# the GPU, run the benchmarks, and leave every log, CSV, markdown and PNG in one folder.
#   bash bench/gpu_check.sh [OUT_DIR]      (default: bench/out/gpu_check)
# Uses the python3 and torch already installed there (no downloads). Finishes in < 8 min: each
# step has its own time limit (the sum is 470 s plus the environment step), and the benchmark
# steps are interrupted with SIGINT, on which `remat bench` writes the results it has so far.
# When $ARCHIVE_DIR is set, everything is also packed into $ARCHIVE_DIR/gpu_check.tar.gz with
# summary.txt beside it (for runners that bring back only a few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-bench/out/gpu_check}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python3}
# Attention block sizes tuned by the benchmarks land in the output folder with the results.
export REMAT_CACHE_DIR=${REMAT_CACHE_DIR:-$OUT_DIR/autotune}
status=0
step() { echo "== $1 ($(date +%T))"; }

pack() {
    [ -n "${ARCHIVE_DIR:-}" ] || return 0
    mkdir -p "$ARCHIVE_DIR"
    tar czf "$ARCHIVE_DIR/gpu_check.tar.gz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
    cp "$OUT_DIR/summary.txt" "$ARCHIVE_DIR/" 2>/dev/null
}
trap pack EXIT
exec > >(tee "$OUT_DIR/summary.txt") 2>&1

step "environment"
{ nvidia-smi; "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } \
    > "$OUT_DIR/environment.txt" 2>&1
tail -n 1 "$OUT_DIR/environment.txt"

step "build (sm_90 only)"
if ! TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} timeout 150 \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -e . > "$OUT_DIR/build.log" 2>&1; then
    echo "build failed: see build.log"; tail -n 30 "$OUT_DIR/build.log"; exit 1
fi
"$PYTHON" -m remat info | tee "$OUT_DIR/backends.txt"

step "tests on the GPU"
# The ahead-of-time compile checks need no GPU and already run in CI: skipped here for time.
# Several workers when pytest-xdist is there: most of the time is Triton's compiler, on the CPU.
parallel=$("$PYTHON" -c "import xdist" 2> /dev/null && echo "-n 8")
timeout 120 "$PYTHON" -m pytest -q $parallel --junitxml="$OUT_DIR/pytest.xml" -k "not compiles_without_spills" \
    --ignore tests/test_cuda_compile.py --ignore tests/test_triton_aot.py > "$OUT_DIR/pytest.log" 2>&1 || status=1
tail -n 5 "$OUT_DIR/pytest.log"

if command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool"
        timeout 40 compute-sanitizer --tool "$tool" --error-exitcode 3 "$PYTHON" bench/sanitize_check.py \
            > "$OUT_DIR/sanitizer_$tool.log" 2>&1 || status=1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all ops ran" "$OUT_DIR/sanitizer_$tool.log" | tail -n 2
    done
else
    echo "compute-sanitizer not found: memory checks skipped"
fi

step "kernel benchmarks"
timeout -s INT 90 "$PYTHON" -m remat bench layernorm gelu mlp attention --dtype bf16 --no-progress \
    --out "$OUT_DIR/bench" > "$OUT_DIR/bench.log" 2>&1 || status=1

step "block benchmark (2 layers: per-layer figures do not depend on the depth)"
timeout -s INT 60 "$PYTHON" -m remat bench block --quick --no-progress --out "$OUT_DIR/block" \
    > "$OUT_DIR/block.log" 2>&1 || status=1

step "memory policies"
timeout 30 "$PYTHON" -m remat memory --model gpt2-medium --batch 8 --seq 1024 --budget 20 --out "$OUT_DIR/memory" \
    > "$OUT_DIR/memory.log" 2>&1 || status=1

step "summary"
grep -E "bfloat16" "$OUT_DIR/bench/bench.md" 2>/dev/null | head -n 60
grep -E "^\| gpt_block" "$OUT_DIR/block/bench.md" 2>/dev/null
tail -n 12 "$OUT_DIR/memory.log" 2>/dev/null
exit $status
