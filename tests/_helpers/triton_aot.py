"""Ahead-of-time compilation of Triton kernels for NVIDIA GPUs, on any machine (no GPU needed).

A kernel module opts in by exposing ``aot_cases()``, a list of dicts, one per launch to check::

    {"name": str,           # unique, for reports
     "launch": callable,    # no arguments: calls the module's launcher(s) on CPU tensors shaped
                            # like a real call (it allocates them itself, so listing is cheap)
     "archs": (90,)}        # optional: the only archs it is launched on (None: all)

``compile_module_cases(spec, archs)`` runs each case's ``launch`` in worker processes where every
Triton kernel launch compiles for the target GPU instead of running. The compile goes through
Triton's own launch path (``JITFunction.run`` in warmup mode) with a stand-in driver that names
the target: Triton binds the launcher's real arguments and specialises them as it would on that
GPU (integers equal to 1 or divisible by 16, 16-byte aligned pointers, the pointer dtypes, the
launch options), so the variant compiled is the one a GPU would run for those arguments, and no
signature is typed by hand. Triton's bundled ``cuobjdump --dump-resource-usage`` then reads each
cubin's registers, shared memory and LOCAL/STACK bytes (> 0: register spills); ``failing`` also flags
shared memory beyond what a block may use on the arch.

The workers run without TRITON_INTERPRET: under the interpreter (tests/conftest.py sets it on
machines without a GPU) ``@triton.jit`` returns interpreted functions that cannot be compiled.
CPU tensors stand in for CUDA ones: their allocations are 64-byte aligned, as the CUDA caching
allocator's are at least 16-byte aligned, so pointers specialise the same way.

This file is both the importable helper and the worker script the subprocesses run.
"""

import contextlib
import json
import os
import subprocess
import sys
import time

_RESULT_MARK = "TRITON_AOT_RESULTS "


def compile_module_cases(spec, archs=(80, 90), jobs=None, extra_paths=(), timeout=900, sass=False):
    """Compile the kernels launched by each case of ``spec`` for each arch; one result per launch.

    spec: "module" (its aot_cases()), "module:function" (that function's cases) or
    "module:function:argument" (the cases of function(argument)).
    Result keys: name ("<case> <kernel>"), case, kernel, arch, num_warps, num_stages, regs,
    local_bytes, stack_bytes, shared_bytes (Triton's dynamic shared memory plus the cubin's
    static), seconds, error (None, or the message), and with sass=True the kernel's SASS text.
    A case that fails before launching anything gives one result with kernel None and the error.
    ``extra_paths`` are prepended to the workers' import path (after the parent's sys.path, which
    they inherit). The work is split over ``jobs`` worker processes (default: CPU count, max 8).
    Raises RuntimeError if a worker fails before it reports (e.g. the module does not import).
    """
    archs = [int(a) for a in archs]
    jobs = jobs or max(1, min(8, os.cpu_count() or 1))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(p) for p in extra_paths] + [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + env.get("PYTHONPATH", "").split(os.pathsep)))
    base = [sys.executable, os.path.abspath(__file__), spec, ",".join(map(str, archs)), str(int(sass))]
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
        raise RuntimeError(f"AOT compilation of {spec} failed:\n" + "\n".join(failures))
    return sorted(results, key=lambda r: (r["arch"], r["name"]))


# Shared memory one block may use (the opt-in maximum): sm_80 163 KiB, sm_90 227 KiB. A kernel
# above it compiles but fails at launch.
MAX_SHARED_BYTES = {80: 166912, 90: 232448}


def failing(results):
    """The results that failed to compile, spill registers (local or stack bytes > 0), or need more
    shared memory than a block may have on their arch."""
    return [r for r in results if r["error"] or r["local_bytes"] or r["stack_bytes"]
            or r["shared_bytes"] > MAX_SHARED_BYTES.get(r["arch"], r["shared_bytes"])]


def sass_loops(sass):
    """The loops of a kernel's SASS (cuobjdump -sass text): for each backward branch whose range
    holds no EXIT, the instructions from its target to the branch, in order, without addresses
    or encodings. (A backward branch over an EXIT is no loop: it returns from out-of-line code
    placed after the kernel's end, such as the divergent-warp path of a shuffle.)"""
    import re

    code = [(int(addr, 16), text.strip()) for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in code:
        branch = re.match(r"(@!?U?P\d+\s+)?BRA\s+(0x[0-9a-f]+)", text)
        if branch and int(branch.group(2), 16) <= addr:
            body = [t for a, t in code if int(branch.group(2), 16) <= a <= addr]
            if not any(re.search(r"\bEXIT\b", t) for t in body):
                loops.append(body)
    return loops


def format_results(results):
    """One line per result, for failure messages and logs."""
    lines = []
    for r in results:
        if r["error"]:
            lines.append(f"sm_{r['arch']} {r['name']}: ERROR {r['error']}")
        else:
            lines.append(
                f"sm_{r['arch']} {r['name']}: warps={r['num_warps']} stages={r['num_stages']} regs={r['regs']} "
                f"local={r['local_bytes']} stack={r['stack_bytes']} shared={r['shared_bytes']} ({r['seconds']:.1f} s)"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess without TRITON_INTERPRET.
# ------------------------------------------------------------------------------------------------
def cuda_binary_tool(name):
    """A CUDA binary tool bundled with Triton (cuobjdump, nvdisasm), else the one on PATH."""
    import shutil

    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(bundled):
        return bundled
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found (neither bundled with triton nor on PATH)")
    return found


def _cuobjdump(cubin, *flags):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([cuda_binary_tool("cuobjdump"), *flags, path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


def _resource_usage(cubin, kernel_name):
    """(regs, stack, shared, local) of the kernel in a cubin, from cuobjdump --dump-resource-usage."""
    import re

    text = _cuobjdump(cubin, "--dump-resource-usage")
    # One "Function <name>:" line followed by "REG:.. STACK:.. SHARED:.. LOCAL:.." per function.
    usage = re.findall(r"Function ([^\s:]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not usage:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{text}")
    chosen = [u for u in usage if u[0] == kernel_name] or usage
    return tuple(int(v) for v in chosen[0][1:])


class _TargetOnlyDriver:
    """Stands in for Triton's CUDA driver where there is no GPU: names the target to compile for.

    Triton's launch path asks the active driver for the current device (a key of its per-device
    kernel caches: the arch, so each arch gets its own), the stream and the target; nothing else
    is asked before a warmup launch returns the compiled kernel.
    """

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _launches_compile_for(arch, compiled):
    """Within: every Triton kernel launch compiles for sm_<arch> and appends (kernel, compiled
    kernel) to `compiled` instead of running (JITFunction.run with warmup=True)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self, kernel))
        return kernel

    driver.set_active(_TargetOnlyDriver(arch))  # never reset: this process has no GPU driver to go back to
    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = run


def _metadata(kernel, field, default=None):
    value = getattr(kernel.metadata, field, default)
    return default if value is None else value


def _run_case(case, arch, want_sass):
    """The results of one case on one arch: one per kernel launch (one with the error if the
    launcher fails)."""
    base = dict(case=case["name"], arch=arch, kernel=None, num_warps=None, num_stages=None, regs=None,
                local_bytes=None, stack_bytes=None, shared_bytes=None, error=None)
    compiled = []
    start = time.perf_counter()
    try:
        with _launches_compile_for(arch, compiled):
            case["launch"]()
        if not compiled:
            raise RuntimeError("the case launched no Triton kernel")
    except Exception as e:  # reported per case, so one bad case does not hide the others
        error = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
        return [dict(base, name=f"{case['name']} (launch)", error=error, seconds=time.perf_counter() - start)]
    base["seconds"] = time.perf_counter() - start  # the whole case: its kernels compile during the launch
    results = []
    for jit_function, kernel in compiled:
        name = jit_function.fn.__name__
        result = dict(base, name=f"{case['name']} {name}", kernel=name, num_warps=_metadata(kernel, "num_warps"),
                      num_stages=_metadata(kernel, "num_stages"))
        try:
            cubin = kernel.asm["cubin"]
            regs, stack, shared, local = _resource_usage(cubin, _metadata(kernel, "name", name))
            result.update(regs=regs, stack_bytes=stack, local_bytes=local,
                          shared_bytes=shared + int(_metadata(kernel, "shared", 0)))
            if want_sass:
                result["sass"] = _cuobjdump(cubin, "-sass")
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"
        results.append(result)
    return results


def _load_cases(spec):
    import importlib

    module_name, function, *argument = spec.split(":", 2) if ":" in spec else (spec, "aot_cases")
    cases = getattr(importlib.import_module(module_name), function)(*argument)
    names = [c["name"] for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{spec} has duplicate case names")
    return cases


def _worker(spec, archs, want_sass, shard):
    index, count = (int(v) for v in shard.split("/"))
    cases = _load_cases(spec)
    work = [(case, arch) for arch in archs for case in cases if arch in (case.get("archs") or archs)]
    results = []
    for case, arch in work[index::count]:
        results += _run_case(case, arch, want_sass)
    print(_RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    # python triton_aot.py SPEC ARCHS SASS SHARD, e.g. remat.triton_kernels.layer_norm 80,90 0 0/2
    os.environ.pop("TRITON_INTERPRET", None)
    _worker(sys.argv[1], [int(a) for a in sys.argv[2].split(",")], sys.argv[3] == "1", sys.argv[4])
