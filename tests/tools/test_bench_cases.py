"""The benchmark runner: outputs checked before timing, remat's backend for the whole timed call,
failures and Ctrl-C contained, results on disk after every case."""

import csv
import math
import types

import pytest
import torch

import remat
from remat import _backend, bench
from remat.bench.cases import Built, Case, CaseInterrupted, Implementation, Timer, check_against, measure_case, op_built


def _case(implementations, make_inputs=lambda: None, check=None):
    return Case(op="fake", mode="fwd", dtype=torch.float32, shape="n=1", size=1, unit="GB/s", work=1e6,
                make_inputs=make_inputs, implementations=implementations, check=check)


def _timed(fn):
    return lambda inputs: Built(fn)


def test_backend_is_in_force_for_the_backward_too(monkeypatch):
    """remat's ops choose their backend when they run: the backward of a benchmarked call must see
    the implementation's backend, not whatever is set after its forward returned."""
    seen = []
    choose = _backend.choose
    monkeypatch.setattr(_backend, "choose",
                        lambda op, device, **kw: seen.append(_backend.get_backend()) or choose(op, device, **kw))
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        remat.layer_norm(x, (16,)).sum().backward()

    results = measure_case(_case([Implementation("remat", True, _timed(step), backend="reference")]),
                           Timer("cpu", warmup=1, reps=2), rounds=1)
    assert not results[0].error and results[0].p50_ms > 0
    calls_per_step = len(seen) // 3  # 1 warm-up + 2 timed calls
    assert calls_per_step >= 2, f"forward and backward should both choose a backend, saw {seen}"
    assert set(seen) == {"reference"}, seen
    assert _backend.get_backend() == "auto"


def test_deterministic_algorithms_are_in_force_for_a_deterministic_implementation_only():
    """An implementation with deterministic=True runs every timed call (the backward inside it
    included) under torch.use_deterministic_algorithms(True); the others, and the caller after
    the case, keep the setting they had."""
    seen = {}

    def record(name):
        return lambda: seen.setdefault(name, set()).add(torch.are_deterministic_algorithms_enabled())

    impls = [Implementation("deterministic", True, _timed(record("deterministic")), deterministic=True),
             Implementation("default", False, _timed(record("default")))]
    results = measure_case(_case(impls), Timer("cpu", warmup=1, reps=2), rounds=1)
    assert not any(result.error for result in results)
    assert seen == {"deterministic": {True}, "default": {False}}
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_failing_implementation_or_input_is_reported_not_fatal():
    def broken():
        raise RuntimeError("out of memory, say")

    results = measure_case(_case([Implementation("ok", True, _timed(lambda: None)),
                                  Implementation("broken", False, _timed(broken))]), Timer("cpu", warmup=1, reps=2))
    by_name = {r.implementation: r for r in results}
    assert by_name["ok"].p50_ms >= 0 and not by_name["ok"].error
    assert "out of memory" in by_name["broken"].error and math.isnan(by_name["broken"].p50_ms)

    def no_inputs():
        raise MemoryError("inputs too large")

    results = measure_case(_case([Implementation("ok", True, _timed(lambda: None))], no_inputs), Timer("cpu"))
    assert results[0].error.startswith("inputs: MemoryError")


def _interrupting_after(calls):
    count = {"n": 0}

    def fn():
        count["n"] += 1
        if count["n"] > calls:
            raise KeyboardInterrupt

    return fn


def test_ctrl_c_inside_a_case_keeps_what_it_timed():
    # Round 1 times both (1 warm-up + 3 calls each); Ctrl-C comes in round 2.
    case = _case([Implementation("first", True, _timed(lambda: None)),
                  Implementation("second", False, _timed(_interrupting_after(4)))])
    with pytest.raises(CaseInterrupted) as stop:
        measure_case(case, Timer("cpu", warmup=1, reps=3))
    by_name = {r.implementation: r for r in stop.value.results}
    assert not math.isnan(by_name["first"].p50_ms) and not math.isnan(by_name["second"].p50_ms)


def test_run_writes_partial_results_when_interrupted(tmp_path, monkeypatch, capsys):
    def cases(device, dtypes, quick, sizes):
        yield _case([Implementation("measured", True, _timed(lambda: None)),
                     Implementation("cut", False, _timed(_interrupting_after(0)))])
        yield _case([Implementation("never", True, _timed(lambda: None))])

    monkeypatch.setitem(bench.SUITES, "fake", types.SimpleNamespace(cases=cases))
    bench.run(["fake"], [torch.float32], out_dir=str(tmp_path), device="cpu", progress=False)
    assert "interrupted: partial results" in capsys.readouterr().out
    with open(tmp_path / "bench.csv") as handle:
        rows = {row["implementation"]: row for row in csv.DictReader(handle)}
    assert float(rows["measured"]["p50_ms"]) >= 0
    assert rows["cut"]["p50_ms"] == "-" and "never" not in rows


def test_memory_is_measured_after_the_first_timing_and_a_failure_there_keeps_the_times():
    class FailingMemoryTimer(Timer):
        def peak_memory_bytes(self, fn, reset=None):
            self.measured = getattr(self, "measured", 0) + 1
            raise RuntimeError("CUDA out of memory")

    timer = FailingMemoryTimer("cpu", warmup=1, reps=2)
    (result,) = measure_case(_case([Implementation("ours", True, _timed(lambda: None))]), timer, rounds=3)
    assert timer.measured == 1  # once, in the first round
    assert result.error.startswith("memory: RuntimeError") and result.p50_ms >= 0


def _layer_norm_case(implementations, dtype=torch.bfloat16):
    """A LayerNorm case checked against F.layer_norm, with the given functions of (x, w, b)."""
    def build(fn):
        def built(inputs):
            x, w, b, dy = inputs
            return op_built("fwd+bwd", lambda: fn(x, w, b), {"x": x, "weight": w, "bias": b}, dy)

        return built

    def make_inputs():
        x, dy = torch.randn(64, 48, dtype=dtype, requires_grad=True), torch.randn(64, 48, dtype=dtype)
        w, b = (torch.randn(48, dtype=dtype, requires_grad=True) for _ in range(2))
        return x, w, b, dy

    torch_layer_norm = lambda x, w, b: torch.nn.functional.layer_norm(x, (48,), w, b)  # noqa: E731
    impls = [Implementation(name, name != "torch", build(fn))
             for name, fn in [("torch", torch_layer_norm), *implementations]]
    return Case(op="layernorm", mode="fwd+bwd", dtype=dtype, shape="M=64 N=48", size=48, unit="GB/s", work=1e6,
                make_inputs=make_inputs, implementations=impls, check=check_against(build(torch_layer_norm)))


def _by_name(results):
    return {r.implementation: r for r in results}


def test_a_wrong_output_is_marked_and_never_timed():
    calls = {"wrong": 0}

    def wrong_bias_gradient(x, w, b):  # the same forward, bit for bit, but db comes out doubled
        calls["wrong"] += 1
        return torch.nn.functional.layer_norm(x, (48,), w, b + (b - b.detach()))

    def slightly_off(x, w, b):  # an fp32 computation rounded once: more exact than bf16 PyTorch
        return torch.nn.functional.layer_norm(x.float(), (48,), w.float(), b.float()).to(x.dtype)

    results = _by_name(measure_case(_layer_norm_case([("wrong", wrong_bias_gradient), ("exact", slightly_off)]),
                                    Timer("cpu", warmup=1, reps=2)))
    assert results["wrong"].check == "wrong" and math.isnan(results["wrong"].p50_ms)
    assert "dbias error" in results["wrong"].error and "2x PyTorch's" in results["wrong"].error
    assert calls["wrong"] == 1  # the check's one call, no timing, no memory measurement
    for name in ("torch", "exact"):
        assert results[name].check.startswith("ok (") and results[name].p50_ms > 0, results[name]


def test_non_finite_outputs_are_wrong():
    def nan_output(x, w, b):
        return torch.nn.functional.layer_norm(x, (48,), w, b) * float("nan")

    result = _by_name(measure_case(_layer_norm_case([("nan", nan_output)]), Timer("cpu", warmup=1, reps=2)))["nan"]
    assert result.check == "wrong" and result.error == "wrong output: out has non-finite values"
    assert math.isnan(result.p50_ms)


def test_a_missing_gradient_is_wrong():
    def detached_weight(x, w, b):
        return torch.nn.functional.layer_norm(x, (48,), w.detach(), b)

    result = _by_name(measure_case(_layer_norm_case([("detached", detached_weight)]), Timer("cpu")))["detached"]
    assert result.check == "wrong" and result.error == "wrong output: no dweight"


def test_a_reference_that_fails_leaves_the_rows_timed_and_marked_unchecked():
    case = _layer_norm_case([])
    case.check = check_against(lambda inputs: (_ for _ in ()).throw(MemoryError("float64 does not fit")))
    (result,) = measure_case(case, Timer("cpu", warmup=1, reps=2))
    assert result.check == "unchecked" and result.error == "reference: MemoryError: float64 does not fit"
    assert result.p50_ms > 0


def test_csv_and_markdown_are_written_after_every_case(tmp_path, monkeypatch):
    """A run killed during a case (SIGKILL after a time limit) leaves the earlier cases on disk."""
    seen_on_disk = []

    def look_at_the_csv():
        with open(tmp_path / "bench.csv") as handle:
            seen_on_disk.append({row["implementation"] for row in csv.DictReader(handle)})

    def cases(device, dtypes, quick, sizes):
        yield _case([Implementation("first", True, _timed(lambda: None))])
        yield _case([Implementation("second", True, _timed(look_at_the_csv))])

    monkeypatch.setitem(bench.SUITES, "fake", types.SimpleNamespace(cases=cases))
    bench.run(["fake"], [torch.float32], out_dir=str(tmp_path), device="cpu", progress=False)
    assert seen_on_disk and all(names == {"first"} for names in seen_on_disk)
    assert "| first |" in (tmp_path / "bench.md").read_text()
