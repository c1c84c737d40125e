"""The op-family registry (remat.ops.FAMILIES): the contract every family's ops keep, checked on the
family's own samples and public calls, and the tooling's loops (benchmark suites, CLI help, AOT
compile test, validation table, sanitizer run) see every family."""

import dataclasses
import importlib
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import bench
from remat.cli import main
from remat.ops import FAMILIES, registered_calls

from numerics import COMPILE_BACKEND, rel_error

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAMILY_PARAMS = [pytest.param(family, id=family.name) for family in FAMILIES.values()]
OP_PARAMS = [pytest.param(family, direction, id=f"{family.name}-{direction}")
             for family in FAMILIES.values() for direction in ("forward", "backward")]
CALL_PARAMS = [pytest.param(family, call, id=call.name) for family, call in registered_calls()]


def _op_and_samples(family, direction, device):
    op = family.forward_op if direction == "forward" else family.backward_op
    return op, getattr(family.samples(torch.device(device)), direction)


def _cuda_op(family, direction):
    """The CUDA extension's op (remat_C::<name>_fwd or _bwd)."""
    name = family.cuda_ops[0 if direction == "forward" else 1]
    return getattr(torch.ops.remat_C, name.partition("::")[2])


def _metadata(outputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [(tuple(t.shape), t.dtype, t.stride()) for t in outputs]


def _on_fake(mode, args):
    return [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]


# --- every op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family, direction", OP_PARAMS)
def test_opcheck(target, family, direction):
    """Schema, fake, autograd registration and AOT dispatch (torch.library.opcheck) on every sample;
    on a GPU with the CUDA backend the extension's remat_C op directly too."""
    device, backend = target
    op, samples = _op_and_samples(family, direction, device)
    assert samples, f"{family.name} has no {direction} samples"
    for args in samples:
        torch.library.opcheck(op, args)
        if device == "cuda" and backend == "cuda" and family.cuda and (family.cuda_takes is None
                                                                        or family.cuda_takes(*args)):
            detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            torch.library.opcheck(_cuda_op(family, direction).default, detached)


@pytest.mark.parametrize("family, direction", OP_PARAMS)
def test_fakes_give_the_real_outputs_shapes_dtypes_and_strides(target, family, direction):
    device, _ = target
    op, samples = _op_and_samples(family, direction, device)
    for args in samples:
        real = _metadata(op(*args))
        with FakeTensorMode() as mode:
            fake = _metadata(op(*_on_fake(mode, args)))
        assert fake == real, args


@pytest.mark.parametrize("family, direction", OP_PARAMS)
def test_the_cuda_extension_ops_have_the_familys_fakes(family, direction):
    """Where the extension is built (it is on any machine with nvcc, GPU or not), its remat_C ops
    trace with the same fakes as the remat ops."""
    if not family.cuda:
        pytest.skip(f"{family.name} has no CUDA-extension ops")
    available, why = remat.backends()["cuda"]
    if not available:
        pytest.skip(why)
    op, samples = _op_and_samples(family, direction, "cpu")
    cuda_op = _cuda_op(family, direction)
    for args in samples:
        with FakeTensorMode() as mode, torch.no_grad():
            fake_args = _on_fake(mode, args)
            assert _metadata(cuda_op(*fake_args)) == _metadata(op(*fake_args))


def test_the_families_declare_exactly_the_cuda_extensions_ops():
    """cuda=True where the built extension has the family's two ops, and no extension op outside a
    family (its kernels' ops, or the tools it declares)."""
    available, why = remat.backends()["cuda"]
    if not available:
        pytest.skip(why)
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("remat_C::")}
    assert registered == {name for family in FAMILIES.values() for name in family.cuda_ops + family.cuda_tools}


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_the_backward_op_has_no_derivative_and_says_so(family):
    args = family.samples(torch.device("cpu")).backward[0]
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    first = family.backward_op(*leaves)[0]
    with pytest.raises(NotImplementedError, match=f"{family.qualified_op_names[1]} has no derivative"):
        first.sum().backward()


# --- every public function ------------------------------------------------------------------------


def _padded_leaves(call, device):
    """The call's tensors, each a view into a wider allocation (rows with a stride beyond their width)."""
    tensors = {}
    for name, shape in call.shapes.items():
        wide = torch.randn(*shape[:-1], shape[-1] + 3, device=device)
        tensors[name] = wide[..., :shape[-1]].requires_grad_()
    return tensors


@pytest.mark.parametrize("family, call", CALL_PARAMS)
def test_torch_compile_fullgraph_matches_eager(target, family, call):
    device, _ = target
    tensors = _padded_leaves(call, device)
    names = list(tensors)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *ts: call.ours(dict(zip(names, ts))), fullgraph=True, backend=COMPILE_BACKEND)
    out = compiled(*tensors.values())
    dy = torch.randn_like(out)
    compiled_grads = torch.autograd.grad(out, list(tensors.values()), dy)
    expected = call.ours(tensors)
    expected_grads = torch.autograd.grad(expected, list(tensors.values()), dy)
    assert rel_error(out, expected) < 1e-5
    for name, got, want in zip(names, compiled_grads, expected_grads):
        assert rel_error(got, want) < 1e-5, name


class _RecordedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family, call", CALL_PARAMS)
def test_only_create_graph_leaves_the_backward_kernel(target, family, call):
    """create_graph=False (every training step) runs the backward op, the kernels; only a
    backward that will be differentiated again runs the reference."""
    device, _ = target
    backward_op = family.qualified_op_names[1].replace("::", ".") + ".default"
    for create_graph in (False, True):
        tensors = {name: torch.randn(*shape, device=device, requires_grad=True) for name, shape in call.shapes.items()}
        out = call.ours(tensors)
        with _RecordedOps() as recorded:
            torch.autograd.grad(out, list(tensors.values()), torch.randn_like(out), create_graph=create_graph)
        assert (backward_op in recorded.names) == (not create_graph), (create_graph, sorted(recorded.names))


# --- the registry itself and the tooling that loops over it --------------------------------------


def test_a_family_is_declared_once():
    with pytest.raises(ValueError, match="op family 'gelu' is declared twice"):
        dataclasses.replace(FAMILIES["gelu"])


def test_every_family_has_its_ops_and_public_calls():
    for family in FAMILIES.values():
        for name in family.qualified_op_names:
            namespace, _, op = name.partition("::")
            assert hasattr(getattr(torch.ops, namespace), op), name
        assert family.calls, f"{family.name} declares no public call"
    names = [call.name for _, call in registered_calls()]
    assert len(names) == len(set(names)), names


def test_every_family_has_a_benchmark_suite_with_sizes_and_sanitizer_calls():
    for family in FAMILIES.values():
        suite = bench.SUITES[family.bench_suite]
        assert suite.__name__ == f"remat.bench.{family.name}"
        assert callable(suite.cases) and isinstance(suite.SIZES_MEAN, str) and callable(suite.sanitize_calls)


def test_cli_help_says_what_shapes_means_for_every_suite(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, suite in bench.SUITES.items():
        assert f"{name} {suite.SIZES_MEAN}" in text, name


def _module_in(folder, name, monkeypatch):
    """Module `name` from `folder` (a test file or script imported by name, as pytest and python do)."""
    monkeypatch.syspath_prepend(str(ROOT / folder))
    return importlib.import_module(name)


def test_the_aot_test_compiles_every_family_with_triton_kernels(monkeypatch):
    aot = _module_in("tests/package", "test_triton_aot", monkeypatch)
    modules = {family.triton for family in FAMILIES.values() if family.triton}
    assert set(aot.KERNEL_MODULES) == modules
    assert set(aot.CI_SUBSETS) <= modules, "a CI subset for a kernel module no family has"
    for name in modules:
        assert callable(aot._kernel_module(name).aot_cases), name


def test_the_validation_table_has_every_public_call(monkeypatch):
    validation = _module_in("tests/ops", "test_validation", monkeypatch)
    subjects = {subject.name: subject for subject in validation.SUBJECTS}
    for _, call in registered_calls():
        assert subjects[call.name].ours is call.ours and subjects[call.name].theirs is call.stock, call.name


def test_the_sanitizer_runs_every_family(monkeypatch):
    sanitize = _module_in("bench", "sanitize_check", monkeypatch)
    names = [name for name, _ in sanitize.family_calls("cpu", torch.float32)]
    assert set(names) == set(FAMILIES)


# --- the eager path: the family's functions skip torch.library's dispatch ------------------------


def _dispatched_remat_ops(step, *args):
    """(step(*args), the remat:: ops the dispatcher saw meanwhile): torch's profiler records every op
    the dispatcher runs, without being a mode the eager path would step aside for."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = step(*args)
    return result, {event.name for event in profile.events() if event.name.startswith("remat::")}


def _grad_leaves(args):
    return [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def _forward_and_grads(forward, args):
    """(outputs, gradients of every floating input) of `forward` on fresh leaves of `args`."""
    leaves = _grad_leaves(args)
    outputs = forward(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    differentiable = [o for o in outputs if o.requires_grad]
    inputs = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    if not differentiable:  # a linear_cross_entropy shard's parts: the loss they combine into has the gradient
        return [o.detach() for o in outputs], ()
    grads = torch.autograd.grad(differentiable, inputs, [torch.ones_like(o) for o in differentiable],
                                allow_unused=True)
    return [o.detach() for o in outputs], grads


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_the_eager_path_computes_what_the_ops_compute_without_their_dispatch(target, family):
    """family.forward in eager mode on plain CPU tensors runs no remat:: op (forward nor backward), and
    gives bitwise the outputs and gradients of the custom op; inside a dispatch mode (as a tracer
    is) it is the custom ops again."""
    device, _ = target
    for args in family.samples(torch.device(device)).forward:
        (outputs, grads), seen = _dispatched_remat_ops(_forward_and_grads, family.forward, args)
        assert seen == set()
        want_outputs, want_grads = _forward_and_grads(family.forward_op, args)
        for got, want in zip([*outputs, *grads], [*want_outputs, *want_grads], strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got, want)
        with _RecordedOps() as recorded:
            _forward_and_grads(family.forward, args)
        ran = family.qualified_op_names if want_grads else family.qualified_op_names[:1]  # no gradient, no backward
        assert {f"{name.replace('::', '.')}.default" for name in ran} <= recorded.names


def test_the_eager_path_keeps_the_ops_for_meta_tensors_and_no_grad_backward_ops():
    """Meta tensors go to the ops' fakes; without grad mode the backward runs directly too."""
    family = FAMILIES["layer_norm"]
    x = torch.randn(3, 7)
    _, seen = _dispatched_remat_ops(family.forward, x.to("meta"), None, None, 1e-5)
    assert seen == {"remat::layer_norm_fwd"}
    y, mean, rstd = family.forward(x, None, None, 1e-5)
    with torch.no_grad():
        _, seen = _dispatched_remat_ops(family.backward, torch.ones_like(y), x, None, None, mean, rstd, False)
    assert seen == set()
