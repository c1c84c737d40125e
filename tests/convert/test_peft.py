"""Fine-tuning workflows around remat.convert on Hugging Face models: peft's LoRA applied after or
before conversion, merge_and_unload, save_pretrained / from_pretrained, LoRA variants and dropout
(which run peft's own forward, with a warning), and the transformers Trainer.

In every case the converted model computes what stock + LoRA computes: the same loss, the same
gradient for every trained parameter, the same AdamW trajectory; where remat's fused ops apply,
they keep less than stock by exactly what the conversion report says.
"""

import copy
import importlib
import warnings

import pytest
import torch

from hf_models import (
    LAYERS,
    OpCounter,
    build,
    cache_view_bytes,
    convert_layers,
    inputs,
    tokens,
    transformers,
)
from numerics import rel_error, saved_bytes

peft = pytest.importorskip("peft")
conv = importlib.import_module("remat.convert")
from remat._guards import RematFallbackWarning  # noqa: E402

TOL = 1e-4
# What a LoRA fine-tune of each family targets: the projections after each pre-LN LayerNorm.
TARGETS = {"gpt2": ["c_attn", "c_fc"], "vit": ["q_proj", "v_proj", "fc1"], "gpt_neox": ["query_key_value",
                                                                                         "dense_h_to_4h"]}
HEADS_TO_SAVE = {"vit": ["classifier"]}


def lora_config(family, **overrides):
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family],
                  modules_to_save=HEADS_TO_SAVE.get(family))
    return peft.LoraConfig(**{**config, **overrides})


def randomize_lora(model, seed=1):
    """Non-zero lora_B (peft starts it at zero, which would hide a bypassed adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def peft_pair(family, order, **config):
    """(stock model + LoRA, converted model + LoRA) with the same weights; `order` "after": LoRA
    applied to the converted model, "before": the peft model converted."""
    stock, _ = build(family)
    reference = randomize_lora(peft.get_peft_model(copy.deepcopy(stock), lora_config(family, **config)))
    if order == "after":
        ours = peft.get_peft_model(convert_layers(copy.deepcopy(stock)), lora_config(family, **config))
        ours = convert_layers(conv.revert(ours))  # a norm fused into a projection peft wrapped: converted again
    else:
        ours = convert_layers(peft.get_peft_model(copy.deepcopy(stock), lora_config(family, **config)))
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def trained_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def fused_op_calls(fn):
    """(fn()'s result, the counts of remat's fused ops it dispatched)."""
    with OpCounter() as counter:
        result = fn()
    return result, counter.counts


@pytest.mark.parametrize("order", ["after", "before"])
@pytest.mark.parametrize("family", TARGETS)
def test_lora_trains_what_stock_lora_trains(target, family, order):
    """The forward, and every LoRA gradient, are stock + LoRA's; the adapters run inside remat's
    fused ops (no fallback), and the bytes kept drop by what the report says."""
    device, _ = target
    reference, ours = (m.to(device) for m in peft_pair(family, order))
    batch = inputs(family, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)  # the fused path must take the LoRA layers
        (loss, grads), counts = fused_op_calls(lambda: trained_grads(ours, batch))
    want_loss, want_grads = trained_grads(reference, batch)
    assert rel_error(loss, want_loss) < TOL
    assert grads.keys() == want_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in want_grads.items():
        assert grads[name] is not None and rel_error(grads[name], grad) < TOL, name
    assert counts["remat::attention_fwd"] == LAYERS
    assert counts["remat::layer_norm_fwd"] >= 2 * LAYERS  # each pre-LN LayerNorm fused into its projections


def layer_zero_input_term(family):
    """The first layer's input (the embeddings) needs no gradient when only adapters train: a
    LayerNorm reading it keeps its output, as stock does, rather than its input (fp32 hidden 64
    per token). GPT-NeoX's parallel residual feeds both its LayerNorms from that input."""
    return (2 if family == "gpt_neox" else 1) * 4 * 64


@pytest.mark.parametrize("family", TARGETS)
def test_lora_saved_bytes_match_the_report(family):
    """Under LoRA (base weights frozen) the fused layers keep, per layer and token, the LayerNorm
    outputs the adapters' A would need less than stock (no GELU output: fc2 is frozen), exactly
    what the report counts under the model's requires_grad, less the first layer's first
    LayerNorm, whose input needs no gradient (see layer_zero_input_term). GPT-2 runs a GELU
    computed in one op: its default gelu_new, written in Python, keeps more in stock than the
    report counts."""
    stock, _ = build(family, **({"activation_function": "gelu_pytorch_tanh"} if family == "gpt2" else {}))
    converted, report = convert_layers(copy.deepcopy(stock), report=True)
    full_fine_tuning = report.saved_bytes_per_token()
    reference = peft.get_peft_model(stock, lora_config(family))
    ours = peft.get_peft_model(converted, lora_config(family))
    ours, report = convert_layers(conv.revert(ours), report=True)  # converted again after peft (see peft_pair)
    batch = inputs(family, "cpu")
    measure = lambda m: saved_bytes(lambda: m(**batch).loss, exclude=list(m.parameters()))  # noqa: E731
    per_token = report.saved_bytes_per_token()  # now under LoRA's requires_grad
    assert per_token == LAYERS * 2 * 4 * 64 < full_fine_tuning  # two LayerNorm outputs, fp32 hidden 64
    attention = LAYERS * tokens(family) * cache_view_bytes(family)  # the attention's, not the fused layers'
    fused = tokens(family) * (per_token - layer_zero_input_term(family))
    assert measure(reference) - measure(ours) == fused + attention


def test_lora_training_steps_follow_stock():
    """AdamW on a LoRA'd converted ViT (adapters and the classifier head train): the same losses and
    the same adapter weights as stock + LoRA, and lora_B moves away from zero."""
    stock, _ = build("vit")
    reference = peft.get_peft_model(copy.deepcopy(stock), lora_config("vit"))
    ours = peft.get_peft_model(convert_layers(copy.deepcopy(stock)), lora_config("vit"))
    ours.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (reference, ours)]
    batch = inputs("vit", "cpu")
    for _ in range(3):
        losses = []
        for model, optimizer in zip((reference, ours), optimizers):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < TOL * abs(losses[0])
    lora_b = {n: p for n, p in ours.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.abs().max() > 0 for p in lora_b.values())
    want = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert rel_error(p, want[name]) < 1e-3, name


def test_merge_and_unload_after_convert():
    """Merged, the LoRA layers are gone and the fused ops read the merged weights."""
    reference, ours = peft_pair("gpt2", "after")
    merged_reference, merged = reference.merge_and_unload(), ours.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # c_attn, fused by structure, is the plain base layer again: convert it again
    with pytest.warns(RematFallbackWarning, match="ln_1 is not fused any more: attn.c_attn is no longer"):
        merged(**inputs("gpt2", "cpu"))
    merged = convert_layers(conv.revert(merged))
    batch = inputs("gpt2", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        out, counts = fused_op_calls(lambda: merged(**batch).loss)
    assert counts["remat::layer_norm_fwd"] >= 2 * LAYERS
    assert rel_error(out, merged_reference(**batch).loss) < TOL


def test_save_pretrained_round_trip(tmp_path):
    """Adapters saved from a converted model load into stock + LoRA, and the converted base model
    saves a checkpoint the stock class loads (same keys)."""
    reference, ours = peft_pair("gpt_neox", "after")
    ours.save_pretrained(tmp_path / "adapter")
    stock = copy.deepcopy(reference).unload()  # the stock base model, LoRA layers removed unmerged
    loaded = peft.PeftModel.from_pretrained(stock, tmp_path / "adapter")
    batch = inputs("gpt_neox", "cpu")
    assert rel_error(loaded(**batch).loss, ours(**batch).loss) < TOL
    merged = ours.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    again = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(again.gpt_neox.layers[0].attention).__name__ == "GPTNeoXAttention"
    assert rel_error(again(**batch).loss, merged(**batch).loss) < TOL


@pytest.mark.parametrize("variant", [dict(lora_dropout=0.1), dict(use_dora=True)], ids=["dropout", "dora"])
def test_lora_peft_computes_itself_runs_its_own_forward(variant):
    """LoRA dropout in training, and DoRA, are not what the fused ops compute: those calls run
    peft's own forward (the same random stream as stock for the dropout), with one warning per
    module and reason, counted by the report."""
    stock, _ = build("gpt2")
    reference = randomize_lora(peft.get_peft_model(copy.deepcopy(stock), lora_config("gpt2", **variant)))
    converted, report = convert_layers(copy.deepcopy(stock), report=True)
    ours = peft.get_peft_model(converted, lora_config("gpt2", **variant))
    ours.load_state_dict(reference.state_dict())
    batch = inputs("gpt2", "cpu")
    torch.manual_seed(5)
    want_loss, want_grads = trained_grads(reference, batch)
    torch.manual_seed(5)
    with pytest.warns(RematFallbackWarning, match="DoRA|LoRA dropout") as caught:
        loss, grads = trained_grads(ours, batch)
        trained_grads(ours, batch)  # a second call warns no more
    assert rel_error(loss, want_loss) < TOL
    for name, grad in want_grads.items():
        assert rel_error(grads[name], grad) < TOL, name
    warned = [str(w.message) for w in caught if issubclass(w.category, RematFallbackWarning)]
    # once each: each layer's MLP, and its c_attn (fused by structure, wrapped after convert: not fused,
    # test_lora_added_after_convert_takes_effect_when_reverted_and_converted) or attention (a rule's)
    assert len(warned) == 2 * LAYERS
    counts = report.fallbacks()
    assert counts and all(sum(c.values()) == 2 for c in counts.values())


def test_trainer_keeps_remat_attention(tmp_path):
    """The Trainer passes num_items_in_batch (and more) down to every attention: remat's path still
    runs, every step."""
    model = convert_layers(build("gpt_neox")[0])
    data = [inputs("gpt_neox", "cpu") for _ in range(2)]
    data = [{k: v[0] for k, v in example.items()} for example in data]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1,
                                          report_to=[], use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        _, counts = fused_op_calls(trainer.train)
    assert counts["remat::attention_fwd"] == 2 * LAYERS
    assert counts["remat::attention_bwd"] == 2 * LAYERS


def test_torch_compile_of_a_lora_model_matches_eager():
    """torch.compile of a converted model with LoRA: the compiled step's loss and LoRA gradients are
    eager's (transformers' own logging breaks the graph; remat's ops do not)."""
    _, ours = peft_pair("gpt2", "after")
    batch = inputs("gpt2", "cpu")
    loss, grads = trained_grads(ours, batch)  # eager first: each LoRA layer checked once, outside the graph
    torch._dynamo.reset()
    compiled_loss, compiled_grads = trained_grads(torch.compile(ours), batch)
    assert rel_error(compiled_loss, loss) < TOL
    for name, grad in grads.items():
        assert rel_error(compiled_grads["_orig_mod." + name], grad) < TOL, name
