"""The fused layers with peft's LoRA adapters on their Linears, and what they keep under frozen weights.

LoRA runs inside the fused ops (base + Σ B(A(x))·scale, in peft's order and dtypes): outputs and
every gradient match peft's own layers in float64; what autograd keeps follows the gradients that
are actually required, never more than the stock layers keep, and less by exactly the formula the
conversion report uses.
"""

import copy
import itertools

import pytest
import torch

import remat
from remat._linears import fused_saved_bytes
from remat.ops.fused import norm_linears
from remat.specs import Linear, LoRA, Norm

from numerics import REL_TOL, activation_bytes, rel_error, saved_bytes

peft = pytest.importorskip("peft")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Each fused kind, the stock Sequential it stands for, and where its Linears sit in both.
STOCK_NAMES = {
    "LayerNormLinear": {"norm": "0", "linear": "1"},
    "MLP": {"fc1": "0", "fc2": "2"},
    "LayerNormMLP": {"norm": "0", "fc1": "1", "fc2": "3"},
}
LINEARS = {"LayerNormLinear": ["linear"], "MLP": ["fc1", "fc2"], "LayerNormMLP": ["fc1", "fc2"]}


def stock_and_ours(kind, hidden=24, ffn=40):
    """(stock Sequential, remat module) with the same random weights, fp32 on CPU."""
    if kind == "LayerNormLinear":
        stock = torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, ffn))
    else:
        layers = [torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden)]
        stock = torch.nn.Sequential(*([torch.nn.LayerNorm(hidden)] if kind == "LayerNormMLP" else []), *layers)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.5) + (p.dim() == 1) * 0.1)
    ours = getattr(remat.nn, kind).from_modules(*stock)
    return stock, ours


def with_lora(stock, ours, kind, rank=3, lora_bias=False):
    """Both models with the same LoRA adapters on their Linears (lora_B random, not zero), every
    parameter trainable."""
    names = LINEARS[kind]
    config = dict(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, lora_bias=lora_bias)
    peft.inject_adapter_in_model(peft.LoraConfig(target_modules=names, **config), ours)
    peft.inject_adapter_in_model(peft.LoraConfig(target_modules=[STOCK_NAMES[kind][n] for n in names], **config),
                                 stock)
    with torch.no_grad():
        for name in names:
            ours_layer, stock_layer = getattr(ours, name), stock[int(STOCK_NAMES[kind][name])]
            for part in ("lora_A", "lora_B"):
                src = getattr(ours_layer, part)["default"]
                src.weight.normal_(0, 0.3)
                if src.bias is not None:
                    src.bias.normal_(0, 0.3)
                getattr(stock_layer, part)["default"].load_state_dict(src.state_dict())
    for p in [*stock.parameters(), *ours.parameters()]:
        p.requires_grad_(True)  # peft freezes the base weights; each test says what trains
    return stock, ours


def assert_within_twice_torch(name, got, torch_same_dtype, ref, dtype):
    """Error against float64 within the per-dtype bound, or within twice PyTorch's own in that dtype."""
    bound = max(REL_TOL[dtype], 2 * rel_error(torch_same_dtype, ref))
    assert torch.isfinite(got).all(), name
    assert rel_error(got, ref) <= bound, f"{name}: {rel_error(got, ref):.3g} > {bound:.3g} ({dtype})"


def grads_of(module, x, dy):
    """(module(x), {"x" or parameter name: gradient})."""
    out = module(x)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [x, *(p for _, p in named)], dy)
    return out, dict(zip(["x", *(n for n, _ in named)], grads))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCK_NAMES)
def test_lora_inside_the_fused_op_matches_float64_peft(target, kind, dtype):
    device, _ = target
    stock, ours = with_lora(*stock_and_ours(kind), kind, lora_bias=True)
    ours, stock64 = ours.to(device, dtype), copy.deepcopy(stock).to(device, torch.float64)
    x = torch.randn(2, 5, 24, device=device).to(dtype).requires_grad_()
    dy = torch.randn_like(ours(x))
    out, grads = grads_of(ours, x, dy)
    want, want_grads = grads_of(stock64, x.detach().double().requires_grad_(), dy.double())
    # PyTorch's own error in this dtype (peft's layers on torch's): ours may be up to twice it
    same, same_grads = grads_of(copy.deepcopy(stock).to(device, dtype), x.detach().requires_grad_(), dy)
    assert len(grads) == len(want_grads) == 1 + len(list(ours.parameters()))
    assert_within_twice_torch("out", out, same, want, dtype)
    for name, got in grads.items():
        key = name if name == "x" else _stock_name(kind, name)
        assert_within_twice_torch(name, got, same_grads[key], want_grads[key], dtype)


def test_adapters_in_float32_beside_half_weights_as_peft_computes():
    """peft keeps adapters in float32 on a half-precision model (autocast_adapter_dtype): x is cast
    to the adapter's dtype for the LoRA branch and the sum cast back, gradients likewise."""
    stock, ours = with_lora(*stock_and_ours("LayerNormMLP"), "LayerNormMLP")
    for model in (stock, ours):
        model.to(torch.bfloat16)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    x = torch.randn(7, 24, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(7, 24, dtype=torch.bfloat16)
    with remat.use_backend("reference"):
        out, grads = grads_of(ours, x, dy)
    want, want_grads = grads_of(stock, x, dy)
    assert out.dtype == want.dtype == torch.bfloat16
    assert rel_error(out, want) < 1e-2
    for name, got in grads.items():
        ref = want_grads[name if name == "x" else _stock_name("LayerNormMLP", name)]
        assert got.dtype == ref.dtype and rel_error(got, ref) < 2e-2, name


def test_several_active_adapters_add_up_as_in_peft():
    stock, ours = stock_and_ours("LayerNormLinear")
    for model, target in ((ours, "linear"), (stock, "1")):
        for name, rank in (("a", 2), ("b", 5)):
            peft.inject_adapter_in_model(peft.LoraConfig(target_modules=[target], r=rank, lora_alpha=3),
                                         model, adapter_name=name)
    for layer in (ours.linear, stock[1]):
        layer.set_adapter(["a", "b"])
    torch.manual_seed(3)
    with torch.no_grad():
        for (name, p), q in zip(ours.named_parameters(), stock.parameters()):
            if "lora_" in name:
                p.normal_(0, 0.3)
            q.copy_(p)
    x = torch.randn(6, 24, requires_grad=True)
    dy = torch.randn(6, 40)
    out, grads = grads_of(ours, x, dy)
    want, want_grads = grads_of(stock, x, dy)
    assert len(ours.linear.active_adapters) == 2
    assert rel_error(out, want) < 1e-5
    for name, got in grads.items():
        assert rel_error(got, want_grads[name if name == "x" else _stock_name("LayerNormLinear", name)]) < 1e-5


def test_norm_linears_computes_the_layer_norm_once():
    """Three Linears reading one LayerNorm (ViT's q, k, v): the outputs and gradients of three
    separate fused calls, keeping x and one mean/rstd pair instead of three."""
    x = torch.randn(5, 16, requires_grad=True)
    norm_w, norm_b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    weights = [torch.randn(8, 16, requires_grad=True) for _ in range(3)]
    linears = [Linear(w, None) for w in weights]
    outs = norm_linears(x, Norm(norm_w, norm_b), linears)
    separate = [remat.layer_norm_linear(x, norm_w, norm_b, w) for w in weights]
    dys = [torch.randn(5, 8) for _ in range(3)]
    together = torch.autograd.grad(outs, [x, norm_w, norm_b, *weights], dys)
    apart = torch.autograd.grad(separate, [x, norm_w, norm_b, *weights], dys)
    for a, b in zip(together, apart):
        assert rel_error(a, b) < 1e-6
    kept = saved_bytes(lambda: norm_linears(x, Norm(norm_w, norm_b), linears), exclude=[norm_w, norm_b, *weights])
    assert kept == 5 * 16 * 4 + 2 * 5 * 4  # x, and one fp32 mean and rstd per row


# --- what is kept, under every combination of trained parameters --------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("kind", STOCK_NAMES)
def test_kept_bytes_follow_the_required_gradients(kind, lora):
    """For every combination of frozen weights (and of an input that needs no gradient): the same
    gradients as stock, never more bytes kept than stock, and, for an input that needs a gradient,
    less by exactly fused_saved_bytes (the report's formula) per token."""
    stock, ours = stock_and_ours(kind)
    if lora:
        stock, ours = with_lora(stock, ours, kind)
        for model in (stock, ours):  # as peft trains: base weights frozen, adapters trained
            for name, p in model.named_parameters():
                p.requires_grad_("lora_" in name)
    params = [(n, p) for n, p in ours.named_parameters() if "lora_" not in n]
    stock_params = dict(stock.named_parameters())
    tokens = 6
    with remat.use_backend("reference"):
        for flags in itertools.product([False, True], repeat=len(params) + 1):
            x_grad, *param_flags = flags
            if lora and any(param_flags):
                continue  # with LoRA: only the input's gradient varies
            for (name, p), flag in zip(params, param_flags if not lora else [False] * len(params)):
                p.requires_grad_(flag)
                stock_params[_stock_name(kind, name)].requires_grad_(flag)
            x = torch.randn(tokens, 24, requires_grad=x_grad)
            ours_kept, stock_kept = activation_bytes(ours, x), activation_bytes(stock, x)
            assert ours_kept <= stock_kept, flags
            if x_grad:
                norm = getattr(ours, "norm", None)
                first = ours.linear if kind == "LayerNormLinear" else ours.fc1
                readers = [first] if norm is not None else []
                formula = fused_saved_bytes(norm, readers, getattr(ours, "fc2", None))
                assert stock_kept - ours_kept == tokens * formula, flags
            named = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
            if named or x_grad:
                got = torch.autograd.grad(ours(x).sum(), [p for _, p in named] + ([x] if x_grad else []))
                stock_wanted = [stock_params[_stock_name(kind, n)] for n, _ in named] + ([x] if x_grad else [])
                want = torch.autograd.grad(stock(x).sum(), stock_wanted)
                assert all(rel_error(g, w) < 1e-5 for g, w in zip(got, want)), flags


def _stock_name(kind, name):
    """ours' "fc1.base_layer.weight" / "fc1.weight" -> the stock Sequential's "0.base_layer.weight" / "0.weight"."""
    first, rest = name.split(".", 1)
    return f"{STOCK_NAMES[kind][first]}.{rest}"


# --- bad adapters are refused by name ------------------------------------------------------------

@pytest.mark.parametrize(
    "adapters, error, words",
    [
        ([(torch.randn(2, 8), torch.randn(4, 2), None, 1.0)], TypeError, "adapters must be a tuple of"),
        ([LoRA(torch.randn(2, 7), torch.randn(4, 2), None, 1.0)], ValueError,
         "adapters[0].a must have shape (rank, 8)"),
        ([LoRA(torch.randn(2, 8), torch.randn(4, 3), None, 1.0)], ValueError, "adapters[0].b must have shape (4, 2)"),
        ([LoRA(torch.randn(2, 8), torch.randn(4, 2).half(), None, 1.0)], TypeError,
         "adapters[0].b has dtype torch.float16 but adapters[0].a has torch.float32"),
        ([LoRA(torch.randn(2, 8), torch.randn(4, 2), torch.randn(5), 1.0)], ValueError,
         "adapters[0].b_bias must have shape (4,)"),
        ([LoRA(torch.randn(2, 8), torch.randn(4, 2), None, "2")], TypeError, "adapters[0].scale must be a number"),
    ],
    ids=["not-lora", "a-width", "b-shape", "b-dtype", "b_bias-shape", "scale"],
)
def test_bad_adapters_are_named(adapters, error, words):
    with pytest.raises(error) as caught:
        remat.layer_norm_linear(torch.randn(3, 8), torch.randn(8), torch.randn(8), torch.randn(4, 8),
                                adapters=adapters)
    assert words in str(caught.value)
