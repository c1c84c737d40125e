"""remat.plan on causal LMs: their LM head and loss are a choice, stock or remat.convert's fused loss,
with exact bytes. The bytes the applied model keeps, counted with saved-tensor hooks of remat.saved
(not the planner's counter), equal the plan's; the head's two choices differ by what the fused loss
saves, counted on the stock and the loss-converted model the same way."""

import copy
import dataclasses
import json
import re
import warnings

import pytest
import torch

import remat
from remat.planner import Plan, measure, meta_copy, saved_bytes_of
from remat.planner.units import fused_head
from remat.saved import saved_bytes

from hf_models import VOCAB, assert_same_step, build, inputs

# Llama; Qwen3 with the head tied to the embedding; Gemma2 with its final_logit_softcapping (the
# fused loss takes the config's softcap: convert/hf/loss.py)
FAMILIES = ("llama", "qwen3", "gemma2")


def _on_meta(batch):
    return {k: torch.empty_like(v, device="meta") for k, v in batch.items()}


def _kept(model, batch):
    """Bytes autograd keeps for one training forward, each storage once; the parameters, buffers (Gemma's
    embedding scale) and the caller's inputs (the labels the loss saves) left out, as the planner
    leaves them out."""
    return saved_bytes(lambda: model(**batch).loss,
                       exclude=[*model.parameters(), *model.buffers(), *batch.values()])


def _loss_converted(model):
    """The model with remat.convert's fused LM head and loss only: every layer stock."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remat.convert(model, layers={"loss"})


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """A tiny model of the family on CPU, its batch (with labels), and the bytes its stock forward and
    its forward with the loss fused keep."""
    model, _ = build(request.param)
    batch = inputs(request.param, "cpu")
    return request.param, model, batch, _kept(model, batch), _kept(_loss_converted(model), batch)


def test_the_fused_head_alone_fits_and_keeps_exactly_what_the_plan_says(family):
    """Budget: what the model keeps with only its loss fused. On an H200's constants the fused head
    costs far less time per byte than any block's choice, so the plan fuses it and nothing else;
    applied, the model keeps the plan's bytes exactly."""
    name, model, batch, stock_bytes, fused_bytes = family
    assert fused_bytes < stock_bytes
    plan = remat.plan(model, batch, fused_bytes, device="H200")
    assert plan.head == "fused" and set(plan.choices) == {"stock"}, (plan.head, plan.choices)
    planned = plan.apply(copy.deepcopy(model))
    assert fused_head(planned) is not None
    assert _kept(planned, batch) == plan.saved_bytes == fused_bytes
    assert plan.head_seconds > 0 and plan.extra_seconds == plan.head_seconds


def test_the_heads_two_choices_differ_by_what_the_fused_loss_saves(family):
    """A budget so loose nothing needs changing: all stock, the head too (the fastest plan: no extra
    time). A budget below what every block fully checkpointed keeps with the stock head: only the
    fused head fits. Their head bytes differ by the stock and loss-converted models' difference,
    which for Llama and Qwen3 (fp32) is the fp32 log-softmax of the logits less the fused loss's
    log-sum-exp: 4·vocab - 4 bytes a token, and for Gemma2 the tanh of its softcapping besides. Counted on meta,
    the same head bytes as on CPU."""
    name, model, batch, stock_bytes, fused_bytes = family
    loose = remat.plan(model, batch, 2 * stock_bytes)
    assert (loose.head, set(loose.choices), loose.extra_seconds) == ("stock", {"stock"}, 0.0)
    assert loose.saved_bytes == stock_bytes
    saves, _, _ = measure(model, batch, ("full",))  # every block checkpointed, the head stock
    forced = remat.plan(model, batch, saves["full"].total_bytes() - 1)
    assert forced.head == "fused"
    assert loose.head_bytes - forced.head_bytes == stock_bytes - fused_bytes
    tokens = batch["labels"].numel()
    if name == "gemma2":  # its stock head also keeps the tanh of its logits' softcapping (fp32)
        assert stock_bytes - fused_bytes == tokens * (4 * VOCAB - 4) + tokens * 4 * VOCAB
        return  # and remat's attention cannot build its sliding-window mask on meta: no meta plan
    assert stock_bytes - fused_bytes == tokens * (4 * VOCAB - 4)
    on_meta = remat.plan(meta_copy(model), _on_meta(batch), 2 * stock_bytes)
    assert on_meta.head_bytes == loose.head_bytes


def test_a_plan_with_the_fused_head_on_meta_keeps_what_it_predicts_at_every_budget():
    """From the least any plan keeps to more than stock: the applied model's count is the plan's,
    and the head is fused where the budget needs it."""
    model, _ = build("llama")
    model, batch = meta_copy(model), _on_meta(inputs("llama", "cpu"))
    saves, _, _ = measure(model, batch, ("stock", "full"))
    stock, least_stock_head = saves["stock"].total_bytes(), saves["full"].total_bytes()
    heads = set()
    for budget in (least_stock_head - 1, (least_stock_head + stock) // 2, stock - 1, stock):
        plan = remat.plan(model, batch, budget)
        heads.add(plan.head)
        plan.apply(model)
        try:
            assert saved_bytes_of(model, batch) == plan.saved_bytes <= budget
        finally:
            remat.revert(model)
        assert "(LM head + loss)" in str(plan)
    assert heads == {"stock", "fused"}


def test_the_least_peak_of_a_step_fuses_the_head():
    """Under a budget on the step's peak the head's choice also sets the backward's largest transient
    outside the layers (the stock loss's fp32 logits): the least peak fuses it, and keeps its bytes."""
    model, _ = build("llama")
    model, batch = meta_copy(model), _on_meta(inputs("llama", "cpu"))
    with pytest.raises(ValueError, match="least peak") as refused:
        remat.plan(model, batch, 0, budget_kind="peak")
    least = int(re.search(r"reach at these inputs: (\d+) bytes", str(refused.value)).group(1))
    plan = remat.plan(model, batch, least, budget_kind="peak")
    assert plan.head == "fused" and plan.peak_bytes == least
    plan.apply(model)
    try:
        assert saved_bytes_of(model, batch) == plan.saved_bytes
    finally:
        remat.revert(model)


def test_without_labels_or_in_evaluation_the_head_is_no_choice_and_stays_stock():
    model, _ = build("llama")
    model, with_labels = meta_copy(model), _on_meta(inputs("llama", "cpu"))
    batch = {"input_ids": with_labels["input_ids"]}
    saves, _, _ = measure(model, batch, ("full",))
    plan = remat.plan(model, batch, saves["full"].total_bytes())  # the least: no fused head to reach less
    assert plan.head is None and plan.head_bytes == 0 and "(LM head + loss)" not in str(plan)
    plan.apply(model)
    try:
        assert fused_head(model) is None and saved_bytes_of(model, batch) == plan.saved_bytes
    finally:
        remat.revert(model)
    assert remat.plan(model, with_labels, 10**9).head == "stock"  # the same model with labels: a choice
    model.eval()  # evaluation computes logits, labels or not: no choice either
    assert remat.plan(model, with_labels, 10**9).head is None


def test_json_round_trip_of_the_head():
    model, _ = build("llama")
    model, batch = meta_copy(model), _on_meta(inputs("llama", "cpu"))
    saves, _, _ = measure(model, batch, ("full",))
    plan = remat.plan(model, batch, saves["full"].total_bytes() - 1)
    assert plan.head == "fused"
    assert Plan.from_json(plan.to_json()) == plan
    older = {k: v for k, v in json.loads(plan.to_json()).items()  # a plan written before the head was a choice
             if k not in ("head", "head_bytes", "head_seconds")}
    assert Plan.from_json(json.dumps(older)) == dataclasses.replace(plan, head=None, head_bytes=0, head_seconds=0.0)
    with pytest.raises(ValueError, match="its head must be one of"):
        Plan.from_json(plan.to_json().replace('"head": "fused"', '"head": "faster"'))


def test_apply_fuses_the_head_as_convert_does_trains_as_stock_and_revert_undoes_it():
    model, _ = build("llama")
    batch = inputs("llama", "cpu")
    keys, stock_class = list(model.state_dict()), type(model)
    plan = remat.plan(model, batch, _kept(_loss_converted(model), batch), device="H200")
    assert plan.head == "fused"
    planned = plan.apply(copy.deepcopy(model))
    assert type(planned).__module__ == "remat.convert.hf.loss" and planned(**batch).logits is None
    assert_same_step(model, planned, batch, seed=0)
    remat.revert(planned)
    assert type(planned) is stock_class and fused_head(planned) is None and list(planned.state_dict()) == keys
    assert _kept(planned, batch) == _kept(model, batch)


def test_a_plan_that_fuses_the_head_refuses_a_model_whose_head_convert_keeps_stock():
    model, _ = build("llama")
    batch = inputs("llama", "cpu")
    plan = remat.plan(model, batch, _kept(_loss_converted(model), batch), device="H200")
    assert plan.head == "fused"
    hooked = copy.deepcopy(model)
    hooked.lm_head.register_forward_hook(lambda module, args, out: None)  # remat.convert keeps a hooked head stock
    with pytest.raises(ValueError, match="fuses the LM head and loss, but remat.convert keeps this model's stock"):
        plan.apply(hooked)
    assert type(hooked) is type(model) and not remat.planner.is_planned(hooked)  # left as it was
