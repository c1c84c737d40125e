"""Ahead-of-time compilation of Triton kernels for NVIDIA GPUs, on any machine (no GPU needed).

A kernel module opts in by exposing ``aot_cases()``, a list of dicts, one per launch
configuration its launchers can use::

    {"name": str,                       # unique, for reports
     "kernel": <@triton.jit function>,
     "signature": {arg: "*bf16" | "*fp32" | "i32" | "i64" | "fp32" | "constexpr", ...},
     "constexprs": {arg: value, ...},   # the args marked "constexpr" in the signature
     "num_warps": int,
     "num_stages": int,                 # optional
     "divisible_by_16": [arg, ...],     # optional: args Triton would specialise as 16-divisible
     "archs": (90,)}                    # optional: the only archs it is launched on (None: all)

``compile_module_cases(module_name, archs)`` compiles every case for every arch with
``triton.compile`` (PTX, then a cubin via Triton's bundled ptxas) and reads the cubin's resource
usage with Triton's bundled ``cuobjdump --dump-resource-usage``. LOCAL or STACK bytes > 0 mean
register spills.

The compilation runs in subprocesses with TRITON_INTERPRET removed from their environment:
under the interpreter (tests/conftest.py sets it on machines without a GPU) ``@triton.jit``
returns interpreted functions that ``triton.compile`` cannot lower.

This file is both the importable helper and the worker script the subprocesses run.
"""

import json
import os
import subprocess
import sys
import time

_RESULT_MARK = "TRITON_AOT_RESULTS "


def compile_module_cases(module_name, archs=(80, 90), jobs=None, extra_paths=(), timeout=900):
    """Compile ``module_name.aot_cases()`` for each arch; one result dict per (case, arch).

    Result keys: name, arch, num_warps, regs, local_bytes, stack_bytes, shared_bytes (Triton's
    dynamic shared memory plus the cubin's static), seconds, error (None, or the message).
    ``extra_paths`` are prepended to the workers' import path (after the parent's sys.path, which
    they inherit). The work is split over ``jobs`` worker processes (default: CPU count, max 8).
    Raises RuntimeError if a worker fails before it reports (e.g. the module does not import).
    """
    archs = [int(a) for a in archs]
    jobs = jobs or max(1, min(8, os.cpu_count() or 1))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(p) for p in extra_paths] + [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + env.get("PYTHONPATH", "").split(os.pathsep)))
    base = [sys.executable, os.path.abspath(__file__), module_name, ",".join(map(str, archs))]
    procs = [
        subprocess.Popen(base + [f"{k}/{jobs}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(jobs)
    ]
    results, failures = [], []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"worker timed out after {timeout} s\n{err[-2000:]}")
            continue
        lines = [line for line in out.splitlines() if line.startswith(_RESULT_MARK)]
        if proc.returncode != 0 or not lines:
            failures.append(f"worker exited with {proc.returncode}\n{err[-4000:]}")
            continue
        results += json.loads(lines[-1][len(_RESULT_MARK):])
    if failures:
        raise RuntimeError(f"AOT compilation of {module_name} failed:\n" + "\n".join(failures))
    return sorted(results, key=lambda r: (r["arch"], r["name"]))


def spilling(results):
    """The results that failed to compile or spill registers (local or stack bytes > 0)."""
    return [r for r in results if r["error"] or r["local_bytes"] or r["stack_bytes"]]


def format_results(results):
    """One line per result, for failure messages and logs."""
    lines = []
    for r in results:
        if r["error"]:
            lines.append(f"sm_{r['arch']} {r['name']}: ERROR {r['error']}")
        else:
            lines.append(
                f"sm_{r['arch']} {r['name']}: warps={r['num_warps']} regs={r['regs']} local={r['local_bytes']} "
                f"stack={r['stack_bytes']} shared={r['shared_bytes']} ({r['seconds']:.1f} s)"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess without TRITON_INTERPRET.
# ------------------------------------------------------------------------------------------------
def _cuobjdump():
    import shutil

    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(bundled):
        return bundled
    found = shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("cuobjdump not found (neither bundled with triton nor on PATH)")
    return found


def _resource_usage(cubin, kernel_name):
    """(regs, stack, shared, local) of the kernel in a cubin, from cuobjdump --dump-resource-usage."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    # One "Function <name>:" line followed by "REG:.. STACK:.. SHARED:.. LOCAL:.." per function.
    usage = re.findall(r"Function ([^\s:]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not usage:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{text}")
    chosen = [u for u in usage if u[0] == kernel_name] or usage
    return tuple(int(v) for v in chosen[0][1:])


def _compile_case(case, arch):
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = case["kernel"]
    params = inspect.signature(ASTSource.__init__).parameters
    # The constexpr keyword is "constexprs" in newer Triton, "constants" in older releases.
    const_kw = "constexprs" if "constexprs" in params else "constants"
    kwargs = {const_kw: dict(case.get("constexprs", {}))}
    divisible = case.get("divisible_by_16") or []
    if divisible and "attrs" in params:
        names = list(kernel.arg_names)
        kwargs["attrs"] = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(fn=kernel, signature=dict(case["signature"]), **kwargs)
    options = {"num_warps": int(case["num_warps"])}
    if "num_stages" in case:
        options["num_stages"] = int(case["num_stages"])
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    name = compiled.metadata.name if hasattr(compiled.metadata, "name") else kernel.__name__
    regs, stack, shared, local = _resource_usage(compiled.asm["cubin"], name)
    dynamic_shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    return regs, stack, shared + dynamic_shared, local


def _worker(module_name, archs, shard):
    import importlib

    index, count = (int(v) for v in shard.split("/"))
    module = importlib.import_module(module_name)
    cases = module.aot_cases()
    names = [c["name"] for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{module_name}.aot_cases() has duplicate names")
    work = [(case, arch) for arch in archs for case in cases if arch in (case.get("archs") or archs)]
    results = []
    for case, arch in work[index::count]:
        start = time.perf_counter()
        result = dict(name=case["name"], arch=arch, num_warps=int(case["num_warps"]), regs=None, local_bytes=None,
                      stack_bytes=None, shared_bytes=None, error=None)
        try:
            regs, stack, shared, local = _compile_case(case, arch)
            result.update(regs=regs, stack_bytes=stack, shared_bytes=shared, local_bytes=local)
        except Exception as e:  # reported per case, so one bad case does not hide the others
            result["error"] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
        result["seconds"] = time.perf_counter() - start
        results.append(result)
    print(_RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    # python triton_aot.py MODULE ARCHS SHARD, e.g. remat.triton_kernels.layer_norm 80,90 0/2
    os.environ.pop("TRITON_INTERPRET", None)
    _worker(sys.argv[1], [int(a) for a in sys.argv[2].split(",")], sys.argv[3])
