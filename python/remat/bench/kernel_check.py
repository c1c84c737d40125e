"""Every kernel against float64 at small shapes, nothing timed: the check the main job runs without a GPU.

Each forward + backward case of the benchmark suites, at their CPU shapes, runs remat's
implementation once, and its output and every gradient are compared with float64: at most twice
PyTorch's own error in the same dtype (remat.bench.check, as the benchmarks and the GPU's smoke check
hold them). A case with no float64 reference (attention with dropout: no two implementations draw
the same mask) is listed as unchecked.

Without a GPU the Triton kernels run through Triton's interpreter, which TRITON_INTERPRET=1 turns on
when triton is imported: the (suite, dtype) groups run in worker processes started with it, two by
default (the interpreter is single-threaded Python), while the process that started them goes on
with other work. bf16 is not checked here: the interpreter's tl.dot is wrong on bf16 operands
(triton issue 11584); bf16 is checked on a GPU (bench/smoke_check.py).
"""

import contextlib
import csv
import multiprocessing
import os
import time

CHECK_DTYPES = ("fp32", "fp16")
COLUMNS = ["suite", "op", "dtype", "shape", "implementation", "check", "error", "seconds"]
NO_REFERENCE = "unchecked: the case has no float64 reference"


def check_group(group):
    """((suite, dtype name), rows) of one group = (suite, dtype name); one row "did not run" when the
    group fails as a whole."""
    suite, dtype_name = group
    try:
        return group, _check_group(suite, dtype_name)
    except Exception as error:  # a group that cannot run is a row that says why, not a lost check
        return group, [{"suite": suite, "dtype": dtype_name, "check": "did not run",
                        "error": f"{type(error).__name__}: {error}"[:200]}]


def _check_group(suite, dtype_name):
    import remat

    remat._load()  # a worker of the `remat` command starts with the package not loaded (remat/__init__.py)
    return check_rows(suite, dtype_name, "cpu", _verdict)


def check_rows(suite, dtype_name, device, verdict):
    """A row (COLUMNS) per remat implementation of each forward + backward case of `suite` at its quick
    shapes on `device`, checked once against float64, nothing timed; verdict(result) is its check column.
    The smoke check of a GPU run (bench/smoke_check.py) runs the same."""
    import torch

    from . import DTYPES, SUITES
    from .cases import check_case

    rows = []
    for case in SUITES[suite].cases(torch.device(device), [DTYPES[dtype_name]], quick=True):
        if case.mode != "fwd+bwd":  # the same function as its fwd and bwd cases: one check covers them
            continue
        case.implementations = [impl for impl in case.implementations if impl.ours and not impl.compiles]
        start = time.perf_counter()
        results = check_case(case)
        seconds = (time.perf_counter() - start) / max(len(results), 1)
        rows += [{"suite": suite, "op": case.op, "dtype": dtype_name, "shape": case.shape,
                  "implementation": r.implementation, "check": verdict(r), "error": r.error,
                  "seconds": f"{seconds:.1f}"} for r in results]
    return rows


def _verdict(result):
    """The check's verdict ("ok (1.02x)", "wrong"); else "failed" (it did not run) or NO_REFERENCE."""
    if result.check:
        return result.check
    return "failed" if result.error else NO_REFERENCE


def passed(row):
    return row["check"].startswith("ok") or row["check"] == NO_REFERENCE


@contextlib.contextmanager
def _environment(**values):
    """os.environ with `values`, for the worker processes started inside; restored after, so this
    process keeps its own setting (TRITON_INTERPRET here would send meta tensors to the interpreter)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Checks:
    """The check's groups, started in `jobs` worker processes under the Triton interpreter (or run
    in this process, one after the other, when jobs is 0: for a process that has the interpreter on)."""

    def __init__(self, dtypes=CHECK_DTYPES, suites=None, jobs=2):
        from . import SUITES

        self.groups = [(suite, dtype) for suite in (suites or SUITES) for dtype in dtypes]
        self.pool = None
        if jobs:
            # spawn: a fresh interpreter that reads TRITON_INTERPRET when it imports triton
            with _environment(TRITON_INTERPRET="1", REMAT_AUTOTUNE="0"):
                self.pool = multiprocessing.get_context("spawn").Pool(min(jobs, len(self.groups)))
            self.pending = self.pool.imap_unordered(check_group, self.groups)

    def results(self, on_row=print):
        """Every row, as the groups end; on_row(row) for each as it comes."""
        done = self.pending if self.pool else map(check_group, self.groups)
        rows = []
        for _, found in done:
            for row in found:
                on_row(row)
            rows += found
        return rows

    def close(self):
        if self.pool is not None:
            self.pool.terminate()  # no worker outlives the run, busy or not


def row_text(row):
    return (f"{row['dtype']} {row.get('op', row['suite'])} {row.get('shape', '')} {row.get('implementation', '')}: "
            f"{row['check']} {row['error']}").rstrip()


def write(rows, out_dir):
    """check.csv (a row per check) and check.md in out_dir; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path, md_path = os.path.join(out_dir, "check.csv"), os.path.join(out_dir, "check.md")
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    good = sum(passed(row) for row in rows)
    lines = ["# remat kernels against float64 (at most twice PyTorch's error), on CPU through the Triton interpreter",
             "", f"{good} of {len(rows)} ok", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |" for row in rows]
    with open(md_path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return csv_path, md_path
