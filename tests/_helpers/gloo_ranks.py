"""Two CPU processes in one gloo group, for the DDP and FSDP2 tests: one spawn (process start-up,
torch and triton imports, costs once), each rank's results saved to a file and read back."""

import os
import socket
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
# How long the ranks may take together: a collective that only one rank enters hangs, and a hang fails
# the test after this long instead of holding the whole run (the ranks' work takes well under a minute).
TIMEOUT_S = 900


def run_ranks(worker, out_dir):
    """worker(rank) -> a dict of tensors and lists, run on each of WORLD ranks of a gloo process
    group; the dicts, by rank. Skips the test where torch has no gloo backend."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    ranks = mp.spawn(_rank, args=(worker, _free_port(), str(out_dir)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0)):  # raises where a rank failed
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {WORLD} ranks did not finish in {TIMEOUT_S} s: a hang (a collective one rank "
                        "entered alone?)")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def _rank(rank, worker, port, out_dir):
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton, as conftest does
        from remat import _backend

        if _backend.interpreter_enabled() and _backend.backends()["triton"][0]:  # conftest's patches, per process
            from numerics import make_interpreter_dots_and_math_isa_independent, round_interpreter_bf16_casts_to_nearest

            round_interpreter_bf16_casts_to_nearest()
            make_interpreter_dots_and_math_isa_independent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(worker(rank), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        dist.destroy_process_group()
    # The results are saved: leave without the interpreter's teardown, where gloo's threads
    # sometimes abort the process ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_grads(model):
    """{state_dict key: gradient}, FSDP2's sharded DTensor gradients gathered whole."""
    out = {}
    for key, p in model.state_dict(keep_vars=True).items():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[key] = grad.detach().clone()
    return out
