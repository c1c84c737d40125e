"""remat.nn.RMSNorm, RMSNormLinear and GatedMLP: drop-in behaviour, every gradient against the stock
computation in float64, and the exact bytes autograd keeps."""

import copy

import pytest
import torch
import torch.nn.functional as F

import remat

from numerics import REL_TOL, activation_bytes, assert_close_to_ref, float64_step, rel_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STOCK_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}


class StockGatedMLP(torch.nn.Module):
    """The stock computation, as transformers' LlamaMLP writes it (an optional norm in front)."""

    def __init__(self, hidden, ffn, activation, bias=False, norm=None, fused_projection=False):
        super().__init__()
        self.activation = activation
        if norm is not None:
            self.norm = torch.nn.RMSNorm(hidden, eps=1e-6) if norm == "rms_norm" else torch.nn.LayerNorm(hidden)
        if fused_projection:
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn, bias=bias)
        else:
            self.gate_proj = torch.nn.Linear(hidden, ffn, bias=bias)
            self.up_proj = torch.nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        if "norm" in self._modules:
            x = self.norm(x)
        if "gate_up_proj" in self._modules:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(STOCK_ACTIVATIONS[self.activation](gate) * up)

    def remat_layer(self, recompute=True):
        """remat.nn.GatedMLP sharing this module's submodules."""
        fused = "gate_up_proj" in self._modules
        gate, up = (self.gate_up_proj, None) if fused else (self.gate_proj, self.up_proj)
        return remat.nn.GatedMLP.from_modules(gate, up, self.down_proj, self.activation, self._modules.get("norm"),
                                              recompute=recompute)


def randomized(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (1 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3) + (p.dim() == 1))
    return module


CONFIGS = [  # (activation, bias, norm, fused_projection)
    ("silu", False, None, False), ("silu", False, "rms_norm", True), ("gelu_tanh", True, "layer_norm", False),
    ("gelu", False, "rms_norm", False),
]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c))
def test_gated_mlp_matches_float64_stock(target, config, dtype, recompute):
    """Output and every gradient against the stock computation in float64, at a prime hidden width and
    an FFN width that is no multiple of any block."""
    device, _ = target
    activation, bias, norm, fused = config
    stock = randomized(StockGatedMLP(29, 67, activation, bias, norm, fused)).to(device, dtype)
    ours = copy.deepcopy(stock).remat_layer(recompute)
    x = torch.randn(3, 5, 29, device=device).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 29, device=device).to(dtype)
    y = ours(x)
    y.backward(dy)
    want_y, want_dx, want_grads = float64_step(stock, x, dy)
    assert y.dtype == dtype
    assert_close_to_ref("y", y, want_y, dtype)
    assert_close_to_ref("dx", x.grad, want_dx, dtype)
    for name, p in ours.named_parameters():
        assert_close_to_ref(name, p.grad, want_grads[name], dtype)


def test_gated_mlp_state_dict_and_shared_parameters():
    stock = StockGatedMLP(16, 40, "silu", norm="rms_norm")
    ours = stock.remat_layer()
    assert list(ours.state_dict()) == list(stock.state_dict())
    assert all(a is b for a, b in zip(ours.parameters(), stock.parameters()))
    built = remat.nn.GatedMLP(16, 40, norm="rms_norm")
    assert list(built.state_dict()) == list(stock.state_dict())
    built.load_state_dict(stock.state_dict())


# --- memory: exact byte counts -----------------------------------------------------------------


@pytest.mark.parametrize("norm", [None, "rms_norm", "layer_norm"])
@pytest.mark.parametrize("fused", [False, True], ids=["gate-up", "gate_up"])
def test_gated_mlp_keeps_x_gate_and_up_only(target, norm, fused):
    """Autograd keeps x (with the norm's fp32 statistics: rstd, or mean and rstd, per row) and the gate
    and up outputs, never act(gate) nor the product; stock keeps those two more (and the norm's output),
    exactly what saved_bytes_per_token says."""
    device, _ = target
    tokens, hidden, ffn = 2 * 7, 32, 88
    stock = randomized(StockGatedMLP(hidden, ffn, "silu", norm=norm, fused_projection=fused)).to(device,
                                                                                                  torch.bfloat16)
    ours = copy.deepcopy(stock).remat_layer()
    x = torch.randn(2, 7, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    statistics = {None: 0, "rms_norm": 4, "layer_norm": 8}[norm] * tokens
    assert activation_bytes(ours, x) == 2 * tokens * hidden + 2 * 2 * tokens * ffn + statistics
    # A CPU LayerNorm keeps a bf16 input's mean and rstd in bf16 (4 bytes a row), ours are fp32 (8)
    slack = 4 * tokens if norm == "layer_norm" and torch.device(device).type == "cpu" else 0
    assert activation_bytes(stock, x) - activation_bytes(ours, x) >= tokens * ours.saved_bytes_per_token() - slack
    assert ours.saved_bytes_per_token() == 2 * 2 * ffn + (2 * hidden if norm else 0)


def test_gated_mlp_without_recompute_keeps_the_product(target):
    device, _ = target
    stock = randomized(StockGatedMLP(32, 88, "silu")).to(device, torch.bfloat16)
    ours = copy.deepcopy(stock).remat_layer(recompute=False)
    x = torch.randn(14, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    assert activation_bytes(ours, x) == 2 * 14 * 32 + 3 * 2 * 14 * 88
    assert ours.saved_bytes_per_token() == 0


# --- RMSNorm and RMSNormLinear ------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_module_is_a_drop_in(target, dtype, affine):
    device, _ = target
    stock = torch.nn.RMSNorm(37, elementwise_affine=affine, device=device, dtype=dtype)
    if affine:
        randomized(stock)
    ours = remat.nn.RMSNorm.from_torch(stock)
    assert list(ours.state_dict()) == list(stock.state_dict())
    assert type(remat.revert(ours)) is torch.nn.RMSNorm
    ours = remat.nn.RMSNorm.from_torch(stock)
    x = torch.randn(4, 37, device=device).to(dtype).requires_grad_()
    dy = torch.randn(4, 37, device=device).to(dtype)
    y = ours(x)
    y.backward(dy)
    want_y, want_dx, want_grads = float64_step(stock, x, dy)
    assert_close_to_ref("y", y, want_y, dtype)
    assert_close_to_ref("dx", x.grad, want_dx, dtype)
    if affine:
        assert_close_to_ref("weight", ours.weight.grad, want_grads["weight"], dtype)
    assert activation_bytes(ours, x) == 4 * 37 * x.element_size() + 4 * 4  # x and one fp32 rstd a row


def test_rms_norm_linear_keeps_x_and_rstd(target):
    device, _ = target
    stock = randomized(torch.nn.Sequential(torch.nn.RMSNorm(40), torch.nn.Linear(40, 24))).to(device, torch.bfloat16)
    ours = remat.nn.RMSNormLinear.from_modules(*stock)
    assert list(ours.state_dict()) == ["norm.weight", "linear.weight", "linear.bias"]
    x = torch.randn(6, 40, device=device, dtype=torch.bfloat16, requires_grad=True)
    assert activation_bytes(ours, x) == 6 * 40 * 2 + 6 * 4
    assert ours.saved_bytes_per_token() == 40 * 2
    dy = torch.randn(6, 24, device=device, dtype=torch.bfloat16)
    ours(x).backward(dy)
    want_y, want_dx, want_grads = float64_step(stock, x, dy)
    assert_close_to_ref("dx", x.grad, want_dx, torch.bfloat16)
    assert rel_error(ours.norm.weight.grad, want_grads["0.weight"]) < REL_TOL[torch.bfloat16]
    assert rel_error(ours.linear.weight.grad, want_grads["1.weight"]) < REL_TOL[torch.bfloat16]


# --- bad input ------------------------------------------------------------------------------------


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="activation must be one of"):
        remat.nn.GatedMLP(8, 16, activation="relu")
    with pytest.raises(ValueError, match="norm must be None"):
        remat.nn.GatedMLP(8, 16, norm="batch_norm")
    gate, up, down = torch.nn.Linear(8, 16), torch.nn.Linear(8, 12), torch.nn.Linear(16, 8)
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        remat.nn.GatedMLP.from_modules(gate, up, down, "silu")
    with pytest.raises(ValueError, match="down must map 16 features back to 8"):
        remat.nn.GatedMLP.from_modules(gate, torch.nn.Linear(8, 16), torch.nn.Linear(12, 8), "silu")
    with pytest.raises(TypeError, match="activation must be one of"):
        remat.nn.GatedMLP.from_modules(gate, torch.nn.Linear(8, 16), down, torch.nn.ReLU())
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        remat.gated_activation(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="style must be one of"):
        remat.rms_norm(torch.randn(3, 4), (4,), torch.randn(4), style="mistral")
    with pytest.raises(ValueError, match="weight is required for style 'llama'"):
        remat.rms_norm(torch.randn(3, 4), (4,), style="llama")
    with pytest.raises(ValueError, match="weight must have shape"):
        remat.rms_norm(torch.randn(3, 4), (4,), torch.randn(5))
