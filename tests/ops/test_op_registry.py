"""The op-family registry (remat.ops.FAMILIES): the contract every family's ops keep, checked on the
family's own samples and public calls."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.ops import FAMILIES, registered_calls

from numerics import rel_error

FAMILY_PARAMS = [pytest.param(family, id=family.name) for family in FAMILIES.values()]
OP_PARAMS = [pytest.param(family, direction, id=f"{family.name}-{direction}")
             for family in FAMILIES.values() for direction in ("forward", "backward")]
CALL_PARAMS = [pytest.param(family, call, id=call.name) for family, call in registered_calls()]


def _op_and_samples(family, direction, device):
    op = family.forward_op if direction == "forward" else family.backward_op
    return op, getattr(family.samples(torch.device(device)), direction)


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
    index = 0 if direction == "forward" else 1
    for args in samples:
        torch.library.opcheck(op, args)
        if device == "cuda" and backend == "cuda" and family.cuda:
            detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            torch.library.opcheck(getattr(torch.ops.remat_C, family.op_names[index]).default, detached)


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
    index = 0 if direction == "forward" else 1
    op, samples = _op_and_samples(family, direction, "cpu")
    cuda_op = getattr(torch.ops.remat_C, family.op_names[index])
    for args in samples:
        with FakeTensorMode() as mode, torch.no_grad():
            fake_args = _on_fake(mode, args)
            assert _metadata(cuda_op(*fake_args)) == _metadata(op(*fake_args))


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
    compiled = torch.compile(lambda *ts: call.ours(dict(zip(names, ts))), fullgraph=True)
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


# --- the registry itself --------------------------------------


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
