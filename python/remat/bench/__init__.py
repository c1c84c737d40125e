"""Kernel microbenchmarks: remat against the peers that are installed, in the same run."""

import torch

from . import attention, block, gelu, layer_norm, mlp, report
from .cases import CaseInterrupted, Progress, Timer, measure_case

# op name -> module with cases(device, dtypes, quick)
SUITES = {"layernorm": layer_norm, "gelu": gelu, "mlp": mlp, "attention": attention, "block": block}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run(ops, dtypes, quick=False, out_dir="bench/out", device=None, progress=True, sizes=None):
    """Measure every case of `ops`; print the table and write CSV, markdown and plots to out_dir.

    Ctrl-C stops early: what was measured so far is still printed and written.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_cases = [case for op in ops for case in SUITES[op].cases(device, dtypes, quick, sizes)]
    timer = Timer(device, warmup=2 if quick else 5, reps=6 if quick else 30) if device.type == "cuda" \
        else Timer(device, warmup=1, reps=3)
    bar = Progress(len(all_cases), enabled=progress)
    results = []
    interrupted = False
    try:
        for case in all_cases:
            bar.step(f"{case.op} {case.mode} {case.shape}")
            results.append(measure_case(case, timer))
    except CaseInterrupted as stop:  # within a case: keep what it timed
        results.append(stop.results)
        interrupted = True
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        env = report.environment(device)
        table = report.rows(results)
        print(report.text_table(table, env))
        plots = report.write_all(table, env, out_dir)
        print(f"wrote {out_dir}/bench.csv, bench.md and {len(plots)} plots"
              + (" (interrupted: partial results)" if interrupted else ""))
    return table
