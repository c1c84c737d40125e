"""Compile every attention autotuning candidate in parallel processes, before a benchmark.

On a fresh GPU machine the attention tuner would compile each candidate configuration the first
time it times it: some 40 kernels one after the other (several seconds each) inside the
benchmark's time limit. Triton keeps compiled kernels in its on-disk cache, keyed by the source,
the constexprs, the target and the launch's specialisation of the integer arguments (equal to 1,
divisible by 16). This script launches each candidate once on small tensors whose integer
arguments specialise like the benchmark's (heads 16, lengths and strides multiples of 16), in
several processes at once, so that the benchmark's tuner finds every kernel compiled and only
times them.

    python bench/warm_triton_cache.py [--jobs 8] [--head-dims 64 128] [--dtypes bfloat16 float16]
"""

import argparse
import concurrent.futures
import multiprocessing
import time

HEADS, SEQLEN = 16, 256  # like the benchmarks' integer arguments: both multiples of 16


def _work(dtype_name, head_dims):
    """Every (kind, head dim, causal, configuration) the tuner may time."""
    import torch

    from remat.triton_kernels import attention

    dtype = getattr(torch, dtype_name)
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return [(kind, d, causal, config) for d in head_dims for causal in (False, True)
            for kind in attention.KINDS for config in attention.candidates(kind, d, dtype, hopper)]


def _compile(dtype_name, items, device="cuda"):
    """Launch each item once (compiling it into Triton's cache); (items done, errors)."""
    import torch

    from remat.triton_kernels import attention

    dtype = getattr(torch, dtype_name)
    errors = []
    for kind, d, causal, config in items:
        # The launchers directly, with the configuration given: no tuning here (timings taken
        # by parallel processes on one GPU would be meaningless). Values do not matter.
        q, k, v, do = (torch.randn(1, HEADS, SEQLEN, d, device=device, dtype=dtype) for _ in range(4))
        o = torch.empty(1, SEQLEN, HEADS, d, device=device, dtype=dtype).transpose(1, 2)  # as attention_fwd's
        lse, delta = (torch.zeros(1, HEADS, SEQLEN, device=device) for _ in range(2))
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        scores = attention._score_options(q, k, lse, causal, d**-0.5, -1, -1, 0.0, None)  # no window, cap or ALiBi
        try:
            if kind == "fwd":
                attention._launch_fwd(q, k, v, o, lse, scores, d**-0.5, config)
            elif kind == "dkdv":
                attention._launch_dkdv(q, k, v, do, lse, delta, dk, dv, scores, d**-0.5, config)
            else:
                attention._launch_dq(q, k, v, do, lse, delta, dq, scores, d**-0.5, config)
        except Exception as error:  # e.g. out of shared memory on this GPU: the tuner skips it too
            errors.append(f"{kind} d{d} causal={causal} {config}: {type(error).__name__}")
    if device == "cuda":
        torch.cuda.synchronize()
    return len(items), errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    work = [(dtype, item) for dtype in args.dtypes for item in _work(dtype, args.head_dims)]
    start = time.perf_counter()
    shares = [work[i::args.jobs] for i in range(args.jobs)]
    # spawn: CUDA cannot be used in forked children of a process that initialised it.
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_compile, dtype, [item for d, item in share if d == dtype])
                   for share in shares for dtype in args.dtypes]
        done = [future.result() for future in futures]
    errors = [e for _, batch in done for e in batch]
    print(f"compiled {sum(n for n, _ in done)} attention kernels ({', '.join(args.dtypes)}) in "
          f"{time.perf_counter() - start:.0f} s with {args.jobs} processes"
          + (f"; {len(errors)} failed: " + "; ".join(errors) if errors else ""))


if __name__ == "__main__":
    main()
