"""Compile the benchmarks' torch.compile and FlexAttention peers ahead of time, in other processes.

On a fresh GPU machine each compiled peer compiles on its first call, inside its benchmark's time
limit: tens of seconds for a GPT block or a FlexAttention shape. Inductor keeps what it compiles
on disk (its FX graph and AOTAutograd caches, and Triton's kernel cache), keyed by the graph, the
input shapes and dtypes, and the versions, so a later process compiling the same graph loads it
instead (on CPU: a LayerNorm's 5.5 s compile became 0.2 s, a GPT block's 46 s about 3 s). This
script builds the benchmarks' own cases (`remat bench --quick`) and runs each compiled
implementation once, forward and backward, as the benchmark's check does: the same graphs. One
process per (suite, implementation), so they compile side by side.

Nothing here is timed, and Inductor's choice among kernel configurations, which it times on the
first launch, is not kept (its autotune cache is off here): the benchmark times those itself, on
a quiet GPU, while these processes run beside other work.

    python bench/warm_compile_cache.py [--suites layernorm rms_norm gelu gated mlp attention block]
        [--dtype bf16] [--jobs N]
"""

import argparse
import concurrent.futures
import multiprocessing
import time

SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")


def compiled_implementations(suite, dtype_name, device):
    """Names of the suite's implementations built with torch.compile (no tensor is made)."""
    import torch

    from remat import bench

    names = []
    for case in bench.SUITES[suite].cases(torch.device(device), [bench.DTYPES[dtype_name]], quick=True):
        names += [impl.name for impl in case.implementations if impl.compiles and impl.name not in names]
    return names


def compile_one(suite, name, dtype_name, device):
    """Run implementation `name` of every forward + backward case of `suite` once: (seconds, errors)."""
    import torch
    import torch._inductor.config

    from remat import bench
    from remat.bench.cases import short_error

    torch._inductor.config.autotune_local_cache = False  # the benchmark times its configurations itself
    start, errors = time.perf_counter(), []
    for case in bench.SUITES[suite].cases(torch.device(device), [bench.DTYPES[dtype_name]], quick=True):
        if case.mode != "fwd+bwd":  # its fwd and bwd cases call the same compiled function
            continue
        for impl in case.implementations:
            if impl.name == name:
                try:
                    impl.build(case.make_inputs()).outputs()
                except Exception as error:  # the benchmark will report it too
                    errors.append(f"{case.op} {case.shape}: {short_error(error)}")
    return time.perf_counter() - start, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--jobs", type=int, default=0, help="processes (default: one per implementation)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    work = [(suite, name) for suite in args.suites for name in compiled_implementations(suite, args.dtype, args.device)]
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
    with concurrent.futures.ProcessPoolExecutor(args.jobs or len(work), mp_context=context) as pool:
        futures = {pool.submit(compile_one, suite, name, args.dtype, args.device): (suite, name)
                   for suite, name in work}
        for future in concurrent.futures.as_completed(futures):
            suite, name = futures[future]
            seconds, errors = future.result()
            print(f"{suite} {name}: compiled in {seconds:.0f} s"
                  + (f"; {len(errors)} failed: " + "; ".join(errors) if errors else ""), flush=True)


if __name__ == "__main__":
    main()
