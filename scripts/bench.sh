#!/usr/bin/env bash
# The main job. On a GPU: the kernel microbenchmarks, remat against PyTorch and the other peers in
# one run. Without one: what remat saves on real models (counted exactly on meta tensors, step times
# predicted for a GPU) and every kernel checked against float64 through the Triton interpreter.
# Without arguments: `remat bench --quick`; otherwise the arguments go to `remat bench`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ $# -eq 0 ]; then set -- --quick; fi
"$VENV/bin/remat" bench "$@"
