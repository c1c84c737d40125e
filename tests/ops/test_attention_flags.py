"""remat.ops.attention.AttentionFlags: attention's flags checked once for calls that repeat them (a
converted model's attention module); the same results as remat.attention, the same errors."""

import copy
import pickle

import pytest
import torch

from remat.ops import attention as attn_ops
from remat.ops.attention import AttentionFlags, attention

# (heads, kv_heads, seqlen, head_dim, causal, softmax_scale, softcap, dropout_p, window_size): plain, GQA
# with a window and softcap, dropout; lengths not a multiple of the interpreter's 16-blocks.
CASES = [
    pytest.param((2, 2, 17, 32, True, None, 0.0, 0.0, (-1, -1)), id="causal"),
    pytest.param((4, 2, 19, 32, False, 0.3, 5.0, 0.0, (6, 3)), id="gqa-window-softcap"),
    pytest.param((2, 1, 17, 32, True, None, 0.0, 0.25, (-1, -1)), id="mqa-dropout"),
]


def qkv(heads, kv_heads, seq, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, seq, head_dim), (2, kv_heads, seq, head_dim), (2, kv_heads, seq, head_dim)]
    return [torch.randn(s, generator=generator).to(dtype).requires_grad_() for s in shapes]


def out_and_grads(fn, tensors, seed=1):
    torch.manual_seed(seed)  # the dropout seed drawn at the call
    out = fn(*tensors)
    out.backward(torch.ones_like(out))
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_flags_compute_what_attention_computes(case, dtype):
    """Outputs and gradients bit for bit remat.attention's with the same flags, at the first call (q, k
    and v checked) and the next ones (taken as like the checked ones)."""
    heads, kv_heads, seq, head_dim, causal, scale, softcap, dropout_p, window = case
    flags = AttentionFlags(causal, scale, softcap, dropout_p)
    for seed in (0, 1):
        tensors = qkv(heads, kv_heads, seq, head_dim, dtype, seed)
        want = out_and_grads(lambda q, k, v: attention(q, k, v, causal, scale, window_size=window, softcap=softcap,
                                                       dropout_p=dropout_p), tensors)
        got = out_and_grads(lambda q, k, v: flags(q, k, v, window), tensors)
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1], want[1]):
            assert torch.equal(g, w)


@pytest.mark.parametrize("flags, error, name", [
    (("yes", None, 0.0, 0.0), TypeError, "causal"),
    ((True, float("nan"), 0.0, 0.0), ValueError, "softmax_scale"),
    ((True, True, 0.0, 0.0), ValueError, "softmax_scale"),
    ((True, None, -1.0, 0.0), ValueError, "softcap"),
    ((True, None, 0.0, 1.0), ValueError, "dropout_p"),
])
def test_bad_flags_are_refused_naming_the_argument(flags, error, name):
    with pytest.raises(error, match=name):
        AttentionFlags(*flags)


def test_q_k_v_unlike_the_checked_ones_are_checked_again():
    """Each call's q, k and v are checked unless shapes, dtypes and devices are those of the last ones that
    passed: another k's shape, v's dtype, a 3-D q or a list after good calls get attention's errors."""
    flags = AttentionFlags(True, None, 0.0, 0.0)
    q, k, v = qkv(2, 2, 17, 32)
    flags(q, k, v, (-1, -1))
    flags(q, k, v, (-1, -1))
    with pytest.raises(ValueError, match="k must have shape"):
        flags(q, k[..., :16], v[..., :16], (-1, -1))
    with pytest.raises(TypeError, match="v must have q's dtype"):
        flags(q, k, v.double(), (-1, -1))
    with pytest.raises(ValueError, match="q must be 4-D"):
        flags(q[0], k, v, (-1, -1))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flags(q, k.tolist(), v, (-1, -1))
    flags(q, k, v, (-1, -1))  # the good ones still pass


def test_checks_once_for_calls_alike(monkeypatch):
    """q, k and v like the last ones that passed are not checked again (what the flags are for)."""
    checked = []
    check = attn_ops._check_qkv
    monkeypatch.setattr(attn_ops, "_check_qkv", lambda *a: (checked.append(1), check(*a)))
    flags = AttentionFlags(True, None, 0.0, 0.0)
    for seed in range(3):
        flags(*qkv(2, 2, 17, 32, seed=seed), (-1, -1))
    assert len(checked) == 1
    flags(*qkv(2, 2, 18, 32), (-1, -1))
    assert len(checked) == 2


def test_under_autocast_the_call_is_attention_s():
    """Under autocast the call is remat.attention's own (q, k and v cast to the autocast dtype, as sdpa's)."""
    flags = AttentionFlags(True, 0.2, 0.0, 0.0)
    tensors = qkv(2, 2, 17, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = out_and_grads(lambda q, k, v: flags(q, k, v, (-1, -1)), tensors)
        want = out_and_grads(lambda q, k, v: attention(q, k, v, True, 0.2), tensors)
    assert got[0].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g, w)


def test_dropout_draws_its_seed_at_each_call():
    flags = AttentionFlags(False, None, 0.0, 0.5)
    q, k, v = (t.detach() for t in qkv(2, 2, 17, 32))
    torch.manual_seed(3)
    first, second = flags(q, k, v, (-1, -1)), flags(q, k, v, (-1, -1))
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    assert torch.equal(flags(q, k, v, (-1, -1)), first)


def test_a_copy_or_pickle_checks_afresh():
    flags = AttentionFlags(True, 0.5, 2.0, 0.1)
    flags(*qkv(2, 2, 17, 32), (-1, -1))
    for other in (copy.deepcopy(flags), pickle.loads(pickle.dumps(flags))):
        assert other._like is None
        assert (other.causal, other.softmax_scale, other.softcap, other.dropout_p) == (True, 0.5, 2.0, 0.1)
