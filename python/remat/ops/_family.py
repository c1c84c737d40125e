"""An op family declared once: its custom ops, fakes, autograd and backend dispatch, and its registry entry.

A family is a forward op and its backward op, `remat::<name>_fwd` and `remat::<name>_bwd`. Its
file (ops/layer_norm.py, ...) writes what is particular to it: the float64-capable references, whose
annotated Python signatures are the ops' schemas; the fake functions; the autograd formula
(setup_context and backward); the public function; and one OpFamily(...) that builds the rest:

- both custom ops, dispatching at each call to the backend remat._backend chooses: the Triton
  launchers (imported on first use), the CUDA extension's remat_C ops, or the references;
- `forward` and `backward`, what the family's code calls: in eager mode on plain tensors they run
  the chosen implementation directly (the forward under an autograd.Function with the ops'
  autograd), skipping torch.library's dispatch, which costs tens of µs a call; under
  torch.compile, a dispatch or function mode, tensor subclasses or meta tensors they call the ops;
- the fakes of both ops, and of the remat_C ops when the extension is built and has them;
- the forward's autograd, and a backward op whose own derivative is a clear error;
- the family's entry in FAMILIES, which the tooling loops over: the benchmark suites, the CLI's
  help, the ahead-of-time compile test, the validation table, the sanitizer run and the contract
  tests (tests/ops/test_op_registry.py) that opcheck every op on the family's samples.
"""

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import _backend

FAMILIES = {}  # name -> OpFamily, in the order the families were declared


class OpSamples(NamedTuple):
    """Arguments of the forward op and of the backward op, small and awkward (widths that are no
    power of two, optional tensors present and absent, every flag): what the contract tests opcheck."""

    forward: list
    backward: list


@dataclass(frozen=True)
class PublicCall:
    """The public function on small awkward named tensors, beside the same computation in stock PyTorch.

    shapes: name -> shape of each tensor, the activations (`inputs`) first, then the parameters;
    the tests fill them with randn. ours / stock: that dict of tensors -> the output. The
    validation table checks `ours` against `stock` rule by rule; the contract tests compile `ours`.
    """

    name: str
    shapes: dict
    ours: Callable
    stock: Callable
    inputs: tuple = ("x",)


@dataclass
class OpFamily:
    """One op family; declaring it registers its ops (see the module docstring). Fields:

    name: the ops are remat::<name>_fwd and remat::<name>_bwd; also the name backend warnings use.
    forward_ref, backward_ref: the PyTorch references, what the "reference" backend runs; their
        annotated signatures are the ops' schemas, so their argument names are the ops'.
    forward_fake, backward_fake: output metadata from the inputs alone (register_fake).
    setup_context, autograd_backward: the forward op's autograd (register_autograd).
    samples: device -> OpSamples.
    bench_suite: the family's `remat bench` suite, in module remat.bench.<name>, which also lists
        the calls bench/sanitize_check.py runs under compute-sanitizer.
    calls: the family's PublicCalls: its subjects in the validation table.
    triton: the module of remat.triton_kernels holding the Triton launchers, None without any.
    triton_launchers: their names there; default (<name>_fwd, <name>_bwd), with the ops' signatures.
    triton_takes: op arguments -> whether the Triton launchers take them (else the reference runs);
        None: always.
    cuda: whether the CUDA extension has remat_C::<name>_fwd and remat_C::<name>_bwd.
    cuda_takes: op arguments -> whether the CUDA kernels take them; None: always. Calls they do not
        take run the Triton launchers (else the reference) under backend "cuda", and say so once.
    cuda_tools: the family's other remat_C ops, which launch nothing (attention_launch_plan).
    uses_tl_dot: the Triton kernels multiply with tl.dot, whose bfloat16 results the Triton
        interpreter gets wrong (triton issue 11584): bf16 calls on CPU tensors are refused unless the
        interpreter's bf16 dot is exact (the tests patch it).
    """

    name: str
    forward_ref: Callable
    backward_ref: Callable
    forward_fake: Callable
    backward_fake: Callable
    setup_context: Callable
    autograd_backward: Callable
    samples: Callable[[torch.device], OpSamples]
    bench_suite: str
    calls: tuple = ()
    triton: str | None = None
    triton_launchers: tuple | None = None
    triton_takes: Callable | None = None
    cuda: bool = False
    cuda_takes: Callable | None = None
    cuda_tools: tuple = ()
    uses_tl_dot: bool = False
    forward_op: object = field(init=False, repr=False)
    backward_op: object = field(init=False, repr=False)
    forward: Callable = field(init=False, repr=False)  # what the family's code calls (see the module docstring)
    backward: Callable = field(init=False, repr=False)
    kernels: tuple = field(init=False, repr=False)  # the backends with kernels for it, as _backend.choose takes them
    op_names: tuple = field(init=False, repr=False)  # (<name>_fwd, <name>_bwd): its ops' names in remat's and remat_C's
    _defaults: tuple = field(init=False, repr=False)  # the forward's and the backward's _trailing_defaults
    _launchers: tuple | None = field(default=None, init=False, repr=False)  # _triton_launchers, once imported

    def __post_init__(self):
        if self.name in FAMILIES:
            raise ValueError(f"op family {self.name!r} is declared twice")
        # once: _implementation reads them at every op call
        self.kernels = tuple(name for name, present in (("triton", self.triton), ("cuda", self.cuda)) if present)
        self.op_names = f"{self.name}_fwd", f"{self.name}_bwd"
        self.forward_op = self._custom_op(0, self.forward_ref, self.forward_fake)
        self.backward_op = self._custom_op(1, self.backward_ref, self.backward_fake)
        self._defaults = _trailing_defaults(self.forward_ref), _trailing_defaults(self.backward_ref)
        self.forward_op.register_autograd(_backend.on_forward_backend(self.autograd_backward),
                                          setup_context=self._setup_context)
        _backend.refuse_double_backward(self.backward_op, self.qualified_op_names[1])
        self.forward = self._eager_forward(_eager_autograd(self))
        self.backward = self._eager_backward()
        self._register_cuda_extension_fakes()
        FAMILIES[self.name] = self

    def _setup_context(self, ctx, inputs, output):
        _backend.remember_backend(ctx)
        self.setup_context(ctx, inputs, output)

    def _eager_forward(self, autograd):
        """The forward op, or in eager mode on plain tensors its implementation: under `autograd`
        when a gradient is needed."""
        op, defaults = self.forward_op, self._defaults[0]

        def forward(*args, **kwargs):
            plain = None if kwargs else _plain_eager_call(args)
            if plain is None:
                return op(*args, **kwargs)
            requires_grad, device = plain
            args = _filled(args, defaults)  # (the schema's defaults are no tensors)
            if requires_grad and torch.is_grad_enabled():
                return autograd.apply(*args, device)
            return self._implementation(0, args, device)(*args)

        return forward

    def _eager_backward(self):
        """The backward op, or in eager mode on plain tensors without a gradient to record (outside a
        create_graph backward: the op's derivative is a clear error) its implementation."""
        op, defaults = self.backward_op, self._defaults[1]

        def backward(*args, **kwargs):
            plain = None if kwargs or torch.is_grad_enabled() else _plain_eager_call(args)
            if plain is None:
                return op(*args, **kwargs)
            args = _filled(args, defaults)
            return self._implementation(1, args, plain[1])(*args)

        return backward

    def run(self, index, device, *args):
        """Op `index` (0 forward, 1 backward) on `args` from inside a fused op's call (remat.ops.fused) that
        decided once, for all its op calls, that they may run their implementations directly: `device`,
        from eager_device or eager_backward_device. The op's own checks of each call (forward and backward:
        plain tensors, no float64, no mode) are what that decision stands for; device None: they run."""
        if device is None:
            return (self.forward, self.backward)[index](*args)
        args = _filled(args, self._defaults[index])
        return self._implementation(index, args, device)(*args)

    @property
    def qualified_op_names(self):
        """("remat::<name>_fwd", "remat::<name>_bwd")."""
        return tuple(f"remat::{name}" for name in self.op_names)

    @property
    def cuda_ops(self):
        """The CUDA extension's ops, forward then backward, as declared (whether or not it is built)."""
        return tuple(f"remat_C::{name}" for name in self.op_names) if self.cuda else ()

    def _custom_op(self, index, reference, fake):
        def dispatch(*args):
            return self._implementation(index, args)(*args)

        op = torch.library.custom_op(self.qualified_op_names[index], dispatch, mutates_args=(),
                                     schema=torch.library.infer_schema(reference, mutates_args=()))
        op.register_fake(fake)
        return op

    def _implementation(self, index, args, device=None):
        """What runs op `index` (0 forward, 1 backward) on `args`: a Triton launcher, a remat_C op or the
        reference. device: the tensors' device, given where the caller knows that none is float64 (run, and the
        eager calls through _plain_eager_call)."""
        if device is None:
            for a in args:  # (a loop, not generators: this runs at every op call)
                if isinstance(a, torch.Tensor):
                    if a.dtype == torch.float64:
                        return (self.forward_ref, self.backward_ref)[index]  # the kernels compute in fp32 at most
                    if device is None:
                        device = a.device
        backend = _backend.choose(self.name, device, kernels=self.kernels)
        if backend == "cuda" and self.cuda_takes is not None and not self.cuda_takes(*args):
            backend = "triton" if self.triton and _backend.triton_available() else "reference"
            _backend.warn_cuda_kernel_declines_once(self.name, backend)
        if backend == "triton" and (self.triton_takes is None or self.triton_takes(*args)):
            if device.type == "cpu" and self.uses_tl_dot:
                self._check_interpreter_dot(args)
            return self._triton_launchers()[index]
        if backend == "cuda":
            return getattr(torch.ops.remat_C, self.op_names[index])
        return (self.forward_ref, self.backward_ref)[index]

    def _triton_launchers(self):
        """(forward, backward) Triton launchers, imported on first use (not at every call: importlib's lookup)."""
        if self._launchers is None:
            module = importlib.import_module(f"remat.triton_kernels.{self.triton}")
            self._launchers = tuple(getattr(module, name) for name in (self.triton_launchers or self.op_names))
        return self._launchers

    def _check_interpreter_dot(self, args):
        """Refuses bf16 kernels the Triton interpreter would compute wrong (its bf16 tl.dot: triton
        issue 11584) rather than return garbage."""
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            return
        from remat.triton_kernels._interpreter import bf16_dot_checked

        if not bf16_dot_checked():
            raise RuntimeError(
                f"remat.{self.name}: the Triton interpreter (TRITON_INTERPRET=1) multiplies bfloat16 matrices "
                "wrong (triton issue 11584), so its bfloat16 kernels cannot run on CPU tensors here. Use "
                "float32 or float16, or run the PyTorch reference: unset TRITON_INTERPRET, or "
                "remat.set_backend('reference')")

    def _register_cuda_extension_fakes(self):
        """The remat_C ops get the same fakes, so that they trace and pass opcheck like the remat ones."""
        if not self.cuda or not _backend.backends()["cuda"][0]:
            return
        for name, fake in zip(self.op_names, (self.forward_fake, self.backward_fake)):
            if hasattr(torch.ops.remat_C, name):  # not in an extension built before the family had it
                torch.library.register_fake(f"remat_C::{name}")(fake)


def _eager_autograd(family):
    """The forward op's autograd (setup_context, backward on the forward's backend) as an
    autograd.Function around its implementation, for eager calls."""

    # forward takes ctx and calls setup_context itself: an autograd.Function that defines
    # setup_context has every apply bind its arguments with inspect.signature (tens of µs a call).
    class EagerForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args_and_device):  # the op's arguments (the backward reads their needs_input_grad by
            args, device = args_and_device[:-1], args_and_device[-1]  # position), then _plain_eager_call's device
            output = family._implementation(0, args, device)(*args)
            family._setup_context(ctx, args, output)
            return output

        @staticmethod
        @_backend.on_forward_backend
        def backward(ctx, *grads):
            return *family.autograd_backward(ctx, *grads), None

    EagerForward.__qualname__ = EagerForward.__name__ = f"{family.name}_fwd_eager"
    return EagerForward


def _trailing_defaults(reference):
    """(number of parameters, their defaults from the first one that has a default) of `reference`, whose
    signature is the op's schema."""
    parameters = list(inspect.signature(reference).parameters.values())
    first = next((i for i, p in enumerate(parameters) if p.default is not inspect.Parameter.empty), len(parameters))
    return len(parameters), tuple(p.default for p in parameters[first:])


def _filled(args, defaults):
    """`args` completed with the schema's defaults, as the op fills them before its implementation runs."""
    count, tail = defaults
    missing = count - len(args)
    return args + tail[len(tail) - missing:] if missing > 0 else args


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


# torch's own answers to "which modes are active", looked up once (_modes_or_tracing runs at every op call)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch_transform = torch._C._functorch.peek_interpreter_stack


def _modes_or_tracing():
    """Whether torch.compile traces, or a dispatch mode, a function mode or a functorch transform is active:
    each must see remat's ops, not their implementations."""
    return torch.compiler.is_compiling() or _dispatch_modes() or _function_modes() or _functorch_transform() is not None


def eager_device(tensors):
    """For a fused op's call on `tensors` (None entries skipped): the device of its op calls where each may
    run its implementation directly (OpFamily.run), which their own checks would allow each of them (plain
    CPU or CUDA tensors, no float64 among them, outside torch.compile, modes and transforms, without a
    gradient to record: the op calls inside an autograd.Function's forward); else None. Asked once a call:
    the op calls inside read these tensors and tensors computed from them."""
    if torch.is_grad_enabled() or _modes_or_tracing():
        return None
    plain = _plain_tensors(tensors)
    return plain[1] if plain is not None else None


def eager_backward_device(device, grad):
    """For an op call in the backward of a fused op whose forward's op calls ran on `device` (eager_device),
    on the gradient `grad` and the forward's tensors: `device` where it may run its implementation directly
    too, else None. What may differ from the forward there: the grad mode (create_graph), the modes, and
    the gradient autograd passed (a tensor subclass)."""
    if device is None or type(grad) not in _PLAIN_TENSORS or torch.is_grad_enabled() or _modes_or_tracing():
        return None
    return device


def _plain_eager_call(args):
    """Whether an op call may skip torch.library's dispatch: None where it may not, else (whether a tensor
    among `args` requires grad, their device for _implementation where none is float64, else None: it then
    looks for itself). It may not while torch.compile traces, under a dispatch or function mode or a functorch
    transform (they must see the op), or with a tensor that is not a plain CPU or CUDA one (a subclass, or
    meta: those dispatch to the op's fake or their own handling). One pass over the arguments, for both."""
    return None if _modes_or_tracing() else _plain_tensors(args)


def _plain_tensors(args):
    """None where a tensor among `args` (the other arguments skipped) is not a plain CPU or CUDA one, else
    (whether one requires grad, their device where none is float64, else None)."""
    requires_grad, device, float64 = False, None, False
    for a in args:
        if isinstance(a, torch.Tensor):
            if not (type(a) in _PLAIN_TENSORS and (a.is_cpu or a.is_cuda)):
                return None
            requires_grad = requires_grad or a.requires_grad
            float64 = float64 or a.dtype == torch.float64
            if device is None:
                device = a.device
    return requires_grad, None if float64 else device


def grad_leaves(*tensors):
    """Fresh copies of `tensors` that require grad (None stays None): a sample's forward inputs."""
    return tuple(t.detach().clone().requires_grad_() if t is not None else None for t in tensors)


def registered_calls():
    """(family, call) for every PublicCall of every family."""
    return [(family, call) for family in FAMILIES.values() for call in family.calls]
