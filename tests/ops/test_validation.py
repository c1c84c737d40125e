"""Argument handling of every public function and module, rule by rule.

Two tables:
- BAD_INPUT: (call, exception type, argument, pattern). Each bad input must raise that exception,
  naming the argument, with a message matching the pattern (what was expected and what came).
- SUBJECTS: every public function and module with its PyTorch counterpart (each op family's
  public function as its declaration in remat.ops.FAMILIES calls it). Legal input must
  behave as PyTorch's own layers: every requires_grad combination, no-grad modes, non-unit
  strides, NaN, empty batches, autocast dtypes, and meta / fake tensors (torch.compile traces
  with fake tensors, so no validation may read data).
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

import remat
from remat.ops import registered_calls
from remat.ops.attention import multihead_self_attention

from numerics import REL_TOL, assert_raises_naming, rel_error

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="a CUDA input needs a GPU")


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


# =============================================================================================
# Bad input: a clear error naming the argument
# =============================================================================================


def case(function, rule, call, error, argument, pattern, marks=()):
    return pytest.param(call, error, argument, pattern, marks=marks, id=f"{function}-{rule}")


def mlp_args(**overrides):
    """Arguments of remat.mlp for x (3, 8), hidden 16, with some replaced."""
    args = {"x": rand(3, 8), "w1": rand(16, 8), "b1": rand(16), "w2": rand(8, 16), "b2": rand(8)}
    args.update(overrides)
    return args


def lnl_args(**overrides):
    """Arguments of remat.layer_norm_linear for x (3, 8) and 4 outputs, with some replaced."""
    args = {"x": rand(3, 8), "norm_weight": rand(8), "norm_bias": rand(8), "weight": rand(4, 8), "bias": rand(4)}
    args.update(overrides)
    return args


def qkv(q=(1, 4, 8, 32), k=(1, 2, 8, 32), v=None, **kwargs):
    """remat.attention on fresh q, k, v of the given shapes (v defaults to k's shape)."""
    return remat.attention(rand(*q), rand(*k), rand(*(v or k)), **kwargs)


def varlen(q=(9, 4, 32), k=(9, 2, 32), cu_seqlens_q=(0, 4, 9), cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=5,
           **kwargs):
    """remat.attention_varlen on fresh packed q, k, v (v of k's shape) and int32 cu_seqlens given as tuples."""
    cu_q = torch.tensor(cu_seqlens_q, dtype=torch.int32) if isinstance(cu_seqlens_q, tuple) else cu_seqlens_q
    cu_k = cu_q if cu_seqlens_k is None else torch.tensor(cu_seqlens_k, dtype=torch.int32)
    return remat.attention_varlen(rand(*q), rand(*k), rand(*k), cu_q, cu_k, max_seqlen_q, max_seqlen_k, **kwargs)


MHA = remat.nn.MultiheadSelfAttention(64, 2)


def mha_function(x):
    return multihead_self_attention(x, MHA.in_proj_weight, MHA.in_proj_bias, MHA.out_proj.weight,
                                    MHA.out_proj.bias, 2, 2)


LAYER_NORM_ERRORS = [
    case("layer_norm", "x-not-a-tensor", lambda: remat.layer_norm(rand(3, 8).tolist(), (8,)),
         TypeError, "x", r"x must be a torch\.Tensor, got list"),
    case("layer_norm", "x-int", lambda: remat.layer_norm(rand(3, 8).long(), (8,)),
         TypeError, "x", r"x must have dtype float32, float16, bfloat16, float64, got torch\.int64"),
    case("layer_norm", "x-complex", lambda: remat.layer_norm(rand(3, 8).to(torch.complex64), (8,)),
         TypeError, "x", r"x must have dtype .*got torch\.complex64"),
    case("layer_norm", "weight-int", lambda: remat.layer_norm(rand(3, 8), (8,), rand(8).int()),
         TypeError, "weight", r"weight must have dtype .*got torch\.int32"),
    case("layer_norm", "weight-bf16-with-fp16-x",
         lambda: remat.layer_norm(rand(3, 8, dtype=torch.float16), (8,), rand(8, dtype=torch.bfloat16)),
         TypeError, "weight", r"weight must have dtype float16, float32 \(x is float16\), got torch\.bfloat16"),
    case("layer_norm", "bias-fp16-with-fp32-x",
         lambda: remat.layer_norm(rand(3, 8), (8,), None, rand(8, dtype=torch.float16)),
         TypeError, "bias", r"bias must have dtype float32 \(x is float32\), got torch\.float16"),
    case("layer_norm", "weight-width", lambda: remat.layer_norm(rand(3, 8), (8,), rand(5)),
         ValueError, "weight", r"weight must have shape \(8,\), got \(5,\)"),
    case("layer_norm", "bias-shape", lambda: remat.layer_norm(rand(3, 8), (8,), rand(8), rand(1, 8)),
         ValueError, "bias", r"bias must have shape \(8,\), got \(1, 8\)"),
    case("layer_norm", "weight-on-other-device", lambda: remat.layer_norm(rand(3, 8), (8,), rand(8, device="meta")),
         ValueError, "weight", r"weight is on meta but x is on cpu"),
    case("layer_norm", "x-on-other-device", lambda: remat.layer_norm(rand(3, 8, device="meta"), (8,), rand(8)),
         ValueError, "weight", r"weight is on cpu but x is on meta"),
    case("layer_norm", "normalized-shape", lambda: remat.layer_norm(rand(3, 8), (7,)),
         ValueError, "normalized_shape", r"normalized_shape \(7,\) does not match the trailing dims of x"),
    case("layer_norm", "eps-negative", lambda: remat.layer_norm(rand(3, 8), (8,), eps=-1e-5),
         ValueError, "eps", r"eps must be a non-negative float, got -1e-05"),
    case("layer_norm", "eps-nan", lambda: remat.layer_norm(rand(3, 8), (8,), eps=float("nan")),
         ValueError, "eps", r"eps must be a non-negative float, got nan"),
    case("nn.LayerNorm", "x-width", lambda: remat.nn.LayerNorm(8)(rand(3, 7)),
         ValueError, "x", r"normalized_shape \(8,\) does not match the trailing dims of x \(shape \(3, 7\)\)"),
    case("nn.LayerNorm", "x-int", lambda: remat.nn.LayerNorm(8)(rand(3, 8).long()),
         TypeError, "x", r"x must have dtype"),
    case("nn.LayerNorm", "fp16-module-fp32-x", lambda: remat.nn.LayerNorm(8, dtype=torch.float16)(rand(3, 8)),
         TypeError, "weight", r"weight must have dtype float32 \(x is float32\), got torch\.float16"),
]

GELU_ERRORS = [
    case("gelu", "x-not-a-tensor", lambda: remat.gelu(3.0), TypeError, "x", r"x must be a torch\.Tensor, got float"),
    case("gelu", "x-int", lambda: remat.gelu(rand(3, 8).int()), TypeError, "x", r"x must have dtype .*int32"),
    case("gelu", "x-complex", lambda: remat.gelu(rand(3, 8).to(torch.complex64)), TypeError, "x",
         r"x must have dtype .*complex64"),
    case("gelu", "approximate", lambda: remat.gelu(rand(3, 8), "fast"),
         ValueError, "approximate", r"approximate must be one of \('none', 'tanh', 'quick'\), got 'fast'"),
    case("gelu", "bias-shape", lambda: remat.gelu(rand(3, 8), "none", rand(3)),
         ValueError, "bias", r"bias must have shape \(8,\), got \(3,\)"),
    case("gelu", "bias-2d", lambda: remat.gelu(rand(3, 8), "none", rand(3, 8)),
         ValueError, "bias", r"bias must have shape \(8,\), got \(3, 8\)"),
    case("gelu", "bias-int", lambda: remat.gelu(rand(3, 8), "none", rand(8).long()),
         TypeError, "bias", r"bias must have dtype .*int64"),
    case("gelu", "bias-bf16-with-fp16-x",
         lambda: remat.gelu(rand(3, 8, dtype=torch.float16), "none", rand(8, dtype=torch.bfloat16)),
         TypeError, "bias", r"bias must have dtype float16, float32 \(x is float16\), got torch\.bfloat16"),
    case("gelu", "bias-on-other-device", lambda: remat.gelu(rand(3, 8), "none", rand(8, device="meta")),
         ValueError, "bias", r"bias is on meta but x is on cpu"),
    case("nn.GELU", "x-int", lambda: remat.nn.GELU()(rand(3, 8).long()), TypeError, "x", r"x must have dtype"),
]

LAYER_NORM_LINEAR_ERRORS = [
    case("layer_norm_linear", "x-int", lambda: remat.layer_norm_linear(**lnl_args(x=rand(3, 8).long())),
         TypeError, "x", r"x must have dtype .*int64"),
    case("layer_norm_linear", "x-0-dim", lambda: remat.layer_norm_linear(**lnl_args(x=rand(()))),
         ValueError, "x", r"x must have at least one dimension"),
    case("layer_norm_linear", "norm_weight-width", lambda: remat.layer_norm_linear(**lnl_args(norm_weight=rand(7))),
         ValueError, "norm_weight", r"norm_weight must have shape \(8,\), got \(7,\)"),
    case("layer_norm_linear", "norm_bias-int", lambda: remat.layer_norm_linear(**lnl_args(norm_bias=rand(8).int())),
         TypeError, "norm_bias", r"norm_bias must have dtype .*int32"),
    case("layer_norm_linear", "norm_weight-fp16-with-fp32-x",
         lambda: remat.layer_norm_linear(**lnl_args(norm_weight=rand(8, dtype=torch.float16))),
         TypeError, "norm_weight", r"norm_weight must have dtype float32 \(x is float32\), got torch\.float16"),
    case("layer_norm_linear", "norm_weight-on-other-device",
         lambda: remat.layer_norm_linear(**lnl_args(norm_weight=rand(8, device="meta"))),
         ValueError, "norm_weight", r"norm_weight is on meta but x is on cpu"),
    case("layer_norm_linear", "weight-1d", lambda: remat.layer_norm_linear(**lnl_args(weight=rand(8))),
         ValueError, "weight", r"weight must have shape \(out_features, 8\), got \(8,\)"),
    case("layer_norm_linear", "weight-width", lambda: remat.layer_norm_linear(**lnl_args(weight=rand(4, 9))),
         ValueError, "weight", r"weight must have shape \(out_features, 8\), got \(4, 9\)"),
    case("layer_norm_linear", "weight-dtype",
         lambda: remat.layer_norm_linear(**lnl_args(weight=rand(4, 8, dtype=torch.bfloat16))),
         TypeError, "weight", r"weight has dtype torch\.bfloat16 but x has torch\.float32"),
    case("layer_norm_linear", "weight-on-other-device",
         lambda: remat.layer_norm_linear(**lnl_args(weight=rand(4, 8, device="meta"))),
         ValueError, "weight", r"weight is on meta but x is on cpu"),
    case("layer_norm_linear", "bias-shape", lambda: remat.layer_norm_linear(**lnl_args(bias=rand(8))),
         ValueError, "bias", r"bias must have shape \(4,\), got \(8,\)"),
    case("layer_norm_linear", "bias-fp16-with-fp32-weight",
         lambda: remat.layer_norm_linear(**lnl_args(bias=rand(4, dtype=torch.float16))),
         TypeError, "bias", r"bias must have dtype float32 \(x is float32\), got torch\.float16"),
    case("layer_norm_linear", "bias-fp32-with-fp16-weight",
         lambda: remat.layer_norm_linear(**lnl_args(x=rand(3, 8, dtype=torch.float16),
                                                    weight=rand(4, 8, dtype=torch.float16))),
         TypeError, "bias", r"bias has dtype torch\.float32 but weight has torch\.float16"),
    case("layer_norm_linear", "eps-negative", lambda: remat.layer_norm_linear(**lnl_args(), eps=-1.0),
         ValueError, "eps", r"eps must be a non-negative float, got -1\.0"),
    case("nn.LayerNormLinear", "x-width", lambda: remat.nn.LayerNormLinear(8, 4)(rand(2, 7)),
         ValueError, "x", r"x must have 8 features in its last dimension \(the in_features of LayerNormLinear\), "
                          r"got shape \(2, 7\)"),
    case("nn.LayerNormLinear", "recompute", lambda: remat.nn.LayerNormLinear(8, 4, recompute=1),
         TypeError, "recompute", r"recompute must be True or False, got 1"),
]

MLP_ERRORS = [
    case("mlp", "x-not-a-tensor", lambda: remat.mlp(**mlp_args(x=[1.0] * 8)),
         TypeError, "x", r"x must be a torch\.Tensor, got list"),
    case("mlp", "x-complex", lambda: remat.mlp(**mlp_args(x=rand(3, 8).to(torch.complex64))),
         TypeError, "x", r"x must have dtype .*complex64"),
    case("mlp", "w1-width", lambda: remat.mlp(**mlp_args(w1=rand(16, 9))),
         ValueError, "w1", r"w1 must have shape \(out_features, 8\), got \(16, 9\)"),
    case("mlp", "w2-width", lambda: remat.mlp(**mlp_args(w2=rand(8, 15))),
         ValueError, "w2", r"w2 must have shape \(out_features, 16\), got \(8, 15\)"),
    case("mlp", "w1-dtype", lambda: remat.mlp(**mlp_args(w1=rand(16, 8, dtype=torch.float16))),
         TypeError, "w1", r"w1 has dtype torch\.float16 but x has torch\.float32"),
    case("mlp", "w2-on-other-device", lambda: remat.mlp(**mlp_args(w2=rand(8, 16, device="meta"))),
         ValueError, "w2", r"w2 is on meta but x is on cpu"),
    case("mlp", "b1-shape", lambda: remat.mlp(**mlp_args(b1=rand(8))),
         ValueError, "b1", r"b1 must have shape \(16,\), got \(8,\)"),
    case("mlp", "b1-fp16-with-fp32-x", lambda: remat.mlp(**mlp_args(b1=rand(16, dtype=torch.float16))),
         TypeError, "b1", r"b1 must have dtype float32 \(x is float32\), got torch\.float16"),
    case("mlp", "b2-bf16-with-fp32-x", lambda: remat.mlp(**mlp_args(b2=rand(8, dtype=torch.bfloat16))),
         TypeError, "b2", r"b2 must have dtype float32 \(x is float32\), got torch\.bfloat16"),
    case("mlp", "b2-on-other-device", lambda: remat.mlp(**mlp_args(b2=rand(8, device="meta"))),
         ValueError, "b2", r"b2 is on meta but x is on cpu"),
    case("mlp", "approximate", lambda: remat.mlp(**mlp_args(), approximate="exact"),
         ValueError, "approximate", r"approximate must be one of"),
    case("mlp", "norm-params-without-layer-norm", lambda: remat.mlp(**mlp_args(), norm_weight=rand(8)),
         ValueError, "norm_weight", r"norm_weight and norm_bias need layer_norm=True"),
    case("mlp", "norm_bias-shape", lambda: remat.mlp(**mlp_args(), norm_bias=rand(16), layer_norm=True),
         ValueError, "norm_bias", r"norm_bias must have shape \(8,\), got \(16,\)"),
    case("mlp", "eps-negative", lambda: remat.mlp(**mlp_args(), eps=-0.5, layer_norm=True),
         ValueError, "eps", r"eps must be a non-negative float, got -0\.5"),
    case("nn.MLP", "x-width", lambda: remat.nn.MLP(8, 16)(rand(2, 9)),
         ValueError, "x",
         r"x must have 8 features in its last dimension \(the in_features of MLP\), got shape \(2, 9\)"),
    case("nn.MLP", "activation", lambda: remat.nn.MLP(8, 16, activation="relu"),
         ValueError, "activation", r"activation must be one of \('gelu', 'gelu_tanh', 'gelu_quick'\), got 'relu'"),
    case("nn.LayerNormMLP", "x-width", lambda: remat.nn.LayerNormMLP(8, 16)(rand(2, 9)),
         ValueError, "x", r"x must have 8 features .* \(the in_features of LayerNormMLP\), got shape \(2, 9\)"),
    case("nn.LayerNormMLP", "x-dtype", lambda: remat.nn.LayerNormMLP(8, 16)(rand(2, 8, dtype=torch.bfloat16)),
         TypeError, "w1", r"w1 has dtype torch\.float32 but x has torch\.bfloat16"),
]

ATTENTION_ERRORS = [
    case("attention", "q-not-a-tensor", lambda: remat.attention(rand(1, 4, 8, 32).tolist(), rand(1, 2, 8, 32),
                                                                rand(1, 2, 8, 32)),
         TypeError, "q", r"q must be a torch\.Tensor"),
    case("attention", "q-int", lambda: remat.attention(rand(1, 2, 8, 32).long(), rand(1, 2, 8, 32).long(),
                                                       rand(1, 2, 8, 32).long()),
         TypeError, "q", r"q must have dtype .*int64"),
    case("attention", "v-int", lambda: remat.attention(rand(1, 2, 8, 32), rand(1, 2, 8, 32), rand(1, 2, 8, 32).long()),
         TypeError, "v", r"v must have dtype .*int64"),
    case("attention", "k-dtype-mismatch", lambda: remat.attention(rand(1, 2, 8, 32), rand(1, 2, 8, 32).half(),
                                                                  rand(1, 2, 8, 32)),
         TypeError, "k", r"k must have q's dtype torch\.float32, got torch\.float16"),
    case("attention", "q-3d", lambda: qkv(q=(4, 8, 32)),
         ValueError, "q", r"q must be 4-D \(batch, heads, seq, head_dim\), got shape \(4, 8, 32\)"),
    case("attention", "k-3d", lambda: qkv(k=(2, 8, 32)), ValueError, "k", r"k must be 4-D"),
    case("attention", "head-dim-mismatch", lambda: qkv(k=(1, 2, 8, 16)),
         ValueError, "k", r"k must have shape \(1, kv_heads, seqlen_k, 32\)"),
    case("attention", "batch-mismatch", lambda: qkv(k=(2, 2, 8, 32)),
         ValueError, "k", r"k must have shape \(1, kv_heads, seqlen_k, 32\)"),
    case("attention", "kv-seq-mismatch", lambda: qkv(v=(1, 2, 7, 32)),
         ValueError, "v", r"v must have k's shape \(1, 2, 8, 32\), got \(1, 2, 7, 32\)"),
    case("attention", "kv-heads-not-dividing", lambda: qkv(k=(1, 3, 8, 32)),
         ValueError, "k", r"k and v must have a number of heads dividing q's 4, got 3"),
    case("attention", "k-on-other-device", lambda: remat.attention(rand(1, 2, 8, 32), rand(1, 2, 8, 32, device="meta"),
                                                                   rand(1, 2, 8, 32)),
         ValueError, "k", r"k is on meta but q is on cpu"),
    case("attention", "causal", lambda: qkv(causal=1), TypeError, "causal", r"causal must be True or False, got 1"),
    case("attention", "softmax_scale-inf", lambda: qkv(softmax_scale=float("inf")),
         ValueError, "softmax_scale", r"softmax_scale must be a finite float or None, got inf"),
    case("attention", "softmax_scale-tensor", lambda: qkv(softmax_scale=torch.tensor(0.1)),
         ValueError, "softmax_scale", r"softmax_scale must be a finite float or None"),
    case("attention", "return_lse", lambda: qkv(return_lse="yes"),
         TypeError, "return_lse", r"return_lse must be True or False"),
    case("attention", "attn_mask", lambda: qkv(attn_mask=torch.ones(8, 8, dtype=torch.bool)),
         ValueError, "attn_mask", r"attn_mask must be None: remat\.attention masks causally \(causal=True\) or by a "
                                  r"sliding window \(window_size\) only; for other masks call "
                                  r"torch\.nn\.functional\.scaled_dot_product_attention"),
    case("attention_varlen", "q-4d", lambda: varlen(q=(1, 9, 4, 32)),
         ValueError, "q", r"q must be 3-D \(total_tokens, heads, head_dim\), got shape \(1, 9, 4, 32\)"),
    case("attention_varlen", "kv-heads-not-dividing", lambda: varlen(k=(9, 3, 32)),
         ValueError, "k", r"k and v must have a number of heads dividing q's 4, got 3"),
    case("attention_varlen", "cu_seqlens-int64", lambda: varlen(cu_seqlens_q=torch.tensor([0, 4, 9])),
         TypeError, "cu_seqlens_q", r"cu_seqlens_q must have dtype torch\.int32 .*got torch\.int64"),
    case("attention_varlen", "cu_seqlens-2d", lambda: varlen(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32)),
         ValueError, "cu_seqlens_q", r"cu_seqlens_q must be 1-D"),
    case("attention_varlen", "cu_seqlens-lengths-differ", lambda: varlen(cu_seqlens_k=(0, 9)),
         ValueError, "cu_seqlens_k", r"cu_seqlens_k must have cu_seqlens_q's shape \(3,\)"),
    case("attention_varlen", "cu_seqlens-past-the-rows", lambda: varlen(cu_seqlens_q=(0, 4, 10), max_seqlen_q=6),
         ValueError, "cu_seqlens_q", r"cu_seqlens_q must start at 0, never decrease and end at 9 .*got \[0, 4, 10\]"),
    case("attention_varlen", "cu_seqlens-decreasing", lambda: varlen(cu_seqlens_q=(0, 5, 4, 9)),
         ValueError, "cu_seqlens_q", r"cu_seqlens_q must start at 0, never decrease"),
    case("attention_varlen", "max_seqlen-too-small", lambda: varlen(max_seqlen_k=4),
         ValueError, "max_seqlen_k", r"max_seqlen_k must be at least the longest sequence of cu_seqlens_k, 5, got 4"),
    case("attention_varlen", "max_seqlen-float", lambda: varlen(max_seqlen_q=5.0),
         ValueError, "max_seqlen_q", r"max_seqlen_q must be an int >= 0"),
    case("attention_varlen", "alibi-per-batch-of-wrong-count",
         lambda: varlen(alibi_slopes=torch.rand(3, 4)),
         ValueError, "alibi_slopes", r"alibi_slopes must have shape \(4,\) or \(2, 4\) \(heads, or sequences"),
    case("nn.MultiheadSelfAttention", "x-2d", lambda: MHA(rand(8, 64)),
         ValueError, "x", r"x must have shape \(batch, seq, embed_dim\) with embed_dim 64, got \(8, 64\)"),
    case("nn.MultiheadSelfAttention", "x-width", lambda: MHA(rand(1, 8, 32)),
         ValueError, "x", r"x must have shape .* with embed_dim 64, got \(1, 8, 32\)"),
    case("nn.MultiheadSelfAttention", "x-seq-first-width",
         lambda: remat.nn.MultiheadSelfAttention(64, 2, batch_first=False)(rand(8, 1, 32)),
         ValueError, "x", r"x must have shape \(seq, batch, embed_dim\) with embed_dim 64"),
    case("nn.MultiheadSelfAttention", "x-int", lambda: MHA(rand(1, 8, 64).long()),
         TypeError, "x", r"x must have dtype .*int64"),
    case("nn.MultiheadSelfAttention", "x-dtype", lambda: MHA(rand(1, 8, 64, dtype=torch.float16)),
         TypeError, "x", r"x has dtype torch\.float16 but in_proj_weight has torch\.float32"),
    case("nn.MultiheadSelfAttention", "x-on-other-device", lambda: MHA(rand(1, 8, 64, device="meta")),
         ValueError, "x", r"x is on meta but in_proj_weight is on cpu"),
    case("nn.MultiheadSelfAttention", "key", lambda: MHA(rand(1, 8, 64), rand(1, 8, 64)),
         ValueError, "key", r"key and value must be None or the query"),
    case("nn.MultiheadSelfAttention", "need_weights", lambda: MHA(rand(1, 8, 64), need_weights=True),
         ValueError, "need_weights", r"need_weights must be False"),
    case("nn.MultiheadSelfAttention", "dropout", lambda: remat.nn.MultiheadSelfAttention(64, 4, dropout=1.0),
         ValueError, "dropout", r"dropout must be a float in \[0, 1\), got 1\.0"),
    case("nn.MultiheadSelfAttention", "num_kv_heads", lambda: remat.nn.MultiheadSelfAttention(64, 4, num_kv_heads=3),
         ValueError, "num_kv_heads", r"num_kv_heads must be >= 1 and divide num_heads 4, got 3"),
]

# The function behind nn.MultiheadSelfAttention checks x itself too (convert's attention calls it).
MHA_FUNCTION_ERRORS = [
    case("multihead_self_attention", "x-2d", lambda: mha_function(rand(8, 64)),
         ValueError, "x", r"x must have shape \(batch, seq, embed_dim\)"),
    case("multihead_self_attention", "x-width", lambda: mha_function(rand(1, 8, 32)),
         ValueError, "x", r"x must have shape .* with embed_dim 64"),
    case("multihead_self_attention", "x-int", lambda: mha_function(rand(1, 8, 64).long()),
         TypeError, "x", r"x must have dtype"),
]


def _cuda(*shape):
    return rand(*shape, device="cuda")


# A CUDA input with a parameter left on the CPU: caught before any kernel launch.
GPU_ERRORS = [
    case("layer_norm", "cpu-weight-cuda-x", lambda: remat.layer_norm(_cuda(3, 8), (8,), rand(8)),
         ValueError, "weight", r"weight is on cpu but x is on cuda", marks=needs_gpu),
    case("gelu", "cpu-bias-cuda-x", lambda: remat.gelu(_cuda(3, 8), "none", rand(8)),
         ValueError, "bias", r"bias is on cpu but x is on cuda", marks=needs_gpu),
    case("layer_norm_linear", "cpu-weight-cuda-x",
         lambda: remat.layer_norm_linear(_cuda(3, 8), _cuda(8), _cuda(8), rand(4, 8)),
         ValueError, "weight", r"weight is on cpu but x is on cuda", marks=needs_gpu),
    case("mlp", "cpu-b1-cuda-x", lambda: remat.mlp(_cuda(3, 8), _cuda(16, 8), rand(16), _cuda(8, 16)),
         ValueError, "b1", r"b1 is on cpu but x is on cuda", marks=needs_gpu),
    case("attention", "cpu-v-cuda-q",
         lambda: remat.attention(_cuda(1, 2, 8, 32), _cuda(1, 2, 8, 32), rand(1, 2, 8, 32)),
         ValueError, "v", r"v is on cpu but q is on cuda", marks=needs_gpu),
    case("nn.MultiheadSelfAttention", "cuda-x-cpu-module", lambda: MHA(_cuda(1, 8, 64)),
         ValueError, "x", r"x is on cuda:0 but in_proj_weight is on cpu", marks=needs_gpu),
]

BAD_INPUT = (LAYER_NORM_ERRORS + GELU_ERRORS + LAYER_NORM_LINEAR_ERRORS + MLP_ERRORS + ATTENTION_ERRORS
             + MHA_FUNCTION_ERRORS + GPU_ERRORS)


@pytest.mark.parametrize("call, error, argument, pattern", BAD_INPUT)
def test_bad_input_raises_naming_the_argument(call, error, argument, pattern):
    assert_raises_naming(call, error, argument, pattern)


# =============================================================================================
# Legal input: the same behaviour as PyTorch's own layers
# =============================================================================================


@dataclass
class Subject:
    """A public function or module and its PyTorch counterpart, called on the same named tensors.

    build() gives fresh float32 tensors by name: the activations (`inputs`) first, then the
    parameters. ours/theirs take that dict; theirs also runs in float64 as the reference.
    """

    name: str
    build: Callable[[str], dict]
    ours: Callable[[dict], torch.Tensor]
    theirs: Callable[[dict], torch.Tensor]
    inputs: tuple = ("x",)


def _module_call(module, inputs=("x",), **kwargs):
    """Call `module` with the dict's tensors as its parameters (torch.func.functional_call)."""
    def call(t):
        params = {name: value for name, value in t.items() if name not in inputs}
        return functional_call(module, params, tuple(t[name] for name in inputs), kwargs)
    return call


def _stock_mlp(t, approximate="none", norm=False):
    x = F.layer_norm(t["x"], t["x"].shape[-1:], t["norm.weight"], t["norm.bias"]) if norm else t["x"]
    h = F.gelu(F.linear(x, t["fc1.weight"], t["fc1.bias"]), approximate=approximate)
    return F.linear(h, t["fc2.weight"], t["fc2.bias"])


# Shapes: small for the interpreter, but awkward: a width that is no power of two, 3-D inputs
# whose rows the ops flatten, GQA with seqlen_q != seqlen_k.
WIDTH, HIDDEN, OUT = 24, 40, 10


def _tensors(device, **shapes):
    """randn of each shape; 2-D ones are Linear weights, scaled by 1/sqrt(fan_in) as nn.Linear's
    init does, so that activations and attention logits stay O(1) as in a real model (unit-variance
    weights make the softmax near one-hot, where fp32 rounding alone passes the bounds)."""
    tensors = {name: torch.randn(*shape, device=device) for name, shape in shapes.items()}
    return {name: t / t.shape[1] ** 0.5 if t.dim() == 2 else t for name, t in tensors.items()}


def _family_subject(call):
    """A subject from an op family's declaration (remat.ops.FAMILIES): its public function's call."""
    return Subject(call.name, lambda d: _tensors(d, **call.shapes), call.ours, call.stock, call.inputs)


STOCK_MHA = torch.nn.MultiheadAttention(64, 2, batch_first=True)
SUBJECTS = [_family_subject(call) for _, call in registered_calls()] + [
    Subject("nn.LayerNorm", lambda d: _tensors(d, x=(2, 3, WIDTH), weight=(WIDTH,), bias=(WIDTH,)),
            _module_call(remat.nn.LayerNorm(WIDTH)), _module_call(torch.nn.LayerNorm(WIDTH))),
    Subject("nn.GELU", lambda d: _tensors(d, x=(2, 3, WIDTH)),
            _module_call(remat.nn.GELU()), _module_call(torch.nn.GELU())),
    Subject("layer_norm_linear",
            lambda d: _tensors(d, x=(2, 3, WIDTH), norm_weight=(WIDTH,), norm_bias=(WIDTH,), weight=(OUT, WIDTH),
                               bias=(OUT,)),
            lambda t: remat.layer_norm_linear(t["x"], t["norm_weight"], t["norm_bias"], t["weight"], t["bias"]),
            lambda t: F.linear(F.layer_norm(t["x"], (WIDTH,), t["norm_weight"], t["norm_bias"]), t["weight"],
                               t["bias"])),
    Subject("nn.LayerNormLinear",
            lambda d: _tensors(d, x=(2, 3, WIDTH), **{"norm.weight": (WIDTH,), "norm.bias": (WIDTH,),
                                                      "linear.weight": (OUT, WIDTH), "linear.bias": (OUT,)}),
            _module_call(remat.nn.LayerNormLinear(WIDTH, OUT)),
            lambda t: F.linear(F.layer_norm(t["x"], (WIDTH,), t["norm.weight"], t["norm.bias"]),
                               t["linear.weight"], t["linear.bias"])),
    Subject("mlp",
            lambda d: _tensors(d, x=(2, 3, WIDTH), w1=(HIDDEN, WIDTH), b1=(HIDDEN,), w2=(WIDTH, HIDDEN), b2=(WIDTH,)),
            lambda t: remat.mlp(t["x"], t["w1"], t["b1"], t["w2"], t["b2"]),
            lambda t: F.linear(F.gelu(F.linear(t["x"], t["w1"], t["b1"])), t["w2"], t["b2"])),
    Subject("nn.MLP",
            lambda d: _tensors(d, x=(2, 3, WIDTH), **{"fc1.weight": (HIDDEN, WIDTH), "fc1.bias": (HIDDEN,),
                                                      "fc2.weight": (WIDTH, HIDDEN), "fc2.bias": (WIDTH,)}),
            _module_call(remat.nn.MLP(WIDTH, HIDDEN, activation="gelu_tanh")),
            lambda t: _stock_mlp(t, approximate="tanh")),
    Subject("nn.LayerNormMLP",
            lambda d: _tensors(d, x=(2, 3, WIDTH), **{"norm.weight": (WIDTH,), "norm.bias": (WIDTH,),
                                                      "fc1.weight": (HIDDEN, WIDTH), "fc1.bias": (HIDDEN,),
                                                      "fc2.weight": (WIDTH, HIDDEN), "fc2.bias": (WIDTH,)}),
            _module_call(remat.nn.LayerNormMLP(WIDTH, HIDDEN)), lambda t: _stock_mlp(t, norm=True)),
    Subject("nn.MultiheadSelfAttention",
            lambda d: _tensors(d, x=(2, 5, 64), in_proj_weight=(192, 64), in_proj_bias=(192,),
                               **{"out_proj.weight": (64, 64), "out_proj.bias": (64,)}),
            _module_call(remat.nn.MultiheadSelfAttention(64, 2)),
            lambda t: _module_call(STOCK_MHA, inputs=("x", "x", "x"), need_weights=False)(t)[0]),
]


def subject_params():
    return [pytest.param(s, id=s.name) for s in SUBJECTS]


def _gradient_cases():
    """(subject, names that require grad): the activations alone, the parameters alone, all."""
    cases = []
    for subject in SUBJECTS:
        names = list(subject.build("meta"))
        params = [name for name in names if name not in subject.inputs]
        if subject.inputs == ("q", "k", "v"):  # no parameters: q alone, then k and v alone
            subsets = {"q": ["q"], "k-v": ["k", "v"], "all": names}
        else:
            subsets = {"inputs": list(subject.inputs), "params": params, "all": names}
        for label, wanted in subsets.items():
            if wanted and (label == "all" or wanted != names):
                cases.append(pytest.param(subject, wanted, id=f"{subject.name}-{label}"))
    return cases


def _float64_reference(subject, tensors, wanted=()):
    reference = {n: t.detach().double().requires_grad_(n in wanted) for n, t in tensors.items()}
    return reference, subject.theirs(reference)


@pytest.mark.parametrize("subject, wanted", _gradient_cases())
def test_gradients_match_pytorch_for_each_requires_grad_combination(target, subject, wanted):
    device, _ = target
    tensors = {n: t.requires_grad_(n in wanted) for n, t in subject.build(device).items()}
    reference, expected = _float64_reference(subject, tensors, wanted)
    out = subject.ours(tensors)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert rel_error(out, expected) <= REL_TOL[torch.float32]
    cotangent = torch.randn_like(expected)  # not ones: sum(LayerNorm(x)) has no gradient wrt x
    out.backward(cotangent.float())
    expected.backward(cotangent)
    for name, tensor in tensors.items():
        if name in wanted:
            assert tensor.grad is not None, name
            assert rel_error(tensor.grad, reference[name].grad) <= REL_TOL[torch.float32], name
        else:
            assert tensor.grad is None, f"{name} does not require grad but got one"


@pytest.mark.parametrize("subject", subject_params())
def test_float64_is_computed_as_pytorch_computes_it(target, subject):
    """float64, as the stock layers take it (gradcheck, numerics studies): the output and every
    gradient in float64, equal to PyTorch's own float64 ones to float64's rounding (the kernels compute
    in fp32: float64 runs remat's references, which compute in float64)."""
    device, _ = target
    tensors = {n: t.double().requires_grad_() for n, t in subject.build(device).items()}
    reference, expected = _float64_reference(subject, tensors, wanted=list(tensors))
    out = subject.ours(tensors)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    assert rel_error(out, expected) <= 1e-12
    cotangent = torch.randn_like(expected)
    out.backward(cotangent)
    expected.backward(cotangent)
    for name, tensor in tensors.items():
        assert tensor.grad.dtype == torch.float64, name
        assert rel_error(tensor.grad, reference[name].grad) <= 1e-12, name


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("subject", subject_params())
def test_no_grad_modes_give_the_grad_mode_output(target, subject, mode):
    device, _ = target
    tensors = {n: t.requires_grad_() for n, t in subject.build(device).items()}
    with_grad = subject.ours(tensors)
    with mode():
        out = subject.ours(tensors)
    assert with_grad.requires_grad and not out.requires_grad
    # Not bitwise: on a GPU the first call of a shape autotunes, and a later one may run other
    # block sizes, so another summation order.
    assert rel_error(out, with_grad.detach()) <= REL_TOL[torch.float32]


def _last_stride_two(t):
    """t's values in a view whose last dim has stride 2; the skipped elements are NaN, so a kernel
    that ignored the stride would return NaN, not a near miss."""
    return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]


@pytest.mark.parametrize("subject", subject_params())
def test_non_unit_last_stride_is_read_correctly(target, subject):
    device, _ = target
    tensors = subject.build(device)
    strided = {n: _last_stride_two(t).requires_grad_() for n, t in tensors.items()}
    assert all(t.stride(-1) == 2 for t in strided.values())
    reference, expected = _float64_reference(subject, tensors, wanted=list(tensors))
    out = subject.ours(strided)
    assert rel_error(out, expected) <= REL_TOL[torch.float32]
    cotangent = torch.randn_like(expected)
    out.backward(cotangent.float())
    expected.backward(cotangent)
    for name, tensor in strided.items():
        assert rel_error(tensor.grad, reference[name].grad) <= REL_TOL[torch.float32], name


@pytest.mark.parametrize("subject", subject_params())
def test_nan_input_propagates_as_in_pytorch(target, subject):
    """NaN where PyTorch's float64 result has NaN: its same-dtype CPU kernels are no oracle for
    non-finite values (their handling of inf and NaN can depend on the vector ISA)."""
    device, _ = target
    tensors = subject.build(device)
    tensors[subject.inputs[0]].view(-1)[0] = float("nan")
    out = subject.ours(tensors)
    reference = subject.theirs({n: t.double() for n, t in tensors.items()})
    assert torch.equal(torch.isnan(out), torch.isnan(reference))
    assert not torch.isnan(out).all(), "the NaN must stay in its row, batch or head"
    finite = ~torch.isnan(reference)
    assert rel_error(out[finite], reference[finite]) <= REL_TOL[torch.float32]


@pytest.mark.parametrize("subject", subject_params())
def test_empty_batch_gives_empty_output_and_zero_parameter_gradients(target, subject):
    device, _ = target
    tensors = {n: (t[:0] if n in subject.inputs else t).requires_grad_() for n, t in subject.build(device).items()}
    reference, expected = _float64_reference(subject, tensors, wanted=list(tensors))
    out = subject.ours(tensors)
    assert out.shape == expected.shape and out.numel() == 0
    out.sum().backward()
    expected.sum().backward()
    for name, tensor in tensors.items():
        assert tensor.grad.shape == tensor.shape, name
        assert torch.equal(tensor.grad.double(), reference[name].grad), name


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("subject", subject_params())
def test_autocast_gives_pytorch_dtypes(target, subject, amp):
    device, _ = target
    tensors = {n: t.requires_grad_() for n, t in subject.build(device).items()}
    reference, expected = _float64_reference(subject, tensors, wanted=list(tensors))
    with torch.autocast(device, dtype=amp):
        out = subject.ours(tensors)
        stock = subject.theirs(tensors)
    assert out.dtype == stock.dtype
    # As FlashAttention's tests: within the dtype's bound, or twice PyTorch's own error under the
    # same autocast (its layers round intermediates to `amp` as ours do).
    assert rel_error(out, expected) <= max(REL_TOL[amp], 2 * rel_error(stock, expected))
    cotangent = torch.randn_like(expected)
    ours_grads = torch.autograd.grad(out, list(tensors.values()), cotangent.to(out.dtype))  # outside autocast
    stock_grads = torch.autograd.grad(stock, list(tensors.values()), cotangent.to(stock.dtype))
    expected_grads = torch.autograd.grad(expected, list(reference.values()), cotangent)
    for name, ours, theirs, exact in zip(tensors, ours_grads, stock_grads, expected_grads):
        assert ours.dtype == theirs.dtype == torch.float32, name
        assert rel_error(ours, exact) <= max(REL_TOL[amp], 2 * rel_error(theirs, exact)), name


@pytest.mark.parametrize("subject", subject_params())
def test_meta_tensors_give_pytorch_shapes(subject):
    tensors = {n: t.requires_grad_() for n, t in subject.build("meta").items()}
    out, expected = subject.ours(tensors), subject.theirs(tensors)
    assert out.device.type == "meta"
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
    out.backward(torch.ones_like(out))
    assert all(t.grad.shape == t.shape for t in tensors.values())


@pytest.mark.parametrize("subject", subject_params())
def test_fake_tensors_trace_without_reading_data(subject):
    """torch.compile traces with fake tensors: a check that reads a value would raise here."""
    real = subject.build("cpu")
    with FakeTensorMode() as mode:
        tensors = {n: mode.from_tensor(t) for n, t in real.items()}
        out, expected = subject.ours(tensors), subject.theirs(tensors)
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
