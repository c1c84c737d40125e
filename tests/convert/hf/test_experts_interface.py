"""remat's experts as transformers' "remat" experts implementation (remat.convert.hf.experts): every
mixture-of-experts family calling transformers' experts interface runs remat.experts after
remat.convert, from_pretrained(..., experts_implementation="remat") or set_experts_implementation,
trains as its stock experts, keeps the routing and tokens only, and never calls the router again.
Every causal-LM family's tiny model is also checked to run remat.experts, with no fallback, in
test_every_causal_lm.py."""

import copy
import re
import types
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import remat
from remat._guards import RematFallbackWarning, fallback_counts
from remat.convert.hf import experts as hf_experts

from hf_models import (
    VOCAB,
    OpCounter,
    assert_autocast_step_as_accurate_as_stock,
    assert_tiny_step_as_stock,
    assert_trainer_trains_as_stock,
    tiny_causal_lm,
    tiny_loss,
    transformers,
)
from numerics import COMPILE_BACKEND, saved_bytes

IDS = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))  # 18 tokens: not a power of two


def convert(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remat.convert(model, **kwargs)


def experts_calls(model):
    """The remat.experts forward calls of one training step of `model` (asserting no experts module fell back)."""
    with OpCounter() as counter:
        tiny_loss(model, "causal", IDS).backward()
    assert not {path: reasons for path, reasons in fallback_counts(model).items() if path.endswith(".experts")}
    return counter.counts["remat::experts_fwd"]


def moe_layers(model):
    return len(hf_experts.experts_modules(model))


# Families of every layout and activation transformers' experts use: concatenated gate/up (Qwen3-MoE,
# Qwen2-MoE with a shared expert, Mixtral, GraniteMoE, OLMoE, DeepSeek-V3 with its shared experts and
# dense first layers), gpt-oss (interleaved, transposed, biases, clamped SwiGLU), MiniMax-M3 (the
# clamped SwiGLU concatenated), Nemotron-H (non-gated squared ReLU).
FAMILIES = ["Qwen3MoeConfig", "Qwen2MoeConfig", "MixtralConfig", "GraniteMoeConfig", "OlmoeConfig",
            "DeepseekV3Config", "GptOssConfig", "MiniMaxM3VLTextConfig", "NemotronHConfig"]


@pytest.mark.parametrize("config_name", FAMILIES)
def test_families_train_as_their_stock_experts_on_remat_experts_with_router_logits(config_name):
    """Loss with the auxiliary load-balancing loss (output_router_logits; without it every family is in
    test_every_causal_lm.py) and every gradient equal stock's (transformers' grouped_mm, its default),
    every MoE layer on remat.experts."""
    stock = tiny_causal_lm(config_name, first_k_dense_replace=1)  # DeepSeek-V3: a dense layer, then MoE
    assert hasattr(stock.config, "output_router_logits")
    stock.config.output_router_logits = True
    converted, report = convert(stock, report=True)
    assert converted.config._experts_implementation == "remat"
    # transformers' output recorders, which output_router_logits installs on the layers, the attention
    # and the router at the probe's forward, leave the layers' fusions as they are
    assert not [row for row in report if "hooks" in row.reason]
    assert_tiny_step_as_stock(stock, converted, "causal", IDS)
    converted.zero_grad()
    assert experts_calls(converted) == moe_layers(converted) > 0
    # the norm before each block fused into its router, experts and shared experts, which took it at every
    # call (Nemotron-H's not: an Identity between its norm and its block returns the norm's output)
    handed = [m for _, m in hf_experts.experts_modules(converted) if "remat_handoff" in vars(m)]
    assert len(handed) == (moe_layers(converted) if config_name != "NemotronHConfig" else 0)
    assert not {path for path in fallback_counts(converted) if "attn" not in path}  # gpt-oss's sinks: attention's


@pytest.mark.kernels
@pytest.mark.parametrize("config_name", ["Qwen3MoeConfig", "GptOssConfig"])
def test_the_kernels_train_two_families_as_stock_with_router_logits(config_name):
    """As above, remat.experts on its Triton kernels: the concatenated layout and gpt-oss's (interleaved,
    transposed, biases, clamped SwiGLU)."""
    stock = tiny_causal_lm(config_name)
    stock.config.output_router_logits = True
    converted = convert(stock)
    with OpCounter() as counter:
        assert_tiny_step_as_stock(stock, converted, "causal", IDS)
    assert counter.counts["remat::experts_fwd"] == moe_layers(converted) > 0


def _qwen3_moe(experts, top_k):
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                                         moe_intermediate_size=24, num_experts=experts, num_experts_per_tok=top_k,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=32, output_router_logits=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _never_route_to_the_last_expert(model, experts):
    """Router outputs rewritten (in stock and converted alike) so that expert `experts - 1` gets no token."""
    def hook(_router, _args, output):
        logits, weights, index = output
        return logits, weights, index % (experts - 1)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


def test_top_8_of_ten_experts_with_an_expert_that_gets_no_token():
    stock = _qwen3_moe(experts=10, top_k=8)
    _never_route_to_the_last_expert(stock, 10)
    converted = convert(stock)
    assert_tiny_step_as_stock(stock, converted, "causal", IDS)
    converted.zero_grad()
    assert experts_calls(converted) == 2
    for layer in converted.model.layers:  # no token: a gradient of zeros, as the stock experts' own
        assert layer.mlp.experts.gate_up_proj.grad[-1].abs().max() == 0


def test_the_router_is_never_called_in_the_backward():
    """Counted by the routers' class (a hook on a router would keep the norm out of it): each router runs
    once, fused with the post-attention norm, in the forward only."""
    converted = convert(_qwen3_moe(experts=6, top_k=2))
    router_class = type(converted.model.layers[0].mlp.gate)
    assert router_class.__name__ == "RematNormedQwen3MoeTopKRouter"
    calls, forward = [], router_class.forward

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    with mock.patch.object(router_class, "forward", counted):
        loss = tiny_loss(converted, "causal", IDS)
        assert len(calls) == 2
        loss.backward()
    assert len(calls) == 2  # no forward of a router ran during the backward
    assert not fallback_counts(converted)


def _norm_and_block_bytes(model, tokens):
    """Bytes autograd keeps for the first layer's post-attention norm and MoE block, called as the layer
    calls them, on `tokens` hidden states, their parameters left out."""
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    params = [*layer.post_attention_layernorm.parameters(), *layer.mlp.parameters()]
    return saved_bytes(lambda: layer.mlp(layer.post_attention_layernorm(x)), exclude=params)


def test_the_norm_fused_into_router_and_experts_keeps_x_once_never_its_output():
    """Counted on the norm and the block (fp32): beyond the experts' own saving (the report's), stock's
    RMSNorm keeps its output, which the router's projection and the experts read, and the normalised x
    its weight multiplies (in fp32 the upcast is x itself, kept by both); remat keeps x and one fp32 rstd
    a token, as stock's norm does. The report's norm row counts the output alone."""
    stock = _qwen3_moe(experts=6, top_k=3)
    converted, report = convert(stock, report=True)
    (experts_row,) = [row for row in report if row.action.startswith("experts implementation")]
    (norm_row,) = [row for row in report if row.path == "model.layers.0.post_attention_layernorm"]
    width = stock.config.hidden_size
    assert norm_row.saves() == width * 4
    stock_per_token = (_norm_and_block_bytes(stock, 34) - _norm_and_block_bytes(stock, 17)) / 17
    remat_per_token = (_norm_and_block_bytes(converted, 34) - _norm_and_block_bytes(converted, 17)) / 17
    assert stock_per_token - remat_per_token == experts_row.saves() / 2 + 2 * width * 4


def test_a_block_called_apart_from_its_layer_reads_its_input_as_stock():
    """The norm hands its input over to the block it feeds only: the block called on anything else (its
    own input, not the norm's) computes what stock computes on it."""
    stock = _qwen3_moe(experts=6, top_k=2).eval()
    converted = convert(stock)
    x = torch.randn(2, 5, stock.config.hidden_size)
    with torch.no_grad():
        converted.model.layers[0].post_attention_layernorm(torch.randn_like(x))  # the norm's last hand-over: not x
        assert torch.allclose(converted.model.layers[0].mlp(x), stock.model.layers[0].mlp(x), atol=1e-6)


def test_a_router_jitter_in_training_keeps_the_norm_out_of_the_block():
    """Mixtral's router jitter scales the block's input in place in training, which would be the norm's
    input (the residual stream) if the norm handed it over: convert sees it by a call in training mode."""
    stock = tiny_causal_lm("MixtralConfig", router_jitter_noise=0.1)
    _, report = convert(stock, report=True)
    rows = [row for row in report if row.path.endswith("post_attention_layernorm")]
    assert rows and all(row.action == "skipped" and "training mode" in row.reason for row in rows)


def _moe_block_bytes(model, tokens):
    """Bytes autograd keeps for the first MoE block's call on `tokens` hidden states (its router
    included), its parameters left out."""
    block = model.model.layers[0].mlp
    x = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    return saved_bytes(lambda: block(x), exclude=list(block.parameters()))


@pytest.mark.parametrize("keep_hidden", [False, True], ids=["recompute", "keep_hidden"])
def test_the_bytes_saved_are_the_reports_formula_and_most_of_the_experts(keep_hidden):
    """Counted with saved_tensors_hooks on the MoE block (router and experts), stock grouped_mm against
    remat: the difference per token is docs/memory.md's formula (the report's figure), and the experts
    keep at least 70 % fewer bytes than stock's."""
    stock = _qwen3_moe(experts=6, top_k=3)
    converted, report = convert(stock, report=True, recompute=not keep_hidden)
    (row,) = [row for row in report if row.action.startswith("experts implementation")]
    stock_per_token = (_moe_block_bytes(stock, 34) - _moe_block_bytes(stock, 17)) / 17
    remat_per_token = (_moe_block_bytes(converted, 34) - _moe_block_bytes(converted, 17)) / 17
    assert stock_per_token - remat_per_token == row.saves() / 2  # the row totals both MoE layers
    router_per_token = _router_bytes_per_token(stock)
    experts_stock, experts_remat = stock_per_token - router_per_token, remat_per_token - router_per_token
    assert experts_remat <= (0.3 if not keep_hidden else 0.7) * experts_stock


def _router_bytes_per_token(model):
    router = model.model.layers[0].mlp.gate

    def per(tokens):
        x = torch.randn(tokens, model.config.hidden_size, requires_grad=True)
        return saved_bytes(lambda: router(x), exclude=list(router.parameters()))

    return (per(34) - per(17)) / 17


def test_register_experts_serves_from_pretrained_and_set_experts_implementation(tmp_path):
    stock = _qwen3_moe(experts=6, top_k=2)
    stock.save_pretrained(tmp_path)
    remat.register_experts()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="remat").train()
    assert loaded.config._experts_implementation == "remat"
    assert_tiny_step_as_stock(stock, loaded, "causal", IDS)
    loaded.zero_grad()
    assert experts_calls(loaded) == 2
    other = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    other.set_experts_implementation("remat")
    other.zero_grad()
    assert experts_calls(other) == 2


def test_revert_gives_the_previous_implementation_back():
    stock = _qwen3_moe(experts=6, top_k=2)
    stock.set_experts_implementation("batched_mm")
    converted = convert(stock)
    assert converted.config._experts_implementation == "remat"
    # one layer reverted apart from its model (as a plan's stock layers): its experts run stock, the
    # other's remat.experts, though both read the model's config
    converted.model.layers[0] = remat.revert(converted.model.layers[0])
    assert converted.config._experts_implementation == "remat"
    assert_tiny_step_as_stock(stock, converted, "causal", IDS)
    converted.zero_grad()
    assert experts_calls(converted) == 1
    reverted = remat.revert(converted)
    assert reverted.config._experts_implementation == "batched_mm"
    assert not any(key.startswith("remat_experts") for m in reverted.modules() for key in vars(m))
    with OpCounter() as counter:
        tiny_loss(reverted, "causal", IDS)
    assert counter.counts["remat::experts_fwd"] == 0


def _clamped_silu_gate(self, gate_up):
    """DeepSeek-V4's gate (SiLU of the clamped gate times the clamped up): an activation remat.experts lacks."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)


def test_a_gate_remat_lacks_runs_stock_with_the_reason():
    stock = _qwen3_moe(experts=6, top_k=2)
    experts = stock.model.layers[1].mlp.experts
    experts._apply_gate = types.MethodType(_clamped_silu_gate, experts)
    converted, report = convert(stock, report=True)
    (row,) = [row for row in report if row.path == "model.layers.1.mlp.experts"]
    assert row.action == "skipped" and "its _apply_gate computes none of remat.experts' activations" in row.reason
    assert_tiny_step_as_stock(stock, converted, "causal", IDS)
    with OpCounter() as counter:
        tiny_loss(converted, "causal", IDS)
    assert counter.counts["remat::experts_fwd"] == 1  # layer 0's


def test_weights_in_another_dtype_than_the_tokens_run_stock_with_a_warning():
    """grouped_mm casts the tokens to the weights' dtype; remat.experts computes in one: the call runs stock."""
    stock = _qwen3_moe(experts=6, top_k=2)
    converted = convert(stock)
    x = torch.randn(5, stock.config.hidden_size, dtype=torch.float64)
    index, weights = torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5, dtype=torch.float64)
    reason = ("hidden_states are torch.float64 and the expert weights torch.float32 (remat.experts computes in one "
              "dtype)")
    with pytest.warns(RematFallbackWarning, match=re.escape(reason)):
        out = converted.model.layers[0].mlp.experts(x, index, weights)
    assert torch.equal(out, stock.model.layers[0].mlp.experts(x, index, weights))
    assert fallback_counts(converted) == {"model.layers.0.mlp.experts": {reason: 1}}


def test_peft_lora_on_the_experts_parameters_is_taken():
    """peft's LoRA on the experts' 3-D parameters (target_parameters) runs through a parametrization that
    remat.experts reads as the stock forward does: the adapters train as in the stock model."""
    peft = pytest.importorskip("peft")
    stock = _qwen3_moe(experts=6, top_k=2)
    lora = peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"])
    stock_peft = peft.get_peft_model(stock, lora)
    with torch.no_grad():  # B starts at zero: make the adapters matter
        for name, p in stock_peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    converted = convert(stock_peft)
    assert_tiny_step_as_stock(stock_peft, converted, "causal", IDS)
    converted.zero_grad()
    with OpCounter() as counter:
        tiny_loss(converted, "causal", IDS).backward()
    assert counter.counts["remat::experts_fwd"] == 2
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in converted.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("policy", ["stock", "remat"])
def test_a_qwen3_30b_a3b_layer_at_4096_tokens(policy):
    """remat memory's qwen3-30b-a3b (bf16, on meta, one layer of it: what a layer of the 48 keeps, and
    the rotary embedding's share that 48 layers split): 762.30 MiB stock (760.34 a layer of 48), at
    most 160 MiB under remat (its experts and q/k norms)."""
    from remat.memory import _hf_config
    from remat.planner import measure

    config = _hf_config("qwen3-30b-a3b")
    config.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config, dtype=torch.bfloat16)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    with remat.use_backend("auto"):  # (on meta the ops run their fakes whatever the backend)
        saves, paths, _ = measure(model, {"input_ids": ids}, (policy,))
    counted = saves[policy]
    outside = counted.outside.internal_bytes + sum(counted.key_bytes[k] for k in counted.outside.shared_keys)
    per_layer = (counted.total_bytes() - outside) / len(paths) / 2**20
    if policy == "stock":
        assert 762 < per_layer < 762.5, per_layer
    else:
        assert per_layer <= 160, per_layer  # the bound
        assert 109.5 < per_layer < 110, per_layer  # 107.71 a layer of 48: the post-attention norm fused too


def test_the_planner_offers_both_experts_policies_with_their_bytes_and_flops():
    """remat.plan's per-layer choices for a MoE layer: "remat" (the experts rebuild the up projection:
    2 · T · K · h · N1 FLOPs more in the backward, in the cost model) and "remat-keep" (the
    pre-activation kept: T · K · N1 elements more); a dense model gets no "remat-keep"."""
    from remat.planner import DEVICES, measure
    from remat.planner.cost import extra_seconds

    model = _qwen3_moe(experts=6, top_k=3)
    tokens, width, n1, top_k = IDS.numel(), model.config.hidden_size, 2 * model.config.moe_intermediate_size, 3
    saves, paths, fusable = measure(model, {"input_ids": IDS}, ("stock", "remat", "remat-keep"))
    assert all(fusable) and len(paths) == 2
    for i in range(2):
        remat_unit, keep_unit = saves["remat"].units[i], saves["remat-keep"].units[i]
        assert keep_unit.internal_bytes - remat_unit.internal_bytes == tokens * top_k * n1 * 4
        assert remat_unit.work.rebuilt_flops == 2 * tokens * top_k * width * n1
        assert keep_unit.work.rebuilt_flops == 0
        h200, stock_unit = DEVICES["H200"], saves["stock"].units[i]
        rebuild = extra_seconds("remat", stock_unit, remat_unit, h200) - 2 * (
            stock_unit.internal_bytes - remat_unit.internal_bytes) / h200.bytes_per_s
        assert rebuild == pytest.approx(remat_unit.work.rebuilt_flops / h200.flops_per_s)
    dense = tiny_causal_lm("Qwen3Config")
    saves, _, _ = measure(dense, {"input_ids": IDS}, ("stock", "remat", "remat-keep"))
    assert "remat-keep" not in saves


def test_a_plan_choosing_remat_keep_keeps_the_pre_activation_and_trains_as_stock():
    from remat.planner.units import apply_choices, find_units

    stock = _qwen3_moe(experts=6, top_k=2)
    planned = _qwen3_moe(experts=6, top_k=2)
    apply_choices(planned, find_units(planned), ["remat-keep", "remat"])
    flags = [layer.mlp.experts.__dict__["remat_experts_keep_hidden"] for layer in planned.model.layers]
    assert flags == [True, False]
    assert_tiny_step_as_stock(stock, planned, "causal", IDS)


# --- the workflows a converted mixture of experts goes through ----------------------------------------


def test_the_trainer_trains_a_converted_moe_model_as_stock(tmp_path):
    """Two HF Trainer steps with the router's auxiliary loss (plain SGD, as test_lm_loss.py's Trainer test):
    every experts module on remat.experts at every step, the norm before it fused in, the trained weights
    the stock model's."""
    stock = _qwen3_moe(experts=6, top_k=2)
    converted = convert(copy.deepcopy(stock))
    data = [{"input_ids": IDS[0], "labels": IDS[0]} for _ in range(2)]
    calls = assert_trainer_trains_as_stock(stock, converted, data, tmp_path, "remat::experts_fwd")
    assert calls == 2 * moe_layers(converted)
    assert not fallback_counts(converted)


def test_a_bf16_autocast_step_is_as_accurate_as_stocks():
    """Under bf16 autocast (fp32 weights) the converted model's loss and gradients are within twice the
    stock model's error against the fp32 step: the experts and the norm fused before them cast as stock's
    products do."""
    stock = _qwen3_moe(experts=6, top_k=2)
    stock.set_experts_implementation("eager")  # the float64 reference: grouped_mm takes no float64
    converted = convert(stock)
    assert_autocast_step_as_accurate_as_stock(stock, converted, {"input_ids": IDS, "labels": IDS})


def test_torch_compile_of_the_norm_and_block_matches_eager():
    """torch.compile of a layer's post-attention norm and MoE block, as the layer calls them (the router's
    projection computed inside its traced forward, the experts applying the norm): eager's output and
    gradients."""
    layer = convert(_qwen3_moe(experts=6, top_k=2)).model.layers[0]
    x = torch.randn(2, 9, layer.post_attention_layernorm.weight.shape[0], requires_grad=True)
    leaves = [x, *layer.parameters()]

    def norm_and_block(x):
        return layer.mlp(layer.post_attention_layernorm(x))

    out = norm_and_block(x)
    dy = torch.randn_like(out)
    eager = torch.autograd.grad(out, leaves, dy, allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(norm_and_block, backend=COMPILE_BACKEND, fullgraph=True)(x)
    torch.testing.assert_close(compiled, out, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(compiled, leaves, dy, allow_unused=True), eager):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
