#!/usr/bin/env bash
# Runs remat's test suite (on CPU through the Triton interpreter; on a GPU for real).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k layer_norm`.
#   REMAT_TEST_WORKERS  pytest-xdist worker processes (default 2; 0 runs in this process). The
#                       interpreter's tests are single-threaded Python: two workers on two cores
#                       take about half the time of one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
"$PYTHON" -m pytest -n "${REMAT_TEST_WORKERS:-2}" "$@"
