"""`remat memory` survives what a one-shot GPU run meets: a policy that fails, an interrupt, and
host bytes that are counted as the device bytes are (each storage once, no parameters)."""

import csv
import gc
import math

import pytest
import torch

from remat import memory
from remat.policies import Checkpointed

POLICIES = memory.policies  # the real table, before a test swaps it


class _RaisesInForward(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("pretend out of memory\nsecond line of the message")


def _fails_to_build(stack):
    raise ValueError("no pinned memory, pretend")


def _interrupts(stack):
    raise KeyboardInterrupt  # as `timeout -s INT` would, while this policy is measured


def _with_policies(monkeypatch, *extra):
    """The tiny model's policies: eager, then `extra` (name, make), then full checkpoint."""
    def table(layers):
        stock = dict(POLICIES(layers))
        return [("eager", stock["eager"]), *extra, ("full checkpoint", stock["full checkpoint"])]

    monkeypatch.setattr(memory, "policies", table)


def _csv_rows(tmp_path):
    with open(tmp_path / "memory_tiny.csv") as handle:
        return list(csv.DictReader(handle))


def _run(tmp_path):
    return memory.run("tiny", batch=2, seq=16, budget_gb=1.0, out_dir=str(tmp_path), device="cpu")


def test_a_failing_policy_costs_only_its_own_row(tmp_path, monkeypatch, capsys):
    _with_policies(monkeypatch, ("broken build", _fails_to_build),
                   ("broken forward", lambda s: (_RaisesInForward(), False)))
    results = {r.policy: r for r in _run(tmp_path)}
    assert list(results) == ["eager", "broken build", "broken forward", "full checkpoint"]
    assert results["broken build"].error == "ValueError: no pinned memory, pretend"
    assert results["broken forward"].error == "RuntimeError: pretend out of memory"  # first line only
    for name in ("broken build", "broken forward"):
        r = results[name]
        assert all(math.isnan(v) for v in (r.saved_bytes, r.host_bytes, r.per_layer_sbh, r.step_ms, r.peak_gb))
    for name in ("eager", "full checkpoint"):
        assert not results[name].error and results[name].saved_bytes > 0
    printed = capsys.readouterr().out
    assert "error: RuntimeError: pretend out of memory" in printed
    assert "budget 1.0 GB: use 'eager'" in printed  # a failed policy is never the one that fits
    rows = {row["policy"]: row for row in _csv_rows(tmp_path)}
    assert list(rows) == list(results)
    assert rows["broken forward"]["error"] == "RuntimeError: pretend out of memory"
    assert rows["eager"]["error"] == "" and float(rows["eager"]["saved_bytes"]) > 0


def test_an_interrupt_keeps_what_was_measured(tmp_path, monkeypatch, capsys):
    _with_policies(monkeypatch, ("interrupted", _interrupts))
    try:
        results = _run(tmp_path)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself rather than fail this test
        pytest.fail("run() let the interrupt escape")
    assert [r.policy for r in results] == ["eager"]  # measuring stops: full checkpoint is not run
    assert results[0].saved_bytes > 0
    printed = capsys.readouterr().out
    assert "(interrupted: partial results)" in printed
    assert "budget 1.0 GB: use 'eager'" in printed
    rows = _csv_rows(tmp_path)
    assert [row["policy"] for row in rows] == ["eager"]
    assert float(rows[0]["saved_bytes"]) == results[0].saved_bytes


class _SavesAWeightAndATensorTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        h = self.linear(x)  # saves x (the caller's) and the weight (a parameter): neither counted
        return h * h  # saves h twice: counted once


H_BYTES = 4 * 16 * 4  # h: (4, 16) float32. Counting every save would give 128 + 512 + 2·256 = 1152.


def test_saved_bytes_count_each_storage_once_and_no_parameters():
    module, x = _SavesAWeightAndATensorTwice(), torch.randn(4, 8, requires_grad=True)
    assert memory.count_saved_bytes(module, x, offload=False) == (H_BYTES, 0)
    assert memory.count_saved_bytes(module, x, offload=True) == (0, H_BYTES)


def test_offloaded_bytes_are_counted_as_saved_bytes_are():
    # What _allocated_by_forward does on a GPU: each saved tensor copied off the device (a clone
    # here), so the device tensor is freed after the forward; the host count must not change.
    module, x = _SavesAWeightAndATensorTwice(), torch.randn(4, 8, requires_grad=True)
    offloaded = memory.SavedStorages(module.parameters())

    def to_host(tensor):
        offloaded.add(tensor)
        return tensor.clone()

    with torch.autograd.graph.saved_tensors_hooks(to_host, lambda t: t):
        out = module(x)
    assert offloaded.total_bytes(out, x) == H_BYTES == memory.count_saved_bytes(module, x, offload=True)[1]


def test_a_freed_storage_is_counted_though_another_reuses_its_address():
    # Offloading frees each saved device tensor, and the allocator hands its address to the next:
    # two storages at one address, both copied to the host. Built here on one buffer, so the
    # address is the same for certain.
    buffer = bytearray(64)
    saved = memory.SavedStorages(torch.nn.Linear(1, 1).parameters())
    first = torch.frombuffer(buffer, dtype=torch.float32)
    saved.add(first)
    address = first.untyped_storage().data_ptr()
    del first
    second = torch.frombuffer(buffer, dtype=torch.float32)
    assert second.untyped_storage().data_ptr() == address
    saved.add(second)
    saved.add(second)  # the same storage again: still once
    assert saved.total_bytes() == 2 * 64
    assert saved.total_bytes(second) == 64  # excluding the live one leaves the freed one


def _selective_bytes_by_hand(config, batch, seq, dtype):
    """What selective checkpointing keeps for a stack of stock blocks (remat.gpt.TorchGPTBlock),
    derived from the block's structure: each checkpoint holds its block's input, and the cache
    holds every output of the ops the policy saves (mm/addmm/bmm and SDPA); all else is recomputed."""
    tokens, h, size = batch * seq, config.hidden, torch.empty((), dtype=dtype).element_size()
    per_layer = (
        tokens * 3 * h * size  # attn_qkv: addmm on the 2-D view of LN(x); q, k, v are views of it
        + tokens * h * size  # SDPA (_scaled_dot_product_flash_attention_for_cpu) output, (b, heads, s, d)
        + batch * config.heads * seq * 4  # ... and its logsumexp: fp32, one per head per token
        + tokens * h * size  # attn_out: addmm
        + tokens * config.ffn_hidden * size  # fc1: addmm (GELU's output is recomputed)
        + tokens * h * size  # fc2: addmm (the residual adds are recomputed)
    )
    # Each checkpoint holds its block's input: the first is the caller's, the others are the
    # previous block's output, kept once though the previous checkpoint returns it.
    inputs = (config.layers - 1) * tokens * h * size
    return config.layers * per_layer + inputs


def _forward_allocations(module, x):
    """Bytes the forward leaves allocated besides its output, from the profiler's record of CPU
    allocations and frees: a measurement independent of saved-tensor hooks and dispatch modes,
    as the allocator's is on a GPU. Each non-reentrant checkpoint also keeps the CPU RNG state
    (to replay dropout in the recompute), which is not an activation: taken out."""
    from torch.profiler import ProfilerActivity, profile

    checkpoints = sum(isinstance(m, Checkpointed) for m in module.modules())
    gc.collect()  # no unrelated frees during the forward
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = module(x)
    allocated = sum(event.self_cpu_memory_usage for event in prof.key_averages())
    return allocated - out.untyped_storage().nbytes() - checkpoints * torch.get_rng_state().nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_checkpoint_bytes_match_the_block_structure_and_the_allocations(dtype):
    config, batch, seq = memory.MODELS["tiny"], 2, 16
    stack = memory.torch_stack(config, dtype=dtype)
    x = torch.randn(batch, seq, config.hidden, dtype=dtype, requires_grad=True)
    built = {name: make(stack)[0] for name, make in POLICIES(config.layers)}
    counted = {name: memory.count_saved_bytes(built[name], x, offload=False)[0]
               for name in ("eager", "selective checkpoint", "full checkpoint")}
    expected = _selective_bytes_by_hand(config, batch, seq, dtype)
    assert counted["selective checkpoint"] == expected
    assert counted["full checkpoint"] < counted["selective checkpoint"] < counted["eager"]
    for name, saved in counted.items():  # the second, independent measurement agrees
        assert _forward_allocations(built[name], x) == saved, name


def test_run_reports_selective_checkpoint_on_cpu(tmp_path):
    config, batch, seq = memory.MODELS["tiny"], 2, 16
    results = {r.policy: r for r in memory.run("tiny", batch=batch, seq=seq, out_dir=str(tmp_path),
                                               device="cpu", dtype=torch.float32)}
    selective = results["selective checkpoint"]
    assert not selective.error
    assert selective.saved_bytes == _selective_bytes_by_hand(config, batch, seq, torch.float32)
    # fp32, per layer in bytes per s·b·h: the input, 4, in 3 of the 4 layers (the first is the
    # caller's); qkv 12, attention 4, attn_out 4, fc1 16, fc2 4; the logsumexp, 4 bytes per head
    # per token, 2 heads over a width of 64: 1/8.
    assert selective.per_layer_sbh == 3 + 40 + 1 / 8
    assert results["full checkpoint"].per_layer_sbh < selective.per_layer_sbh < results["eager"].per_layer_sbh


def test_an_unknown_model_is_a_value_error_naming_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"model must be one of gpt2-small, .*; got 'gpt2-smal'"):
        memory.run("gpt2-smal", out_dir=str(tmp_path), device="cpu")
