"""Which implementation runs an op: the Triton kernels, the CUDA extension, or the PyTorch reference.

Rule (revised as benchmarks show which backend is faster):

- CUDA tensors, backend "auto": Triton when triton is importable, else the CUDA extension
  when it was built, else the PyTorch reference with a one-time warning.
  "triton" / "cuda" force one backend (an error if it is unavailable).
- CPU tensors: the Triton kernel through the interpreter when TRITON_INTERPRET=1,
  else the PyTorch reference. A forced "cuda" backend does not apply to CPU tensors.
- "reference" runs the pure-PyTorch reference everywhere (for debugging and tests).

The backend is chosen for the process with remat.set_backend(name) or the REMAT_BACKEND environment
variable, and for a block of code with `with remat.use_backend(name):`, which holds in the thread
(or asyncio task) that enters it only. An op's backward runs on the backend its forward ran on.
"""

import contextlib
import contextvars
import functools
import importlib
import os
import warnings

import torch

BACKEND_NAMES = ("auto", "triton", "cuda", "reference")

_chosen = None  # the process default; None: read REMAT_BACKEND on first use
# The backend of the innermost `use_backend` block of this thread or task; None outside any.
_local = contextvars.ContextVar("remat_backend", default=None)


def _check_name(name, source):
    if name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {BACKEND_NAMES}, got {name!r}")


def set_backend(name):
    """Choose the process's default implementation for every op: "auto", "triton", "cuda" or "reference".

    "triton" and "cuda" choose what CUDA tensors run; CPU tensors run the Triton kernels through
    the interpreter (TRITON_INTERPRET=1) or the reference whatever the backend. Without a CUDA
    device, choosing either says so once (a warning). A `use_backend` block overrides it in its thread.
    """
    global _chosen
    _check_usable(name)
    _chosen = name


def _check_usable(name):
    _check_name(name, "backend")
    if name in ("triton", "cuda"):
        # Only the named backend's (cached) status: set_backend runs around every benchmarked call.
        available, reason = (_triton_status if name == "triton" else _cuda_extension_status)()
        if not available:
            raise RuntimeError(f"remat backend {name!r} is not available: {reason}. It is for CUDA tensors; "
                               f"CPU tensors run {cpu_implementation()} whatever the backend")
        if not _cuda_device_visible():
            _warn_no_cuda_device_once(name)


def get_backend():
    """The backend of the innermost `use_backend` block of this thread, else the one set by
    set_backend, else REMAT_BACKEND, else "auto"."""
    global _chosen
    local = None if torch.compiler.is_compiling() else _local.get()
    if local is not None:
        return local
    if _chosen is None:
        name = os.environ.get("REMAT_BACKEND", "auto")
        _check_name(name, "REMAT_BACKEND")
        _chosen = name
    return _chosen


@contextlib.contextmanager
def use_backend(name):
    """Run the enclosed calls on backend `name`, in this thread (or asyncio task) only: other threads
    keep theirs, and the process default (set_backend) is untouched. Checked as set_backend checks."""
    _check_usable(name)
    with _local_backend(name):
        yield


@contextlib.contextmanager
def _local_backend(name):
    token = _local.set(name)
    try:
        yield
    finally:
        _local.reset(token)


def remember_backend(ctx):
    """Record on an autograd ctx the `use_backend` block its forward runs in (see on_forward_backend)."""
    ctx.remat_backend = None if torch.compiler.is_compiling() else _local.get()


def on_forward_backend(backward):
    """An autograd backward run on the backend its forward ran on (recorded by remember_backend): the
    autograd engine runs a CUDA backward in a thread of its own, which does not see the forward's
    `use_backend` block."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        name = getattr(ctx, "remat_backend", None)
        if name is None:
            return backward(ctx, *grads)
        with _local_backend(name):
            return backward(ctx, *grads)

    return run


def interpreter_enabled():
    """True when Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreter_runs_cpu_tensors():
    return interpreter_enabled() and _triton_status()[0]


def cpu_implementation():
    """What CPU tensors run, in words, under every backend but "reference" (the reference everywhere)."""
    if _interpreter_runs_cpu_tensors():
        return "the Triton kernels through the interpreter (TRITON_INTERPRET=1)"
    if _triton_status()[0]:
        return "the PyTorch reference (TRITON_INTERPRET=1 would run the Triton kernels through the interpreter)"
    return "the PyTorch reference"


@functools.cache
def _cuda_device_visible():
    return torch.cuda.is_available()


@functools.cache
def _warn_no_cuda_device_once(name):
    warnings.warn(
        f"remat.set_backend({name!r}): no CUDA device is visible, so this backend runs nothing here (it "
        f"chooses what CUDA tensors run); CPU tensors still run {cpu_implementation()}",
        stacklevel=3,
    )


@functools.cache
def _triton_status():
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return False, f"triton is not importable ({error})"
    return True, f"triton {triton.__version__}"


def triton_available():
    return _triton_status()[0]


@functools.cache
def _cuda_extension_status():
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    try:
        importlib.import_module("remat._C")
    except ImportError as error:
        return False, (f"remat._C is not built ({error}); `pip install --no-build-isolation .` builds it where nvcc "
                       "and a CUDA build of torch are present (scripts/setup.sh: where a GPU is, or with "
                       "REMAT_BUILD_CUDA=1)")
    return True, "remat._C loaded"


def backends():
    """What is available, as {name: (available, why)}: each "why" says what the backend does on this
    machine (a kernel backend built or importable runs no CUDA tensor where no GPU is visible)."""
    gpu = torch.cuda.is_available()
    on_cpu = _interpreter_runs_cpu_tensors()
    triton, triton_why = _triton_status()
    cuda, cuda_why = _cuda_extension_status()
    if gpu:
        triton_here = cuda_here = f"runs CUDA tensors on {torch.cuda.get_device_name()}"
    elif on_cpu:
        triton_here = "no GPU here: runs only CPU tensors, through the interpreter (TRITON_INTERPRET=1)"
        cuda_here = "no GPU here, so it runs nothing"
    else:  # what "interpreter" says too: CPU tensors run the reference
        triton_here = "no GPU here and TRITON_INTERPRET is not set, so it runs nothing (CPU tensors run the reference)"
        cuda_here = "no GPU here, so it runs nothing"
    return {
        "triton": (triton, f"{triton_why}; {triton_here}" if triton else triton_why),
        "cuda": (cuda, f"built ({cuda_why}); {cuda_here}" if cuda else cuda_why),
        "interpreter": (
            on_cpu,
            "TRITON_INTERPRET=1: Triton kernels run on CPU tensors (slowly: for checking them)"
            if interpreter_enabled() else "TRITON_INTERPRET is not set: CPU tensors use the PyTorch reference",
        ),
        "gpu": (gpu, torch.cuda.get_device_name() if gpu else "no CUDA device visible"),
        "reference": (True, "pure PyTorch, always available" + ("" if on_cpu else "; what CPU tensors run")),
    }


@functools.cache
def _warn_reference_once(op):
    warnings.warn(
        f"remat: neither triton nor the CUDA extension is available; {op} runs the slow "
        "PyTorch reference on the GPU (see remat.backends())",
        stacklevel=3,
    )


@functools.cache
def _warn_missing_kernel_once(op, backend, instead):
    warnings.warn(
        f"remat backend {backend!r} has no {op} kernel: {op} runs {instead} (see remat.backends())",
        stacklevel=4,
    )


@functools.cache
def warn_cuda_kernel_declines_once(op, instead):
    runs = f"its {instead} kernel" if instead != "reference" else "the reference"
    warnings.warn(
        f"remat backend 'cuda': the CUDA {op} kernel does not take some of these calls (see the op's "
        f"documentation for what it takes); those run {runs}",
        stacklevel=4,
    )


def choose(op, device, kernels=("triton", "cuda")):
    """The implementation for `op` on `device`: "triton", "cuda" or "reference". `kernels`: the
    backends `op` has kernels for. A backend chosen by name means the same for every op: one an op
    has no kernel for runs that op's other kernel, and says so once."""
    backend = get_backend()
    if backend == "reference":
        return "reference"
    if device.type != "cuda":
        return "triton" if _interpreter_runs_cpu_tensors() and "triton" in kernels else "reference"
    if backend != "auto":
        if backend in kernels:
            return backend
        instead = next((k for k in kernels if (_triton_status if k == "triton" else _cuda_extension_status)()[0]),
                       "reference")
        _warn_missing_kernel_once(op, backend, f"its {instead} kernel" if instead != "reference" else "the reference")
        return instead
    if "triton" in kernels and _triton_status()[0]:
        return "triton"
    if "cuda" in kernels and _cuda_extension_status()[0]:
        return "cuda"
    _warn_reference_once(op)
    return "reference"


# ---------------------------------------------------------------------------------------------
# Double backward (create_graph=True)
# ---------------------------------------------------------------------------------------------


def backward_is_differentiated():
    """True inside a backward whose result will be differentiated again (create_graph=True).

    Autograd runs a backward in grad mode only then. The ops compute such a backward with their
    differentiable PyTorch reference instead of the backward kernels, which have no derivative.
    torch.compile traces the backward with grad mode off: compiled training keeps the kernels.
    """
    return torch.is_grad_enabled()


def refuse_double_backward(backward_op, name):
    """Gives the custom backward op `backward_op` (named `name`) a derivative that is a clear error.

    remat.layer_norm, remat.gelu and remat.attention never differentiate their backward ops (see
    backward_is_differentiated); the fused layers call them inside their own backward, and a
    double backward through those would need the backward op's derivative.
    """
    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{name} has no derivative: remat's fused layers (remat.mlp, remat.layer_norm_linear, remat.nn.MLP, "
            "LayerNormMLP, LayerNormLinear) do not support a double backward (create_graph=True). "
            "remat.layer_norm, remat.gelu and remat.attention do: use them with torch.nn.Linear there, "
            "or the stock layers (remat.revert(model))"
        )

    backward_op.register_autograd(backward, setup_context=setup_context)
