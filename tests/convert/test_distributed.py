"""A converted model under DDP and FSDP2 on two CPU processes (gloo) gives the gradients of one process.

Each worker converts the same tiny model (same seed), takes half of the batch, and saves its
gradients (after DDP's all-reduce, or FSDP2's reduce-scatter, gathered) to a file; the test
compares them with one process running the whole batch. Both runs happen in one spawn, to keep
process start-up (torch + triton imports) to once.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
HIDDEN, FFN, BATCH, SEQ = 32, 64, 4, 8


class _PreLNBlock(torch.nn.Module):
    """Layers held as attributes, not in a Sequential: remat.convert fuses them through torch.fx."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc1, self.act, self.fc2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 10)

    def forward(self, x):
        return self.head(x + self.fc2(self.act(self.fc1(self.norm(x)))))


def _model(kind="sequential"):
    from torch import nn

    torch.manual_seed(0)
    if kind == "fx":
        return _PreLNBlock()
    return nn.Sequential(
        nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN),  # -> LayerNormMLP
        nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 10),  # -> LayerNormLinear
    )


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randint(0, 10, (BATCH, SEQ), generator=generator)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _grads(model):
    out = {}
    for key, p in model.state_dict(keep_vars=True).items():
        grad = p.grad
        if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor
            grad = grad.full_tensor()
        out[key] = grad.detach().clone()
    return out


def _worker(rank, port, out_dir):
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton, as conftest does
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from remat.convert import convert

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, y = _data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        ddp = torch.nn.parallel.DistributedDataParallel(convert(_model()))
        _loss(ddp, x[shard], y[shard]).backward()
        results = {"ddp": _grads(ddp.module)}
        fx_ddp = torch.nn.parallel.DistributedDataParallel(convert(_model("fx")))
        _loss(fx_ddp, x[shard], y[shard]).backward()
        results["ddp_fx"] = _grads(fx_ddp.module)
        try:
            from torch.distributed.fsdp import fully_shard

            model = convert(_model())
            for block in (model[0], model[4]):
                fully_shard(block)
            fully_shard(model)
            _loss(model, x[shard], y[shard]).backward()
            results["fsdp"] = _grads(model)
        except Exception as error:  # noqa: BLE001 - reported as the skip reason
            results["fsdp_error"] = f"{type(error).__name__}: {error}"
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    out_dir = str(tmp_path_factory.mktemp("distributed"))
    mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def _single_process_grads(kind):
    from remat.convert import convert

    model, report = convert(_model(kind), report=True)
    assert report.swapped, "nothing was fused: the distributed test would not test remat"
    _loss(model, *_data()).backward()
    return _grads(model)


@pytest.fixture(scope="module")
def single_process_grads():
    return _single_process_grads("sequential")


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_ddp_matches_single_process(distributed_results, single_process_grads):
    for results in distributed_results:
        _assert_close(results["ddp"], single_process_grads)


def test_ddp_of_a_model_fused_through_fx(distributed_results):
    want = _single_process_grads("fx")
    for results in distributed_results:
        _assert_close(results["ddp_fx"], want)


def test_fsdp2_matches_single_process(distributed_results, single_process_grads):
    if "fsdp_error" in distributed_results[0]:
        pytest.skip(f"FSDP2 (fully_shard) on CPU/gloo failed with this torch: {distributed_results[0]['fsdp_error']}")
    for results in distributed_results:
        _assert_close(results["fsdp"], single_process_grads)
