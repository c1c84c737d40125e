"""bench/gpu_check.sh, dry-run on CPU with stubs for python, nvidia-smi, compute-sanitizer and
timeout (bench/dry_run_gpu_check.sh): every step runs in order within its limit, a failed build
or a suite out of time does not end the run, and the summary has a row for everything. Seconds."""

import csv
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from remat.bench import report
from remat.bench.cases import Built, Case, Implementation, Timer, measure_case

BENCH = pathlib.Path(__file__).parents[2] / "bench"
SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")
ALWAYS_RUN = {"environment", "install (Triton only)", "build (CUDA extension)", "reinstall (Triton only)", "smoke",
              "tests: kernels", "tests: rest", *(f"bench: {suite}" for suite in SUITES)}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_check.sh is a bash script")


def _dry_run(tmp_path, **switches):
    env = {**os.environ, "REAL_PYTHON": sys.executable, **switches}
    done = subprocess.run(["bash", str(BENCH / "dry_run_gpu_check.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    with open(tmp_path / "gpu_check" / "steps.tsv", newline="") as handle:
        steps = {row["step"]: row for row in csv.DictReader(handle, delimiter="\t")}
    summary = done.stdout[done.stdout.index("== summary"):]
    return done, steps, summary


def test_every_step_runs_and_the_summary_has_a_row_for_each(tmp_path):
    done, steps, summary = _dry_run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(steps[name]["status"] == "ok" for name in ALWAYS_RUN - {"reinstall (Triton only)"}), steps
    assert "reinstall (Triton only)" not in steps  # only after a failed build
    # The steps that always run fit 8 minutes with the summary's 10 s (the others only get what is left).
    assert sum(int(steps[name]["limit"]) for name in steps if name in ALWAYS_RUN) + 15 <= 560
    assert "limits summing to 550 s" in done.stdout
    for suite in SUITES:
        assert re.search(rf"^  {suite} +ok .* cases .* bench/{suite}/bench.md$", summary, re.M), summary
    assert "smoke (bf16, fp16; remat against float64, at most twice PyTorch's error): 2 of 2 ok" in summary
    assert re.search(r"^  kernels +ok +116 passed, 0 failed, 4 skipped", summary, re.M)
    assert "sanitizer: compute-sanitizer memcheck: exit 0" in summary and "ERROR SUMMARY: 0 errors" in summary
    assert "commit dryrun0" in summary and "device NVIDIA H200" in summary and "triton 3.6.0" in summary
    archive = tmp_path / "archive"
    assert (archive / "gpu_check.tar.gz").stat().st_size > 0 and (archive / "summary.txt").read_text() == summary


def test_a_failed_build_reinstalls_for_triton_and_goes_on(tmp_path):
    done, steps, summary = _dry_run(tmp_path, STUB_BUILD_FAIL="1")
    assert done.returncode == 1
    assert steps["build (CUDA extension)"]["status"] == "failed (exit 1)"
    assert steps["reinstall (Triton only)"]["status"] == "ok"
    assert all(steps[f"bench: {suite}"]["status"] == "ok" for suite in SUITES)
    calls = (tmp_path / "stub_calls.tsv").read_text()
    assert "REMAT_SKIP_CUDA_BUILD=1" in calls.split("TORCH_CUDA_ARCH_LIST")[1]  # the reinstall came after the build


def test_a_suite_out_of_time_keeps_its_row_and_the_others_run(tmp_path):
    done, steps, summary = _dry_run(tmp_path, STUB_TIMEOUT_ON="remat bench attention")
    assert done.returncode == 1
    assert steps["bench: attention"]["status"] == "timed out"
    assert re.search(r"^  attention +timed out +1 of 18 +cases", summary, re.M), summary
    assert steps["bench: block"]["status"] == "ok" and re.search(r"^  block +ok", summary, re.M)


def test_failed_smoke_checks_are_listed(tmp_path):
    done, steps, summary = _dry_run(tmp_path, STUB_SMOKE_FAIL="1")
    assert steps["smoke"]["status"] == "failed (exit 1)" and done.returncode == 1
    assert "1 of 2 ok" in summary
    assert "WRONG: fp16 attention_causal b=8 h=16 s=2048 d=64 remat-triton wrong output: dq error" in summary


def test_without_pytest_plugins_the_tests_still_run(tmp_path):
    done, steps, summary = _dry_run(tmp_path, STUB_NO_PLUGINS="1")
    pytest_calls = [line for line in (tmp_path / "stub_calls.tsv").read_text().splitlines()
                    if line.startswith("python\t-m pytest")]
    assert len(pytest_calls) == 3 and not any(" -n " in c or "--timeout" in c for c in pytest_calls)
    assert steps["tests: kernels"]["status"] == "ok"


@pytest.mark.parametrize("elapsed, expected", [(0, "85"), (480, "70"), (542, "skipped")])
def test_a_step_never_gets_more_than_the_budget_leaves(tmp_path, elapsed, expected):
    """560 s in all, 10 of them kept for the summary: a step asking for 85 s at second 480 gets
    70; at second 542 it is skipped (under 10 s left)."""
    script = f"""
        source "{BENCH / 'gpu_check.sh'}"
        STEPS="{tmp_path / 'steps.tsv'}"; OUT_DIR="{tmp_path}"
        START=0; SECONDS={elapsed}
        run_step probe 85 "{tmp_path / 'probe.log'}" true
        cut -f 2,4 "$STEPS"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout
    limit, status = out.strip().splitlines()[-1].split("\t")
    assert (status.startswith("skipped") if expected == "skipped" else (limit, status) == (expected, "ok")), out


def test_the_stub_writes_the_columns_the_real_bench_writes():
    """The dry run's bench CSVs have the real header, so the summary read in it holds for the GPU's."""
    stub = (BENCH / "gpu_check_stubs" / "python").read_text()
    header = re.search(r'^BENCH_HEADER="(.*)"$', stub, re.M).group(1).split(",")
    assert header == report.COLUMNS + list(report.environment(torch.device("cpu"), cases_planned=1))


def test_summary_reads_a_real_bench_csv(tmp_path):
    """A CSV the runner wrote (a performance run's columns, a wrong row) becomes the suite's row."""
    def case(implementations):
        return Case(op="layernorm", mode="fwd", dtype=torch.bfloat16, shape="M=8 N=8", size=8, unit="GB/s", work=1e9,
                    make_inputs=lambda: None, implementations=implementations)

    results = measure_case(case([Implementation("remat-triton", True, lambda inputs: Built(lambda: None)),
                                 Implementation("torch", False, lambda inputs: Built(lambda: None))]),
                           Timer("cpu", reps=2))
    # as the runner leaves a wrong implementation: marked, not timed
    results[1].check, results[1].error = "wrong", "wrong output: dx error 1e-1 > 2x PyTorch's 1e-3"
    results[1].p20_ms = results[1].p50_ms = results[1].p80_ms = math.nan
    env = {**report.environment(torch.device("cpu"), cases_planned=3), "timings": report.PERFORMANCE}
    report.write_tables(report.rows([results]), env, str(tmp_path / "bench" / "layernorm"))
    summarize = _load("summarize")
    row = summarize.suite_row(str(tmp_path), "layernorm", {"bench: layernorm": {"status": "timed out"}})
    assert re.search(r"layernorm +timed out +1 of 3 +cases +2 rows +1 wrong +0 failed", row), row
    (headline,) = summarize.headline_lines(str(tmp_path), ["layernorm"])[1:]
    assert "remat-triton" in headline and "GB/s" in headline and "no peer timed" in headline


def _load(script):
    import importlib.util

    spec = importlib.util.spec_from_file_location(script, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_check_runs_each_group_and_writes_every_check(tmp_path):
    """bench/smoke_check.py for real, on CPU shapes: a row per remat implementation and case,
    all within twice PyTorch's error, exit 0; the md says so."""
    done = subprocess.run([sys.executable, str(BENCH / "smoke_check.py"), "--device", "cpu", "--dtypes", "fp32",
                           "--suites", "layernorm", "gelu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "smoke.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((row["op"], row["shape"]) for row in rows) == [
        ("gelu", "M=256 N=1000"), ("gelu+bias", "M=256 N=1000"), ("gelu_tanh", "M=256 N=1000"),
        ("layernorm", "M=256 N=1000"), ("layernorm", "M=256 N=256")]
    assert all(row["check"].startswith("ok (") and row["implementation"].startswith("remat") for row in rows)
    assert "5 of 5 ok" in (tmp_path / "smoke.md").read_text()


def test_smoke_check_writes_unfinished_groups_as_such(tmp_path):
    smoke = _load("smoke_check")
    rows = [{"suite": "layernorm", "op": "layernorm", "dtype": "bf16", "shape": "M=1 N=1",
             "implementation": "remat-triton", "check": "ok (1.00x)", "error": "", "seconds": "1.0"}]
    smoke._write(rows, [("attention", "fp16")], {"commit": "abc"}, str(tmp_path))
    with open(tmp_path / "smoke.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(row["suite"], row["check"]) for row in written] == [
        ("layernorm", "ok (1.00x)"), ("attention", "not finished")]
    assert "1 of 2 ok; not finished: attention fp16" in (tmp_path / "smoke.md").read_text()


def test_compile_warmer_finds_every_compiled_peer():
    """bench/warm_compile_cache.py compiles what the benchmarks build with torch.compile (on a GPU
    also FlexAttention and the memory-budget policies, left out of CPU runs)."""
    warmer = _load("warm_compile_cache")
    found = {suite: warmer.compiled_implementations(suite, "bf16", "cpu") for suite in SUITES}
    assert found == {"layernorm": ["torch.compile"], "rms_norm": ["torch.compile"], "gelu": ["torch.compile"],
                     "gated": ["torch.compile"], "mlp": ["torch.compile"],
                     "attention": [], "block": ["compile", "remat + compile", "compile (each block)"]}
