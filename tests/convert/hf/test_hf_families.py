"""remat.convert on the Hugging Face families built from LayerNorms and GELU MLPs (tiny random configs,
no downloads): DeiT, SigLIP (both towers), Phi, GPT-J, Falcon (its three layer wirings, multi-query
and grouped keys), DistilBERT, BART, Whisper, BLOOM and OPT. The same loss and gradients as stock,
the same checkpoint, the exact bytes no longer kept (derived per family), and the reasons for what
stays stock: BLOOM's ALiBi attention, OPT's ReLU MLP, cross-attention, post-LN configs."""

import collections
import importlib
import json
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import _backend, memory
from remat._guards import RematFallbackWarning

from hf_models import (
    BATCH,
    F32,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    SEQ,
    WHISPER_FRAMES,
    OpCounter,
    assert_same_step,
    assert_save_pretrained_round_trip,
    attention_output_copy_bytes,
    autocast_errors,
    build,
    convert_layers,
    family_inputs,
    loss_and_grads,
    padded_batch,
    remat_attention_calls,
    step_saved_bytes,
    transformers,
    varlen_attention_calls,
)
from numerics import rel_error, saved_bytes

conv = importlib.import_module("remat.convert")


# case -> (family, config overrides, {swapped class: count}, remat attention kernels per step,
#          {reason substring: count} of the rows left stock)
# kept: the attention modules left as they are, their attention function remat's (the "remat"
# attention implementation): LAYERS for a family without rules
Case = collections.namedtuple("Case", "family overrides swaps attention skipped kept", defaults=(0,))
KEPT = "its attention function remat's"
CASES = {
    # no rule: the attention modules kept, on the "remat" implementation, the norms fused into the
    # projections by structure (a probe call on images the config's size), the MLPs by structure
    "deit": Case("deit", {}, {"RematNormedLinear": 6, "RematDeiTMLP": 2, "RematFusedLayerNorm": 4}, 2, {}, LAYERS),
    # both towers' layers (the probe calls the model on token ids and images), and the vision tower's
    # pooling head (its LayerNorm and MLP; its nn.MultiheadAttention on remat.nn's)
    "siglip": Case("siglip", {}, {"RematNormedLinear": 12, "RematSiglipMLP": 5, "RematFusedLayerNorm": 9,
                                  "RematMultiheadAttention": 1}, 4, {}, 2 * LAYERS),
    # both towers' layers, QuickGELU MLPs; the text tower's causal mask
    "clip": Case("clip", {}, {"RematNormedLinear": 12, "RematCLIPMLP": 4, "RematFusedLayerNorm": 8}, 4, {},
                 2 * LAYERS),
    # One LayerNorm per layer feeding q, k, v and fc1:
    "phi": Case("phi", {}, {"RematNormedLinear": 6, "RematPhiMLP": 2, "RematFusedLayerNorm": 2}, 2, {}, LAYERS),
    "gptj": Case("gptj", {}, {"RematNormedLinear": 6, "RematGPTJMLP": 2, "RematFusedLayerNorm": 2}, 2, {}, LAYERS),
    # Falcon-7B: multi-query, one LayerNorm feeding the parallel query_key_value and MLP
    "falcon": Case("falcon", {}, {"RematNormedFalconLinear": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 2}, 2,
                   {}, LAYERS),
    # the new decoder architecture: one group of keys and values for the 2 heads, ln_attn and ln_mlp
    "falcon-new": Case("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1},
                       {"RematNormedFalconLinear": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 4}, 2, {}, LAYERS),
    "falcon-new-one-ln": Case("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1,
                                         "num_ln_in_parallel_attn": 1},
                              {"RematNormedFalconLinear": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 2}, 2,
                              {}, LAYERS),
    "falcon-sequential": Case("falcon", {"parallel_attn": False, "multi_query": False},
                              {"RematNormedFalconLinear": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 4}, 2,
                              {}, LAYERS),
    # post-LN: its two LayerNorms a layer feed the residual adds, and say so
    "distilbert": Case("distilbert", {}, {"RematFFN": 2}, 2, {"not fused into a projection": 2 * LAYERS}, LAYERS),
    # post-LN: the MLP each layer holds itself (fc1 -> activation_fn -> fc2, found by structure), fused
    # into its fc2; its LayerNorms feed the residual adds. The encoder's and the decoder's self-attention
    # and the decoder's cross-attention on the "remat" implementation.
    "bart": Case("bart", {}, {"RematMLPLinear": 4, "RematFusedLinear": 4, "RematFusedGELUActivation": 4}, 6,
                 {"not fused into a projection": 5 * LAYERS}, 3 * LAYERS),
    # pre-LN: the encoder's 2 LayerNorms a layer, the decoder's 3 (the cross-attention's into its q_proj)
    "whisper": Case("whisper", {}, {"RematMLPLinear": 4, "RematFusedLinear": 4, "RematFusedGELUActivation": 4,
                                    "RematFusedLayerNorm": 10, "RematNormedLinear": 14}, 6, {}, 3 * LAYERS),
    # the ALiBi attention on remat.attention's alibi_slopes (swapped by its class: the model's attention
    # implementation, which its ALiBi mask does not call, stays eager); by structure, input_layernorm
    # fused into query_key_value, and the MLP BloomMLP holds (it adds the residual after its fc2) fused
    # into its fc2 with post_attention_layernorm in front
    "bloom": Case("bloom", {}, {"RematBloomAttention": 2, "RematNormedLinear": 2, "RematFusedLayerNorm": 4,
                                "RematMLPLinear": 2, "RematFusedLinear": 2, "RematFusedBloomGelu": 2}, 2,
                  {"flash-attention-style masks": 1}),
    # no rule; the ReLU MLP its layers hold stays stock, final_layer_norm fused into its fc1
    "opt": Case("opt", {}, {"RematFusedLayerNorm": 4, "RematNormedLinear": 8}, 2,
                {"the layer holds stays stock: activation ReLU": LAYERS}, LAYERS),
}


def build_case(name, **overrides):
    case = CASES[name]
    return build(case.family, **{**case.overrides, **overrides})


def swapped_counts(report):
    return collections.Counter(row.action.removeprefix("swapped to ") for row in report if row.action != "skipped")


def assert_skipped_as_expected(report, expected, kept=0):
    """Every row left stock is one the case expects, for its reason; `kept` attention modules on the
    "remat" implementation."""
    assert len(report.kept) == kept and all(KEPT in row.reason for row in report.kept), str(report)
    found = collections.Counter()
    for row in report.skipped:
        reason = next((r for r in expected if r in row.reason), None)
        assert reason is not None, f"{row.path}: unexpected skip: {row.reason}\n{report}"
        found[reason] += 1
    assert found == collections.Counter(expected), str(report)


@pytest.mark.parametrize("name", CASES)
def test_same_loss_gradients_and_checkpoint(target, name):
    device, _ = target
    case = CASES[name]
    stock, _ = build_case(name)
    stock.to(device)
    converted, report = convert_layers(stock, report=True)
    counts = swapped_counts(report)
    for cls, count in case.swaps.items():
        assert counts[cls] == count, f"{cls}: {counts[cls]} != {count}\n{report}"
    assert_skipped_as_expected(report, case.skipped, case.kept)
    # the checkpoint: the same keys in the same order, the same values, loadable strictly
    state, converted_state = stock.state_dict(), converted.state_dict()
    assert list(converted_state) == list(state)
    assert all(torch.equal(converted_state[k], v) for k, v in state.items())
    converted.load_state_dict(state, strict=True)
    with OpCounter() as counter:  # the stock model runs no remat op: the counts are the converted's
        assert_same_step(stock, converted, family_inputs(case.family, device))
    assert counter.counts["remat::attention_fwd"] == case.attention
    assert counter.counts["remat::attention_bwd"] == case.attention


@pytest.mark.kernels
@pytest.mark.parametrize("name", [n for n in CASES if n not in ("falcon-new-one-ln", "falcon-sequential")])
def test_training_under_bf16_autocast_is_as_accurate_as_stock(name):
    """fp32 weights under bf16 autocast (the Trainer's bf16=True), each family's default cache in
    training (GPT-2-like models make one): the fused ops and remat.attention take autocast's bf16 q, k,
    v and projections as stock does. The loss and gradient errors, summed over three random models,
    within twice stock's own: at these tiny sizes one model's bf16 gradient error varies tenfold from
    one random draw to the next (a ReLU or a rounding flipping), so one draw alone compares noise."""
    errors = torch.zeros(2, 2, dtype=torch.float64)  # (stock, converted) x (loss, gradient)
    for seed in range(3):
        torch.manual_seed(seed)
        stock, _ = build_case(name)
        converted = convert_layers(stock)
        batch = family_inputs(CASES[name].family, "cpu")
        found, calls = remat_attention_calls(lambda s=stock, c=converted, b=batch: autocast_errors(s, c, b))
        assert calls == CASES[name].attention  # the converted model's step
        errors += torch.tensor(found, dtype=torch.float64)
    (stock_loss, stock_grad), (loss, grad) = errors.tolist()
    assert loss <= 2 * stock_loss + 1e-3 and grad <= 2 * stock_grad + 1e-3, errors


# --- What autograd keeps: derived per family, asserted exactly -------------------------------------


def attention_output_copy(family, device):
    """Bytes per token the stock out-projection keeps of a copy of the attention output (fp32), or 0.

    SDPA's output takes q's layout on some backends (CPU); where that is (B, H, S, D), the stock
    transpose(1, 2).reshape copies it, and the out-projection keeps the copy besides the output SDPA
    keeps. remat.attention lays its output out (B, S, H, D): no copy. q is built as each family
    builds it: a view of the projection (B, S, H, D) transposed; Phi's rotary (a torch.cat over the
    head dim) and Whisper's .contiguous() make it (B, H, S, D) itself."""
    q = torch.randn(1, 3, HEADS, HEAD_DIM, device=device, requires_grad=True).transpose(1, 2)
    return attention_output_copy_bytes(q.contiguous() if family in ("phi", "whisper") else q)


def sdpa_mask_bytes(device, kv_heads):
    """Bytes per token the stock SDPA keeps for the (B, 1, S, S) bool causal mask Falcon always
    materialises (its float copy, on CPU), measured on torch's own SDPA; remat.attention reads the
    mask's pattern and keeps nothing of it."""
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, requires_grad=True)
    kv = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, device=device, requires_grad=True)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device).tril()
    with_mask = saved_bytes(lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask))
    without = saved_bytes(lambda: F.scaled_dot_product_attention(q, kv, kv))
    return (with_mask - without) // (BATCH * SEQ)


# What the converted model keeps less than stock in one training forward, in bytes: fused, by the
# fused ops' recomputation (recompute=False gives it back), and attention, by remat.attention
# itself; the report's totals per token of each (fp32).
Saving = collections.namedtuple("Saving", "fused attention report_fused report_attention")


def expected_saving(name, ffn, device):
    """The Saving of case `name` (docs/memory.md):

    gelu  the GELU output (fc2's input), ffn wide: the fused MLP keeps the fc1 output only
    norm  a LayerNorm's output, hidden wide: the fused projections keep x and mean/rstd instead;
          one LayerNorm feeding two modules (Phi, GPT-J, Falcon-7B) is applied inside both, which keep
          the same x and the same fp32 mean/rstd once: norm
    gqa   Falcon's new architecture: the stock forward copies each group's k and v out to all heads
    and what depends on the stock attention's backend: the attention output copy, Falcon's mask.
    """
    gelu, norm = F32 * ffn, F32 * HIDDEN
    tokens = BATCH * SEQ
    copy = attention_output_copy(CASES[name].family, device)
    if name == "deit":  # 4 patches, [CLS] and the distillation token
        return Saving(LAYERS * BATCH * 6 * (gelu + 2 * norm), 0, LAYERS * (gelu + 2 * norm), 0)
    if name == "siglip":  # both towers' layers; the pooling head's LayerNorm and MLP: one token per image
        per_layer, head = gelu + 2 * norm, gelu + norm
        return Saving(LAYERS * (tokens + BATCH * 4) * per_layer + BATCH * head, 0, 2 * LAYERS * per_layer + head, 0)
    if name == "clip":  # both towers' layers: the text tokens, and 4 patches and [CLS] an image
        per_layer = gelu + 2 * norm
        return Saving(LAYERS * (tokens + BATCH * 5) * per_layer, 0, 2 * LAYERS * per_layer, 0)
    if name in ("phi", "gptj"):
        per_layer = gelu + norm
        return Saving(LAYERS * tokens * per_layer, LAYERS * tokens * copy, LAYERS * per_layer, 0)
    if name.startswith("falcon"):
        config = CASES[name].overrides
        new = config.get("new_decoder_architecture", False)
        one_norm = config.get("num_ln_in_parallel_attn") == 1 or not config  # Falcon-7B's default: one
        per_layer = gelu + (norm if one_norm else 2 * norm)
        # The stock forward hands each group's keys and values once to its attention function (GQA), as
        # remat.attention takes them: the attention saves the mask and the output's copy only.
        mask = sdpa_mask_bytes(device, 1 if new or config.get("multi_query", True) else HEADS)
        return Saving(LAYERS * tokens * per_layer, LAYERS * tokens * (mask + copy), LAYERS * per_layer, 0)
    if name == "distilbert":
        return Saving(LAYERS * tokens * gelu, 0, LAYERS * gelu, 0)
    if name == "bart":  # post-LN: the MLPs only, in the encoder's and the decoder's layers
        return Saving(2 * LAYERS * tokens * gelu, 0, 2 * LAYERS * gelu, 0)
    if name == "whisper":  # encoder: 2 LayerNorms; decoder: 3 (the cross-attention's into its q_proj);
        # the output copy of the encoder's self-attention, the decoder's self- and cross-attention
        encoder, decoder, frames = gelu + 2 * norm, gelu + 3 * norm, BATCH * WHISPER_FRAMES
        return Saving(LAYERS * (frames * encoder + tokens * decoder), LAYERS * (frames + 2 * tokens) * copy,
                      LAYERS * (encoder + decoder), 0)
    if name == "bloom":  # the ALiBi attention on remat.attention: the stock one keeps the probabilities (seq
        # wide per head), remat's the lse and the slopes (fp32 per head, once a layer); both keep q, k, v (the
        # empty cache's copies of k and v, q copied out of query_key_value's output) and the output
        attention = tokens * (HEADS * SEQ * F32 - HEADS * 4) - HEADS * 4
        return Saving(LAYERS * tokens * (gelu + 2 * norm), LAYERS * attention, LAYERS * (gelu + 2 * norm), 0)
    if name == "opt":  # the ReLU MLP stays stock: the two LayerNorms only
        return Saving(LAYERS * tokens * 2 * norm, LAYERS * tokens * copy, LAYERS * 2 * norm, 0)
    raise AssertionError(name)


# Phi and GPT-J default to gelu_new, a Python formula whose autograd keeps intermediates of its own
# (test_gelu_new_keeps_three_more_intermediates); the figures here are derived on the one-op tanh
# GELU, the same function.
ONE_OP_GELU = {"phi": {"hidden_act": "gelu_pytorch_tanh"}, "gptj": {"activation_function": "gelu_pytorch_tanh"},
               "clip": {"hidden_act": "gelu"}}


@pytest.mark.parametrize("name", CASES)
def test_saved_bytes_per_layer(target, name):
    device, _ = target
    stock, ffn = build_case(name, **ONE_OP_GELU.get(name, {}))
    stock.to(device)
    batch = family_inputs(CASES[name].family, device)
    expected = expected_saving(name, ffn, device)
    before = step_saved_bytes(stock, batch)
    converted, report = convert_layers(stock, report=True)
    assert before - step_saved_bytes(converted, batch) == expected.fused + expected.attention
    assert report.saved_bytes_per_token() == expected.report_fused + expected.report_attention
    # recompute=False keeps the LayerNorm and GELU outputs again (a LayerNorm feeding two modules
    # stays stock: each would keep its own output); what remat.attention keeps less remains.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conv.RematWarning)
        kept_model, kept_report = convert_layers(stock, recompute=False, report=True)
    assert before - step_saved_bytes(kept_model, batch) == expected.attention
    assert kept_report.saved_bytes_per_token() == expected.report_attention


def test_gelu_new_keeps_three_more_intermediates():
    """Phi's default gelu_new, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in Python ops: its autograd
    keeps x³'s input x (shared with fc1's output), tanh's output, 0.5·x and 1 + tanh, the last two
    also fc2's input: three ffn-wide tensors more than the one-op GELU, all of which the fused MLP
    drops. The report counts the one-op GELU's saving, a lower bound."""
    stock, ffn = build_case("phi")
    batch = family_inputs("phi", "cpu")
    expected = expected_saving("phi", ffn, "cpu")
    converted, report = convert_layers(stock, report=True)
    extra = LAYERS * BATCH * SEQ * 3 * F32 * ffn
    saving = step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch)
    assert saving == expected.fused + expected.attention + extra
    assert report.saved_bytes_per_token() == expected.report_fused


def test_quick_gelu_keeps_its_sigmoid_more():
    """CLIP's default quick_gelu, x·σ(1.702·x) in Python ops: its autograd keeps the sigmoid's output
    besides x (fc1's output) and the product (fc2's input): one ffn-wide tensor more than a one-op
    GELU, which the fused MLP drops too. The report counts the one-op GELU's saving, a lower bound."""
    stock, ffn = build_case("clip")
    batch = family_inputs("clip", "cpu")
    expected = expected_saving("clip", ffn, "cpu")
    converted, report = convert_layers(stock, report=True)
    extra = LAYERS * (BATCH * SEQ + BATCH * 5) * F32 * ffn
    saving = step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch)
    assert saving == expected.fused + expected.attention + extra
    assert report.saved_bytes_per_token() == expected.report_fused


# --- Checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_save_pretrained_round_trip(tmp_path, name):
    """The checkpoint and its keys: remat's ops on their references (the same saves and loads, the same
    losses compared; the kernels are checked in these families' steps above), ~4 s a family fewer."""
    stock, _ = build_case(name)
    with _backend.use_backend("reference"):
        assert_save_pretrained_round_trip(stock, family_inputs(CASES[name].family, "cpu"), tmp_path)


# --- The activations: BloomGelu and transformers' tanh GELUs are the tanh approximation ----------

# transformers' GELU modules remat computes, by the approximate they are matched to
TANH_GELUS = ["GELUTanh", "NewGELUActivation", "FastGELUActivation", "BloomGelu"]
EXACT_GELUS = ["GELUActivation"]
QUICK_GELUS = ["QuickGELUActivation"]


def approximate_of(name):
    return "tanh" if name in TANH_GELUS else "quick" if name in QUICK_GELUS else "none"


def reference_gelu(x, approximate):
    """torch's GELU, or QuickGELU's defining formula (x·σ(1.702·x)) in x's dtype."""
    return x * torch.sigmoid(1.702 * x) if approximate == "quick" else F.gelu(x, approximate=approximate)


def gelu_module(name):
    if name == "BloomGelu":
        return transformers.models.bloom.modeling_bloom.BloomGelu()
    return getattr(transformers.activations, name)()


@pytest.mark.parametrize("name", TANH_GELUS + EXACT_GELUS + QUICK_GELUS)
def test_transformers_gelus_are_the_function_remat_computes(name):
    """In float64 each module's formula equals torch's GELU of its approximate to 1e-8 relative:
    FastGELU's and BloomGelu's hand-rounded constants (sqrt(2/pi) as 0.7978845608, 0.79788456) change
    it by less than any float dtype's rounding (fp32: 6e-8). BloomGelu's hand-written backward too."""
    approximate = approximate_of(name)
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
    stock = gelu_module(name).train()  # BloomGelu's autograd function runs in training
    want = reference_gelu(x, approximate)
    got = stock(x)
    assert rel_error(got, want) < 1e-8
    (d_got,), (d_want,) = torch.autograd.grad(got.sum(), x), torch.autograd.grad(want.sum(), x)
    assert rel_error(d_got, d_want) < 1e-8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", TANH_GELUS + EXACT_GELUS + QUICK_GELUS)
def test_remat_gelu_rounds_no_worse_than_the_stock_module(name, dtype):
    """In bf16 and fp16 the stock Python formulas round after every op; remat's GELU (the kernel the
    fused MLP runs) computes in fp32 and rounds once. Its error against float64 is at most twice
    the stock module's (house rule), and in fact no larger."""
    approximate = approximate_of(name)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    exact = reference_gelu(x, approximate)
    with torch.no_grad():
        stock_error = rel_error(gelu_module(name)(x.to(dtype)), exact)
        remat_error = rel_error(remat.gelu(x.to(dtype), approximate=approximate), exact)
    assert remat_error <= 2 * stock_error


# --- The remat path's guards on the new shapes -----------------------------------------------------


def test_a_hook_on_one_consumer_of_a_shared_layer_norm():
    """Phi's input_layernorm is applied inside both the attention and the MLP. A hook on the MLP
    breaks their handoff: the LayerNorm computes itself, and both modules take its output (the
    attention still on remat.attention), with the stock result."""
    stock, _ = build_case("phi")
    converted = convert_layers(stock)
    converted.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: None)
    with pytest.warns(RematFallbackWarning, match="input_layernorm is not fused any more"):
        _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, family_inputs("phi", "cpu")))
    assert calls == LAYERS


def assert_same_dropout_step_falling_back(stock, converted, batch, reason):
    """The converted model's training step, warning that its fused MLPs fell back for `reason`, draws
    the same dropout masks as stock's (the same seed) and gives the same loss and gradients."""
    torch.manual_seed(5)
    loss, grads = loss_and_grads(stock, batch)
    torch.manual_seed(5)
    with pytest.warns(RematFallbackWarning, match=reason):
        loss_c, grads_c = loss_and_grads(converted, batch)
    assert rel_error(loss_c, loss) < 1e-4
    assert all(rel_error(grads_c[k], g) < 1e-4 for k, g in grads.items() if g is not None)


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_activation_dropout_in_training_runs_the_layer_mlp_stock(name):
    """BART's and Whisper's layers apply activation_dropout between the activation and fc2: in
    training with p > 0 their fc1, activation and fc2 compute themselves, drawing the same random
    numbers as stock; in eval the fused MLP runs again."""
    stock, _ = build_case(name, activation_dropout=0.3)
    converted, report = convert_layers(stock, report=True)
    batch = family_inputs(CASES[name].family, "cpu")
    assert_same_dropout_step_falling_back(stock, converted, batch, r"activation_dropout \(p=0.3\) in training")

    def fc2_fallbacks():
        return {path: sum(reasons.values()) for path, reasons in report.fallbacks().items() if path.endswith("fc2")}

    assert list(fc2_fallbacks().values()) == [1] * (2 * LAYERS)  # each layer's fc2, once
    stock.eval(), converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss)
    assert list(fc2_fallbacks().values()) == [1] * (2 * LAYERS)  # in eval: fused, no fallback


def test_falcon_alibi_keeps_the_stock_attention():
    """Falcon adds ALiBi to a materialised (B, 1, S, S) mask: its attention implementation stays sdpa,
    and the report's root row says why; its norms and MLP fuse all the same."""
    stock, _ = build_case("falcon", alibi=True)
    converted, report = convert_layers(stock, report=True)
    (root,) = [row for row in report if row.path == "(root)"]
    assert root.action == "skipped" and "alibi=True" in root.reason, str(report)
    assert converted.config._attn_implementation == "sdpa"
    counts = swapped_counts(report)
    assert counts["RematFalconMLP"] == counts["RematNormedFalconLinear"] == counts["RematFusedLayerNorm"] == LAYERS
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, family_inputs("falcon", "cpu")))
    assert calls == 0


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["bart", "opt", "clip", "siglip", "distilbert", "gptj"])
def test_padded_batches_run_remat_attention_varlen(name):
    """A right-padded batch: the padded attentions (BART's encoder and its decoder's cross-attention
    to it, CLIP's and SigLIP's text towers, the decoders, DistilBERT) run remat.attention_varlen on
    the real tokens, the same step as stock."""
    stock, _ = build_case(name)
    batch = family_inputs(name, "cpu")
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -3:] = 0
    batch = {**batch, "attention_mask": mask}
    if name in ("opt", "gptj"):  # causal LMs: the padding's labels out of the loss
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    converted = convert_layers(stock)
    _, varlen, _ = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert varlen == (2 * LAYERS if name == "bart" else LAYERS)


@pytest.mark.kernels
@pytest.mark.parametrize("side", ["right", "left"])
def test_bloom_padded_batch_runs_remat_attention_varlen_with_its_alibi(side):
    """Padding restarts BLOOM's ALiBi positions at each sequence's first real token: the bias remat
    checks, and remat.attention_varlen's ALiBi per sequence; the same step as stock."""
    stock, _ = build_case("bloom")
    converted = convert_layers(stock)
    batch = padded_batch(family_inputs("bloom", "cpu"), side, causal=True)
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (LAYERS, 0)


def test_bloom_mlp_set_to_another_forward_after_convert_runs_stock():
    """BloomMLP's forward reads its pretraining_tp and slow_but_exact: with both set (after convert) it
    sums dense_4h_to_h in slices instead of calling it, so the MLP the structure fused (its fc1 and
    activation returning their input for fc2 to compute all) must not hold: every module of it runs its
    own forward, and the step is stock's with the same settings."""
    stock, _ = build_case("bloom")
    converted = convert_layers(stock)
    for model in (stock, converted):
        for block in model.transformer.h:
            block.mlp.pretraining_tp, block.mlp.slow_but_exact = 2, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(stock, converted, family_inputs("bloom", "cpu"))
    handoff = converted.transformer.h[0].mlp.dense_4h_to_h.remat_handoff
    assert handoff.reason() == "mlp.pretraining_tp is 2, not the 1 its forward was probed with"
    said = [str(w.message) for w in caught if issubclass(w.category, RematFallbackWarning)]
    assert sum("post_attention_layernorm" in m and "mlp.pretraining_tp is 2" in m for m in said) == LAYERS, said


def test_bloom_with_a_bias_that_is_not_its_alibi_runs_the_stock_attention():
    stock, _ = build_case("bloom")
    converted = convert_layers(stock)
    attention = converted.transformer.h[0].self_attention
    hidden = torch.randn(BATCH, SEQ, stock.config.hidden_size)
    alibi = sys.modules[type(stock).__module__].build_alibi_tensor(torch.ones(BATCH, SEQ), stock.config.n_head,
                                                                   torch.float32)
    mask = torch.full((SEQ, SEQ), torch.finfo(torch.float32).min).triu(1)[None, None].expand(BATCH, 1, SEQ, SEQ)
    call = dict(residual=hidden, alibi=alibi * 1.5 + torch.rand_like(alibi), attention_mask=mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, calls = remat_attention_calls(lambda: attention(hidden, **call))
    assert calls == 0
    assert any("an ALiBi bias other than the slopes times the key positions" in str(w.message) for w in caught)


@pytest.mark.parametrize("name, overrides, norm, reason", [
    # the structure probe sees more than projections read the LayerNorm's output (the residual add;
    # OPT's: a reshape before it) and says so; it then runs as remat.nn.LayerNorm
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "input_layernorm", "not fused into a projection"),
    ("opt", {"do_layer_norm_before": False}, "self_attn_layer_norm", "not fused into a projection"),
])
def test_configs_whose_layer_norms_feed_more_stay_stock(name, overrides, norm, reason):
    """BLOOM with apply_residual_connection_post_layernorm (the LayerNorm's output is the residual
    too) and OPT-350m's post-LN layers: the LayerNorms are not fused, with the reason; the rest
    converts."""
    stock, _ = build_case(name, **overrides)
    converted, report = convert_layers(stock, report=True)
    rows = [row for row in report.skipped if row.path.endswith(norm)]
    assert len(rows) == LAYERS and all(reason in row.reason for row in rows), str(report)
    assert "RematFusedLayerNorm" not in swapped_counts(report)
    assert "RematNormedLinear" not in swapped_counts(report)
    assert_same_step(stock, converted, family_inputs(name, "cpu"))


@pytest.mark.parametrize("name", ["phi", "falcon", "gptj"])
def test_generation_uses_the_cache_like_stock(name):
    """The prefill fills an empty cache through remat.attention; the steps after it run the stock
    attention; greedy generation gives the same tokens."""
    stock, _ = build_case(name)
    stock.eval()
    converted = convert_layers(stock)
    ids = family_inputs(name, "cpu")["input_ids"]
    with torch.no_grad():
        want = stock(ids, use_cache=True).logits
        got, calls = remat_attention_calls(lambda: converted(ids, use_cache=True).logits)
        assert calls == LAYERS
        torch.testing.assert_close(got, want)
        settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
        torch.testing.assert_close(converted.generate(ids, **settings), stock.generate(ids, **settings))


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_an_encoder_decoder_prefill_fills_its_self_attention_cache_through_remat(name):
    """The decoder's self-attention reads the EncoderDecoderCache's self_attention_cache: an empty
    one is filled through remat.attention, as stock fills it (and the cross-attention's keys and
    values from the encoder are computed once and kept in its cross_attention_cache)."""
    stock, _ = build_case(name)
    stock.eval()
    converted = convert_layers(stock)
    batch = {k: v for k, v in family_inputs(name, "cpu").items() if k != "labels"}
    batch["decoder_input_ids"] = batch.get("input_ids", torch.full((BATCH, 1), 1))[:, :SEQ]
    with torch.no_grad():
        want = stock(**batch, use_cache=True)
        got, calls = remat_attention_calls(lambda: converted(**batch, use_cache=True))
    assert calls == 3 * LAYERS  # the encoder's and the decoder's self-attention, the cross-attention
    torch.testing.assert_close(got.logits, want.logits)
    assert got.cache.self_attention_cache.get_seq_length() == want.cache.self_attention_cache.get_seq_length()
    assert got.cache.cross_attention_cache.get_seq_length() == want.cache.cross_attention_cache.get_seq_length()


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_an_encoder_decoder_generates_as_stock(name):
    """Greedy generation: the encoder once, then each step's self-attention over the cache and
    cross-attention over the encoder's keys, all on remat.attention: the same tokens as stock."""
    stock, _ = build_case(name)
    stock.eval()
    converted = convert_layers(stock)
    batch = {k: v for k, v in family_inputs(name, "cpu").items() if k != "labels"}
    settings = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        want = stock.generate(**batch, **settings)
        got, calls = remat_attention_calls(lambda: converted.generate(**batch, **settings))
    torch.testing.assert_close(got, want)
    assert calls == LAYERS + 3 * 2 * LAYERS  # the encoder's layers, then 3 steps of the decoder's


def test_a_layer_mlp_dropout_two_attributes_held_runs_stock_when_either_drops():
    """BART's layer applies dropout(p=activation_dropout) between its activation and fc2, and
    dropout(p=dropout) after fc2: with both 0 at convert time the probe cannot tell which attribute
    the first reads, so the fused MLP holds only while neither drops in training."""
    stock, _ = build_case("bart")
    converted = convert_layers(stock)
    for layer in (*stock.model.encoder.layers, *converted.model.encoder.layers):
        layer.dropout = 0.2  # after fc2: stock's own dropout, which the fused MLP could have kept
    batch = family_inputs("bart", "cpu")
    assert_same_dropout_step_falling_back(stock, converted, batch, r"dropout \(p=0.2\) in training")


def test_a_layer_set_to_training_alone_runs_its_held_mlp_stock():
    """BART's layer reads its own training flag for the activation_dropout between its activation and fc2:
    set on the layer alone (its children still in eval), stock drops there, so the fused MLP, decided in
    eval, is decided again and runs stock (the handoff's fingerprint watches the layer for its dropout)."""
    stock, _ = build_case("bart", activation_dropout=0.3)
    converted = convert_layers(stock)
    batch = family_inputs("bart", "cpu")
    stock.eval(), converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss)  # fused, decided in eval
    for layer in (*stock.model.encoder.layers, *converted.model.encoder.layers):
        layer.training = True
    torch.manual_seed(5)
    with torch.no_grad():
        want = stock(**batch).loss
    torch.manual_seed(5)
    with torch.no_grad(), pytest.warns(RematFallbackWarning, match=r"activation_dropout \(p=0.3\) in training"):
        got = converted(**batch).loss
    torch.testing.assert_close(got, want)


def test_a_layer_mlp_dropout_read_from_no_attribute_stays_stock(monkeypatch):
    """A dropout between the activation and fc2 whose probability no attribute of the layer holds
    (here a class attribute): whether it drops in training is unknown, so that MLP stays stock."""
    layer_class = transformers.models.bart.modeling_bart.BartEncoderLayer
    monkeypatch.setattr(layer_class, "activation_dropout", 0.25, raising=False)
    stock, _ = build_case("bart")
    for layer in stock.model.encoder.layers:
        del layer.activation_dropout
    converted, report = convert_layers(stock, report=True)
    rows = [row for row in report.skipped if "the MLP the layer holds stays stock" in row.reason]
    assert [row.path for row in rows] == [f"model.encoder.layers.{i}" for i in range(LAYERS)], str(report)
    assert all("(p=0.25) reads no attribute of BartEncoderLayer" in row.reason for row in rows)
    assert swapped_counts(report)["RematMLPLinear"] == LAYERS  # the decoder's
    assert_same_step(stock, converted, family_inputs("bart", "cpu"), seed=5)  # the same dropout masks


def test_pickle_and_deepcopy_keep_the_handoffs(tmp_path):
    """A converted model with a shared LayerNorm (Phi) and a layer-held MLP (BART) survives
    torch.save / torch.load and deepcopy: the copy's handoffs point at the copy's layers."""
    import copy
    for name in ("phi", "bart"):
        stock, _ = build_case(name)
        converted = convert_layers(stock)
        batch = family_inputs(name, "cpu")
        torch.save(converted, tmp_path / f"{name}.pt")
        for again in (torch.load(tmp_path / f"{name}.pt", weights_only=False), copy.deepcopy(converted)):
            with torch.no_grad():
                _, calls = remat_attention_calls(lambda m=again, b=batch: m(**b))
            assert calls == CASES[name].attention
            with torch.no_grad():
                torch.testing.assert_close(again(**batch).loss, stock(**batch).loss)


# --- remat memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, tokens", [("deit", 6), ("phi", SEQ), ("bloom", SEQ)])
def test_remat_memory_reads_the_familys_config(tmp_path, name, tokens):
    """`remat memory --model config.json` builds the family's model and counts, exactly, what
    remat.convert keeps less per layer: the fused figures of the report (DeiT through its family's
    pixel input, with its 4 patches and 2 extra tokens)."""
    stock, ffn = build_case(name, **ONE_OP_GELU.get(name, {}))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stock.config.to_dict()))
    results = {r.policy: r for r in memory.run(str(path), batch=BATCH, seq=SEQ, out_dir=str(tmp_path),
                                               device="cpu", dtype=torch.float32)}
    expected = expected_saving(name, ffn, "cpu")
    per_layer_token = expected.report_fused // LAYERS
    saved = results["eager"].saved_bytes - results["remat"].saved_bytes
    assert saved == LAYERS * BATCH * tokens * per_layer_token + expected.attention  # attention: at BATCH x SEQ
    assert not math.isnan(results["eager"].per_layer_sbh)


@pytest.mark.parametrize("name", ["phi", "falcon-new", "bart", "whisper", "bloom", "opt"])
def test_revert(name):
    """remat.revert gives the stock classes back, the shared LayerNorms, the layers' own fc1,
    activation and fc2, and the Linears fused inside stock modules included."""
    stock, _ = build_case(name)
    stock_types = [type(m) for m in stock.modules()]
    converted = convert_layers(stock)
    reverted = conv.revert(converted)
    assert [type(m) for m in reverted.modules()] == stock_types
    assert not any(n.startswith("remat_") for m in reverted.modules() for n in vars(m))
    batch = family_inputs(CASES[name].family, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(reverted(**batch).loss, stock(**batch).loss, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["deit", "distilbert"])
def test_a_model_in_training_with_attention_dropout_still_converts(name):
    """With an attention dropout (0.1) in a model in training mode, the attention interface hands the
    call's dropout over: the calls run remat.attention, in training with its dropout_p, and in eval
    without."""
    stock, _ = build_case(name, **({"attention_probs_dropout_prob": 0.1} if name == "deit" else
                                   {"attention_dropout": 0.1}))
    converted = convert_layers(stock.train())
    batch = family_inputs(name, "cpu")
    _, calls = remat_attention_calls(lambda: converted(**batch))
    assert calls == LAYERS
    converted.eval()
    with torch.no_grad():
        _, calls = remat_attention_calls(lambda: converted(**batch))
    assert calls == LAYERS
