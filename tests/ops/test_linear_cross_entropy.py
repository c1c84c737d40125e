"""remat.linear_cross_entropy (an LM head and its loss, the logits recomputed in the backward): the kernels
against float64 at awkward shapes in every dtype, within twice PyTorch's own error; the semantics of
F.cross_entropy and of transformers' ForCausalLMLoss; what autograd keeps, exactly; deterministic
gradients; the module; bad input."""

import contextlib
import functools
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.ops import linear_cross_entropy as lce_ops
from remat.triton_kernels import linear_cross_entropy as lce_kernels

from numerics import assert_raises_naming, rel_error, saved_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, hidden, vocab): one token; prime widths and a vocabulary of one 256-block and one more
# column; 40 tokens against 1003 classes (no multiple of any block; on CPU three backward chunks,
# the last one ragged, and eight to sixteen forward splits).
SHAPES = [(1, 29, 257), (37, 29, 257), (40, 64, 1003)]
OPTIONS = {"plain": dict(), "every-option": dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)}
# As the benchmarks' check (remat.bench.check): where both errors are fp32 rounding noise (~1e-7) a
# factor of 2 means nothing; in fp16 and bf16 every output is rounded (>= ~1e-4) and the floor changes nothing.
ERROR_FLOOR = 1e-6


def make_case(tokens, hidden, vocab, dtype, device, bias=False, ignored=(2,)):
    """x, weight (nn.Linear's scale: logits of order 1), bias and a target with `ignored` tokens."""
    x = torch.randn(tokens, hidden, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=device).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[[i for i in ignored if i < tokens]] = -100
    return x, weight, b, target


def stock(x, weight, bias, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
          softcap=None, num_items_in_batch=None):
    """The stock computation in x's dtype: logits, the softcap (as Gemma 2 applies it), F.cross_entropy,
    the z-loss (z_loss * lse^2 of each counted token, reduced as the loss is)."""
    logits = F.linear(x, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat, flat_target = logits.reshape(-1, weight.shape[0]), target.reshape(-1)
    losses = F.cross_entropy(flat, flat_target, ignore_index=ignore_index, reduction="none",
                             label_smoothing=label_smoothing)
    counted = flat_target != ignore_index
    if z_loss:
        losses = losses + z_loss * torch.logsumexp(flat, dim=1) ** 2 * counted
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (num_items_in_batch if num_items_in_batch is not None else counted.sum())


def float64_leaves(*tensors):
    return [t.detach().double().requires_grad_() if t is not None else None for t in tensors]


def grads_of(out, leaves, cotangent):
    present = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, present, cotangent)


def assert_within_twice_pytorchs_error(names, ours, theirs, exact):
    for name, mine, torch_own, want in zip(names, ours, theirs, exact):
        assert torch.isfinite(mine).all(), name
        error, bound = rel_error(mine, want), 2 * rel_error(torch_own, want) + ERROR_FLOOR
        assert error <= bound, f"{name}: error {error:.3g} > twice PyTorch's {bound:.3g}"


# --- numerics against float64 -------------------------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_loss_and_gradients_within_twice_pytorchs_error(target, shape, dtype, options):
    """Per-token losses (reduction "none", a random upstream gradient per token) and the gradients of
    x, the weight and (with every option) the bias, against float64; PyTorch's own computation in the
    same dtype sets the bound."""
    device, _ = target
    x, weight, bias, labels = make_case(*shape, dtype, device, bias=bool(options))
    leaves = [x, weight, bias]
    exact_leaves = float64_leaves(*leaves)
    exact = stock(*exact_leaves, labels, reduction="none", **options)
    cotangent = torch.randn_like(exact)
    ours = remat.linear_cross_entropy(x, weight, labels, bias, reduction="none", **options)
    assert ours.dtype == torch.float32 and ours.shape == labels.shape
    theirs = stock(x, weight, bias, labels, reduction="none", **options)
    names = ["loss", "dx", "dweight", "dbias"]
    assert_within_twice_pytorchs_error(
        names, [ours, *grads_of(ours, leaves, cotangent)], [theirs, *grads_of(theirs, leaves, cotangent.to(dtype))],
        [exact, *grads_of(exact, exact_leaves, cotangent)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_bias_with_half_inputs(target, dtype):
    device, _ = target
    x, weight, _, labels = make_case(37, 29, 257, dtype, device)
    bias = torch.randn(257, device=device, requires_grad=True)
    loss = remat.linear_cross_entropy(x, weight, labels, bias)
    loss.backward()
    x64, w64, b64 = float64_leaves(x, weight, bias)
    exact = stock(x64, w64, b64, labels)
    exact.backward()
    assert rel_error(loss, exact) <= 1e-5
    assert bias.grad.dtype == torch.float32 and rel_error(bias.grad, b64.grad) <= 1e-2


def test_chunk_and_split_counts_change_only_the_rounding(target):
    """The backward over 1 and 3 vocabulary chunks (the single-chunk dx, and the first, accumulating and
    last variants) and the forward over 1 and 16 vocabulary splits give what the float64 reference gives."""
    device, _ = target
    x, weight, bias, labels = make_case(40, 64, 1003, torch.float16, device, bias=True)
    options = (-100, 0.1, 1e-3, 5.0)
    args = [t.detach() for t in (x, weight, bias)] + [labels]
    exact_loss, exact_lse = lce_ops.linear_cross_entropy_fwd_ref(*float64_leaves(x, weight, bias), labels, *options)
    dloss = torch.randn(40, device=device)
    exact_grads = lce_ops.linear_cross_entropy_bwd_ref(dloss.double(), *float64_leaves(x, weight, bias), labels,
                                                       exact_lse, *options, True, True, True)
    for splits in (1, 16):
        loss, lse = lce_kernels.forward(*args, *options, splits=splits)
        assert rel_error(loss, exact_loss) <= 1e-6 and rel_error(lse, exact_lse) <= 1e-6, splits
    for columns in (1024, 384):  # one chunk of all 1003 columns; three, the last one ragged
        grads = lce_kernels.backward(dloss, *args[:3], labels, exact_lse.float(), *options, True, True, True,
                                     columns=columns)
        for name, got, want in zip(("dx", "dweight", "dbias"), grads, exact_grads):
            assert rel_error(got, want) <= 2e-3, (columns, name)


# --- a vocabulary split across ranks (tensor parallel) -------------------------------------------
# Three uneven shards of 1003 classes; the ranks' all-reduces (a maximum, then sums) done here on the list.
SHARD_CUTS = (0, 335, 700, 1003)


def _shard_combined(x, weight, bias, labels, dloss, options):
    """(per-token losses, dx, dweight, dbias) of the kernels run a shard at a time and combined as
    remat.linear_cross_entropy combines them across ranks: lse = log sum_r exp(lse_r), the loss the sum of
    the shards' parts plus lse + z_loss lse^2, each shard's backward given that lse, dx their sum."""
    vocab, shards = weight.shape[0], list(zip(SHARD_CUTS, SHARD_CUTS[1:]))
    outs = [lce_ops.linear_cross_entropy_fwd(x, weight[a:b], bias[a:b], labels, *options, a, vocab) for a, b in shards]
    lse = torch.logsumexp(torch.stack([lse for _, lse in outs]), dim=0)
    losses = torch.where(labels != -100, sum(part for part, _ in outs) + lse + options[2] * lse * lse, 0.0)
    grads = [lce_ops.linear_cross_entropy_bwd(dloss, x, weight[a:b], bias[a:b], labels, lse, *options, True, True,
                                              True, a, vocab) for a, b in shards]
    return (losses, sum(g[0].float() for g in grads).to(x.dtype), torch.cat([g[1] for g in grads]),
            torch.cat([g[2] for g in grads]))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocabulary_shards_combine_to_the_whole_loss_and_gradients(target, dtype, options):
    """A vocabulary-parallel head's kernels: each shard's lse and part of the loss, combined, and each
    shard's backward given the combined lse, give the loss and gradients of the whole vocabulary within
    twice PyTorch's own error (targets in every shard, one ignored)."""
    device, _ = target
    x, weight, bias, labels = make_case(40, 64, 1003, dtype, device, bias=True)
    labels[3:6] = torch.tensor(SHARD_CUTS[1:]) - 1  # the last class of each shard (token 2 is ignored)
    op_options = (-100, options.get("label_smoothing", 0.0), options.get("z_loss", 0.0), options.get("softcap"))
    leaves, exact_leaves = [x, weight, bias], float64_leaves(x, weight, bias)
    exact = stock(*exact_leaves, labels, reduction="none", **options)
    dloss = torch.randn(40, device=device)
    theirs = stock(x, weight, bias, labels, reduction="none", **options)
    ours = _shard_combined(*(t.detach() for t in leaves), labels, dloss, op_options)
    assert_within_twice_pytorchs_error(
        ["loss", "dx", "dweight", "dbias"], ours, [theirs, *grads_of(theirs, leaves, dloss.to(dtype))],
        [exact, *grads_of(exact, exact_leaves, dloss.double())])


def test_a_shard_marks_a_target_outside_the_whole_vocabulary_nan(target):
    """A shard checks targets against the whole vocabulary: another shard's target is no error, a target
    beyond the whole vocabulary gives a NaN part and NaN gradients, an ignored one 0."""
    device, _ = target
    x, weight, bias, _ = make_case(3, 29, 40, torch.float32, device, bias=True)
    labels = torch.tensor([5, 40, -100], device=device)  # another shard's; beyond the vocabulary; ignored
    part, _ = lce_ops.linear_cross_entropy_fwd(x.detach(), weight[20:].detach(), bias[20:].detach(), labels, -100,
                                               0.0, 0.0, None, 20, 40)
    assert part[0] == 0 and part[1].isnan() and part[2] == 0
    dx, dweight, _ = lce_ops.linear_cross_entropy_bwd(torch.ones(3, device=device), x.detach(), weight[20:].detach(),
                                                      None, labels, torch.zeros(3, device=device), -100, 0.0, 0.0,
                                                      None, True, True, False, 20, 40)
    assert dx[0].isfinite().all() and dx[1].isnan().all() and (dx[2] == 0).all() and dweight.isnan().any()


def test_a_shard_outside_its_vocabulary_is_refused_and_its_parts_have_no_gradient(target):
    device, _ = target
    x, weight, _, labels = make_case(3, 29, 40, torch.float32, device)
    with pytest.raises(ValueError, match="vocab_start=30 must lie within the vocabulary of vocab_total=40"):
        lce_kernels.linear_cross_entropy_fwd(x.detach(), weight[20:].detach(), None, labels, -100, 0.0, 0.0, None,
                                             30, 40)
    part, lse = lce_ops.linear_cross_entropy_fwd(x, weight[20:], None, labels, -100, 0.0, 0.0, None, 20, 40)
    assert not part.requires_grad and not lse.requires_grad  # the combined loss is what has a gradient


# --- semantics: PyTorch's cross-entropy and transformers' loss -----------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.2, ignore_index=5)], ids=["plain", "smoothing"])
def test_reductions_and_options_are_pytorchs(target, reduction, options):
    """As F.cross_entropy with the same reduction, ignore_index (-100, or a real class such as a pad
    token's) and label smoothing, for 3-D inputs whose tokens are flattened."""
    device, _ = target
    x = torch.randn(2, 7, 24, device=device, requires_grad=True)
    weight = (torch.randn(97, 24, device=device) / 24**0.5).requires_grad_()
    labels = torch.randint(0, 97, (2, 7), device=device)
    labels[0, :3] = options.get("ignore_index", -100)
    ours = remat.linear_cross_entropy(x, weight, labels, reduction=reduction, **options)
    x64, w64 = float64_leaves(x, weight)
    logits = F.linear(x64, w64)
    exact = F.cross_entropy(logits.transpose(1, 2), labels, reduction=reduction, **options)  # (N, C, d) layout
    assert ours.shape == exact.shape and rel_error(ours, exact) <= 1e-5
    cotangent = torch.randn_like(exact)
    for got, want in zip(grads_of(ours, [x, weight], cotangent.float()), grads_of(exact, [x64, w64], cotangent)):
        assert rel_error(got, want) <= 1e-5


def test_z_loss_is_averaged_as_the_loss_is(target):
    """loss = mean over counted tokens of (cross-entropy + z_loss * lse^2), as OLMo and PaLM train."""
    device, _ = target
    x, weight, _, labels = make_case(13, 24, 97, torch.float32, device, ignored=(0, 5))
    ours = remat.linear_cross_entropy(x, weight, labels, z_loss=1e-2)
    logits = F.linear(x.double(), weight.double())
    counted = labels != -100
    per_token = F.cross_entropy(logits, labels, reduction="none") + 1e-2 * torch.logsumexp(logits, dim=1) ** 2
    assert rel_error(ours, per_token[counted].mean()) <= 1e-6


@pytest.mark.parametrize("num_items", ["int", "tensor"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["llama", "gemma2-softcap"])
def test_transformers_causal_lm_loss(target, num_items, softcap):
    """transformers' ForCausalLMLoss on the model's logits (Gemma 2/3 softcap them first, as their
    final_logit_softcapping does) with the Trainer's num_items_in_batch, against remat on the hidden
    states and the shifted labels."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    device, _ = target
    hidden = torch.randn(2, 9, 24, device=device, requires_grad=True)
    head = torch.nn.Linear(24, 101, bias=False, device=device)
    labels = torch.randint(0, 101, (2, 9), device=device)
    labels[1, :4] = -100  # a prompt that is not trained on
    counted = int((labels[:, 1:] != -100).sum())
    items = counted + 3 if num_items == "int" else torch.tensor(counted + 3)  # as across accumulation steps

    logits = head(hidden) if softcap is None else softcap * torch.tanh(head(hidden) / softcap)
    theirs = loss_utils.ForCausalLMLoss(logits, labels, 101, num_items_in_batch=items)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    ours = remat.linear_cross_entropy(hidden, head.weight, shifted, softcap=softcap, num_items_in_batch=items)
    assert ours.dtype == theirs.dtype == torch.float32
    assert rel_error(ours, theirs) <= 1e-5
    (dx,) = torch.autograd.grad(ours, hidden)
    (want,) = torch.autograd.grad(theirs, hidden)
    assert rel_error(dx, want) <= 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_token_ignored_gives_zero_loss_and_zero_gradients(target, reduction):
    """No counted token: loss 0 (PyTorch's mean would be 0 / 0 = NaN), no NaN anywhere, zero gradients."""
    device, _ = target
    x, weight, bias, _ = make_case(9, 24, 257, torch.float32, device, bias=True)
    labels = torch.full((9,), -100, device=device)
    loss = remat.linear_cross_entropy(x, weight, labels, bias, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.backward(torch.ones_like(loss))
    for tensor in (x, weight, bias):
        assert torch.equal(tensor.grad, torch.zeros_like(tensor)), tensor.shape


def test_weight_tied_to_the_embedding_accumulates_both_gradients(target):
    """A head sharing the embedding's Parameter: the weight's gradient is the embedding's plus the head's."""
    device, _ = target

    def run(loss_fn):
        torch.manual_seed(7)
        embedding = torch.nn.Embedding(211, 24, device=device)
        head = torch.nn.Linear(24, 211, bias=False, device=device)
        head.weight = embedding.weight
        ids = torch.randint(0, 211, (3, 8), device=device)
        hidden = torch.tanh(embedding(ids))
        loss_fn(hidden, head.weight, ids.roll(-1, dims=1)).backward()
        return embedding.weight.grad

    ours = run(remat.linear_cross_entropy)
    theirs = run(lambda h, w, t: F.cross_entropy(F.linear(h, w).reshape(-1, 211), t.reshape(-1)))
    assert rel_error(ours, theirs) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8], ids=str)
def test_integer_target_dtypes_give_int64s_result(target, dtype):
    device, _ = target
    x, weight, _, labels = make_case(11, 24, 200, torch.float32, device, ignored=())
    expected = remat.linear_cross_entropy(x, weight, labels, reduction="none")
    assert torch.equal(remat.linear_cross_entropy(x, weight, labels.to(dtype), reduction="none"), expected)


def test_one_token_of_a_1d_input(target):
    """x (K,) and a 0-dim target, as F.cross_entropy takes logits (C,) and a class index."""
    device, _ = target
    x = torch.randn(24, device=device, requires_grad=True)
    weight = torch.randn(31, 24, device=device) / 24**0.5
    label = torch.tensor(17, device=device)
    for reduction in ("mean", "none"):
        ours = remat.linear_cross_entropy(x, weight, label, reduction=reduction)
        want = F.cross_entropy(F.linear(x.double(), weight.double()), label, reduction=reduction)
        assert ours.shape == want.shape == () and rel_error(ours, want) <= 1e-6


# --- a target outside the vocabulary: an error, or a NaN where it cannot be checked -----------------


def test_a_target_outside_the_vocabulary_is_nan_where_it_is_not_checked(target):
    """Under torch.compile (no values read) the op itself runs: that token's loss and gradient row are NaN,
    the others exact; never a finite wrong answer."""
    device, _ = target
    x, weight, _, labels = make_case(6, 24, 97, torch.float32, device, ignored=(1,))
    labels[3] = 97
    loss, lse = lce_ops.linear_cross_entropy_fwd(x.detach(), weight.detach(), None, labels, -100, 0.0, 0.0, None)
    assert torch.isnan(loss[3]) and torch.isfinite(loss[[0, 1, 2, 4, 5]]).all() and loss[1] == 0
    dx, _, _ = lce_ops.linear_cross_entropy_bwd(torch.ones(6, device=device), x.detach(), weight.detach(), None,
                                                labels, lse, -100, 0.0, 0.0, None, True, False, False)
    assert torch.isnan(dx[3]).all() and torch.isfinite(dx[[0, 1, 2, 4, 5]]).all()


# --- -inf logits: as F.cross_entropy takes them -----------------------------------------------------
# A -inf bias entry (a vocabulary masked out, padding classes) makes those logits -inf. Where a
# vocabulary block's logits are all -inf, the online log-sum-exp's running maximum is -inf: such a
# block must add exp(-inf) = 0, not exp(-inf - -inf) = NaN. Cases: the forward's first vocabulary
# block (64 columns, in every dtype; with 257 classes also a whole split) -inf, the targets elsewhere
# (a finite loss); some targets' own logit -inf (loss +inf, finite gradients, as PyTorch's); every
# logit -inf (NaN loss and gradients for the counted tokens, as F.cross_entropy). Plain, with label
# smoothing and z-loss (which sum every logit: +inf where one is -inf), and softcapped (c tanh(-inf / c)
# = -c: finite again). An ignored token gives 0 and zero gradients whatever its logits (remat's rule;
# PyTorch's log_softmax backward makes an ignored row whose logits are all -inf NaN in dx).
MINUS_INF_CASES = ["a-block", "the-target", "every-logit"]
MINUS_INF_OPTIONS = {"plain": dict(), "smoothing-z-loss": dict(label_smoothing=0.1, z_loss=1e-3),
                     "softcap": dict(softcap=5.0)}
MINUS_INF_BLOCK = 64  # the forward's vocabulary block in every dtype
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as numerics.REL_TOL


def _minus_inf_case(case, dtype, device):
    """x, weight, a bias with -inf entries and targets, for one of MINUS_INF_CASES (token 2 ignored)."""
    x, weight, bias, labels = make_case(6, 29, 257, dtype, device, bias=True, ignored=(2,))
    with torch.no_grad():
        bias[: None if case == "every-logit" else MINUS_INF_BLOCK] = float("-inf")
    in_block = (labels >= 0) & (labels < MINUS_INF_BLOCK)
    if case == "a-block":
        labels = torch.where(in_block, labels + MINUS_INF_BLOCK, labels)
    elif case == "the-target":
        labels[[0, 3]] = torch.tensor([5, MINUS_INF_BLOCK - 1], device=device)
    return x, weight, bias, labels


def _cross_entropy_float64(x, weight, bias, labels, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Per-token F.cross_entropy in float64 (plus the z-loss of the counted tokens)."""
    logits = F.linear(x, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        losses = losses + torch.where(labels != -100, z_loss * torch.logsumexp(logits, dim=1) ** 2, 0.0)
    return losses


def _assert_as_float64(name, ours, exact, dtype):
    """NaN and ±inf exactly where the float64 result has them; elsewhere within the dtype's bound."""
    assert torch.equal(ours.isnan(), exact.isnan()), f"{name}: NaN where float64 has none, or none where it has"
    infinite = exact.isinf()
    assert torch.equal(ours.isinf(), infinite) and torch.equal(ours[infinite], exact[infinite].to(ours.dtype)), (
        f"{name}: ±inf differs from float64's")
    finite = exact.isfinite()
    error = rel_error(ours[finite], exact[finite])
    assert error <= REL_TOL[dtype], f"{name}: error {error:.3g} > {REL_TOL[dtype]:.1g}"


def _loss_and_grads(x, weight, bias, labels, cotangent, options, backend=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    with remat.use_backend(backend) if backend else contextlib.nullcontext():
        loss = remat.linear_cross_entropy(*leaves[:2], labels, leaves[2], reduction="none", **options)
        return [loss.detach(), *torch.autograd.grad(loss, leaves, cotangent)]


# The interpreter's numpy warns where the math is NaN or -inf (every-logit: -inf - -inf, log(0)): meant.
@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered:RuntimeWarning")
@pytest.mark.parametrize("options", MINUS_INF_OPTIONS.values(), ids=MINUS_INF_OPTIONS.keys())
@pytest.mark.parametrize("case", MINUS_INF_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits_as_f_cross_entropy(target, dtype, case, options):
    device, _ = target
    x, weight, bias, labels = _minus_inf_case(case, dtype, device)
    cotangent = torch.randn(labels.shape, device=device)
    leaves64 = float64_leaves(x, weight, bias)
    exact = _cross_entropy_float64(*leaves64, labels, **options)
    exact = [exact.detach(), *torch.autograd.grad(exact, leaves64, cotangent.double())]
    counted = labels != -100
    exact[1] = torch.where(counted[:, None], exact[1], 0.0)  # remat's rule for an ignored token (above)
    ours = _loss_and_grads(x, weight, bias, labels, cotangent, options)
    reference = _loss_and_grads(x, weight, bias, labels, cotangent, options, backend="reference")
    for name, mine, ref, want in zip(["loss", "dx", "dweight", "dbias"], ours, reference, exact):
        _assert_as_float64(name, mine, want, dtype)
        _assert_as_float64(f"{name} (reference)", ref, want, dtype)
    if case == "a-block" and "label_smoothing" not in options:
        assert torch.isfinite(ours[0]).all(), "a block of -inf logits must leave the loss finite"
    # The saved log-sum-exp, from the per-split parts (with 257 classes the first split is all -inf):
    # torch.logsumexp's, -inf for a row whose every logit is -inf (the log of an empty sum).
    logits64 = F.linear(*(t.detach() for t in leaves64))
    if options.get("softcap") is not None:
        logits64 = options["softcap"] * torch.tanh(logits64 / options["softcap"])
    settings = (-100, options.get("label_smoothing", 0.0), options.get("z_loss", 0.0), options.get("softcap"))
    _, lse = lce_ops.linear_cross_entropy_fwd(x.detach(), weight.detach(), bias.detach(), labels, *settings)
    _assert_as_float64("lse", lse, torch.logsumexp(logits64, dim=1), torch.float32)


# --- what autograd keeps ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_are_x_the_target_and_4_bytes_a_token(target, dtype, reduction):
    """Beyond the weight (a parameter): remat keeps x, the int64 target and the fp32 lse (4 bytes a
    token), and for the mean its fp32 count (4 bytes); the stock computation keeps x, the target, the
    (tokens x vocabulary) log-softmax in the logits' dtype and nll_loss's total weight (one element of
    that dtype, whatever the reduction); transformers' loss, which upcasts the logits, keeps the
    log-softmax in fp32."""
    device, _ = target
    tokens, hidden, vocab = 24, 32, 257
    x, weight, _, labels = make_case(tokens, hidden, vocab, dtype, device)
    elem = x.element_size()
    inputs = x.numel() * elem + labels.numel() * 8
    ours = saved_bytes(lambda: remat.linear_cross_entropy(x, weight, labels, reduction=reduction), exclude=[weight])
    assert ours == inputs + 4 * tokens + (4 if reduction == "mean" else 0)
    theirs = saved_bytes(lambda: F.cross_entropy(F.linear(x, weight), labels, reduction=reduction), exclude=[weight])
    assert theirs == inputs + tokens * vocab * elem + elem
    upcast = saved_bytes(lambda: F.cross_entropy(F.linear(x, weight).float(), labels, reduction=reduction),
                         exclude=[weight])
    assert upcast == inputs + tokens * vocab * 4 + 4


# --- deterministic gradients ---------------------------------------------------------------------


def test_gradients_are_bitwise_reproducible(target):
    device, _ = target
    x, weight, bias, labels = make_case(40, 64, 1003, torch.float32, device, bias=True)  # three chunks on CPU
    runs = []
    for _ in range(2):
        for t in (x, weight, bias):
            t.grad = None
        remat.linear_cross_entropy(x, weight, labels, bias, label_smoothing=0.1).backward()
        runs.append([t.grad.clone() for t in (x, weight, bias)])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_the_kernels_use_no_atomics():
    """dW and db are fixed-partition sums (dW rows disjoint per chunk, db partials summed in a second
    kernel): an atomic add anywhere would make them depend on scheduling."""
    source = inspect.getsource(lce_kernels)
    assert not re.search(r"\batomic_\w+\(", source)


def test_frozen_head_skips_the_parameter_gradients(target):
    """A frozen head with a bias (LoRA fine-tuning): the backward op is asked for dx only, forms no dW nor
    db, and dx is right (no db partial sum is written anywhere)."""
    device, _ = target
    x, weight, bias, labels = make_case(13, 24, 97, torch.float32, device, bias=True)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    remat.linear_cross_entropy(x, weight, labels, bias).backward()
    assert weight.grad is None and bias.grad is None
    x64 = x.detach().double().requires_grad_()
    stock(x64, weight.double(), bias.double(), labels).backward()
    assert rel_error(x.grad, x64.grad) <= 1e-5
    asked = lce_ops.linear_cross_entropy_bwd(torch.ones(13, device=device), x.detach(), weight, bias, labels,
                                             torch.zeros(13, device=device), -100, 0.0, 0.0, None, True, False, False)
    assert asked[1].numel() == 0 and asked[2].numel() == 0


# --- the reference at real vocabularies, chunked over tokens ---------------------------------------


@pytest.mark.parametrize("vocab", [50257, 151936, 256000])
def test_reference_at_real_vocabularies_in_token_chunks(reference_backend, monkeypatch, vocab):
    """GPT-2's, Qwen 2's and Gemma's vocabularies (the first no multiple of 16) on the reference, forced
    into one token per chunk, against one float64 F.cross_entropy over all tokens."""
    monkeypatch.setattr(lce_ops, "REFERENCE_CHUNK_ELEMENTS", vocab)
    x, weight, bias, labels = make_case(3, 8, vocab, torch.float32, "cpu", bias=True, ignored=(1,))
    loss = remat.linear_cross_entropy(x, weight, labels, bias, label_smoothing=0.05)
    loss.backward()
    x64, w64, b64 = float64_leaves(x, weight, bias)
    exact = stock(x64, w64, b64, labels, label_smoothing=0.05)
    exact.backward()
    for got, want in ((loss, exact), (x.grad, x64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
        assert rel_error(got, want) <= 1e-5


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_float64_is_pytorchs_float64(target, options):
    """float64 inputs run the reference, in float64 throughout: PyTorch's float64 to its rounding."""
    device, _ = target
    x, weight, bias, labels = make_case(37, 29, 257, torch.float64, device, bias=bool(options))
    leaves = [x, weight, bias]
    ours = remat.linear_cross_entropy(x, weight, labels, bias, reduction="none", **options)
    exact = stock(x, weight, bias, labels, reduction="none", **options)
    cotangent = torch.randn_like(exact)
    assert ours.dtype == torch.float64 and rel_error(ours, exact) <= 1e-12
    for got, want in zip(grads_of(ours, leaves, cotangent), grads_of(exact, leaves, cotangent)):
        assert got.dtype == torch.float64 and rel_error(got, want) <= 1e-12


# --- double backward -----------------------------------------------------------------------------------


def test_double_backward_matches_pytorch(target):
    """A gradient penalty: the first backward with create_graph=True runs the differentiable reference."""
    device, _ = target
    x, weight, bias, labels = make_case(7, 16, 53, torch.float32, device, bias=True)
    options = dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0)

    def second_order(fn, leaves):
        grads = torch.autograd.grad(fn(*leaves, labels), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)

    ours = second_order(lambda x, w, b, t: remat.linear_cross_entropy(x, w, t, b, **options), [x, weight, bias])
    exact = second_order(lambda x, w, b, t: stock(x, w, b, t, **options), float64_leaves(x, weight, bias))
    for got, want in zip(ours, exact):
        assert rel_error(got, want) <= 1e-5


# --- the module ------------------------------------------------------------------------------------


def test_module_from_linear_shares_the_linears_parameters(target):
    device, _ = target
    linear = torch.nn.Linear(24, 97, device=device)
    module = remat.nn.LinearCrossEntropy.from_linear(linear, label_smoothing=0.1, ignore_index=0)
    assert module.weight is linear.weight and module.bias is linear.bias
    assert dict(module.named_parameters()).keys() == dict(linear.named_parameters()).keys()
    x = torch.randn(5, 24, device=device)
    labels = torch.tensor([0, 3, 96, 0, 40], device=device)
    module(x, labels).backward()
    want = F.cross_entropy(linear(x.double().float()), labels, label_smoothing=0.1, ignore_index=0)
    assert rel_error(module(x, labels), want) <= 1e-5
    assert linear.weight.grad is not None and linear.bias.grad is not None


def test_module_holds_a_linears_parameters_and_state_dict(target):
    device, _ = target
    module = remat.nn.LinearCrossEntropy(24, 97, bias=True, reduction="sum", z_loss=1e-4, device=device)
    linear = torch.nn.Linear(24, 97, device=device)
    module.load_state_dict(linear.state_dict())
    assert torch.equal(module.weight, linear.weight) and torch.equal(module.bias, linear.bias)
    x, labels = torch.randn(2, 5, 24, device=device), torch.randint(0, 97, (2, 5), device=device)
    assert rel_error(module(x, labels), stock(x, linear.weight, linear.bias, labels, reduction="sum",
                                              z_loss=1e-4)) <= 1e-5
    assert "z_loss=0.0001" in repr(module) and "reduction='sum'" in repr(module)


# --- bad input: a clear error naming the argument ------------------------------------------------


def _call(**changes):
    """remat.linear_cross_entropy on x (4, 8), weight (11, 8), bias (11,), target (4,), some replaced."""
    args = dict(x=torch.randn(4, 8), weight=torch.randn(11, 8), target=torch.tensor([0, 3, -100, 10]), bias=None)
    args.update(changes)
    return functools.partial(remat.linear_cross_entropy, args.pop("x"), args.pop("weight"), args.pop("target"),
                             **args)


BAD_INPUT = [
    ("x-int", _call(x=torch.ones(4, 8, dtype=torch.int64)), TypeError, "x", r"x must have dtype .*got torch\.int64"),
    ("x-0-dim", _call(x=torch.tensor(1.0)), ValueError, "x", r"at least one dim"),
    ("weight-width", _call(weight=torch.randn(11, 9)), ValueError, "weight", r"\(vocabulary, 8\).*got \(11, 9\)"),
    ("weight-1-dim", _call(weight=torch.randn(8)), ValueError, "weight", r"got \(8,\)"),
    ("weight-dtype", _call(weight=torch.randn(11, 8, dtype=torch.float16)), TypeError, "weight",
     r"weight has dtype torch\.float16 but x has torch\.float32"),
    ("weight-device", _call(weight=torch.randn(11, 8, device="meta")), ValueError, "weight",
     r"weight is on meta but x is on cpu"),
    ("bias-shape", _call(bias=torch.randn(10)), ValueError, "bias", r"bias must have shape \(11,\), got \(10,\)"),
    ("bias-dtype", _call(bias=torch.randn(11, dtype=torch.float16)), TypeError, "bias", r"got torch\.float16"),
    ("target-list", _call(target=[0, 3, 1, 10]), TypeError, "target", r"torch\.Tensor.*got list"),
    ("target-float", _call(target=torch.zeros(4)), TypeError, "target", r"integer dtype.*got torch\.float32"),
    ("target-shape", _call(target=torch.zeros(4, 1, dtype=torch.int64)), ValueError, "target",
     r"target must have x's shape without its last dim, \(4,\), got \(4, 1\)"),
    ("target-device", _call(target=torch.zeros(4, dtype=torch.int64, device="meta")), ValueError, "target",
     r"target is on meta but x is on cpu"),
    ("target-vocab", _call(target=torch.tensor([0, 11, 1, 2])), ValueError, "target", r"\[0, 11\).*got 11"),
    ("target-negative", _call(target=torch.tensor([0, -1, 1, 2])), ValueError, "target", r"got -1"),
    ("reduction", _call(reduction="avg"), ValueError, "reduction", r"one of \('mean', 'sum', 'none'\), got 'avg'"),
    ("ignore-index", _call(ignore_index=1.5), TypeError, "ignore_index", r"must be an int, got 1\.5"),
    ("label-smoothing", _call(label_smoothing=1.5), ValueError, "label_smoothing", r"in \[0\.0, 1\.0\], got 1\.5"),
    ("z-loss", _call(z_loss=-1.0), ValueError, "z_loss", r"got -1\.0"),
    ("z-loss-nan", _call(z_loss=float("nan")), ValueError, "z_loss", r"finite float, got nan"),
    ("softcap", _call(softcap=0.0), ValueError, "softcap", r"in \(0\.0, inf\], got 0\.0"),
    ("num-items-sum", _call(num_items_in_batch=3, reduction="sum"), ValueError, "num_items_in_batch",
     r"reduction must be 'mean'"),
    ("num-items-zero", _call(num_items_in_batch=0), ValueError, "num_items_in_batch", r"positive number.*got 0"),
    ("num-items-tensor", _call(num_items_in_batch=torch.tensor([1, 2])), ValueError, "num_items_in_batch",
     r"one-element"),
    ("module-option", lambda: remat.nn.LinearCrossEntropy(8, 11, label_smoothing=2.0), ValueError,
     "label_smoothing", r"got 2\.0"),
    ("from-linear", lambda: remat.nn.LinearCrossEntropy.from_linear(torch.nn.Conv1d(8, 11, 1)), TypeError, "linear",
     r"torch\.nn\.Linear, got Conv1d"),
    ("from-linear-option", lambda: remat.nn.LinearCrossEntropy.from_linear(torch.nn.Linear(8, 11), smoothing=0.1),
     TypeError, "smoothing", r"unknown loss options \['smoothing'\]"),
]


@pytest.mark.parametrize("call, error, argument, pattern", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUT])
def test_bad_input_raises_naming_the_argument(call, error, argument, pattern):
    assert_raises_naming(call, error, argument, pattern)
