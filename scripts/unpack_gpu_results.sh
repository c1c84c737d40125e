#!/usr/bin/env bash
# Puts the tables of a bench/gpu_check.sh archive under bench/results/<date>-<gpu>-<commit>/, ready
# to commit: the summary, the steps and their seconds, the environment, the smoke check, every
# benchmark suite's CSV, markdown and plots, the tuned attention blocks and `remat memory`'s tables.
# The logs stay in the archive (keep it beside the results if they are needed).
#   bash scripts/unpack_gpu_results.sh ARCHIVE [RESULTS_DIR]     (default RESULTS_DIR: bench/results)
# date: the run's (UTC); gpu: its name, lower case, without "NVIDIA" (h200); commit: the commit the
# run named. It refuses a run whose commit is unknown (the tree was copied without .git and without
# REMAT_COMMIT: pass COMMIT=<commit> if you know it), and a folder that already exists.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ ! -f "$1" ]; then
    echo "usage: bash scripts/unpack_gpu_results.sh ARCHIVE [RESULTS_DIR] (ARCHIVE: gpu_check.tar.gz)" >&2
    exit 2
fi
archive=$1
results=${2:-$(cd "$(dirname "$0")/.." && pwd)/bench/results}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$archive" -C "$work"
run_file=$(find "$work" -mindepth 2 -maxdepth 2 -name run.txt | head -n 1)
if [ -z "$run_file" ]; then
    echo "error: $archive has no run.txt: not an archive of bench/gpu_check.sh" >&2
    exit 1
fi
run=$(dirname "$run_file")

field() {  # field NAME: NAME's value in run.txt (its last line: the environment step may add one)
    sed -n "s/^$1=//p" "$run_file" | tail -n 1
}

date=$(field date)
commit=${COMMIT:-$(field commit)}
gpu=$(field gpu | tr '[:upper:]' '[:lower:]' | sed -e 's/nvidia//g' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
if [ -z "$commit" ] || [ "$commit" = unknown ]; then
    echo "error: the run does not know its commit; pass COMMIT=<commit> if you know which one ran" >&2
    exit 1
fi
case $commit in
    *-dirty) echo "warning: the run's tree had uncommitted changes ($commit): its results describe no commit exactly" >&2 ;;
esac
dest="$results/${date:-undated}-${gpu:-unknown-gpu}-$commit"
if [ -e "$dest" ]; then
    echo "error: $dest already exists" >&2
    exit 1
fi

# The tables, each at its path in the work folder.
mkdir -p "$dest"
(
    cd "$run"
    find . -maxdepth 1 -type f \( -name summary.txt -o -name steps.tsv -o -name run.txt -o -name environment.txt \
        -o -name backends.txt -o -name memcheck_summary.txt \) -print
    find smoke bench memory -type f \( -name '*.csv' -o -name '*.md' -o -name '*.png' \) -print 2> /dev/null || true
    find autotune -type f -name '*.json' -print 2> /dev/null || true
) | sort > "$work/files"
(cd "$run" && tar cf - -T "$work/files") | tar xf - -C "$dest"
echo "unpacked $(wc -l < "$work/files") files into $dest:"
sed 's/^\.\///; s/^/  /' "$work/files"
echo "next: git add $dest"
