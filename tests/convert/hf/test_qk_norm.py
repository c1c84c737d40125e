"""q/k norms fused into remat's attention (remat/convert/hf/head_norm.py): Qwen3 (per-head norms on
the projection viewed as heads), OLMo2 (norms over every head) and Gemma3 (per-head norms on the
transposed view, Gemma's (1 + w) rounding) train as stock; the attention keeps the projections'
outputs and fp32 rstds instead of q and k (counted exactly, on meta); the fallbacks and revert."""

import contextlib
import warnings

import pytest
import torch

import remat
from remat._guards import RematFallbackWarning, fallback_counts
from remat.convert import RematWarning
from remat.convert.hf import head_norm
from remat.ops.qk_norm_attention import NormRopeAttention

from hf_models import LAYER_RULES, OpCounter, assert_tiny_step_as_stock, tiny_causal_lm, tiny_loss

transformers = pytest.importorskip("transformers", minversion="5.25")

FAMILIES = {"Qwen3Config": "Qwen3RMSNorm", "Olmo2Config": "Olmo2RMSNorm", "Gemma3TextConfig": "Gemma3RMSNorm"}


def _ids(batch=2, seq=8):
    return torch.randint(2, 90, (batch, seq), generator=torch.Generator().manual_seed(1))


def _fused_rows(report):
    return [row for row in report if row.type.startswith("RematHead")]


def _convert(stock):
    """remat.convert with the layer rules (the fused LM loss's own probe is slow under the interpreter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        warnings.simplefilter("error", RematFallbackWarning)
        return remat.convert(stock, report=True, layers=LAYER_RULES)


@pytest.mark.kernels
@pytest.mark.parametrize("config_name", FAMILIES)
def test_qk_norms_fused_train_as_stock(config_name):
    stock = tiny_causal_lm(config_name)
    converted, report = _convert(stock)
    layers = stock.config.num_hidden_layers
    rows = _fused_rows(report)
    assert [row.path.rsplit(".", 1)[1] for row in rows] == ["q_norm", "k_norm"] * layers
    assert all(row.type == f"RematHead{FAMILIES[config_name]}" and row.saves() > 0 for row in rows)
    with _fused_backwards() as fused:
        assert_tiny_step_as_stock(stock, converted, "causal", _ids())
    assert fused == [layers]  # every attention's backward rebuilt its q and k
    assert fallback_counts(converted) == {}


@contextlib.contextmanager
def _fused_backwards():
    """[the number of fused attention backwards (q and k rebuilt) run inside], filled on exit."""
    counts, calls = [], [0]
    original = NormRopeAttention.backward

    def counting(ctx, do):
        calls[0] += 1
        return original(ctx, do)

    NormRopeAttention.backward = staticmethod(counting)
    try:
        yield counts
    finally:
        NormRopeAttention.backward = staticmethod(original)
        counts.append(calls[0])


def _meta_base_model(config_name, **sizes):
    """A bf16 base model (no LM head) on meta at the given sizes; with Llama's layer but for the q/k
    norms where config_name is "LlamaConfig"."""
    config = getattr(transformers, config_name)(vocab_size=100, num_hidden_layers=2, intermediate_size=8,
                                                max_position_embeddings=8192, **sizes)
    with torch.device("meta"):
        return transformers.AutoModel.from_config(config).to(torch.bfloat16).train()


def _kept_bytes(model, tokens):
    """Bytes one training forward keeps (each storage once, parameters aside), as remat memory counts."""
    from remat.planner.counting import count_forward

    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    return count_forward(model, (), {"input_ids": ids}).total_bytes()


SIZES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def test_fused_layer_keeps_llamas_bytes_and_the_rstds():
    """Exact, on meta in bf16: a Qwen3 layer with its q/k norms fused keeps what a Llama layer of the
    same shape keeps and one fp32 rstd per head and token (4 (H + H_kv) bytes a token): no fp32 copy
    of q or k, no normalised q or k, no post-rope q or k. Unfused (the norms stock, as before),
    6 bytes more an element of q and k: the fp32 copy (4) and the normalised x (2); the post-rope q
    the attention kept is as large as the projection output it keeps instead. The report says so."""
    tokens, layers = 16, 2
    heads, kv_heads, head_dim = SIZES["num_attention_heads"], SIZES["num_key_value_heads"], SIZES["head_dim"]
    llama = remat.convert(_meta_base_model("LlamaConfig", **SIZES))
    fused, report = remat.convert(_meta_base_model("Qwen3Config", **SIZES), report=True)
    rstd_bytes = 4 * (heads + kv_heads) * tokens * layers
    assert _kept_bytes(fused, tokens) == _kept_bytes(llama, tokens) + rstd_bytes

    unfused = remat.convert(_meta_base_model("Qwen3Config", **SIZES))
    head_norm.unfuse(unfused, [], "as before the fusion")  # stock q/k norms and the rope's q and k
    assert not any(type(m).__name__.startswith("RematHead") for m in unfused.modules())
    qk_elements = (heads + kv_heads) * head_dim * tokens * layers
    difference = _kept_bytes(unfused, tokens) - _kept_bytes(fused, tokens)
    assert difference == 6 * qk_elements
    assert sum(row.saves() for row in _fused_rows(report)) * tokens == difference


def test_qwen3_shaped_layer_at_4096_tokens():
    """remat memory's figure for the issue's Qwen3-shaped layer (hidden 2048, 32 heads of 128, 4 kv
    heads, a tiny MLP) at 4096 tokens, bf16 on meta: 214.2 MiB a layer before, now at most 120 MiB."""
    from remat.planner import measure

    sizes = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    model = _meta_base_model("Qwen3Config", **sizes)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    saves, paths, _ = measure(model, {"input_ids": ids}, ("remat",))
    counted = saves["remat"]
    outside = counted.outside.internal_bytes + sum(counted.key_bytes[k] for k in counted.outside.shared_keys)
    per_layer = (counted.total_bytes() - outside) / len(paths)
    assert per_layer <= 120 * 2**20, per_layer / 2**20


@pytest.fixture(scope="module")
def qwen3():
    """(stock, converted) tiny Qwen3, converted once for the tests below (each clears the gradients
    and the fallback counts, and removes what it adds)."""
    stock = tiny_causal_lm("Qwen3Config")
    return stock, _convert(stock)[0]


def _fresh(*models):
    for model in models:
        model.zero_grad(set_to_none=True)
        for module in model.modules():
            module.__dict__.pop("remat_fallbacks", None)


def _step(model, loss_of):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = loss_of(model)
    loss.backward()
    return loss


def _assert_same_step(stock, converted, loss_of):
    _fresh(stock, converted)
    torch.testing.assert_close(_step(converted, loss_of), _step(stock, loss_of), rtol=1e-5, atol=0)
    for (name, p), q in zip(stock.named_parameters(), converted.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("batch_kind", ["padded", "packed"])
def test_padded_and_packed_batches_fuse_on_attention_varlen(qwen3, batch_kind):
    """A left-padded batch (the kept tokens) and packed sequences (position_ids restarting): the
    fused path on remat.attention_varlen's kernels, q and k rebuilt as tokens in the backward."""
    stock, converted = qwen3
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    if batch_kind == "padded":
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        batch.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    else:
        batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * ids.shape[0])
    with OpCounter() as counter, _fused_backwards() as fused:
        _assert_same_step(stock, converted, lambda model: model(**batch).loss)
    layers = stock.config.num_hidden_layers
    assert fused == [layers] and counter.counts["remat::attention_varlen_fwd"] == layers
    assert counter.counts["remat::attention_fwd"] == 0
    assert fallback_counts(converted) == {}


def test_a_norm_running_stock_falls_back_with_the_reason(qwen3):
    """A hook on a q norm after convert: that norm runs its stock forward, its attention the q and k
    it is handed (their graph gives the gradients), with the reasons recorded; the step as stock."""
    stock, converted = qwen3
    handle = converted.model.layers[0].self_attn.q_norm.register_forward_hook(lambda module, args, output: None)
    ids = _ids()
    try:
        with _fused_backwards() as fused:
            _assert_same_step(stock, converted, lambda model: model(input_ids=ids, labels=ids).loss)
    finally:
        handle.remove()
    assert fused == [stock.config.num_hidden_layers - 1]
    reasons = fallback_counts(converted)
    assert "has forward/backward hooks" in reasons["model.layers.0.self_attn.q_norm"]
    assert list(reasons["model.layers.0.self_attn"]) == [
        "q/k norms not fused: its q norm did not run remat's forward in this call"]
    assert "model.layers.1.self_attn" not in reasons


def test_past_keys_run_as_stock(qwen3):
    """A second forward on the cache of a first (past keys): computed as stock, gradients included,
    with the reason (the mask of a call with past keys is none remat's kernels take)."""
    stock, converted = qwen3
    ids = _ids(batch=1)

    def loss_of(model):
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        return model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits.pow(2).mean()

    with _fused_backwards() as fused:
        _assert_same_step(stock, converted, loss_of)
    # The first call (no past keys) fuses; its keys and values reach the loss through the cache only
    # (their gradients through the stock rope and the norms' own Function), and layer 0's output
    # through layer 1's keys: one fused backward, layer 0's.
    assert fused == [1]
    reasons = [r for counts in fallback_counts(converted).values() for r in counts]
    assert reasons and all("a mask remat's kernels do not take" in r for r in reasons), reasons


def test_revert_gives_stock_back():
    stock = tiny_causal_lm("Qwen3Config")
    converted, _ = _convert(stock)
    reverted = remat.revert(converted)
    for module in reverted.modules():
        assert not any(key.startswith("remat_") for key in vars(module))
        assert not type(module).__name__.startswith("Remat")
    attention = reverted.model.layers[0].self_attn
    assert not attention._forward_pre_hooks and not attention._forward_hooks
    assert type(attention.q_norm) is type(stock.model.layers[0].self_attn.q_norm)
    with torch.no_grad():
        assert torch.equal(tiny_loss(reverted, "causal", _ids()), tiny_loss(stock, "causal", _ids()))


def test_each_layer_replayed_on_its_own_path():
    """AFMoE applies the rotary embedding in its local layers only: each attention module is replayed
    on its own, the global layer's norms stay stock with why (remat's rebuild applies the rope)."""
    if not hasattr(transformers, "AfmoeConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no AFMoE")
    stock = tiny_causal_lm("AfmoeConfig")
    local = [layer.self_attn.is_local_attention for layer in stock.model.layers]
    assert True in local and False in local
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, report = remat.convert(stock, report=True, layers=LAYER_RULES)
    rows = {row.path: row for row in report if row.path.endswith(("q_norm", "k_norm"))}
    for i, is_local in enumerate(local):
        for name in ("q_norm", "k_norm"):
            row = rows[f"model.layers.{i}.self_attn.{name}"]
            if is_local:
                assert row.action.startswith("swapped to RematHead"), row
            else:
                assert row.action == "skipped" and "not rope(norm(x))" in row.reason, row


def test_norms_stay_stock_where_the_attention_stays_the_models():
    """The fusion needs remat's attention function: a model whose attention implementation convert
    keeps (here: it says it takes no flash-attention-style masks) keeps its stock norms, and says why."""
    stock = tiny_causal_lm("Qwen3Config")
    stock._supports_flash_attn = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted, report = remat.convert(stock, report=True, layers=LAYER_RULES)
    assert converted.config._attn_implementation != "remat"
    assert not any(type(m).__name__.startswith("RematHead") for m in converted.modules())
    assert not converted.model.layers[0].self_attn._forward_pre_hooks
    rows = [row for row in report if row.path.endswith(("q_norm", "k_norm"))]
    assert len(rows) == 2 * stock.config.num_hidden_layers
    assert all(row.action == "skipped" and row.type == "Qwen3RMSNorm" and "attention implementation stays" in row.reason
               for row in rows)
