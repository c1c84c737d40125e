#!/usr/bin/env bash
# Runs remat's test suite (on CPU through the Triton interpreter; on a GPU for real).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k layer_norm`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
"$PYTHON" -m pytest "$@"
