"""remat.convert on T5 (T5ForConditionalGeneration and T5EncoderModel; its copies mT5 and UMT5) and
Mixtral, neither with a rule (the structure finds T5's norms and gated FFN; Mixtral's attention runs
through the interface), tiny random configs, no downloads: the same loss and gradients as stock, the
same checkpoint, the exact bytes no longer kept (derived per family), and the reasons for what stays
stock: T5's attention (a relative position bias: the model takes no flash-attention-style masks), its
non-gated ReLU FFN, its gated FFN under dropout or with wo kept in fp32; Mixtral's MoE block (experts
as 3-D parameters) and the norm in front of it."""

import collections
import importlib
import json
import types
import warnings

import pytest
import torch
from test_hf_families import assert_skipped_as_expected, swapped_counts
from test_hf_rms_families import attention_output_copy

from remat import memory
from remat.convert.hf import experts

from hf_models import (
    BATCH,
    F32,
    FFN,
    HIDDEN,
    LAYERS,
    SEQ,
    assert_same_step,
    assert_save_pretrained_round_trip,
    build,
    convert_layers,
    family_inputs,
    remat_attention_calls,
    step_saved_bytes,
    transformers,
)

conv = importlib.import_module("remat.convert")

TOKENS = BATCH * SEQ  # per stack: T5's decoder runs as many tokens as its encoder here
STOCK_ATTENTION = "no remat rule for T5Attention: it runs as it is"  # self- and cross-attention
NO_FLASH_MASKS = "the model does not take flash-attention-style masks"  # the model's row: sdpa kept
RELU_FFN = "its forward (wi, act, dropout, wo) is none of fc1 -> act -> fc2"  # dropout before wo, ReLU
# the norm before the MoE block, which fuses into the router and the experts with remat's experts only
MOE_INPUT = "mlp.experts runs transformers' experts, not remat's (layers excludes experts)"


# --- T5 ----------------------------------------------------------------------------------------------


def t5_swaps(ffn, decoder=True, layers=LAYERS):
    """The swaps of a T5 model: per block, its self-attention norm into q, k and v, the FFN's norm into
    the gated FFN (or the ReLU FFN's wi), and in the decoder the cross-attention's norm into its q."""
    stacks, decoders = (2, layers) if decoder else (1, 0)
    gated = ffn == "gated-gelu"
    return {"RematFusedT5LayerNorm": 2 * stacks * layers + decoders,
            "RematNormedLinear": 3 * stacks * layers + decoders + (0 if gated else stacks * layers),
            "RematT5DenseGatedActDense": stacks * layers if gated else 0}


def t5_skips(ffn, decoder=True, layers=LAYERS):
    stacks, decoders = (2, layers) if decoder else (1, 0)
    skips = {STOCK_ATTENTION: stacks * layers + decoders, NO_FLASH_MASKS: 1,
             "RMSNorm: no fusion": stacks}  # each stack's final_layer_norm
    if ffn == "relu":
        skips[RELU_FFN] = stacks * layers
    return {k: v for k, v in skips.items() if v}


def t5_saving(ffn, decoder=True, layers=LAYERS):
    """(bytes the converted T5 keeps less in one fp32 training step, the report's bytes per token):

    norm   T5LayerNorm's stock forward keeps x, its rstd, x̂ = x·rstd and y = w·x̂; the fused projection
           keeps x and the rstd: x̂ and y, hidden wide each, no longer (the report counts y)
    self   the self-attention's norm is applied by each of q, k and v, which keep x and one rstd (shared)
    cross  the decoder's cross-attention norm feeds q alone (k and v read the encoder's states)
    ffn    gated: NewGELUActivation's formula keeps its input, tanh's output, 0.5·x and 1 + tanh; the
           product keeps act(gate) and up; wo keeps the product. The fused MLP keeps gate and up: 5 ffn
           wide no longer (the report counts act(gate) and the product). ReLU: the FFN runs stock.
    """
    gated = ffn == "gated-gelu"
    norm = 2 * F32 * HIDDEN
    encoder_block = norm + norm + (5 * F32 * FFN if gated else 0)
    report_block = F32 * HIDDEN + F32 * HIDDEN + (2 * F32 * FFN if gated else 0)
    saving, report = layers * TOKENS * encoder_block, layers * report_block
    if decoder:
        saving += layers * TOKENS * (encoder_block + norm)
        report += layers * (report_block + F32 * HIDDEN)
    return saving, report


class _EncoderLoss(torch.nn.Module):
    """A T5EncoderModel with a loss (the mean square of its last hidden state), as assert_same_step reads one."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids):
        hidden = self.encoder(input_ids=input_ids).last_hidden_state
        return types.SimpleNamespace(loss=hidden.square().mean())


class _Seeded(torch.nn.Module):
    """A model whose every call draws the same dropout masks: the RNG seeded first."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        torch.manual_seed(0)
        return self.model(**batch)


def assert_t5_report(report, ffn, decoder=True, layers=LAYERS):
    counts = swapped_counts(report)
    for cls, count in t5_swaps(ffn, decoder, layers).items():
        assert counts[cls] == count, f"{cls}: {counts[cls]} != {count}\n{report}"
    assert_skipped_as_expected(report, t5_skips(ffn, decoder, layers))


def assert_same_checkpoint(stock, converted):
    state, converted_state = stock.state_dict(), converted.state_dict()
    assert list(converted_state) == list(state)
    assert all(torch.equal(converted_state[k], v) for k, v in state.items())
    converted.load_state_dict(state, strict=True)


def converted_case(device, name, **overrides):
    """(stock, converted, report, batch, bytes autograd keeps for the stock step) of `name`'s tiny model."""
    stock, _ = build(name, **overrides)
    stock.to(device)
    batch = family_inputs(name, device)
    before = step_saved_bytes(stock, batch)
    converted, report = convert_layers(stock, report=True)
    return stock, converted, report, batch, before


def assert_saving_and_same_step(case, expected, attention_calls):
    """The step keeps exactly expected[0] bytes less, the report says expected[1] per token, and the loss
    and every gradient are stock's, with `attention_calls` remat attention kernels run."""
    stock, converted, report, batch, before = case
    assert before - step_saved_bytes(converted, batch) == expected[0]
    assert report.saved_bytes_per_token() == expected[1]
    _, calls = remat_attention_calls(lambda: assert_same_step(stock, converted, batch))
    assert calls == attention_calls


@pytest.mark.parametrize("ffn, layers", [("gated-gelu", LAYERS), ("relu", 1)])  # ReLU: one block a stack
def test_t5_same_loss_gradients_checkpoint_and_saved_bytes(target, ffn, layers):
    case = converted_case(target[0], "t5", feed_forward_proj=ffn, num_layers=layers)
    stock, converted, report, _, _ = case
    assert_t5_report(report, ffn, layers=layers)
    assert_same_checkpoint(stock, converted)
    assert_saving_and_same_step(case, t5_saving(ffn, layers=layers), attention_calls=0)  # the attention runs stock


def test_t5_encoder_model():
    stock, _ = build("t5_encoder")
    converted, report = convert_layers(stock, report=True)
    assert_t5_report(report, "gated-gelu", decoder=False)
    batch = {"input_ids": family_inputs("t5", "cpu")["input_ids"]}
    stock_loss, converted_loss = _EncoderLoss(stock), _EncoderLoss(converted)
    saving, report_saving = t5_saving("gated-gelu", decoder=False)
    assert step_saved_bytes(stock_loss, batch) - step_saved_bytes(converted_loss, batch) == saving
    assert report.saved_bytes_per_token() == report_saving
    assert_same_step(stock_loss, converted_loss, batch)


def test_t5_dropout_before_wo_runs_the_gated_ffn_stock_in_training():
    """dropout_rate (T5's default 0.1) applies between the gated product and wo: each training call of
    the FFN runs stock (the norm before it applied first), the same step with the same dropout masks;
    in eval the fused FFN runs. (One block a stack: the rules are those of the tests above.)"""
    stock, _ = build("t5", dropout_rate=0.1, num_layers=1)
    converted = convert_layers(stock)
    batch = family_inputs("t5", "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(_Seeded(stock), _Seeded(converted), batch)
    assert any("dropout (p=0.1) before wo in training" in str(w.message) for w in caught)
    stock.eval()
    converted.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no call runs stock in eval
        torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss)


def test_t5_wo_kept_in_fp32_leaves_the_ffn_stock():
    """T5's _keep_in_fp32_modules keeps wo in fp32 when the model loads in half precision: the stock
    forward casts the product to fp32 for wo (a to() the probe sees), which the fused gated MLP does
    not, so the FFN stays stock and the report says why. wo's fp32 output makes the residual stream
    fp32 from there on: the norms after the first FFN of each stack get fp32 input for bf16 weights,
    which the stock norm casts and remat's fused ops do not take, so they stay stock too (the first
    block's norms fuse: into q, k and v, into wi_0 and wi_1, into the cross-attention's q). The
    converted model computes the stock loss exactly."""
    stock, _ = build("t5")
    stock.to(torch.bfloat16)
    for block in (*stock.encoder.block, *stock.decoder.block):
        block.layer[-1].DenseReluDense.wo.float()
    converted, report = convert_layers(stock, report=True)
    kept = "its forward (wi_0, act, wi_1, mul, dropout, to, wo) is none of"
    rows = collections.Counter(row.path.rsplit(".", 1)[-1] for row in report.skipped if kept in row.reason)
    assert rows == {"DenseReluDense": 2 * LAYERS}, str(report)
    fp32_input = "its input is torch.float32, its weight torch.bfloat16"
    assert sum(fp32_input in row.reason for row in report.skipped) == (LAYERS - 1) * (2 + 3), str(report)
    assert swapped_counts(report)["RematT5DenseGatedActDense"] == 0
    assert swapped_counts(report)["RematNormedLinear"] == 2 * (3 + 2) + 1
    for block in converted.encoder.block:
        ff = block.layer[-1]
        assert type(ff.DenseReluDense) is transformers.models.t5.modeling_t5.T5DenseGatedActDense
        assert ff.DenseReluDense.wo.weight.dtype == torch.float32
    batch = family_inputs("t5", "cpu")
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss, rtol=0, atol=0)


def test_t5_self_attention_norm_stays_stock_without_recompute():
    """recompute=False: each of q, k and v would compute and keep the norm's output, three times what
    stock keeps once; the FFN and cross-attention norms (one consumer each) still fuse."""
    stock, _ = build("t5")
    with pytest.warns(conv.RematWarning, match="saves no activation memory"):  # recompute=False keeps as stock
        _, report = convert_layers(stock, recompute=False, report=True)
    reasons = [row.reason for row in report.skipped if row.path.endswith("layer.0.layer_norm")]
    assert len(reasons) == 2 * LAYERS and all("recompute=False: layer_norm feeds 3 modules" in r for r in reasons)
    assert swapped_counts(report)["RematFusedT5LayerNorm"] == 3 * LAYERS


@pytest.mark.parametrize("prefix", ["MT5", "UMT5"])
def test_t5_copies_convert_as_t5(prefix):
    """mT5 and UMT5 copy T5's modules under their own names: the same swaps (one block a stack), and the
    same loss."""
    config = getattr(transformers, f"{prefix}Config")(**build("t5", num_layers=1)[0].config.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).train()
    converted, report = convert_layers(stock, report=True)
    counts = swapped_counts(report)
    expected = {k.replace("T5", prefix, 1) if k != "RematNormedLinear" else k: v
                for k, v in t5_swaps("gated-gelu", layers=1).items()}
    assert {k: counts[k] for k in expected} == expected, str(report)
    batch = family_inputs("t5", "cpu")
    with torch.no_grad():
        torch.testing.assert_close(converted(**batch).loss, stock(**batch).loss)


# --- Mixtral -----------------------------------------------------------------------------------------


def mixtral_saving(device, layers=LAYERS):
    """(bytes the converted Mixtral keeps less in one fp32 training step, the report's bytes per token):
    input_layernorm's x̂ and y no longer kept (the report counts y), and the attention output copy the
    stock backend makes; the MoE block and the norm before it run stock."""
    per_layer = 2 * F32 * HIDDEN + attention_output_copy("mixtral", device)
    return layers * TOKENS * per_layer, layers * F32 * HIDDEN


def test_mixtral_fuses_the_attention_norm_and_says_why_the_moe_norm_stays_stock(target):
    """No rule: attention through the interface, input_layernorm fused into q, k and v by structure;
    without the "experts" rule the MoE block (experts as 3-D parameters, no Linear) stays stock, and so
    does the norm before it, which would fuse into its router and remat's experts only
    (tests/convert/hf/test_experts_interface.py)."""
    case = converted_case(target[0], "mixtral", use_cache=False)
    stock, converted, report, _, _ = case
    counts = swapped_counts(report)
    assert counts["RematNormedLinear"] == 3 * LAYERS and counts["RematFusedMixtralRMSNorm"] == LAYERS, str(report)
    assert converted.config._attn_implementation == "remat"
    # per layer post_attention_layernorm, and the final norm; the attention modules kept (their function remat's)
    assert_skipped_as_expected(report, {MOE_INPUT: LAYERS, "RMSNorm: no fusion": 1}, kept=LAYERS)
    stock_file = transformers.models.mixtral.modeling_mixtral
    for layer in converted.model.layers:
        assert type(layer.mlp) is stock_file.MixtralSparseMoeBlock
        assert type(layer.mlp.experts) is stock_file.MixtralExperts
        assert type(layer.post_attention_layernorm) is stock_file.MixtralRMSNorm
    assert_same_checkpoint(stock, converted)
    assert_saving_and_same_step(case, mixtral_saving(target[0]), attention_calls=LAYERS)


@pytest.mark.parametrize("name", ["t5", "mixtral"])
def test_save_pretrained_round_trip(tmp_path, name):
    stock, _ = build(name, use_cache=False)
    assert_save_pretrained_round_trip(stock, family_inputs(name, "cpu"), tmp_path)


# --- remat memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t5", "mixtral"])
def test_remat_memory_reads_the_config(tmp_path, name):
    """`remat memory --model config.json` builds T5Model (the same ids into its encoder and decoder) or
    MixtralModel and counts exactly the saving derived above (no LM head: it changes nothing here); one
    block a stack, as the policies each convert or copy the model."""
    stock, _ = build(name, **{"t5": {"num_layers": 1}, "mixtral": {"num_hidden_layers": 1}}[name])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stock.config.to_dict()))
    results = {r.policy: r for r in memory.run(str(path), batch=BATCH, seq=SEQ, out_dir=str(tmp_path),
                                               device="cpu", dtype=torch.float32)}
    saving, _ = t5_saving("gated-gelu", layers=1) if name == "t5" else mixtral_saving("cpu", layers=1)
    if name == "mixtral":  # remat memory converts all of it, the experts too (layer rules aside): their
        # bytes per token (docs/memory.md), less one int32, as remat.experts' offsets have E + 1 entries
        # where grouped_mm's have E
        n1, top_k = 2 * stock.config.intermediate_size, stock.config.num_experts_per_tok
        saving += TOKENS * (experts.grouped_mm_bytes_per_token(HIDDEN, n1, True, top_k, F32)
                            - experts.remat_bytes_per_token(n1, top_k, F32, False)) - 4
        # and the norm before them, fused into the router and the experts: its x̂ and output no longer kept
        saving += TOKENS * 2 * F32 * HIDDEN
    assert results["eager"].saved_bytes - results["remat"].saved_bytes == saving
