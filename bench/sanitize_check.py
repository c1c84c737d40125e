"""Runs every kernel once on small CUDA inputs: meant to run under compute-sanitizer.

    compute-sanitizer --tool memcheck python bench/sanitize_check.py
    compute-sanitizer --tool racecheck python bench/sanitize_check.py

Every op family runs the calls its benchmark module lists (sanitize_calls): shapes awkward on
purpose (odd widths, a strided view, a misaligned slice) so that the scalar paths and the masked
tails run too; the CUDA backend's twice, for both of its attention backwards (one pass adding dQ
by atomics, and under torch.use_deterministic_algorithms the dQ kernel). Exits non-zero if an op raises.
"""

import torch

import remat
from remat.bench import SUITES


def family_calls(device, dtype):
    """(family name, call) for every call of every op family's sanitize_calls(device, dtype)."""
    for family in remat.ops.FAMILIES.values():
        for call in SUITES[family.bench_suite].sanitize_calls(device, dtype):
            yield family.name, call


def run_all(device="cuda"):
    for backend in ("triton", "cuda"):
        if not remat.backends()[backend][0]:
            print(f"skip {backend}: {remat.backends()[backend][1]}")
            continue
        for deterministic in (False, True) if backend == "cuda" else (False,):
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            with remat.use_backend(backend):
                for dtype in (torch.float32, torch.bfloat16):
                    for _name, call in family_calls(device, dtype):
                        call().sum().backward()
    torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
    print("sanitize_check: all ops ran")


if __name__ == "__main__":
    run_all()
