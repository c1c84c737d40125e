"""The conversion report says what was saved: bytes per token per swapped module and in total, the
modules remat recognises but does not convert (RMSNorm, gated MLPs, families without a rule) and
why, and a warning when the whole conversion saves nothing."""

import importlib
import warnings

import torch
from torch import nn

from hf_models import transformers

conv = importlib.import_module("remat.convert")


def converted_with_warnings(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = conv.convert(model, report=True)
    return report, [w for w in caught if issubclass(w.category, conv.RematWarning)]


def rows_of(report, kind):
    return [row for row in report if row.type == kind]


def test_fused_modules_say_what_they_save():
    """A LayerNormMLP over fp32 width 16 with ffn 64: the LayerNorm output (16·4) and the GELU
    output (64·4) per token; a LayerNorm swapped on its own saves nothing, and says so."""
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))
    report, warned = converted_with_warnings(model)
    (fused,) = rows_of(report, "LayerNorm")[:1]
    assert fused.action == "swapped to LayerNormMLP" and fused.saves() == 16 * 4 + 64 * 4
    lone = [row for row in report if row.action == "swapped to remat.nn.LayerNorm"]
    assert len(lone) == 1 and lone[0].saves() == 0
    assert report.saved_bytes_per_token() == 320 and not warned
    text = str(report)
    assert "saves B/token" in text and "320 activation bytes saved per token" in text


def test_frozen_weights_change_the_saving():
    """Freeze fc2 and the GELU output is no saving any more (stock keeps no input for a frozen Linear)."""
    model, report = conv.convert(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), report=True)
    assert report.saved_bytes_per_token() == 64 * 4
    model[0].fc2.weight.requires_grad_(False)
    assert report.saved_bytes_per_token() == 0


def test_rms_norm_and_gated_mlps_are_recognised():
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    report, warned = converted_with_warnings(nn.Sequential(nn.RMSNorm(8), Gated()))
    reasons = {row.type: row.reason for row in report.skipped}
    assert reasons["RMSNorm"].startswith("RMSNorm: no fusion with a Linear after it applies here")
    assert reasons["Gated"].startswith("gated MLP (act(gate) * up -> down): not fused outside the Hugging Face")
    assert len(warned) == 1 and "saves no activation memory" in str(warned[0].message)


def mbart():  # BART's pre-LN sibling under its own class names: no rule (BART's: convert/hf/test_hf_families.py)
    config = transformers.MBartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=32)
    return transformers.MBartForConditionalGeneration(config)


def test_a_hugging_face_family_without_a_rule_is_fused_by_structure():
    """mBART (pre-LN, no family rule): each layer's LayerNorms fused into the projections reading them,
    found by the structure probe, the report saying so; its attention modules are kept as they are,
    their attention function remat's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        model = mbart()
    report, warned = converted_with_warnings(model)
    fused = [row for row in rows_of(report, "LayerNorm") if row.action == "swapped to RematFusedLayerNorm"]
    # the encoder layer's 2, the decoder layer's 3 (the cross-attention's into its q_proj)
    assert len(fused) == 5 and all("fused into" in row.reason for row in fused), str(report)
    attention = rows_of(report, "MBartAttention")
    assert attention and all(row.action == "kept" and "its attention function remat's" in row.reason
                             for row in attention), str(report)
    assert report.saved_bytes_per_token() > 0 and not warned


def test_a_hugging_face_family_without_a_rule_on_the_meta_device_is_fused_by_structure_too():
    """On meta (no weights to run, as remat memory counts) the probe runs on meta tensors: the same
    fusions, reported the same way, as on the CPU."""
    reports = []
    for device in ("cpu", "meta"):
        with warnings.catch_warnings(), torch.device(device):
            warnings.simplefilter("ignore")
            model = mbart()
        reports.append(converted_with_warnings(model)[0])
    assert [(r.path, r.action) for r in reports[1]] == [(r.path, r.action) for r in reports[0]]
    assert reports[1].saved_bytes_per_token() == reports[0].saved_bytes_per_token() > 0
