"""The `remat` command answers fast: `--help` and a mistyped argument before torch is imported,
`remat info` without the kernels, and `import remat` without the planner (torch's compiler stack).
Its argument checks repeat, torch-free, lists the package holds: they are held equal here."""

import os
import subprocess
import sys

import pytest

from remat import bench, cli, memory
from remat.planner import DEVICES
from remat.planner.command import parse_bytes

COMMAND = os.path.join(os.path.dirname(sys.executable), "remat")  # pip's launcher, in the venv's bin


def _imports(*arguments):
    """(exit status, stdout, stderr, the modules imported) of the `remat` command with `arguments`."""
    if not os.path.exists(COMMAND):
        pytest.skip("the remat command is not installed beside this Python (pip install -e .)")
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # -X importtime: one stderr line per module imported
    done = subprocess.run([COMMAND, *arguments], capture_output=True, text=True, env=env, timeout=120)
    modules = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    errors = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return done.returncode, done.stdout, errors, modules


def test_help_and_a_mistyped_argument_answer_before_torch_is_imported():
    status, out, _, modules = _imports("--help")
    assert status == 0 and "remat bench" in out and "torch" not in modules and "remat.cli" in modules
    status, out, _, modules = _imports("bench", "--help")
    assert status == 0 and "widths N" in out and "torch" not in modules
    for arguments, message in [(("memory", "--model", "llama-3-8"), "argument --model: model must be one of"),
                               (("bench", "layernorms"), "invalid choice: 'layernorms'"),
                               (("plan", "--budget", "12 gigs"), "argument --budget: budget must be bytes")]:
        status, _, errors, modules = _imports(*arguments)
        assert status == 2 and message in errors and "torch" not in modules, (arguments, errors)


def test_info_imports_the_backends_alone():
    status, out, _, modules = _imports("info")
    assert status == 0 and out.splitlines()[1].startswith("cuda ")
    assert "remat._backend" in modules and "torch" in modules
    assert not {"remat.ops", "remat.nn", "remat.convert", "remat.planner", "transformers"} & modules


def test_import_remat_leaves_the_planner_until_it_is_used():
    code = ("import sys, remat; before = 'remat.planner' in sys.modules; "
            "names = (remat.plan.__name__, remat.Plan.__name__, remat.calibrate.__name__, remat.convert.__name__); "
            "print(before, 'remat.planner' in sys.modules, *names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "True", "plan", "Plan", "calibrate", "convert"]


def test_the_library_never_imports_the_command_line():
    """The command line imports the library, never the reverse: remat, its memory counts, its planner
    and its benchmarks import without remat.cli."""
    code = ("import sys, remat, remat.memory, remat.planner.command, remat.bench.without_gpu; "
            "print('remat.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False"]


def test_import_remat_leaves_torch_s_compiler_stack_alone_without_cuda():
    """torch._dynamo alone takes seconds to import: `import remat` (its ops, nn and convert) pays for
    it only where CUDA is available, for the capability check torch.compile must see as a constant."""
    code = ("import sys, torch, remat.ops, remat.nn, remat.convert; "
            "print(torch.cuda.is_available(), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    cuda, dynamo = out.split()
    assert dynamo == cuda


def test_the_commands_lists_are_the_packages():
    assert cli.SUITES == {name: suite.SIZES_MEAN for name, suite in bench.SUITES.items()}
    assert cli.SUITE_ALIASES == bench.ALIASES and set(bench.ALIASES.values()) <= set(bench.SUITES)
    assert cli.MODEL_NAMES == memory.model_names()
    assert cli.HUB_ID.pattern == memory.HUB_ID.pattern  # what --model takes for a Hugging Face model id
    assert set(cli.GPUS) == set(DEVICES) - {"cpu"}


@pytest.mark.parametrize("text", ["12GiB", "500MB", "1.5 gib", "1000000", " 7 kB ", "3B", "12 gigs", "GiB", "1e9",
                                  "5iB", "-3MB", "2 PB"])
def test_the_budget_syntax_is_what_remat_plan_reads(text):
    try:
        parse_bytes(text)
        accepted = True
    except ValueError:
        accepted = False
    assert (cli._BYTES.fullmatch(text) is not None) == accepted
