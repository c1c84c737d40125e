"""remat's attention as transformers' attention implementation "remat" (remat.convert.hf.interface):
the same loss and gradients as stock on plain, padded and packed batches, the kernels running, the
calls it cannot compute on stock attention with the reason, and no (seq x seq) tensor built."""

import copy
import warnings

import pytest
import torch

import remat
from remat._guards import RematFallbackWarning, fallback_counts
from remat.convert.hf import interface
from remat.ops import attention as attn_ops

from hf_models import (
    SEQ,
    VOCAB,
    assert_same_step,
    assert_tiny_step_as_stock,
    build,
    family_inputs,
    family_sweep_on_the_reference,
    packed_batch,
    padded_batch,
    remat_attention_calls,
    step_saved_bytes,
    tiny_model,
    transformers,
    varlen_attention_calls,
)

interface.register()

# Decoders (causal, GQA, sliding window, softcap, fused qkv), an encoder and an encoder-decoder.
FAMILIES = {"llama": True, "qwen3": True, "mistral": True, "gemma2": True, "gpt_neox": True, "gpt2": True,
            "bert": False, "bart": True}


def with_remat(stock):
    converted = copy.deepcopy(stock)
    converted.set_attn_implementation("remat")
    return converted


@pytest.mark.parametrize("name", FAMILIES)
def test_the_same_step_as_stock(name):
    """Every attention of the model runs remat.attention; loss and gradients are stock's (Mistral with
    a sliding window shorter than the sequence, Gemma2 with its softcap)."""
    overrides = {"sliding_window": 4} if name == "mistral" else {}
    stock, _ = build(name, **overrides)
    converted = with_remat(stock)
    batch = family_inputs(name, "cpu")
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    layers = stock.config.num_hidden_layers
    assert calls == (3 * layers if name == "bart" else layers)  # BART: encoder, decoder and cross attention


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "bert", "gpt_neox"])
def test_padding_runs_on_the_tokens(name, side):
    """A padded batch: transformers hands "remat" a 2-D padding mask, and the attention runs
    remat.attention_varlen on the kept tokens; loss and gradients over the real tokens are stock's."""
    stock, _ = build(name)
    converted = with_remat(stock)
    batch = padded_batch(family_inputs(name, "cpu"), side, causal=FAMILIES[name])
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (stock.config.num_hidden_layers, 0)


@pytest.mark.parametrize("how", ["position_ids", "flash_kwargs"])
def test_packed_sequences_run_on_the_tokens(how):
    """Sequences packed in a batch of one, as DataCollatorWithFlattening gives them: restarting
    position_ids, or with its cu_seq_lens_q/k and max_length_q/k too: each sequence attends to
    itself only (stock builds the block-diagonal mask from the position ids). The cu_seq_lens are
    not read, as sdpa does not read them: here they disagree with the position ids, which decide."""
    stock, _ = build("llama")
    converted = with_remat(stock)
    batch = packed_batch(family_inputs("llama", "cpu"))
    extra = {}
    if how == "flash_kwargs":
        cu = torch.tensor([0, 5, SEQ], dtype=torch.int32)  # the position ids restart at 3
        extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5, "max_length_k": 5}
    want = stock(**batch).logits
    got, varlen, dense = varlen_attention_calls(lambda: converted(**batch, **extra).logits)
    assert (varlen, dense) == (stock.config.num_hidden_layers, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# Rows of a batch packed at different places, as transformers separates sequences: wherever a row's
# position does not grow by 1 (a restart, a jump: [0, 1, 2, 3, 7, ...] is two sequences, and a row
# starting at 5 is one). Row i of the batch of size n: PACKED_ROWS[i].
PACKED_ROWS = [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12]]


def packed_rows(name, rows):
    """A training batch of `rows` rows whose position_ids (PACKED_ROWS) pack sequences, no cache."""
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.tensor(PACKED_ROWS[:rows]), "use_cache": False}


def block_diagonal_mask(positions):
    """(batch, 1, seq, seq) bool: causal within each packed sequence (a new one wherever a row's
    position does not grow by 1), built here from the definition."""
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    sequence = new.cumsum(1)
    index = torch.arange(positions.shape[1])
    causal = index[None, :] <= index[:, None]
    return (causal & (sequence[:, :, None] == sequence[:, None, :]))[:, None]


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_packed_rows_of_a_batch_attend_within_their_sequences(name, rows):
    """position_ids packing sequences at different places in each row of a batch of 2 or 3 (no
    attention_mask, no cache): every attention runs remat.attention_varlen over the whole batch's
    tokens, with stock sdpa's loss and gradients, and the float64 stock model's logits with the
    explicit block-diagonal mask."""
    stock, _ = build(name)
    converted = with_remat(stock)
    batch = packed_rows(name, rows)
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (stock.config.num_hidden_layers, 0)
    exact = copy.deepcopy(stock).double()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    want = exact(**inputs, attention_mask=block_diagonal_mask(batch["position_ids"])).logits
    with torch.no_grad():
        got = converted(**inputs).logits
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, window", [("mistral", 3), ("gemma2", 4)])
def test_packed_rows_with_a_sliding_window(name, window):
    """Packed rows under a sliding window shorter than the rows (Gemma2: its full and its sliding
    layers, two masks a forward): the window applies within each sequence, as stock's."""
    stock, _ = build(name, sliding_window=window)
    converted = with_remat(stock)
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, packed_rows(name, 2)))
    assert (varlen, dense) == (stock.config.num_hidden_layers, 0)


def test_packed_rows_with_a_cache_attend_across_as_stock():
    """With a cache (the config's use_cache=True) transformers does not pack: stock attends across
    the sequences, and so does remat (remat.attention on the rows)."""
    stock, _ = build("llama", use_cache=True)
    converted = with_remat(stock)
    batch = {**packed_rows("llama", 2), "use_cache": True}
    _, varlen, dense = varlen_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert (varlen, dense) == (0, stock.config.num_hidden_layers)


def test_the_packing_is_read_once_a_forward(monkeypatch):
    """Every layer is handed the same mask: its sequences' bounds are read on the device once a
    forward (when transformers builds the mask), not by every layer; every forward runs the packing."""
    stock, _ = build("llama")
    converted = with_remat(stock)
    batch = packed_rows("llama", 2)
    reads = []
    original = interface._cu_seqlens
    monkeypatch.setattr(interface, "_cu_seqlens", lambda numbers: reads.append(1) or original(numbers))
    want = stock(**batch).logits
    for _ in range(2):
        got, varlen, _ = varlen_attention_calls(lambda: converted(**batch).logits)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert varlen == stock.config.num_hidden_layers and len(reads) == 1
        reads.clear()


def test_padded_model_compiles_fullgraph_on_stock_attention():
    """torch.compile(fullgraph=True) of a converted Llama on a padded batch: the mask is sdpa's while
    compiling (the varlen kernels' sizes are the data's), one graph with stock sdpa in it, and stock's
    loss and gradients. (Without padding, with the default cache, remat.attention is in the graph:
    test_hf_rms_families.py's test_compile_fullgraph_with_the_default_cache.)"""
    stock, _ = build("llama", use_cache=True)
    converted = with_remat(stock)
    batch = padded_batch(family_inputs("llama", "cpu"), "right", causal=True)
    graphs = []

    def record(graph_module, example_inputs):  # dynamo's graph, run as traced (no Inductor: fast)
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    torch._dynamo.reset()
    converted.forward = torch.compile(converted.forward, backend=record, fullgraph=True)
    assert_same_step(stock, converted, batch)
    assert len(graphs) == 1
    assert "remat.attention" not in graphs[0] and graphs[0].count("scaled_dot_product_attention") == 2


def test_dropout_in_training_is_remat_s_and_reproducible():
    """Training with attention dropout: remat's own mask, drawn from torch's generator (the same seed,
    the same step), and a different step from no dropout; none in eval."""
    stock, _ = build("llama", attention_dropout=0.3)
    converted = with_remat(stock)
    batch = family_inputs("llama", "cpu")
    torch.manual_seed(0)
    first = converted(**batch).loss
    torch.manual_seed(0)
    assert torch.equal(converted(**batch).loss, first)
    converted.eval()
    stock.eval()
    assert not torch.equal(converted(**batch).loss, first)
    torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss, rtol=1e-5, atol=1e-6)


def attention_weights(converted, stock, inputs):
    """(the converted model's attention weights, those of stock's eager attention) of output_attentions=True."""
    eager = copy.deepcopy(stock)
    eager.set_attn_implementation("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (converted(**inputs, output_attentions=True).attentions,
                eager(**inputs, output_attentions=True).attentions)


def test_a_module_s_calls_check_their_flags_once_and_ask_the_rest_each_time(monkeypatch):
    """Each attention module's calls check remat.attention's flags and q, k and v once, at the first call
    (kept for the call's scalars, interface._kept_flags); what may change between calls is asked at each:
    a scaling set on the modules after kept calls (new flags, q, k and v checked again), attention
    weights requested (the model's eager attention, weights as stock's). Every step stock's."""
    stock, _ = build("llama")
    converted = with_remat(stock)
    batch = family_inputs("llama", "cpu")
    checked = []
    check = attn_ops._check_qkv
    monkeypatch.setattr(attn_ops, "_check_qkv", lambda *args: (checked.append(1), check(*args)))
    for _ in range(3):
        assert_same_step(stock, converted, batch)
    layers = [layer.self_attn for layer in converted.model.layers]
    assert len(checked) == len(layers)
    assert all("remat_attention_flags" in vars(attention) for attention in layers)
    for model in (stock, converted):
        for layer in model.model.layers:
            layer.self_attn.scaling = 0.05
    assert_same_step(stock, converted, batch)
    assert len(checked) == 2 * len(layers)
    inputs = {"input_ids": batch["input_ids"]}
    got, want = attention_weights(converted, stock, inputs)
    assert len(got) == len(want) == len(layers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_attention_weights_requested_run_the_model_s_eager_attention():
    """output_attentions=True runs the model's own eager attention on the call's pattern (the flash-style
    mask rebuilt as stock takes it), weights as stock eager's, and says why."""
    stock, _ = build("llama")
    stock.eval()
    converted = with_remat(stock)
    batch = padded_batch(family_inputs("llama", "cpu"), "left", causal=True)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    got, want = attention_weights(converted, stock, inputs)
    assert len(got) == len(want) == stock.config.num_hidden_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g[0], w[0])  # the unpadded row; stock's padded rows see whatever
        torch.testing.assert_close(g[1, :, 3:], w[1, :, 3:])  # the real tokens of the left-padded one
    reasons = {reason for counts in fallback_counts(converted).values() for reason in counts}
    assert any("attention weights requested" in r for r in reasons), reasons


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation(cache):
    """Greedy generation gives stock's tokens. With a dynamic cache every call runs remat.attention (a
    decoding step's one query sees every key: remat's bottom-right causal alignment); a static cache's
    padded buffer comes with the 4-D mask transformers builds for it, and its calls run stock sdpa."""
    stock, _ = build("llama")
    stock.eval()
    converted = with_remat(stock)
    ids = family_inputs("llama", "cpu")["input_ids"]
    settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "cache_implementation": cache}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens, calls = remat_attention_calls(lambda: converted.generate(ids, **settings))
        torch.testing.assert_close(tokens, stock.generate(ids, **settings))
    layers = stock.config.num_hidden_layers
    assert calls == (3 * layers if cache == "dynamic" else 0)
    reasons = {reason for counts in fallback_counts(converted).values() for reason in counts}
    assert any("a static cache" in r for r in reasons) == (cache == "static"), reasons


def test_from_pretrained_takes_remat(tmp_path):
    stock, _ = build("llama")
    stock.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="remat")
    assert loaded.config._attn_implementation == "remat"
    batch = family_inputs("llama", "cpu")
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, loaded, batch))
    assert calls == stock.config.num_hidden_layers


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("batch_kind", ["padded", "packed"])
def test_no_seq_by_seq_tensor_is_built(batch_kind):
    """A training step on a padded or packed batch builds no (seq x seq) tensor, transformers' own mask
    building included: every op's output is recorded (the sequence, 37, is no other size of the model)."""
    seq = 37
    stock, _ = build("llama")
    converted = with_remat(stock)
    ids = torch.randint(3, 100, (2, seq))
    batch = {"input_ids": ids, "labels": ids}
    if batch_kind == "padded":
        batch = padded_batch(batch, "right", causal=True)
    else:
        batch = {"input_ids": ids[:1], "labels": ids[:1], "use_cache": False,
                 "position_ids": torch.cat([torch.arange(10), torch.arange(seq - 10)]).unsqueeze(0)}
    recorder = _Shapes()
    with recorder:
        converted(**batch).loss.backward()
    assert recorder.shapes, "nothing recorded"
    assert not [s for s in recorder.shapes if list(s).count(seq) >= 2], "a seq x seq tensor was built"
    stock_recorder = _Shapes()
    with stock_recorder:  # the check can fail: stock sdpa builds its (batch, 1, seq, seq) mask
        stock(**batch).loss.backward()
    assert [s for s in stock_recorder.shapes if list(s).count(seq) >= 2]


# Families remat has no rule for: remat.convert runs their attention on remat's kernels through the
# interface alone, or its report says why not (None: every layer's attention on remat).
FURTHER_FAMILIES = {
    "Olmo2Config": None, "OlmoConfig": None, "OlmoeConfig": None, "GraniteConfig": None, "GraniteMoeConfig": None,
    "SmolLM3Config": None, "Glm4Config": None, "GlmConfig": None, "Qwen3MoeConfig": None, "Qwen2MoeConfig": None,
    "MinistralConfig": None, "CohereConfig": None, "Cohere2Config": None, "StableLmConfig": None,
    "Starcoder2Config": None, "Exaone4Config": None, "HeliumConfig": None, "ArceeConfig": None,
    "Ernie4_5Config": None, "PersimmonConfig": None, "NemotronConfig": None, "GPTBigCodeConfig": None,
    "ModernBertConfig": None, "XLMRobertaConfig": None, "ElectraConfig": None, "CamembertConfig": None,
    "Data2VecTextConfig": None, "ErnieConfig": None, "AlbertConfig": None,
    "GptOssConfig": "attention sinks (s_aux)",
    "DogeConfig": "does not take flash-attention-style masks",
    "DebertaV2Config": "does not take flash-attention-style masks",
    # image and audio models
    "Dinov2Config": None, "ViTMSNConfig": None, "ViTMAEConfig": None, "SiglipVisionConfig": None,
    "CLIPVisionConfig": None, "Wav2Vec2Config": None, "HubertConfig": None,
    "BeitConfig": "does not take flash-attention-style masks",  # its relative position bias
    "WavLMConfig": "does not take flash-attention-style masks",  # its gated relative position bias
}


@pytest.mark.parametrize("config_name", FURTHER_FAMILIES)
def test_a_family_without_rules_runs_remat_attention_or_says_why(config_name):
    """remat.convert of a tiny model of the family: the same loss and gradients as stock, and each layer's
    attention on remat.attention, or the report (a skipped row) or the fallbacks say exactly why not."""
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    stock, kind = tiny_model(config_name)
    ids = torch.randint(3, VOCAB, (2, SEQ))
    with family_sweep_on_the_reference():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted, report = remat.convert(stock, report=True)
        counter = assert_tiny_step_as_stock(stock, converted, kind, ids)
    calls = counter.counts["remat::attention_fwd"]
    expected = FURTHER_FAMILIES[config_name]
    if expected is None:
        assert calls == stock.config.num_hidden_layers, str(report)
        return
    assert calls == 0
    said = [row.reason for row in report.skipped] + [r for counts in report.fallbacks().values() for r in counts]
    assert any(expected in reason for reason in said), said


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_layer_reverted_apart_from_the_model_runs_stock_attention(implementation):
    """remat.revert of one layer of a model whose attention runs through the interface (as a plan does
    for the layers it keeps stock): every layer reads "remat" from the shared config, but the reverted
    layer's attention runs the previous implementation's, the others remat's. With every layer
    reverted so, the model keeps exactly stock's bytes (eager keeps its probabilities, sdpa does not:
    the bytes tell the two apart); reverting the model gives its implementation back."""
    stock, kind = tiny_model("Olmo2Config")
    stock.set_attn_implementation(implementation)
    converted = remat.convert(copy.deepcopy(stock), layers={"layernorm", "gelu", "attention", "mlp"})  # no fused loss
    assert converted.config._attn_implementation == interface.NAME
    ids = torch.randint(0, VOCAB, (2, SEQ))
    layers = converted.model.layers
    for reverted in range(len(layers)):
        remat.revert(layers[reverted])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RematFallbackWarning)
            _, calls = remat_attention_calls(lambda: converted(input_ids=ids, labels=ids).loss)
        assert calls == len(layers) - reverted - 1
    assert_tiny_step_as_stock(stock, converted, kind, ids)
    assert converted.config._attn_implementation == interface.NAME
    assert step_saved_bytes(converted, {"input_ids": ids, "labels": ids}) == \
        step_saved_bytes(stock, {"input_ids": ids, "labels": ids})
    remat.revert(converted)
    assert converted.config._attn_implementation == implementation
    assert not [name for m in converted.modules() for name in vars(m) if name.startswith("remat_")]


def test_the_mask_on_meta_tensors_reads_no_values():
    """On the meta device (remat memory's models at full size) the mask function reads no values: a
    mask transformers may have packed (packed_sequence_mask_function over meta sequence numbers)
    counts as one sequence, as transformers counts it there."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function

    sequences = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    mask_function = and_masks(causal_mask_function, packed_sequence_mask_function(sequences))
    assert interface.attention_mask(batch_size=2, q_length=SEQ, kv_length=SEQ, mask_function=mask_function,
                                    attention_mask=None, allow_is_causal_skip=False, device="meta") is None
