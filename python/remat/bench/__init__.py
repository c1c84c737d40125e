"""Kernel microbenchmarks: remat against the peers that are installed, in the same run."""

import importlib

import torch

from ..ops import FAMILIES
from . import block, mlp, overhead, report
from .cases import CaseInterrupted, Progress, Timer, measure_case

# Suite name -> module with cases(device, dtypes, quick, sizes) and SIZES_MEAN: each op family's
# (remat.bench.<family name>), then the fused MLP layers' and the GPT block's.
SUITES = {
    **{family.bench_suite: importlib.import_module(f"{__name__}.{family.name}") for family in FAMILIES.values()},
    "mlp": mlp,
    "block": block,
}
# Other names a suite answers to (the command line mirrors them: remat.cli.SUITE_ALIASES). "moe": the
# experts family's suite (remat.ops.experts declares its suite "experts"), by the name of the layer it is.
ALIASES = {"moe": "experts"}
# Suites run only when named (`remat bench overhead`), not by `all`: each writes a report of its own
# with run(out_dir, seqs, dtypes, reps, quick, progress), not the kernel cases' table.
NAMED_SUITES = {"overhead": overhead}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run(ops, dtypes, quick=False, out_dir="bench/out", device=None, progress=True, sizes=None):
    """Measure every case of `ops`; print the table and write CSV, markdown and (on a GPU) plots
    to out_dir.

    The CSV and markdown are rewritten after every case, so a run killed at any point leaves
    what it measured on disk. Ctrl-C stops early: what was measured so far is still printed and
    written, a case cut short included.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_cases = [case for op in ops for case in SUITES[op].cases(device, dtypes, quick, sizes)]
    on_gpu = device.type == "cuda"
    # On CPU the times only show that each implementation runs: one round of a few calls.
    timer = (Timer(device, warmup=2 if quick else 5, reps=6 if quick else 30) if on_gpu
             else Timer(device, warmup=1, reps=3))
    rounds = 3 if on_gpu else 1
    # Read once, before measuring: nvidia-smi can take seconds, which a killed run may not have.
    env = report.environment(device, cases_planned=len(all_cases))
    with_ratios = report.is_performance(env)
    bar = Progress(len(all_cases), enabled=progress)
    results = []
    interrupted = False
    try:
        for case in all_cases:
            bar.step(f"{case.op} {case.mode} {case.shape}")
            results.append(measure_case(case, timer, rounds))
            report.write_tables(report.rows(results, with_ratios), env, out_dir)
    except CaseInterrupted as stop:  # within a case: keep what it timed
        results.append(stop.results)
        interrupted = True
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        table = report.rows(results, with_ratios)
        report.write_tables(table, env, out_dir)
        print(report.text_table(table, env))
        plots = report.write_plots(table, env, out_dir) if with_ratios else []  # no rate plots of CPU timings
        print(f"wrote {out_dir}/bench.csv, bench.md and "
              + (f"{len(plots)} plots" if with_ratios else "no plots (CPU timings are not performance)")
              + (" (interrupted: partial results)" if interrupted else ""))
    return table
