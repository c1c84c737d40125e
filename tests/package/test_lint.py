"""The tree is clean under the project's ruff configuration (pyproject.toml), with the pinned ruff."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True)
    assert "No module named ruff" not in run.stderr, "ruff is a test dependency: pip install -e '.[test]'"
    assert run.returncode == 0, run.stdout + run.stderr
