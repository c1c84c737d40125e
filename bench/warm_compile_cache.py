"""Compile the benchmarks' torch.compile and FlexAttention peers ahead of time, in other processes.

On a fresh GPU machine each compiled peer compiles on its first call, inside its benchmark's time
limit: tens of seconds for a GPT block or a FlexAttention shape. Inductor keeps what it compiles
on disk (its FX graph and AOTAutograd caches, and Triton's kernel cache), keyed by the graph, the
input shapes and dtypes, and the versions, so a later process compiling the same graph loads it
instead (on CPU: a LayerNorm's 5.5 s compile became 0.2 s, a GPT block's 46 s about 3 s). This
script builds the benchmarks' own cases (`remat bench --quick`) and runs each compiled
implementation once, forward and backward, as the benchmark's check does: the same graphs. One
work item per (suite, implementation, case), in several processes, so that they compile side by
side: the eight FlexAttention graphs (a shape and causality, a window, softcapping) each in its
own item, the longest ones (FlexAttention, the GPT block's policies) first.

Nothing here is timed, and Inductor's choice among kernel configurations, which it times on the
first launch, is not kept (its autotune cache is off here): the benchmark times those itself, on
a quiet GPU, while these processes run beside other work.

    python bench/warm_compile_cache.py [--suites layernorm rms_norm gelu gated mlp attention block]
        [--dtype bf16] [--jobs 8]
"""

import argparse
import concurrent.futures
import multiprocessing
import time

SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")  # the default: gpu_check.sh's
HEAVY_FIRST = ("attention", "attention_varlen", "block")  # the longest compiles: started first


def _cases(suite, dtype_name, device):
    import torch

    from remat import bench

    return list(bench.SUITES[suite].cases(torch.device(device), [bench.DTYPES[dtype_name]], quick=True))


def work_items(suites, dtype_name, device):
    """(suite, implementation name, case index) of every compiled implementation of each forward +
    backward case (its fwd and bwd cases call the same compiled function), the longest first."""
    items = [(suite, impl.name, index)
             for suite in suites for index, case in enumerate(_cases(suite, dtype_name, device))
             if case.mode == "fwd+bwd" for impl in case.implementations if impl.compiles]
    return sorted(items, key=lambda item: item[0] not in HEAVY_FIRST)


def compile_one(suite, name, index, dtype_name, device):
    """Run implementation `name` of case `index` of `suite` once, forward and backward: (seconds, errors)."""
    import torch._inductor.config

    from remat.bench.cases import short_error

    torch._inductor.config.autotune_local_cache = False  # the benchmark times its configurations itself
    start, errors = time.perf_counter(), []
    case = _cases(suite, dtype_name, device)[index]
    impl = next(impl for impl in case.implementations if impl.name == name)
    try:
        impl.build(case.make_inputs()).outputs()
    except Exception as error:  # the benchmark will report it too
        errors.append(f"{case.op} {case.shape}: {short_error(error)}")
    return time.perf_counter() - start, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), help="any of remat.bench.SUITES")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from remat import bench

    unknown = sorted(set(args.suites) - set(bench.SUITES))
    if unknown:
        parser.error(f"no suite {', '.join(unknown)} (remat.bench has {', '.join(bench.SUITES)})")
    work = work_items(args.suites, args.dtype, args.device)
    if not work:
        print("nothing to compile: no compiled implementation in these suites")
        return
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
    with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(work)), mp_context=context) as pool:
        futures = {pool.submit(compile_one, *item, args.dtype, args.device): item for item in work}
        for future in concurrent.futures.as_completed(futures):
            suite, name, index = futures[future]
            try:
                seconds, errors = future.result()
            except Exception as error:  # the worker died: the others go on
                seconds, errors = 0, [f"{type(error).__name__}: {error}"]
            print(f"{suite} {name} case {index}: compiled in {seconds:.0f} s"
                  + (f"; {len(errors)} failed: " + "; ".join(errors) if errors else ""), flush=True)
    print(f"compiled {len(work)} cases in {time.perf_counter() - start:.0f} s with {min(args.jobs, len(work))} "
          "processes", flush=True)


if __name__ == "__main__":
    main()
