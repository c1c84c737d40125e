#!/usr/bin/env bash
# Sets up .venv for remat: torch, triton and the test/bench tools, then installs remat itself.
# Sourced by bench.sh and test.sh; a few seconds when nothing changed.
#   REMAT_VENV        the virtual environment (default .venv in the repository)
#   REMAT_TORCH       the torch requirement (default torch==2.15.0)
#   REMAT_BUILD_CUDA  1: build the CUDA extension remat._C (needs nvcc and a CUDA build of torch;
#                     tens of minutes on a few cores); 0: never. Default: only where torch sees a
#                     GPU, the one place it can run. (`pip install .` itself builds it wherever nvcc
#                     and a CUDA torch are present: a cluster's build node has no GPU.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${REMAT_VENV:-.venv}
PYTHON="$VENV/bin/python"
REQUIREMENTS=("${REMAT_TORCH:-torch==2.15.0}" "triton>=3.6" ninja "pytest>=7" "pytest-xdist>=3" "hypothesis>=6"
              numpy matplotlib "setuptools>=77" wheel "transformers>=5.25,<6" "peft>=0.21" "accelerate>=1.15" ruff==0.17.6
              deepspeed==0.19.8)  # deepspeed: the ZeRO-3 tests (tests/convert/test_distributed.py), not remat's
if [ ! -x "$PYTHON" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi
# Install the requirements only when they changed since the last install into this venv.
wanted="${REQUIREMENTS[*]} | $("$PYTHON" --version 2>&1)"
stamp="$VENV/.remat-requirements-stamp"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    echo "setup: installing torch, triton, transformers and the test tools (pip; several GB the first time)"
    "$PYTHON" -m pip install --quiet --upgrade pip
    "$PYTHON" -m pip install --quiet "${REQUIREMENTS[@]}"
    echo "$wanted" > "$stamp"
fi
# The CUDA extension: built where it can run (a GPU), or when asked.
build_cuda=${REMAT_BUILD_CUDA:-$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")}
if [ "$build_cuda" = 1 ]; then
    skip=0
    echo "setup: the CUDA extension will be built (REMAT_BUILD_CUDA=${REMAT_BUILD_CUDA:-unset, a GPU is present})"
else
    skip=1
fi
# Rebuild only when the sources of the extension, the build, or the choice to build it changed.
stamp="$VENV/.remat-build-stamp"
sources_hash="$(cat setup.py pyproject.toml csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1) cuda=$build_cuda"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources_hash" ]; then
    echo "setup: installing remat (pip install --no-build-isolation -e .)"
    REMAT_SKIP_CUDA_BUILD=$skip "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps -e .
    echo "$sources_hash" > "$stamp"
fi
echo "setup: remat backends on this machine (remat info):"
"$VENV/bin/remat" info | sed 's/^/    /'
