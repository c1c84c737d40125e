"""Linear + cross-entropy cases (an LM head and its loss, T tokens of hidden h against a vocabulary of V):
remat against the stock matmul + F.cross_entropy in eager PyTorch, torch.compile of it, and, on a GPU
and when installed, Liger's LigerFusedLinearCrossEntropyLoss and Apple's cut-cross-entropy.

Forward + backward of the mean loss (a training step's `loss.backward()`), timed and its peak memory
measured in the same run. FLOP model: the stock computation's three products, logits 2·T·V·h, then
dx and dW 2·T·V·h each: 6·T·V·h. remat and cut-cross-entropy compute the logits a second time in
the backward (8·T·V·h) and are charged nothing for it: their rate is the stock-equivalent work per
second, so the rates compare times. The saved-bytes column is what each keeps for the backward:
the stock computation its (T x V) log-softmax, remat the fp32 lse (4·T bytes), each also the target.

Cases: bf16, hidden 4096, vocabularies 32000 (Llama 2), 128256 (Llama 3) and 256000 (Gemma), at
8192 and 32768 tokens (--quick: 8192); about 5 % of the targets ignored. Checked against the stock
computation before timing: the loss and the gradients of x and the weight, at the case's hidden size
and vocabulary but on its first CHECK_TOKENS tokens, against a float64 reference (remat's own in
float64, which holds a chunk of tokens' logits at a time). At all 8192 tokens the float64 reference
would be 8·T·V·h = 9e15 to 3e17 FLOPs a case: two minutes to an hour of an H200's FP64 tensor
cores; at 64 tokens it is 1-8 s. The kernels' numerics at many tokens (several backward chunks) are
the tests' subject (tests/ops/test_linear_cross_entropy.py).
"""

import functools
import importlib

import torch
import torch.nn.functional as F

import remat

from .cases import Case, Variant, check_against, op_built, ours_by_backend
from .check import outputs_and_grads

GPU_HIDDEN, GPU_VOCABS, GPU_TOKENS, QUICK_TOKENS = 4096, (32000, 128256, 256000), (8192, 32768), (8192,)
CPU_HIDDEN, CPU_VOCABS, CPU_TOKENS = 64, (1003,), (48,)
SIZES_MEAN = "token counts T"  # what cases(sizes=...), `remat bench --shapes`, sets
IGNORED_FRACTION = 0.05  # targets set to ignore_index (padding, prompt tokens)
CHECK_TOKENS = 64  # the tokens the check runs on (see the module docstring)


def _remat(x, weight, target):
    return remat.linear_cross_entropy(x, weight, target)


def _torch(x, weight, target):
    return F.cross_entropy(F.linear(x, weight), target)


@functools.cache
def _compiled():
    return torch.compile(_torch, dynamic=False)  # one kernel set per shape


def _liger():
    module = importlib.import_module("liger_kernel.transformers")
    loss = module.LigerFusedLinearCrossEntropyLoss()
    return lambda x, weight, target: loss(weight, x, target)


def _cut_cross_entropy():
    function = importlib.import_module("cut_cross_entropy").linear_cross_entropy
    return lambda x, weight, target: function(x, weight, target)


def implementations(device):
    """A Variant (a function of x, weight, target) for every implementation that can run on `device`."""
    impls = [Variant(name, True, _remat, backend) for name, backend in ours_by_backend(device)]
    impls += [Variant("torch", False, _torch), Variant("torch.compile", False, lambda *a: _compiled()(*a),
                                                       compiles=True)]
    if device.type == "cuda":  # both peers are Triton kernels for CUDA tensors only
        for name, build in (("liger", _liger), ("cut-cross-entropy", _cut_cross_entropy)):
            try:
                impls.append(Variant(name, False, build()))
            except Exception:  # not installed, or installed but broken against this torch/triton
                pass
    return impls


def _make_inputs(tokens, hidden, vocab, dtype, device):
    def make():
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        # nn.Linear's scale: logits of order 1, as a trained head gives them, not a near one-hot softmax.
        weight = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_()
        target = torch.randint(0, vocab, (tokens,), device=device)
        target[torch.rand(tokens, device=device) < IGNORED_FRACTION] = -100
        checked_x = x.detach()[:CHECK_TOKENS].clone().requires_grad_()
        return x, weight, target, torch.ones((), device=device), checked_x, target[:CHECK_TOKENS]

    return make


def _build(fn):
    """The Built of fn on a case's inputs: the timed step on all its tokens, the check's outputs on
    the first CHECK_TOKENS."""
    def build(inputs):
        x, weight, target, dy, checked_x, checked_target = inputs
        built = op_built("fwd+bwd", lambda: fn(x, weight, target), {"x": x, "weight": weight}, dy)
        built.outputs = lambda: outputs_and_grads(lambda: fn(checked_x, weight, checked_target),
                                                  {"x": checked_x, "weight": weight}, dy)
        return built

    return build


def _float64_reference(inputs):
    """The check's loss and gradients in float64 through remat's reference (float64 inputs run it),
    which holds one chunk of tokens' logits at a time."""
    _, weight, _, dy, checked_x, checked_target = inputs
    leaves = {"x": checked_x.detach().double().requires_grad_(), "weight": weight.detach().double().requires_grad_()}
    return outputs_and_grads(lambda: _remat(leaves["x"], leaves["weight"], checked_target), leaves, dy.double())


def sanitize_calls(device, dtype):
    """Calls of remat.linear_cross_entropy that bench/sanitize_check.py runs, forward and backward, under
    compute-sanitizer: 37 tokens of a prime width as a strided view, a vocabulary that is no multiple
    of any block (1003) with a bias, softcap, label smoothing and z-loss, ignored tokens; then one
    token per row reduced "none"."""
    wide = torch.randn(37, 32, device=device, dtype=dtype)
    x = wide[:, :29].detach().requires_grad_()
    weight = (torch.randn(1003, 29, device=device) / 29**0.5).to(dtype).requires_grad_()
    bias = torch.randn(1003, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 1003, (37,), device=device)
    target[::5] = -100
    yield functools.partial(remat.linear_cross_entropy, x, weight, target, bias, label_smoothing=0.1, z_loss=1e-4,
                            softcap=30.0)
    yield functools.partial(remat.linear_cross_entropy, x[:1], weight, target[1:2], reduction="none")


def cases(device, dtypes, quick, sizes=None):
    on_gpu = device.type == "cuda"
    hidden, vocabs = (GPU_HIDDEN, GPU_VOCABS) if on_gpu else (CPU_HIDDEN, CPU_VOCABS)
    token_counts = sizes or ((QUICK_TOKENS if quick else GPU_TOKENS) if on_gpu else CPU_TOKENS)
    impls = implementations(device)
    check = check_against(_build(_torch), _float64_reference)
    for dtype in dtypes:
        for vocab in vocabs:
            for tokens in token_counts:
                yield Case(
                    op="linear_cross_entropy", mode="fwd+bwd", dtype=dtype, shape=f"T={tokens} h={hidden} V={vocab}",
                    size=tokens * vocab, unit="TFLOP/s", work=6 * tokens * vocab * hidden,
                    make_inputs=_make_inputs(tokens, hidden, vocab, dtype, device),
                    implementations=[impl.implementation(_build) for impl in impls], check=check,
                )
