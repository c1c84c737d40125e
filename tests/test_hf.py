"""remat.convert on Hugging Face models (tiny random configs, no downloads): same loss and
gradients, the GELU output of every MLP no longer kept, same state_dict, gradient
checkpointing, revert."""

import copy
import importlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

# remat.convert is also the name of the function remat/__init__.py exports: import the module by path.
conv = importlib.import_module("remat.convert")
from remat import hf  # noqa: E402
from numerics import rel_error, saved_bytes  # noqa: E402

GRAD_TOL = 1e-4
BATCH, SEQ, VOCAB, LAYERS = 2, 8, 100, 2


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), 4 * 32


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    return transformers.BertForMaskedLM(config), 64


def roberta():
    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, max_position_embeddings=40,
                                        pad_token_id=1)
    return transformers.RobertaForMaskedLM(config), 64


def vit():
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)
    return transformers.ViTForImageClassification(config), 64


def gpt_neox():
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                        hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(config), 64


FAMILIES = {"gpt2": gpt2, "bert": bert, "roberta": roberta, "vit": vit, "gpt_neox": gpt_neox}
# The MLP module swapped in each family (the FFN of BERT/RoBERTa is split over two modules).
FUSED = {"gpt2": "RematHFMLP", "bert": "RematBertOutput", "roberta": "RematBertOutput",
         "vit": "RematHFMLP", "gpt_neox": "RematHFMLP"}


def build(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, ffn = FAMILIES[family]()
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


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    params = model.state_dict(keep_vars=True)
    return loss.detach(), {k: p.grad for k, p in params.items() if isinstance(p, torch.nn.Parameter)}


def assert_same_step(stock, converted, batch):
    loss, grads = loss_and_grads(stock, batch)
    loss_c, grads_c = loss_and_grads(converted, batch)
    assert rel_error(loss_c, loss) < GRAD_TOL
    assert grads.keys() == grads_c.keys()
    compared = 0
    for key, grad in grads.items():
        if grad is None:  # unused by this loss (e.g. a pooler): unused after conversion too
            assert grads_c[key] is None, key
            continue
        assert rel_error(grads_c[key], grad) < GRAD_TOL, f"{key}: {rel_error(grads_c[key], grad):.3g}"
        compared += 1
    assert compared > 10


@pytest.mark.parametrize("family", FAMILIES)
def test_same_loss_gradients_and_state_dict(target, family):
    device, _ = target
    stock, _ = build(family)
    stock.to(device)
    converted, report = conv.convert(stock, report=True)
    fused = [row for row in report if row.action == f"swapped to {FUSED[family]}"]
    assert len(fused) == LAYERS, str(report)
    assert any(row.action == "swapped to remat.nn.LayerNorm" for row in report)
    assert list(converted.state_dict()) == list(stock.state_dict())
    converted.load_state_dict(stock.state_dict(), strict=True)
    assert_same_step(stock, converted, inputs(family, device))


@pytest.mark.parametrize("family", FAMILIES)
def test_gelu_output_no_longer_saved(target, family):
    """Per layer, the fused MLP drops the GELU output: T·f·4 bytes in fp32. GPT-2's gelu_new,
    computed in Python by transformers, kept even more (its intermediates)."""
    device, _ = target
    stock, ffn = build(family)
    stock.to(device)
    converted = conv.convert(stock)
    batch = inputs(family, device)
    tokens = BATCH * (5 if family == "vit" else SEQ)  # ViT: 4 patches + [CLS]
    measure = lambda m: saved_bytes(lambda: m(**batch).loss, exclude=list(m.parameters()))  # noqa: E731
    drop = measure(stock) - measure(converted)
    per_layer = tokens * ffn * 4
    if family == "gpt2":
        assert drop >= LAYERS * per_layer
    else:
        assert drop == LAYERS * per_layer
    kept = conv.convert(stock, recompute=False)
    assert measure(kept) == measure(stock) if family != "gpt2" else measure(kept) < measure(stock)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gradient_checkpointing(target, family):
    device, _ = target
    stock, _ = build(family)
    stock.to(device)
    converted = conv.convert(stock)
    with warnings.catch_warnings():  # 5.x deprecates the name for activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        converted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert converted.is_gradient_checkpointing
    assert_same_step(stock, converted, inputs(family, device))


@pytest.mark.parametrize("family", FAMILIES)
def test_revert(family):
    stock, _ = build(family)
    reference = copy.deepcopy(stock)
    converted = conv.convert(stock)
    reverted = conv.revert(converted)
    stock_types = [type(m) for m in reference.modules()]
    assert [type(m) for m in reverted.modules()] == stock_types
    assert list(reverted.state_dict()) == list(reference.state_dict())
    batch = inputs(family, "cpu")
    torch.testing.assert_close(reverted(**batch).loss, reference(**batch).loss, rtol=0, atol=0)


def test_dropout_stays_equivalent_in_training():
    """GPT-2 with resid_pdrop > 0 in training: the dropout after c_proj is torch's nn.Dropout,
    drawn in the same order, so the same seed gives the same loss and gradients."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.3, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    stock = transformers.GPT2LMHeadModel(config).train()
    converted = conv.convert(stock)
    batch = inputs("gpt2", "cpu")
    torch.manual_seed(5)
    loss, grads = loss_and_grads(stock, batch)
    torch.manual_seed(5)
    loss_c, grads_c = loss_and_grads(converted, batch)
    assert rel_error(loss_c, loss) < GRAD_TOL
    for key in grads:
        assert rel_error(grads_c[key], grads[key]) < GRAD_TOL, key


def test_clip_quick_gelu_is_not_fused():
    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4)
    model = transformers.CLIPVisionModel(config)
    _, report = conv.convert(model, report=True)
    rows = [row for row in report if row.type == "CLIPMLP"]
    assert rows and all(row.action == "skipped" and "QuickGELU" in row.reason for row in rows)


def test_probe_refuses_a_forward_that_differs():
    """A transformers MLP class whose forward is not the known one is left alone."""
    model, _ = build("gpt_neox")
    mlp = model.gpt_neox.layers[0].mlp
    mlp.forward = lambda x: mlp.dense_4h_to_h(mlp.act(mlp.dense_h_to_4h(x)) * 2)  # what a new version might do
    _, report = conv.convert(model, report=True)
    row = next(row for row in report if row.path == "gpt_neox.layers.0.mlp")
    assert row.action == "skipped" and "probe mismatch" in row.reason
    assert hf.is_hf_model(model) and not hf.is_hf_model(torch.nn.Linear(2, 2))
