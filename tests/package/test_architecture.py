"""The package's shape: no import cycles between remat's modules (imports inside functions count:
a lazy import only hides a cycle), and the Triton kernels depend on nothing of remat's."""

import ast
import fnmatch
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "remat"
KERNELS = ROOT / "triton_kernels"


def module_name(path, root, package):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def imported_modules(path, name, known):
    """The modules of `known` that the file at `path` (module `name`) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".")
            if node.level:
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # the deepest module of the package that the import names
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root, package):
    files = {module_name(p, root, package): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, name, files) for name, path in files.items()}


def find_cycle(graph):
    """A list of modules forming an import cycle, or None."""
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
            if nxt not in state:
                cycle = visit(nxt, trail + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_no_import_cycles_in_remat():
    graph = import_graph(PACKAGE, "remat")
    # A package imports its own submodules to re-export them; a submodule importing its package's
    # __init__ back is what makes a cycle, and is reported as one.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_kernels_import_nothing_of_remat():
    for path in KERNELS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            assert not any(n == "remat" or n.startswith("remat.") for n in names), f"{path.name} imports {names}"


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_wheel_holds_every_package(tmp_path):
    """`pip install .` (not -e) installs what setup.py lists: a package folder left out of it installs
    without error and fails at its first import (remat.planner once did)."""
    source = tmp_path / "source"
    skipped = shutil.ignore_patterns("__pycache__", "*.so", "triton_kernels")  # a link to the kernels, in a tree
    for name in ("python", "triton_kernels", "csrc"):
        shutil.copytree(ROOT / name, source / name, ignore=skipped)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env = {**os.environ, "REMAT_SKIP_CUDA_BUILD": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, env=env, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    held = {name.rpartition("/")[0] for name in zipfile.ZipFile(wheel).namelist() if name.endswith("__init__.py")}
    folders = {"remat/" + str(p.parent.relative_to(PACKAGE)) if p.parent != PACKAGE else "remat"
               for p in PACKAGE.rglob("__init__.py")}
    assert folders | {"remat/triton_kernels"} <= held, sorted(folders - held)


def test_no_module_of_the_package_is_over_800_lines():
    """A module a reader cannot hold at once is two modules (the Triton kernels' files are not held to it)."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if not p.is_relative_to(PACKAGE / "triton_kernels") and (n := len(p.read_text().splitlines())) > 800}
    assert long == {}


def test_pytest_collects_every_test_folder(request):
    """No folder of tests is one pytest's norecursedirs passes over without a word (this folder was
    tests/build, and pytest's default skips "build": its tests ran in no suite for five days)."""
    patterns = request.config.getini("norecursedirs")
    folders = {p.parent for p in (ROOT / "tests").rglob("test_*.py")}
    skipped = [str(f.relative_to(ROOT)) for f in folders
               if any(fnmatch.fnmatch(part, pattern) for part in f.relative_to(ROOT).parts for pattern in patterns)]
    assert skipped == []
