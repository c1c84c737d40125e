"""remat.convert on every causal-LM family of the installed transformers (its auto mapping,
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): a tiny random model of each (tiny_causal_lm) converts without
raising and trains as stock (fp32: the loss within 1e-5, every gradient within 1e-4). What remat
cannot take runs stock with its reason (warnings are fine); a crash inside convert is a bug.

A family whose tiny model does not build, or whose stock model does not run a training step, is
listed in DO_NOT_BUILD with why; its test asserts it still fails so, and fails as soon as it builds
(move it out of the list then). A family new to the mapping is tested as every other: it is in the
list only once someone looked at why it does not build."""

import warnings

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import remat
from remat._guards import fallback_counts
from remat.convert.hf.experts import experts_modules

from hf_models import (
    VOCAB,
    assert_tiny_step_as_stock,
    family_sweep_on_the_reference,
    tiny_causal_lm,
    tiny_loss,
    transformers,
)


def _families():
    """The model types of the mapping, one per config class: the config's own where the mapping has
    more (gpt-sw3 is GPT-2's config and model, tested as gpt2)."""
    by_config = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config_name = CONFIG_MAPPING_NAMES[model_type]
        if getattr(getattr(transformers, config_name), "model_type", None) == model_type:
            by_config[config_name] = model_type
        else:
            by_config.setdefault(config_name, model_type)
    return sorted(by_config.values())


FAMILIES = _families()

# A tiny model has a few hundred thousand parameters; a config with nested full-size parts (a vision
# or speech tower, an image tokenizer) the tiny fields do not reach builds far more, in minutes.
MAX_PARAMETERS = 6_000_000

# model type -> the start of the error its tiny model's build or stock training step raises.
_NOT_TINY = "ValueError: not tiny: "
DO_NOT_BUILD = {
    # nested full-size parts (vision or audio towers, image tokenizers, per-layer embeddings) or sizes the
    # tiny fields do not name
    **dict.fromkeys(["blt", "deepseek_v4", "deepseek_v32", "emu3", "gemma3", "gemma4", "gemma4_text", "gemma4_unified",
                     "gemma4_unified_assistant", "git", "glm_moe_dsa", "got_ocr2", "hy_v4", "inkling2_loop_text",
                     "inkling2_text", "llama4", "mllama", "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5",
                     "qwen3_5_moe", "roc_bert"], _NOT_TINY),
    # the config's own checks refuse the tiny fields
    "diffllama": "ValueError: DiffLlama requires `num_key_value_heads` to be even",
    **dict.fromkeys(["dots3_note", "dots3_note_text", "gemma4_assistant", "gpt_neo", "kolibri1_1", "mamba2"],
                    "StrictDataclassClassValidationError: Class validation error for validator"),
    **dict.fromkeys(["plbart", "whisper"], "ValueError: embed_dim must be divisible by num_heads"),  # 12, 6 heads
    **dict.fromkeys(["zamba", "zamba2"], "StrictDataclassClassValidationError: Class validation error for validator "
                    "'validate_layer_type'"),  # its block types listed for its full-size layer count
    "xlnet": "NotImplementedError: The model xlnet is one of the few models that has no sequence length limit",
    "prophetnet": "NotImplementedError: This model does not support the setting of `num_hidden_layers`",
    "falcon": "AttributeError: property 'head_dim' of 'FalconConfig' object has no setter",
    # configs of other shapes: fields the tiny ones leave unset, or nested configs
    **dict.fromkeys(["cohere_compass_text", "dory"], "KeyError: 'full_attention'"),  # rope per layer type
    "dbrx": "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "dots1": "TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'",
    "gemma3n_text": "ValueError: The set of layer types producing a cache is different",
    "lfm2_moe": "TypeError: 'NoneType' object is not subscriptable",
    "musicgen": "AttributeError: 'MusicgenConfig' object has no attribute 'dropout'",  # its decoder's config nested
    "musicgen_melody": "AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout'",
    **dict.fromkeys(["qwen4_exp", "qwen4_exp_text"], "TypeError: unsupported operand type(s) for //: 'NoneType'"),
    "reformer": "AssertionError: If you want to use `ReformerModelWithLMHead` make sure that `is_decoder=True`",
    # hybrids whose tiny config has no attention layer (their pattern derived from fields the tiny ones do
    # not set), which transformers' mask building needs
    "recurrent_gemma": "ValueError: `get_mask_sizes` can only be called on Attention layers",
    # mLSTM's state shaped for its full-size heads; X-MOD needs a language chosen before it runs
    "xlstm": "ValueError: matC_old has wrong shape",
    "xmod": "ValueError: Input language unknown",
    # needs a package remat does not depend on
    "gemma3n": "ImportError:  TimmWrapperModel requires the timm library",
}

# model type -> a bug outside the structure probe and its rules that makes remat.convert's model
# differ from stock or raise (the test shows it, and flips when it is fixed).
KNOWN_BUGS = {}


def build(model_type):
    """The tiny causal LM of `model_type`, checked on the meta device first to be tiny; raises what its
    build raises."""
    config_name = CONFIG_MAPPING_NAMES[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            parameters = sum(p.numel() for p in tiny_causal_lm(config_name).parameters())
        if parameters > MAX_PARAMETERS:
            raise ValueError(f"not tiny: {parameters} parameters from its tiny config")
        torch.manual_seed(0)
        return tiny_causal_lm(config_name)


# The slowest families here (8 to 22 s a test on a loaded 2-core CPU, where most take 2 to 5 s; the whole
# file 9 minutes there on one worker): their state-space or linear-attention scans run transformers'
# PyTorch reference implementations.
SLOW = {"bamba": "Mamba-2 reference scan", "falcon_h1": "Mamba-2 reference scan",
        "granitemoehybrid": "Mamba-2 reference scan", "jamba": "Mamba reference scan",
        "kimi_linear": "KDA linear-attention reference", "bailing_hybrid": "linear-attention reference"}


def _case(model_type):
    marks = [pytest.mark.slow] if model_type in SLOW else []
    if model_type in KNOWN_BUGS:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[model_type]))
    return pytest.param(model_type, marks=marks, id=model_type)


@pytest.mark.parametrize("model_type", [_case(t) for t in FAMILIES])
def test_converts_and_trains_as_stock(model_type):
    """The tiny model of the family converts and trains as stock; or, for a family listed in
    DO_NOT_BUILD, its tiny model still fails to build or to run stock, for the reason listed."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    if model_type in DO_NOT_BUILD:
        with pytest.raises(Exception) as failure:  # noqa: PT011 - transformers raises many kinds
            tiny_loss(build(model_type), "causal", ids)
        said = " ".join(f"{failure.type.__name__}: {failure.value}".split())  # transformers' may span lines
        assert said.startswith(" ".join(DO_NOT_BUILD[model_type].split())), said
        return
    stock = build(model_type)
    with family_sweep_on_the_reference():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallbacks with their reasons are fine
            converted = remat.convert(stock)
        counter = assert_tiny_step_as_stock(stock, converted, "causal", ids)
    experts = experts_modules(converted)  # a mixture of experts' experts all run remat.experts
    assert counter.counts["remat::experts_fwd"] == len(experts)
    assert not [path for path in fallback_counts(converted) if path.endswith(".experts")]



def test_the_lists_name_families_of_the_mapping():
    """DO_NOT_BUILD and KNOWN_BUGS name model types of the installed transformers' mapping only."""
    assert not (set(DO_NOT_BUILD) | set(KNOWN_BUGS)) - set(FAMILIES), transformers.__version__
    assert not set(DO_NOT_BUILD) & set(KNOWN_BUGS)
    assert not set(SLOW) - set(FAMILIES)
