"""own_views: the q, k and v an attention keeps for its backward hold their own parts only. A view of a
larger tensor that the three views do not cover (a fused qkv projection's output whose k and v were copied
into a cache, or whose q and k a rotary embedding copied) would keep that whole tensor alive: it is copied.
Views that cover their tensor (GPT-2's q, k and v of c_attn's output) are returned as they are."""

import torch

from remat.ops.qk_norm_attention import own_views


def _qkv_views(batch=2, seq=5, heads=3, head_dim=4):
    """q, k and v as transformers splits a fused projection's output: views of one (batch, seq, 3 * width)."""
    fused = torch.randn(batch, seq, 3 * heads * head_dim)
    return [t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in fused.split(heads * head_dim, dim=-1)]


def test_views_covering_their_tensor_are_returned_as_they_are():
    q, k, v = _qkv_views()
    assert all(a is b for a, b in zip(own_views(q, k, v), (q, k, v)))


def test_a_view_of_a_tensor_the_others_do_not_cover_is_copied():
    q, k, v = _qkv_views()
    k_copy, v_copy = k.clone(), v.clone()  # a cache filled with k and v: q alone views the projection's output
    got = own_views(q, k_copy, v_copy)
    assert got[0] is not q and got[0]._base is None and torch.equal(got[0], q)
    assert got[1] is k_copy and got[2] is v_copy


def test_views_of_two_tensors_are_judged_per_tensor():
    q, k, v = _qkv_views()
    q2, k2, _ = _qkv_views()  # q and k of one projection, v of another: neither is covered
    got = own_views(q, k2, v)
    assert got[1] is not k2 and torch.equal(got[1], k2)
    assert got[0] is not q and got[2] is not v  # two thirds of their tensor each
    assert all(t._base is None for t in got)
    got = own_views(q2, k2, v)
    assert got[0] is not q2 and got[1] is not k2 and got[2] is not v


def test_nothing_is_copied_without_grad():
    q, k, v = _qkv_views()
    k_copy, v_copy = k.clone(), v.clone()
    with torch.no_grad():
        assert own_views(q, k_copy, v_copy)[0] is q


def test_plain_tensors_are_returned_as_they_are():
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    assert all(a is b for a, b in zip(own_views(q, k, v), (q, k, v)))


def test_views_of_one_tensor_they_do_not_cover_are_copied():
    fused = torch.randn(2, 5, 4 * 12)  # q, k, v and a fourth part (a gate, as some fused projections hold)
    q, k, v, _ = (t.view(2, 5, 3, 4).transpose(1, 2) for t in fused.split(12, dim=-1))
    got = own_views(q, k, v)
    assert all(a is not b and a._base is None and torch.equal(a, b) for a, b in zip(got, (q, k, v)))
