"""Compile every Triton kernel the smoke check and the benchmarks launch, in parallel processes, before them.

On a fresh GPU machine each kernel compiles the first time it is launched: for attention, every
tuning candidate the tuner times (about 5 configurations x 3 kernels for each variant: causal or
not, a window, softcapping, dropout), several seconds each, one after the other inside the
benchmark's time limit. Triton keeps compiled kernels in its on-disk cache, keyed by the source,
the constexprs (the variant's switches, the block sizes), the target and the launch's
specialisation of its arguments (integers equal to 1 or divisible by 16, pointer alignment).

So this script runs the work the later steps will run, at their own shapes (every specialisation
matches): each forward + backward case of the given suites (`remat bench --quick`, which the smoke
check runs too), once, with remat's Triton backend, in several processes at once. Attention's tuner
is replaced by one that launches every candidate once (compiling it) and times nothing: timings
taken by processes sharing one GPU would mean nothing, and the benchmark tunes on a quiet GPU
with every candidate already compiled. In --tuned dtypes every candidate compiles (the benchmarks
tune those); in the others the fixed table's entry only (the smoke check runs REMAT_AUTOTUNE=0).
Nothing here is checked or timed; a case that fails is reported (the steps after report it too).

    python bench/warm_triton_cache.py [--suites layernorm ... block] [--dtypes bf16 fp16] [--tuned bf16]
        [--jobs 6] [--device cuda]
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import time

SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")  # the default: gpu_check.sh's
HEAVY_FIRST = ("attention", "attention_varlen", "block")  # most kernels per case: started first


class LaunchEveryCandidate:
    """Stands in for attention's tuner (remat.triton_kernels.attention._TUNER): launches each
    candidate once, so that it compiles, and returns the first (the table's); times nothing and
    remembers nothing. A candidate that fails is skipped, as the real tuner skips it, and listed."""

    def __init__(self):
        self.launched, self.failed = 0, []

    def best(self, key, candidates, run, may_time=True):
        for config in candidates:
            try:
                run(config)
                self.launched += 1
            except Exception as error:
                self.failed.append(f"{key} {tuple(config)}: {type(error).__name__}")
        return tuple(candidates[0])


def _cases(suite, dtype_name, device):
    import torch

    from remat import bench

    return list(bench.SUITES[suite].cases(torch.device(device), [bench.DTYPES[dtype_name]], quick=True))


def triton_implementation(case):
    """The implementation of `case` that runs remat's Triton kernels: remat's, not compiled (a
    compiled one runs the table's configuration only), on the Triton backend or on the default
    one (which the caller sets to Triton). None when the case has none."""
    for impl in case.implementations:
        if impl.ours and not impl.compiles and impl.backend in (None, "auto", "triton") and not impl.deterministic:
            return impl
    return None


def work_items(suites, dtypes, tuned, device="cuda"):
    """(suite, dtype name, case index, every candidate or not) of each forward + backward case that
    has a Triton implementation (its fwd and bwd cases launch the same kernels), heaviest first."""
    items = [(suite, dtype, index, dtype in tuned)
             for suite in suites for dtype in dtypes
             for index, case in enumerate(_cases(suite, dtype, device))
             if case.mode == "fwd+bwd" and triton_implementation(case) is not None]
    return sorted(items, key=lambda item: (item[0] not in HEAVY_FIRST, not item[3]))


def warm(item, device="cuda"):
    """Run one work item: (a line about it, the failures)."""
    import torch

    from remat import use_backend
    from remat.triton_kernels import attention

    suite, dtype_name, index, every_candidate = item
    # Read at each tuning decision: on, the tuner (our stand-in) is asked; off, the table's entry runs.
    os.environ["REMAT_AUTOTUNE"] = "1" if every_candidate else "0"
    attention._TUNER = tuner = LaunchEveryCandidate()
    case = _cases(suite, dtype_name, device)[index]
    start, failed = time.perf_counter(), []
    try:
        with use_backend("triton"):
            triton_implementation(case).build(case.make_inputs()).outputs()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # the steps after report it too, with their own error
        failed.append(f"{type(error).__name__}: {str(error)[:100]}")
    failed += tuner.failed
    line = (f"{suite} {dtype_name} {case.op} {case.shape}: {tuner.launched} tuning candidates launched, "
            f"{time.perf_counter() - start:.0f} s" + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return line, failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), help="any of remat.bench.SUITES")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--tuned", nargs="*", default=["bf16"], choices=["bf16", "fp16", "fp32"],
                        help="dtypes whose attention tuning candidates all compile (the others: the table's)")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from remat import bench

    unknown = sorted(set(args.suites) - set(bench.SUITES))
    if unknown:
        parser.error(f"no suite {', '.join(unknown)} (remat.bench has {', '.join(bench.SUITES)})")
    items = work_items(args.suites, args.dtypes, args.tuned, args.device)
    if not items:
        print("nothing to compile: no case of these suites runs remat's Triton kernels")
        return
    start, failures = time.perf_counter(), 0
    # spawn: CUDA cannot be used in forked children of a process that initialised it.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(items)), mp_context=context) as pool:
        futures = {pool.submit(warm, item, args.device): item for item in items}
        for future in concurrent.futures.as_completed(futures):
            try:
                line, failed = future.result()
            except Exception as error:  # the worker died (a crash in a kernel): the others go on
                line, failed = f"{' '.join(map(str, futures[future][:3]))}: {type(error).__name__}: {error}", [error]
            print(line, flush=True)
            failures += len(failed)
    print(f"warmed {len(items)} cases ({', '.join(args.dtypes)}; every attention candidate in "
          f"{', '.join(args.tuned) or 'none'}) in {time.perf_counter() - start:.0f} s with {args.jobs} processes"
          + (f"; {failures} failures, listed above" if failures else ""), flush=True)


if __name__ == "__main__":
    main()
