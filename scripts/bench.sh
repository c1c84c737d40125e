#!/usr/bin/env bash
# Runs the kernel microbenchmarks: remat against PyTorch and the other peers, in one run.
# Without arguments: `remat bench --quick`; otherwise the arguments go to `remat bench`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ $# -eq 0 ]; then set -- --quick; fi
"$VENV/bin/remat" bench "$@"
