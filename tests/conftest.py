"""Test set-up: without a GPU, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before anything imports triton (its @triton.jit decides at
decoration time), so this runs first, before the tests import remat.
"""

import os
import sys
import tempfile
import warnings
import zlib

import torch

# The tests' shared helpers (numerics, hf_models, triton_aot) are imported by name from every folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_helpers"))

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A fresh torch.compile cache per run: Inductor's on-disk cache is keyed on the graph, not on
# the Python source of our fake kernels, so a cache from an older checkout could hide a change.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="remat-inductor-"))
# Fixed attention block sizes: on a GPU, tuning every shape class the tests meet would add
# minutes; tests/ops/test_autotune.py turns tuning on where it tests it.
os.environ.setdefault("REMAT_AUTOTUNE", "0")

import pytest  # noqa: E402

import remat  # noqa: E402
from remat import _backend  # noqa: E402

from numerics import make_interpreter_dots_and_math_isa_independent, round_interpreter_bf16_casts_to_nearest  # noqa: E402

# Under the interpreter, fp32 -> bf16 casts round to nearest even, as on the GPU, and tl.dot and the
# fp32 math functions give the same bits on every CPU: tl.dot the exact product rounded once (a GPU's
# exact products and fp32 sums, bf16 included), never the CPU's BLAS kernel (see numerics.py).
# Before any test runs an op: remat asks once whether the interpreter's bf16 dot is exact.
INTERPRETER = _backend.interpreter_enabled() and _backend.backends()["triton"][0]
BF16_CASTS_PATCHED = INTERPRETER and round_interpreter_bf16_casts_to_nearest()
DOTS_AND_MATH_PATCHED = INTERPRETER and make_interpreter_dots_and_math_isa_independent()


def pytest_configure(config):
    """Each pytest-xdist worker's torch gets its share of the cores. torch's default is a thread per core in
    every process: two workers on two cores ran four threads, and the tests' small ops paid for the
    contention (tests/convert/hf/test_hf_rms_families.py with tests/ops/test_attention.py on two workers:
    192 s, 152 s at one thread each). The processes a test starts (gloo ranks, AOT compile workers) inherit
    it through OMP_NUM_THREADS. An OMP_NUM_THREADS the caller set is kept."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_report_header(config):
    lines = []
    if BF16_CASTS_PATCHED:
        lines.append("Triton interpreter: fp32 -> bf16 casts truncate; patched to round to nearest even, as on a GPU")
    if DOTS_AND_MATH_PATCHED:
        lines.append("Triton interpreter: tl.dot (numpy/BLAS sums, CPU-dependent; bf16 raw bits, triton#11584) "
                     "patched to the exact product rounded once; fp32 exp/log/sin/cos computed in float64")
    return lines or None

# Devices and backends every kernel test runs on: the interpreter on CPU everywhere, and on a
# GPU each compiled backend that this install has.
KERNEL_TARGETS = [pytest.param(("cpu", "triton"), id="cpu-triton")]
if HAS_GPU:
    KERNEL_TARGETS.append(pytest.param(("cuda", "triton"), id="cuda-triton"))
    KERNEL_TARGETS.append(pytest.param(("cuda", "cuda"), id="cuda-cuda"))


@pytest.fixture(params=KERNEL_TARGETS)
def target(request):
    """(device, backend) with the backend set for the test's duration."""
    device, backend = request.param
    available, why = remat.backends()[backend]
    if device == "cpu" and not _backend.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is not set: CPU tensors run the reference")
    if not available:
        if HAS_GPU and backend == "cuda":
            pytest.fail(f"the CUDA extension should be built on a GPU machine: {why}")
        pytest.skip(why)
    previous = remat.get_backend()
    with warnings.catch_warnings():  # without a GPU: the note that "triton" runs no CUDA tensor here
        warnings.filterwarnings("ignore", r"remat\.set_backend\('triton'\): no CUDA device", UserWarning)
        remat.set_backend(backend)
    yield device, backend
    remat.set_backend(previous)


@pytest.fixture
def reference_backend():
    previous = remat.get_backend()
    remat.set_backend("reference")
    yield
    remat.set_backend(previous)


# The folders whose subject is remat's integration (conversion, the planner, memory measurement), not
# its kernels: under the interpreter (no GPU) their tests run remat's ops on the PyTorch references, to
# which tests/ops holds the kernels at every dtype and awkward shape; on a GPU they run the kernels.
# Under the interpreter the kernels took ~60 % of these tests' time (test_hf_families.py with
# test_hf_rms_families.py on two workers: 274 s, 111 s on the references). Where the kernels at a
# model's shapes and strides are the subject, a test asks for them: the `target` fixture (each family
# file's same-loss, same-gradients and saved-bytes tests, LoRA), or the `kernels` marker (training
# under bf16 autocast as accurately as stock, padded batches on the varlen kernels, the fused LM-head
# loss, the fused q/k norms, the experts'). The processes a test starts (the gloo ranks) choose their
# backend as any process does.
INTEGRATION_FOLDERS = ("convert", "plan", "measure")
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _references_where_integration_is_the_subject(request):
    folder = os.path.relpath(str(request.node.path), TESTS).split(os.sep)[0]
    if not INTERPRETER or folder not in INTEGRATION_FOLDERS or "target" in request.fixturenames or \
            request.node.get_closest_marker("kernels"):
        yield
    else:
        with remat.use_backend("reference"):
            yield


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A different, reproducible seed per test: fresh inputs, yet a failure can be rerun."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed
