"""The CUDA sources compile for the GPUs we ship (sm_80, sm_90) without register spills, and
their SASS has the instructions the kernels are written for.

Reads the device code of the built extension (remat._C) when it is newer than every file of csrc/
and holds both architectures of every csrc/*.cu, as the README's install builds it: what ships is
what is checked, and nothing compiles twice. Otherwise runs nvcc on each source standalone with
the flags torch's extension build uses (both architectures in one call). Registers, stack frame
and local memory per kernel come from `cuobjdump --dump-resource-usage` (what `-Xptxas -v`
reports; a spill needs a stack frame). Needs nvcc, not a GPU; skips without it.
"""

import functools
import glob
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from triton_aot import cuda_binary_tool, sass_loops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
CUDA_SOURCES = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
HOST_SOURCES = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
ARCHS = ("80", "90")
COMPILE_TIMEOUT_S = 900


@functools.cache
def find_nvcc():
    """nvcc from CUDA_HOME, torch's CUDA_HOME, or PATH; None when absent."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils import cpp_extension

        homes.append(cpp_extension.CUDA_HOME)
    except Exception:  # torch without CUDA support: PATH is all we have
        pass
    for home in homes:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_home(nvcc):
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def torch_cxx_std():
    """The C++ standard torch's extension builder passes (c++20 on recent torch, else c++17)."""
    from torch.utils import cpp_extension

    return "c++20" if "-std=c++20" in inspect.getsource(cpp_extension) else "c++17"


def include_dirs(nvcc):
    from torch.utils import cpp_extension

    try:
        dirs = cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.6 spelled it include_paths(cuda=True)
        dirs = cpp_extension.include_paths(cuda=True)
    dirs = [d for d in dirs if d != "/usr/local/include"]  # torch adds its guess of CUDA_HOME
    dirs += [sysconfig.get_paths()["include"], os.path.join(cuda_home(nvcc), "include"), CSRC]
    try:  # pip CUDA packages hold headers (cuBLAS, cuSPARSE) that a minimal toolkit lacks
        import nvidia

        for root in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def nvcc_command(nvcc, source, output):
    from torch.utils import cpp_extension

    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    return (
        [nvcc, "-c", source, "-o", output, f"-std={torch_cxx_std()}", "-O3"]
        + gencode
        + list(cpp_extension.COMMON_NVCC_FLAGS)  # -D__CUDA_NO_HALF_OPERATORS__ ..., as the real build
        + ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "--compiler-options", "-fPIC"]
        + [f"-I{d}" for d in include_dirs(nvcc)]
    )


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


@functools.cache
def resource_usage(binary, source=None):
    """{(arch, source file name): {mangled kernel: (registers, stack frame bytes, local bytes)}} of
    the device code in a binary: the extension's shared library, whose code names its source file,
    or SOURCE's object file, whose code does not."""
    text = subprocess.run([cuda_binary_tool("cuobjdump"), "--dump-resource-usage", binary], capture_output=True,
                          text=True, check=True).stdout
    usage, arch, named, kernel = {}, None, None, None
    for line in text.splitlines():
        if line.startswith("Fatbin"):
            named = None
        elif m := re.match(r"arch = sm_(\d+)", line):
            arch = m[1]
        elif m := re.match(r"identifier = (.+)", line):
            named = m[1].strip()
        elif m := re.match(r"\s*Function (\S+):", line):
            kernel = m[1]
        elif m := re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line):
            key = (arch, os.path.basename(named or source or "?"))
            usage.setdefault(key, {})[kernel] = tuple(int(g) for g in m.groups())
    return usage


requires_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (set CUDA_HOME or add it to PATH)")


@functools.cache
def compile_source(source):
    """The object file of one nvcc compile of `source` for ARCHS, shared by the tests."""
    nvcc = find_nvcc()
    output = os.path.join(tempfile.mkdtemp(prefix="remat-nvcc-"), "out.o")
    command = nvcc_command(nvcc, source, output)
    result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"nvcc failed on {os.path.basename(source)}:\n{' '.join(command)}\n{log[-6000:]}"
    return output


@functools.cache
def built_extension():
    """The built extension's shared library when it is newer than every file of csrc/ (not stale)
    and holds code for every ARCHS of every CUDA source, else None."""
    try:
        spec = importlib.util.find_spec("remat._C")
    except ImportError:
        return None
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return None
    if os.path.getmtime(spec.origin) < max(os.path.getmtime(p) for p in glob.glob(os.path.join(CSRC, "*"))):
        return None
    usage = resource_usage(spec.origin)
    has_all = all(usage.get((arch, os.path.basename(s))) for arch in ARCHS for s in CUDA_SOURCES)
    return spec.origin if has_all else None


def binary_of(source):
    """A binary with SOURCE's device code for ARCHS: the built extension, else a compile of SOURCE alone."""
    return built_extension() or compile_source(source)


@requires_nvcc
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=os.path.basename)
def test_compiles_without_spills(source):
    pytest.importorskip("torch")
    name = os.path.basename(source)
    usage = resource_usage(binary_of(source), source)
    for arch in ARCHS:
        assert usage.get((arch, name)), f"no sm_{arch} kernels of {name} in the binary"
    spilling = [(arch, kernel, *counts) for arch in ARCHS for kernel, counts in usage[(arch, name)].items()
                if counts[1] or counts[2]]
    names = demangle(sorted({kernel for _, kernel, *_ in spilling}))
    report = "\n".join(f"  sm_{arch} {names[kernel]}: {regs} registers, {stack} bytes stack frame, {local} bytes local"
                       for arch, kernel, regs, stack, local in spilling)
    assert not spilling, f"register spills (a stack frame or local memory) in {name}:\n{report}"


@functools.cache
def sass_functions(obj, arch):
    """{demangled function name: its SASS} of the sm_<arch> code in a binary."""
    text = subprocess.run([cuda_binary_tool("cuobjdump"), "-sass", "-arch", f"sm_{arch}", obj], capture_output=True,
                          text=True, check=True).stdout
    bodies = dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s+Function : |\Z)", text, flags=re.S))
    names = demangle(sorted(bodies))
    return {names[mangled]: body for mangled, body in bodies.items()}


# A register backward kernel: layer_norm_bwd_kernel<x, parameter, VEC, EPT, warp per row, recompute,
# NormMode<RMSNorm?, y's type (dy's too), xhat's rounding> >.
BACKWARD_KERNEL = re.compile(r"layer_norm_bwd_kernel<(?P<x>[\w:]+), [\w:]+, (?P<vec>\d+), \d+, \w+, \w+, "
                             r"[\w:() ]*NormMode<\w+, (?P<y>[\w:]+), ")
PACK_ELEMENTS = {"float": "4", "c10::Half": "8", "c10::BFloat16": "8"}  # 16 bytes of x


def prefetches_rows(name):
    """The register backward kernels that prefetch: vectorised rows (16-byte packs of x) whose dy
    has x's type (cp.async copies one 16-byte chunk of each)."""
    m = BACKWARD_KERNEL.search(name)
    return bool(m) and m["vec"] == PACK_ELEMENTS[m["x"]] and m["y"] == m["x"]


@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_layer_norm_backward_loads_the_next_row_before_its_reductions(arch):
    """In each register backward kernel on vectorised rows whose dy has x's type: the row loop
    issues cp.async copies (LDGSTS) of the next row before this row's first warp shuffle, and the
    wait before that shuffle leaves one copy group in flight (DEPBAR.LE SB0, 0x1): the next row's
    loads overlap this row's reductions."""
    # The kernels are norm_kernels.cuh's, instantiated by both ops' sources (one binary when built).
    objs = {binary_of(os.path.join(CSRC, source)) for source in ("layer_norm.cu", "rms_norm.cu")}
    kernels = {name: body for obj in objs for name, body in sass_functions(obj, arch).items() if prefetches_rows(name)}
    # (5 LayerNorm (x, parameter) dtype pairs + 7 RMSNorm modes with y in x's dtype: 1 for fp32 x,
    # 3 for each 16-bit x) x 4 (elements a thread, warp or block per row) x recompute or not
    assert len(kernels) == (5 + 7) * 4 * 2, sorted(kernels)
    for name, body in kernels.items():
        (loop,) = [loop for loop in sass_loops(body) if any(t.startswith("SHFL.BFLY") for t in loop)]
        first_shuffle = next(i for i, t in enumerate(loop) if t.startswith("SHFL.BFLY"))
        before = loop[:first_shuffle]
        assert any(t.startswith("LDGSTS") for t in before), f"{name}: no cp.async before the reductions"
        waits = [t for t in before if t.startswith("DEPBAR.LE SB0")]
        assert waits and waits[-1] == "DEPBAR.LE SB0, 0x1", f"{name}: waits {waits}"


# A gated kernel: gated_{fwd,bwd}_kernel<T, VEC, ...>.
GATED_KERNEL = re.compile(r"gated_(fwd|bwd)_kernel<(?P<t>[\w:]+), (?P<vec>\d+), ")


@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_gated_kernels_on_aligned_rows_access_memory_in_16_byte_packs(arch):
    """Every global load and store of the gated kernels compiled for 16-byte packs (VEC 8 for
    16-bit types, 4 for fp32) is one 16-byte access: gate, up and dy in, y, d_gate and d_up out."""
    obj = binary_of(os.path.join(CSRC, "gated.cu"))
    packed = {}
    for name, body in sass_functions(obj, arch).items():
        m = GATED_KERNEL.search(name)
        if m and m["vec"] == PACK_ELEMENTS[m["t"]]:
            packed[name] = body
    # 3 dtypes x 3 activations x round_activation or not, forward + backward (recompute or not)
    assert len(packed) == 3 * 3 * 2 * 3, sorted(packed)
    for name, body in packed.items():
        accesses = re.findall(r"\b(?:LDG|STG)\.E[.\w]*", body)
        assert accesses and all(".128" in a for a in accesses), f"{name}: {sorted(set(accesses))}"


# An attention kernel of csrc/attention_kernels.cuh: attention_{fwd,dkdv,dq}_kernel<T, padded head dim>.
ATTENTION_KERNEL = re.compile(r"attention_(fwd|dkdv|dq)_kernel<")


@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_kernels_multiply_on_tensor_cores(arch):
    """Every attention kernel's products are m16n8k16 tensor-core instructions (HMMA.16816 with
    fp32 accumulators), fed by ldmatrix (LDSM) from shared memory that cp.async (LDGSTS) filled."""
    obj = binary_of(os.path.join(CSRC, "attention.cu"))
    kernels = {name: body for name, body in sass_functions(obj, arch).items() if ATTENTION_KERNEL.search(name)}
    assert len(kernels) == 3 * 2 * 5, sorted(kernels)  # 3 kernels x fp16/bf16 x head dims 32, 64, 96, 128, 256
    for name, body in kernels.items():
        assert re.search(r"\bHMMA\.16816\.F32", body), f"{name}: no m16n8k16 HMMA"
        assert re.search(r"\bLDSM\.16\.M88\.4\b", body) and re.search(r"\bLDSM\.16\.MT88\.4\b", body), \
            f"{name}: no ldmatrix x4 and x4.trans"
        assert re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", body), f"{name}: no 16-byte cp.async"


@requires_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_the_one_pass_backward_adds_dq_by_reductions(arch):
    """The dK/dV kernels add dQ by fp32 reductions to global memory (RED: no value comes back to
    wait for), two columns in one on sm_90 (F32x2); no other attention kernel has an atomic."""
    obj = binary_of(os.path.join(CSRC, "attention.cu"))
    kernels = {name: body for name, body in sass_functions(obj, arch).items() if ATTENTION_KERNEL.search(name)}
    width = "F32x2" if int(arch) >= 90 else "F32"
    for name, body in kernels.items():
        reductions = set(re.findall(r"\bREDG?\.E\.ADD\.(F32\w*)", body))
        assert not re.search(r"\bATOMG?\.", body), f"{name}: an atomic that returns its value"
        assert reductions == ({width} if "dkdv" in name else set()), f"{name}: {sorted(reductions)}"


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
@pytest.mark.parametrize("source", HOST_SOURCES, ids=os.path.basename)
def test_host_sources_compile(source):
    """csrc/*.cpp (the module init) passes the host compiler."""
    torch = pytest.importorskip("torch")
    from torch.utils import cpp_extension

    try:
        dirs = cpp_extension.include_paths()
    except TypeError:
        dirs = cpp_extension.include_paths(cuda=False)
    dirs = list(dirs) + [sysconfig.get_paths()["include"], CSRC]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    command = (
        [shutil.which("c++"), "-fsyntax-only", f"-std={torch_cxx_std()}", "-DTORCH_EXTENSION_NAME=_C",
         "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", source]
        + [f"-I{d}" for d in dirs]
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert result.returncode == 0, f"{os.path.basename(source)} failed to compile:\n{result.stderr[-6000:]}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
