"""Ahead-of-time compilation of the Triton kernels for sm_80 and sm_90, on any machine.

Catches what the interpreter accepts but the GPU compiler rejects, and register spills, for
every launch configuration the launchers can use (each module's aot_cases()).
"""

import importlib
import os

import pytest

pytest.importorskip("triton")

try:  # tests/ on sys.path (pytest's default rootdir-relative import)
    from triton_aot import compile_module_cases, format_results, spilling
except ImportError:  # tests/ imported as a package
    from tests.triton_aot import compile_module_cases, format_results, spilling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_name(family):
    """The installed module (after `pip install -e .`), else the in-tree triton_kernels/ package,
    so the test also runs from a plain checkout."""
    try:
        importlib.import_module(f"remat.triton_kernels.{family}")
        return f"remat.triton_kernels.{family}"
    except ImportError:
        return f"triton_kernels.{family}"


# Every Triton op family; attention's cases are compiled in tests/test_attention.py.
FAMILIES = ["layer_norm", "gelu"]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiles_without_spills(family, arch):
    results = compile_module_cases(_module_name(family), archs=(arch,), extra_paths=[REPO])
    assert results, "aot_cases() returned no cases"
    bad = spilling(results)
    assert not bad, f"{len(bad)} of {len(results)} {family} kernels fail to compile or spill on sm_{arch}:\n" + format_results(bad)
