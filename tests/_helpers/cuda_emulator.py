"""Builds CUDA kernel sources for the CPU warp emulator and loads them with ctypes (no GPU needed).

``build_emulated(sources, name)`` compiles C++ files that include the kernels (with
REMAT_WARP_EMULATOR defined, csrc/tensor_core.cuh takes its primitives from
tests/cuda_emulator/warp_emulator.h) into a shared library, cached under the temp folder by a hash
of the sources, the headers beside them and the flags. A test that needs it is skipped, with the
reason, only when g++ or the CUDA headers (cuda_fp16.h, cuda_bf16.h, vector_types.h) are absent;
a compile error fails it.

``emulated_attention_fwd`` / ``emulated_attention_bwd`` run csrc/attention_kernels.cuh's forward
and backward on CPU tensors through tests/cuda_emulator/attention_harness.cpp.
"""

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")
EMULATOR = os.path.join(ROOT, "tests", "cuda_emulator")
CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "vector_types.h")
# The half/bfloat16 operator switches of torch's extension build (cpp_extension.COMMON_NVCC_FLAGS),
# so that a kernel that builds here also builds there.
TORCH_HALF_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")
ERROR_BYTES = 4096


@functools.cache
def cuda_include_dir():
    """A folder holding the CUDA headers the kernels include on the host, or None."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # resolves wrapper scripts only as far as links go; /usr/local/cuda covers the rest
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates = [os.path.join(home, "include") for home in homes if home]
    try:  # torch's CUDA wheels bring the runtime headers as pip packages (nvidia/cu13/include, ...)
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    for folder in candidates:
        if all(os.path.exists(os.path.join(folder, header)) for header in CUDA_HEADERS):
            return folder
    return None


def _compile_command(sources, flags, output, cuda_include):
    return (["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-DREMAT_WARP_EMULATOR",
             *TORCH_HALF_FLAGS, *flags, "-I", CSRC, "-I", EMULATOR, "-I", cuda_include]
            + list(sources) + ["-o", output])


def _digest(sources, command):
    """Hash of the command, the sources and every header of csrc/ and tests/cuda_emulator/."""
    headers = sorted(glob.glob(os.path.join(CSRC, "*.cuh")) + glob.glob(os.path.join(CSRC, "*.h"))
                     + glob.glob(os.path.join(EMULATOR, "*.h")))
    digest = hashlib.sha256("\0".join(command).encode())
    for path in list(sources) + headers:
        with open(path, "rb") as handle:
            digest.update(path.encode() + b"\0" + handle.read())
    return digest.hexdigest()[:20]


def build_emulated(sources, name, flags=()):
    """ctypes.CDLL of SOURCES (file names in tests/cuda_emulator/ or paths) built for the emulator,
    with the extra compiler FLAGS.

    Skips the calling test when g++ or the CUDA headers are absent; raises RuntimeError with the
    compiler's output when the build fails.
    """
    if isinstance(sources, str):
        sources = (sources,)
    return _build(tuple(s if os.path.isabs(s) else os.path.join(EMULATOR, s) for s in sources), name, tuple(flags))


@functools.cache
def _build(sources, name, flags):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the CUDA warp emulator builds the kernels with it")
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        pytest.skip(f"no CUDA headers ({', '.join(CUDA_HEADERS)}) under CUDA_HOME, CUDA_PATH, "
                    "/usr/local/cuda, nvcc's toolkit or the pip nvidia packages")
    cache = os.path.join(tempfile.gettempdir(), "remat-cuda-emulator")
    os.makedirs(cache, exist_ok=True)
    digest = _digest(sources, _compile_command(sources, flags, "", cuda_include))
    library = os.path.join(cache, f"{name}-{digest}.so")
    if not os.path.exists(library):
        partial = f"{library}.{os.getpid()}.tmp"  # a parallel build of the same sources replaces it whole
        done = subprocess.run(_compile_command(sources, flags, partial, cuda_include), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {name} for the warp emulator failed:\n{done.stderr[-8000:]}")
        os.replace(partial, library)
    return ctypes.CDLL(library)


def error_buffer():
    return ctypes.create_string_buffer(ERROR_BYTES)


def check(status, error, what):
    """Raises RuntimeError with the emulator's message when a C entry point returned nonzero."""
    if status != 0:
        raise RuntimeError(f"{what}: {error.value.decode(errors='replace')}")
