"""Whether the Triton interpreter (TRITON_INTERPRET=1, Triton kernels on CPU tensors) multiplies
bfloat16 matrices right.

The interpreter keeps bfloat16 values as their raw 16 bits (numpy uint16), and its tl.dot hands
those to numpy's matmul as integers (triton issue 11584): a bf16 tl.dot returns garbage (a 16 x 16
product off by ~1e10). remat's attention kernels multiply with tl.dot, so under the interpreter
their bf16 results would be silently wrong; remat asks this check first and refuses instead. The
tests make the interpreter's bf16 dot exact (tests/_helpers/numerics.py) and assert, with this
same check, that the patch took.
"""

import functools

import torch
import triton
import triton.language as tl

_SIZE = 16  # tl.dot's smallest tile


@triton.jit
def _bf16_dot(A, B, C, SIZE: tl.constexpr):  # A, B: (SIZE, SIZE) bf16; C: (SIZE, SIZE) fp32
    rows = tl.arange(0, SIZE)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
    tl.store(C + rows, tl.dot(tl.load(A + rows), tl.load(B + rows)))


def bf16_dot_is_exact():
    """True when a bf16 tl.dot on CPU tensors gives the fp32-accumulated product of its bf16 inputs."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(_SIZE, _SIZE, generator=generator).to(torch.bfloat16) for _ in range(2))
    c = torch.empty(_SIZE, _SIZE)
    _bf16_dot[(1,)](a, b, c, SIZE=_SIZE)
    want = a.double() @ b.double()
    return bool(((c.double() - want).norm() <= 1e-5 * want.norm()).item())


@functools.cache
def bf16_dot_checked():
    """bf16_dot_is_exact(), asked once per process (the tests patch the interpreter before any op runs)."""
    return bf16_dot_is_exact()
