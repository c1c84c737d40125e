"""Correctness before speed: remat's ops and fused layers at the benchmark shapes, against PyTorch.

    python bench/smoke_check.py [--out DIR] [--dtypes bf16 fp16] [--suites layernorm ...] [--jobs N]

Each forward + backward case of the benchmark suites at their `remat bench --quick` shapes
(LayerNorm, RMSNorm, GELU in its three forms, the gated activations, MLP and LayerNormMLP,
attention causal or not and with its features, the GPT block with its LayerNormLinear) runs
every remat implementation (each backend; not those under torch.compile, which the benchmarks
check) once, nothing timed, and compares its output and every gradient with float64: at most
twice PyTorch's own error (remat.bench.check). A (suite, dtype) group is one process, several at
once; attention runs its fixed block table (REMAT_AUTOTUNE=0: tuning is the benchmarks' job, and
they check what it picks). Every suite the benchmarks run is here: its kernels compile in this
step, in parallel, not one after the other inside a benchmark's limit.

smoke.csv and smoke.md in --out are rewritten as each group ends, so a run cut short keeps what it
checked (Ctrl-C or SIGINT: the unfinished groups are written as such). Exit status 1 if any check
fails, a case does not run, or a group does not finish.
"""

import argparse
import csv
import multiprocessing
import os
import sys

SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")
COLUMNS = ["suite", "op", "dtype", "shape", "implementation", "check", "error", "seconds"]


def check_group(group):
    """((suite, dtype name), rows) of the smoke check of group = (suite, dtype name, device), in a
    worker process; one row "did not run" when the group fails as a whole."""
    suite, dtype_name, device = group
    try:
        return (suite, dtype_name), _check_group(suite, dtype_name, device)
    except Exception as error:
        return (suite, dtype_name), [{"suite": suite, "dtype": dtype_name, "check": "did not run",
                                      "error": f"{type(error).__name__}: {error}"[:200]}]


def _check_group(suite, dtype_name, device):
    from remat.bench.kernel_check import check_rows

    return check_rows(suite, dtype_name, device, lambda result: result.check or "did not run")


def passed(row):
    return row["check"].startswith("ok")


def _write(rows, pending, env, out_dir):
    """smoke.csv (a row per check, then one per unfinished group) and smoke.md."""
    rows = rows + [{"suite": suite, "dtype": dtype, "check": "not finished"} for suite, dtype in pending]
    with open(os.path.join(out_dir, "smoke.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS + list(env), restval="")
        writer.writeheader()
        writer.writerows({**row, **env} for row in rows)
    good = sum(passed(row) for row in rows)
    lines = ["# remat smoke check: remat against float64, at most twice PyTorch's error", "",
             *[f"- {k}: {v}" for k, v in env.items()], "",
             f"{good} of {len(rows)} ok"
             + (f"; not finished: {', '.join(f'{s} {d}' for s, d in pending)}" if pending else ""), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |" for row in rows]
    with open(os.path.join(out_dir, "smoke.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def _environment(device):
    import torch

    from remat.bench import report

    env = report.environment(torch.device(device))
    return {k: env[k] for k in ("device", "driver", "cuda", "torch", "triton", "commit")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out/smoke")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--jobs", type=int, default=0, help="processes (default: one per group)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["REMAT_AUTOTUNE"] = "0"  # before the workers start: they inherit it
    groups = [(suite, dtype) for suite in args.suites for dtype in args.dtypes]
    rows, pending, env = [], list(groups), {}
    _write(rows, pending, env, args.out)  # from the start: every group is there, unfinished
    # spawn: CUDA cannot be used in forked children of a process that initialised it.
    pool = multiprocessing.get_context("spawn").Pool(args.jobs or len(groups))
    try:
        done = pool.imap_unordered(check_group, [(suite, dtype, args.device) for suite, dtype in groups])
        env = _environment(args.device)
        for group, found in done:
            pending.remove(group)
            for row in found:
                print(f"{row['dtype']} {row.get('op', row['suite'])} {row.get('shape', '')} "
                      f"{row.get('implementation', '')}: {row['check']} {row['error']}".rstrip(), flush=True)
            rows += found
            _write(rows, pending, env, args.out)
    except KeyboardInterrupt:
        print(f"interrupted: {len(pending)} groups not finished", flush=True)
    finally:
        pool.terminate()  # no worker outlives this process, busy or not (they hold GPU memory)
        _write(rows, pending, env, args.out)
    good = sum(passed(row) for row in rows)
    print(f"smoke: {good} of {len(rows)} checks ok, {len(pending)} groups not finished; {args.out}/smoke.md",
          flush=True)
    return 0 if good == len(rows) and not pending else 1


if __name__ == "__main__":
    sys.exit(main())
