"""The built CUDA extension remat._C: each csrc/*.cu registers its ops, and their argument checks.

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


def test_each_source_registers_its_ops_as_cuda_kernels_of_the_python_custom_ops():
    """The ops of remat_C are those the .cu files define (a source missing from the build, or a
    stale build, shows here); each has a CUDA kernel and the schema of the remat:: custom op of the
    same name, whose CUDA implementation it is."""
    defined = ops_defined_in_sources()
    registered = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith("remat_C::"))
    assert defined, f"no m.def in {CSRC}/*.cu"
    assert registered == sorted(defined), "remat._C does not register what csrc/*.cu defines (rebuild it?)"
    for name, source in defined.items():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"remat_C::{name}", "CUDA"), f"{source}: {name}"
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
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_a_bad_argument_raises_an_error_naming_the_op_and_the_argument(case):
    op, arguments, message = BAD_ARGUMENTS[case]
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = arguments(cuda(4, 8))
        with pytest.raises(RuntimeError, match=f"^{message}"):
            getattr(torch.ops.remat_C, op).default.redispatch(CUDA_KEY, *args)
