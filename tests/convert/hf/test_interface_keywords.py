"""The keywords of transformers' attention-interface calls and what "remat" does with each
(remat.convert.hf.interface's IMPLEMENTED, REFUSED and IGNORED): every keyword the installed
transformers' model files pass is in the table, and a call with one remat refuses or does not know
runs stock attention, says why, and gives stock's result."""

import ast
import copy
import pathlib
import sys
import warnings

import pytest
import torch

import remat
from remat._guards import RematFallbackWarning, fallback_counts
from remat.convert.hf import interface

from hf_models import assert_same_step, build, family_inputs, padded_batch, tiny_model, transformers

# The arguments an attention function takes by position: module, query, key, value, attention_mask.
POSITIONAL = 5


def interface_calls():
    """(model file name, ast.Call) of every call of `attention_interface(...)` in the installed
    transformers' model files (transformers/models/*/modeling_*.py)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
                yield path.name, node


def handed_down_keywords():
    """The keywords model forwards hand down to their attention calls through **kwargs: the fields of
    transformers' TransformersKwargs and FlashAttentionKwargs."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    return {name for kind in (TransformersKwargs, FlashAttentionKwargs)
            for name in kind.__required_keys__ | kind.__optional_keys__}


def test_the_table_is_one_answer_a_keyword():
    groups = [set(interface.IMPLEMENTED), set(interface.REFUSED), set(interface.IGNORED)]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1:])


def test_every_keyword_of_the_installed_transformers_is_in_the_table():
    """Each keyword of every attention-interface call in the model files, and each keyword handed
    down, is implemented, refused or ignored by remat's attention: a keyword a new release adds fails
    here until the table says what it does. No call passes more than the five positional arguments."""
    known = set(interface.IMPLEMENTED) | set(interface.REFUSED) | set(interface.IGNORED)
    missing, positional, calls = {}, [], 0
    for file, call in interface_calls():
        calls += 1
        if len(call.args) > POSITIONAL:
            positional.append(f"{file}:{call.lineno}")
        for keyword in call.keywords:
            if keyword.arg is not None and keyword.arg not in known:  # (None: **kwargs)
                missing.setdefault(keyword.arg, file)
    for name in handed_down_keywords() - known:
        missing.setdefault(name, "TransformersKwargs / FlashAttentionKwargs")
    assert calls > 100, "the scan found too few attention-interface calls: how does transformers call them now?"
    assert not missing, f"keywords remat's attention does not know (where first seen): {missing}"
    assert not positional, f"calls with more positional arguments than {POSITIONAL}: {positional}"


def test_t5_through_the_public_path_is_sdpa():
    """T5 with remat.register_attention() and set_attn_implementation("remat"): each attention call
    passes position_bias (T5's relative attention), which remat's kernels do not take: it runs
    stock sdpa with the bias, warns why, and the loss and gradients are sdpa's (padded batch too)."""
    remat.register_attention()
    stock, _ = build("t5")
    stock.set_attn_implementation("sdpa")
    converted = copy.deepcopy(stock)
    converted.set_attn_implementation("remat")
    batches = (family_inputs("t5", "cpu"), padded_batch(family_inputs("t5", "cpu"), "right", causal=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            assert_same_step(stock, converted, batch)
    said = {str(w.message) for w in caught if issubclass(w.category, RematFallbackWarning)}
    assert said and all("position_bias" in message for message in said), said
    reasons = {reason for counts in fallback_counts(converted).values() for reason in counts}
    assert reasons == {interface.REFUSED["position_bias"][0]}


@pytest.mark.parametrize("mask", ["none", "4-D"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_keyword_remat_does_not_know_runs_stock(monkeypatch, implementation, mask):
    """An attention call with a keyword not in the table (a newer release's) runs stock attention and
    says so: the implementation the model had where remat.convert knows it (sdpa ignores what it does
    not take, as stock did), else the model's own eager attention function, which the model's
    keywords are written for. The keyword here is passed on to it, and changes its result; with a
    4-D mask (stock attention for the mask's sake) as well."""
    stock, _ = tiny_model("Olmo2Config")  # a family without rules: its attention runs through the interface
    stock.set_attn_implementation(implementation)
    converted = remat.convert(copy.deepcopy(stock), layers={"attention"})
    module = converted.model.layers[0].self_attn
    received = []
    model_file = sys.modules[type(module).__module__]
    eager = model_file.eager_attention_forward

    def eager_with_a_new_keyword(module, query, key, value, attention_mask, new_keyword=None, **kwargs):
        received.append(new_keyword)
        out, weights = eager(module, query, key, value, attention_mask, **kwargs)
        return out * new_keyword, weights

    monkeypatch.setattr(model_file, "eager_attention_forward", eager_with_a_new_keyword)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 32, dtype=torch.float64, generator=generator) for _ in range(3))
    k, v = k[:, :1], v[:, :1]  # GQA: one key and value head
    with pytest.warns(RematFallbackWarning, match="does not know.*new_keyword" if mask == "none" else "a mask"):
        causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None].expand(2, 1, 8, 8)
        out, _ = interface.attention_forward(module, q, k, v, causal if mask == "4-D" else None, scaling=32 ** -0.5,
                                             new_keyword=2.0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
    factor = 1.0 if implementation == "sdpa" else 2.0  # sdpa ignores the keyword; eager takes it
    # (eager attention functions take their softmax in float32: float32's tolerance for the float64 inputs)
    torch.testing.assert_close(out, want.transpose(1, 2) * factor, rtol=1e-5, atol=1e-6)
    assert received == ([] if implementation == "sdpa" else [2.0])
