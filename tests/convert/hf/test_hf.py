"""remat.convert on Hugging Face models (tiny random configs, no downloads): attention on
remat.attention with the pre-LN LayerNorms fused into the q/k/v projection and into fc1, the
MLPs fused; same loss and gradients, the exact bytes no longer kept, the stock result wherever
the remat path does not apply (output_attentions, KV cache), padded and packed batches on
remat.attention_varlen, same state_dict, gradient checkpointing, revert."""

import collections
import copy
import functools
import importlib
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from remat._guards import RematFallbackWarning, fallback_counts

from hf_models import (
    DECODERS,
    FAMILIES,
    FUSED,
    GRAD_TOL,
    HEADS,
    HIDDEN,
    LAYERS,
    PRE_LN,
    QKV_PROJECTIONS,
    OpCounter,
    assert_nothing_seq_by_seq_saved,
    assert_same_step,
    build,
    cache_view_bytes,
    convert_layers,
    inputs,
    loss_and_grads,
    packed_batch,
    padded_batch,
    remat_attention_calls,
    tokens,
    transformers,
    varlen_attention_calls,
)
from numerics import rel_error, saved_bytes

# remat.convert is also the name of the function remat/__init__.py exports: import the module by path.
conv = importlib.import_module("remat.convert")
from remat.convert import hf  # noqa: E402
from remat.convert.hf import interface  # noqa: E402

# RoBERTa's LM head (dense -> GELU -> layer_norm -> decoder, no family rule) has its LayerNorm fused into
# the decoder by structure (convert/hf/structure.py): hidden fp32 bytes a token more not kept.
HEAD_NORMS = {"roberta": 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_same_loss_gradients_and_state_dict(target, family):
    device, _ = target
    stock, _ = build(family)
    stock.to(device)
    converted, report = convert_layers(stock, report=True)
    actions = collections.Counter(row.action for row in report)
    assert actions[f"swapped to {FUSED[family]}"] == LAYERS, str(report)
    expected_norms = (2 * LAYERS if family in PRE_LN else 0) + HEAD_NORMS.get(family, 0)
    assert actions["swapped to RematFusedLayerNorm"] == expected_norms, str(report)
    assert any(row.action == "swapped to remat.nn.LayerNorm" for row in report)
    # the attention modules stay, on the "remat" implementation
    assert converted.config._attn_implementation == "remat"
    normed = "RematNormedConv1D" if family == "gpt2" else "RematNormedLinear"  # GPT-2's c_attn is a Conv1D
    # (RoBERTa's LM head has its layer_norm fused into its decoder: HEAD_NORMS)
    projections = LAYERS * QKV_PROJECTIONS.get(family, 1) if family in PRE_LN else 0
    assert actions[f"swapped to {normed}"] == projections + HEAD_NORMS.get(family, 0), str(report)
    assert len(report.kept) == LAYERS and all("its attention function remat's" in r.reason for r in report.kept)
    assert not report.skipped and f" swapped, {LAYERS} kept, 0 skipped;" in str(report), str(report)
    assert list(converted.state_dict()) == list(stock.state_dict())
    converted.load_state_dict(stock.state_dict(), strict=True)
    batch = inputs(family, device)
    with OpCounter() as counter:  # the stock model runs no remat op: the counts are the converted's
        assert_same_step(stock, converted, batch)
    assert counter.counts["remat::attention_fwd"] == LAYERS
    assert counter.counts["remat::attention_bwd"] == LAYERS


def attention_output_copy(family, device):
    """Bytes per token and hidden unit of the copy the stock out-projection keeps of the attention
    output (fp32), or 0: SDPA's output is (B, H, S, D); when it is not laid out (B, S, H, D), as
    remat.attention's always is, transformers' transpose(1, 2).contiguous() copies it, and the
    out-projection keeps the copy besides the original that SDPA's backward keeps. On CPU, SDPA's
    output takes q's layout: a copy for GPT-NeoX only."""
    # q as the models give it, in training: a (B, S, H, D) projection output viewed as (B, H, S, D),
    # or, after GPT-NeoX's rotary embedding (a torch.cat over the head dim), (B, H, S, D) itself.
    if family == "gpt_neox":
        q = torch.randn(1, HEADS, 3, HIDDEN // HEADS, device=device, requires_grad=True)
    else:
        q = torch.randn(1, 3, HEADS, HIDDEN // HEADS, device=device, requires_grad=True).transpose(1, 2)
    return 0 if F.scaled_dot_product_attention(q, q, q).transpose(1, 2).is_contiguous() else 4


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_bytes_per_layer(target, family):
    """Per layer and token, in fp32 (4 bytes), the converted model no longer keeps (docs/memory.md):
    the GELU output (ffn), the outputs of the two pre-LN LayerNorms (hidden each: the fused
    projections keep x and mean/rstd instead; ViT's three q/k/v Linears read one LayerNorm, computed
    once), the stock copy of the attention output (see attention_output_copy) and GPT-2's q view of
    its whole projection output (cache_view_bytes). The report's
    total is that figure less the attention copy, which depends on the device. GPT-2 runs a tanh
    GELU here that transformers computes in one op (its default gelu_new keeps intermediates in
    Python)."""
    device, _ = target
    overrides = {"activation_function": "gelu_pytorch_tanh"} if family == "gpt2" else {}
    stock, ffn = build(family, **overrides)
    stock.to(device)
    batch = inputs(family, device)
    measure = lambda m: saved_bytes(lambda: m(**batch).loss, exclude=list(m.parameters()))  # noqa: E731
    layer_norms = 2 if family in PRE_LN else 0
    attention_copy = attention_output_copy(family, device) * HIDDEN + cache_view_bytes(family)
    fused_per_token = 4 * ffn + layer_norms * 4 * HIDDEN
    before = measure(stock)
    converted, report = convert_layers(stock, report=True)
    after = measure(converted)
    head = HEAD_NORMS.get(family, 0) * 4 * HIDDEN
    assert before - after == LAYERS * tokens(family) * (fused_per_token + attention_copy) + tokens(family) * head
    assert report.saved_bytes_per_token() == LAYERS * fused_per_token + head
    # recompute=False keeps the LayerNorm and GELU outputs again: only the attention term remains.
    with pytest.warns(conv.RematWarning, match="saves no activation memory"):
        kept_model, kept_report = convert_layers(stock, recompute=False, report=True)
    assert before - measure(kept_model) == LAYERS * tokens(family) * attention_copy
    assert kept_report.saved_bytes_per_token() == 0


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gradient_checkpointing(target, family):
    device, _ = target
    stock, _ = build(family)
    stock.to(device)
    converted = convert_layers(stock)
    with warnings.catch_warnings():  # 5.x deprecates the name for activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        converted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert converted.is_gradient_checkpointing
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, inputs(family, device)))
    assert calls == 2 * LAYERS  # the forward, and its rerun in the backward


@pytest.mark.parametrize("family", FAMILIES)
def test_revert(family):
    stock, _ = build(family)
    reference = copy.deepcopy(stock)
    converted = convert_layers(stock)
    reverted = conv.revert(converted)
    stock_types = [type(m) for m in reference.modules()]
    assert [type(m) for m in reverted.modules()] == stock_types
    assert not any(name.startswith("remat_") for m in reverted.modules() for name in vars(m))
    assert list(reverted.state_dict()) == list(reference.state_dict())
    batch = inputs(family, "cpu")
    torch.testing.assert_close(reverted(**batch).loss, reference(**batch).loss, rtol=0, atol=0)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "bert", "gpt_neox"])
def test_padded_batches_run_remat_attention_varlen(family, implementation, side):
    """A padding mask (bool for sdpa, float for eager) runs remat.attention_varlen on the real tokens:
    the same step as stock (the loss over real tokens), nothing of size seq x seq saved."""
    stock, _ = build(family, attn_implementation=implementation)
    converted = convert_layers(stock)
    batch = padded_batch(inputs(family, "cpu"), side, causal=family in DECODERS)
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (LAYERS, 0)
    full = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}  # nothing hidden: remat.attention
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, full))
    assert (varlen, dense) == (0, LAYERS)
    assert_nothing_seq_by_seq_saved(converted, batch)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_a_causal_padded_batch_gives_the_real_tokens_stock_logits(family):
    """Every real token's logits are stock's (the padding rows' attention is zero, see
    tests/convert/hf/test_masks.py, as in Hugging Face's FlashAttention path)."""
    stock, _ = build(family)
    stock.eval()
    converted = convert_layers(stock)
    for side in ("right", "left"):
        batch = {k: v for k, v in padded_batch(inputs(family, "cpu"), side, causal=True).items() if k != "labels"}
        (got, want), varlen, _ = varlen_attention_calls(
            lambda batch=batch: (converted(**batch).logits, stock(**batch).logits))
        real = batch["attention_mask"].bool()
        assert varlen == LAYERS
        torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_packed_sequences_run_remat_attention_varlen_as_stock_honours_them(family):
    """position_ids restarting, without a cache: transformers builds a block-diagonal mask, and remat
    runs attention_varlen on the sequences; with a cache (use_cache=True) stock ignores the packing,
    attends across the sequences, and so does remat (remat.attention, causal)."""
    stock, _ = build(family)
    converted = convert_layers(stock)
    packed = packed_batch(inputs(family, "cpu"))
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, packed))
    assert (varlen, dense) == (LAYERS, 0)
    ignored = {**packed, "use_cache": True}
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, ignored))
    assert (varlen, dense) == (0, LAYERS)


@pytest.mark.parametrize("family", ["gpt2", "vit", "gpt_neox"])
def test_output_attentions_gives_the_stock_weights(family):
    stock, _ = build(family, attn_implementation="eager")
    stock.eval()
    converted = convert_layers(stock)
    batch = {k: v for k, v in inputs(family, "cpu").items() if k != "labels"}
    want = stock(**batch, output_attentions=True)
    got, calls = remat_attention_calls(lambda: converted(**batch, output_attentions=True))
    assert calls == 0
    assert len(got.attentions) == len(want.attentions) == LAYERS
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.logits, want.logits)
    fell_back = fallback_counts(converted)  # the attention modules: the weights asked for
    _, calls = remat_attention_calls(lambda: converted(**batch))  # not asked for: remat again
    assert calls == LAYERS
    # and nothing else fell back: transformers' output recorders, left on the attention modules, read
    # their outputs only, and the norm fused into the projections inside them stays fused
    assert fallback_counts(converted) == fell_back
    reasons = {"attention weights requested (output_attentions)"}
    assert all(set(counts) == reasons for counts in fell_back.values())


@pytest.mark.parametrize("family", DECODERS)
def test_generation_uses_the_cache_like_stock(family):
    """The prefill fills an empty DynamicCache through remat.attention; the steps after it (past
    keys in the cache) run the stock attention with a rule's attention class (GPT-2), remat.attention
    through the interface (GPT-NeoX: one query sees every key). Greedy generation gives the same tokens."""
    stock, _ = build(family)
    stock.eval()
    converted = convert_layers(stock)
    ids = inputs(family, "cpu")["input_ids"]
    with torch.no_grad():
        prefill_stock = stock(ids, use_cache=True)
        prefill, calls = remat_attention_calls(lambda: converted(ids, use_cache=True))
        assert calls == LAYERS
        torch.testing.assert_close(prefill.logits, prefill_stock.logits)
        step = ids[:, -1:]
        want = stock(step, cache=prefill_stock.cache, use_cache=True).logits
        got, calls = remat_attention_calls(lambda: converted(step, cache=prefill.cache, use_cache=True).logits)
        assert calls == LAYERS
        torch.testing.assert_close(got, want)
        settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
        torch.testing.assert_close(converted.generate(ids, **settings), stock.generate(ids, **settings))


def test_dropout_stays_equivalent_in_training():
    """GPT-2 with resid_pdrop > 0 in training: the dropouts after c_proj are torch's nn.Dropout,
    drawn in the same order, so the same seed gives the same loss and gradients."""
    stock, _ = build("gpt2", n_layer=1, resid_pdrop=0.3, attn_pdrop=0.0)
    converted = convert_layers(stock)
    batch = inputs("gpt2", "cpu")
    torch.manual_seed(5)
    loss, grads = loss_and_grads(stock, batch)
    torch.manual_seed(5)
    (loss_c, grads_c), calls = remat_attention_calls(lambda: loss_and_grads(converted, batch))
    assert calls == 1
    assert rel_error(loss_c, loss) < GRAD_TOL
    for key in grads:
        assert rel_error(grads_c[key], grads[key]) < GRAD_TOL, key


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("family, dropout", [("gpt2", {"attn_pdrop": 0.1}),
                                             ("bert", {"attention_probs_dropout_prob": 0.1}),
                                             ("qwen2", {"attention_dropout": 0.1, "use_cache": False})])
def test_default_attention_dropout_runs_remat_attention_reproducibly(family, dropout, padded):
    """GPT-2 and BERT with their default attention dropout (0.1), and a Llama-like family's, in
    training, on a full batch (remat.attention) and a right-padded one (remat.attention_varlen): remat
    draws its own mask (Philox, regenerated in the backward), so the same seed gives bitwise the same
    loss and gradients, another seed another loss."""
    stock, _ = build(family, **dropout)
    converted = convert_layers(stock)
    batch = inputs(family, "cpu")
    if padded:
        batch = padded_batch(batch, "right", causal=family != "bert")

    def step(seed):
        torch.manual_seed(seed)
        return loss_and_grads(converted, batch)

    (loss, grads), varlen, dense = varlen_attention_calls(lambda: step(3))
    assert (varlen, dense) == ((LAYERS, 0) if padded else (0, LAYERS))
    again, grads_again = step(3)
    assert torch.equal(loss, again)
    assert all(torch.equal(grads[k], grads_again[k]) for k in grads if grads[k] is not None)
    assert not torch.equal(step(4)[0], loss)


def test_a_head_dim_the_kernels_lack_runs_stock_attention_on_a_gpu(monkeypatch):
    """Head dim 16, which the GPU kernels lack: on the CPU remat's reference computes every head dim;
    on a GPU (simulated: the kernels' verdict patched in) the attention interface hands the call to
    stock attention, with the reason. The same step as stock either way."""
    model, _ = build("bert", hidden_size=48, num_attention_heads=3)
    converted = convert_layers(model)
    batch = inputs("bert", "cpu")
    _, calls = remat_attention_calls(lambda: assert_same_step(model, converted, batch))
    assert calls == LAYERS
    monkeypatch.setattr(interface, "kernels_reason", lambda q, k, v: f"head dim {q.shape[-1]} is not the kernels'")
    warning = r"attention.self \(BertSelfAttention\) runs stock attention: head dim 16"
    with pytest.warns(RematFallbackWarning, match=warning):
        _, calls = remat_attention_calls(lambda: assert_same_step(model, converted, batch))
    assert calls == 0


def test_probe_refuses_a_forward_that_differs():
    """A transformers MLP whose forward is not the known one is left alone, and the report says why."""
    model, _ = build("gpt2")
    mlp = model.transformer.h[0].mlp
    # what a new version might do (a method of the instance: a copy of the model calls the copy's children)
    mlp.forward = types.MethodType(lambda self, x: self.c_proj(self.act(self.c_fc(x)) * 2), mlp)
    _, report = convert_layers(model, report=True)
    row = next(row for row in report if row.path == "transformer.h.0.mlp")
    assert row.action == "skipped" and row.reason.startswith("not fused as an MLP: its forward"), str(report)
    assert hf.is_hf_model(model) and not hf.is_hf_model(torch.nn.Linear(2, 2))


def test_probe_refuses_an_attention_forward_that_differs(monkeypatch):
    """An attention class whose stock forward computes something else (a new release, say) is
    left alone: the stock module is kept as it is, and convert says so in a warning, not in the report
    only. The LayerNorm before it is fused into its query_key_value by structure, a fusion of its own
    (probed on the whole block, whose stock forward it computes), which stands."""
    stock_class = transformers.models.bloom.modeling_bloom.BloomAttention  # swapped by class (the ALiBi tensor)
    original = stock_class.forward

    @functools.wraps(original)
    def scaled(self, *args, **kwargs):
        out, *rest = original(self, *args, **kwargs)
        return out * 2, *rest

    monkeypatch.setattr(stock_class, "forward", scaled)
    model, _ = build("bloom")
    with pytest.warns(conv.RematWarning, match=r"remat.convert: 2 modules that a rule of remat's is written for "
                                               r"failed its probe and stay stock: transformer.h.0.self_attention: "
                                               r"probe mismatch"):
        converted, report = convert_layers(model, report=True)
    rows = collections.defaultdict(list)
    for row in report:
        rows[row.path].append(row)
    (attention,) = rows["transformer.h.0.self_attention"]
    assert attention.action == "skipped" and "probe mismatch" in attention.reason, str(report)
    norm_rows = rows["transformer.h.0.input_layernorm"]
    assert [r.action for r in norm_rows] == ["swapped to RematFusedLayerNorm"], str(report)
    assert type(converted.transformer.h[0].self_attention) is stock_class
    ids = inputs("bloom", "cpu")["input_ids"]  # the fused norm computes what the (changed) stock forward does
    with torch.no_grad():
        assert rel_error(converted(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
