"""The "offload" choice: offered for GPUs only (plans for CPU tensors never offload, plans for a GPU
made from meta tensors may), counted as keeping nothing on the device, and, forced on CPU tensors
(where the same hooks copy into plain host tensors), training as the stock model and reverting.
Nothing here measures an overlap of copies with compute: that needs a GPU."""

import copy
import dataclasses

import pytest
import torch

import remat
from remat.gpt import GPTConfig, torch_stack
from remat.planner import measure, meta_copy, offers_offload, saved_bytes_of
from remat.planner.cost import extra_seconds
from remat.planner.counting import UnitSaves, Work
from remat.planner.devices import DEVICES, Device
from remat.planner.units import apply_choices, find_units

from hf_models import assert_same_step, build, inputs


def _on_meta(batch):
    return {k: torch.empty_like(v, device="meta") for k, v in batch.items()}


@pytest.mark.parametrize("device", [None, "H200", "cpu"])
def test_plans_for_cpu_tensors_never_offload(device):
    stack = torch_stack(GPTConfig(hidden=32, heads=2, layers=2))
    x = torch.randn(2, 8, 32, requires_grad=True)
    saves, _, _ = measure(stack, (x,), ("full",))
    plan = remat.plan(stack, (x,), saves["full"].total_bytes(), device=device)  # the least: all checkpointed
    assert set(plan.choices) == {"full"} and plan.host_bytes == 0
    assert not offers_offload(DEVICES["H200"], (x,)) and offers_offload(DEVICES["H200"], (x.to("meta"),))


def _least_without_offload(model, batch):
    """What a model keeps with every unit fully checkpointed and its LM head and loss fused."""
    shell = meta_copy(model)
    paths = find_units(shell)
    apply_choices(shell, paths, ["full"] * len(paths), head="fused")
    return saved_bytes_of(shell, batch)


def test_plans_on_meta_offload_only_for_a_gpu():
    model, _ = build("gpt2")
    model, batch = meta_copy(model), _on_meta(inputs("gpt2", "cpu"))
    least_without = _least_without_offload(model, batch)
    with pytest.raises(ValueError, match=f"least this model can keep at these inputs: {least_without} bytes"):
        remat.plan(model, batch, least_without - 1)  # meta planned with the "cpu" figures: no offloading
    plan = remat.plan(model, batch, least_without - 1, device="H200")
    assert "offload" in plan.choices and plan.host_bytes > 0
    offloaded = [b for b, c in zip(plan.unit_bytes, plan.choices) if c == "offload"]
    assert offloaded == [0] * len(offloaded)  # nothing of theirs stays on the device
    plan.apply(model)
    try:
        assert saved_bytes_of(model, batch) == plan.saved_bytes
    finally:
        remat.revert(model)
    assert not any("remat_offload" in vars(m) or "forward" in vars(m) for m in model.modules())


def _bytes_saved_inside(model, batch, units):
    """Bytes of the tensors autograd saves inside each unit (each tensor on its own, the units'
    weights left out), counted with hooks of this test's own."""
    current, totals = [], [0] * len(units)
    weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}

    def leave(*_):  # returns None: a forward hook's result would replace the output
        current.pop()

    def pack(tensor):
        if current and tensor.untyped_storage()._cdata not in weights:
            totals[current[-1]] += tensor.nbytes
        return tensor

    handles = [h for i, unit in enumerate(units) for h in (
        unit.register_forward_pre_hook(lambda *_, i=i: current.append(i)),
        unit.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return totals


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_offloading_forced_on_cpu_tensors_trains_as_the_stock_model_and_reverts(family):
    model, _ = build(family)
    batch = inputs(family, "cpu")
    saves, paths, _ = measure(model, batch, ("full", "offload"))
    planned = copy.deepcopy(model)
    units = apply_choices(planned, paths, ["offload"] * len(paths))
    # the device keeps what is kept outside the units only; the hooks copied out what the units save
    assert saved_bytes_of(planned, batch) == saves["offload"].total_bytes() < saves["full"].total_bytes()
    stock_units = [model.get_submodule(path) for path in paths]
    assert [u.remat_offload.host_bytes for u in units] == _bytes_saved_inside(model, batch, stock_units)
    assert_same_step(model, planned, batch, seed=0)
    remat.revert(planned)
    assert saved_bytes_of(planned, batch) == saved_bytes_of(model, batch)


def test_a_compiled_model_with_an_offloaded_block_trains_as_the_stock_one():
    # the offloaded block runs eagerly inside the compiled model (a graph break of its own)
    stack = torch_stack(GPTConfig(hidden=32, heads=2, layers=2))
    x = torch.randn(2, 8, 32, requires_grad=True)
    planned = copy.deepcopy(stack)
    apply_choices(planned, ["0", "1"], ["offload", "stock"])
    out = torch.compile(planned, backend="aot_eager")(x)
    out.sum().backward()
    assert planned[0].remat_offload.host_bytes > 0  # its hooks ran
    expected = stack(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for mine, stock in zip(planned.parameters(), stack.parameters()):
        torch.testing.assert_close(mine.grad, stock.grad)


def test_the_offload_cost_is_the_transfer_not_hidden_by_compute():
    link = 10e9
    device = Device("test", flops_per_s=1e12, bytes_per_s=1e11, host_bytes_per_s=link)
    stock = UnitSaves(work=Work(kept_flops=1e9, kept_bytes=0, other_flops=0, other_bytes=0))  # 1 ms forward
    forward = 1e-3
    for moved in (5e6, 15e6, 40e6):  # 0.5 ms, 1.5 ms, 4 ms each way
        transfer, traffic = moved / link, 2 * moved / 1e11
        expected = max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward) + traffic
        got = extra_seconds("offload", stock, UnitSaves(offloaded_bytes=int(moved)), device)
        assert got == pytest.approx(expected)
    # hidden behind the compute: the copies' device-memory traffic is all that is left
    assert extra_seconds("offload", stock, UnitSaves(offloaded_bytes=int(5e6)), device) == pytest.approx(1e-4)
    assert DEVICES["cpu"].host_bytes_per_s is None and DEVICES["H200"].host_bytes_per_s > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading's copies run on a GPU")
def test_offloading_on_a_gpu_frees_the_saved_tensors_and_trains_as_the_stock_model():
    model, _ = build("gpt2")
    model = model.cuda()
    batch = inputs("gpt2", "cuda")
    plan = remat.plan(model, batch, 10**9)
    planned = dataclasses.replace(plan, choices=["offload"] * len(plan.units)).apply(copy.deepcopy(model))

    def kept_after_forward(m):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = m(**batch).loss
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, loss

    stock_kept, _ = kept_after_forward(model)
    offloaded_kept, _ = kept_after_forward(planned)
    assert offloaded_kept < stock_kept
    assert_same_step(model, planned, batch, seed=0)
