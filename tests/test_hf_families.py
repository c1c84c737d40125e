"""remat.convert on the Hugging Face families built from LayerNorms and GELU MLPs (tiny random configs,
no downloads): DeiT, SigLIP (both towers), Phi, GPT-J, Falcon (its three layer wirings, multi-query
and grouped keys), DistilBERT, BART, Whisper, BLOOM and OPT. The same loss and gradients as stock,
the same checkpoint, the exact bytes no longer kept (derived per family), and the reasons for what
stays stock: BLOOM's ALiBi attention, OPT's ReLU MLP, cross-attention, post-LN configs."""

import collections
import importlib
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from hf_models import (
    BATCH,
    HEADS,
    HIDDEN,
    LAYERS,
    SEQ,
    WHISPER_FRAMES,
    OpCounter,
    assert_same_step,
    build,
    family_inputs,
    loss_and_grads,
    remat_attention_calls,
    transformers,
)
from numerics import rel_error, saved_bytes

import remat
from remat import memory

conv = importlib.import_module("remat.convert")

HEAD_DIM = HIDDEN // HEADS
F32 = 4  # bytes: the tests run in fp32
STATS = 8  # fp32 mean and rstd per token: what a second consumer of one LayerNorm keeps besides x
STOCK_INDEX_BYTES = 16  # Falcon's new architecture indexes k and v with [-2] and [-1]: two 1-element int64 indices

# case -> (family, config overrides, {swapped class: count}, remat attention kernels per step,
#          {reason substring: count} of the rows left stock)
Case = collections.namedtuple("Case", "family overrides swaps attention skipped")
CASES = {
    "deit": Case("deit", {}, {"RematDeiTAttention": 2, "RematDeiTMLP": 2, "RematFusedLayerNorm": 4}, 2, {}),
    # both towers' layers, and the vision tower's pooling head (its LayerNorm and MLP)
    "siglip": Case("siglip", {}, {"RematSiglipAttention": 4, "RematSiglipMLP": 5, "RematFusedLayerNorm": 9}, 4, {}),
    # one LayerNorm per layer, fused into both the attention and the MLP
    "phi": Case("phi", {}, {"RematPhiAttention": 2, "RematPhiMLP": 2, "RematFusedLayerNorm": 2}, 2, {}),
    "gptj": Case("gptj", {}, {"RematGPTJAttention": 2, "RematGPTJMLP": 2, "RematFusedLayerNorm": 2}, 2, {}),
    # Falcon-7B: multi-query, one LayerNorm feeding the parallel attention and MLP
    "falcon": Case("falcon", {}, {"RematFalconAttention": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 2}, 2, {}),
    # the new decoder architecture: one group of keys and values for the 2 heads, ln_attn and ln_mlp
    "falcon-new": Case("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1},
                       {"RematFalconAttention": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 4}, 2, {}),
    "falcon-new-one-ln": Case("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1,
                                         "num_ln_in_parallel_attn": 1},
                              {"RematFalconAttention": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 2}, 2, {}),
    "falcon-sequential": Case("falcon", {"parallel_attn": False, "multi_query": False},
                              {"RematFalconAttention": 2, "RematFalconMLP": 2, "RematFusedLayerNorm": 4}, 2, {}),
    "distilbert": Case("distilbert", {}, {"RematDistilBertSelfAttention": 2, "RematFFN": 2}, 2, {}),
    "bart": Case("bart", {}, {"RematBartAttention": 4, "RematMLPLinear": 4, "RematFusedLinear": 4,
                              "RematFusedGELUActivation": 4}, 4, {"cross-attention": 2}),
    "whisper": Case("whisper", {}, {"RematWhisperAttention": 4, "RematMLPLinear": 4, "RematFusedLinear": 4,
                                    "RematFusedGELUActivation": 4, "RematFusedLayerNorm": 10,
                                    "RematNormedLinear": 2}, 4, {"cross-attention": 2}),
    "bloom": Case("bloom", {}, {"RematBloomMLP": 2, "RematFusedLayerNorm": 4, "RematNormedLinear": 2}, 0,
                  {"ALiBi position bias": 2}),
    "opt": Case("opt", {}, {"RematOPTAttention": 2, "RematFusedLayerNorm": 4, "RematNormedLinear": 2}, 2,
                {"ReLU is not a GELU": 2}),
}


def build_case(name, **overrides):
    case = CASES[name]
    return build(case.family, **{**case.overrides, **overrides})


def swapped_counts(report):
    return collections.Counter(row.action.removeprefix("swapped to ") for row in report if row.action != "skipped")


def assert_skipped_as_expected(report, expected):
    """Every row left stock is one the case expects, for its reason (and no "no remat rule" row)."""
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
    converted, report = conv.convert(stock, report=True)
    counts = swapped_counts(report)
    for cls, count in case.swaps.items():
        assert counts[cls] == count, f"{cls}: {counts[cls]} != {count}\n{report}"
    assert_skipped_as_expected(report, case.skipped)
    # the checkpoint: the same keys in the same order, the same values, loadable strictly
    state, converted_state = stock.state_dict(), converted.state_dict()
    assert list(converted_state) == list(state)
    assert all(torch.equal(converted_state[k], v) for k, v in state.items())
    converted.load_state_dict(state, strict=True)
    with OpCounter() as counter:  # the stock model runs no remat op: the counts are the converted's
        assert_same_step(stock, converted, family_inputs(case.family, device))
    assert counter.counts["remat::attention_fwd"] == case.attention
    assert counter.counts["remat::attention_bwd"] == case.attention


# --- What autograd keeps: derived per family, asserted exactly -------------------------------------


def attention_output_copy(family, device):
    """Bytes per token the stock out-projection keeps of a copy of the attention output (fp32), or 0.

    SDPA's output takes q's layout on some backends (CPU); where that is (B, H, S, D), the stock
    transpose(1, 2).reshape copies it, and the out-projection keeps the copy besides the output SDPA
    keeps. remat.attention lays its output out (B, S, H, D): no copy. q is built as each family
    builds it: a view of the projection (B, S, H, D) transposed; Phi's rotary (a torch.cat over the
    head dim) and Whisper's .contiguous() make it (B, H, S, D) itself."""
    q = torch.randn(1, 3, HEADS, HEAD_DIM, device=device, requires_grad=True).transpose(1, 2)
    if family in ("phi", "whisper"):
        q = q.contiguous()
    out = F.scaled_dot_product_attention(q, q, q)
    return 0 if out.transpose(1, 2).is_contiguous() else F32 * HIDDEN


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
          the same x once and each its own fp32 mean/rstd: norm - STATS
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
    if name in ("phi", "gptj"):
        per_layer = gelu + norm - STATS
        return Saving(LAYERS * tokens * per_layer, LAYERS * tokens * copy, LAYERS * per_layer, 0)
    if name.startswith("falcon"):
        config = CASES[name].overrides
        new = config.get("new_decoder_architecture", False)
        one_norm = config.get("num_ln_in_parallel_attn") == 1 or not config  # Falcon-7B's default: one
        per_layer = gelu + (norm - STATS if one_norm else 2 * norm)
        gqa = 2 * (HEADS - 1) * HEAD_DIM * F32 if new else 0
        mask = sdpa_mask_bytes(device, 1 if new or config.get("multi_query", True) else HEADS)
        index = LAYERS * STOCK_INDEX_BYTES if new else 0
        return Saving(LAYERS * tokens * per_layer, LAYERS * tokens * (gqa + mask + copy) + index,
                      LAYERS * per_layer, LAYERS * gqa)
    if name == "distilbert":
        return Saving(LAYERS * tokens * gelu, 0, LAYERS * gelu, 0)
    if name == "bart":  # post-LN: the MLPs only, in the encoder's and the decoder's layers
        return Saving(2 * LAYERS * tokens * gelu, 0, 2 * LAYERS * gelu, 0)
    if name == "whisper":  # encoder: 2 LayerNorms; decoder: 3 (the cross-attention's into its q_proj)
        encoder, decoder, frames = gelu + 2 * norm, gelu + 3 * norm, BATCH * WHISPER_FRAMES
        return Saving(LAYERS * (frames * encoder + tokens * decoder), LAYERS * (frames + tokens) * copy,
                      LAYERS * (encoder + decoder), 0)
    if name == "bloom":  # the ALiBi attention stays stock, with input_layernorm fused into query_key_value
        return Saving(LAYERS * tokens * (gelu + 2 * norm), 0, LAYERS * (gelu + 2 * norm), 0)
    if name == "opt":  # the ReLU MLP stays stock: the two LayerNorms only
        return Saving(LAYERS * tokens * 2 * norm, LAYERS * tokens * copy, LAYERS * 2 * norm, 0)
    raise AssertionError(name)


# Phi and GPT-J default to gelu_new, a Python formula whose autograd keeps intermediates of its own
# (test_gelu_new_keeps_three_more_intermediates); the figures here are derived on the one-op tanh
# GELU, the same function.
ONE_OP_GELU = {"phi": {"hidden_act": "gelu_pytorch_tanh"}, "gptj": {"activation_function": "gelu_pytorch_tanh"}}


def measure(model, batch):
    return saved_bytes(lambda: model(**batch).loss, exclude=list(model.parameters()))


@pytest.mark.parametrize("name", CASES)
def test_saved_bytes_per_layer(target, name):
    device, _ = target
    stock, ffn = build_case(name, **ONE_OP_GELU.get(name, {}))
    stock.to(device)
    batch = family_inputs(CASES[name].family, device)
    expected = expected_saving(name, ffn, device)
    before = measure(stock, batch)
    converted, report = conv.convert(stock, report=True)
    assert before - measure(converted, batch) == expected.fused + expected.attention
    assert report.saved_bytes_per_token() == expected.report_fused + expected.report_attention
    # recompute=False keeps the LayerNorm and GELU outputs again (a LayerNorm feeding two modules
    # stays stock: each would keep its own output); what remat.attention keeps less remains.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conv.RematWarning)
        kept_model, kept_report = conv.convert(stock, recompute=False, report=True)
    assert before - measure(kept_model, batch) == expected.attention
    assert kept_report.saved_bytes_per_token() == expected.report_attention


def test_gelu_new_keeps_three_more_intermediates():
    """Phi's default gelu_new, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in Python ops: its autograd
    keeps x³'s input x (shared with fc1's output), tanh's output, 0.5·x and 1 + tanh, the last two
    also fc2's input: three ffn-wide tensors more than the one-op GELU, all of which the fused MLP
    drops. The report counts the one-op GELU's saving, a lower bound."""
    stock, ffn = build_case("phi")
    batch = family_inputs("phi", "cpu")
    expected = expected_saving("phi", ffn, "cpu")
    converted, report = conv.convert(stock, report=True)
    extra = LAYERS * BATCH * SEQ * 3 * F32 * ffn
    assert measure(stock, batch) - measure(converted, batch) == expected.fused + expected.attention + extra
    assert report.saved_bytes_per_token() == expected.report_fused
