"""A converted model never computes something the stock model would not: a module changed after
conversion (hooks, parametrizations, weight norm, a tensor subclass as weight, another module in its
place) makes every fused path that stands in for it run the modules' own forwards for that call,
with one RematFallbackWarning per module and reason, counted by the report; deep copies and pickles
of converted models keep their fusions."""

import copy
import importlib
import io
import warnings

import pytest
import torch
from torch import nn

import remat
from remat._guards import RematFallbackWarning

from hf_models import BATCH, LAYERS, SEQ, build, inputs, remat_attention_calls
from module_changes import double_output, scale_parametrization, to_subclass
from numerics import rel_error

conv = importlib.import_module("remat.convert")
patterns = importlib.import_module("remat.convert.patterns")


CHANGES = {
    "forward-hook": lambda m: m.register_forward_hook(double_output),
    "pre-hook": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,)),
    "parametrization": scale_parametrization,
    "weight-norm": lambda m: torch.nn.utils.parametrizations.weight_norm(m),
    "tensor-subclass": to_subclass,
}


def stack(kind):
    """(remat fused module, a stock Sequential of the same layers sharing their parameters)."""
    norm, fc1, act, fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)
    if kind == "LayerNormLinear":
        return patterns.fused_module(patterns.LAYER_NORM_LINEAR, [norm, fc1], True), nn.Sequential(norm, fc1)
    return patterns.fused_module(patterns.LAYER_NORM_MLP, [norm, fc1, act, fc2], True), \
        nn.Sequential(norm, fc1, act, fc2)


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_a_changed_linear_runs_its_own_forward(kind, change):
    fused, stock = stack(kind)
    x = torch.randn(3, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        fused(x)  # plain: the fused path, no warning
    CHANGES[change](stock[1])  # the first Linear, shared by both
    with pytest.warns(RematFallbackWarning, match="runs its stock forward") as caught:
        out = fused(x)
        fused(x)
    assert len([w for w in caught if issubclass(w.category, RematFallbackWarning)]) == 1  # once per reason
    want = stock(x)
    assert rel_error(out, want) < 1e-6
    grads = torch.autograd.grad(out.sum(), x)
    assert rel_error(grads[0], torch.autograd.grad(want.sum(), x)[0]) < 1e-6
    assert sum(fused.__dict__["remat_fallbacks"].values()) == 2


def test_a_replaced_linear_is_what_runs():
    fused, _ = stack("LayerNormLinear")
    x = torch.randn(4, 16)
    fused.linear = nn.Sequential(nn.Linear(16, 8), nn.ReLU())  # not a Linear any more
    with pytest.warns(RematFallbackWarning, match="is Sequential, not exactly Linear"):
        out = fused(x)
    assert torch.equal(out, fused.linear(fused.norm(x)))


def test_global_module_hooks_run():
    fused, stock = stack("LayerNormMLP")
    x = torch.randn(2, 16)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    try:
        with pytest.warns(RematFallbackWarning, match="global module hooks"):
            fused(x)
    finally:
        handle.remove()
    assert calls.count("Linear") == 2 and "GELU" in calls  # each layer ran, as stock runs them


# --- Hugging Face models: changes after conversion ---------------------------------------------


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "after-a-fused-call"])
@pytest.mark.parametrize("change", ["forward-hook", "parametrization", "tensor-subclass"])
def test_a_changed_projection_in_a_converted_hf_model(change, warm):
    """Also after a fused call, whose verdict is kept: the change is seen at the next call."""
    stock, _ = build("gpt2")
    converted = conv.convert(copy.deepcopy(stock))
    if warm:
        converted(**inputs("gpt2", "cpu"))
    for model in (stock, converted):  # the same change to both: their results must agree
        CHANGES[change](model.transformer.h[0].attn.c_attn)
        CHANGES[change](model.transformer.h[1].mlp.c_fc)
    batch = inputs("gpt2", "cpu")
    with pytest.warns(RematFallbackWarning) as caught:
        loss, calls = remat_attention_calls(lambda: converted(**batch).loss)
    assert rel_error(loss, stock(**batch).loss) < 1e-5
    assert calls == LAYERS  # the attention function reads no weight: remat's in both layers
    where = {str(w.message).split(" (")[0] for w in caught if issubclass(w.category, RematFallbackWarning)}
    assert where == {"remat: transformer.h.0.attn.c_attn", "remat: transformer.h.1.mlp"}


def test_a_replaced_layer_norm_breaks_its_handoff():
    """A fused LayerNorm replaced after conversion: the new module's output is what the attention
    gets, as in stock; the fusion is gone for that layer, with a warning."""
    stock, _ = build("gpt2")
    converted = conv.convert(copy.deepcopy(stock))
    replacement = nn.LayerNorm(64)
    with torch.no_grad():
        replacement.weight.normal_()
    for model in (stock, converted):
        model.transformer.h[0].ln_1 = copy.deepcopy(replacement)
    batch = inputs("gpt2", "cpu")
    with pytest.warns(RematFallbackWarning, match="ln_1 is not fused any more"):
        loss = converted(**batch).loss
    assert rel_error(loss, stock(**batch).loss) < 1e-5


def test_a_copy_of_a_fused_layer_norm_alone_normalises():
    """peft's modules_to_save wraps a deep copy of a module: a copied fused LayerNorm, which does not
    sit in the layer, computes LayerNorm itself; the attention then takes its output as stock."""
    stock, _ = build("gpt2")
    converted = conv.convert(copy.deepcopy(stock))
    for model in (stock, converted):
        layer = model.transformer.h[0]
        layer.ln_1 = nn.Sequential(copy.deepcopy(layer.ln_1))
    batch = inputs("gpt2", "cpu")
    with pytest.warns(RematFallbackWarning):
        loss = converted(**batch).loss
    assert rel_error(loss, stock(**batch).loss) < 1e-5


def test_deepcopy_and_pickle_keep_the_fusions():
    stock, _ = build("vit")
    converted = conv.convert(copy.deepcopy(stock))
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(converted), torch.load(buffer, weights_only=False)]
    batch = inputs("vit", "cpu")
    want = stock(**batch).loss
    for model in copies:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RematFallbackWarning)
            loss, calls = remat_attention_calls(lambda model=model: model(**batch).loss)
        assert calls == LAYERS and rel_error(loss, want) < 1e-5
        # the copy's handoffs are the copy's: changing the original leaves it fused
        assert model.vit.layers[0].layernorm_before.remat_handoff is not \
            converted.vit.layers[0].layernorm_before.remat_handoff


# --- what runs stock is counted, and said once --------------------------------------------------


def test_a_mask_remat_does_not_compute_is_reported():
    """GPT-2 given a 4-D mask of no pattern remat computes (one query that does not see one earlier
    key): its attention runs stock, which the user learns from one warning per layer and from the
    report's counts."""
    stock, _ = build("gpt2")
    converted, report = conv.convert(stock, report=True)
    batch = inputs("gpt2", "cpu")
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(BATCH, 1, SEQ, SEQ).clone()
    mask[0, 0, 5, 2] = False
    reason = "a mask remat's kernels do not take (past keys, a static cache, or the model's own pattern)"
    with pytest.warns(RematFallbackWarning, match=r"remat: transformer.h.1.attn \(GPT2Attention\) runs stock "
                                                  r"attention: a mask remat's kernels do not take"):
        for _ in range(3):
            converted(**batch, attention_mask=mask).loss.backward()
    counts = report.fallbacks()
    assert counts == {f"transformer.h.{i}.attn": {reason: 3} for i in range(LAYERS)}
    _, calls = remat_attention_calls(lambda: converted(**batch).loss)
    assert calls == LAYERS  # no such mask: remat's path


def test_revert_drops_the_records():
    fused, stock = stack("LayerNormLinear")
    seq = conv.convert(nn.Sequential(*stock))
    seq[0].linear.register_forward_hook(double_output)
    with pytest.warns(RematFallbackWarning):
        seq(torch.randn(2, 16))
    reverted = remat.revert(seq)
    assert not any(n.startswith("remat_") for m in reverted.modules() for n in vars(m))


def _llama():
    from hf_models import RMS_FAMILIES

    torch.manual_seed(0)
    stock, _ = RMS_FAMILIES["llama"]()
    return stock


def test_the_checks_are_decided_once_and_again_after_a_change(monkeypatch):
    """A converted layer's checks of its modules run at its first call only: later calls compare one
    fingerprint. Changes the fingerprint covers (a hook, eval mode, a cast, a replaced weight) make
    the next call check again, and compute what stock computes."""
    from remat import _guards, _linears

    stock = _llama()
    converted = conv.convert(copy.deepcopy(stock))
    ids = torch.randint(0, stock.config.vocab_size, (2, 7))
    converted(input_ids=ids, labels=ids)
    checks = []
    counted = lambda f: lambda *a, **k: checks.append(f.__name__) or f(*a, **k)  # noqa: E731
    monkeypatch.setattr(_linears, "plain_reason", counted(_guards.plain_reason))
    modules = importlib.import_module("remat.convert.hf.modules")
    handoff = importlib.import_module("remat.convert.hf.handoff")
    monkeypatch.setattr(handoff, "hook_reason", counted(_guards.hook_reason))
    monkeypatch.setattr(modules, "plain_reason", counted(_guards.plain_reason))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        converted(input_ids=ids, labels=ids)
    assert checks == []
    k_proj = converted.model.layers[0].self_attn.k_proj
    changes = {
        "eval": lambda model: model.eval(),
        "hook": lambda model: model.model.layers[0].self_attn.k_proj.register_forward_hook(double_output),
        "weight": lambda model: to_subclass(model.model.layers[1].mlp.down_proj),
    }
    for name, change in changes.items():
        for model in (stock, converted):
            change(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RematFallbackWarning)
            loss = converted(input_ids=ids, labels=ids).loss
        assert checks, name
        checks.clear()
        assert rel_error(loss, stock(input_ids=ids, labels=ids).loss) < 1e-5, name
    assert any("k_proj has forward/backward hooks" in reason for reason in k_proj.__dict__["remat_fallbacks"])


def _kept_calls(model):
    """The fused modules of `model` whose fused op call is kept with their verdict (remat.ops.fused.Checked)."""
    from remat.ops.fused import Checked

    return [m for m in model.modules() if isinstance(m.__dict__.get("remat_decided"), tuple)
            and type(m.__dict__["remat_decided"][1]) is tuple
            and isinstance(m.__dict__["remat_decided"][1][-1], Checked)
            and m.__dict__["remat_decided"][1][-1]._call is not None]


NORMS = {"gpt2": ("ln_1", "ln_2", "eps"), "llama": ("input_layernorm", "post_attention_layernorm", "variance_epsilon")}


@pytest.mark.parametrize("family", NORMS)
def test_what_a_kept_call_does_not_hold_is_read_again(family):
    """After fused calls, whose arguments are kept with their verdict (the fused op's call, decided once), a
    norm's eps set on its module (no fingerprint covers it) and a weight's data replaced in place (the same
    Parameter) are what the next call computes with, as stock does."""
    stock = build("gpt2")[0] if family == "gpt2" else _llama()
    converted = conv.convert(copy.deepcopy(stock))
    batch = inputs("gpt2", "cpu") if family == "gpt2" else {"input_ids": torch.randint(0, 100, (2, 7))}
    batch["labels"] = batch["input_ids"]
    for _ in range(2):
        converted(**batch)
    assert len(_kept_calls(converted)) == 2 * LAYERS  # each layer's q/k/v or c_attn, and its MLP
    first, second, eps = NORMS[family]
    layers = lambda model: model.transformer.h if family == "gpt2" else model.model.layers  # noqa: E731
    weight = torch.randn_like(layers(stock)[1].mlp.down_proj.weight if family == "llama" else
                              layers(stock)[1].mlp.c_fc.weight)
    for model in (stock, converted):
        setattr(getattr(layers(model)[0], first), eps, 0.5)
        setattr(getattr(layers(model)[1], second), eps, 0.25)
        projection = layers(model)[1].mlp.down_proj if family == "llama" else layers(model)[1].mlp.c_fc
        projection.weight.data = weight.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        loss = converted(**batch).loss
    assert rel_error(loss, stock(**batch).loss) < 1e-5


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_converted_model_takes_no_fingerprint_while_nothing_changes(monkeypatch, native):
    """With remat._C built, a converted model's calls after its first compare their kept fingerprints in place
    and take none; without it (or where it cannot tell) each check takes one, and a change still decides again."""
    from remat import _guards

    if native and not _guards.native_comparison():
        pytest.skip("remat._C is not built here")
    if not native:
        monkeypatch.setattr(_guards, "_same_fingerprint", None)
    stock = _llama()
    converted = conv.convert(copy.deepcopy(stock))
    ids = torch.randint(0, stock.config.vocab_size, (2, 7))
    converted(input_ids=ids, labels=ids)
    taken = []
    take = _guards.fingerprint
    monkeypatch.setattr(_guards, "fingerprint", lambda modules: taken.append(1) or take(modules))
    converted(input_ids=ids, labels=ids)
    assert (len(taken) == 0) == native
    for model in (stock, converted):
        model.model.layers[1].mlp.down_proj.register_forward_hook(double_output)
    with pytest.warns(RematFallbackWarning, match="hooks"):
        loss = converted(input_ids=ids, labels=ids).loss
    assert taken and rel_error(loss, stock(input_ids=ids, labels=ids).loss) < 1e-5
