"""The main job on a machine without a GPU (`remat bench` without ops, `bash scripts/bench.sh`).

What a CPU can tell for certain, in a minute or two: how much memory remat would save on real
models (remat memory's report: every policy's bytes kept for the backward, counted exactly on meta
tensors at the models' real sizes, step times predicted for a GPU by the planner's cost model), and
that every kernel computes what it should (remat.bench.kernel_check: float64 at small shapes,
through the Triton interpreter, in worker processes started first so that they run while the
memory is counted). Timing kernels on a CPU says nothing about a GPU: `remat bench all --device cpu`
still does it.
"""

import os

from .. import memory
from .kernel_check import CHECK_DTYPES, Checks, passed, row_text, write

BANNER = """\
No GPU here: what remat saves on real models, counted exactly on meta tensors (no memory used),
with step times predicted for {gpu} (a model, not a measurement); then every kernel checked against
float64 at small shapes through the Triton interpreter. On a GPU the same command runs the kernel
microbenchmarks; `remat bench all --device cpu` times the kernels on this CPU anyway (functional
timings, not performance)."""


def run(out_dir="bench/out", dtypes=CHECK_DTYPES, models=memory.DEFAULT_MODELS, batch=None, seq=None,
        suites=None, jobs=2, gpu=memory.DEFAULT_GPU, progress=True):
    """The memory report of `models` and the float64 check of `suites` (default every one) in
    `dtypes`; tables printed, memory_<model>.csv/.png and check.csv/.md written to out_dir. jobs: worker
    processes for the check (0: in this process, which must have TRITON_INTERPRET=1 to check the
    Triton kernels rather than the reference). Returns (the memory results by model, the check's rows)."""
    print(BANNER.format(gpu=gpu), flush=True)
    checks = Checks(dtypes, suites, jobs)  # started first: the workers check while the memory is counted
    try:
        found = {name: memory.run(name, batch=batch, seq=seq, out_dir=out_dir, device="meta", gpu=gpu)
                 for name in models}
        print(f"\nremat's kernels against float64 ({', '.join(dtypes)}; at most twice PyTorch's own error):",
              flush=True)
        rows = checks.results(on_row=lambda row: print("  " + row_text(row), flush=True) if progress else None)
    finally:
        checks.close()
    csv_path, md_path = write(rows, out_dir)
    good = sum(passed(row) for row in rows)
    print(f"\n{good} of {len(rows)} kernel checks ok ({csv_path}, {md_path}); memory: "
          + ", ".join(os.path.join(out_dir, f"memory_{memory.file_label(name)}.png") for name in models), flush=True)
    return found, rows
