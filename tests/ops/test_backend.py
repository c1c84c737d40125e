"""remat.set_backend says what it changes: the backends choose what CUDA tensors run, and CPU
tensors run the interpreter or the reference whatever the backend."""

import warnings

import pytest
import torch

import remat
from remat import _backend


@pytest.fixture
def backend_restored():
    """The backend and set_backend's once-only warning as they were, whatever the test sets."""
    previous = remat.get_backend()
    _backend._warn_no_cuda_device_once.cache_clear()
    yield
    _backend._chosen = previous  # as it was, without set_backend's checks and warning
    _backend._warn_no_cuda_device_once.cache_clear()


@pytest.mark.parametrize("interpreter, cpu_runs", [
    (True, r"the Triton kernels through the interpreter \(TRITON_INTERPRET=1\)"),
    (False, r"the PyTorch reference \(TRITON_INTERPRET=1 would run the Triton kernels through the interpreter\)"),
], ids=["interpreter", "no-interpreter"])
def test_triton_without_a_cuda_device_says_what_cpu_tensors_run(monkeypatch, backend_restored, interpreter,
                                                                   cpu_runs):
    monkeypatch.setattr(_backend, "_cuda_device_visible", lambda: False)
    monkeypatch.setattr(_backend, "interpreter_enabled", lambda: interpreter)
    if not _backend.backends()["triton"][0]:
        pytest.skip("triton is not importable")
    with pytest.warns(UserWarning, match=r"remat\.set_backend\('triton'\): no CUDA device is visible, so this "
                                         r"backend runs nothing here .*; CPU tensors still run " + cpu_runs):
        remat.set_backend("triton")
    assert remat.get_backend() == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: set_backend runs around every benchmarked call
        remat.set_backend("triton")


def test_triton_with_a_cuda_device_says_nothing(monkeypatch, backend_restored):
    monkeypatch.setattr(_backend, "_cuda_device_visible", lambda: True)
    if not _backend.backends()["triton"][0]:
        pytest.skip("triton is not importable")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.set_backend("triton")


def test_triton_not_importable_says_cpu_tensors_do_not_need_it(monkeypatch, backend_restored):
    monkeypatch.setattr(_backend, "_triton_status", lambda: (False, "triton is not importable (pretend)"))
    with pytest.raises(RuntimeError, match=r"remat backend 'triton' is not available: triton is not importable "
                                           r"\(pretend\)\. It is for CUDA tensors; CPU tensors run the PyTorch "
                                           r"reference whatever the backend"):
        remat.set_backend("triton")


def test_a_backend_means_the_same_for_every_op(monkeypatch, backend_restored):
    """"cuda" for varlen attention, which has no CUDA-extension kernel: its Triton kernel runs, and the user
    is told once; ops with a CUDA kernel run it."""
    monkeypatch.setattr(_backend, "_triton_status", lambda: (True, "triton (pretend)"))
    monkeypatch.setattr(_backend, "_cuda_extension_status", lambda: (True, "remat._C (pretend)"))
    _backend._warn_missing_kernel_once.cache_clear()
    _backend._chosen = "cuda"
    gpu = torch.device("cuda")
    assert _backend.choose("layer_norm", gpu) == "cuda"
    with pytest.warns(UserWarning, match=r"remat backend 'cuda' has no attention_varlen kernel: attention_varlen "
                                         r"runs its "
                                         r"triton kernel"):
        assert _backend.choose("attention_varlen", gpu, kernels=("triton",)) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert _backend.choose("attention_varlen", gpu, kernels=("triton",)) == "triton"
    _backend._warn_missing_kernel_once.cache_clear()


def test_use_backend_is_local_to_its_thread(backend_restored):
    """Two threads each in a `use_backend` block: each sees its own backend while inside, the other
    thread and the process default are untouched, and the default is the same afterwards."""
    import threading

    remat.set_backend("auto")
    inside, release = threading.Barrier(3), threading.Barrier(3)
    seen = {}

    def run(name):
        with remat.use_backend(name):
            inside.wait()  # both threads are inside their blocks at once
            seen[name] = remat.get_backend()
            release.wait()
        seen[name + " after"] = remat.get_backend()

    threads = [threading.Thread(target=run, args=(name,)) for name in ("reference", "auto")]
    for thread in threads:
        thread.start()
    inside.wait()
    seen["main"] = remat.get_backend()
    release.wait()
    for thread in threads:
        thread.join()
    assert seen == {"reference": "reference", "auto": "auto", "main": "auto",
                    "reference after": "auto", "auto after": "auto"}
    assert remat.get_backend() == "auto"


def test_a_backward_runs_on_its_forwards_backend(monkeypatch, backend_restored):
    """The autograd engine runs a CUDA backward in a thread of its own, outside the forward's
    `use_backend` block: the backward ops run on the forward's backend all the same (here the
    backward runs in another thread, as it would on a GPU)."""
    import threading

    remat.set_backend("auto")
    chosen = []
    choose = _backend.choose
    monkeypatch.setattr(_backend, "choose", lambda op, device, **kw: chosen.append(_backend.get_backend())
                        or choose(op, device, **kw))
    x = torch.randn(3, 8, requires_grad=True)
    fc = torch.nn.Linear(8, 4)
    with remat.use_backend("reference"):
        y = remat.gelu(x).sum() + remat.layer_norm_linear(x, None, None, fc.weight, fc.bias).sum()
    thread = threading.Thread(target=y.backward)
    thread.start()
    thread.join()
    assert x.grad is not None
    assert chosen and set(chosen) == {"reference"}, chosen
