"""`remat memory` counts each policy exactly (on meta tensors and on CPU ones, each storage once, what
checkpoints hold included), predicts its time with the planner's cost model, and survives what a
one-shot GPU run meets: a policy that fails, an interrupt."""

import csv
import gc
import math

import pytest
import torch

from remat import memory
from remat.planner import measure, plan
from remat.policies import Checkpointed
from remat.policies import policies as policy_table
from remat.saved import SavedStorages, count_saved_bytes

TINY = memory.MODELS["tiny"]


def _rows(tmp_path, device="meta", dtype=torch.bfloat16, batch=2, seq=16):
    return {r.policy.split(":")[0]: r for r in memory.run("tiny", batch=batch, seq=seq, out_dir=str(tmp_path),
                                                         device=device, dtype=dtype)}


def test_a_failing_policy_costs_only_its_own_timing_and_an_interrupt_keeps_the_rest(tmp_path, monkeypatch, capsys):
    """What a GPU run meets while timing the policies (out of memory, no pinned memory, Ctrl-C): run
    here through the same loop, on CPU tensors, with the timing of some rows made to fail."""
    counted, rows = memory.count("tiny", 2, 16)
    timed = []

    def time_row(row, model, paths, example, timer):
        if row.policy == "remat":
            raise RuntimeError("pretend out of memory\nsecond line of the message")
        if row.policy == "full checkpoint":
            raise KeyboardInterrupt  # as `timeout -s INT` would, while this policy is timed
        timed.append(row.policy)
        row.step_ms, row.peak_gb = 1.0, 0.5

    monkeypatch.setattr(memory, "time_row", time_row)
    assert memory._time_rows(counted, rows, device="cpu") is True  # interrupted
    by_name = {r.policy: r for r in rows}
    assert timed == ["eager", "selective checkpoint"]  # timing stopped at the interrupt
    assert by_name["remat"].error == "RuntimeError: pretend out of memory"  # first line only
    assert by_name["remat"].saved_bytes > 0 and math.isnan(by_name["remat"].step_ms)  # its count stands
    assert by_name["eager"].step_ms == 1.0 and math.isnan(by_name["offload to host"].step_ms)
    assert "timed remat: error: RuntimeError: pretend out of memory" in capsys.readouterr().out
    memory._write_csv(rows, str(tmp_path / "memory.csv"))
    with open(tmp_path / "memory.csv") as handle:
        written = {row["policy"]: row for row in csv.DictReader(handle)}
    assert written["remat"]["error"] == "RuntimeError: pretend out of memory" and written["eager"]["error"] == ""
    assert float(written["remat"]["saved_bytes"]) == by_name["remat"].saved_bytes
    assert memory.cheapest_fitting(rows, 1.0).policy == "eager"  # measured, fitting, and the fastest


def test_the_predicted_times_are_the_cost_models(tmp_path):
    """eager: the layers' forward and backward, three forwards; full checkpointing reruns the forward;
    each plan is eager plus what its choices add, and keeps at most its share of eager's bytes."""
    rows = _rows(tmp_path)
    eager = rows["eager"]
    assert rows["full checkpoint"].predicted_ms == pytest.approx(eager.predicted_ms * 4 / 3)
    assert eager.predicted_ms < rows["remat"].predicted_ms < rows["full checkpoint"].predicted_ms
    for fraction in memory.PLAN_FRACTIONS:
        plan = rows[f"plan {fraction:.0%}"]
        assert plan.saved_bytes <= fraction * eager.saved_bytes and plan.predicted_ms >= eager.predicted_ms
        assert len(plan.choices) == TINY.layers
    offload = rows["offload to host"]
    assert offload.saved_bytes == 0 and offload.host_bytes > 0 and offload.per_layer_bytes == 0


def test_a_causal_lms_loss_head_is_counted_and_fused(tmp_path):
    """A causal LM's rows hold its LM head and transformers' loss, counted on meta: x (bf16) and the
    fp32 log-softmax of the logits, and the shifted labels; remat.linear_cross_entropy keeps x, an fp32
    log-sum-exp and the label a token. Each keeps a 4-byte scalar besides (the loss's token count)."""
    pytest.importorskip("transformers", minversion="5.25")
    batch, seq, hidden, vocab = 2, 16, 64, 101
    tokens = batch * seq
    stock, fused = memory.loss_head_bytes(hidden, vocab, batch, seq, torch.bfloat16)
    assert stock == tokens * (2 * hidden + 4 * vocab + 8) + 4
    assert fused == tokens * (2 * hidden + 4 + 8) + 4
    assert memory._causal_lm_head("hf-gpt2-small") == (768, 50257)
    assert memory._causal_lm_head("bert-base") is None and memory._causal_lm_head("tiny") is None


def test_a_causal_lms_plan_rows_choose_its_loss_head():
    """The plan rows of a causal LM plan its *ForCausalLM with labels: its LM head and loss are the
    plan's choice too, "+ fused loss" in the row's name where fused, and the row's total is the plan's,
    head included. Two countings agree: its all-stock plan keeps exactly the eager row's total (the
    body and the head counted apart), and its two head choices differ by what loss_head_bytes says
    the fused loss saves."""
    pytest.importorskip("transformers", minversion="5.25")
    name, batch, seq = "hf-gpt2-small", 2, 64
    counted, rows = memory.count(name, batch, seq)
    eager, plans = rows[0], [r for r in rows if r.policy.startswith("plan")]
    assert len(plans) == len(memory.PLAN_FRACTIONS)
    for fraction, row in zip(memory.PLAN_FRACTIONS, plans):
        assert not row.error and row.saved_bytes <= fraction * eager.saved_bytes
        assert row.head in ("stock", "fused") and row.policy.endswith(" + fused loss") == (row.head == "fused")
    assert "fused" in {row.head for row in plans}  # the head's bytes are most of a short sequence's
    model, example = memory.plan_model(name, batch, seq, torch.bfloat16)
    loose = plan(model, example, 10**15)
    assert (loose.head, loose.saved_bytes) == ("stock", eager.saved_bytes)
    saves, _, _ = measure(model, example, ("full",))  # every layer checkpointed, the head stock
    forced = plan(model, example, saves["full"].total_bytes() - 1)
    stock_head, fused_head = counted.head
    assert forced.head == "fused" and loose.head_bytes - forced.head_bytes == stock_head - fused_head


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
    assert count_saved_bytes(module, x, offload=False) == (H_BYTES, 0)
    assert count_saved_bytes(module, x, offload=True) == (0, H_BYTES)


def test_offloaded_bytes_are_counted_as_saved_bytes_are():
    # What offloading does on a GPU: each saved tensor copied off the device (a clone here), so the
    # device tensor is freed after the forward; the host count must not change.
    module, x = _SavesAWeightAndATensorTwice(), torch.randn(4, 8, requires_grad=True)
    offloaded = SavedStorages(module.parameters())

    def to_host(tensor):
        offloaded.add(tensor)
        return tensor.clone()

    with torch.autograd.graph.saved_tensors_hooks(to_host, lambda t: t):
        out = module(x)
    assert offloaded.total_bytes(out, x) == H_BYTES == count_saved_bytes(module, x, offload=True)[1]


def test_a_freed_storage_is_counted_though_another_reuses_its_address():
    # Offloading frees each saved device tensor, and the allocator hands its address to the next:
    # two storages at one address, both copied to the host. Built here on one buffer, so the
    # address is the same for certain.
    buffer = bytearray(64)
    saved = SavedStorages(torch.nn.Linear(1, 1).parameters())
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
    config, batch, seq = TINY, 2, 16
    stack = memory.torch_stack(config, dtype=dtype)
    x = torch.randn(batch, seq, config.hidden, dtype=dtype, requires_grad=True)
    built = {p.name: p.make(stack) for p in policy_table(config.layers, compiled=False)}
    counted = {name: count_saved_bytes(built[name], x, offload=False)[0]
               for name in ("eager", "selective checkpoint", "full checkpoint")}
    expected = _selective_bytes_by_hand(config, batch, seq, dtype)
    assert counted["selective checkpoint"] == expected
    assert counted["full checkpoint"] < counted["selective checkpoint"] < counted["eager"]
    for name, saved in counted.items():  # the second, independent measurement agrees
        assert _forward_allocations(built[name], x) == saved, name


# A GPU's flash attention (what SDPA is counted as on meta) also keeps its dropout generator's seed
# and offset, 16 + 8 bytes of uint64, which the CPU kernel does not.
PHILOX_BYTES = 24


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_run_counts_selective_checkpoint_as_the_block_structure_says(tmp_path, device):
    """remat memory's count (the planner's, on CPU or meta tensors) equals the hand count above, which
    the allocations confirm on CPU."""
    config, batch, seq = TINY, 2, 16
    rows = _rows(tmp_path, device, torch.float32, batch, seq)
    selective = rows["selective checkpoint"]
    philox = PHILOX_BYTES * config.layers if device == "meta" else 0
    assert not selective.error
    assert selective.saved_bytes == _selective_bytes_by_hand(config, batch, seq, torch.float32) + philox
    # fp32, per layer in bytes per s·b·h: the input, 4, in 3 of the 4 layers (the first is the
    # caller's); qkv 12, attention 4, attn_out 4, fc1 16, fc2 4; the logsumexp, 4 bytes per head
    # per token, 2 heads over a width of 64: 1/8.
    assert selective.per_layer_sbh == 3 + 40 + 1 / 8 + philox / config.layers / (batch * seq * config.hidden)
    assert rows["full checkpoint"].per_layer_sbh < selective.per_layer_sbh < rows["eager"].per_layer_sbh
    assert ("offload to host" in rows) == (device == "meta")  # offloading is a GPU's choice: not for CPU tensors


def test_an_unknown_model_is_a_value_error_naming_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"model must be one of gpt2-small, .*; got 'gpt2-smal'"):
        memory.run("gpt2-smal", out_dir=str(tmp_path), device="cpu")


def test_a_policy_longer_than_the_column_widens_it_for_every_row(capsys):
    counted = memory.Counted("m", "M", 2, 8, 1, 4, torch.float32, "meta", "H200")
    long = "plan 25%: 2 remat, 18 selective, 16 full + fused loss"
    rows = [memory.PolicyResult("eager", 2048.0, 0.0, 1024.0, 1.0), memory.PolicyResult(long, 1024.0, 0.0, 512.0, 1.5)]
    memory._print_table(counted, rows, on_gpu=False)
    header, *table = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("policy", "eager",
                                                                                                "plan"))]
    assert len(long) > memory.POLICY_WIDTH
    assert header.index("per layer") + len("per layer") == len(long) + 1 + 10  # where the rows' first number ends
    assert table[1].startswith(long + " ") and len(table[0]) == len(table[1])
