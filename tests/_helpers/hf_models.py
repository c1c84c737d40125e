"""Tiny random Hugging Face models (no downloads) and the helpers the tests that convert them share."""

import collections
import contextlib
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from remat import _backend

from numerics import rel_error, saved_bytes

# The hf extra's floor (pyproject.toml). Older releases have other attention forward signatures:
# remat.hf then leaves those classes stock and says why (test_probe_refuses_an_attention_forward_
# that_differs), so the counts and swaps asserted here do not apply to them.
transformers = pytest.importorskip("transformers", minversion="5.25")

GRAD_TOL = 1e-4
# The rules whose savings the family tests assert layer by layer: all but the fused LM head and loss,
# whose own saving tests/convert/hf/test_lm_loss.py asserts.
LAYER_RULES = frozenset({"layernorm", "gelu", "attention", "mlp"})
BATCH, SEQ, VOCAB, LAYERS = 2, 8, 100, 2
HIDDEN, HEADS, FFN = 64, 2, 128  # head dim 32: one of remat's attention kernel head dims
HEAD_DIM = HIDDEN // HEADS
F32 = 4  # bytes: the family tests run in fp32


def gpt2(**overrides):
    config = dict(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides})), 4 * HIDDEN


def bert(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  max_position_embeddings=32)
    return transformers.BertForMaskedLM(transformers.BertConfig(**{**config, **overrides})), FFN


def roberta(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  max_position_embeddings=40, pad_token_id=1)
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(**{**config, **overrides})), FFN


def vit(**overrides):
    config = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=5)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**{**config, **overrides})), FFN


def gpt_neox(**overrides):
    # rotary on half of each head (Pythia's partial_rotary_factor): the pass-through half is covered too
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**{**config, **overrides})), FFN


FAMILIES = {"gpt2": gpt2, "bert": bert, "roberta": roberta, "vit": vit, "gpt_neox": gpt_neox}
# The MLP module swapped in each family (the FFN of BERT/RoBERTa is split over two modules).
FUSED = {"gpt2": "RematGPT2MLP", "bert": "RematBertOutput", "roberta": "RematRobertaOutput",
         "vit": "RematViTMLP", "gpt_neox": "RematGPTNeoXMLP"}
# No family here has a rule: each attention runs through transformers' attention interface ("remat"),
# a pre-LN norm fused into the projections reading it (RematNormedLinear, structure.py): q, k and v
# separate (ViT), or one (GPT-2's c_attn, GPT-NeoX's query_key_value).
QKV_PROJECTIONS = {"vit": 3}
PRE_LN = ("gpt2", "vit", "gpt_neox")  # LayerNorms fused into the q/k/v projection and into fc1
DECODERS = ("gpt2", "gpt_neox")


def build(family, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, ffn = {**FAMILIES, **GELU_FAMILIES, **RMS_FAMILIES, **T5_MOE_FAMILIES}[family](**overrides)
    with torch.no_grad():  # LayerNorms away from ones/zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.train(), ffn


def inputs(family, device):
    generator = torch.Generator().manual_seed(1)
    if family == "vit":
        pixels = torch.randn(BATCH, 3, 8, 8, generator=generator)
        return {"pixel_values": pixels.to(device), "labels": torch.tensor([1, 3], device=device)}
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def tokens(family):
    return BATCH * (5 if family == "vit" else SEQ)  # ViT: 4 patches + [CLS]


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while active, by name ("remat::attention_fwd")."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


def assert_trainer_trains_as_stock(stock, converted, data, output_dir, op):
    """Two HF Trainer steps of each model on `data` (it passes num_items_in_batch) train the converted one
    to the stock one's weights (plain SGD: Adam's normalised steps would turn rounding noise in a
    near-zero gradient into a full step); returns how many times the remat op `op` ran in the
    converted model's steps (none in the stock one's)."""
    trained = []
    for model in (stock, converted):
        args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=1,
                                              report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                              disable_tqdm=True, optim="sgd", learning_rate=0.1)
        with OpCounter() as counter:
            transformers.Trainer(model=model, args=args, train_dataset=data).train()
        trained.append((counter.counts[op], model.state_dict()))
    assert trained[0][0] == 0
    for key, value in trained[0][1].items():
        torch.testing.assert_close(trained[1][1][key], value, rtol=1e-4, atol=1e-5, msg=key)
    return trained[1][0]


def cache_view_bytes(family):
    """Bytes per token (fp32) GPT-2's stock attention keeps more than remat's through its KV cache:
    transformers makes an empty DynamicCache in training too (use_cache=True), which copies k and v,
    so q alone is left a view of c_attn's output and keeps all of it (3 hidden) alive for SDPA's
    backward; remat keeps q copied out (hidden). The other families' q is no such view."""
    return 2 * 4 * HIDDEN if family == "gpt2" else 0


def loss_and_grads(model, batch, seed=None):
    if seed is not None:  # the same dropout masks for models that draw the same random numbers
        torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    params = model.state_dict(keep_vars=True)
    return loss.detach(), {k: p.grad for k, p in params.items() if isinstance(p, torch.nn.Parameter)}


def grad_error(out, ref, total):
    """rel_error, with a floor on the scale of 1e-4 x the whole model's gradient norm: a gradient
    that is zero in exact arithmetic (the key bias: softmax ignores a constant added to a whole
    row of scores) holds only rounding noise, which differs between two correct kernels."""
    return (out.double() - ref.double()).norm().item() / max(ref.double().norm().item(), 1e-4 * total)


def assert_same_step(stock, converted, batch, seed=None):
    loss, grads = loss_and_grads(stock, batch, seed)
    loss_c, grads_c = loss_and_grads(converted, batch, seed)
    assert rel_error(loss_c, loss) < GRAD_TOL
    assert grads.keys() == grads_c.keys()
    total = sum(g.double().norm().item() ** 2 for g in grads.values() if g is not None) ** 0.5
    compared = 0
    for key, grad in grads.items():
        if grad is None:  # unused by this loss (e.g. a pooler): unused after conversion too
            assert grads_c[key] is None, key
            continue
        error = grad_error(grads_c[key], grad, total)
        assert error < GRAD_TOL, f"{key}: {error:.3g}"
        compared += 1
    assert compared > 10


def autocast_errors(stock, converted, batch, dtype=torch.bfloat16):
    """((loss error, gradient error) of the stock model, the same of the converted model): fp32 weights,
    forward under torch.autocast(dtype) and backward (what the HF Trainer's bf16=True runs), both
    measured against the stock model in float64 without autocast (its float inputs in float64 too)."""
    import copy

    exact_batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                   for k, v in batch.items()}
    exact_loss, exact_grads = loss_and_grads(copy.deepcopy(stock).double(), exact_batch)

    def error(model):
        with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
            loss, grads = loss_and_grads(model, batch)
        flat = torch.cat([g.double().flatten() for k, g in sorted(grads.items()) if g is not None])
        exact = torch.cat([g.flatten() for k, g in sorted(exact_grads.items()) if g is not None])
        return rel_error(loss, exact_loss), rel_error(flat, exact)

    return error(stock), error(converted)


def assert_autocast_step_as_accurate_as_stock(stock, converted, batch, dtype=torch.bfloat16):
    """Under autocast (autocast_errors) the converted model's loss and whole gradient are within twice
    the stock model's error."""
    (stock_loss_error, stock_grad_error), (loss_error, grad_error_) = autocast_errors(stock, converted, batch, dtype)
    assert loss_error <= 2 * stock_loss_error + 1e-3, (loss_error, stock_loss_error)
    assert grad_error_ <= 2 * stock_grad_error + 1e-3, (grad_error_, stock_grad_error)


def assert_save_pretrained_round_trip(stock, batch, path):
    """A converted model saves the stock checkpoint: the stock class loads it, with the same weights
    and the same loss; converting the loaded model gives the converted model's loss again."""
    import importlib

    convert = importlib.import_module("remat.convert").convert
    converted = convert(stock)
    converted.save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = type(stock).from_pretrained(path).train()
    state, loaded_state = stock.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(state)
    assert all(torch.equal(loaded_state[k], v) for k, v in state.items())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).loss, stock(**batch).loss, rtol=0, atol=0)
        torch.testing.assert_close(convert(loaded)(**batch).loss, converted(**batch).loss, rtol=0, atol=0)


def remat_attention_calls(fn):
    """(fn()'s result, number of remat attention forward kernels it ran)."""
    with OpCounter() as counter:
        result = fn()
    return result, counter.counts["remat::attention_fwd"]


def varlen_attention_calls(fn):
    """(fn()'s result, number of remat.attention_varlen forward kernels it ran, of remat.attention's)."""
    with OpCounter() as counter:
        result = fn()
    return result, counter.counts["remat::attention_varlen_fwd"], counter.counts["remat::attention_fwd"]


def padded_batch(batch, side, causal):
    """`batch` with its first row padded by 3 tokens on the right, or its second on the left, and the
    labels of padding (-100) left out of the loss. For a causal LM also the label of a left-padded row's
    first real token: the shifted loss predicts it from the last padding token, whose attention output
    remat (as Hugging Face's FlashAttention path) makes zero where the stock attention averages
    whatever keys its implementation lets a row that sees none see."""
    mask = torch.ones_like(batch["input_ids"])
    if side == "right":
        mask[0, -3:] = 0
    else:
        mask[1, :3] = 0
    ignored = mask == 0
    if causal and side == "left":
        ignored[1, 3] = True
    return {**batch, "attention_mask": mask, "labels": batch["labels"].masked_fill(ignored, -100)}


def assert_nothing_seq_by_seq_saved(model, batch):
    """A training step of model on batch keeps no tensor ending in (SEQ, SEQ): no mask, no scores."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        model(**batch).loss.backward()
    assert not [shape for shape in shapes if shape[-2:] == (SEQ, SEQ)], "a mask or scores were saved"


def packed_batch(batch):
    """Row 0 of `batch` as packed sequences of 3 and SEQ - 3 tokens: position_ids restarting (as
    DataCollatorWithFlattening makes them), no attention_mask, no cache (transformers builds the
    block-diagonal mask from position_ids only without one)."""
    positions = torch.cat([torch.arange(3), torch.arange(SEQ - 3)]).unsqueeze(0)
    return {**{name: t[:1] for name, t in batch.items()}, "position_ids": positions, "use_cache": False}


# --- The GELU/LayerNorm families of remat.convert.hf (tests/convert/hf/test_hf_families.py) ------
# Tiny random configs: 2 layers, hidden 64, 2 heads (head dim 32), FFN 128, no dropout. Each builder
# returns the model and its FFN width, as the ones above. Token ids stay below VOCAB and avoid the
# special ids the configs name (pad 0, bos 1, eos 2).
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
IMAGE = dict(image_size=8, patch_size=4, num_channels=3)  # 4 patches
WHISPER_FRAMES = 8  # encoder tokens (max_source_positions): 2 * 8 mel frames of input


def deit(**overrides):
    config = dict(**IMAGE, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)
    return transformers.DeiTForImageClassification(transformers.DeiTConfig(**{**config, **overrides})), FFN


def siglip(**overrides):
    """Both towers (SiglipModel with return_loss=True in inputs()): gelu_pytorch_tanh by default."""
    tower = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 attention_dropout=0.0)
    text = dict(tower, vocab_size=VOCAB, max_position_embeddings=SEQ, **_SPECIAL)
    vision = dict(tower, **IMAGE)
    config = transformers.SiglipConfig(text_config={**text, **overrides}, vision_config={**vision, **overrides})
    return transformers.SiglipModel(config), FFN


def clip(**overrides):
    """Both towers (CLIPModel with return_loss=True in inputs()): quick_gelu by default; the text tower
    attends causally."""
    tower = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 attention_dropout=0.0, projection_dim=HIDDEN)
    text = dict(tower, vocab_size=VOCAB, max_position_embeddings=SEQ, **_SPECIAL)
    vision = dict(tower, **IMAGE)
    config = transformers.CLIPConfig(text_config={**text, **overrides}, vision_config={**vision, **overrides},
                                     projection_dim=HIDDEN)
    return transformers.CLIPModel(config), FFN


def phi(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0,
                  attention_dropout=0.0, **_SPECIAL)
    return transformers.PhiForCausalLM(transformers.PhiConfig(**{**config, **overrides})), FFN


def gptj(**overrides):
    # rotary on the first 16 of each head's 32 dims (rotary_dim): the pass-through part is covered too
    config = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN, rotary_dim=16,
                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_SPECIAL)
    return transformers.GPTJForCausalLM(transformers.GPTJConfig(**{**config, **overrides})), FFN


def falcon(**overrides):
    """Falcon-7B's layout by default (multi-query, one LayerNorm feeding the parallel attention and MLP)."""
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  ffn_hidden_size=FFN, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=32,
                  **_SPECIAL)
    return transformers.FalconForCausalLM(transformers.FalconConfig(**{**config, **overrides})), FFN


def distilbert(**overrides):
    config = dict(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                  max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0)
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(**{**config, **overrides})), FFN


def _seq2seq_config(**fields):
    return dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                decoder_ffn_dim=FFN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                decoder_start_token_id=1, **_SPECIAL, **fields)


def bart(**overrides):
    config = _seq2seq_config(max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(**{**config, **overrides})), FFN


def whisper(**overrides):
    config = _seq2seq_config(num_mel_bins=8, max_source_positions=WHISPER_FRAMES, max_target_positions=32)
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**{**config, **overrides})), FFN


def bloom(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0,
                  attention_dropout=0.0, **_SPECIAL)
    return transformers.BloomForCausalLM(transformers.BloomConfig(**{**config, **overrides})), 4 * HIDDEN


def opt(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  ffn_dim=FFN, max_position_embeddings=32, word_embed_proj_dim=HIDDEN, dropout=0.0,
                  attention_dropout=0.0, **_SPECIAL)
    return transformers.OPTForCausalLM(transformers.OPTConfig(**{**config, **overrides})), FFN


GELU_FAMILIES = {"deit": deit, "siglip": siglip, "clip": clip, "phi": phi, "gptj": gptj, "falcon": falcon,
                 "distilbert": distilbert, "bart": bart, "whisper": whisper, "bloom": bloom, "opt": opt}


def family_inputs(family, device):
    """A training batch (with the labels that make .loss) of `family`'s tiny model."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    if family == "deit":
        return {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=generator).to(device),
                "labels": torch.tensor([1, 3], device=device)}
    if family in ("siglip", "clip"):
        return {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=generator).to(device),
                "return_loss": True}
    if family == "whisper":
        features = torch.randn(BATCH, 8, 2 * WHISPER_FRAMES, generator=generator).to(device)
        return {"input_features": features, "labels": ids}
    return {"input_ids": ids, "labels": ids}


# --- The RMSNorm / gated-MLP families (tests/convert/hf/test_hf_rms_families.py) -------------------
# Tiny random configs as above: 2 layers, hidden 64, 2 heads of 32 and 1 group of keys and values
# (GQA), FFN 128, no dropout; each with its default activation (SiLU, or Gemma's tanh GELU).
KV_HEADS = 1
_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                attention_dropout=0.0, **_SPECIAL)
_GEMMA = dict(head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS)


def _decoder(config_class, model_class, **fields):
    def builder(**overrides):
        config = getattr(transformers, config_class)(**{**_DECODER, **fields, **overrides})
        return getattr(transformers, model_class)(config), FFN
    return builder


RMS_FAMILIES = {
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=HIDDEN // HEADS),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0),
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", **_GEMMA),
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", **_GEMMA),
    "gemma3": _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", **_GEMMA),
}


# --- T5 and Mixtral (tests/convert/hf/test_hf_t5_mixtral.py) --------------------------------------
# As above: 2 layers (each stack), hidden 64, 2 heads of 32, FFN 128, no dropout. T5 v1.1's gated
# tanh GELU FFN by default (feed_forward_proj="relu": the original T5's); Mixtral with 4 experts, 2 a token.
_T5 = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
           dropout_rate=0.0, feed_forward_proj="gated-gelu", decoder_start_token_id=0, **_SPECIAL)


def _t5(model_class):
    def builder(**overrides):
        return getattr(transformers, model_class)(transformers.T5Config(**{**_T5, **overrides})), FFN
    return builder


T5_MOE_FAMILIES = {
    "t5": _t5("T5ForConditionalGeneration"),
    "t5_encoder": _t5("T5EncoderModel"),
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
}


def step_saved_bytes(model, batch):
    """Bytes autograd keeps for one training forward of `model` on `batch` (its parameters left out)."""
    return saved_bytes(lambda: model(**batch).loss, exclude=list(model.parameters()))


def attention_output_copy_bytes(q):
    """Bytes per token a stock output projection keeps of a copy of SDPA's output, for q (B, H, S, D) as
    the stock forward builds it: where SDPA's output takes q's layout (B, H, S, D) (CPU), the stock
    transpose(1, 2).reshape copies it (fp32, hidden wide); remat.attention lays it out (B, S, H, D)."""
    out = F.scaled_dot_product_attention(q, q, q)
    return 0 if out.transpose(1, 2).is_contiguous() else F32 * HIDDEN


# --- Families remat has no rule for, from tiny configs (tests/convert/hf/test_attention_interface.py) ---
# The sizes above under their usual config names; the fields a family lacks are left out, and the ones
# of mixture-of-experts and other families set small where the config has them.
_TINY_FIELDS = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HEAD_DIM, max_position_embeddings=64,
                    **_SPECIAL)
_TINY_EXTRA = dict(moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                   shared_expert_intermediate_size=64, embedding_size=HIDDEN, attention_dropout=0.0,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, hidden_dropout=0.0, attn_pdrop=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0)


# Fields of the tiny image and audio models: 4 patches of an 8 x 8 image; two convolutions turning
# TINY_SAMPLES of audio into 12 frames (a receptive field of 10 + 4, a hop of 10). No dropout or
# masking of time steps in training.
_TINY_VISION = dict(**IMAGE)
_TINY_AUDIO = dict(conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=4,
                   num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.0, activation_dropout=0.0,
                   feat_proj_dropout=0.0, final_dropout=0.0)
TINY_SAMPLES = 124


def _tiny_config(config_name, extra):
    """The config of class `config_name` with the tiny fields above, then those of `extra` it has."""
    config_class = getattr(transformers, config_name)
    default = config_class()
    fields = {**_TINY_FIELDS, **(_TINY_VISION if hasattr(default, "image_size") else {}),
              **(_TINY_AUDIO if isinstance(getattr(default, "conv_kernel", None), (tuple, list)) else {})}
    config = config_class(**fields)  # a state-space model's conv_kernel is one width: no audio convolutions
    for name, value in extra.items():
        if _has(config, name):
            setattr(config, name, value)
    return config, default


def _has(config, name):
    """hasattr, where a config with fields per layer raises more than AttributeError on a global read."""
    try:
        getattr(config, name)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError among them
        return False
    return True


def _random_train(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.train()


def tiny_model(config_name):
    """(a tiny random model of the transformers config class `config_name` with a language-model head
    where it has one (causal, else masked), its kind: "causal", "masked" or "base"). Image and audio
    models (their main input pixel_values or input_values) are "base"."""
    config, _ = _tiny_config(config_name, _TINY_EXTRA)
    for kind, auto in (("causal", transformers.AutoModelForCausalLM), ("masked", transformers.AutoModelForMaskedLM),
                       ("base", transformers.AutoModel)):
        try:
            model = auto.from_config(config)
        except ValueError:  # no such head for this config
            continue
        return _random_train(model), kind
    raise ValueError(f"no model class for {config_name}")


# Fields of the tiny causal LMs of every family (tests/convert/hf/test_every_causal_lm.py) besides
# tiny_model's: an encoder-decoder family's decoder layers, linear-attention (gated delta net) and
# state-space heads small.
_TINY_CAUSAL_EXTRA = dict(_TINY_EXTRA, encoder_layers=LAYERS, decoder_layers=LAYERS, linear_num_key_heads=2,
                          linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                          num_layers_per_stack=1, H_cycles=1, L_cycles=1,  # HRM: 2 stacks of 16 layers, 6 cycles
                          rotary_dim=HEAD_DIM // 2,  # CodeGen's and GPT-J's 64 exceed the tiny heads
                          # the second layer attention (Bamba's, Jamba's first is their eighth or none)
                          attn_layer_indices=[1], attn_layer_period=2, attn_layer_offset=1,
                          n_group=1, topk_group=1)  # DeepSeek-V3's expert groups: the 4 tiny experts in one


def _one_layer_of_each_type(config, default):
    """A hybrid family's tiny config (layer_types: linear attention, sliding, full) with one layer of each
    type its full-size default has (and a full attention one), in its order, where the tiny layer count
    left one out (two layers of linear attention only: no attention layer, which transformers' mask
    building needs)."""
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or ()))
    if kinds == ["linear_attention"]:  # GraniteMoeHybrid's default has no attention layer: one added
        kinds.append("full_attention")
    if kinds and all(isinstance(k, str) for k in kinds) and set(config.layer_types or ()) != set(kinds):
        try:
            config.layer_types = kinds
        except AttributeError:  # derived from other fields (Jamba's, RecurrentGemma's): left as they are
            return
        config.num_hidden_layers = len(kinds)


def tiny_causal_lm(config_name, **fields):
    """A tiny random causal LM (AutoModelForCausalLM) of the transformers config class `config_name`:
    tiny_model's fields and _TINY_CAUSAL_EXTRA's, one layer of each type a hybrid family has, then
    `fields`."""
    config, default = _tiny_config(config_name, {**_TINY_CAUSAL_EXTRA, **fields})
    _one_layer_of_each_type(config, default)
    if _has(config, "kv_lora_rank"):  # latent attention (DeepSeek's MLA) has a key and value per head
        config.num_key_value_heads = config.num_attention_heads
        _rope_width_as_head_dim(config, default)
    return _random_train(transformers.AutoModelForCausalLM.from_config(config))


def _rope_width_as_head_dim(config, default):
    """Latent attention whose config derives head_dim from its rotary width (DeepSeek-V3's: head_dim =
    qk_rope_head_dim, which its rotary embedding is built for): the rotary width the tiny head_dim,
    and the query-key width (nope + rope) it derives with it."""
    if getattr(default, "head_dim", None) != getattr(default, "qk_rope_head_dim", None):
        return
    config.qk_rope_head_dim = config.head_dim
    if _has(config, "qk_head_dim") and _has(config, "qk_nope_head_dim"):
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim


def tiny_inputs(model, ids):
    """The tiny model's inputs: the token ids, or an image batch (or audio) of as many rows."""
    generator = torch.Generator().manual_seed(1)
    if model.main_input_name == "pixel_values":
        return {"pixel_values": torch.randn(ids.shape[0], 3, 8, 8, generator=generator)}
    if model.main_input_name == "input_values":
        return {"input_values": torch.randn(ids.shape[0], TINY_SAMPLES, generator=generator)}
    return {"input_ids": ids}


def tiny_loss(model, kind, ids):
    """A training loss of the tiny model on token ids (or tiny_inputs): its LM loss, or the mean square
    of the hidden states. Seeded: models drawing random numbers in training (stochastic depth, MAE's
    masking) draw the same for stock and converted."""
    torch.manual_seed(0)
    if kind == "base":
        return model(**tiny_inputs(model, ids)).last_hidden_state.pow(2).mean()
    return model(input_ids=ids, labels=ids).loss


def assert_tiny_step_as_stock(stock, converted, kind, ids):
    """The converted tiny model's loss and gradients are the stock model's (tiny_loss); returns the
    OpCounter of the converted model's forward."""
    loss = tiny_loss(stock, kind, ids)
    loss.backward()
    with OpCounter() as counter:
        loss_converted = tiny_loss(converted, kind, ids)
    loss_converted.backward()
    assert rel_error(loss_converted, loss) < 1e-5
    grads = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    converted_grads = dict(converted.named_parameters())
    total = sum(g.double().norm() ** 2 for g in grads.values()) ** 0.5
    assert max(grad_error(converted_grads[n].grad, g, total) for n, g in grads.items()) < 1e-4
    return counter


def convert_layers(model, **kwargs):
    """remat.convert with the layer rules only (LAYER_RULES), unless `layers` is given."""
    import remat

    kwargs.setdefault("layers", LAYER_RULES)
    return remat.convert(model, **kwargs)


@contextlib.contextmanager
def family_sweep_on_the_reference():
    """Every remat op on its PyTorch reference, for the sweeps over every family (test_every_causal_lm.py,
    and the families without rules of test_attention_interface.py and test_structure.py). They test
    what remat.convert builds from each family's structure: which modules fuse, the ops each step runs,
    the same loss and gradients as stock, the bytes kept, the reasons. The references take the ops'
    arguments and keep what the kernels keep (the ops' autograd is the same), so each of those is what
    the kernels give; the kernels themselves are checked against float64 op by op (tests/ops) and inside
    models, under the interpreter, by the other model tests (test_hf_families.py, test_hf.py,
    test_experts_interface.py, ...). Under the interpreter a family's step takes 3 to 20 s, on the
    references well under one: the sweeps were ~45 % of the suite's time."""
    with _backend.use_backend("reference"):
        yield


@contextlib.contextmanager
def experts_on_the_reference():
    """remat.experts on its PyTorch reference, every other op as the session runs it (the Triton
    interpreter): the experts kernels take 1 to 8 s of a tiny model's step in the interpreter (45
    mixture-of-experts families in test_every_causal_lm.py), and are checked under it by
    tests/ops/test_experts.py and, in a few families, test_experts_interface.py."""
    choose = _backend.choose

    def experts_reference(op, device, kernels=("triton", "cuda")):
        return "reference" if op.startswith("experts") else choose(op, device, kernels)

    with mock.patch.object(_backend, "choose", experts_reference):
        yield
