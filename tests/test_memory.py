"""`remat memory` survives what a one-shot GPU run meets: a policy that fails, an interrupt, and
host bytes that are counted as the device bytes are (each storage once, no parameters)."""

import csv
import math

import pytest
import torch
from remat import memory

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
    offloaded = memory._SavedStorages(module)

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
    saved = memory._SavedStorages(torch.nn.Linear(1, 1))
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
