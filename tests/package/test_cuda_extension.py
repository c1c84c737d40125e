"""The built CUDA extension remat._C: each csrc/*.cu registers its ops, with the schemas of the
Python custom ops of the same names, and their argument checks reject bad arguments by name and
pass valid ones (strided halves of one projection, the RMSNorm styles' dtype rules).

Needs the extension built (skips without it), not a GPU: the registrations are read from the
dispatcher, and the argument checks run in the CUDA kernels on fake CUDA tensors (metadata only,
no data), called through the CUDA dispatch key directly. Every check comes before the first CUDA
call, so a bad argument raises on any machine.
"""

import glob
import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat  # noqa: F401  (registers the remat:: custom ops the extension's kernels stand in for)
from remat.ops._family import FAMILIES

pytest.importorskip("remat._C", reason="the CUDA extension remat._C is not built")

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def ops_defined_in_sources():
    """{op name: source file} of every m.def("name(...)") in csrc/*.cu."""
    defined = {}
    for source in sorted(glob.glob(os.path.join(CSRC, "*.cu"))):
        with open(source) as f:
            for name in re.findall(r'm\.def\(\s*"(\w+)\(', f.read()):
                defined[name] = os.path.basename(source)
    return defined


# The families' tools (attention_launch_plan): ops that launch nothing, one kernel for every device.
TOOLS = {name.split("::", 1)[1] for family in FAMILIES.values() for name in family.cuda_tools}


def test_each_source_registers_its_ops_as_cuda_kernels():
    """The ops of remat_C are those the .cu files define (a source missing from the build, or a
    stale build, shows here), and each has a CUDA kernel (a tool, one for every device)."""
    defined = ops_defined_in_sources()
    registered = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith("remat_C::"))
    assert defined, f"no m.def in {CSRC}/*.cu"
    assert registered == sorted(defined), "remat._C does not register what csrc/*.cu defines (rebuild it?)"
    assert TOOLS <= set(defined)
    for name, source in defined.items():
        key = "CompositeImplicitAutograd" if name in TOOLS else "CUDA"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"remat_C::{name}", key), f"{source}: {name}"


@pytest.mark.parametrize("name", sorted(set(ops_defined_in_sources()) - TOOLS))
def test_each_extension_op_has_the_schema_of_the_python_custom_op_of_its_name(name):
    """remat_C::<name> is the CUDA implementation of the remat::<name> custom op: same schema."""
    source = ops_defined_in_sources()[name]
    assert hasattr(torch.ops.remat, name), f"{source} defines remat_C::{name}, but there is no remat::{name} op"
    extension = str(getattr(torch.ops.remat_C, name).default._schema).split("::", 1)[1]
    python = str(getattr(torch.ops.remat, name).default._schema).split("::", 1)[1]
    assert extension == python, f"{source}: {name}"


def cuda(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def cpu(*shape):
    return torch.empty(*shape)


def strided(n):
    """(n,) with a stride of 2: not contiguous."""
    return cuda(2 * n)[::2]


def transposed(m, n):
    """(m, n) with a column stride of m: the transpose of a contiguous (n, m)."""
    return cuda(n, m).t()


# (op, argument builder on fake CUDA tensors, the error). x is (4, 8) float32 unless said.
BAD_ARGUMENTS = {
    "gelu approximate": ("gelu_fwd", lambda x: (x, None, "exact"),
                         "gelu: approximate must be 'none', 'tanh' or 'quick', got 'exact'"),
    "gelu x on cpu": ("gelu_fwd", lambda x: (cpu(4, 8), None, "none"), "gelu: x must be a CUDA tensor, got device cpu"),
    "gelu x 3-D": ("gelu_fwd", lambda x: (cuda(2, 4, 8), None, "none"),
                   r"gelu: x must be 2-D \(M, N\), got shape \[2, 4, 8\]"),
    "gelu x float64": ("gelu_fwd", lambda x: (cuda(4, 8, dtype=torch.float64), None, "tanh"),
                       "gelu: x must be float32, float16 or bfloat16, got Double"),
    "gelu x column stride": ("gelu_fwd", lambda x: (transposed(4, 8), None, "none"),
                             r"gelu: x must have a unit stride in its last dim, got strides \[1, 4\]"),
    "gelu bias on cpu": ("gelu_fwd", lambda x: (x, cpu(8), "none"), "gelu: bias is on cpu but x is on cuda:0"),
    "gelu bias shape": ("gelu_fwd", lambda x: (x, cuda(1, 8), "none"),
                        r"gelu: bias must have shape \(8,\), got \[1, 8\]"),
    "gelu bias strided": ("gelu_fwd", lambda x: (x, strided(8), "none"), "gelu: bias must be contiguous"),
    "gelu bias int64": ("gelu_fwd", lambda x: (x, cuda(8, dtype=torch.int64), "none"),
                        "gelu: bias must be float32, float16 or bfloat16, got Long"),
    "gelu dy on cpu": ("gelu_bwd", lambda x: (cpu(4, 8), x, None, "none", False),
                       "gelu: dy must be a CUDA tensor, got device cpu"),
    "gelu dy shape": ("gelu_bwd", lambda x: (cuda(4, 9), x, None, "none", False),
                      r"gelu: dy must have x's shape \[4, 8\], got \[4, 9\]"),
    "gelu dy dtype": ("gelu_bwd", lambda x: (cuda(4, 8, dtype=torch.float16), x, None, "none", True),
                      "gelu: dy must have x's dtype Float, got Half"),
    "layer_norm x N = 0": ("layer_norm_fwd", lambda x: (cuda(4, 0), None, None, 1e-5),
                           r"layer_norm: x must have N >= 1 columns, got shape \[4, 0\]"),
    "layer_norm x int8": ("layer_norm_fwd", lambda x: (cuda(4, 8, dtype=torch.int8), None, None, 1e-5),
                          "layer_norm: x must be float32, float16 or bfloat16, got Char"),
    "layer_norm weight shape": ("layer_norm_fwd", lambda x: (x, cuda(9), None, 1e-5),
                                r"layer_norm: weight must have shape \(8,\), got \[9\]"),
    "layer_norm bias strided": ("layer_norm_fwd", lambda x: (x, None, strided(8), 1e-5),
                                "layer_norm: bias must be contiguous"),
    "layer_norm weight dtype": ("layer_norm_fwd", lambda x: (x, cuda(8, dtype=torch.float16), None, 1e-5),
                                "layer_norm: weight and bias must be float32 or x's dtype Float, got Half"),
    "layer_norm dy N = 0": ("layer_norm_bwd", lambda x: (cuda(4, 0), x, None, None, cuda(4), cuda(4), False),
                            r"layer_norm: dy must have N >= 1 columns, got shape \[4, 0\]"),
    "layer_norm dy dtype": ("layer_norm_bwd",
                            lambda x: (cuda(4, 8, dtype=torch.bfloat16), x, None, None, cuda(4), cuda(4), False),
                            "layer_norm: dy must have x's dtype Float, got BFloat16"),
    "layer_norm mean on cpu": ("layer_norm_bwd", lambda x: (x, x, None, None, cpu(4), cuda(4), False),
                               "layer_norm: mean is on cpu but x is on cuda:0"),
    "layer_norm rstd shape": ("layer_norm_bwd", lambda x: (x, x, None, None, cuda(4), cuda(5), False),
                              r"layer_norm: rstd must have shape \(4,\), got \[5\]"),
    "rms_norm style": ("rms_norm_fwd", lambda x: (x, cuda(8), 1e-6, "mistral"),
                       "rms_norm: style must be 'torch', 'llama', 'gemma' or 't5', got 'mistral'"),
    "rms_norm weight required": ("rms_norm_fwd", lambda x: (x, None, 1e-6, "llama"),
                                 r"rms_norm: weight is required for style 'llama' \(its stock module always has one\)"),
    "rms_norm weight shape": ("rms_norm_fwd", lambda x: (x, cuda(9), 1e-6, "torch"),
                              r"rms_norm: weight must have shape \(8,\), got \[9\]"),
    "rms_norm weight int32": ("rms_norm_fwd", lambda x: (x, cuda(8, dtype=torch.int32), 1e-6, "gemma"),
                              "rms_norm: weight must be float32, float16 or bfloat16, got Int"),
    "rms_norm weight on cpu": ("rms_norm_fwd", lambda x: (x, cpu(8), 1e-6, "t5"),
                               "rms_norm: weight is on cpu but x is on cuda:0"),
    "rms_norm eps negative": ("rms_norm_fwd", lambda x: (x, None, -1e-6, "torch"),
                              "rms_norm: eps must be a non-negative float, got -1e-06"),
    "rms_norm eps nan": ("rms_norm_fwd", lambda x: (x, None, float("nan"), "torch"),
                         "rms_norm: eps must be a non-negative float, got nan"),
    "rms_norm x N = 0": ("rms_norm_fwd", lambda x: (cuda(4, 0), None, 1e-6, "torch"),
                         r"rms_norm: x must have N >= 1 columns, got shape \[4, 0\]"),
    "rms_norm x float64": ("rms_norm_fwd", lambda x: (cuda(4, 8, dtype=torch.float64), None, 1e-6, "torch"),
                           "rms_norm: x must be float32, float16 or bfloat16, got Double"),
    "rms_norm dy shape": ("rms_norm_bwd", lambda x: (cuda(4, 9), x, None, cuda(4), "torch", False),
                          r"rms_norm: dy must have x's shape \[4, 8\], got \[4, 9\]"),
    # llama on bf16 x with an fp32 weight: y (so dy) is fp32, the promoted dtype, as LlamaRMSNorm's
    "rms_norm dy dtype llama": ("rms_norm_bwd",
                                lambda x: (cuda(4, 8, dtype=torch.bfloat16), cuda(4, 8, dtype=torch.bfloat16),
                                           cuda(8), cuda(4), "llama", True),
                                "rms_norm: dy must have y's dtype Float, got BFloat16"),
    # t5 on fp32 x with a bf16 weight: y (so dy) in the weight's dtype, as T5LayerNorm's
    "rms_norm dy dtype t5": ("rms_norm_bwd", lambda x: (x, x, cuda(8, dtype=torch.bfloat16), cuda(4), "t5", False),
                             "rms_norm: dy must have y's dtype BFloat16, got Float"),
    "rms_norm bwd weight required": ("rms_norm_bwd", lambda x: (x, x, None, cuda(4), "gemma", False),
                                     "rms_norm: weight is required for style 'gemma'"),
    "rms_norm rstd dtype": ("rms_norm_bwd", lambda x: (x, x, None, cuda(4, dtype=torch.bfloat16), "torch", False),
                            "rms_norm: rstd must be float32, got BFloat16"),
    "rms_norm rstd shape": ("rms_norm_bwd", lambda x: (x, x, None, cuda(4, 1), "torch", False),
                            r"rms_norm: rstd must have shape \(4,\), got \[4, 1\]"),
    "gated activation": ("gated_fwd", lambda x: (x, x, "relu", False),
                         "gated: activation must be 'silu', 'gelu' or 'gelu_tanh', got 'relu'"),
    "gated gate 1-D": ("gated_fwd", lambda x: (cuda(8), cuda(8), "silu", False),
                       r"gated: gate must be 2-D \(M, N\), got shape \[8\]"),
    "gated up on cpu": ("gated_fwd", lambda x: (x, cpu(4, 8), "gelu", True),
                        "gated: up must be a CUDA tensor, got device cpu"),
    "gated up shape": ("gated_fwd", lambda x: (x, cuda(4, 9), "gelu_tanh", False),
                       r"gated: up must have gate's shape \[4, 8\], got \[4, 9\]"),
    "gated up dtype": ("gated_fwd", lambda x: (x, cuda(4, 8, dtype=torch.float16), "silu", False),
                       "gated: up must have gate's dtype Float, got Half"),
    "gated up column stride": ("gated_fwd", lambda x: (x, transposed(4, 8), "silu", False),
                               r"gated: up must have a unit stride in its last dim, got strides \[1, 4\]"),
    "gated bwd activation": ("gated_bwd", lambda x: (x, x, x, "swish", True, False),
                             "gated: activation must be 'silu', 'gelu' or 'gelu_tanh', got 'swish'"),
    "gated dy shape": ("gated_bwd", lambda x: (cuda(3, 8), x, x, "silu", False, False),
                       r"gated: dy must have gate's shape \[4, 8\], got \[3, 8\]"),
    "gated dy dtype": ("gated_bwd", lambda x: (cuda(4, 8, dtype=torch.bfloat16), x, x, "gelu", True, True),
                       "gated: dy must have gate's dtype Float, got BFloat16"),
}


def call_cuda_kernel(op, arguments):
    """remat_C::<op>'s CUDA kernel on the fake CUDA tensors arguments(x) builds, x (4, 8) float32."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        return getattr(torch.ops.remat_C, op).default.redispatch(CUDA_KEY, *arguments(cuda(4, 8)))


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_a_bad_argument_raises_an_error_naming_the_op_and_the_argument(case):
    op, arguments, message = BAD_ARGUMENTS[case]
    with pytest.raises(RuntimeError, match=f"^{message}"):
        call_cuda_kernel(op, arguments)


def halves(m, n, dtype=torch.float32):
    """The two (m, n) halves of one (m, 2n) tensor, as a fused gate_up projection gives them."""
    return cuda(m, 2 * n, dtype=dtype).chunk(2, dim=1)


# Arguments the checks must accept (the calls then fail past the checks: fake tensors have no data).
GOOD_ARGUMENTS = {
    "gated halves": ("gated_fwd", lambda x: (*halves(4, 8), "silu", True)),
    "gated halves at a ragged width": ("gated_bwd", lambda x: (cuda(4, 5), *halves(4, 5), "gelu", True, False)),
    "rms_norm llama, fp32 weight on bf16 x": ("rms_norm_bwd",
                                              lambda x: (x, x.bfloat16(), x[0], cuda(4), "llama", True)),
    "rms_norm t5, bf16 weight on fp32 x": ("rms_norm_bwd",
                                           lambda x: (x.bfloat16(), x, x[0].bfloat16(), cuda(4), "t5", False)),
    "rms_norm gemma, fp16 weight on bf16 x": ("rms_norm_fwd", lambda x: (x.bfloat16(), x[0].half(), 0.0, "gemma")),
    "gelu quick": ("gelu_bwd", lambda x: (x, x, None, "quick", True)),
}


@pytest.mark.parametrize("case", GOOD_ARGUMENTS)
def test_valid_arguments_pass_the_argument_checks(case):
    """Strided halves of one tensor, the styles' dtype rules for y and dy, QuickGELU: no error
    naming the op (the op family prefix every check's message starts with)."""
    op, arguments = GOOD_ARGUMENTS[case]
    family = op.rsplit("_", 1)[0]
    try:
        call_cuda_kernel(op, arguments)
    except Exception as error:  # past the checks: no device or no data, never a bad argument
        assert not str(error).startswith(f"{family}: "), str(error)
