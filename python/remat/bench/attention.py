"""Attention cases: remat's Triton kernels against SDPA's flash, cuDNN and efficient backends and FlexAttention.

FLOP model: forward 4·b·h·s²·d, halved when causal; backward 2.5 times the forward; forward +
backward 3.5 times. Inputs are (b, h, s, d), bf16 by default.
"""

import functools

import torch
import torch.nn.functional as F

import remat

from .cases import Case, Implementation

GPU_SHAPES = ((8, 16, 2048, 64), (4, 16, 4096, 128), (1, 16, 16384, 128))
QUICK_SHAPES = GPU_SHAPES  # the shapes attention is judged at; --quick only times fewer calls
CPU_SHAPES = ((1, 2, 128, 64),)


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v, causal):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


@functools.cache
def _flex_compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # one kernel per shape and head dim


@functools.cache
def _causal_block_mask(seq, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: q >= k, None, None, seq, seq, device=device)


def _flex(q, k, v, causal):
    block_mask = _causal_block_mask(q.shape[2], str(q.device)) if causal else None
    return _flex_compiled()(q, k, v, block_mask=block_mask)


def _remat(q, k, v, causal):
    return remat.attention(q, k, v, causal=causal)


def implementations(device):
    impls = [(f"remat-{remat._backend.choose('attention', device)}", True, _remat)]
    if device.type == "cuda":
        impls += [(f"sdpa-{name}", False, _sdpa(backend)) for name, backend in
                  (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))]
        impls.append(("flex_attention", False, _flex))
    else:
        impls.append(("sdpa", False, lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    return impls


def _make_inputs(shape, dtype, device):
    def make():
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(shape, device=device, dtype=dtype)

    return make


def _forward(fn, causal):
    def build(inputs):
        q, k, v, _ = inputs
        return (lambda: fn(q, k, v, causal)), None

    return build


def _backward(fn, causal):
    def build(inputs):
        q, k, v, do = inputs
        out = {}

        def reset():  # the forward is untimed: only the backward is measured
            q.grad = k.grad = v.grad = None
            out["o"] = fn(q, k, v, causal)

        return (lambda: out["o"].backward(do)), reset

    return build


def _forward_backward(fn, causal):
    def build(inputs):
        q, k, v, do = inputs

        def reset():
            q.grad = k.grad = v.grad = None

        return (lambda: fn(q, k, v, causal).backward(do)), reset

    return build


def cases(device, dtypes, quick, sizes=None):
    shapes = (QUICK_SHAPES if quick else GPU_SHAPES) if device.type == "cuda" else CPU_SHAPES
    if sizes:
        shapes = [(1, 16, s, 128) for s in sizes]
    impls = implementations(device)
    for dtype in dtypes:
        for b, h, s, d in shapes:
            for causal in (False, True):
                forward_flops = 4 * b * h * s * s * d / (2 if causal else 1)
                for mode, factor, wrap in (("fwd", 1.0, _forward), ("bwd", 2.5, _backward),
                                           ("fwd+bwd", 3.5, _forward_backward)):
                    yield Case(
                        op="attention" + ("_causal" if causal else ""), mode=mode, dtype=dtype,
                        shape=f"b={b} h={h} s={s} d={d}", size=s, unit="TFLOP/s", work=factor * forward_flops,
                        make_inputs=_make_inputs((b, h, s, d), dtype, device),
                        implementations=[Implementation(name, ours, wrap(fn, causal)) for name, ours, fn in impls],
                    )
