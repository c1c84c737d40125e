"""remat.convert(model, dry_run=True) and remat.convert(model, filter_fn=...): a dry run leaves the model
as it is and reports what the conversion does; a module the filter rejects stays stock with all below
it, the rest converts, and the model trains as stock."""

import warnings

import pytest
import torch
from torch import nn

import remat
from remat._guards import fallback_counts
from remat.convert import RematWarning
from remat.convert.hf import rules

from hf_models import (
    assert_tiny_step_as_stock,
    build,
    experts_on_the_reference,
    remat_attention_calls,
    tiny_causal_lm,
    tiny_loss,
)

transformers = pytest.importorskip("transformers", minversion="5.25")

# the stock marks a module rejected by the filter may carry: its model's attention and experts implementation
# became remat's, and these say it runs the previous one
STOCK_MARKS = {"remat_attention_previous", "remat_attention_path", "remat_attention_stock", "remat_experts_previous",
               "remat_experts_path", "remat_experts_stock"}


def _ids(batch=2, seq=8):
    return torch.randint(2, 90, (batch, seq), generator=torch.Generator().manual_seed(1))


def _state(model):
    """What a conversion may change of a model: each module's class and remat_ entries, the attention and
    experts implementations, each parameter's identity, values, requires_grad and attributes."""
    modules = {name: (type(m), sorted(k for k in vars(m) if k.startswith("remat_"))) for name, m in
               model.named_modules()}
    config = model.config
    implementations = (config._attn_implementation, getattr(config, "_experts_implementation", None))
    parameters = {name: (p, p.detach().clone(), p.requires_grad, dict(vars(p))) for name, p in model.named_parameters()}
    return modules, implementations, parameters


def _assert_same_state(before, after):
    assert before[0] == after[0]
    assert before[1] == after[1]
    assert before[2].keys() == after[2].keys()
    for name, (param, values, requires_grad, attributes) in before[2].items():
        now = after[2][name]
        assert now[0] is param and torch.equal(now[1], values) and now[2] == requires_grad and now[3] == attributes


# Qwen3-MoE: attention, q/k norms, the norm fused into the router and experts, remat.experts, the fused loss.
# GPT-2: Conv1D projections, its MLP with a dropout, the fused loss.
@pytest.mark.parametrize("config_name", ["Qwen3MoeConfig", "GPT2Config"])
def test_dry_run_reports_the_conversion_and_leaves_the_model(config_name):
    stock = tiny_causal_lm(config_name)
    before = _state(stock)
    with experts_on_the_reference():
        dry = remat.convert(stock, dry_run=True)
        _assert_same_state(before, _state(stock))
        converted, report = remat.convert(stock, report=True)
    assert str(dry) == str(report)  # every row: paths, actions, reasons and the bytes each saves
    assert dry.saved_bytes_per_token() == report.saved_bytes_per_token() > 0
    assert len(report.swapped) > 3
    _assert_same_state(before, _state(stock))


def test_dry_run_of_a_plain_torch_model():
    """The fx and Sequential paths, outside Hugging Face: the rows, and the module left as it was."""
    stock = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
    classes = [type(m) for m in stock.modules()]
    dry = remat.convert(stock, dry_run=True)
    assert [type(m) for m in stock.modules()] == classes and type(stock) is nn.Sequential
    _, report = remat.convert(stock, report=True)
    assert str(dry) == str(report) and len(report.swapped) == 1


def test_dry_run_and_filter_arguments():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="dry_run=True leaves the model as it is; inplace=True"):
        remat.convert(model, dry_run=True, inplace=True)
    with pytest.raises(TypeError, match="filter_fn must be a function"):
        remat.convert(model, filter_fn="model.layers.0")


def test_a_rejected_layer_stays_stock_and_the_model_trains_as_stock():
    """Qwen3-MoE with its first decoder layer rejected: every module of that layer keeps its class and
    gains no remat state but the stock marks, its attention runs stock (sdpa) and its experts their
    stock implementation; the second layer converts as it would alone; loss and gradients are stock's."""
    stock = tiny_causal_lm("Qwen3MoeConfig")
    rejected = "model.layers.0"
    with experts_on_the_reference():
        converted, report = remat.convert(stock, report=True,
                                          filter_fn=lambda module, fqn: fqn != rejected)
        _, whole = remat.convert(stock, report=True)
    layer = converted.model.layers[0]
    for (name, module), (_, original) in zip(layer.named_modules(), stock.model.layers[0].named_modules(),
                                             strict=True):
        assert type(module) is type(original), name
        assert {k for k in vars(module) if k.startswith("remat_")} <= STOCK_MARKS, name
    rows = [row for row in report if row.path.startswith(rejected)]  # the layer's, its experts' (model-wide)
    assert [row.path for row in rows] == [rejected, f"{rejected}.mlp.experts"]
    assert all(row.action == "skipped" and "excluded by convert's filter_fn" in row.reason for row in rows)
    layer_one = [(row.path, row.action) for row in report if row.path.startswith("model.layers.1")]
    assert layer_one == [(row.path, row.action) for row in whole if row.path.startswith("model.layers.1")]
    assert any(action.startswith("swapped") for _, action in layer_one)
    ids = _ids()
    with experts_on_the_reference():
        _, attention_calls = remat_attention_calls(lambda: tiny_loss(converted, "causal", ids))
        assert attention_calls == stock.config.num_hidden_layers - 1  # the rejected layer's attention runs sdpa
        assert_tiny_step_as_stock(stock, converted, "causal", ids)
    assert fallback_counts(converted) == {}


def test_a_filter_on_module_identity_sees_the_callers_modules():
    """The filter is asked of the caller's modules, not of convert's copy: `module is ...` works."""
    stock = tiny_causal_lm("LlamaConfig")
    mlp = stock.model.layers[1].mlp
    converted, report = remat.convert(stock, report=True, layers=("layernorm", "mlp"),
                                      filter_fn=lambda module, fqn: module is not mlp)
    assert type(converted.model.layers[1].mlp) is type(mlp)
    assert type(converted.model.layers[0].mlp) is not type(stock.model.layers[0].mlp)
    norm_row = next(row for row in report if row.path == "model.layers.1.post_attention_layernorm")
    assert norm_row.action == "skipped" and "excluded by convert's filter_fn" in norm_row.reason


def test_a_module_around_a_rejected_one_is_not_swapped():
    """GPT-2's MLP calls its dropout: with the dropout rejected, the MLP (whose fused forward computes its
    children's work) stays stock, and says why."""
    stock = tiny_causal_lm("GPT2Config")
    converted, report = remat.convert(stock, report=True, layers=("layernorm", "mlp"),
                                      filter_fn=lambda module, fqn: fqn != "transformer.h.0.mlp.dropout")
    assert type(converted.transformer.h[0].mlp) is type(stock.transformer.h[0].mlp)
    assert type(converted.transformer.h[1].mlp) is not type(stock.transformer.h[1].mlp)
    reasons = [row.reason for row in report if row.path.startswith("transformer.h.0.")]
    assert any("its dropout is excluded by convert's filter_fn" in reason for reason in reasons)


def test_rejecting_the_model_converts_nothing_and_says_why():
    stock = tiny_causal_lm("LlamaConfig")
    with pytest.warns(RematWarning, match=r"filter_fn rejects the model itself \(fqn ''\)"):
        converted, report = remat.convert(stock, report=True, filter_fn=lambda module, fqn: fqn != "")
    assert [(row.path, row.action) for row in report] == [("(root)", "skipped")]
    assert all(type(a) is type(b) for a, b in zip(converted.modules(), stock.modules(), strict=True))
    assert converted.config._attn_implementation == stock.config._attn_implementation


def test_a_rule_that_would_touch_a_rejected_module_is_an_error(monkeypatch):
    """The check after conversion: were a rule to ignore the filter's mark (here: the hf rules' instance
    check made blind to it), convert raises rather than hand back a rejected module changed."""
    monkeypatch.setattr(rules, "_instance_reason", lambda module: None)
    stock = tiny_causal_lm("GPT2Config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        with pytest.raises(RuntimeError, match=r"changed transformer\.h\.0\.mlp\.dropout, which filter_fn excludes: "
                                               r"transformer\.h\.0\.mlp above it computes in its place"):
            remat.convert(stock, layers=("layernorm", "mlp"),
                          filter_fn=lambda module, fqn: fqn != "transformer.h.0.mlp.dropout")


@pytest.mark.parametrize("family, attention", [("llama", "model.layers.0.self_attn"),
                                               ("bloom", "transformer.h.0.self_attention")])
def test_a_rejected_attention_has_one_row_saying_so(family, attention):
    """An attention module filter_fn rejects runs the model's previous attention implementation (llama), or keeps
    its class (BLOOM's, swapped by class elsewhere): its one row says it is excluded, none that it runs remat's."""
    model, _ = build(family)
    report = remat.convert(model, dry_run=True, filter_fn=lambda module, fqn: fqn != attention)
    rows = [(row.action, row.reason) for row in report if row.path == attention]
    assert rows == [("skipped", "excluded by convert's filter_fn: it and the modules below it stay stock")]
    other = attention.replace(".0.", ".1.")  # the next layer's attention: its row as without the filter
    whole = remat.convert(model, dry_run=True)
    assert [(row.action, row.reason) for row in report if row.path == other] == \
        [(row.action, row.reason) for row in whole if row.path == other] != []
