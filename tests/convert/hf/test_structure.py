"""Fusions found by structure (remat.convert.hf.structure): in the Hugging Face models no family rule
covers (Llama and its kin among them: tests/convert/hf/test_hf_rms_families.py), one probe call of the
model records which module outputs feed which modules and functions; a norm read only by projections
is fused into them, an MLP whose forward is fc1 -> act -> fc2 or a gated MLP becomes the fused MLP, a
BERT-like FFN split in two the fused pair. The same loss and gradients as stock, the exact bytes no
longer kept, and the reasons for what the dataflow refuses."""

import contextlib
import copy
import warnings

import pytest
import torch
import transformers
from test_hf_rms_families import build_case, expected_saving

import remat
from remat._guards import RematFallbackWarning
from remat.convert.hf import example_inputs
from remat.convert.hf.modules import _RematFusedNorm, _RematGatedMLP, _RematMLP, _RematNormedLinear, _RematOutput

from hf_models import (
    HIDDEN,
    LAYERS,
    VOCAB,
    OpCounter,
    assert_autocast_step_as_accurate_as_stock,
    assert_same_step,
    assert_tiny_step_as_stock,
    build,
    convert_layers,
    family_inputs,
    family_sweep_on_the_reference,
    loss_and_grads,
    step_saved_bytes,
    tiny_causal_lm,
    tiny_loss,
    tiny_model,
)
from numerics import saved_bytes

LAYER_FUSIONS = {"layernorm", "mlp"}


def _layers(model):
    """The model's stack of layers (its longest ModuleList): what a family's expectations count."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)


def _kinds(model):
    """{fusion kind: count} below `model`: fused norms, projections a norm is fused into, MLPs, split FFNs."""
    kinds = {"norm": _RematFusedNorm, "projection": _RematNormedLinear, "mlp": (_RematMLP, _RematGatedMLP),
             "ffn": _RematOutput}
    return {kind: sum(isinstance(m, cls) for m in model.modules()) for kind, cls in kinds.items()}


def _skipped(report, path_end):
    return [row.reason for row in report.skipped if row.path.endswith(path_end)]


def test_llama_layers_by_structure_keep_the_bytes_of_docs_memory():
    """Llama's layers without its attention: both norms of each layer fused (into q, k and v, into the
    gated MLP), the MLP fused, exactly the bytes docs/memory.md says these layers save, same step."""
    stock, ffn = build_case("llama")
    batch = family_inputs("llama", "cpu")
    converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    assert _kinds(converted) == {"norm": 2 * LAYERS, "projection": 3 * LAYERS, "mlp": LAYERS, "ffn": 0}, str(report)
    saving, report_saving = expected_saving("llama", ffn, "cpu", remat_attention=False)
    assert step_saved_bytes(stock, batch) - step_saved_bytes(converted, batch) == saving
    assert report.saved_bytes_per_token() == report_saving
    assert_same_step(stock, converted, batch)
    remat.revert(converted)
    assert _kinds(converted) == {"norm": 0, "projection": 0, "mlp": 0, "ffn": 0}
    assert_same_step(stock, converted, batch)


def test_the_projections_of_one_norm_run_as_one_fused_op():
    """q, k and v, each with input_layernorm fused in: the first one called computes all three in one
    fused op (the norm applied once) and hands the others theirs; a projection called on another
    tensor, or on the same one modified in place, computes its own."""
    stock, _ = build_case("llama")
    converted = convert_layers(stock, layers=LAYER_FUSIONS)
    batch = family_inputs("llama", "cpu")
    with OpCounter() as counter:
        loss_and_grads(converted, batch)
    assert counter.counts["remat::rms_norm_fwd"] == 2 * LAYERS  # once for q, k and v; once in the MLP
    assert_same_step(stock, converted, batch)
    fused, plain = converted.model.layers[0], stock.model.layers[0]
    with torch.no_grad():
        x = torch.randn(2, 3, HIDDEN)
        fused.self_attn.q_proj(x)  # leaves k's and v's outputs for x
        x.add_(1)  # (an RMSNorm is blind to a scale)
        torch.testing.assert_close(fused.self_attn.v_proj(x), plain.self_attn.v_proj(plain.input_layernorm(x)))
        fused.self_attn.q_proj(x)
        other = x.clone().add_(1)  # modified once too, as x: its identity tells them apart
        torch.testing.assert_close(fused.self_attn.k_proj(other),
                                   plain.self_attn.k_proj(plain.input_layernorm(other)))


def test_structural_fusions_under_bf16_autocast_with_the_default_cache():
    """fp32 weights under torch.autocast(bf16), use_cache left at its default (True): what the Trainer's
    bf16=True runs. The structural fusions stay within twice stock's error against float64."""
    stock, _ = build("llama")  # the config's default use_cache
    assert stock.config.use_cache
    converted = convert_layers(stock, layers=LAYER_FUSIONS)
    assert _kinds(converted) == {"norm": 2 * LAYERS, "projection": 3 * LAYERS, "mlp": LAYERS, "ffn": 0}
    assert_autocast_step_as_accurate_as_stock(stock, converted, family_inputs("llama", "cpu"))


@pytest.mark.parametrize("order", ["lora_then_convert", "convert_then_lora"])
def test_lora_on_structural_fusions(order):
    """peft LoRA on every projection, before or after conversion: the stock LoRA step. Before, every
    fusion takes the LoRA layers (q, k and v as RematNormedLoraLinear); after, the gated MLP takes them
    inside its fused op, and input_layernorm, whose q, k and v peft wrapped, runs stock and says so."""
    peft = pytest.importorskip("peft")
    stock, _ = build_case("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(copy.deepcopy(stock), config)
    if order == "lora_then_convert":
        model, report = convert_layers(peft.get_peft_model(copy.deepcopy(stock), config), report=True,
                                       layers=LAYER_FUSIONS)
        assert _kinds(model) == {"norm": 2 * LAYERS, "projection": 3 * LAYERS, "mlp": LAYERS, "ffn": 0}, str(report)
        expected_warning = contextlib.nullcontext()
    else:
        model = peft.get_peft_model(convert_layers(copy.deepcopy(stock), layers=LAYER_FUSIONS), config)
        expected_warning = pytest.warns(RematFallbackWarning, match="q_proj was wrapped by Linear after convert")
    model.load_state_dict(reference.state_dict())
    batch = family_inputs("llama", "cpu")
    loss, grads = loss_and_grads(reference, batch)
    with expected_warning:
        got_loss, got_grads = loss_and_grads(model, batch)
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    grads = {k: g for k, g in grads.items() if g is not None}
    assert len(grads) == 12 * LAYERS and {k for k, g in got_grads.items() if g is not None} == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(got_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


# --- What the dataflow refuses ---------------------------------------------------------------------


def test_an_mlp_whose_activation_reads_the_product_stays_stock(monkeypatch):
    """down(act(gate(x) * up(x))) is not a gated MLP: the probe sees the activation read the product."""
    stock, _ = build_case("llama")
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaMLP, "forward",
                        lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x) * self.up_proj(x))))
    converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    assert _kinds(converted)["mlp"] == 0
    assert all("none of fc1 -> act -> fc2" in r for r in _skipped(report, "post_attention_layernorm")), str(report)
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))


def test_a_norm_that_rounds_as_none_of_remat_s_stays_stock(monkeypatch):
    """An RMSNorm whose forward is not one of remat's styles bitwise (here: eps added after the root)."""
    stock, _ = build_case("llama")

    def forward(self, x):
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon))

    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", forward)
    converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    assert _kinds(converted)["norm"] == 0 and _kinds(converted)["mlp"] == LAYERS
    assert all("none of remat's RMSNorm styles" in r for r in _skipped(report, "input_layernorm")), str(report)
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))


def test_a_gated_rms_norm_is_no_rms_norm_and_says_why():
    """A gated RMSNorm (Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's: forward(x, gate)) has a 1-D weight and a
    float eps as an RMSNorm has, but its forward takes a gate: the style check says so, where it called
    norm(x) and raised before, and the hybrid model converts and trains as stock."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    from remat.convert.hf import structure

    assert structure.rms_style(Qwen3NextRMSNormGated(HIDDEN)) == (None, "its forward takes gate besides its input")
    torch.manual_seed(0)
    stock = tiny_causal_lm("Qwen3NextConfig")
    assert stock.config.layer_types == ["linear_attention", "full_attention"]
    ids = torch.randint(3, VOCAB, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    assert _skipped(report, "linear_attn.norm") == ["not fused into a projection: Qwen3NextRMSNormGated: its "
                                                    "forward takes gate besides its input"], str(report)
    assert _kinds(converted)["norm"] == LAYERS, str(report)  # each input_layernorm, into its layer's projections
    assert_tiny_step_as_stock(stock, converted, "causal", ids)


def test_an_mlp_calling_a_module_not_its_child_stays_stock(monkeypatch):
    """An MLP whose forward calls a module held elsewhere in the model (not its child) first: the probe
    names that call as such, the MLP and the norm before it stay stock with the reason (the probe
    raised on the unnamed call before)."""
    stock, _ = build_case("llama")
    stock.model.shared_tap = torch.nn.Identity()
    for layer in stock.model.layers:
        layer.mlp.__dict__["tap"] = stock.model.shared_tap  # a plain attribute: not a child of the MLP

    def forward(self, x):
        x = self.tap(x)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaMLP, "forward", forward)
    converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    assert _kinds(converted) == {"norm": LAYERS, "projection": 3 * LAYERS, "mlp": 0, "ffn": 0}, str(report)
    tap = "<Identity, not a child of LlamaMLP>"
    assert _skipped(report, "post_attention_layernorm") == [
        f"not fused into a projection: {tap} in LlamaMLP's forward reads it"] * LAYERS, str(report)
    assert f"not fused as an MLP: its input goes to {tap}, gate_proj, up_proj, not projections only" in \
        _skipped(report, "mlp"), str(report)
    assert_same_step(stock, converted, family_inputs("llama", "cpu"))


def test_a_norm_feeding_the_residual_stays_stock():
    """OLMo-2 normalises each block's output before the residual add: nothing to fuse those norms into."""
    stock, _ = tiny_model("Olmo2Config")
    _, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    reasons = _skipped(report, "post_attention_layernorm")
    assert len(reasons) == LAYERS and all("add() in Olmo2DecoderLayer's forward reads it" in r for r in reasons)


def test_a_layer_norm_without_weights_stays_stock():
    """A LayerNorm without affine parameters (elementwise_affine=False) is one remat's fused ops do
    not take: its row says why, and the converted model computes as stock."""
    stock, _ = build("gpt2")
    for block in stock.transformer.h:
        block.ln_1 = torch.nn.LayerNorm(block.ln_1.normalized_shape, elementwise_affine=False)
    converted, report = convert_layers(stock, report=True)
    reasons = _skipped(report, "ln_1")
    assert len(reasons) == LAYERS and all("elementwise_affine=False" in r for r in reasons), str(report)
    assert_same_step(stock, converted, family_inputs("gpt2", "cpu"))


@pytest.mark.parametrize("config_name", ["GraniteConfig", "Olmo2Config", "GPTBigCodeConfig", "ElectraConfig",
                                         "Dinov2Config"])
def test_a_model_on_the_meta_device_is_fused_as_on_the_cpu(config_name):
    """The probe runs on meta too (with the model's default cache: its mask building then reads no
    position ids), RMSNorm styles checked on a CPU copy: the same fusions and saved bytes as on the CPU,
    what `remat memory` and remat.plan count at any size."""
    kinds, saved = {}, {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            stock, _ = tiny_model(config_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
        kinds[device], saved[device] = _kinds(_layers(converted)), report.saved_bytes_per_token()
    assert kinds["meta"] == kinds["cpu"] and any(kinds["cpu"].values())
    assert saved["meta"] == saved["cpu"] > 0


@pytest.mark.parametrize("config_name, name, tokens", [
    ("LlamaConfig", "input_ids", 5), ("Dinov2Config", "pixel_values", 5), ("Wav2Vec2Config", "input_values", 5),
    ("WhisperConfig", "input_features", 8)])
def test_example_inputs_are_what_the_model_takes(config_name, name, tokens):
    """The probe's (and remat memory's) inputs, made from the config: token ids, images of the config's
    size (4 patches and [CLS]), audio that the convolutions turn into the asked-for frames, Whisper's
    log-mel frames of the one length its encoder takes (2 x max_source_positions); on meta too."""
    config = getattr(transformers, config_name)(
        **({"max_source_positions": 8, "num_mel_bins": 8} if config_name == "WhisperConfig" else {}))
    for device in ("cpu", "meta"):
        with torch.device(device):
            model, _ = tiny_model(config_name) if config_name != "WhisperConfig" else \
                (transformers.WhisperModel(config), None)
        inputs, reason = example_inputs(model, 2, 5, device, torch.float32)
        assert reason is None and name in inputs and all(x.device.type == device for x in inputs.values())
        if config_name == "WhisperConfig":
            assert inputs[name].shape == (2, 8, 16) and inputs["decoder_input_ids"].shape == (2, 5)
        with torch.no_grad():
            out = model.eval()(**inputs)
        first = {"WhisperConfig": "encoder_last_hidden_state", "LlamaConfig": "logits"}.get(config_name,
                                                                                          "last_hidden_state")
        assert getattr(out, first).shape[:2] == (2, tokens)


def test_a_model_whose_input_the_probe_cannot_make_says_why():
    """A main input the probe does not know how to make: no structural fusion, and the report says why."""
    stock, _ = tiny_model("Olmo2Config")
    stock.main_input_name = "inputs_embeds"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    layers = {f"model.layers.{i}" for i in range(LAYERS)}
    reasons = [row.reason for row in report.skipped if row.path in layers]
    assert len(reasons) == LAYERS and all("no probe of its structure: no probe input: its input inputs_embeds is "
                                          "none made from its config" in r for r in reasons), str(report)


def test_on_the_meta_device_a_llama_keeps_what_it_keeps_on_the_cpu():
    """Counted as remat memory counts (remat.planner.counting), a converted Llama (attention through the
    interface, norms and MLP by structure) keeps on meta exactly what it keeps on the CPU, less than stock."""
    from remat.planner.counting import count_forward

    kept = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            stock, _ = build("llama")
        ids = torch.zeros(2, 16, dtype=torch.long, device=device)
        converted = remat.convert(copy.deepcopy(stock))
        assert converted.config._attn_implementation == "remat"
        kept[device] = [count_forward(m, (), {"input_ids": ids, "labels": ids}).total_bytes()
                        for m in (stock, converted)]
    assert kept["meta"][1] == kept["cpu"][1] < kept["cpu"][0]


# --- Families remat has no rule for -----------------------------------------------------------------

# config -> the fusions found in each of its layers ({kind: count per layer}), or the reason none is:
# a norm fused into its projections (projection: how many), a norm into a fused MLP, a split FFN.
NORMS_AND_MLP = {"norm": 2, "projection": 3, "mlp": 1}
FURTHER_FAMILIES = {
    "GraniteConfig": NORMS_AND_MLP, "SmolLM3Config": NORMS_AND_MLP, "Glm4Config": NORMS_AND_MLP,
    "GlmConfig": NORMS_AND_MLP, "MinistralConfig": NORMS_AND_MLP, "HeliumConfig": NORMS_AND_MLP,
    "Ernie4_5Config": NORMS_AND_MLP, "StableLmConfig": NORMS_AND_MLP, "DogeConfig": NORMS_AND_MLP,
    "Qwen2MoeConfig": {"norm": 1, "projection": 3, "mlp": 1},  # the MoE's shared expert, its norm not fused
    "GPTBigCodeConfig": {"norm": 2, "projection": 1, "mlp": 1},  # c_attn: q, k and v in one projection
    "Olmo2Config": {"mlp": 1}, "OlmoConfig": {"mlp": 1}, "Exaone4Config": {"mlp": 1},  # post-norm blocks
    "CohereConfig": {"mlp": 1}, "Cohere2Config": {"mlp": 1},  # a LayerNorm without a bias remat fuses no RMSNorm
    "Qwen3MoeConfig": {"norm": 1, "projection": 3}, "OlmoeConfig": {"norm": 1, "projection": 3},  # MoE MLPs
    "GraniteMoeConfig": {"norm": 1, "projection": 3}, "GptOssConfig": {"norm": 1, "projection": 3},
    "ArceeConfig": {"norm": 1, "projection": 3},  # its MLP's ReLU² is none of remat's
    "PersimmonConfig": {"norm": 1, "projection": 1},  # its MLP's ReLU² is none of remat's
    "ModernBertConfig": {"norm": 2, "projection": 2},  # a dropout inside its gated MLP
    "ElectraConfig": {"ffn": 1}, "ErnieConfig": {"ffn": 1}, "XLMRobertaConfig": {"ffn": 1},
    "CamembertConfig": {"ffn": 1}, "Data2VecTextConfig": {"ffn": 1},
    "NemotronConfig": "ReLUSquaredActivation is not a GELU",
    "DebertaV2Config": "has no feed_forward_chunk",
}
# Image and audio models: the probe calls them on images (audio) of the size their config says.
FURTHER_FAMILIES.update({
    "Dinov2Config": NORMS_AND_MLP, "Dinov2WithRegistersConfig": NORMS_AND_MLP, "ViTMSNConfig": NORMS_AND_MLP,
    "IJepaConfig": NORMS_AND_MLP, "ViTMAEConfig": NORMS_AND_MLP, "SiglipVisionConfig": NORMS_AND_MLP,
    "CLIPVisionConfig": NORMS_AND_MLP, "ChineseCLIPVisionConfig": NORMS_AND_MLP,
    "BeitConfig": NORMS_AND_MLP,  # its attention stays sdpa (its relative position bias): the report says so
    # the attention's LayerNorm read inside its self-attention, not by its projections alone; the FFN's
    # output module has no LayerNorm to make the pair
    "Data2VecVisionConfig": {"norm": 1, "projection": 1}, "DPTConfig": {"norm": 1, "projection": 1},
    # post-LN layers whose FFN has a dropout module between its activation and output_dense
    "Wav2Vec2Config": "is none of fc1 -> act -> fc2", "UniSpeechConfig": "is none of fc1 -> act -> fc2",
})
# Fusions fewer than per layer × layers: ModernBERT's first layer has no attention norm (an Identity).
FEWER = {"ModernBertConfig": {"norm": 1, "projection": 1}}


@pytest.mark.parametrize("config_name", FURTHER_FAMILIES)
def test_a_family_without_rules_saves_bytes_or_says_why(config_name):
    """remat.convert's layer fusions on a tiny model of a family remat has no rule for: the fusions the
    dataflow allows in every layer, fewer bytes kept, the same loss and gradients; or the reason."""
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    stock, kind = tiny_model(config_name)
    ids = torch.randint(3, VOCAB, (2, 8))
    with family_sweep_on_the_reference():
        _check_family_without_rules(config_name, stock, kind, ids)


def _check_family_without_rules(config_name, stock, kind, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted, report = convert_layers(stock, report=True, layers=LAYER_FUSIONS)
    stock_bytes, converted_bytes = (saved_bytes(lambda m=m: tiny_loss(m, kind, ids), exclude=list(m.parameters()))
                                    for m in (stock, converted))
    expected = FURTHER_FAMILIES[config_name]
    if isinstance(expected, str):
        assert converted_bytes == stock_bytes
        assert any(expected in row.reason for row in report.skipped), str(report)
    else:
        kinds = _kinds(_layers(converted))  # not the LM head's (RoBERTa-like heads fuse their LayerNorm)
        layers = stock.config.num_hidden_layers
        fewer = FEWER.get(config_name, {})
        want = {k: n * layers - fewer.get(k, 0) for k, n in expected.items()}
        assert {k: n for k, n in kinds.items() if n} == want, str(report)
        assert converted_bytes < stock_bytes
    assert_tiny_step_as_stock(stock, converted, kind, ids)
