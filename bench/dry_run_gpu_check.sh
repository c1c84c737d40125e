#!/usr/bin/env bash
# gpu_check.sh end to end without a GPU, in seconds: python, nvidia-smi, compute-sanitizer and
# timeout are stubs (bench/gpu_check_stubs/) that write what the real steps write, at once, and
# only the summary runs for real. Its clock is the model's: each step takes the time modelled for
# it on the H200 machine (the table in gpu_check.sh), so the budget's decisions (a step cut at its
# limit, the extras skipped for lack of time) are those the GPU run is expected to make. Shows what
# the GPU run will print and bring back, before GPU time is spent; ends with the modelled totals.
#   bash bench/dry_run_gpu_check.sh [DIR]       (default: bench/out/dry_run)
# DIR holds the work folder (DIR/gpu_check) and DIR/stub_calls.tsv, every limit the script gave
# with its command. The archive, summary.txt and console.log go to $OUT when it is set (as on the
# GPU machine; DIR must not be inside it), else to DIR/archive.
# gpu_check.sh's settings (GPU_CHECK_*) apply. The stubs' switches (see gpu_check_stubs/python and
# timeout): STUB_BUILD_FAIL=1, STUB_BROKEN_INSTALL=1, STUB_SMOKE_FAIL=1, STUB_NO_PLUGINS=1,
# STUB_TIMEOUT_ON=REGEX (that step runs out of time), STUB_KILL_ON=REGEX (the run is killed there).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-$here/out/dry_run}
rm -rf "$DIR"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
export REAL_PYTHON=${REAL_PYTHON:-$(command -v python3)}
export STUB_LOG="$DIR/stub_calls.tsv"
export PATH="$here/gpu_check_stubs:$PATH" PYTHON="$here/gpu_check_stubs/python" GPU_CHECK_MODEL_TIME=1
export REMAT_COMMIT=${REMAT_COMMIT:-dryrun0} REMAT_CACHE_DIR="$DIR/autotune" TORCHINDUCTOR_CACHE_DIR="$DIR/inductor"
# The GPU machine gets a copy of the tree without its git folder: so does the dry run (REMAT_COMMIT names the commit).
export GIT_DIR="$DIR/no-git-folder"
[ -z "${OUT:-}" ] && export ARCHIVE_DIR="$DIR/archive"
bash "$here/gpu_check.sh" "$DIR/gpu_check"
status=$?
[ -f "$DIR/gpu_check/steps.tsv" ] || exit $status  # it stopped before any step (a wrong setting)

# The modelled seconds of each step as it ran (steps.tsv), and the totals (the background work
# counts through the wait for it).
awk -F '\t' -v budget="${GPU_CHECK_BUDGET:-380}" '
    NR == 1 { print "dry run: the steps, modelled on the H200:"; next }
    { printf "  %-40s %-10s %5s s  %s\n", $1, $5, $3, $4 }
    $5 == "always" { always += $3 }
    $5 != "background" && $3 ~ /^[0-9]+$/ { total += $3 }
    END { printf "dry run: modelled on the H200, the always-run part takes %d s (budget %d s), the whole run %d s\n", always, budget, total }
' "$DIR/gpu_check/steps.tsv"
exit $status
