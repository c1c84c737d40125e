"""remat.convert on causal LMs: in training with labels the head and loss run on remat.linear_cross_entropy
(remat.convert.hf.loss): the stock loss and gradients without the logits, their fp32 log-softmax not
kept; every other call computes logits as stock; heads and losses that do more stay stock with the reason."""

import copy
import pickle
import warnings

import pytest
import torch

import remat
from remat._guards import RematFallbackWarning, fallback_counts
from remat.convert.hf.modules import _RematFusedNorm

from hf_models import (
    LAYERS,
    SEQ,
    VOCAB,
    OpCounter,
    assert_same_step,
    assert_trainer_trains_as_stock,
    build,
    family_inputs,
    loss_and_grads,
    step_saved_bytes,
    tiny_model,
    transformers,
)

FUSED = "LM head + loss fused (remat.linear_cross_entropy)"


def head_row(report):
    (row,) = [row for row in report if "LM head" in row.action or "LM head" in row.reason]
    return row


def convert(stock, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remat.convert(stock, report=True, **kwargs)


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2", "qwen3"])
def test_the_stock_step_without_logits(name):
    """Llama; Gemma2 with its final_logit_softcapping; GPT-2 and Qwen3 with the head tied to the
    embedding (its gradient is the sum of both uses): the stock loss and every gradient, one
    linear_cross_entropy call, and no logits in the output."""
    stock, _ = build(name)
    converted, report = convert(stock)
    assert head_row(report).action == FUSED
    batch = family_inputs(name, "cpu")
    with OpCounter() as counter:
        assert_same_step(stock, converted, batch)
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 1
    assert converted(**batch).logits is None


def test_saved_bytes_are_the_log_softmax_less_the_lse():
    """Exactly: stock's loss keeps the fp32 log-softmax of the logits (4 bytes a logit), the fused one an
    fp32 log-sum-exp a token; both keep the hidden states (the head's input) and the labels."""
    stock, _ = build("llama")
    converted, report = convert(stock, layers={"loss"})
    batch = family_inputs("llama", "cpu")
    tokens = batch["input_ids"].numel()
    saved = step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch)
    assert saved == tokens * (4 * VOCAB - 4) == tokens * report.saved_bytes_per_token()


def test_evaluation_generation_and_calls_without_labels_compute_logits_as_stock():
    stock, _ = build("llama")
    converted, _ = convert(stock)
    batch = family_inputs("llama", "cpu")
    ids = batch["input_ids"]
    torch.testing.assert_close(converted(ids).logits, stock(ids).logits)  # training, no labels
    converted.eval()
    stock.eval()
    got, want = converted(**batch), stock(**batch)  # evaluation with labels: metrics read the logits
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(converted.generate(ids, **settings), stock.generate(ids, **settings))


def test_num_items_in_batch_and_shift_labels_as_the_trainer_passes_them():
    """The Trainer's num_items_in_batch (the loss summed, then divided by it) and a caller's own
    shift_labels (context parallelism), with ignored labels: the stock loss."""
    stock, _ = build("llama")
    converted, _ = convert(stock)
    batch = family_inputs("llama", "cpu")
    labels = batch["labels"].clone()
    labels[0, :3] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    for extra in ({"num_items_in_batch": torch.tensor(11)}, {"shift_labels": shifted}):
        want = stock(input_ids=batch["input_ids"], labels=labels, **extra).loss
        got = converted(input_ids=batch["input_ids"], labels=labels, **extra).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config_name, overrides, reason", [
    ("CohereConfig", {}, "probe mismatch"),  # its logits are scaled by logit_scale
    ("Qwen3MoeConfig", {"output_router_logits": True}, "aux_loss"),  # the router's auxiliary loss is added
])
def test_a_head_or_loss_that_does_more_stays_stock_with_the_reason(config_name, overrides, reason):
    stock, kind = tiny_model(config_name)
    for field, value in overrides.items():
        setattr(stock.config, field, value)
    converted, report = convert(stock)
    row = head_row(report)
    assert row.action == "skipped" and reason in row.reason, row.reason
    assert type(converted) is type(stock)
    ids = torch.randint(3, VOCAB, (2, SEQ))
    torch.testing.assert_close(converted(input_ids=ids, labels=ids).loss, stock(input_ids=ids, labels=ids).loss)


def test_save_pretrained_pickle_and_revert(tmp_path):
    """The converted model is still a LlamaForCausalLM by name and class: save_pretrained writes the
    stock architecture, which loads as the stock class with the same loss; it pickles; revert gives
    the stock class back in place."""
    stock, _ = build("llama")
    converted, _ = convert(stock)
    assert isinstance(converted, transformers.LlamaForCausalLM) and type(converted).__name__ == "LlamaForCausalLM"
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is transformers.LlamaForCausalLM
    batch = family_inputs("llama", "cpu")
    torch.testing.assert_close(loaded(**batch).loss, converted(**batch).loss)
    again = pickle.loads(pickle.dumps(converted))
    torch.testing.assert_close(again(**batch).loss, converted(**batch).loss)
    remat.revert(converted)
    assert type(converted) is transformers.LlamaForCausalLM and converted(**batch).logits is not None


def test_lora_on_the_base_model_both_orders():
    """peft LoRA on the attention projections, added before or after conversion: the stock loss and
    LoRA gradients, the head fused."""
    peft = pytest.importorskip("peft")
    stock, _ = build("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(copy.deepcopy(stock), config)
    before = peft.get_peft_model(convert(copy.deepcopy(stock))[0], config)
    after, report = convert(peft.get_peft_model(copy.deepcopy(stock), config))
    assert head_row(report).action == FUSED
    batch = family_inputs("llama", "cpu")
    loss, grads = loss_and_grads(reference, batch)
    grads = {key: grad for key, grad in grads.items() if grad is not None}
    assert len(grads) == 4 * LAYERS  # lora_A and lora_B of q_proj and v_proj: the rest is frozen
    for model in (before, after):
        model.load_state_dict(reference.state_dict())
        with OpCounter() as counter:
            got_loss, got_grads = loss_and_grads(model, batch)
        got_grads = {key: grad for key, grad in got_grads.items() if grad is not None}
        assert counter.counts["remat::linear_cross_entropy_fwd"] == 1
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(got_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_the_trainer_trains_on_the_fused_loss(tmp_path):
    """Two HF Trainer steps (it passes num_items_in_batch): the fused head and loss run at every step, and
    the trained weights are the stock model's (plain SGD: Adam's normalised steps would turn rounding
    noise in a near-zero gradient into a full step); Llama's norms and MLPs fused by structure, its
    attention through the interface."""
    stock, _ = build("llama")
    converted, _ = convert(copy.deepcopy(stock))
    assert sum(isinstance(m, _RematFusedNorm) for m in converted.modules()) == 2 * LAYERS
    data = [{k: v[0] for k, v in family_inputs("llama", "cpu").items()} for _ in range(2)]
    assert assert_trainer_trains_as_stock(stock, converted, data, tmp_path, "remat::linear_cross_entropy_fwd") == 2


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of a converted model's training forward with labels: one graph, the
    fused loss in it, the stock step."""
    stock, _ = build("llama")
    converted, _ = convert(stock)
    graphs = []

    def record(graph_module, example_inputs):  # dynamo's graph, run as traced (no Inductor: fast)
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    torch._dynamo.reset()
    converted.forward = torch.compile(converted.forward, backend=record, fullgraph=True)
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))
    assert len(graphs) == 1 and "remat.linear_cross_entropy_fwd" in graphs[0]


def doubled_loss(logits, labels, vocab_size, **kwargs):
    """A loss_function of a user's: twice transformers' causal LM loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)


def test_a_loss_function_set_before_convert_keeps_the_head_stock():
    stock, _ = build("llama")
    stock.loss_function = doubled_loss
    converted, report = convert(stock)
    assert head_row(report).action == "skipped" and "probe mismatch" in head_row(report).reason
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))


def test_a_loss_function_set_after_convert_runs_the_stock_forward_and_says_why():
    """The probe proved the fused loss equal to the loss_function the model had then: a new one is the
    stock forward's to call (also on a deep copy of the model: its bound methods are new objects)."""
    stock, _ = build("llama")
    converted, report = convert(stock)
    assert head_row(report).action == FUSED
    with OpCounter() as counter:
        copy.deepcopy(converted)(**family_inputs("llama", "cpu"))  # the loss_function kept: fused
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 1
    stock.loss_function = converted.loss_function = doubled_loss
    batch = family_inputs("llama", "cpu")
    with pytest.warns(RematFallbackWarning, match="loss_function was replaced"), OpCounter() as counter:
        assert_same_step(stock, converted, batch)
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 0
    assert fallback_counts(converted)


def test_a_head_with_hooks_after_convert_runs_stock_and_says_why():
    """A hook on the head after convert (FSDP2's fully_shard of the head in its own group registers its
    own): the head must run as a module, so the training step runs the stock head and loss, with a
    warning naming the head, never silently."""
    stock, _ = build("llama")
    converted, _ = convert(stock)
    converted.get_output_embeddings().register_forward_pre_hook(lambda module, args: None)
    with pytest.warns(RematFallbackWarning, match="the LM head: has forward/backward hooks"), OpCounter() as counter:
        assert_same_step(stock, converted, family_inputs("llama", "cpu"))
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 0


def tuple_loss_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out[0].backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("where", ["call", "config"])
def test_return_dict_false_in_training_returns_the_stock_tuple(where):
    """return_dict=False (passed, or the config's) asks for the stock tuple (loss, logits, cache): the
    stock forward runs, with a warning, and gives the stock loss, logits and gradients (or stock's error:
    transformers 5.25's LlamaForCausalLM fails on a config's return_dict=False)."""
    stock, _ = build("llama")
    converted, _ = convert(stock, layers={"loss"})  # the rest stock: the same numbers exactly
    kwargs = {"return_dict": False} if where == "call" else {}
    if where == "config":
        stock.config.return_dict = converted.config.return_dict = False
    batch = family_inputs("llama", "cpu")
    try:
        want, want_grads = tuple_loss_and_grads(stock, batch, **kwargs)
    except AttributeError as error:  # transformers 5.25's base model answers the config with a tuple
        with pytest.raises(type(error), match=str(error)), pytest.warns(RematFallbackWarning, match="return_dict"):
            converted(**batch)
        return
    with pytest.warns(RematFallbackWarning, match="return_dict=False"):
        got, got_grads = tuple_loss_and_grads(converted, batch, **kwargs)
    assert isinstance(got, tuple) and [type(x) for x in got] == [type(x) for x in want]
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)
    with OpCounter() as counter:  # asked for a ModelOutput after all: the fused loss
        loss = converted(**batch, return_dict=True).loss
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 1
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-6)


def test_hidden_states_and_attentions_asked_for_pass_on_as_stock():
    stock, _ = build("llama")
    converted, _ = convert(stock, layers={"loss"})
    batch = family_inputs("llama", "cpu")
    asked = {"output_hidden_states": True, "output_attentions": True}
    with OpCounter() as counter:
        got = converted(**batch, **asked)
    want = stock(**batch, **asked)
    assert counter.counts["remat::linear_cross_entropy_fwd"] == 1 and got.logits is None
    assert len(got.hidden_states) == len(want.hidden_states) == LAYERS + 1
    torch.testing.assert_close(got.hidden_states, want.hidden_states)
    torch.testing.assert_close(got.attentions, want.attentions)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
