"""A planned model under FSDP2 on two CPU processes (gloo) gives the loss and gradients of the
unplanned model in one process.

Each worker builds the same stack (same seed), plans it for its half of the batch (the budget is
per rank: the shapes a rank sees), applies the plan, wraps every block and the stack with
fully_shard, and returns its loss and its gradients (gathered from the shards), in one spawn
(gloo_ranks.run_ranks) as tests/convert/test_distributed.py does.
"""

import pytest
import torch

from gloo_ranks import WORLD, full_grads, run_ranks

BATCH, SEQ, HIDDEN, HEADS, LAYERS = 4, 8, 32, 2, 3


def _stack():
    from remat.gpt import GPTConfig, torch_stack

    torch.manual_seed(0)
    return torch_stack(GPTConfig(hidden=HIDDEN, heads=HEADS, layers=LAYERS))


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randn(BATCH, SEQ, HIDDEN, generator=generator)


def _loss(model, x, target):
    return torch.nn.functional.mse_loss(model(x), target)


def _mixed_plan(model, x_shard):
    """A plan for one rank's inputs whose budget leaves some blocks stock and checkpoints others."""
    import remat
    from remat.planner import measure

    saves, _, _ = measure(model, (x_shard.requires_grad_(),))
    budget = (saves["full"].total_bytes() + saves["stock"].total_bytes()) // 2
    return remat.plan(model, (x_shard,), budget)


def _worker(rank):
    x, target = _data()
    shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    model = _stack()
    plan = _mixed_plan(model, x[shard].clone())
    plan.apply(model)
    results = {"choices": plan.choices}
    try:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
        loss = _loss(model, x[shard], target[shard])
        loss.backward()
        results.update(loss=loss.detach(), grads=full_grads(model))
    except Exception as error:  # noqa: BLE001 - reported as the skip reason
        results["fsdp_error"] = f"{type(error).__name__}: {error}"
    return results


def test_a_planned_model_under_fsdp2_trains_as_the_unplanned_one(tmp_path):
    ranks = run_ranks(_worker, tmp_path)
    if "fsdp_error" in ranks[0]:
        pytest.skip(f"FSDP2 (fully_shard) on CPU/gloo failed with this torch: {ranks[0]['fsdp_error']}")
    assert ranks[0]["choices"] == ranks[1]["choices"] and len(set(ranks[0]["choices"])) > 1  # a mixed plan
    stock = _stack()
    x, target = _data()
    _loss(stock, x, target).backward()
    want = full_grads(stock)
    halves = [_loss(stock, x[r * BATCH // WORLD:(r + 1) * BATCH // WORLD], target[r * BATCH // WORLD:
                                                                                  (r + 1) * BATCH // WORLD])
              for r in range(WORLD)]
    for rank, results in enumerate(ranks):
        torch.testing.assert_close(results["loss"], halves[rank].detach(), rtol=1e-5, atol=1e-6)
        assert results["grads"].keys() == want.keys()
        for key in want:
            torch.testing.assert_close(results["grads"][key], want[key], rtol=1e-5, atol=1e-6, msg=key)
