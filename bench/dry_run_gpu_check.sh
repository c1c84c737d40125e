#!/usr/bin/env bash
# gpu_check.sh end to end without a GPU, in seconds: python, nvidia-smi, compute-sanitizer and
# timeout are stubs (bench/gpu_check_stubs/) that write what the real steps write, and only the
# summary runs for real. Shows what the GPU run will print and leave, before GPU time is spent.
#   bash bench/dry_run_gpu_check.sh [OUT_DIR]       (default: bench/out/dry_run)
# The stubs' switches (see gpu_check_stubs/python and timeout): STUB_BUILD_FAIL=1,
# STUB_SMOKE_FAIL=1, STUB_NO_PLUGINS=1, STUB_TIMEOUT_ON=REGEX (that step runs out of time).
# Every limit the script gave is logged, with its command, in OUT_DIR/stub_calls.tsv.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT_DIR=${1:-$here/out/dry_run}
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export REAL_PYTHON=${REAL_PYTHON:-$(command -v python3)}
export STUB_LOG="$OUT_DIR/stub_calls.tsv"
export PATH="$here/gpu_check_stubs:$PATH" PYTHON="$here/gpu_check_stubs/python"
export REMAT_COMMIT=${REMAT_COMMIT:-dryrun0} REMAT_CACHE_DIR="$OUT_DIR/autotune" TORCHINDUCTOR_CACHE_DIR="$OUT_DIR/inductor"
ARCHIVE_DIR="$OUT_DIR/archive" bash "$here/gpu_check.sh" "$OUT_DIR/gpu_check"
