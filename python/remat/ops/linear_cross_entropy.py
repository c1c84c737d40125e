"""Linear + cross-entropy, a language model's head and its loss in one op: reference, custom ops
(kernel, fake, autograd), public function.

loss = F.cross_entropy(x @ weight.T + bias, target) without ever holding the (tokens x vocabulary)
logits. The forward keeps x (the caller's), the target and the fp32 log-sum-exp of each token's
logits (4 bytes a token); the backward recomputes the logits chunk by chunk of the vocabulary from
those and forms dx, dW and db (triton_kernels/linear_cross_entropy.py). Stock PyTorch keeps the
log-softmax of the logits for its backward, (tokens x vocabulary) in the logits' dtype, and
transformers' loss upcasts the logits to fp32 first (4 bytes per logit).

The ops work on (M, K) token rows: remat::linear_cross_entropy_fwd(x, weight, bias, target,
ignore_index, label_smoothing, z_loss, softcap) -> (loss (M,), lse (M,)), the per-token losses (0 for
ignored tokens) in fp32 (float64 for float64 inputs); the public function reduces them in PyTorch.
The backward op takes the per-token upstream gradient (the expanded scalar of a sum or mean, stride
0) and which gradients to form: a frozen head (LoRA) skips the dW product entirely.

Vocabulary parallel (tensor parallel's LM head, the vocabulary split across the ranks): both ops take
vocab_start and vocab_total (0: the weight is the whole vocabulary). A shard's forward returns its
lse and its part of the loss's sums over the vocabulary; remat.linear_cross_entropy with a DTensor
weight combines them across the ranks (two all-reduces of a few floats a token: the logits and the
weight are never gathered) and hands each shard's backward the combined lse, which returns its part
of dx (summed across the ranks) and its rows of dW.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from .. import _backend
from .. import _tensor_parallel as tensor_parallel
from .._numerics import math_dtype
from .._validate import (
    autocast_dtype_for,
    cast_for_autocast,
    check_choice,
    check_float_tensor,
    check_optional_param,
    check_same_device,
    integer,
    rows_with_unit_stride,
)
from ._family import OpFamily, OpSamples, PublicCall, grad_leaves

REDUCTIONS = ("mean", "sum", "none")
# Class-index dtypes: torch's cross_entropy takes int64 and uint8; int32 (common in data pipelines)
# is taken too.
TARGET_DTYPES = (torch.int64, torch.int32, torch.uint8)
# The reference holds at most this many logits at a time (a chunk of tokens times the vocabulary),
# so that it also runs at the sizes the kernels are benchmarked at (8192 x 128256 logits would be
# 4 GiB in fp32, 8 GiB in float64).
REFERENCE_CHUNK_ELEMENTS = 2**22

# ---------------------------------------------------------------------------------------------
# Reference: plain PyTorch, in fp32 (or float64 when given float64), chunked over tokens.
# ---------------------------------------------------------------------------------------------


def _token_chunks(tokens, vocab):
    step = max(1, REFERENCE_CHUNK_ELEMENTS // max(vocab, 1))
    return [(start, min(start + step, tokens)) for start in range(0, tokens, step)]


def _capped_logits(x, weight, bias, softcap):
    """(z, t): the logits after bias and softcap, and tanh(raw / softcap) (None without a cap)."""
    z = x @ weight.T
    if bias is not None:
        z = z + bias
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return softcap * t, t


def _token_losses(z, lse, target, ignore_index, label_smoothing, z_loss, vocab_start, vocab_total):
    """loss_i = lse_i - (1 - eps) z_it - eps mean_j z_ij + lam lse_i^2; 0 where ignored, NaN where the
    target lies outside the vocabulary (never a silent wrong loss). A shard of the vocabulary (vocab_total
    > 0: z holds its columns vocab_start ..): its part of the sums, -(1 - eps) z_it where t_i is its and
    -(eps / vocab_total) sum_j z_ij."""
    vocab, whole = z.shape[1], vocab_total or z.shape[1]
    target = target.long()
    counted = target != ignore_index
    in_range = (target >= 0) & (target < whole)
    local = target - vocab_start
    here = (local >= 0) & (local < vocab)
    target_logit = torch.where(here, z.gather(1, local.clamp(0, vocab - 1)[:, None]).squeeze(1), 0.0)
    loss = -(1 - label_smoothing) * target_logit
    if not vocab_total:
        loss = loss + lse + z_loss * lse * lse
    if label_smoothing:
        loss = loss - (label_smoothing / whole) * z.sum(dim=1)
    return torch.where(counted, torch.where(in_range, loss, math.nan), 0.0)


def linear_cross_entropy_fwd_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int, label_smoothing: float,
    z_loss: float, softcap: float | None, vocab_start: int = 0, vocab_total: int = 0,
) -> tuple[Tensor, Tensor]:
    """(loss, lse) per token of x (M, K) against weight (V, K) (+ bias (V,)) and target (M,); both in
    fp32 (float64 for float64 x). Differentiable (a double backward runs through it). With vocab_total > 0,
    weight is rows vocab_start .. of that vocabulary, and loss the shard's part (_token_losses)."""
    compute = math_dtype(x)
    weight_c = weight.to(compute)
    bias_c = bias.to(compute) if bias is not None else None
    losses, lses = [x.new_empty((0,), dtype=compute)], [x.new_empty((0,), dtype=compute)]
    for start, stop in _token_chunks(x.shape[0], weight.shape[0]):
        z, _ = _capped_logits(x[start:stop].to(compute), weight_c, bias_c, softcap)
        lse = torch.logsumexp(z, dim=1)
        lses.append(lse)
        losses.append(_token_losses(z, lse, target[start:stop], ignore_index, label_smoothing, z_loss, vocab_start,
                                    vocab_total))
    return torch.cat(losses), torch.cat(lses)


def _logit_grads(z, t, lse, target, upstream, ignore_index, label_smoothing, z_loss, vocab_start, vocab_total):
    """d loss / d (raw logits) of a chunk of tokens: the formulas of the kernels' backward (a shard's
    columns with the combined lse, in the whole vocabulary's places)."""
    whole = vocab_total or z.shape[1]
    target = target.long()
    counted = target != ignore_index
    in_range = (target >= 0) & (target < whole)
    p = torch.exp(z - lse[:, None])
    # In z's dtype: (1 - eps) times a bool tensor would be rounded to the default dtype, fp32.
    columns = torch.arange(vocab_start, vocab_start + z.shape[1], device=z.device)
    is_target = (columns[None, :] == target[:, None]).to(z.dtype)
    dz = p * (1 + 2 * z_loss * lse)[:, None] - label_smoothing / whole - (1 - label_smoothing) * is_target
    # NaN only on counted tokens: an ignored token's NaN, though masked below, would make the
    # masked product's own gradient NaN (0 * NaN) under a double backward.
    dz = dz * torch.where(counted & ~in_range, math.nan, upstream.to(z.dtype))[:, None]
    if t is not None:
        dz = dz * (1 - t * t)
    return torch.where(counted[:, None], dz, 0.0)


def linear_cross_entropy_bwd_ref(
    dloss: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, lse: Tensor, ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: float | None, need_dx: bool, need_dweight: bool,
    need_dbias: bool, vocab_start: int = 0, vocab_total: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) for the per-token upstream gradient dloss (M,), the logits rebuilt a chunk
    of tokens at a time; an output not asked for (dbias without a bias) is an empty (0,) tensor. A shard
    (vocab_total > 0) takes the combined lse and returns its part of dx."""
    compute = math_dtype(x)
    weight_c = weight.to(compute)
    bias_c = bias.to(compute) if bias is not None else None
    need_dbias = need_dbias and bias is not None
    dx_parts = [x.new_empty((0, x.shape[1]), dtype=compute)]
    dweight = torch.zeros(weight.shape, dtype=compute, device=x.device)
    dbias = torch.zeros(weight.shape[:1], dtype=compute, device=x.device)
    for start, stop in _token_chunks(x.shape[0], weight.shape[0]):
        x_c = x[start:stop].to(compute)
        z, t = _capped_logits(x_c, weight_c, bias_c, softcap)
        dz = _logit_grads(z, t, lse[start:stop].to(compute), target[start:stop], dloss[start:stop], ignore_index,
                          label_smoothing, z_loss, vocab_start, vocab_total)
        if need_dx:
            dx_parts.append(dz @ weight_c)
        if need_dweight:
            dweight = dweight + dz.T @ x_c
        if need_dbias:
            dbias = dbias + dz.sum(dim=0)
    return (torch.cat(dx_parts).to(x.dtype) if need_dx else _absent(x),
            dweight.to(weight.dtype) if need_dweight else _absent(weight),
            dbias.to(bias.dtype) if need_dbias else _absent(x))


def _absent(like):
    """Placeholder for a gradient not asked for."""
    return like.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# The ops' fakes and autograd (the ops themselves are declared at the end of the file)
# ---------------------------------------------------------------------------------------------


def _fwd_fake(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, vocab_start=0, vocab_total=0):
    rows = x.shape[0]
    return x.new_empty((rows,), dtype=math_dtype(x)), x.new_empty((rows,), dtype=math_dtype(x))


def _bwd_fake(dloss, x, weight, bias, target, lse, ignore_index, label_smoothing, z_loss, softcap, need_dx,
              need_dweight, need_dbias, vocab_start=0, vocab_total=0):
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else _absent(x)
    return (x.new_empty(x.shape) if need_dx else _absent(x),
            weight.new_empty(weight.shape) if need_dweight else _absent(weight), dbias)


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, _vocab_start, vocab_total = inputs
    _loss, lse = output
    if vocab_total:  # a shard's parts: remat.linear_cross_entropy differentiates the loss they combine into
        ctx.mark_non_differentiable(_loss, lse)
        return
    ctx.save_for_backward(x, weight, bias, target, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dloss, _dlse):
    x, weight, bias, target, lse = ctx.saved_tensors
    need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    need_dbias = need_dbias and bias is not None
    if _backend.backward_is_differentiated():
        # create_graph=True: the reference's formulas, which a second backward can differentiate,
        # with the lse recomputed from x and the weight (the saved one is a constant to autograd).
        lse = linear_cross_entropy_fwd_ref(x, weight, bias, target, *ctx.options)[1]
        backward = linear_cross_entropy_bwd_ref
    else:
        backward = linear_cross_entropy_bwd
    dx, dweight, dbias = backward(dloss, x, weight, bias, target, lse, *ctx.options, need_dx, need_dweight,
                                  need_dbias)
    return (dx if need_dx else None, dweight if need_dweight else None, dbias if need_dbias else None,
            None, None, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def _number(name, value, low, high, low_open=False):
    """A real number in [low, high] ((low, high] with low_open), as a float; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def _check_weight(weight, x):
    check_float_tensor("weight", weight)
    width = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != width or weight.shape[0] < 1:
        raise ValueError(f"weight must have shape (vocabulary, {width}) with a vocabulary of at least 1 (x has "
                         f"{width} features), got {tuple(weight.shape)}")
    check_same_device("weight", weight, "x", x)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}; they must match")


def _check_target(target, x):
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in TARGET_DTYPES)
        raise TypeError(f"target must have an integer dtype ({names}: class indices), got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have x's shape without its last dim, {tuple(x.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    check_same_device("target", target, "x", x)


def _readable(t):
    """Whether t's values may be read here: not while tracing (torch.compile, fake or meta tensors)
    nor while a CUDA graph is being captured (a read would synchronise)."""
    if torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.device.type == "meta":
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_target_values(target, vocab, ignore_index):
    """Every target a class index in [0, vocab) or ignore_index. Reads the values: one
    synchronisation with the GPU per call, outside torch.compile and CUDA graphs (where the kernels
    give such a token a NaN loss and NaN gradients instead: still never a silent wrong answer)."""
    if target.numel() == 0 or not _readable(target):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        value = target[bad][0].item()
        raise ValueError(f"target must hold class indices in [0, {vocab}) (the weight's rows) or ignore_index "
                         f"({ignore_index}), got {value}")


def loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The loss options checked (a ValueError or TypeError naming the one that is wrong) and
    normalised: (ignore_index as an int, reduction, label_smoothing, z_loss and softcap as floats or None)."""
    index = integer(ignore_index)
    if index is None:
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    check_choice("reduction", reduction, REDUCTIONS)
    label_smoothing = _number("label_smoothing", label_smoothing, 0.0, 1.0)
    z_loss = _number("z_loss", z_loss, 0.0, math.inf)
    softcap = None if softcap is None else _number("softcap", softcap, 0.0, math.inf, low_open=True)
    return index, reduction, label_smoothing, z_loss, softcap


def _check_num_items(num_items_in_batch, reduction, x):
    if num_items_in_batch is None:
        return None
    if reduction != "mean":
        raise ValueError(f"num_items_in_batch divides the summed loss in place of reduction='mean''s count; "
                         f"reduction must be 'mean' with it, got {reduction!r}")
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex() or num_items_in_batch.dtype == torch.bool:
            raise ValueError(f"num_items_in_batch must be a positive number or a one-element real tensor, got a "
                             f"{num_items_in_batch.dtype} tensor of shape {tuple(num_items_in_batch.shape)}")
        return num_items_in_batch.reshape(()).to(x.device)  # as transformers moves it to the loss's device
    count = num_items_in_batch if integer(num_items_in_batch) is None else integer(num_items_in_batch)
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not 0 < count < math.inf:
        raise ValueError(f"num_items_in_batch must be a positive number or a one-element tensor, got "
                         f"{num_items_in_batch!r}")
    return count


def linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         z_loss=0.0, softcap=None, num_items_in_batch=None):
    """The cross-entropy loss of the logits x @ weight.T + bias against target, without the logits.

    x: (..., K) float32, float16 or bfloat16 (float64 runs the reference); weight: (V, K) in x's dtype
    (an LM head's, tied to the embedding or not); bias: None or (V,), x's dtype or float32; target:
    x's shape without its last dim, int64 (int32, uint8) class indices in [0, V), or ignore_index.
    Equals, in fp32 and with fp32 accumulation whatever the input dtype:

        logits = x @ weight.T + bias                                   # never materialised
        logits = softcap * tanh(logits / softcap)                      # softcap given (Gemma 2/3)
        loss_i = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none",
                                 label_smoothing=label_smoothing)_i + z_loss * lse_i ** 2

    reduced as `reduction` says: "none" (x's shape without its last dim; 0 for ignored tokens), "sum",
    or "mean" over the tokens not ignored (the z-loss averaged as the loss is, as OLMo and PaLM train
    with it). num_items_in_batch (a number or a one-element tensor; "mean" only): the sum divided by it
    instead, as transformers' Trainer passes it to ForCausalLMLoss. The loss is fp32 (float64 for
    float64 inputs), as transformers' loss (which upcasts the logits) and torch's under autocast
    return it; under autocast x, weight and bias are cast to the autocast dtype first.

    Logits of -inf (a -inf bias entry) are F.cross_entropy's too: they add nothing to the log-sum-exp,
    a -inf target logit gives an inf loss, a token whose every logit is -inf a NaN loss.
    Difference from F.cross_entropy: a mean over no counted token (every target ignored) is 0 with
    zero gradients, not NaN; an ignored token's gradient is 0 even where its logits are all -inf.
    Autograd keeps x, the target (flattened) and the fp32 log-sum-exp per token (plus, for the mean,
    its 4-byte count); the backward recomputes the logits (see remat.ops.linear_cross_entropy). Target
    values are checked once per call outside torch.compile (one synchronisation with the GPU).

    Tensor parallel (a vocabulary-parallel head, as Megatron-LM's): weight a DTensor Shard(0) on a 1-D
    device mesh (ColwiseParallel's layout of an LM head), bias None or Shard(0) with it, x the whole input
    on every rank (a plain tensor, or a DTensor Replicate() on the mesh). Each rank computes its shard's
    log-sum-exp and part of the loss, combined across the ranks with two all-reduces of a few floats a
    token; no rank holds the logits or another rank's rows of the weight. The loss is the same on every
    rank, a plain tensor; x's gradient is summed across the ranks, the weight's stays sharded.
    """
    check_float_tensor("x", x)
    dtype = autocast_dtype_for(x)
    if dtype is not None:  # as F.linear under autocast: the product in the autocast dtype
        with torch.autocast(x.device.type, enabled=False):
            cast_x, cast_weight, cast_bias = cast_for_autocast(dtype, x, weight, bias)
            return linear_cross_entropy(cast_x, cast_weight, target, cast_bias, ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                                        softcap=softcap, num_items_in_batch=num_items_in_batch)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the features last), got a 0-dim tensor")
    _check_weight(weight, x)
    vocab, width = weight.shape
    check_optional_param("bias", bias, (vocab,), "x", x)
    _check_target(target, x)
    index, reduction, label_smoothing, z_loss, softcap = loss_options(ignore_index, reduction, label_smoothing,
                                                                      z_loss, softcap)
    num_items = _check_num_items(num_items_in_batch, reduction, x)
    _check_target_values(target, vocab, index)

    options = (index, label_smoothing, z_loss, softcap)
    if any(map(tensor_parallel.is_dtensor, (x, weight, bias))):
        shard = _vocab_shard(x, weight, bias)
        losses = _VocabParallelLosses.apply(rows_with_unit_stride(shard.x, width), shard.weight, shard.bias,
                                            target.reshape(-1), options, (shard.start, vocab, shard.group))
    else:
        losses, _lse = linear_cross_entropy_fwd(rows_with_unit_stride(x, width), weight, bias, target.reshape(-1),
                                                *options)
    if reduction == "none":
        return losses.view(target.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    if num_items is not None:
        return total / num_items
    # A mean over no counted token is 0 (not 0 / 0): clamped count. fp32 (4 bytes, saved by the division).
    count = (target != index).sum().clamp_min(1).to(total.dtype)
    return total / count


# ---------------------------------------------------------------------------------------------
# Vocabulary parallel: the shards' parts combined across the ranks
# ---------------------------------------------------------------------------------------------


class _Shard(NamedTuple):
    x: Tensor  # this rank's input: the whole of it, its gradient summed across the ranks
    weight: Tensor  # this rank's rows of the weight (and of the bias)
    bias: Tensor | None
    start: int  # the first of those rows in the whole vocabulary
    group: object  # the mesh's process group


def _vocab_shard(x, weight, bias):
    """This rank's part of a vocabulary-parallel call (see linear_cross_entropy); a ValueError naming the
    argument whose layout is not one."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not tensor_parallel.is_dtensor(weight):
        raise ValueError("weight must be a DTensor sharded on the vocabulary, Shard(0), where x or bias is a "
                         "DTensor; got a plain tensor")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"weight must be a DTensor Shard(0) (the vocabulary split across the ranks) on a 1-D device "
                         f"mesh, got {weight.placements} on a {mesh.ndim}-D mesh")
    if bias is not None and (not tensor_parallel.is_dtensor(bias) or bias.device_mesh != mesh or
                             bias.placements != (Shard(0),)):
        raise ValueError(f"bias must be None or a DTensor Shard(0) on the weight's mesh, got "
                         f"{getattr(bias, 'placements', 'a plain tensor')}")
    if not tensor_parallel.is_dtensor(x):  # the same tensor on every rank
        x_local = tensor_parallel.summed_grad(x, mesh)
    elif x.device_mesh != mesh or x.placements != (Replicate(),):
        raise ValueError(f"x must be the whole input on every rank (a plain tensor or a DTensor Replicate() on the "
                         f"weight's mesh), got {x.placements}")
    else:
        x_local = x.to_local(grad_placements=[Partial()])
    local = weight.to_local()
    vocab, ranks, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    rows_each = -(-vocab // ranks)  # Shard(0) splits as torch.chunk does
    start = min(rank * rows_each, vocab)
    if local.shape[0] != min(rows_each, vocab - start) or local.shape[0] == 0:
        raise ValueError(f"weight's shard on rank {rank} holds {local.shape[0]} of its {vocab} rows; a vocabulary-"
                         f"parallel head needs Shard(0)'s split ({rows_each} a rank) with a row on every rank")
    return _Shard(x_local, local, None if bias is None else bias.to_local(), start, mesh.get_group())


class _VocabParallelLosses(torch.autograd.Function):
    """The per-token losses of a vocabulary shard's call, combined across the ranks of `group`: each rank's
    lse and part of the loss's sums (the forward op's shard mode), the lse's combined with a maximum and a
    sum, the parts with a sum. Autograd keeps what the single-device op keeps: x, the target, the combined
    lse; the backward op forms the shard's dW and its part of dx from them."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, options, shard):
        start, vocab, group = shard
        part, lse = linear_cross_entropy_fwd(x, weight, bias, target, *options, start, vocab)
        top = lse.clone()
        torch.distributed.all_reduce(top, torch.distributed.ReduceOp.MAX, group=group)
        shift = torch.where(top == -math.inf, 0.0, top)  # every logit -inf: lse -inf, as one device's
        sums = torch.stack([torch.exp(lse - shift), part])
        torch.distributed.all_reduce(sums, group=group)
        lse = shift + torch.log(sums[0])
        index, _label_smoothing, z_loss, _softcap = options
        losses = torch.where(target != index, sums[1] + lse + z_loss * lse * lse, 0.0)
        ctx.save_for_backward(x, weight, bias, target, lse)
        ctx.options, ctx.shard = options, (start, vocab)
        return losses

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss):
        x, weight, bias, target, lse = ctx.saved_tensors
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        need_dbias = need_dbias and bias is not None
        dx, dweight, dbias = linear_cross_entropy_bwd(dloss, x, weight, bias, target, lse, *ctx.options, need_dx,
                                                      need_dweight, need_dbias, *ctx.shard)
        return (dx if need_dx else None, dweight if need_dweight else None, dbias if need_dbias else None, None, None,
                None)


# ---------------------------------------------------------------------------------------------
# The family: remat::linear_cross_entropy_fwd and _bwd, and what the tooling needs
# ---------------------------------------------------------------------------------------------
_OPTIONS = ((-100, 0.0, 0.0, None), (-100, 0.1, 1e-3, 5.0))  # plain; every option
_GRADS = ((True, True, True), (True, False, False), (False, True, True))  # (need_dx, need_dweight, need_dbias)


def _samples(device):
    """5 tokens of width 37 (no power of two, a masked tail) against a prime vocabulary of 67, one
    token ignored, with and without a bias, plain and with every option; the backward also with an
    expanded (stride-0) upstream gradient and each subset of gradients; and a shard of the vocabulary."""
    x = torch.randn(5, 37, device=device)
    weight = torch.randn(67, 37, device=device) / 37**0.5
    bias = torch.randn(67, device=device)
    target = torch.tensor([3, -100, 66, 0, 12], device=device)
    forward, backward = [], []
    for b, options in ((bias, _OPTIONS[1]), (None, _OPTIONS[0])):
        forward.append((*grad_leaves(x, weight, b), target, *options))
        _, lse = linear_cross_entropy_fwd_ref(x, weight, b, target, *options)
        for dloss, grads in zip((torch.randn(5, device=device), torch.randn((), device=device).expand(5),
                                 torch.randn(5, device=device)), _GRADS):
            backward.append((dloss, x, weight, b, target, lse, *options, *grads))
    # A tensor-parallel shard: rows 20 .. 47 of the vocabulary, holding one target (its part of the loss has
    # no gradient of its own: the forward without leaves), its backward with the whole vocabulary's lse.
    _, lse = linear_cross_entropy_fwd_ref(x, weight, bias, target, *_OPTIONS[1])
    forward.append((x, weight[20:47], bias[20:47], target, *_OPTIONS[1], 20, 67))
    backward.append((torch.randn(5, device=device), x, weight[20:47], bias[20:47], target, lse, *_OPTIONS[1],
                     *_GRADS[0], 20, 67))
    return OpSamples(forward, backward)


_WIDTH, _VOCAB = 24, 37  # the validation table's: no powers of two


def validation_target(x, vocab=_VOCAB, ignore_index=-100):
    """Class indices for x's tokens (x's shape without its last dim), computed from the shape alone
    (so on meta and fake tensors too), spread over the vocabulary, the second token ignored."""
    count = math.prod(x.shape[:-1])
    positions = torch.arange(count, device=x.device)
    target = torch.where(positions == 1, ignore_index, (positions * 7 + 3) % vocab)
    return target.reshape(x.shape[:-1])


def stock_linear_cross_entropy(x, weight, target, bias=None, **options):
    """The stock computation: the logits, then F.cross_entropy over the flattened tokens."""
    logits = F.linear(x, weight, bias)
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1), **options)
    return loss.view(target.shape) if options.get("reduction") == "none" else loss


FAMILY = OpFamily(
    name="linear_cross_entropy",
    forward_ref=linear_cross_entropy_fwd_ref,
    backward_ref=linear_cross_entropy_bwd_ref,
    forward_fake=_fwd_fake,
    backward_fake=_bwd_fake,
    setup_context=_setup_context,
    autograd_backward=_backward,
    samples=_samples,
    bench_suite="linear_cross_entropy",
    calls=(PublicCall("linear_cross_entropy", {"x": (2, 3, _WIDTH), "weight": (_VOCAB, _WIDTH), "bias": (_VOCAB,)},
                      lambda t: linear_cross_entropy(t["x"], t["weight"], validation_target(t["x"]), t["bias"],
                                                     reduction="none", label_smoothing=0.1),
                      lambda t: stock_linear_cross_entropy(t["x"], t["weight"], validation_target(t["x"]), t["bias"],
                                                           reduction="none", label_smoothing=0.1)),),
    triton="linear_cross_entropy",
    uses_tl_dot=True,
)
linear_cross_entropy_fwd, linear_cross_entropy_bwd = FAMILY.forward, FAMILY.backward
