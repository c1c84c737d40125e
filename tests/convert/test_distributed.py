"""A converted model under DDP and FSDP2 on two CPU processes (gloo) gives the gradients of one process.

Each worker converts the same tiny model (same seed), takes half of the batch, and returns its
gradients (after DDP's all-reduce, or FSDP2's reduce-scatter, gathered); the test compares them
with one process running the whole batch. Both runs happen in one spawn, to keep process start-up
(torch + triton imports) to once.
"""

import pytest
import torch

from gloo_ranks import WORLD, full_grads, run_ranks

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


def _worker(rank):
    from remat.convert import convert

    x, y = _data()
    shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    ddp = torch.nn.parallel.DistributedDataParallel(convert(_model()))
    _loss(ddp, x[shard], y[shard]).backward()
    results = {"ddp": full_grads(ddp.module)}
    fx_ddp = torch.nn.parallel.DistributedDataParallel(convert(_model("fx")))
    _loss(fx_ddp, x[shard], y[shard]).backward()
    results["ddp_fx"] = full_grads(fx_ddp.module)
    try:
        from torch.distributed.fsdp import fully_shard

        model = convert(_model())
        for block in (model[0], model[4]):
            fully_shard(block)
        fully_shard(model)
        _loss(model, x[shard], y[shard]).backward()
        results["fsdp"] = full_grads(model)
    except Exception as error:  # noqa: BLE001 - reported as the skip reason
        results["fsdp_error"] = f"{type(error).__name__}: {error}"
    results["refusals"] = _converted_after_wrapping()
    return results


def _converted_after_wrapping():
    """{engine: what remat.convert of a model it already wraps or shards said} (each call's error, or
    "converted"): asked on every rank, so that a collective one rank entered alone would hang the test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from remat.convert import convert

    def sharded():
        model = _model()
        fully_shard(model[0])
        return fully_shard(model)

    def parallel():
        mesh = init_device_mesh("cpu", (WORLD,))
        return parallelize_module(_model(), mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})

    said = {}
    for engine, wrapped in (("ddp", lambda: torch.nn.parallel.DistributedDataParallel(_model())),
                            ("fsdp2", sharded), ("tensor parallel", parallel)):
        try:
            convert(wrapped())
            said[engine] = "converted"
        except ValueError as error:
            said[engine] = str(error)
    return said


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("distributed"))


def _single_process_grads(kind):
    from remat.convert import convert

    model, report = convert(_model(kind), report=True)
    assert report.swapped, "nothing was fused: the distributed test would not test remat"
    _loss(model, *_data()).backward()
    return full_grads(model)


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


@pytest.mark.parametrize("engine, says", [("ddp", "is wrapped in DistributedDataParallel"),
                                          ("fsdp2", "is sharded by FSDP2's fully_shard"),
                                          ("tensor parallel", "has DTensor parameters (1.weight")])
def test_a_model_an_engine_already_wraps_is_refused_at_once(distributed_results, engine, says):
    """Converted after wrapping, a model is refused before convert calls it (no probe forward outside the
    engine: no hang in a collective, no root left unsharded), with what wraps it and the order to use."""
    for results in distributed_results:
        said = results["refusals"][engine]
        assert said.startswith(f"model {says}") and "remat.convert the model before handing it" in said, said
