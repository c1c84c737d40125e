"""The main job without a GPU (`bash scripts/bench.sh`, `remat bench` without ops): the memory report
of real models on meta tensors and the float64 check of every kernel, run here at small sizes."""

import csv
import os

import pytest
import torch

from remat import _backend
from remat.bench import kernel_check, without_gpu
from remat.bench.cases import Result
from remat.cli import main


def test_the_main_job_counts_the_models_and_checks_the_kernels(tmp_path, capsys):
    found, rows = without_gpu.run(out_dir=str(tmp_path), dtypes=("fp32",), models=("tiny",), batch=2, seq=16,
                                  suites=("layernorm", "gelu"), jobs=0)
    printed = capsys.readouterr().out
    assert printed.startswith("No GPU here: what remat saves on real models")
    # The memory report: every policy counted on meta, the plans among them, a CSV and a PNG.
    policies = [r.policy for r in found["tiny"]]
    assert policies[:5] == ["eager", "remat", "selective checkpoint", "full checkpoint", "offload to host"]
    assert [p.split(":")[0] for p in policies[5:]] == ["plan 75%", "plan 50%", "plan 25%"]
    assert "counted on meta tensors" in printed and "predicted for H200" in printed
    assert (tmp_path / "memory_tiny.csv").exists() and (tmp_path / "memory_tiny.png").stat().st_size > 0
    # The check: each case of the suites, against float64, on the Triton kernels where the interpreter runs them.
    implementation = "remat-triton" if _backend.interpreter_enabled() else "remat-reference"
    assert [(row["op"], row["implementation"]) for row in rows] == [
        ("layernorm", implementation), ("layernorm", implementation), ("gelu", implementation),
        ("gelu_tanh", implementation), ("gelu+bias", implementation)]
    assert all(row["check"].startswith("ok (") for row in rows), rows
    with open(tmp_path / "check.csv") as handle:
        assert list(csv.DictReader(handle)) == rows
    assert "5 of 5 ok" in (tmp_path / "check.md").read_text()
    assert "5 of 5 kernel checks ok" in printed


def test_the_check_runs_the_triton_kernels_in_workers_and_leaves_this_process_as_it_was(monkeypatch):
    """Worker processes get TRITON_INTERPRET=1 (it must be set before triton is imported), this process
    keeps its setting: here it would send the memory report's meta tensors to the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    checks = kernel_check.Checks(("fp32",), ("rms_norm",), jobs=1)
    try:
        assert "TRITON_INTERPRET" not in os.environ
        rows = checks.results(on_row=lambda row: None)
    finally:
        checks.close()
    assert [row["implementation"] for row in rows] == ["remat-triton", "remat-triton"]
    assert all(row["check"].startswith("ok (") for row in rows), rows


def test_a_case_without_a_reference_is_listed_not_failed():
    result = Result(case=None, implementation="remat-triton", ours=True)  # check_case left check "" and no error
    verdict = kernel_check._verdict(result)
    assert verdict == kernel_check.NO_REFERENCE and kernel_check.passed({"check": verdict})
    result.error = "RuntimeError: the kernel did not run"
    verdict = kernel_check._verdict(result)
    assert verdict == "failed" and not kernel_check.passed({"check": verdict})


def _record_main_job(monkeypatch, rows):
    calls = []

    def run(**kwargs):
        calls.append(kwargs)
        return {}, rows

    monkeypatch.setattr(without_gpu, "run", run)
    return calls


def test_bench_without_ops_and_without_a_gpu_is_the_main_job(monkeypatch, tmp_path):
    calls = _record_main_job(monkeypatch, [{"check": "ok (1.00x)"}])
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert calls == [{"out_dir": str(tmp_path), "dtypes": ("fp32", "fp16"), "progress": True}]
    main(["bench", "--device", "cpu", "--dtype", "fp16", "--no-progress"])
    assert calls[-1]["dtypes"] == ["fp16"] and calls[-1]["progress"] is False
    if not torch.cuda.is_available():  # no --device: the machine decides
        main(["bench"])
        assert len(calls) == 3


def test_the_main_job_fails_when_a_kernel_does(monkeypatch, capsys):
    _record_main_job(monkeypatch, [{"check": "ok (1.00x)"}, {"check": "wrong"}])
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "--device", "cpu"])
    assert stopped.value.code == "remat bench: 1 kernel checks failed (see bench/out/check.md)"


@pytest.mark.parametrize("arguments, message", [
    (["--dtype", "bf16"], "whose tl.dot is wrong on bf16 operands"),
    (["--shapes", "33"], "--shapes sets the microbenchmarks' sizes: name the ops"),
])
def test_the_main_job_refuses_what_it_cannot_do(monkeypatch, arguments, message):
    calls = _record_main_job(monkeypatch, [])
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "--device", "cpu", *arguments])
    assert message in stopped.value.code and not calls
