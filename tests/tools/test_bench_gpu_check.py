"""bench/gpu_check.sh, dry-run on CPU with stubs for python, nvidia-smi, compute-sanitizer and
timeout (bench/dry_run_gpu_check.sh) on the modelled clock: the steps that always run fit the
budget, every step runs in order within its limit, a failed build or a suite out of time does not
end the run, the summary has a row for everything, and what comes back (at most 8 files) is there
also when the run is killed at any point. Then the unpack script, the settings of a targeted rerun,
the commit the results name, and the warmers' and the smoke check's Python. Seconds."""

import csv
import io
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from remat import bench
from remat.bench import report
from remat.bench.cases import Built, Case, Implementation, Timer, measure_case

ROOT = pathlib.Path(__file__).parents[2]
BENCH = ROOT / "bench"
SUITES = ("layernorm", "rms_norm", "gelu", "gated", "mlp", "attention", "block")
ALWAYS_RUN = {"environment", "install (Triton only)", "build (CUDA extension)", "smoke", "wait for the background work",
              *(f"bench: {suite}" for suite in SUITES)}
BUDGET, RESERVE = 380, 10
NAME_THAT_COMES_BACK = re.compile(r"^[A-Za-z0-9._-]+$")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_check.sh is a bash script")


def _step_table():
    """{key: (limit, model, name)} from gpu_check.sh's set_step lines."""
    table = {}
    for line in (BENCH / "gpu_check.sh").read_text().splitlines():
        found = re.match(r'set_step (\w+) +(\d+) +(\d+) +"([^"]+)"', line)
        if found:
            table[found[1]] = (int(found[2]), int(found[3]), found[4])
    return table


def _environment(**switches):
    """This process's environment without any gpu_check or stub setting, then `switches`."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("GPU_CHECK_", "STUB_")) and key not in ("OUT", "ARCHIVE_DIR", "REMAT_COMMIT")}
    return {**env, "REAL_PYTHON": sys.executable, **switches}


def _dry_run_command(tmp_path, **switches):
    """(argv, env, the $OUT folder) of a dry run whose results come back to tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    argv = ["bash", str(BENCH / "dry_run_gpu_check.sh"), str(tmp_path / "dry")]
    return argv, _environment(OUT=str(out), **switches), out


def _dry_run(tmp_path, **switches):
    argv, env, out = _dry_run_command(tmp_path, **switches)
    # A session of its own: the stubs' kill (STUB_KILL_ON) ends this run's processes only.
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, start_new_session=True)
    return done, _steps(tmp_path / "dry" / "gpu_check" / "steps.tsv"), out


def _steps(path):
    with open(path, newline="") as handle:
        return {row["step"]: row for row in csv.DictReader(handle, delimiter="\t")}


def _summary(done):
    return done.stdout[done.stdout.index("== summary"):done.stdout.index("dry run: the steps")]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One dry run of everything, shared by the tests that read it: (done, steps, $OUT folder)."""
    return _dry_run(tmp_path_factory.mktemp("full"))


def test_the_always_run_part_fits_the_budget_on_the_modelled_clock(full_run):
    done, steps, out = full_run
    assert done.returncode == 0, done.stdout + done.stderr
    # Even if every step that always runs took its whole limit, the summaries' reserve would be left.
    limits, reserve = map(int, re.search(r"limits summing to (\d+) s \(\+ (\d+) s", done.stdout).groups())
    assert reserve == RESERVE and limits + reserve <= BUDGET
    # Each step took its modelled time (the stubs run at once), and the dry run adds them up.
    table = {name: model for limit, model, name in _step_table().values()}
    always = {name: row for name, row in steps.items() if row["part"] == "always"}
    assert set(always) == ALWAYS_RUN
    assert all(int(row["seconds"]) == table[name] for name, row in always.items()
               if name != "wait for the background work")
    total = int(re.search(r"the always-run part takes (\d+) s \(budget 380 s\)", done.stdout)[1])
    assert total == sum(int(row["seconds"]) for row in always.values()) < BUDGET - RESERVE
    assert f"== the steps that always run took {total} s (modelled on the H200) of the 380 s budget" in done.stdout
    # The background jobs end, by their models, within what the smoke check and the wait leave.
    background = [row for row in steps.values() if row["part"] == "background"]
    assert len(background) == 5 and all(row["status"].startswith("ok;") for row in background)
    # With the time left: `remat bench moe` (the experts suite) and `remat memory`; the rest of the
    # tests is cut by the budget (no failure).
    extras = [name for name, row in steps.items() if row["part"] == "extra"]
    assert extras == ["bench: experts", "memory", "tests: rest", "tests: exhaustive"]
    assert steps["bench: experts"]["status"] == "ok" and steps["memory"]["status"] == "ok"
    assert steps["tests: rest"]["status"] == "timed out"
    assert steps["tests: exhaustive"]["status"] == "skipped: no time left"


def test_three_files_come_back_with_every_table(full_run):
    done, steps, out = full_run
    assert sorted(os.listdir(out)) == ["console.log", "gpu_check.tar.gz", "summary.txt"]
    summary = _summary(done)
    assert (out / "summary.txt").read_text() == summary and summary in (out / "console.log").read_text()
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        names = set(archive.getnames())
        packed_summary = archive.extractfile("gpu_check/summary.txt").read().decode()
    assert {f"gpu_check/bench/{suite}/bench.csv" for suite in SUITES} <= names
    assert {"gpu_check/smoke/smoke.csv", "gpu_check/steps.tsv", "gpu_check/run.txt", "gpu_check/console.log",
            "gpu_check/pytest_triton.xml", "gpu_check/pytest_cuda.xml", "gpu_check/memory.log"} <= names
    assert packed_summary == summary


def test_the_summary_has_a_row_for_everything(full_run):
    done, steps, out = full_run
    summary = _summary(done)
    for suite in (*SUITES, "experts"):  # experts: the extra moe
        assert re.search(rf"^  {suite} +ok .* cases .* bench/{suite}/bench.md$", summary, re.M), summary
    assert "smoke (bf16, fp16; remat against float64, at most twice PyTorch's error): 2 of 2 ok" in summary
    assert re.search(r"^  triton +ok +116 passed, 0 failed, 4 skipped", summary, re.M)
    assert re.search(r"^  cuda +ok +116 passed, 0 failed, 4 skipped", summary, re.M)
    assert "sanitizer: compute-sanitizer memcheck: exit 0" in summary and "ERROR SUMMARY: 0 errors" in summary
    assert "commit dryrun0" in summary and "device NVIDIA H200" in summary and "triton 3.6.0" in summary
    assert summary.startswith("== summary: ") and "still running" not in summary  # the last one
    pip = [line for line in (out.parent / "dry" / "stub_calls.tsv").read_text().splitlines()
           if line.startswith("python\t-m pip install")]
    assert len(pip) == 2 and all(" --no-index --disable-pip-version-check " in line for line in pip)  # no network


def test_the_note_lists_each_steps_limit_and_modelled_time(full_run):
    """docs/gpu_check.md's tables say what gpu_check.sh's does, and the totals the dry run printed."""
    done, steps, out = full_run
    note = (ROOT / "docs" / "gpu_check.md").read_text()
    for key, (limit, model, name) in _step_table().items():
        if key.startswith(("warm_", "tests_triton", "tests_cuda", "memcheck")):  # background: no limit of its own
            assert re.search(rf"^\| {re.escape(name)} \| [^|]+ \| {model} \|", note, re.M), name
        elif name in ALWAYS_RUN - {"wait for the background work"}:
            assert f"| {name} | {limit} | {model} |" in note, name
        elif key == "reinstall":
            assert f"The reinstall ({limit} s, modelled {model})" in note
        elif key in ("bench_experts", "memory", "tests_rest", "tests_exhaustive", "racecheck"):  # with the time left
            assert re.search(rf"\((limit )?{limit}, (model )?{model}\)", note), key
    wait = steps["wait for the background work"]["seconds"]
    assert f"| wait for the background work | {_step_table()['wait'][0]} | {wait} |" in note
    limits = re.search(r"limits summing to (\d+) s", done.stdout)[1]
    total = re.search(r"the always-run part takes (\d+) s", done.stdout)[1]
    assert f"| **always-run total** | **{limits}** (+{RESERVE}) | **{total}** |" in note


def test_the_unpack_script_puts_the_tables_under_bench_results(full_run, tmp_path):
    done, steps, out = full_run
    results = tmp_path / "results"
    unpack = ["bash", str(ROOT / "scripts" / "unpack_gpu_results.sh"), str(out / "gpu_check.tar.gz"), str(results)]
    unpacked = subprocess.run(unpack, capture_output=True, text=True, timeout=60, env=_environment())
    assert unpacked.returncode == 0, unpacked.stdout + unpacked.stderr
    (folder,) = results.iterdir()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-h200-dryrun0", folder.name), folder.name
    files = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
    assert {f"bench/{suite}/bench.csv" for suite in SUITES} | {"summary.txt", "steps.tsv", "smoke/smoke.csv"} <= files
    assert not any(name.endswith((".log", ".xml")) for name in files)  # the logs stay in the archive
    assert (folder / "summary.txt").read_text() == (out / "summary.txt").read_text()
    again = subprocess.run(unpack, capture_output=True, text=True, timeout=60, env=_environment())
    assert again.returncode == 1 and "already exists" in again.stderr


def test_the_unpack_script_wants_a_known_commit(tmp_path):
    run = tmp_path / "gpu_check"
    (run / "bench" / "gelu").mkdir(parents=True)
    (run / "run.txt").write_text("date=2026-12-01\ncommit=unknown\ngpu=NVIDIA H200\n")
    (run / "bench" / "gelu" / "bench.csv").write_text("op\ngelu\n")
    with tarfile.open(tmp_path / "gpu_check.tar.gz", "w:gz") as archive:
        archive.add(run, arcname="gpu_check")
    unpack = ["bash", str(ROOT / "scripts" / "unpack_gpu_results.sh"), str(tmp_path / "gpu_check.tar.gz"),
              str(tmp_path / "results")]
    refused = subprocess.run(unpack, capture_output=True, text=True, timeout=60, env=_environment())
    assert refused.returncode == 1 and "COMMIT=" in refused.stderr and not (tmp_path / "results").exists()
    named = subprocess.run(unpack, capture_output=True, text=True, timeout=60, env=_environment(COMMIT="abc1234"))
    assert named.returncode == 0, named.stderr
    unpacked = tmp_path / "results" / "2026-12-01-h200-abc1234"
    assert (unpacked / "bench" / "gelu" / "bench.csv").read_text() == "op\ngelu\n"


@pytest.fixture(scope="module")
def troubled_run(tmp_path_factory):
    """A dry run where things go wrong: the build fails, a smoke check is wrong, the attention suite
    runs out of time, pytest has neither pytest-xdist nor pytest-timeout, and the benchmarks wait
    for no background work past the smoke check's limit."""
    return _dry_run(tmp_path_factory.mktemp("troubled"), STUB_BUILD_FAIL="1", STUB_SMOKE_FAIL="1",
                    STUB_TIMEOUT_ON="remat bench attention", STUB_NO_PLUGINS="1", GPU_CHECK_LIMITS="wait=0")


def test_a_failed_build_goes_on_with_triton(troubled_run):
    done, steps, out = troubled_run
    assert done.returncode == 1
    assert steps["build (CUDA extension)"]["status"] == "failed (exit 1)"
    assert "reinstall (Triton only)" not in steps  # pip keeps the Triton-only install when a build fails
    assert steps["tests: cuda"]["status"] == "skipped: no CUDA extension (see the build)"
    assert all(steps[f"bench: {suite}"]["status"] == "ok" for suite in SUITES if suite != "attention")


def test_background_work_still_running_at_its_deadline_is_stopped(troubled_run):
    """memcheck starts at the build's end and runs 50 s by its model: with no wait allowed past the
    smoke check's 40 s limit, it is stopped 10 s after the smoke check (30 s) ended."""
    done, steps, out = troubled_run
    assert steps["background: memcheck"]["status"].startswith("stopped, still running;")
    assert steps["background: memcheck"]["seconds"] == "40"
    assert steps["wait for the background work"]["seconds"] == "10"
    assert all(steps[f"background: {name}"]["status"].startswith("ok;")
               for name in ("warm Triton kernels", "warm torch.compile peers", "tests: triton"))


def test_a_failed_build_that_broke_the_install_reinstalls(tmp_path):
    done, steps, out = _dry_run(tmp_path, STUB_BUILD_FAIL="1", STUB_BROKEN_INSTALL="1")
    assert steps["reinstall (Triton only)"]["part"] == "always"
    calls = (tmp_path / "dry" / "stub_calls.tsv").read_text()
    assert "REMAT_SKIP_CUDA_BUILD=1" in calls.split("TORCH_CUDA_ARCH_LIST")[1]  # the reinstall came after the build


def test_a_suite_out_of_time_keeps_its_row_and_the_others_run(troubled_run):
    done, steps, out = troubled_run
    attention = steps["bench: attention"]
    assert attention["status"] == "timed out" and attention["seconds"] == attention["limit"]  # the clock took it all
    assert re.search(r"^  attention +timed out +1 of 27 +cases", _summary(done), re.M), done.stdout
    assert steps["bench: block"]["status"] == "ok" and re.search(r"^  block +ok", _summary(done), re.M)


def test_failed_smoke_checks_are_listed(troubled_run):
    done, steps, out = troubled_run
    assert steps["smoke"]["status"] == "failed (exit 1)" and done.returncode == 1
    summary = _summary(done)
    assert "1 of 2 ok" in summary
    assert "WRONG: fp16 attention_causal b=8 h=16 s=2048 d=64 remat-triton wrong output: dq error" in summary


def test_without_pytest_plugins_the_tests_still_run(troubled_run):
    done, steps, out = troubled_run
    pytest_calls = [line for line in (out.parent / "dry" / "stub_calls.tsv").read_text().splitlines()
                    if line.startswith("python\t-m pytest")]
    assert {re.search(r"pytest_(\w+)\.xml", call)[1] for call in pytest_calls} == {"triton", "rest"}  # no CUDA build
    assert not any(" -n " in call or "--timeout" in call for call in pytest_calls)
    assert steps["background: tests: triton"]["status"].startswith("ok")


@pytest.mark.parametrize("elapsed, expected", [(0, "85"), (300, "70"), (362, "skipped")])
def test_a_step_never_gets_more_than_the_budget_leaves(tmp_path, elapsed, expected):
    """380 s in all, 10 of them kept for the summaries: a step asking for 85 s at second 300 gets
    70; at second 362 it is skipped (under 10 s left)."""
    script = f"""
        source "{BENCH / 'gpu_check.sh'}"
        cd "{ROOT}"
        STEPS="{tmp_path / 'steps.tsv'}"; OUT_DIR="{tmp_path}"; SUITES=(gelu); PYTHON="{sys.executable}"
        START=0; SECONDS={elapsed}; LIMIT[probe]=85
        run_step probe "{tmp_path / 'probe.log'}" true
        cut -f 2,4 "$STEPS"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=_environment()).stdout
    limit, status = out.strip().splitlines()[-1].split("\t")
    assert (status.startswith("skipped") if expected == "skipped" else (limit, status) == (expected, "ok")), out


def _what_came_back(out):
    """The files in $OUT, checked against what the GPU machine brings back; {name: bytes}."""
    files = {path.name: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert len(files) <= 8 and all(NAME_THAT_COMES_BACK.match(name) for name in files), sorted(files)
    assert {"console.log", "summary.txt"} <= set(files), sorted(files)
    return files


def _archived_steps(files):
    with tarfile.open(fileobj=io.BytesIO(files["gpu_check.tar.gz"])) as archive:
        text = archive.extractfile("gpu_check/steps.tsv").read().decode()
    return [line.split("\t")[0] for line in text.splitlines()[1:]]


@pytest.mark.parametrize("point, last_step", [
    ("summarize", None),  # the first summary, after the first step: nothing packed yet
    ("REMAT_SKIP_CUDA_BUILD=1", "environment"),  # in the install
    ("smoke_check", "build (CUDA extension)"),
    ("remat bench attention", "bench: mlp"),
    ("remat bench experts", "bench: block"),
    ("remat memory", "bench: experts"),
])
def test_killed_at_any_point_at_most_8_files_come_back(tmp_path, point, last_step):
    """SIGKILL of every process of the run in a step (the stubs kill at the command matching
    `point`): what comes back is the console, and the summary and the archive of the steps before
    (the console's last lines may be lost: tee is killed too)."""
    done, steps, out = _dry_run(tmp_path, STUB_KILL_ON=point)
    assert done.returncode == -signal.SIGKILL
    files = _what_came_back(out)
    assert files["console.log"].startswith(b"gpu_check: budget 380 s")
    if last_step is None:
        assert "gpu_check.tar.gz" not in files and files["summary.txt"].startswith(b"gpu_check started")
        return
    assert _archived_steps(files)[-1] == last_step
    assert f"still running, last step ended: {last_step}".encode() in files["summary.txt"]
    assert f"   {last_step}: ok".encode() in files["console.log"]


def test_a_run_stopped_by_sigterm_records_it_before_it_ends(tmp_path):
    done, steps, out = _dry_run(tmp_path, STUB_KILL_ON="remat bench attention", STUB_KILL_SIGNAL="TERM")
    # The shells above the run end at once; the run's own writes its summary and archive first.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        files = _what_came_back(out)
        if _archived_steps(files)[-1] == "interrupted":
            break
        time.sleep(0.1)
    assert _archived_steps(files)[-2:] == ["bench: mlp", "interrupted"]
    assert b"interrupted" in files["summary.txt"]


@pytest.mark.parametrize("delay", [0.2, 0.6])
def test_killed_at_a_moment_at_most_8_files_come_back(tmp_path, delay):
    """Killed wherever it is `delay` s after it started writing (a summary, an archive being packed)."""
    argv, env, out = _dry_run_command(tmp_path)
    run = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "console.log").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had ended already: what came back must hold all the same
            pass
        run.wait(timeout=30)
    files = _what_came_back(out)
    if "gpu_check.tar.gz" in files:  # replaced whole, never half written
        assert _archived_steps(files)


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
    assert re.search(r"layernorm +timed out +1 of 3 +cases +2 rows +1 wrong +0 failed +0 skipped", row), row
    # a peer that cannot run the case (the moe suite's Liger off a GPU) is skipped, not failed
    results[1].check, results[1].error = "-", "Skipped: GPU only: Triton kernels for CUDA tensors, not cpu"
    report.write_tables(report.rows([results]), env, str(tmp_path / "bench" / "layernorm"))
    row = summarize.suite_row(str(tmp_path), "layernorm", {"bench: layernorm": {"status": "ok"}})
    assert re.search(r"2 rows +0 wrong +0 failed +1 skipped", row), row
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


def test_compile_warmer_compiles_each_compiled_peer_of_each_case_apart():
    """bench/warm_compile_cache.py: an item per (suite, compiled implementation, forward + backward
    case), so that the eight FlexAttention graphs (a GPU's attention cases) compile side by side."""
    warmer = _load("warm_compile_cache")
    items = warmer.work_items(SUITES, "bf16", "cpu")
    names = {suite: sorted({name for s, name, _ in items if s == suite}) for suite in SUITES}
    assert names == {"layernorm": ["torch.compile"], "rms_norm": ["torch.compile"], "gelu": ["torch.compile"],
                     "gated": ["torch.compile"], "mlp": ["torch.compile"], "attention": [],
                     "block": ["compile", "compile (each block)", "remat + compile"]}
    assert items[0][0] == "block"  # the longest first
    cases = warmer._cases("attention", "bf16", "cuda")  # listed only: nothing runs
    flex = warmer.work_items(["attention"], "bf16", "cuda")
    assert {name for _, name, _ in flex} == {"flex_attention"}
    assert sorted(cases[index].op for _, _, index in flex) == sorted(
        ["attention"] * 3 + ["attention_causal"] * 3 + ["attention_window", "attention_softcap"])
    assert all(cases[index].mode == "fwd+bwd" for _, _, index in flex)


def test_triton_warmer_runs_every_case_the_smoke_check_and_the_benchmarks_run():
    """bench/warm_triton_cache.py: each forward + backward case of each suite, in each dtype, with
    remat's Triton implementation; every attention tuning candidate in the tuned dtypes only."""
    warmer = _load("warm_triton_cache")
    items = warmer.work_items(SUITES, ["bf16", "fp16"], ["bf16"], "cpu")
    assert {suite for suite, *_ in items} == set(SUITES) and items[0][0] == "attention"
    assert all(every == (dtype == "bf16") for _, dtype, _, every in items)
    cases = {(suite, dtype): warmer._cases(suite, dtype, "cpu") for suite in SUITES for dtype in ("bf16", "fp16")}
    ops = {cases["attention", "bf16"][index].op for suite, dtype, index, _ in items
           if suite == "attention" and dtype == "bf16"}
    assert ops == {"attention", "attention_causal", "attention_window", "attention_softcap", "attention_dropout"}
    for suite, dtype, index, _ in items:
        case = cases[suite, dtype][index]
        impl = warmer.triton_implementation(case)
        assert case.mode == "fwd+bwd" and impl.ours and not impl.compiles and impl.backend != "cuda"


@pytest.mark.filterwarnings(r"ignore:remat\.set_backend\('triton'\):UserWarning")  # no GPU: the interpreter
def test_triton_warmer_runs_its_items_without_an_error(monkeypatch):
    """An item runs its case (here in the interpreter, at the CPU shapes) without an error, so a GPU
    run does not lose its warm-up: attention with a window, and an elementwise op."""
    from remat.triton_kernels import attention

    monkeypatch.setattr(attention, "_TUNER", attention._TUNER)  # warm() replaces it: restored after
    monkeypatch.setenv("REMAT_AUTOTUNE", os.environ.get("REMAT_AUTOTUNE", "0"))  # warm() sets it: restored after
    warmer = _load("warm_triton_cache")
    items = warmer.work_items(["attention", "gelu"], ["fp32"], ["fp32"], "cpu")
    cases = {suite: warmer._cases(suite, "fp32", "cpu") for suite in ("attention", "gelu")}
    window = next(item for item in items if cases[item[0]][item[2]].op == "attention_window")
    gelu = next(item for item in items if item[0] == "gelu")
    for item in (window, gelu):
        line, failed = warmer.warm(item, device="cpu")
        assert failed == [] and line.startswith(f"{item[0]} fp32 {cases[item[0]][item[2]].op} "), line


def test_triton_warmers_tuner_launches_every_candidate_and_keeps_the_table_entry():
    warmer = _load("warm_triton_cache")
    tuner, launched = warmer.LaunchEveryCandidate(), []

    def run(config):
        if config == (64, 64, 4, 3):
            raise RuntimeError("out of resources")
        launched.append(config)

    candidates = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
    assert tuner.best("fwd|d64", candidates, run) == (128, 64, 8, 3)
    assert launched == [(128, 64, 8, 3), (128, 128, 8, 2)] and tuner.launched == 2
    assert tuner.failed == ["fwd|d64 (64, 64, 4, 3): RuntimeError"]


def test_the_smoke_check_covers_every_suite_the_run_benchmarks():
    """Each suite's kernels compile in the smoke step (in parallel), not inside a benchmark's limit."""
    assert set(_load("smoke_check").SUITES) == set(SUITES)


def test_every_benchmark_suite_has_a_step():
    """A suite added to remat.bench has a limit and a model in gpu_check.sh (the run names it), and
    the dry run's stub knows its cases."""
    table = _step_table()
    script = (BENCH / "gpu_check.sh").read_text()
    known = re.search(r'^KNOWN_SUITES=" \$\{ALL_SUITES\[\*\]\} ([\w ]+) "', script, re.M)[1].split()
    default = re.search(r"^ALL_SUITES=\(([\w ]+)\)", script, re.M)[1].split()
    assert tuple(default) == SUITES
    for suite in bench.SUITES:
        assert suite in default + known and f"bench_{suite}" in table, suite
        assert f"[{suite}]=" in (BENCH / "gpu_check_stubs" / "python").read_text(), suite


def test_settings_for_a_targeted_rerun(tmp_path):
    done, steps, out = _dry_run(tmp_path, GPU_CHECK_SUITES="attention", GPU_CHECK_SKIP_BUILD="1",
                                GPU_CHECK_SKIP_SMOKE="1", GPU_CHECK_SKIP_TESTS="1", GPU_CHECK_EXTRAS="",
                                GPU_CHECK_LIMITS="bench_attention=150")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [name for name in steps if name.startswith("bench: ")] == ["bench: attention"]
    assert steps["bench: attention"]["limit"] == "150"
    assert {steps[name]["status"] for name in ("build (CUDA extension)", "smoke", "tests: cuda")} == {
        "skipped: GPU_CHECK_SKIP_BUILD=1", "skipped: GPU_CHECK_SKIP_SMOKE=1", "skipped: GPU_CHECK_SKIP_TESTS=1"}
    assert not any(row["part"] == "extra" for row in steps.values())
    calls = (tmp_path / "dry" / "stub_calls.tsv").read_text()
    assert "-m pytest" not in calls and "TORCH_CUDA_ARCH_LIST" not in calls and "sanitize_check" not in calls
    warmers = [line for line in calls.splitlines() if line.startswith("python\tbench/warm_")]
    assert len(warmers) == 2 and all("--suites attention --" in line or line.endswith("--suites attention")
                                     for line in warmers), warmers
    assert re.search(r"^  attention +ok", _summary(done), re.M) and "  block " not in _summary(done)


def test_moe_names_the_experts_suite_which_runs_once(tmp_path):
    """GPU_CHECK_SUITES takes moe for experts (remat.bench.ALIASES); asked for there, the extra moe
    does not run it again. Liger's fused MoE, a peer of that suite, runs untuned within the budget."""
    done, steps, out = _dry_run(tmp_path, GPU_CHECK_SUITES="moe", GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_SKIP_SMOKE="1",
                                GPU_CHECK_SKIP_TESTS="1", GPU_CHECK_EXTRAS="moe")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [(name, row["part"]) for name, row in steps.items() if name.startswith("bench: ")] == [
        ("bench: experts", "always")]
    calls = (tmp_path / "dry" / "stub_calls.tsv").read_text().splitlines()
    assert [line for line in calls if line.startswith("python\t-m remat bench")] == [
        "python\t-m remat bench experts --quick --dtype bf16 --no-progress --out "
        f"{tmp_path}/dry/gpu_check/bench/experts"]
    assert re.search(r"^  experts +ok", _summary(done), re.M)
    script = (BENCH / "gpu_check.sh").read_text()
    assert re.search(r"^ +export LIGER_FUSED_MOE_AUTOTUNE=\$\{LIGER_FUSED_MOE_AUTOTUNE:-0\}$", script, re.M)


@pytest.mark.parametrize("setting, message", [
    (dict(GPU_CHECK_SUITES="attention nonsense"), "no suite 'nonsense'"),
    (dict(GPU_CHECK_LIMITS="bench_attention=soon"), "'bench_attention=soon' is not KEY=SECONDS"),
    (dict(GPU_CHECK_LIMITS="nonsense=10"), "'nonsense=10' is not KEY=SECONDS"),
    (dict(GPU_CHECK_EXTRAS="memory everything"), "no 'everything'"),
])
def test_wrong_settings_stop_the_run_at_once(tmp_path, setting, message):
    argv, env, out = _dry_run_command(tmp_path, **setting)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "dry" / "gpu_check").exists() and os.listdir(out) == []


def test_the_work_folder_is_never_inside_what_comes_back(tmp_path):
    env = _environment(OUT=str(tmp_path), PATH=f"{BENCH / 'gpu_check_stubs'}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), str(tmp_path / "work")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is inside" in done.stderr and os.listdir(tmp_path) == []


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_results_name_the_commit_of_a_clean_tree(tmp_path):
    """In a git checkout the commit is HEAD's, "-dirty" with changes (REMAT_COMMIT cannot say
    otherwise); in a copy without .git, REMAT_COMMIT's. --command refuses a tree with changes."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("a")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "a")
    head = _git(repo, "rev-parse", "--short=12", "HEAD")

    def sourced(command, **env):
        script = f'source "{BENCH / "gpu_check.sh"}"; cd "{repo}"; {command}'
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                              env=_environment(**env))
        return done.stdout.strip(), done.stderr

    assert sourced("commit_tag") == (head, "")
    assert sourced("print_command")[0] == f"REMAT_COMMIT={head} bash bench/gpu_check.sh"
    tag, warning = sourced("commit_tag", REMAT_COMMIT="0123abcd")
    assert tag == head and "REMAT_COMMIT=0123abcd but this tree is at" in warning
    (repo / "a.txt").write_text("changed")
    assert sourced("commit_tag")[0] == f"{head}-dirty"
    command, error = sourced("print_command")
    assert command == "" and "uncommitted changes" in error and "a.txt" in error
    no_git = dict(GIT_DIR=str(tmp_path / "none"))
    assert sourced("commit_tag", REMAT_COMMIT="0123abcd", **no_git)[0] == "0123abcd"
    tag, warning = sourced("commit_tag", **no_git)
    assert tag == "unknown" and "no git folder and no REMAT_COMMIT" in warning
