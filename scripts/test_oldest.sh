#!/usr/bin/env bash
# Runs the test suite against the oldest torch and triton remat supports (torch 2.11, triton 3.6,
# with transformers 5.17: what GPU machine images built on PyTorch 2.11 hold), in a venv of its
# own, on a copy of the working tree (the extension is built in the tree, so each torch needs its
# own). The Hugging Face family tests skip there: the hf extra needs transformers 5.25 (older
# attention forwards differ, and remat leaves them stock). CI runs it after scripts/test.sh.
# Extra arguments go to pytest.
#   REMAT_OLDEST_VENV  the venv (default .venv-oldest in the repository)
#   REMAT_TEST_WORKERS pytest-xdist worker processes (default 2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=$(realpath -m "${REMAT_OLDEST_VENV:-.venv-oldest}")
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PYTHON="$VENV/bin/python"
"$PYTHON" -m pip install --quiet --upgrade pip
# numpy below 2.4: triton 3.6's interpreter turns one-element arrays into Python ints, which numpy
# 2.4 refuses (the compiled kernels on a GPU do not use numpy).
"$PYTHON" -m pip install --quiet torch==2.11.0 triton==3.6.0 transformers==5.17.0 peft==0.21.2 accelerate==1.15.0 \
    "numpy<2.4" ninja "pytest>=7" "pytest-xdist>=3" "hypothesis>=6" matplotlib "setuptools>=77" wheel

TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
# Tracked and untracked files that git does not ignore: the tree CI clones, uncommitted edits included.
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$TREE"
cd "$TREE"
# The CUDA extension for sm_90 alone (when nvcc is present): that it builds against torch 2.11's
# headers and loads is what is checked; tests/package checks the code it compiles to.
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2} "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps -e .
"$PYTHON" -c "import remat, torch, triton, transformers; print('oldest stack: torch', torch.__version__, 'triton',
      triton.__version__, 'transformers', transformers.__version__, 'backends', {k: v[0] for k, v in remat.backends().items()})"
# Left out: tests/package (the compiler's output, checked with the pinned stack; triton 3.6 puts
# 8 bytes on the stack in 7 of ~2000 kernels that 3.8 compiles clean), and one test that turns
# warnings into errors, where triton 3.6's interpreter itself warns (numpy's deprecated
# array-to-int conversion).
"$PYTHON" -m pytest -n "${REMAT_TEST_WORKERS:-2}" -p no:cacheprovider --ignore tests/package \
    --deselect "tests/ops/test_attention.py::test_row_offsets_past_2_31_elements" "$@"
