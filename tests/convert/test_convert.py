"""remat.convert / remat.revert on plain PyTorch models: same loss and gradients, less saved
activation memory, the same state_dict keys, and what is (not) swapped and why."""

import copy
import importlib
import os
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import remat
from remat import _backend

from numerics import assert_compiled_matches_eager, rel_error, saved_bytes

# remat.convert is also the name of the function remat/__init__.py exports: import the module by path.
conv = importlib.import_module("remat.convert")
conv_fx = importlib.import_module("remat.convert.fx")
torch_modules = importlib.import_module("remat.convert.torch_modules")


def spy_on(module, name):
    """mock.patch of module.name that still calls it: the calls are counted."""
    return mock.patch.object(module, name, wraps=getattr(module, name))

GRAD_TOL = 1e-4  # fp32, converted vs stock


class Block(nn.Module):
    """A pre-LN transformer block with a classifier head, from stock layers."""

    def __init__(self, hidden=32, heads=2, ffn=64, classes=10):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, classes))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        x = x + self.mlp(x)
        return self.head(x)


def randomize(model):
    """Parameters away from their init (LayerNorm ones/zeros would hide bugs)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def loss_and_grads(model, x, target):
    """(loss, {state_dict key: grad}): the keys are the same in stock and converted models."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).flatten(0, -2), target.flatten())
    loss.backward()
    params = model.state_dict(keep_vars=True)
    return loss.detach(), {k: p.grad for k, p in params.items() if isinstance(p, nn.Parameter)}


def assert_same_training_step(stock, converted, x, target):
    loss, grads = loss_and_grads(stock, x, target)
    loss_c, grads_c = loss_and_grads(converted, x, target)
    assert rel_error(loss_c, loss) < GRAD_TOL
    assert grads.keys() == grads_c.keys() and grads
    for key in grads:
        assert grads_c[key] is not None, key
        assert rel_error(grads_c[key], grads[key]) < GRAD_TOL, f"{key}: {rel_error(grads_c[key], grads[key]):.3g}"


def test_block_same_loss_and_gradients(target):
    device, _ = target
    stock = randomize(Block()).to(device)
    converted, report = conv.convert(stock, report=True)
    actions = {row.path: row.action for row in report}
    assert actions == {
        "ln1": "swapped to remat.nn.LayerNorm",
        "attn": "swapped to RematMultiheadAttention",
        "mlp.0": "swapped to LayerNormMLP",
        "head.0": "swapped to LayerNormLinear",
    }
    assert isinstance(converted.mlp[0], remat.nn.LayerNormMLP) and isinstance(converted.mlp[1], nn.Identity)
    assert isinstance(converted.head[0], remat.nn.LayerNormLinear)
    x = torch.randn(2, 11, 32, device=device)
    target_ = torch.randint(0, 10, (2, 11), device=device)
    with spy_on(torch_modules, "multihead_self_attention") as spy:
        assert_same_training_step(stock, converted, x, target_)
    assert spy.call_count == 1  # the attention really ran on remat.attention


def test_transformer_encoder_layer(target):
    """nn.TransformerEncoderLayer (norm_first, GELU module): LayerNorms, attention and GELU swapped."""
    device, _ = target
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, activation=nn.GELU(),
                                       batch_first=True, norm_first=True)
    stock = randomize(nn.Sequential(layer, nn.Linear(32, 10))).to(device)
    converted, report = conv.convert(stock, report=True)
    swapped = {row.path for row in report.swapped}
    assert swapped == {"0.self_attn", "0.norm1", "0.norm2", "0.activation"}
    x = torch.randn(2, 9, 32, device=device)
    assert_same_training_step(stock, converted, x, torch.randint(0, 10, (2, 9), device=device))


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_saved_activation_bytes(target, recompute):
    """fp32, T tokens, width h, FFN f: LayerNorm->MLP no longer keeps LN(x) (T·h·4) and the GELU
    output (T·f·4); LayerNorm->Linear no longer keeps LN(x) (T·h·4). recompute=False keeps them."""
    device, _ = target
    hidden, ffn, batch, seq = 32, 64, 2, 8
    tokens = batch * seq
    stock = Block(hidden, 2, ffn).to(device)
    converted = conv.convert(stock, recompute=recompute)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    measure = lambda m, fn: saved_bytes(lambda: fn(x), exclude=list(m.parameters()))  # noqa: E731
    for name, expected_drop in (("mlp", tokens * (hidden + ffn) * 4), ("head", tokens * hidden * 4)):
        before = measure(stock, getattr(stock, name))
        after = measure(converted, getattr(converted, name))
        assert before - after == (expected_drop if recompute else 0), name
    # Attention keeps the in-projection input, qkv (one storage), the output and fp32 lse: never seq x seq.
    attn = lambda m: (lambda t: m.attn(t, t, t, need_weights=False)[0])  # noqa: E731
    expected = tokens * hidden * 4 * 5 + batch * 2 * seq * 4
    assert measure(converted, attn(converted)) == expected
    assert measure(stock, attn(stock)) >= expected


def test_state_dict_keys_and_checkpoint_load():
    stock = randomize(Block())
    converted = conv.convert(stock)
    assert list(converted.state_dict()) == list(stock.state_dict())  # same keys, same order
    checkpoint = copy.deepcopy(randomize(copy.deepcopy(stock)).state_dict())
    result = converted.load_state_dict(checkpoint, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in converted.state_dict().items():
        assert torch.equal(value, checkpoint[key]), key
    # And back: the converted model's checkpoint loads into a stock model.
    fresh = Block()
    fresh.load_state_dict(converted.state_dict(), strict=True)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(converted(x), fresh(x), rtol=1e-5, atol=1e-5)


def test_inplace_shares_parameters_and_revert():
    stock = randomize(Block())
    reference = copy.deepcopy(stock)
    ids = {id(p) for p in stock.parameters()}
    converted = conv.convert(stock, inplace=True)
    assert converted is stock and {id(p) for p in converted.parameters()} == ids
    reverted = conv.revert(converted)
    assert {id(p) for p in reverted.parameters()} == ids
    assert type(reverted.attn) is nn.MultiheadAttention and type(reverted.ln1) is nn.LayerNorm
    assert type(reverted.mlp) is nn.Sequential
    assert [type(m) for m in reverted.mlp] == [nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear]
    assert list(reverted.state_dict()) == list(reference.state_dict())
    assert not any(isinstance(m, (remat.nn.LayerNorm, remat.nn.MLP, remat.nn.LayerNormLinear))
                   for m in reverted.modules())
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(reverted(x), reference(x), rtol=0, atol=0)


def test_not_inplace_leaves_the_original_alone():
    stock = Block()
    conv.convert(stock)
    assert type(stock.ln1) is nn.LayerNorm and type(stock.mlp) is nn.Sequential
    assert type(stock.mlp[0]) is nn.LayerNorm


def _reason(report, path):
    rows = [row for row in report if row.path == path]
    assert rows, f"no report row for {path}: {report}"
    return rows[0].action, rows[0].reason


def test_never_swaps_what_it_cannot_prove():
    hooked = nn.LayerNorm(16)
    hooked.register_forward_hook(lambda *args: None)

    class MyLayerNorm(nn.LayerNorm):
        pass

    class MySequential(nn.Sequential):
        pass

    model = nn.ModuleDict({
        "no_affine": nn.Sequential(nn.LayerNorm(16, elementwise_affine=False), nn.Linear(16, 8)),
        "widths": nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)),
        "relu": nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
        "gelu_then_other": nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, 16)),
        "hooked": nn.Sequential(hooked, nn.Linear(16, 8)),
        "subclass": MyLayerNorm(16),
        "my_sequential": MySequential(nn.LayerNorm(16), nn.Linear(16, 8)),
    })
    converted, report = conv.convert(model, report=True)
    action, reason = _reason(report, "no_affine.0")
    assert action == "skipped" and "elementwise_affine=False" in reason
    action, reason = _reason(report, "widths.0")
    assert action == "skipped" and "widths do not chain" in reason
    assert _reason(report, "hooked.0") == ("skipped", "LayerNormLinear: has forward/backward hooks")
    assert _reason(report, "subclass")[0] == "skipped"
    assert _reason(report, "my_sequential")[0] == "skipped"
    assert _reason(report, "gelu_then_other.1") == ("swapped to remat.nn.GELU", "")
    assert type(converted["relu"]) is nn.Sequential  # nothing to do there
    assert type(converted["no_affine"][1]) is nn.Linear and type(converted["widths"][1]) is remat.nn.GELU
    assert type(converted["hooked"][0]) is nn.LayerNorm  # the hooked module itself is kept too
    assert "swapped" in str(report) and "skipped" in str(report)  # a readable table
    x = torch.randn(3, 16)
    for name in ("no_affine", "widths", "relu", "gelu_then_other", "hooked", "my_sequential"):
        torch.testing.assert_close(converted[name](x), model[name](x), rtol=1e-5, atol=1e-6)


def test_layers_and_recompute_options():
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    only_gelu = conv.convert(model, layers={"gelu"})
    assert [type(m) for m in only_gelu] == [nn.LayerNorm, nn.Linear, remat.nn.GELU, nn.Linear]
    mlp_only = conv.convert(model, layers={"mlp"})
    assert [type(m) for m in mlp_only] == [nn.LayerNorm, remat.nn.MLP, nn.Identity, nn.Identity]
    one_name = conv.convert(model, layers="mlp")  # one name, not the letters m, l, p
    assert [type(m) for m in one_name] == [type(m) for m in mlp_only]
    with pytest.raises(TypeError, match="layers must be a name or a collection of names"):
        conv.convert(model, layers=3)
    kept = conv.convert(model, recompute=False)
    assert type(kept[0]) is remat.nn.LayerNormMLP and kept[0].recompute is False
    with pytest.raises(ValueError, match="unknown"):
        conv.convert(model, layers={"rmsnorm"})
    with pytest.raises(TypeError, match="recompute"):
        conv.convert(model, recompute="yes")


def test_attention_falls_back_to_torch_where_remat_does_not_apply():
    """Cross-attention, need_weights, padding masks, dropout: the stock computation, same results."""
    stock = randomize(nn.MultiheadAttention(32, 2, batch_first=True))
    ours = conv.convert(stock)
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 4, 32)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    calls = [
        dict(query=x, key=memory, value=memory),
        dict(query=x, key=x, value=x, need_weights=True),
        dict(query=x, key=x, value=x, need_weights=False, key_padding_mask=padding),
        dict(query=x, key=x, value=x, need_weights=False, attn_mask=causal, is_causal=True),
        dict(query=x, key=x, value=x, need_weights=False, attn_mask=causal),  # causal, without the hint
    ]
    with spy_on(torch_modules, "multihead_self_attention") as spy:
        for kwargs in calls:
            want, got = stock(**kwargs), ours(**kwargs)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            if want[1] is not None:
                torch.testing.assert_close(got[1], want[1])
    assert spy.call_count == 1  # only the verified causal self-attention call ran on remat
    assert set(ours.__dict__["remat_fallbacks"]) == {  # the calls that ran stock, each counted
        "not self-attention", "need_weights=True", "key_padding_mask", "attn_mask other than the causal mask"}


def test_attention_dropout_runs_on_remat_reproducibly():
    """Dropout in training: remat.attention's dropout_p (its own mask: reproducible by seed, not
    torch's draws); in eval the stock result."""
    stock = randomize(nn.MultiheadAttention(32, 2, dropout=0.5, batch_first=True))
    ours = conv.convert(copy.deepcopy(stock))
    x = torch.randn(2, 6, 32)
    with spy_on(torch_modules, "multihead_self_attention") as spy:
        torch.manual_seed(0)
        first = ours(x, x, x, need_weights=False)[0]
        torch.manual_seed(0)
        again = ours(x, x, x, need_weights=False)[0]
    assert spy.call_count == 2 and spy.call_args.args[-1] == 0.5
    assert torch.equal(first, again) and not torch.equal(first, ours.eval()(x, x, x, need_weights=False)[0])
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], stock.eval()(x, x, x, need_weights=False)[0],
                               rtol=1e-5, atol=1e-5)


def test_attention_under_autocast_stays_on_remat():
    """Under autocast the projections autocast as torch's own do: remat's path, torch's dtypes."""
    stock = randomize(nn.MultiheadAttention(32, 2, batch_first=True))
    ours = conv.convert(stock)
    x = torch.randn(2, 6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            spy_on(torch_modules, "multihead_self_attention") as spy:
        got, want = ours(x, x, x, need_weights=False)[0], stock(x, x, x, need_weights=False)[0]
    assert spy.call_count == 1 and got.dtype == want.dtype == torch.bfloat16
    assert rel_error(got, want) < 2e-2


def test_sequence_first_attention(target):
    device, _ = target
    stock = randomize(nn.MultiheadAttention(32, 2)).to(device)  # batch_first=False
    ours = conv.convert(stock)
    x = torch.randn(7, 2, 32, device=device, requires_grad=True)
    want = stock(x, x, x, need_weights=False)[0]
    got = ours(x, x, x, need_weights=False)[0]
    assert rel_error(got, want) < GRAD_TOL


def report_rows(report):
    return [(row.path, row.type, row.action, row.reason, row.saves and row.saves()) for row in report]


def module_classes(model):
    return [(path, type(m)) for path, m in model.named_modules()]


def test_convert_twice_is_one_conversion():
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    once, first = conv.convert(model, report=True)
    twice, report = conv.convert(once, report=True)
    assert report_rows(report) == report_rows(first) and report.swapped
    assert module_classes(twice) == module_classes(once) and list(twice.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("inplace", [False, True])
def test_converting_a_converted_model_converts_its_stock_modules_afresh(inplace):
    """convert(convert(model)) is convert(model): the same classes, report, loss and gradients; with
    other options the second time, what those options give the stock model; revert gives stock back."""
    stock = randomize(Block())
    x, target_ = torch.randn(2, 11, 32), torch.randint(0, 10, (2, 11))
    once, first = conv.convert(copy.deepcopy(stock), report=True)
    for layers, want in [(conv.LAYERS, (once, first)), ({"mlp"}, conv.convert(stock, layers={"mlp"}, report=True))]:
        model = copy.deepcopy(once)
        twice, report = conv.convert(model, inplace=inplace, layers=layers, report=True)
        assert (twice is model) == inplace
        assert module_classes(twice) == module_classes(want[0]) and report_rows(report) == report_rows(want[1])
        assert_same_training_step(want[0], twice, x, target_)
        assert_same_training_step(stock, twice, x, target_)
        assert module_classes(conv.revert(twice)) == module_classes(stock)
    assert type(once.mlp[0]) is remat.nn.LayerNormMLP  # a copy converted again, not the model itself


def test_a_planned_model_is_not_converted_over_its_plan():
    from remat.planner.units import checkpoint_in_place

    model = randomize(Block())
    checkpoint_in_place(model.mlp, "full")
    with pytest.raises(ValueError, match="carries a remat plan"):
        conv.convert(model)


def test_a_model_with_zero3_partitioned_parameters_is_refused_before_its_probe():
    """DeepSpeed ZeRO-3 partitions each parameter in place (size 0 outside its module's gather) and tags it
    (ds_id, among others): convert's probe would read those empty weights, so convert refuses at once.
    (The other engines, wrapped on two gloo ranks: tests/convert/test_distributed.py.)"""
    model = randomize(Block())
    model.mlp[0].weight.ds_id = 0  # as deepspeed.zero.Init leaves every parameter it partitions
    with pytest.raises(ValueError, match=r"has DeepSpeed ZeRO-3 partitioned parameters \(mlp.0.weight; with "
                                         r"transformers, .* load and convert it first\): remat.convert the model "):
        conv.convert(model)


@pytest.mark.parametrize("family, inplace", [("llama", True), ("bert", False), ("bert_model", True)])
def test_converting_a_converted_hugging_face_model_again(family, inplace):
    """A causal LM (its fused LM head and loss), BERT with its masked LM head, BertModel: converted
    twice (also in place), it is converted once: the same classes, report, loss and gradients;
    reverted, the stock classes."""
    import hf_models

    stock, _ = hf_models.build("bert" if family == "bert_model" else family)
    batch = hf_models.family_inputs("bert" if family == "bert_model" else family, "cpu")
    if family == "bert_model":  # no head: its loss is the mean square of the hidden states
        stock, ids = stock.bert, batch["input_ids"]
        batch = {"input_ids": ids}
    with warnings.catch_warnings():  # BERT's pooler and the like: nothing to fuse, said at each conversion
        warnings.simplefilter("ignore")
        once, first = conv.convert(copy.deepcopy(stock), report=True)
        model = copy.deepcopy(once)
        twice, report = conv.convert(model, inplace=inplace, report=True)
    assert (twice is model) == inplace and report.swapped
    assert module_classes(twice) == module_classes(once) and report_rows(report) == report_rows(first)
    if family == "bert_model":
        for m in (once, twice):
            m.zero_grad()
            m(**batch).last_hidden_state.pow(2).mean().backward()
        for (name, p), q in zip(once.named_parameters(), twice.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    else:
        torch.testing.assert_close(twice(**batch).loss, once(**batch).loss, rtol=0, atol=0)
        hf_models.assert_same_step(stock, twice, batch)
    assert module_classes(conv.revert(twice)) == module_classes(stock)


def test_named_sequential_keeps_key_order():
    """nn.Sequential(OrderedDict) with names: the keys and their order survive, and revert restores."""
    import collections

    stock = randomize(nn.Sequential(collections.OrderedDict(
        ln=nn.LayerNorm(16), up=nn.Linear(16, 48), act=nn.GELU("tanh"), down=nn.Linear(48, 16), out=nn.Linear(16, 4),
    )))
    converted = conv.convert(stock)
    assert type(converted.ln) is remat.nn.LayerNormMLP and converted.ln.activation == "gelu_tanh"
    assert list(converted.state_dict()) == list(stock.state_dict())
    converted.load_state_dict(stock.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-5)
    reverted = conv.revert(converted)
    assert [type(m) for m in reverted] == [nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear, nn.Linear]
    assert reverted.act.approximate == "tanh"


# --- torch.fx: fusions inside a module's own forward -----------------------------------------


class AttrBlock(nn.Module):
    """A pre-LN transformer block holding its layers as attributes (no nn.Sequential), with a head."""

    def __init__(self, hidden=32, heads=2, ffn=64, classes=10):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        x = x + self.fc2(self.act(self.fc1(self.ln2(x))))
        return self.head(self.ln_f(x))


FX_FUSIONS = {"ln2": "fused to LayerNormMLP (torch.fx)", "ln_f": "fused to LayerNormLinear (torch.fx)"}


def test_fx_block_same_loss_and_gradients(target):
    device, _ = target
    stock = randomize(AttrBlock()).to(device)
    converted, report = conv.convert(stock, report=True)
    actions = {row.path: row.action for row in report}
    assert actions == {"ln1": "swapped to remat.nn.LayerNorm", "attn": "swapped to RematMultiheadAttention",
                       **FX_FUSIONS}
    assert type(converted) is AttrBlock and type(converted.fc1) is nn.Linear  # class and submodules kept
    assert [f[:2] for f in converted.remat_fx.fusions] == [
        ("LayerNormMLP", ("ln2", "fc1", "act", "fc2")), ("LayerNormLinear", ("ln_f", "head"))]
    x = torch.randn(2, 11, 32, device=device)
    target_ = torch.randint(0, 10, (2, 11), device=device)
    with mock.patch.object(conv_fx, "fused_mlp", wraps=conv_fx.fused_mlp) as mlp_spy, \
            mock.patch.object(conv_fx, "norm_linears", wraps=conv_fx.norm_linears) as linear_spy:
        assert_same_training_step(stock, converted, x, target_)
    assert mlp_spy.call_count == 1 and linear_spy.call_count == 1  # the fused functions really ran


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_fx_saved_activation_bytes(target, recompute):
    """fp32, T tokens, width h, FFN f: ln2 -> fc1 -> GELU -> fc2 no longer keeps LN2(x) (T·h·4) nor the
    GELU output (T·f·4); ln_f -> head no longer keeps LN_f(x) (T·h·4). Everything else is as stock
    (attention left stock here), and recompute=False keeps them all."""
    device, _ = target
    hidden, ffn, batch, seq = 32, 64, 2, 8
    tokens = batch * seq
    stock = AttrBlock(hidden, 2, ffn).to(device)
    converted = conv.convert(stock, layers={"layernorm", "mlp"}, recompute=recompute)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)
    before = saved_bytes(lambda: stock(x), exclude=list(stock.parameters()))
    after = saved_bytes(lambda: converted(x), exclude=list(converted.parameters()))
    expected_drop = tokens * (hidden + ffn) * 4 + tokens * hidden * 4
    assert before - after == (expected_drop if recompute else 0)


def test_fx_state_dict_checkpoint_and_revert():
    stock = randomize(AttrBlock())
    reference = copy.deepcopy(stock)
    ids = [id(p) for p in stock.parameters()]
    converted = conv.convert(stock, inplace=True)
    assert "remat_fx" in vars(converted)
    assert [id(p) for p in converted.parameters()] == ids  # the very parameters, in their order
    assert list(converted.state_dict()) == list(reference.state_dict())
    checkpoint = copy.deepcopy(randomize(copy.deepcopy(reference)).state_dict())
    result = converted.load_state_dict(checkpoint, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    fresh = AttrBlock()
    fresh.load_state_dict(converted.state_dict(), strict=True)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(converted(x), fresh(x), rtol=1e-5, atol=1e-5)
    reverted = conv.revert(converted)
    assert reverted is stock and "remat_fx" not in vars(reverted) and "forward" not in vars(reverted)
    assert [id(p) for p in reverted.parameters()] == ids
    assert type(reverted.ln1) is nn.LayerNorm and type(reverted.attn) is nn.MultiheadAttention
    reference.load_state_dict(checkpoint)
    torch.testing.assert_close(reverted(x), reference(x), rtol=0, atol=0)  # the stock forward again


def test_fx_convert_twice_and_deepcopy():
    once = conv.convert(AttrBlock())
    twice, report = conv.convert(once, report=True)
    assert report.swapped and [f[:2] for f in twice.remat_fx.fusions] == [f[:2] for f in once.remat_fx.fusions]
    x = torch.randn(2, 5, 32)
    with mock.patch.object(conv_fx, "fused_mlp", wraps=conv_fx.fused_mlp) as spy:
        torch.testing.assert_close(twice(x), once(x), rtol=0, atol=0)
    assert spy.call_count == 2  # the copy's forward is bound to the copy and still fused


class Twice(nn.Module):
    """The LayerNorm output also goes to the residual: fusing would lose it."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        y = self.ln(x)
        return self.fc(y) + y


class DataDependent(nn.Module):
    """Control flow on a tensor's value: symbolic tracing cannot follow it."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(self.ln(x))
        return self.fc(x)


class MLPBlock(nn.Module):
    def __init__(self, ffn=32, out=16, dropout=None, hooked=False):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, ffn), nn.GELU(), nn.Linear(ffn, out)
        self.drop = dropout
        if hooked:
            self.fc2.register_forward_hook(lambda module, args, out: None)

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.drop is not None:
            h = self.drop(h)
        return self.fc2(h)


class NoGrad(nn.Module):
    """torch.no_grad() runs while tracing but leaves nothing in the graph."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            y = self.ln(x)
        return self.fc(y)


class Counting(nn.Module):
    """A forward that sets an attribute: a graph would not."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(self.ln(x))


def test_fx_never_fuses_what_it_cannot_prove():
    model = nn.ModuleDict({
        "twice": Twice(),
        "data_dependent": DataDependent(),
        "hooked": MLPBlock(hooked=True),
        "dropout": MLPBlock(dropout=nn.Dropout(0.0)),
        "widths": MLPBlock(out=8),
        "no_grad": NoGrad(),
        "counting": Counting(),
    })
    converted, report = conv.convert(model, report=True)
    action, reason = _reason(report, "twice.ln")
    assert action == "skipped" and "ln's output has 2 users (fc, add)" in reason, reason
    action, reason = _reason(report, "data_dependent")
    assert action == "skipped" and reason.startswith("does not trace: ") and "control flow" in reason, reason
    assert _reason(report, "hooked.fc1") == ("skipped", "MLP: Linear has forward/backward hooks")
    action, reason = _reason(report, "dropout.fc1")
    assert action == "skipped" and "goes to drop, not straight into an nn.Linear" in reason, reason
    action, reason = _reason(report, "widths.fc1")
    assert action == "skipped" and "MLP: widths do not chain: 16->32 then 32->8" in reason, reason
    action, reason = _reason(report, "no_grad")
    assert action == "skipped" and "switches grad or autocast mode (torch.no_grad" in reason, reason
    assert _reason(report, "counting") == ("skipped",
                                           "not rewritten: forward sets calls, which a torch.fx graph does not do")
    assert converted["counting"].calls == 0  # as before the traces ran its forward
    assert not any(row.action.startswith("fused") for row in report)
    assert not any("remat_fx" in vars(m) for m in converted.modules())
    x = torch.randn(3, 16)
    for name in model:
        torch.testing.assert_close(converted[name](x), model[name](x), rtol=1e-5, atol=1e-6)


class Optional(nn.Module):
    """An argument with a default and a branch on self.training: the trace sees one case of each."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)
        self.scale = 1.0

    def forward(self, x, shift=None):
        if shift is not None:
            x = x + shift
        if self.training:
            return self.fc(self.ln(x)) * self.scale
        y = self.ln(x)
        return self.fc(y) + y


def test_fx_runs_the_original_forward_for_calls_it_did_not_trace():
    stock = randomize(Optional())
    converted, report = conv.convert(stock, report=True)
    assert _reason(report, "ln") == ("fused to LayerNormLinear (torch.fx)",
                                     "ln -> fc in Optional.forward (in train mode)")
    action, reason = [(row.action, row.reason) for row in report if row.path == "ln"][1]
    assert action == "skipped" and reason.endswith("(in eval mode)") and "2 users" in reason, reason
    assert converted.remat_fx.fusions == (("LayerNormLinear", ("ln", "fc"), True),)
    x, shift = torch.randn(3, 16), torch.randn(16)
    calls = [((x,), {}), ((x,), {"shift": None}), ((x, shift), {}), ((x,), {"shift": shift})]
    with mock.patch.object(conv_fx, "norm_linears", wraps=conv_fx.norm_linears) as spy:
        for args, kwargs in calls:
            torch.testing.assert_close(converted(*args, **kwargs), stock(*args, **kwargs), rtol=1e-5, atol=1e-6)
        assert spy.call_count == 2  # shift=None only: a tensor shift runs the original forward
        converted.scale = stock.scale = 2.0  # a scalar the trace read as a constant
        torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-6)
        converted.eval(), stock.eval()  # eval uses the LayerNorm output twice: its own graph, unfused
        torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-6)
        converted.scale = stock.scale = 1.0
        torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-6)
        converted.train()
        converted.fc.register_forward_hook(lambda module, args, out: None)  # the fused graph would skip it
        torch.testing.assert_close(converted(x), stock.train()(x), rtol=1e-5, atol=1e-6)
    assert spy.call_count == 2


def test_fx_layers_and_recompute_options():
    only_mlp = conv.convert(AttrBlock(), layers={"mlp"})
    assert [f[:2] for f in only_mlp.remat_fx.fusions] == [("MLP", ("fc1", "act", "fc2"))]
    assert type(only_mlp.ln2) is nn.LayerNorm
    only_norm = conv.convert(AttrBlock(), layers={"layernorm"})
    assert [f[:2] for f in only_norm.remat_fx.fusions] == [("LayerNormLinear", ("ln2", "fc1")),
                                                           ("LayerNormLinear", ("ln_f", "head"))]
    assert type(only_norm.act) is nn.GELU  # "gelu" not asked for
    assert "remat_fx" not in vars(conv.convert(AttrBlock(), layers={"gelu", "attention"}))
    kept = conv.convert(AttrBlock(), recompute=False)
    with mock.patch.object(conv_fx, "fused_mlp", wraps=conv_fx.fused_mlp) as spy:
        kept(torch.randn(2, 3, 32))
    assert spy.call_args.args[5] is False  # recompute reaches fused_mlp(x, fc1, act, fc2, norm, recompute)


def test_fx_functional_gelu():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 16)

        def forward(self, x):
            return self.fc2(nn.functional.gelu(self.fc1(x), approximate="tanh"))

    stock = randomize(Functional())
    converted, report = conv.convert(stock, report=True)
    assert _reason(report, "fc1") == ("fused to MLP (torch.fx)", "fc1 -> F.gelu -> fc2 in Functional.forward")
    x = torch.randn(3, 16, requires_grad=True)
    torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-6)


def test_fx_block_compiles_fullgraph():
    """The rewritten forward (an instance attribute with its argument checks) traces in one graph."""
    model = conv.convert(randomize(AttrBlock()), layers={"layernorm", "mlp"})
    x = torch.randn(2, 5, 32)
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


# --- RematMultiheadAttention under torch.compile ----------------------------------------------


class SelfAttention(nn.Module):
    """nn.MultiheadAttention on its input, with the causal mask and is_causal=True when causal."""

    def __init__(self, causal, hidden=32, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.causal = causal

    def forward(self, x):
        if not self.causal:
            return self.attn(x, x, x, need_weights=False)[0]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.attn(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]


def _compiled_ops(model, x):
    """The op names in the graph torch.compile(fullgraph=True) captures for model(x)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=record)(x)
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("causal", [False, True], ids=["no-mask", "causal-mask"])
def test_attention_compiles_fullgraph(target, causal):
    """Eager checks a causal mask's values; under compile only its shape (the is_causal hint is
    trusted, as nn.MultiheadAttention does), so the remat path has no graph break either way."""
    device, _ = target
    model = conv.convert(randomize(SelfAttention(causal))).to(device)
    assert type(model.attn) is conv.RematMultiheadAttention
    x = torch.randn(2, 7, 32, device=device)
    assert any("remat.attention_fwd" in op for op in _compiled_ops(model, x))
    assert_compiled_matches_eager(model, x, tol=1e-4)


def test_remat_gpt_stock_blocks_are_fused_through_fx_keeping_their_keys(target):
    # remat.gpt's TorchGPTBlock is plain PyTorch layers: its LayerNorm -> qkv and LayerNorm -> MLP
    # runs are fused in place (SDPA stays stock), so a plan can choose "remat" for such a stack
    from remat.gpt import GPTConfig, torch_stack

    device, _ = target
    stock = randomize(torch_stack(GPTConfig(hidden=32, heads=2, layers=2), device=device))
    reference = copy.deepcopy(stock)
    ids = [id(p) for p in stock.parameters()]
    converted, report = conv.convert(stock, inplace=True, report=True)
    assert {row.path: row.action for row in report} == {
        f"{i}.{norm}": f"fused to {kind} (torch.fx)"
        for i in range(2) for norm, kind in (("ln_1", "LayerNormLinear"), ("ln_2", "LayerNormMLP"))}
    assert [id(p) for p in converted.parameters()] == ids
    assert list(converted.state_dict()) == list(reference.state_dict())
    x = torch.randn(2, 7, 32, device=device, requires_grad=True)
    fused_out = converted(x)
    stock_out = reference(x)
    torch.testing.assert_close(fused_out, stock_out, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(stock_out)
    fused_grads = torch.autograd.grad(fused_out, [x, *converted.parameters()], dy)
    stock_grads = torch.autograd.grad(stock_out, [x, *reference.parameters()], dy)
    for mine, theirs in zip(fused_grads, stock_grads):
        assert rel_error(mine, theirs) < GRAD_TOL
    conv.revert(converted)
    assert not any("remat_fx" in vars(m) or "forward" in vars(m) for m in converted.modules())


def test_the_integration_folders_run_the_references_under_the_interpreter():
    """tests/conftest.py: under the interpreter, a conversion test that asks for no kernels runs remat's ops on
    the references; on a GPU it runs the kernels."""
    expected = "reference" if _backend.interpreter_enabled() else os.environ.get("REMAT_BACKEND", "auto")
    assert remat.get_backend() == expected


@pytest.mark.kernels
def test_a_test_marked_kernels_runs_the_sessions_backend():
    assert remat.get_backend() == os.environ.get("REMAT_BACKEND", "auto")
