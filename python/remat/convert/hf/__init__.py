"""Hugging Face transformers support for remat.convert (tested with transformers 5.24; the names it reads are
present in 5.17 too, or checked for, as GPT-J's older attention is).

One file per model family (gpt2, vit, deit, siglip, gpt_neox, phi, gptj, falcon, bert, distilbert,
bart, whisper, bloom, opt, clip; llama, mistral, qwen2, qwen3, phi3, gemma, gemma2, gemma3: RMSNorms
fused into the next projections, gated MLPs, rotary GQA attention) registers its classes, submodule names, layer wirings, attention
class, probe inputs and the configs `remat memory` builds (registry.Family); modules.py holds the
swapped classes they share, rules.py what convert does with each module.

remat.convert applies these rules, besides the generic ones (every other nn.LayerNorm becomes
remat.nn.LayerNorm), when the model is a transformers PreTrainedModel (a peft model is converted
through the transformers model it wraps). Class swaps only: no forward function of a transformers
class is patched; a swapped module is the stock instance with a remat subclass of its class, so
it holds the very submodules and parameters of the original (same state_dict keys, in the same
order) and isinstance checks still hold.

    family           swapped (class -> remat class)                  LayerNorms fused
    GPT-2            GPT2Attention -> RematGPT2Attention             ln_1 into c_attn
                     GPT2MLP -> RematGPT2MLP                         ln_2 into c_fc
    ViT, DeiT        ViT/DeiTAttention -> Remat...Attention          layernorm_before into q/k/v_proj
                     ViT/DeiTMLP -> Remat...MLP                      layernorm_after into fc1
    SigLIP (both     SiglipAttention -> RematSiglipAttention         layer_norm1 into q/k/v_proj
      towers)        SiglipMLP -> RematSiglipMLP                     layer_norm2 (the pooling head's
                                                                       layernorm) into fc1
    GPT-NeoX/Pythia  GPTNeoXAttention -> RematGPTNeoXAttention       input_layernorm into
                       (rotary embedding included)                     query_key_value
                     GPTNeoXMLP -> RematGPTNeoXMLP                   post_attention_layernorm into
                                                                       dense_h_to_4h
    Phi-1/2, GPT-J   Phi/GPTJAttention -> Remat...Attention          input_layernorm / ln_1 into both
                       (partial / interleaved rotary)                  q/k/v_proj and fc1 / fc_in
                     PhiMLP / GPTJMLP -> Remat...MLP                   (parallel attention and MLP)
    Falcon           FalconAttention -> RematFalconAttention         by config: input_layernorm into
                       (rotary; multi-query, grouped k/v as GQA)       both (parallel, one LayerNorm),
                     FalconMLP -> RematFalconMLP                       ln_attn and ln_mlp, or input_ and
                                                                       post_attention_layernorm
    BERT, RoBERTa    Bert/RobertaSelfAttention ->                    none: post-LN, the LayerNorm
                       RematBert/RobertaSelfAttention                  follows the residual add
                     Bert/RobertaIntermediate -> Remat...Intermediate (returns its input),
                     Bert/RobertaOutput -> Remat...Output (the FFN, fused)
    DistilBERT       DistilBertSelfAttention -> Remat..., FFN ->     none (post-LN)
                       RematFFN
    BART             BartAttention (self-attention) -> Remat...;     none (post-LN)
                     the layer's fc1, activation_fn -> RematFused...
                       (return their input), fc2 -> RematMLPLinear
                       (the whole MLP)
    Whisper          as BART                                         self_attn_layer_norm into q/k/v,
                                                                       final_layer_norm into fc1,
                                                                       encoder_attn_layer_norm into
                                                                       the stock cross-attention's q_proj
    BLOOM            BloomMLP -> RematBloomMLP (BloomGelu);          input_layernorm into the stock
                       BloomAttention stays stock (ALiBi)              attention's query_key_value,
                                                                       post_attention_layernorm into
                                                                       dense_h_to_4h
    OPT              OPTAttention -> RematOPTAttention; the ReLU     self_attn_layer_norm into q/k/v,
                       MLP stays stock                                 final_layer_norm into fc1
    CLIP             CLIPAttention -> RematCLIPAttention, CLIPMLP    layer_norm1 into q/k/v,
                       -> RematCLIPMLP (quick_gelu or a GELU)          layer_norm2 into fc1

Cross-attention (BART's and Whisper's encoder_attn) runs stock. A LayerNorm fused into a Linear
inside a module that stays stock (BLOOM's query_key_value, Whisper's cross-attention q_proj, OPT's
fc1 before its ReLU) makes that Linear a RematNormedLinear computing norm_linears. Config variants
whose LayerNorms feed more than the next projection stay stock with the reason: BLOOM's
apply_residual_connection_post_layernorm, OPT's do_layer_norm_before=False (post-LN).

Memory (docs/memory.md), per layer and token, in bytes of the activation dtype: the fused MLPs keep
the fc1 output, never the GELU output (ffn less); a fused pre-LN LayerNorm keeps its input x and
fp32 mean/rstd, never its output, because the projection(s) after it rebuild LN(x) for their
weight gradients (hidden less per LayerNorm, two per pre-LN layer; ViT's three q/k/v Linears read
one LayerNorm computed once). A LayerNorm feeding two modules (Phi's, GPT-J's and Falcon-7B's
parallel attention and MLP) is applied inside both fused ops: the same x is kept once, and fp32
mean/rstd by each (8 bytes per token more than one op would keep; remat has no fused
activation -> Linear op that would let one norm_linears call feed q/k/v and fc1 while still
dropping the GELU output). Falcon's new decoder architecture keeps each group's k and v once
(GQA) where the stock forward keeps them copied out to every head. Each saving holds only where
the weight whose gradient needs the tensor is trained (a frozen Linear keeps no input in stock
PyTorch either): the report computes them under the model's requires_grad at the time it is
printed. remat.attention keeps q, k, v,
the output and an fp32 log-sum-exp per row, as SDPA's flash and efficient kernels do, and lays its
output out as (batch, seq, heads, head_dim), so the out-projection keeps that same storage (stock
SDPA's output takes q's layout on some backends, CPU, and transformers' .contiguous() then copies
it: GPT-NeoX on CPU keeps hidden more in stock).

LoRA (peft). Projections wrapped by peft's LoRA layers (before or after convert) run inside the
fused ops: base + Σ B(A(x))·scale, in peft's order and dtypes, keeping only each adapter's rank-r
A(x) besides what the fused op keeps anyway; A's gradient gets the rebuilt input. Each LoRA layer
is checked once against its own forward. A LoRA variant (DoRA, ...), LoRA dropout in training,
or a wrapper remat does not know runs the module's own forward for that call.

Every fused path checks at each call that the modules it computes are still the plain ones fused
(exact classes, no hooks or parametrizations, plain tensors as weights); where one is not, that
call runs the modules' own forwards, with a RematFallbackWarning once per module and reason
(counts: ConversionReport.fallbacks()). The same holds for the calls the remat path does not
compute exactly; the attention classes run the stock forward (with the fused LayerNorm applied
first) when:

- config._attn_implementation is not "sdpa" or "eager" (flash_attention_* and flex_attention read
  packing information from the call);
- attention weights are requested (output_attentions by argument, by config, or by transformers'
  output collector for a model-level output_attentions=True call);
- dropout is in effect (training with an attention dropout above 0);
- a KV cache holds past keys, or is not a plain DynamicCache (an empty one, as in a prefill or in
  training with use_cache=True, stays on remat: its update() returns the new keys as given);
- the mask is neither none nor plain: a 4-D mask must be exactly all-visible or exactly causal
  (bool True = visible, or float with 0 = visible and -inf or the dtype's minimum = hidden); the
  check compares on the device (one synchronisation per layer) and only runs for materialised
  masks (eager, or padding); any padding makes the mask neither;
- an argument that changes the math has a value (cross-attention's encoder_hidden_states, a
  position bias, softcap, sliding windows, ...). The keyword arguments transformers passes through
  every layer (TransformersKwargs: num_items_in_batch from the Trainer, position_ids, cu_seq_lens,
  output_hidden_states, ...), which sdpa and eager attention ignore, stay on remat; is_causal is
  honoured as sdpa honours it;
- the input is not (batch, seq, hidden), or the arguments do not bind to the stock forward's
  signature (a deprecated name it renames).

Not swapped: cross-attention (GPT-2's crossattention, BertCrossAttention), head dims outside
remat's kernel head dims (remat.ops.attention.HEAD_DIMS), modules whose forward was replaced on
the instance, and classes without a rule (the report says "no remat rule").

LayerNorm fusion. A fused LayerNorm becomes RematFusedLayerNorm: still an nn.LayerNorm with its
own weight, bias and eps (same keys), whose forward returns its input while the module after it
applies it inside the fused op (a Handoff between the two, checked by both at every call: each
must still sit in its place in the layer without hooks; otherwise the LayerNorm computes itself
and the next module takes its output, as stock). Only exact nn.LayerNorms over the last dimension
with affine parameters (and a bias, for the MLP) are fused. A LayerNorm feeding several modules has
one Handoff with all of them; an MLP its layer holds itself (BART's and Whisper's fc1 ->
activation_fn -> fc2, called in turn by the layer's forward) is a Handoff too: fc1 and the
activation return their input and fc2 computes the MLP, unless the layer's activation_dropout is
in effect (training with p > 0), when all three compute themselves as stock.

GELU variants accepted: GELUActivation (erf), nn.GELU, GELUTanh/PytorchGELUTanh,
NewGELUActivation, FastGELUActivation and BLOOM's BloomGelu (the tanh approximation; FastGELU's
and BloomGelu's sqrt(2/pi) rounded to 0.7978845608 and 0.79788456, under 1e-8 relative, below
fp32's rounding; in bf16/fp16 the stock Python formulas round after every op, remat once, in fp32).
QuickGELUActivation (CLIP's quick_gelu, x·σ(1.702x)). Not: ReLU, clipped or other activations.
Dropout after fc2 (GPT-2, GPT-J) and after
the attention's out-projection is torch's nn.Dropout exactly as the original, so training with
those dropouts stays equivalent (same random stream). FalconLinear (x @ W.T, then + b) computes
as nn.Linear does (one rounding of the sum in bf16 where FalconLinear rounds twice).

Every rule is checked when it is applied: the original and the swapped modules run on one small
random input (eval mode, a private generator, no autograd) and must agree, the remat path must be
what ran, and a fused LayerNorm is checked by running the whole layer, which also proves its
output feeds nothing else. A mismatch (a transformers version whose forward differs) leaves the
modules alone and says so in the report. Models on the meta device are not probed.

remat.revert gives the stock classes back (same objects inside).
"""

import sys

from . import (  # noqa: F401,E501  (each registers its family)
    bart,
    bert,
    bloom,
    clip,
    deit,
    distilbert,
    falcon,
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_neox,
    gptj,
    llama,
    mistral,
    opt,
    phi,
    phi3,
    qwen2,
    qwen3,
    siglip,
    vit,
    whisper,
)
from .modules import Handoff, RematFusedLayerNorm
from .registry import FAMILIES, memory_input, memory_models
from .rules import convert_children

__all__ = ["FAMILIES", "Handoff", "RematFusedLayerNorm", "convert_children", "is_hf_model", "memory_input",
           "memory_models"]


def is_hf_model(model):
    """True when `model` is a transformers PreTrainedModel (transformers not imported: False)."""
    if sys.modules.get("transformers") is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)
