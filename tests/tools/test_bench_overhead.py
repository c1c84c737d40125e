"""`remat bench overhead` runs end to end (a handful of calls: nothing here is timed or asserted
about speed), writes the rows and columns it promises, times stock and converted layers that compute
the same thing, and leaves the process as it found it."""

import csv

import pytest
import torch

import remat
from remat import bench, cli
from remat.bench import overhead

pytest.importorskip("transformers", minversion="5.25")

REPS = 2


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The command's output folder, after `remat bench overhead` with two calls of each layer."""
    out = tmp_path_factory.mktemp("overhead")
    backend, threads = remat.get_backend(), torch.get_num_threads()
    assert cli.main(["bench", "overhead", "--reps", str(REPS), "--out", str(out), "--no-progress"]) == 0
    assert (remat.get_backend(), torch.get_num_threads()) == (backend, threads)  # set for the run only
    return out


def test_the_command_writes_a_row_per_layer_and_dispatch_measurement(cli_run):
    with open(cli_run / "overhead.csv") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames[:len(overhead.COLUMNS)] == overhead.COLUMNS
    assert {"torch", "transformers", "remat", "commit", "backend", "timings"} <= set(reader.fieldnames)
    empty = overhead.EMPTY_KERNELS
    assert [(row["subject"], row["implementation"]) for row in rows] == [
        ("llama layer fwd+bwd", "stock"), ("llama layer fwd+bwd", "remat"), ("llama layer fwd+bwd", empty),
        ("gpt2 layer fwd+bwd", "stock"), ("gpt2 layer fwd+bwd", "remat"), ("gpt2 layer fwd+bwd", empty),
        ("custom-op call, no grad", "python function"), ("custom-op call, no grad", "torch.library custom op"),
        ("custom-op pair, fwd+bwd", "native autograd"),
        ("custom-op pair, fwd+bwd", "custom op + autograd + backward op")]
    assert all(row["backend"].startswith("reference") for row in rows)
    for row in rows:
        assert not row["error"], row
        assert 0 < float(row["p20_us"]) <= float(row["p50_us"]) <= float(row["p80_us"]), row
    firsts = [rows[0], rows[3], rows[6], rows[8]]
    assert all(row["minus_first_us"] == "-" for row in firsts)
    assert all(row["minus_first_us"] not in ("", "-") for row in rows if row not in firsts)
    assert [row["check"] for row in rows if row["implementation"] == empty] == ["same calls"] * 2
    # each remat layer: its check passed against float64, and it called remat's ops (stock: none)
    for stock, ours in zip(rows[0:6:3], rows[1:6:3]):
        assert ours["check"].startswith("ok ("), ours
        assert stock["remat_op_calls"] == "0" and int(stock["aten_op_calls"]) > 0
        calls = ours["remat_op_calls"]
        assert int(calls.split()[0]) > 0 and calls.endswith("bwd)") and int(ours["aten_op_calls"]) > 0, calls


def test_the_report_has_the_summary_and_a_profile_of_each_converted_layer(cli_run):
    markdown = (cli_run / "overhead.md").read_text()
    assert f"the target of {overhead.TARGET_RATIO - 1:+.0%}" in markdown and "custom-op machinery" in markdown
    profile = (cli_run / "overhead_profile.txt").read_text()
    blocks = profile.strip().split("\n\n")
    assert [block.split()[0] for block in blocks] == ["llama", "llama", "gpt2", "gpt2"]
    assert ["by cumulative time" in block for block in blocks] == [True, False, True, False]
    for block in blocks:
        title, header, *functions = block.splitlines()
        assert header.split()[:4] == ["calls", "own", "µs", "cum"] and len(functions) == overhead.PROFILE_TOP
        assert not any("overhead.py" in line for line in functions)  # the harness is left out
        assert not any(" /" in line or "site-packages" in line for line in functions)  # from the package on


@pytest.mark.parametrize("name", overhead.MODELS)
def test_stock_and_converted_layers_compute_the_same(name, reference_backend):
    pair = overhead.LayerPair(name, seq=8)
    assert type(pair.converted) is type(pair.stock) and pair.converted is not pair.stock
    assert any(type(m).__module__.startswith("remat.") for m in pair.converted.modules())  # converted
    assert not any(type(m).__module__.startswith("remat.") for m in pair.stock.modules())  # still stock
    stock, ours = pair.outputs(pair.stock), pair.outputs(pair.converted)
    assert stock.keys() == ours.keys() and len(ours) == 2 + len(list(pair.stock.parameters()))
    for key in stock:
        torch.testing.assert_close(ours[key], stock[key], rtol=1e-4, atol=1e-5, msg=key)
    ok, verdict = pair.check()
    assert ok, verdict
    counts = overhead.op_counts(pair.step(pair.converted), pair.reset(pair.converted))
    total, forward, backward, aten = overhead.remat_calls(counts)
    assert forward > 0 and backward == forward and total == forward + backward
    stock_counts = overhead.op_counts(pair.step(pair.stock), pair.reset(pair.stock))
    assert overhead.remat_calls(stock_counts)[0] == 0


def test_the_op_count_includes_what_remat_ops_run_on_the_reference(reference_backend):
    counts = overhead.op_counts(lambda: remat.gelu(torch.randn(4, 8)), lambda: None)
    assert counts["remat::gelu_fwd"] == 1 and counts["aten::erf"] == 1  # the exact GELU's erf, inside the op


def test_the_dispatch_measurement_compares_the_same_arithmetic():
    double, forward_op, _ = overhead.trivial_ops()
    leaf = torch.randn(3, 5, requires_grad=True)
    torch.testing.assert_close(forward_op(leaf), double(leaf))
    forward_op(leaf).backward(torch.ones(3, 5))
    torch.testing.assert_close(leaf.grad, torch.full((3, 5), 2.0))
    counts = overhead.op_counts(lambda: forward_op(leaf).sum().backward(), lambda: None)
    assert counts["remat_bench::double_fwd"] == 1 and counts["remat_bench::double_bwd"] == 1


def test_the_suite_is_run_only_when_named(monkeypatch):
    assert cli.NAMED_SUITES == {name: suite.SIZES_MEAN for name, suite in bench.NAMED_SUITES.items()}
    assert "overhead" not in bench.SUITES
    ran = []
    monkeypatch.setattr(bench, "run", lambda ops, *args, **kwargs: ran.append(ops))
    monkeypatch.setattr(overhead, "run", lambda **kwargs: ran.append("overhead"))
    cli.main(["bench", "all", "--device", "cpu"])
    cli.main(["bench", "overhead", "gelu", "--device", "cpu"])
    assert ran == [list(bench.SUITES), "overhead", ["gelu"]]


@pytest.mark.parametrize("arguments, message", [
    (["bench", "overhead", "--device", "cuda"], "--device cuda is not supported"),
    (["bench", "gelu", "--reps", "3"], "--reps sets the overhead suite's timed calls"),
])
def test_arguments_it_does_not_take_are_one_line_errors(arguments, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(arguments)


def test_the_empty_kernels_allocate_the_outputs_and_the_real_ones_come_back(reference_backend):
    """The empty-launch timing runs the same layer with each remat op returning its fake's outputs (right
    shapes, nothing computed), switched by the untimed reset; afterwards the ops compute again."""
    pair = overhead.LayerPair("llama", seq=8)
    switch = overhead._KernelSwitch()
    want = pair.forward(pair.converted)
    step, reset = switch.empty((pair.step(pair.converted), pair.reset(pair.converted)))
    try:
        reset()
        empty = pair.forward(pair.converted)
        step()
        assert empty.shape == want.shape and pair.x.grad.shape == pair.x.shape
    finally:
        switch.restore()
    torch.testing.assert_close(pair.forward(pair.converted), want)


def test_the_empty_kernels_pay_the_choice_of_the_kernel_as_real_calls_do(monkeypatch, reference_backend):
    """A kernel launch on a GPU follows the backend's choice of that kernel (_backend.choose, at every op
    call): the empty launches make it as often as the real calls do, or the row would leave it out of
    remat's overhead."""
    from remat import _backend

    choices = []
    real_choose = _backend.choose
    monkeypatch.setattr(_backend, "choose", lambda *args, **kwargs: choices.append(args[0]) or
                        real_choose(*args, **kwargs))
    pair = overhead.LayerPair("gpt2", seq=8)
    switch = overhead._KernelSwitch()
    made = {}
    try:
        for name, switched in (("real", switch.real), ("empty", switch.empty)):
            step, reset = switched((pair.step(pair.converted), pair.reset(pair.converted)))
            reset()
            choices.clear()
            step()
            made[name] = sorted(choices)
    finally:
        switch.restore()
    assert made["empty"] == made["real"] and {"layer_norm", "attention", "gelu"} <= set(made["real"])


def test_each_converted_row_is_timed_in_a_pair_of_its_own_with_stock(monkeypatch, reference_backend):
    """Interleaved three ways, stock ran after the reference's arithmetic half the time, which slowed it where
    the empty launches (the same modules the reference had just run) were not: the target's ratio came out
    5 to 8 points too low. Each converted row is compared with the stock calls of its own pair."""
    timed = []
    real = overhead.interleaved_us

    def recording(calls, reps, warmup=None):
        samples = real(calls, reps, warmup)
        timed.append(samples)
        return samples

    monkeypatch.setattr(overhead, "interleaved_us", recording)
    rows, _, _ = overhead.measure_layer("gpt2", 8, torch.float32, 3, 1)
    assert [sorted(samples) for samples in timed] == [sorted(["stock", overhead.EMPTY_KERNELS]), ["remat", "stock"]]
    empty, reference = timed
    stock_row, remat_row, empty_row = rows
    assert stock_row["p50_us"] == pytest.approx(overhead.quantiles(empty["stock"])[1])
    assert empty_row["minus_first_us"] == pytest.approx(
        overhead.quantiles(empty[overhead.EMPTY_KERNELS])[1] - overhead.quantiles(empty["stock"])[1])
    assert remat_row["minus_first_us"] == pytest.approx(
        overhead.quantiles(reference["remat"])[1] - overhead.quantiles(reference["stock"])[1])
