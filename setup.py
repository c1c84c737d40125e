"""Build remat, and its CUDA extension remat._C when a CUDA build of torch and nvcc are present.

Environment variables:
  TORCH_CUDA_ARCH_LIST   GPU targets, default "8.0;9.0+PTX" (sm_80, sm_90, PTX for the newest)
  REMAT_SKIP_CUDA_BUILD  "1" installs without the CUDA extension (Triton kernels still work)
  MAX_JOBS               parallel compile jobs (read by torch's BuildExtension through ninja)
  CUDA_HOME              the CUDA toolkit; found from nvcc on PATH when unset

Nothing is downloaded: the extension builds against the torch already installed, so
install with `pip install --no-build-isolation .` (or `-e .`).
"""

import glob
import os
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"

PACKAGE_DIR = {"remat": "python/remat", "remat.triton_kernels": "triton_kernels"}


def packages():
    """remat and every package below it (a folder with an __init__.py), found rather than listed: a
    package missing from a list installs without error and fails at its first import."""
    root = os.path.join(HERE, PACKAGE_DIR["remat"])
    found = ["remat", "remat.triton_kernels"]
    for folder, _, files in sorted(os.walk(root)):
        if folder != root and "__init__.py" in files and "__pycache__" not in folder:
            found.append("remat." + os.path.relpath(folder, root).replace(os.sep, "."))
    return found


PACKAGES = packages()


def say(message):
    print(f"remat setup: {message}", file=sys.stderr)


def find_cuda_home():
    """The toolkit folder, resolving wrapper scripts such as /usr/local/bin/nvcc."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def pip_cuda_include_dirs():
    """Headers of the pip-installed CUDA libraries torch depends on (nvidia/cu13/include, ...).

    A minimal CUDA toolkit lacks cusparse.h and the cuBLAS headers that torch's own headers
    include; torch's CUDA wheels bring them as pip packages under site-packages/nvidia/. They are
    searched after the toolkit's own include folder (cuda_extension): the wheels may hold a newer
    CUDA's runtime headers (torch 2.15's cu132 wheels hold CUDA 13.2's), which nvcc's own CCCL
    headers refuse beside an older nvcc ("CUDA compiler and CUDA toolkit headers are incompatible").
    """
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for root in nvidia.__path__:
        found += sorted(glob.glob(os.path.join(root, "cu*", "include")))
        found += sorted(glob.glob(os.path.join(root, "*", "include")))
    return list(dict.fromkeys(d for d in found if os.path.isdir(d)))


def cuda_extension():
    """The CUDAExtension for remat._C, or None with the reason printed."""
    if os.environ.get("REMAT_SKIP_CUDA_BUILD", "0") == "1":
        say("CUDA backend skipped (REMAT_SKIP_CUDA_BUILD=1); the Triton kernels are still installed")
        return None, None
    try:
        import torch
    except ImportError:
        say("CUDA backend skipped (torch is not importable: install torch first, "
            "then pip install --no-build-isolation .)")
        return None, None
    if torch.version.cuda is None:
        say(f"CUDA backend skipped (torch {torch.__version__} is not a CUDA build)")
        return None, None
    cuda_home = find_cuda_home()
    if cuda_home is None:
        say("CUDA backend skipped (nvcc not found: set CUDA_HOME or put nvcc on PATH)")
        return None, None
    os.environ["CUDA_HOME"] = cuda_home  # read when cpp_extension is imported
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # Every source in csrc/: an op family's .cu registers its own ops, so a new one needs no edit here.
    sources = sorted(glob.glob("csrc/*.cpp", root_dir=HERE)) + sorted(glob.glob("csrc/*.cu", root_dir=HERE))
    extension = CUDAExtension(
        name="remat._C",
        sources=sources,
        # the toolkit's headers first, the pip packages' only for what it lacks (pip_cuda_include_dirs)
        include_dirs=[os.path.join(HERE, "csrc"), os.path.join(cuda_home, "include")] + pip_cuda_include_dirs(),
        extra_compile_args={
            "cxx": ["-O3"],
            # --threads 0: nvcc compiles each TORCH_CUDA_ARCH_LIST target of a source file in parallel (one
            # thread per core) instead of one after the other; rms_norm.cu, the longest, sets the build time.
            "nvcc": ["-O3", "-lineinfo", "--threads", "0"],
        },
    )
    say(f"building the CUDA extension for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} "
        f"with {cuda_home}/bin/nvcc")
    return extension, BuildExtension.with_options(no_python_abi_suffix=False)


extension, build_ext = cuda_extension()

setup(
    package_dir=PACKAGE_DIR,
    packages=PACKAGES,
    ext_modules=[extension] if extension else [],
    cmdclass={"build_ext": build_ext} if build_ext else {},
)
