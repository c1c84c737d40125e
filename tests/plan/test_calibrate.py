"""remat.calibrate(): its arithmetic (rates from shapes and seconds, with a fake timer on meta
tensors), the cache round trip in $REMAT_CACHE_DIR, and remat.plan preferring cached constants."""

import json
import os

import pytest
import torch

import remat
from remat.gpt import GPTConfig, torch_stack
from remat.planner import DEVICES, calibrate
from remat.planner.cost import device_constants
from remat.planner.devices import Device
from remat.planner.units import is_planned


def test_the_rates_come_from_the_shapes_and_the_timed_seconds():
    seconds = {"matmul": 0.5, "copy": 0.25, "to host": 0.1, "from host": 0.2}
    called = []

    def timer(label, fn):
        fn()  # the runs work on meta tensors: shapes, no data
        called.append(label)
        return seconds[label]

    shape, copy_bytes, host_bytes = (64, 32, 16), 4096, 1024
    constants = calibrate.measure_constants("GPU X", timer, "meta", shape, copy_bytes, host_bytes)
    assert called == ["matmul", "copy", "to host", "from host"]
    assert constants == Device("GPU X", 2 * 64 * 32 * 16 / 0.5, 2 * 4096 / 0.25, 1024 / 0.2)  # the slower way


def test_the_cache_round_trip_keeps_every_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "nested" / "cache"))
    first, second = Device("NVIDIA H200", 7e14, 4e12, 5e10), Device("NVIDIA A100-SXM4-80GB", 2.5e14, 1.8e12, 2.4e10)
    calibrate.store(first)
    calibrate.store(second)
    assert calibrate.cached() == {first.name: first, second.name: second}
    assert calibrate.cache_path() == str(tmp_path / "nested" / "cache" / "planner-constants.json")
    assert device_constants("A100") == second and device_constants("H100") == DEVICES["H100"]  # none cached


def test_plan_uses_the_cached_constants_of_that_gpu():
    stack = torch_stack(GPTConfig(hidden=64, heads=2, layers=3), device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    budget = 40 * 1024
    table = remat.plan(stack, (x,), budget, device="H200")
    halved = DEVICES["H200"]
    calibrate.store(Device("NVIDIA H200", halved.flops_per_s / 2, halved.bytes_per_s / 2, halved.host_bytes_per_s / 2))
    measured = remat.plan(stack, (x,), budget, device="H200")
    assert table.device == "H200" and measured.device == "NVIDIA H200"
    assert measured.choices == table.choices and table.extra_seconds > 0  # every rate halved: every time doubled
    assert measured.extra_seconds == pytest.approx(2 * table.extra_seconds)


def test_an_unreadable_cache_warns_and_the_table_is_used():
    path = calibrate.cache_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as handle:
        json.dump({"format": 1, "devices": {"NVIDIA H200": {"flops_per_s": 1.0}}}, handle)
    with pytest.warns(UserWarning, match="ignoring the unreadable calibration cache"):
        assert device_constants("H200") == DEVICES["H200"]


def _stack(device, layers=3):
    stack = torch_stack(GPTConfig(hidden=64, heads=2, layers=layers), device=device, dtype=torch.float32)
    return stack, torch.randn(2, 16, 64, device=device, requires_grad=True)


def test_choice_times_are_timed_training_steps_over_the_units():
    """Each choice's step (every unit under it) less the stock step, over the 3 units; the timed
    steps run forward and backward, and leave the parameters' gradients as they were."""
    stack, x = _stack("cpu")
    sentinel = [torch.full_like(p, 7.0) for p in stack.parameters()]
    for p, grad in zip(stack.parameters(), sentinel):
        p.grad = grad
    steps = {"stock": 1.0, "remat": 1.3, "selective": 1.6, "full": 2.2}
    timed = []

    def timer(label, fn):
        x.grad = None
        fn()
        assert x.grad is not None  # a backward ran
        timed.append(label)
        return steps[label]

    seconds = calibrate.measure_choices(stack, (x,), timer)
    assert timed == ["stock", "remat", "selective", "full"]  # no offloading for CPU tensors
    assert seconds == pytest.approx({"stock": 0.0, "remat": 0.1, "selective": 0.2, "full": 0.4})
    assert all(p.grad is grad for p, grad in zip(stack.parameters(), sentinel))
    assert not is_planned(stack)  # the choices were applied to copies


def test_a_model_and_its_meta_copy_have_one_signature():
    stack, x = _stack("cpu")
    meta = remat.planner.meta_copy(stack)
    assert calibrate.model_signature(stack, (x,)) == calibrate.model_signature(meta, (x.to("meta"),))
    other, y = _stack("cpu", layers=2)
    assert calibrate.model_signature(other, (y,)) != calibrate.model_signature(stack, (x,))


def test_plan_uses_the_measured_choice_times_of_that_model_and_gpu():
    stack = torch_stack(GPTConfig(hidden=64, heads=2, layers=3), device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    budget = 40 * 1024
    predicted = remat.plan(stack, (x,), budget, device="H200")
    calibrate.store(Device("NVIDIA H200", *[getattr(DEVICES["H200"], f) for f in ("flops_per_s", "bytes_per_s",
                                                                                   "host_bytes_per_s")]))
    times = {"stock": 0.0, "remat": 1e-3, "selective": 2e-3, "full": 3e-3, "offload": 9.0}
    calibrate.store_choices("NVIDIA H200", calibrate.model_signature(stack, (x,)), times)
    measured = remat.plan(stack, (x,), budget, device="H200")
    assert not predicted.measured and measured.measured and "times measured on NVIDIA H200" in str(measured)
    assert measured.unit_seconds == [times[c] for c in measured.choices]
    assert "offload" not in measured.choices  # measured as far slower
    other = torch.empty(2, 16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)  # another shape
    assert not remat.plan(stack, (other,), budget, device="H200").measured


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_calibrate_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"remat.calibrate\(\) measures a CUDA GPU and torch sees none"):
        remat.calibrate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a GPU")
def test_calibrate_measures_this_gpu_and_plan_uses_it():
    constants = remat.calibrate()
    name = torch.cuda.get_device_name()
    assert constants.name == name and calibrate.cached()[name] == constants
    assert constants.flops_per_s > 1e12 and constants.bytes_per_s > 1e11 and constants.host_bytes_per_s > 1e9
    assert device_constants(torch.device("cuda")) == constants


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_calibrate_cli_with_a_model_without_a_gpu_is_a_clear_error(capsys):
    from remat.cli import main

    with pytest.raises(SystemExit, match="remat calibrate: timing a model's plan choices needs a CUDA GPU"):
        main(["calibrate", "--model", "tiny", "--batch", "1", "--seq", "8"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a model's choices on a GPU")
def test_calibrate_with_a_model_times_its_choices_and_plan_uses_them(capsys):
    """`remat calibrate --model` times the choices on this GPU; `remat plan --model` on meta, for the
    GPU's table name, then plans with those times."""
    from remat.cli import main
    from remat.planner import command

    main(["calibrate", "--model", "tiny", "--batch", "2", "--seq", "64"])
    assert "extra ms per layer" in capsys.readouterr().out
    name = torch.cuda.get_device_name()
    table = next((d for d in DEVICES if d != "cpu" and d in name), None)
    if table is None:
        pytest.skip(f"{name} has no table entry to plan for from meta")
    result = command.run("tiny", 2, 64, "1GiB", device=table)
    assert result.measured and result.device == name
