"""remat.convert on the Hugging Face families built from RMSNorms and gated MLPs (tiny random configs,
no downloads), none of which has a rule: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma2 and Gemma3
(text). Attention runs as the "remat" attention implementation (interface.py), norms and MLPs are fused
by structure (structure.py). The same loss and gradients as stock, the same checkpoint, the exact bytes
no longer kept (derived per family), and the reasons for what stays stock: the norms of a block's
output. Sliding windows and Gemma2's softcap run on remat.attention, padded and packed batches on
remat.attention_varlen; a call remat's kernels do not take (another mask, a static cache's prefill)
keeps the fused norm and projections and runs stock attention."""

import collections
import importlib
import json
import warnings

import pytest
import torch
from test_hf_families import assert_skipped_as_expected, sdpa_mask_bytes, swapped_counts

from remat import memory
from remat._guards import RematFallbackWarning

from hf_models import (
    BATCH,
    F32,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    SEQ,
    assert_autocast_step_as_accurate_as_stock,
    assert_nothing_seq_by_seq_saved,
    assert_same_step,
    assert_save_pretrained_round_trip,
    attention_output_copy_bytes,
    build,
    convert_layers,
    family_inputs,
    loss_and_grads,
    packed_batch,
    padded_batch,
    remat_attention_calls,
    step_saved_bytes,
    varlen_attention_calls,
)

conv = importlib.import_module("remat.convert")

TOKENS = BATCH * SEQ
OUTPUT_NORMS = "in Gemma{}DecoderLayer's forward reads it"  # post_attention_layernorm, post_feedforward_layernorm
# Families whose attention normalises q and k over each head before the rotary embedding (q_norm,
# k_norm): fused into remat's attention (convert/hf/head_norm.py, tests/convert/hf/test_qk_norm.py)
HEAD_NORMED = ("qwen3", "gemma3")
STOCK_ATTENTION = "runs stock attention"

# family -> (its class prefix, the projections each input_layernorm is fused into, {reason substring:
# count} of the rows left stock); every family's model.norm (the final norm, read by the LM head) stays
# stock too, and its attention modules are kept (their attention function remat's, through the interface).
Case = collections.namedtuple("Case", "prefix projections skipped")
CASES = {
    "llama": Case("Llama", 3, {}),
    "mistral": Case("Mistral", 3, {}),
    "qwen2": Case("Qwen2", 3, {}),
    "qwen3": Case("Qwen3", 3, {}),
    "phi3": Case("Phi3", 1, {}),  # qkv_proj
    "gemma": Case("Gemma", 3, {}),
    # softcapped attention (the default 50.0) on remat.attention's softcap
    "gemma2": Case("Gemma2", 3, {OUTPUT_NORMS.format(2): 2 * LAYERS}),
    "gemma3": Case("Gemma3", 3, {OUTPUT_NORMS.format(3): 2 * LAYERS}),
}
FINAL_NORM = "RMSNorm: no fusion"  # the generic rule's row for model.norm


def build_case(name, **overrides):
    return build(name, use_cache=False, **overrides)


def expected_skips(name):
    return {**CASES[name].skipped, FINAL_NORM: 1}


def expected_swaps(name):
    prefix = CASES[name].prefix
    head_norms = {f"RematHead{prefix}RMSNorm": 2 * LAYERS} if name in HEAD_NORMED else {}
    return {f"Remat{prefix}MLP": LAYERS, f"RematFused{prefix}RMSNorm": 2 * LAYERS,
            "RematNormedLinear": CASES[name].projections * LAYERS, **head_norms}


@pytest.mark.parametrize("name", CASES)
def test_same_loss_gradients_and_checkpoint(target, name):
    device, _ = target
    stock, _ = build_case(name)
    stock.to(device)
    converted, report = convert_layers(stock, report=True)
    counts = swapped_counts(report)
    for cls, count in expected_swaps(name).items():
        assert counts[cls] == count, f"{cls}: {counts[cls]} != {count}\n{report}"
    assert_skipped_as_expected(report, expected_skips(name), kept=LAYERS)  # the attention modules
    assert converted.config._attn_implementation == "remat"
    state, converted_state = stock.state_dict(), converted.state_dict()
    assert list(converted_state) == list(state)
    assert all(torch.equal(converted_state[k], v) for k, v in state.items())
    converted.load_state_dict(state, strict=True)
    batch = family_inputs(name, device)
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == LAYERS


# --- What autograd keeps: derived per family, asserted exactly -------------------------------------


def attention_output_copy(name, device):
    """Bytes per token the stock o_proj keeps of a copy of the attention output (fp32), or 0: where
    SDPA's output takes q's layout (B, H, S, D) (CPU), the stock reshape copies it; remat.attention
    lays it out (B, S, H, D). q is built as the stock forward builds it, with its own rotary function
    (Phi-3's partial-rotary torch.cat makes q (B, H, S, D) itself)."""
    stock_file = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    q = torch.randn(1, 3, HEADS, HEAD_DIM, device=device, requires_grad=True).transpose(1, 2)
    cos = torch.randn(1, 3, HEAD_DIM, device=device)
    q, _ = stock_file.apply_rotary_pos_emb(q, q, cos, cos)
    return attention_output_copy_bytes(q)


def stock_attention_extra(name, device):
    """Bytes per token the stock attention keeps more than remat.attention (q, k, v, its output and
    the fp32 lse). sdpa: the copy of its output that o_proj keeps (attention_output_copy). eager
    (Gemma2's default): keys and values repeated to every head (GQA), the softcap's tanh and the
    probabilities (seq wide per head), and o_proj's input, a copy of the output; remat's k and v
    (kv heads) and lse are not."""
    if name == "phi3":  # stock's v is a view of qkv_proj's output, keeping its q and k parts too; remat's a copy
        # (the interface's _own_value)
        return attention_output_copy(name, device) + F32 * (HEADS + KV_HEADS) * HEAD_DIM
    if name != "gemma2":
        return attention_output_copy(name, device)
    stock = 2 * HEADS * HEAD_DIM * F32 + 2 * HEADS * SEQ * F32
    return stock - 2 * KV_HEADS * HEAD_DIM * F32 - 4 * HEADS


def expected_saving(name, ffn, device, remat_attention=None):
    """(bytes the converted model keeps less in one training step, the report's bytes per token) (docs/memory.md):

    mlp   act(gate) and act(gate) * up, ffn wide each: the fused gated MLP keeps x, gate and up only
    norm  an RMSNorm's x̂ = x·rstd and its output y = w·x̂ (or x̂·(1 + w)), hidden wide each: the fused
          projections keep x and the fp32 rstd, which stock keeps too; the report counts y only (a
          lower bound: fused_saved_bytes)
    gemma GemmaRMSNorm's stock forward also keeps 1 + w in fp32 (hidden wide, once per norm, not per token)
    and, where remat.attention runs (remat_attention, default: it does), what the stock attention keeps
    more (stock_attention_extra); stock attention, run for a call remat's kernels do not take, keeps it too.
    q/k norms (HEAD_NORMED), fused into remat's attention: each q and k element's normalised x (fp32) and
    the post-rope q or k the stock attention keeps (its input, the projection output, is kept instead),
    reported both; Gemma3's 1 + w per head norm (head_dim wide) too.
    """
    remat_attention = True if remat_attention is None else remat_attention
    mlp, norm = 2 * F32 * ffn, 2 * F32 * HIDDEN
    head_norms = 2 * F32 * (HEADS + KV_HEADS) * HEAD_DIM if name in HEAD_NORMED and remat_attention else 0
    per_layer = mlp + 2 * norm + head_norms + (stock_attention_extra(name, device) if remat_attention else 0)
    constant = LAYERS * 2 * F32 * HIDDEN if name.startswith("gemma") else 0
    if name == "gemma3" and remat_attention:
        constant += LAYERS * 2 * F32 * HEAD_DIM
    return LAYERS * TOKENS * per_layer + constant, LAYERS * (mlp + 2 * F32 * HIDDEN + head_norms)


@pytest.mark.parametrize("name", CASES)
def test_saved_bytes_per_layer(target, name):
    device, _ = target
    stock, ffn = build_case(name)
    stock.to(device)
    batch = family_inputs(name, device)
    saving, report_saving = expected_saving(name, ffn, device)
    before = step_saved_bytes(stock, batch)
    converted, report = convert_layers(stock, report=True)
    assert before - step_saved_bytes(converted, batch) == saving
    assert report.saved_bytes_per_token() == report_saving


@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3"])
def test_save_pretrained_round_trip(tmp_path, name):
    stock, _ = build_case(name)
    assert_save_pretrained_round_trip(stock, family_inputs(name, "cpu"), tmp_path)


# --- What stays stock, and why ---------------------------------------------------------------------


def test_an_activation_the_gated_kernels_lack_stays_stock():
    stock, _ = build_case("llama", hidden_act="relu")
    converted, report = convert_layers(stock, report=True)
    reasons = [row.reason for row in report.skipped if row.path.endswith((".mlp", "post_attention_layernorm"))]
    assert len([r for r in reasons if "not an activation remat's gated MLP computes" in r]) == 2 * LAYERS, str(report)
    assert swapped_counts(report)["RematLlamaMLP"] == 0
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))


def assert_stock_attention_on_fused_projections(name, stock, batch, reason):
    """Each attention call runs stock attention (no remat.attention) for `reason`, on the fused norm and
    projections: the same step as stock, and the norms' and MLPs' bytes still saved."""
    converted = convert_layers(stock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == 0
    assert any(STOCK_ATTENTION in str(w.message) and reason in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    saving, _ = expected_saving(name, FFN, "cpu", remat_attention=False)
    assert step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch) == saving


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_a_sliding_window_shorter_than_the_sequence_runs_on_remat_attention(name):
    """A window of 4 over 8 tokens, handed to the attention function as sliding_window (sdpa and eager
    read it from the mask, which then hides the future and the keys 4 or more before each query):
    remat.attention's window_size=(3, 0) computes it (Gemma2 with its softcap too; Gemma2/3 with one
    global layer and one sliding one). Stock sdpa also keeps a float copy of each sliding layer's mask,
    which remat's mask function never builds."""
    layers = {"layer_types": ["sliding_attention", "full_attention"]} if name.startswith("gemma") else {}
    stock, ffn = build_case(name, sliding_window=4, **layers)
    batch = family_inputs(name, "cpu")
    saving, _ = expected_saving(name, ffn, "cpu")
    if stock.config._attn_implementation == "sdpa":
        sliding = LAYERS - 1 if layers else LAYERS
        saving += sliding * TOKENS * sdpa_mask_bytes("cpu", KV_HEADS)
    before = step_saved_bytes(stock, batch)
    converted = convert_layers(stock)
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == LAYERS
    assert before - step_saved_bytes(converted, batch) == saving


def assert_every_attention_on_remat(stock, converted, batch):
    """The step of `converted` on `batch` is stock's, every layer's attention runs remat.attention, and
    remat warns of no fallback."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == LAYERS
    assert not [w for w in caught if "remat" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("name, config", [
    ("mistral", {"sliding_window": 4096}),  # Mistral-7B's own
    ("mistral", {"sliding_window": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("phi3", {"sliding_window": 4}),
    ("gemma2", {"sliding_window": 4}),
], ids=["mistral-4096", "mistral-4", "qwen2-sliding-layers", "phi3", "gemma2"])
def test_training_with_a_sliding_window_cache_stays_on_remat(name, config):
    """Training with the config's default use_cache=True gives sliding-window models an empty cache with
    sliding layers (DynamicSlidingWindowLayer) at every step: each call fills it as stock does and runs
    remat.attention, with no fallback, and the step is stock's."""
    stock, _ = build(name, use_cache=True, **config)
    batch = family_inputs(name, "cpu")
    converted = convert_layers(stock)
    assert_every_attention_on_remat(stock, converted, batch)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_compile_fullgraph_with_the_default_cache(name):
    """torch.compile(fullgraph=True) of a converted model's training forward with the config's default
    use_cache=True (Mistral's with its sliding-window cache): one graph, remat.attention in it for
    every layer, and loss and gradients as stock's."""
    stock, _ = build(name, use_cache=True, **({"sliding_window": 4096} if name == "mistral" else {}))
    batch = family_inputs(name, "cpu")
    converted = convert_layers(stock)
    graphs = []

    def record(graph_module, example_inputs):  # dynamo's graph, run as traced (no Inductor: fast)
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    torch._dynamo.reset()
    converted.forward = torch.compile(converted.forward, backend=record, fullgraph=True)
    assert_same_step(stock, converted, batch)
    assert len(graphs) == 1 and graphs[0].count("remat.attention_fwd") == LAYERS


ROTARY = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox"]


@pytest.mark.kernels
@pytest.mark.parametrize("name", ROTARY)
def test_rotary_models_train_under_autocast(name):
    """fp32 weights under bf16 autocast (the Trainer's bf16=True): the rotary embedding leaves q and k
    in fp32 beside a bf16 v, which stock attention casts; so does remat.attention, which runs."""
    stock, _ = build(name)
    batch = family_inputs(name, "cpu")
    converted = convert_layers(stock)
    _, calls = remat_attention_calls(lambda: assert_autocast_step_as_accurate_as_stock(stock, converted, batch))
    assert calls == LAYERS  # the converted model's step


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_neox"])
def test_a_converted_model_in_float64_computes_as_stock(name):
    """convert(model).double(): every fused op and remat.attention in float64, as stock computes it."""
    stock, _ = build(name)
    converted = convert_layers(stock).double()
    stock.double()
    batch = family_inputs(name, "cpu")
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == LAYERS
    assert all(p.grad.dtype == torch.float64 for p in converted.parameters() if p.grad is not None)


def test_a_4d_mask_runs_stock_attention_on_the_fused_projections():
    """A 4-D mask passed as the model's attention_mask (here one query that does not see one earlier
    key) reaches the attention function as it is: stock attention on the fused projections."""
    stock, _ = build_case("llama")
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(BATCH, 1, SEQ, SEQ).clone()
    mask[0, 0, 5, 2] = False
    batch = {**family_inputs("llama", "cpu"), "attention_mask": mask}
    assert_stock_attention_on_fused_projections("llama", stock, batch, "a mask remat's kernels do not take")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name, config", [("llama", {}), ("mistral", {"sliding_window": 4}), ("gemma2", {
    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]})], ids=["llama", "mistral-window",
                                                                                     "gemma2-window-softcap"])
@pytest.mark.kernels
def test_a_padded_batch_runs_remat_attention_varlen(name, config, side):
    """Padding, with a sliding window of 4 over the 8 tokens (Mistral's every layer, Gemma2's first, with
    its softcap): remat.attention_varlen on the real tokens, the same step, nothing seq x seq saved."""
    stock, _ = build_case(name, **config)
    batch = padded_batch(family_inputs(name, "cpu"), side, causal=True)
    converted = convert_layers(stock)
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (LAYERS, 0)
    assert_nothing_seq_by_seq_saved(converted, batch)


def test_packed_sequences_run_remat_attention_varlen_as_stock_honours_them():
    """position_ids restarting, without a cache: remat.attention_varlen on the sequences; with a cache
    made (use_cache=True) stock attends across the sequences, and so does remat (remat.attention)."""
    stock, _ = build_case("qwen2")
    converted = convert_layers(stock)
    packed = packed_batch(family_inputs("qwen2", "cpu"))
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, packed))
    assert (varlen, dense) == (LAYERS, 0)
    across = {**packed, "use_cache": True}
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, across))
    assert (varlen, dense) == (0, LAYERS)


def test_gemma2_without_softcapping_runs_remat_attention_without_it():
    stock, _ = build_case("gemma2", attn_logit_softcapping=None)
    converted = convert_layers(stock)
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, family_inputs("gemma2", "cpu")))
    assert calls == LAYERS


def test_gemma3_sliding_cache_stays_on_remat():
    """With the config's use_cache=True (also in training), Gemma3's sliding layers hold an empty
    DynamicSlidingWindowLayer cache and its global layers an empty DynamicLayer: every call fills its
    cache as stock does and runs remat.attention on its own keys. The same step, no fallback, and the
    whole saving, attention included."""
    stock, ffn = build("gemma3", layer_types=["sliding_attention"] * (LAYERS - 1) + ["full_attention"])
    batch = family_inputs("gemma3", "cpu")
    converted = convert_layers(stock)
    assert_every_attention_on_remat(stock, converted, batch)
    saving, _ = expected_saving("gemma3", ffn, "cpu", remat_attention=True)
    assert step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch) == saving


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_gives_the_stock_tokens(cache):
    """Greedy generation with a DynamicCache (the prefill and each one-query step after it on
    remat.attention: one query sees every key) or a StaticCache (its zero-padded buffer: stock
    attention on the fused projections, with the mask transformers builds for it): stock's tokens."""
    stock, _ = build_case("llama")
    stock.eval()
    converted = convert_layers(stock)
    ids = family_inputs("llama", "cpu")["input_ids"]
    settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "use_cache": True,
                "cache_implementation": cache}
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, calls = remat_attention_calls(lambda: converted.generate(ids, **settings))
        torch.testing.assert_close(got, stock.generate(ids, **settings))
    stocks = [str(w.message) for w in caught if STOCK_ATTENTION in str(w.message)]
    if cache == "dynamic":  # the prefill and two steps
        assert calls == 3 * LAYERS and not stocks
    else:
        assert calls == 0 and any("a static cache" in message for message in stocks), stocks


# --- LoRA (peft) on every projection of Llama ---------------------------------------------------------


def test_lora_on_every_projection_of_llama():
    """peft's LoRA layers on q, k, v (each with input_layernorm fused in: RematNormedLoraLinear, the
    adapters inside the fused op) and on the MLP's projections: every norm fused as without LoRA, the
    same step as stock + LoRA, and exactly the bytes the report counts less than it keeps (the first
    layer's input_layernorm reads the embeddings, which need no gradient: the fused op keeps its
    output, as stock, not its input), plus the attention's own term."""
    peft = pytest.importorskip("peft")
    stock, _ = build_case("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    stock_peft = peft.get_peft_model(stock, config)
    converted_peft, report = convert_layers(__import__("copy").deepcopy(stock_peft), report=True)
    counts = swapped_counts(report)
    assert counts["RematNormedLoraLinear"] == 3 * LAYERS and counts["RematFusedLlamaRMSNorm"] == 2 * LAYERS, str(report)
    batch = family_inputs("llama", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        _, calls = remat_attention_calls(lambda: assert_same_step(stock_peft, converted_peft, batch))
    assert calls == LAYERS
    first_norm_input = F32 * HIDDEN
    attention = LAYERS * TOKENS * attention_output_copy("llama", "cpu")
    assert step_saved_bytes(stock_peft, batch) - step_saved_bytes(converted_peft, batch) == \
        TOKENS * (report.saved_bytes_per_token() - first_norm_input) + attention
    _, grads = loss_and_grads(converted_peft, batch)
    lora = [k for k in grads if "lora_" in k]
    assert len(lora) == 2 * len(targets) * LAYERS and all(grads[k] is not None for k in lora)


def test_lora_added_after_convert_takes_effect_when_reverted_and_converted():
    """peft wraps projections of a converted model, q_proj and v_proj among them: until the model is
    converted again, input_layernorm computes itself (stock's step), and the warning says what to do;
    remat.revert then remat.convert convert the model as it is now, the same swaps as converting the
    peft model itself."""
    peft = pytest.importorskip("peft")
    stock, _ = build_case("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    stock_peft = peft.get_peft_model(__import__("copy").deepcopy(stock), config)
    _, want = convert_layers(__import__("copy").deepcopy(stock_peft), report=True)
    again = peft.get_peft_model(convert_layers(stock), config)
    again.load_state_dict(stock_peft.state_dict())
    with pytest.warns(RematFallbackWarning, match=r"self_attn.q_proj was wrapped by Linear after convert "
                                                  r"\(remat.revert, then remat.convert the model to fuse it\)"):
        assert_same_step(stock_peft, again, family_inputs("llama", "cpu"))
    again, report = convert_layers(conv.revert(again), report=True)
    assert [(r.path, r.action) for r in report] == [(r.path, r.action) for r in want]
    assert report.saved_bytes_per_token() == want.saved_bytes_per_token() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        assert_same_step(stock_peft, again, family_inputs("llama", "cpu"))


# --- remat memory --------------------------------------------------------------------------------------


def test_remat_memory_reads_a_llama_config(tmp_path):
    stock, ffn = build_case("llama")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stock.config.to_dict()))
    results = {r.policy: r for r in memory.run(str(path), batch=BATCH, seq=SEQ, out_dir=str(tmp_path),
                                               device="cpu", dtype=torch.float32)}
    # the base model (no LM head) runs the same layers: the same saving, without the per-model constant
    saving, _ = expected_saving("llama", ffn, "cpu")
    assert results["eager"].saved_bytes - results["remat"].saved_bytes == saving
    assert KV_HEADS < HEADS  # GQA is what these configs test


def test_a_converted_gemma2_counts_on_meta():
    """On meta (remat memory, remat.plan) a converted Gemma2 (eager, with sliding layers and softcap in
    stock) is counted on remat's attention and keeps fewer bytes than stock."""
    from remat.planner.counting import count_forward

    with torch.device("meta"):
        stock, _ = build("gemma2")  # its default cache, as remat memory builds models
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")

    def kept(model):
        return count_forward(model, (), {"input_ids": ids, "labels": ids}).total_bytes()

    converted = conv.convert(stock, inplace=False)
    assert 0 < kept(converted) < kept(stock)
