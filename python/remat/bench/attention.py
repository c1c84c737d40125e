"""Attention cases: remat's Triton and CUDA kernels against SDPA's flash, cuDNN and efficient backends, FlexAttention.

The CUDA kernels have two rows: remat-cuda, whose backward adds dQ by atomics in one pass (torch's
default setting), and remat-cuda-deterministic, under torch.use_deterministic_algorithms(True),
whose backward runs the dQ kernel (bitwise reproducible; S and dP computed twice).

FLOP model: forward 4·b·h·s²·d, halved when causal; backward 2.5 times the forward; forward +
backward 3.5 times. Inputs are (b, h, s, d), bf16 by default. Checked against SDPA with its
default backend: output and the gradients of q, k and v; the three modes of a shape share their
inputs, so its float64 reference is computed once.

Feature cases, causal: a sliding window (Mistral's) and logit softcapping (Gemma 2's), against
FlexAttention (block mask, score_mod) and, for the window, SDPA's efficient backend with an explicit
mask (flash and cuDNN take no such mask; nothing in SDPA softcaps); dropout (p = 0.1) against SDPA's
flash and efficient backends (FlexAttention has none). Their FLOP model counts the scores computed:
the window's b·h·(keys each row sees, summed)·4·d for the forward. The dropout case is timed
unchecked: every implementation draws its own mask (tests/ops/test_attention_dropout.py checks
remat's against a reference that rebuilds the same mask).
"""

import functools

import torch
import torch.nn.functional as F

import remat

from .cases import Case, Variant, check_against, op_built, ours_by_backend
from .check import outputs_and_grads

GPU_SHAPES = ((8, 16, 2048, 64), (4, 16, 4096, 128), (1, 16, 16384, 128))
QUICK_SHAPES = GPU_SHAPES  # the shapes attention is judged at; --quick only times fewer calls
CPU_SHAPES = ((1, 2, 128, 64),)
SIZES_MEAN = "sequence lengths s"  # what cases(sizes=...), `remat bench --shapes`, sets
# The float64 reference runs this many bytes of attention scores at a time: all 16 heads of a
# 16384-long sequence at once would take 34 GB for the scores alone, and as much again for each
# tensor the backward keeps.
REFERENCE_CHUNK_BYTES = 2**30


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v, causal, mask=None):
        with sdpa_kernel([chosen]):
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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


# The feature cases: name -> remat.attention's keywords (causal=True besides), by device type.
WINDOW = {"cuda": 512, "cpu": 32}  # keys left of the diagonal each row sees (window_size=(WINDOW, 0))
SOFTCAP = 50.0  # Gemma 2's attention softcap
DROPOUT_P = 0.1
FEATURES = ("window", "softcap", "dropout")


def feature_keywords(feature, device):
    return {"window": dict(window_size=(WINDOW[device.type], 0)), "softcap": dict(softcap=SOFTCAP),
            "dropout": dict(dropout_p=DROPOUT_P)}[feature]


@functools.cache
def _window_block_mask(seq, window, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: (q >= k) & (q - k <= window), None, None, seq, seq, device=device)


def _flex_feature(feature):
    def softcap(score, b, h, q, k):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def run(q, k, v, causal):
        if feature == "window":
            return _flex_compiled()(q, k, v, block_mask=_window_block_mask(q.shape[2], WINDOW["cuda"], str(q.device)))
        return _flex_compiled()(q, k, v, score_mod=softcap, block_mask=_causal_block_mask(q.shape[2], str(q.device)))

    return run


def _sdpa_window(backend=None):
    """SDPA with the window as an explicit boolean mask (backend None: SDPA's default choice)."""
    def run(q, k, v, causal):
        window = WINDOW[q.device.type]
        mask = remat.ops.attention._visible_mask(q.shape[2], k.shape[2], q.device, window, 0)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return _sdpa(backend)(q, k, v, mask)

    return run


def _reference_in_dtype(feature):
    """The explicit-softmax reference in the inputs' dtype: the stock computation where SDPA has none."""
    def run(q, k, v, causal):
        return remat.ops.attention.attention_ref(q, k, v, True, **_reference_keywords(feature, q.device))[0]

    return run


def _reference_keywords(feature, device):
    if feature == "window":
        return dict(window_left=WINDOW[device.type], window_right=0)
    return dict(softcap=SOFTCAP)


def _remat_feature(feature):
    def run(q, k, v, causal):
        return remat.attention(q, k, v, causal=True, **feature_keywords(feature, q.device))

    return run


def _sdpa_dropout(backend=None):
    def run(q, k, v, causal):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT_P)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT_P)

    return run


def feature_implementations(device, feature):
    """A Variant for every implementation of a feature case, and the stock one its check builds on
    (None for dropout: no two implementations draw the same mask)."""
    if device.type == "cuda":  # the Triton kernels and the CUDA extension's, each its rows
        ours = [Variant(name, True, _remat_feature(feature), backend) for name, backend in ours_by_backend(device)]
    else:
        ours = [Variant(f"remat-{remat._backend.choose('attention', device, kernels=('triton',))}", True,
                        _remat_feature(feature))]
    if feature == "dropout":
        if device.type != "cuda":
            return ours + [Variant("sdpa", False, _sdpa_dropout())], None
        return ours + [Variant(f"sdpa-{name}", False, _sdpa_dropout(backend)) for name, backend in
                       (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))], None
    stock = _sdpa_window() if feature == "window" else _reference_in_dtype(feature)
    if device.type != "cuda":
        return ours + [Variant("sdpa" if feature == "window" else "reference", False, stock)], stock
    impls = list(ours)
    if feature == "window":
        impls.append(Variant("sdpa-efficient", False, _sdpa_window("EFFICIENT_ATTENTION")))
    impls.append(Variant("flex_attention", False, _flex_feature(feature), compiles=True))
    return impls, stock


def _remat(q, k, v, causal):
    return remat.attention(q, k, v, causal=causal)


def _sdpa_default(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def implementations(device):
    """A Variant (a function of q, k, v, causal) for every implementation."""
    if device.type == "cuda":  # the Triton kernels and the CUDA extension's, each in its own rows
        ours = ours_by_backend(device)
        impls = [Variant(name, True, _remat, backend) for name, backend in ours]
        if any(backend == "cuda" for _, backend in ours):
            # The CUDA backward as torch.use_deterministic_algorithms(True) runs it (its dQ kernel,
            # bitwise reproducible) beside the default one pass with dQ added by atomics.
            impls.append(Variant("remat-cuda-deterministic", True, _remat, "cuda", deterministic=True))
    else:
        impls = [Variant(f"remat-{remat._backend.choose('attention', device, kernels=('triton',))}", True, _remat)]
    if device.type == "cuda":
        impls += [Variant(f"sdpa-{name}", False, _sdpa(backend)) for name, backend in
                  (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))]
        impls.append(Variant("flex_attention", False, _flex, compiles=True))
    else:
        impls.append(Variant("sdpa", False, _sdpa_default))
    return impls


_SHARED = {}  # the inputs of the (shape, dtype, variant) being measured: its three modes use them


def _make_inputs(shape, dtype, device, variant):
    def make():
        key = (shape, dtype, str(device), variant)
        if key not in _SHARED:
            _SHARED.clear()  # the previous shape's inputs go before the next are made
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            _SHARED[key] = (q, k, v, torch.randn(shape, device=device, dtype=dtype))
        return _SHARED[key]

    return make


def _float64_reference(causal, attend=None):
    """Outputs of SDPA (or of attend(q, k, v, causal)) in float64, a few heads at a time
    (REFERENCE_CHUNK_BYTES), each chunk's backward run before the next chunk's forward."""
    attend = attend or _sdpa_default

    def reference(inputs):
        q, k, v, do = (t.detach().double() for t in inputs)
        batch, heads, seqlen_q, dim = q.shape
        flat = [t.reshape(batch * heads, 1, t.shape[2], dim) for t in (q, k, v, do)]  # one head per row
        per_chunk = max(1, REFERENCE_CHUNK_BYTES // (seqlen_q * k.shape[2] * 8))
        parts = {name: [] for name in ("out", "dq", "dk", "dv")}
        for start in range(0, batch * heads, per_chunk):
            q_c, k_c, v_c, do_c = (t[start:start + per_chunk] for t in flat)
            leaves = {"q": q_c.requires_grad_(), "k": k_c.requires_grad_(), "v": v_c.requires_grad_()}
            found = outputs_and_grads(lambda q_c=q_c, k_c=k_c, v_c=v_c: attend(q_c, k_c, v_c, causal),
                                      leaves, do_c)
            for name, tensor in found.items():
                parts[name].append(tensor)
        return {name: torch.cat(tensors).view(batch, heads, -1, dim) for name, tensors in parts.items()}

    return reference


def _build(mode, causal):
    def wrap(fn):
        def build(inputs):
            q, k, v, do = inputs
            return op_built(mode, lambda: fn(q, k, v, causal), {"q": q, "k": k, "v": v}, do)

        return build

    return wrap


def sanitize_calls(device, dtype):
    """The calls of remat.attention that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: GQA with seqlen_q != seqlen_k, causal (masked tails, the mask off the
    diagonal); then a window with softcapping and ALiBi at head dim 256 (skipped blocks, the
    column halves of dK/dV); dropout at head dim 128 (the mask drawn in each kernel)."""
    q = torch.randn(1, 2, 37, 64, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 1, 45, 64, device=device, dtype=dtype, requires_grad=True)
    yield functools.partial(remat.attention, q, k, k, causal=True)
    q = torch.randn(1, 2, 150, 256, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 90, 256, device=device, dtype=dtype, requires_grad=True)
    slopes = torch.rand(2, device=device)
    yield functools.partial(remat.attention, q, k, k, window_size=(10, 25), softcap=3.0, alibi_slopes=slopes)
    q = torch.randn(2, 2, 70, 128, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 130, 128, device=device, dtype=dtype, requires_grad=True)
    yield functools.partial(remat.attention, q, k, k, causal=True, dropout_p=0.2)


def cases(device, dtypes, quick, sizes=None):
    shapes = (QUICK_SHAPES if quick else GPU_SHAPES) if device.type == "cuda" else CPU_SHAPES
    if sizes:
        shapes = [(1, 16, s, 128) for s in sizes]
    impls = implementations(device)
    for dtype in dtypes:
        for b, h, s, d in shapes:
            for causal in (False, True):
                forward_flops = 4 * b * h * s * s * d / (2 if causal else 1)
                check = check_against(_build("fwd+bwd", causal)(_sdpa_default), _float64_reference(causal))
                make_inputs = _make_inputs((b, h, s, d), dtype, device, causal)
                yield from _modes("attention" + ("_causal" if causal else ""), dtype, (b, h, s, d), forward_flops,
                                  make_inputs, impls, causal, check)
        yield from _feature_cases(device, dtype, shapes[0])


_MODES = (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5))  # (mode, its FLOPs per forward FLOP)


def _modes(op, dtype, shape, forward_flops, make_inputs, impls, causal, check):
    b, h, s, d = shape
    for mode, factor in _MODES:
        yield Case(
            op=op, mode=mode, dtype=dtype, shape=f"b={b} h={h} s={s} d={d}", size=s, unit="TFLOP/s",
            work=factor * forward_flops, make_inputs=make_inputs,
            implementations=[impl.implementation(_build(mode, causal)) for impl in impls], check=check,
        )


def _feature_cases(device, dtype, shape):
    """The window, softcap and dropout cases at one shape (causal), each against its peers."""
    b, h, s, d = shape
    for feature in FEATURES:
        impls, stock = feature_implementations(device, feature)
        if feature == "window":  # row i sees min(i, WINDOW) + 1 keys
            window = WINDOW[device.type]
            scores = sum(min(i, window) + 1 for i in range(s))
        else:
            scores = s * (s + 1) // 2
        check = None if stock is None else check_against(
            _build("fwd+bwd", True)(stock), _float64_reference(True, _reference_in_dtype(feature)))
        make_inputs = _make_inputs((b, h, s, d), dtype, device, f"causal-{feature}")
        yield from _modes(f"attention_{feature}", dtype, shape, 4 * b * h * scores * d, make_inputs, impls, True,
                          check)
