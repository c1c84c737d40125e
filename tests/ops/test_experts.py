"""remat.experts, the routed experts of a mixture of experts: every layout and activation transformers'
experts modules use, against a float64 reference and the stock eager loop, the bytes autograd keeps
under both policies, expert-parallel sentinels, experts without a token, determinism, compile and
bad input. The family's ops are opchecked on its samples by tests/ops/test_op_registry.py."""

import dataclasses

import pytest
import torch

import remat
from remat.ops.experts import route, sample_routing, stock_experts
from remat.specs import Norm

from numerics import COMPILE_BACKEND, REL_TOL, assert_raises_naming, rel_error, saved_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclasses.dataclass(frozen=True)
class Layer:
    """An experts layer's shape and options, as transformers' experts modules declare them."""

    tokens: int
    width: int
    inter: int
    experts: int
    top_k: int
    activation: str = "silu"
    gated: bool = True
    interleaved: bool = False
    transposed: bool = False
    biases: bool = False
    limit: float = 7.0

    @property
    def n1(self):
        return 2 * self.inter if self.gated else self.inter

    def options(self):
        return dict(activation=self.activation, gated=self.gated, interleaved=self.interleaved,
                    transposed=self.transposed, limit=self.limit)


# Qwen3-MoE / Mixtral (concatenated SwiGLU), GeGLU, gpt-oss (transposed, interleaved, clamped SwiGLU
# with biases; a limit near 1 so that the clamps act on these unit-scale values), Nemotron-H
# (non-gated squared ReLU), the other non-gated activations, one token, and top-8. The limit, 1.01, is no fp16 or bf16
# number: a pre-activation rounded to exactly the limit would take the clamp's gradient or not by
# its rounding (one ulp of a matmul's summation order), not by the computation; the float64
# reference never rounds there, so with a representable limit the test would measure coin flips.
QWEN = Layer(13, 40, 36, 5, 2)
GPT_OSS = Layer(13, 40, 20, 5, 3, "swiglu_clamped", interleaved=True, transposed=True, biases=True, limit=1.01)
LAYERS = {
    "qwen3_moe": QWEN,
    "geglu": Layer(7, 24, 20, 5, 3, "gelu"),
    "geglu_tanh_one_token": Layer(1, 24, 36, 5, 2, "gelu_tanh"),
    "gpt_oss": GPT_OSS,
    "nemotron_relu2": Layer(7, 24, 36, 5, 1, "relu2", gated=False, biases=True),
    "plain_relu": Layer(7, 40, 20, 5, 2, "relu", gated=False),
    "plain_silu": Layer(7, 24, 20, 5, 2, "silu", gated=False),
    "plain_gelu_tanh": Layer(7, 24, 20, 5, 2, "gelu_tanh", gated=False),
    "top_8": Layer(7, 24, 20, 10, 8),
}


def _inputs(layer, dtype, device, sentinel=True):
    """x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias (in the layer's layout): the
    last expert gets no token, and with `sentinel` one id is past the experts."""
    x = torch.randn(layer.tokens, layer.width, device=device)
    index = sample_routing(layer.tokens, layer.top_k, layer.experts, device, sentinel=sentinel)
    weights = torch.rand(layer.tokens, layer.top_k, device=device)
    gate_up = torch.randn(layer.experts, layer.n1, layer.width, device=device) / layer.width**0.5
    down = torch.randn(layer.experts, layer.width, layer.inter, device=device) / layer.inter**0.5
    if layer.transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    biases = ((torch.randn(layer.experts, layer.n1, device=device) * 0.1,
               torch.randn(layer.experts, layer.width, device=device) * 0.1) if layer.biases else (None, None))
    return [x, index, weights, gate_up, down, *biases]


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() if t is not None and t.is_floating_point() else t for t in tensors]


def _run(fn, tensors, dy, layer, **kwargs):
    """(output, gradients of every floating tensor) of fn on `tensors`."""
    out = fn(*tensors, **layer.options(), **kwargs)
    grads = torch.autograd.grad(out, [t for t in tensors if t is not None and t.is_floating_point()], dy.to(out.dtype))
    return out, grads


GRAD_NAMES = ("x", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias")


def _check_against_float64(target, layer, dtype, keep_hidden):
    device, _ = target
    tensors = _inputs(layer, dtype, device)
    dy = torch.randn(layer.tokens, layer.width, device=device)
    ref_out, ref_grads = _run(stock_experts, _leaves(tensors, torch.float64), dy.double(), layer)
    stock_out, stock_grads = _run(stock_experts, _leaves(tensors, dtype), dy, layer)
    out, grads = _run(remat.experts, _leaves(tensors, dtype), dy, layer, keep_hidden=keep_hidden)
    assert out.dtype == dtype and out.shape == ref_out.shape
    # Twice the stock computation's own error in the same dtype; in fp32 both are near fp32's unit
    # roundoff, where the ratio of two errors is noise: there a tenth of the fp32 bound at least.
    floor = REL_TOL[dtype] / 10 if dtype == torch.float32 else 0.0
    names = [n for n, t in zip(GRAD_NAMES, tensors[:1] + tensors[2:]) if t is not None]
    for name, ours, stock, ref in zip(["out", *names], [out, *grads], [stock_out, *stock_grads],
                                      [ref_out, *ref_grads]):
        assert ours.dtype == stock.dtype and ours.shape == ref.shape, name
        assert torch.isfinite(ours).all(), name
        bound = max(2 * rel_error(stock, ref), floor)
        assert rel_error(ours, ref) <= bound, f"{name}: {rel_error(ours, ref):.3g} > {bound:.3g} ({dtype})"


@pytest.mark.parametrize("name", LAYERS)
def test_every_layout_and_activation_matches_float64_as_well_as_stock_fp32(target, name):
    _check_against_float64(target, LAYERS[name], torch.float32, keep_hidden=False)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_half_precision_errors_are_at_most_twice_stocks(target, name, dtype):
    _check_against_float64(target, LAYERS[name], dtype, keep_hidden=False)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "nemotron_relu2"])
def test_keeping_the_pre_activation_matches_float64_too(target, name):
    _check_against_float64(target, LAYERS[name], torch.float32, keep_hidden=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_policies_give_bitwise_the_same_results_and_repeat_bitwise(target, dtype):
    """The kept pre-activation is the one the recompute rebuilds (one code path, rounded alike), and
    the weight gradients are fixed-order sums (no atomics): every result is bitwise reproducible."""
    device, _ = target
    layer = GPT_OSS
    tensors = _inputs(layer, dtype, device)
    dy = torch.randn(layer.tokens, layer.width, device=device)
    results = [_run(remat.experts, _leaves(tensors, dtype), dy, layer, keep_hidden=keep) for keep in (False, True)]
    results.append(_run(remat.experts, _leaves(tensors, dtype), dy, layer, keep_hidden=False))
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        for got, want in zip(grads, results[0][1]):
            assert torch.equal(got, want)


def test_the_float64_reference_is_the_stock_computation_in_float64():
    layer = GPT_OSS
    tensors = _leaves(_inputs(layer, torch.float64, "cpu"), torch.float64)
    dy = torch.randn(layer.tokens, layer.width, dtype=torch.float64)
    out, grads = _run(remat.experts, tensors, dy, layer)
    stock_out, stock_grads = _run(stock_experts, _leaves(tensors, torch.float64), dy, layer)
    assert out.dtype == torch.float64 and rel_error(out, stock_out) <= 1e-12
    for got, want in zip(grads, stock_grads):
        assert got.dtype == torch.float64 and rel_error(got, want) <= 1e-12


# --- routing: sentinels and experts without a token ------------------------------------------------


def test_routing_sorts_pairs_stably_and_puts_sentinels_past_the_last_offset():
    index = torch.tensor([[2, 0], [5, 2], [0, 3]])  # 4 experts: 5 is a sentinel, expert 1 gets no token
    order, offsets = route(index, 4)
    assert order.tolist() == [1, 4, 0, 3, 5, 2]
    assert offsets.tolist() == [0, 2, 2, 4, 5]
    assert order.dtype == offsets.dtype == torch.int32


def test_sentinel_ids_are_skipped_and_get_no_gradient(target):
    """A pair routed to an id >= num_experts (another rank's expert) contributes nothing and its
    weight's gradient is 0, as transformers' grouped_mm implementation does; tokens routed only there
    get 0 and no gradient."""
    device, _ = target
    layer = QWEN
    x, index, weights, gate_up, down, *_ = _inputs(layer, torch.float32, device, sentinel=False)
    index = index.clone()
    index[0, :] = layer.experts  # token 0: every choice elsewhere
    index[1, 1] = layer.experts + 7
    x, weights, gate_up, down = _leaves([x, weights, gate_up, down], torch.float32)
    out = remat.experts(x, index, weights, gate_up, down)
    dx, dweights = torch.autograd.grad(out, [x, weights], torch.randn_like(out))
    kept = index < layer.experts
    expected = stock_experts(x.double(), index, weights.double() * kept, gate_up.double(), down.double())
    assert rel_error(out, expected) <= REL_TOL[torch.float32]
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(dx[0], torch.zeros_like(dx[0]))
    assert torch.equal(dweights[~kept], torch.zeros_like(dweights[~kept]))


def test_an_expert_without_a_token_gets_zero_gradients(target):
    device, _ = target
    layer = GPT_OSS
    tensors = _leaves(_inputs(layer, torch.float32, device), torch.float32)
    assert not (tensors[1] == layer.experts - 1).any()  # sample_routing leaves the last expert out
    out = remat.experts(*tensors, **layer.options())
    grads = torch.autograd.grad(out, tensors[3:], torch.randn_like(out))
    for name, grad in zip(GRAD_NAMES[2:], grads):
        last = grad[-1]  # experts first in every layout
        assert torch.equal(last, torch.zeros_like(last)), name
        assert grad.abs().sum() > 0, name


def test_no_token_gives_an_empty_output_and_zero_gradients(target):
    device, _ = target
    layer = dataclasses.replace(QWEN, tokens=0)
    tensors = _leaves(_inputs(layer, torch.float32, device), torch.float32)
    out = remat.experts(*tensors, **layer.options())
    assert out.shape == (0, layer.width)
    grads = torch.autograd.grad(out.sum(), [tensors[3], tensors[4]])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


# --- memory: what autograd keeps ----------------------------------------------------------------


@pytest.mark.parametrize("keep_hidden", [False, True], ids=["recompute", "keep-hidden"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_bytes_are_x_the_routing_and_with_keep_hidden_the_pre_activation(target, dtype, keep_hidden):
    """Recompute: x, top_k_weights, the sorted order (4 bytes a pair) and the offsets (4 bytes an expert,
    plus one); keep_hidden adds the pre-activation, T·K·N1 elements. The weights are the caller's."""
    device, _ = target
    layer = GPT_OSS
    x, index, weights, gate_up, down, b1, b2 = _leaves(_inputs(layer, dtype, device), dtype)
    params = [gate_up, down, b1, b2]
    got = saved_bytes(lambda: remat.experts(x, index, weights, gate_up, down, b1, b2, **layer.options(),
                                            keep_hidden=keep_hidden), exclude=params)
    pairs, elem = layer.tokens * layer.top_k, x.element_size()
    expected = x.numel() * elem + weights.numel() * elem + 4 * pairs + 4 * (layer.experts + 1)
    if keep_hidden:
        expected += pairs * layer.n1 * elem
    assert got == expected
    stock = saved_bytes(lambda: stock_experts(x, index, weights, gate_up, down, b1, b2, **layer.options()),
                        exclude=params)
    assert got < stock


# --- a norm in front: the post-attention norm fused in --------------------------------------------


def _llama_rms_norm(x, weight, eps=1e-6):
    """transformers' LlamaRMSNorm (Qwen3-MoE's, Mixtral's, gpt-oss's post-attention norm), in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


NORMS = {
    "rms_llama": lambda w, b: (Norm(w, None, 1e-6, "rms_norm", "llama"), lambda x: _llama_rms_norm(x, w)),
    "layer_norm": lambda w, b: (Norm(w, b, 1e-5), lambda x: torch.nn.functional.layer_norm(
        x, x.shape[-1:], w, b, 1e-5)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer_name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("norm_name", list(NORMS))
def test_a_norm_in_front_matches_float64_as_well_as_stock(target, norm_name, layer_name, dtype):
    """experts(x, ..., norm=...) is the stock norm followed by the stock experts: output and every gradient,
    the norm's parameters' included, within twice the stock computation's own error against float64."""
    device, _ = target
    layer = LAYERS[layer_name]
    tensors = _inputs(layer, dtype, device)
    norm_params = [1 + 0.3 * torch.randn(layer.width, device=device), 0.1 * torch.randn(layer.width, device=device)]
    if norm_name.startswith("rms"):
        norm_params = norm_params[:1]
    dy = torch.randn(layer.tokens, layer.width, device=device)

    def run(dtype, ours):
        ts, ns = _leaves(tensors, dtype), _leaves(norm_params, dtype)
        norm, stock_norm = NORMS[norm_name](*ns, *([None] * (2 - len(ns))))
        if ours:
            out = remat.experts(*ts, **layer.options(), norm=norm)
        else:
            out = stock_experts(stock_norm(ts[0]), *ts[1:], **layer.options())
        floats = [t for t in ts if t is not None and t.is_floating_point()] + ns
        return [out, *torch.autograd.grad(out, floats, dy.to(out.dtype))]

    ref, stock, ours = run(torch.float64, False), run(dtype, False), run(dtype, True)
    floor = REL_TOL[dtype] / 10 if dtype == torch.float32 else 0.0  # as _check_against_float64
    for i, (o, s, r) in enumerate(zip(ours, stock, ref)):
        assert o.dtype == s.dtype and o.shape == r.shape, i
        bound = max(2 * rel_error(s, r), floor)
        assert rel_error(o, r) <= bound, f"output {i}: {rel_error(o, r):.3g} > {bound:.3g} ({dtype})"


def test_a_norm_in_front_keeps_x_and_its_statistics_never_the_normed_tokens(target):
    """The bytes of the plain op (x, the weights of the routing, order, offsets) and an fp32 rstd a token:
    norm(x) is rebuilt in the backward."""
    device, _ = target
    layer, dtype = QWEN, torch.bfloat16
    x, index, weights, gate_up, down, *_ = _leaves(_inputs(layer, dtype, device), dtype)
    norm_weight = _leaves([torch.ones(layer.width, device=device)], dtype)[0]
    params = [gate_up, down, norm_weight]
    norm = Norm(norm_weight, None, 1e-6, "rms_norm", "llama")
    got = saved_bytes(lambda: remat.experts(x, index, weights, gate_up, down, **layer.options(), norm=norm),
                      exclude=params)
    plain = saved_bytes(lambda: remat.experts(x, index, weights, gate_up, down, **layer.options()), exclude=params)
    assert got == plain + 4 * layer.tokens


# --- torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm-in-front"])
def test_torch_compile_fullgraph_matches_eager_with_biases_and_the_transposed_layout(target, with_norm):
    device, _ = target
    layer = GPT_OSS
    tensors = _leaves(_inputs(layer, torch.float32, device), torch.float32)
    norm_weight = _leaves([1 + 0.3 * torch.randn(layer.width, device=device)], torch.float32)[0]
    norm = Norm(norm_weight, None, 1e-6, "rms_norm", "llama") if with_norm else None
    floats = [t for t in tensors if t is not None and t.is_floating_point()] + ([norm_weight] if with_norm else [])
    torch._dynamo.reset()
    compiled = torch.compile(lambda *ts: remat.experts(*ts, **layer.options(), norm=norm), fullgraph=True,
                             backend=COMPILE_BACKEND)
    out = compiled(*tensors)
    dy = torch.randn_like(out)
    compiled_grads = torch.autograd.grad(out, floats, dy)
    expected = remat.experts(*tensors, **layer.options(), norm=norm)
    expected_grads = torch.autograd.grad(expected, floats, dy)
    assert rel_error(out, expected) < 1e-6
    for got, want in zip(compiled_grads, expected_grads):
        assert rel_error(got, want) < 1e-6


# --- bad input --------------------------------------------------------------------------------------


def _small():
    layer = Layer(3, 8, 6, 4, 2)
    x, index, weights, gate_up, down, *_ = _inputs(layer, torch.float32, "cpu", sentinel=False)
    return dict(x=x, top_k_index=index, top_k_weights=weights, gate_up=gate_up, down=down)


def _call(**overrides):
    args = {**_small(), **overrides}
    options = {k: args.pop(k) for k in list(args) if k not in ("x", "top_k_index", "top_k_weights", "gate_up", "down")}
    return lambda: remat.experts(args["x"], args["top_k_index"], args["top_k_weights"], args["gate_up"],
                                 args["down"], **options)


BAD_INPUT = [
    ("x-3d", _call(x=torch.randn(1, 3, 8)), ValueError, "x", r"\(tokens, hidden\)"),
    ("x-int", _call(x=torch.ones(3, 8, dtype=torch.int64)), TypeError, "x", "dtype"),
    ("index-float", _call(top_k_index=torch.zeros(3, 2)), TypeError, "top_k_index", "int64 or int32"),
    ("index-shape", _call(top_k_index=torch.zeros(4, 2, dtype=torch.int64)), ValueError, "top_k_index", "shape"),
    ("top-k-9", _call(top_k_index=torch.zeros(3, 9, dtype=torch.int64), top_k_weights=torch.rand(3, 9)),
     ValueError, "top_k_index", "K <= 8"),
    ("index-negative", _call(top_k_index=torch.tensor([[0, 1], [-1, 2], [3, 0]])), ValueError, "top_k_index",
     ">= 0"),
    ("weights-shape", _call(top_k_weights=torch.rand(3, 3)), ValueError, "top_k_weights", "shape"),
    ("gate-up-2d", _call(gate_up=torch.randn(12, 8)), ValueError, "gate_up", "3 dims"),
    ("gate-up-width", _call(gate_up=torch.randn(4, 12, 9)), ValueError, "gate_up", "hidden 8"),
    ("gate-up-odd", _call(gate_up=torch.randn(4, 11, 8)), ValueError, "gate_up", "2 \\* intermediate"),
    ("gate-up-dtype", _call(gate_up=torch.randn(4, 12, 8, dtype=torch.float16)), TypeError, "gate_up", "must match"),
    ("down-shape", _call(down=torch.randn(4, 8, 7)), ValueError, "down", r"\(4, 8, 6\)"),
    ("bias-shape", _call(gate_up_bias=torch.randn(4, 11)), ValueError, "gate_up_bias", "shape"),
    ("down-bias-dtype", _call(down_bias=torch.randn(4, 8, dtype=torch.float16)), TypeError, "down_bias",
     "must match"),
    ("activation", _call(activation="tanh"), ValueError, "activation", "one of"),
    ("gated-only-activation", _call(activation="swiglu_clamped", gated=False, gate_up=torch.randn(4, 6, 8)),
     ValueError, "activation", "one of"),
    ("gated-bool", _call(gated=1), TypeError, "gated", "bool"),
    ("limit", _call(activation="swiglu_clamped", limit=0.0), ValueError, "limit", "positive"),
    ("alpha", _call(activation="swiglu_clamped", alpha=float("nan")), ValueError, "alpha", "finite"),
    ("norm-spec", _call(norm=(torch.ones(8), None, 1e-6)), ValueError, "norm", "Norm"),
    ("norm-width", _call(norm=Norm(torch.ones(9), None, 1e-6, "rms_norm", "llama")), ValueError, "norm_weight",
     "shape"),
]


@pytest.mark.parametrize("call, error, argument, pattern", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUT])
def test_bad_input_raises_naming_the_argument(call, error, argument, pattern):
    assert_raises_naming(call, error, argument, pattern)
