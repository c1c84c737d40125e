#!/usr/bin/env bash
# Sets up .venv for remat: torch, triton and the test/bench tools, then builds and installs
# remat itself (with its CUDA extension when nvcc is present). Sourced by bench.sh and test.sh;
# quick when nothing changed.
#   REMAT_VENV    the virtual environment (default .venv in the repository)
#   REMAT_TORCH   the torch requirement (default torch==2.14.1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${REMAT_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi
PYTHON="$VENV/bin/python"
"$PYTHON" -m pip install --quiet --upgrade pip
"$PYTHON" -m pip install --quiet "${REMAT_TORCH:-torch==2.14.1}" "triton>=3.6" ninja \
    "pytest>=7" "pytest-xdist>=3" "hypothesis>=6" numpy matplotlib setuptools wheel "transformers>=5.25,<6" \
    "peft>=0.21" "accelerate>=1.15" ruff==0.17.6
# Rebuild only when the sources of the extension or the build changed.
stamp="$VENV/.remat-build-stamp"
sources_hash=$(cat setup.py pyproject.toml csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources_hash" ]; then
    echo "setup: building and installing remat (pip install --no-build-isolation -e .)"
    "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps -e .
    echo "$sources_hash" > "$stamp"
fi
"$PYTHON" -c "import remat; print('setup: remat backends:', {k: v[0] for k, v in remat.backends().items()})"
