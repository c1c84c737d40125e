"""The attention tests' comparison of a run with its float64 reference, their inputs that reveal
dropout's mask, and the switch to deterministic algorithms (the benchmark's)."""

import torch

from remat.bench.cases import deterministic_algorithms  # noqa: F401  (the tests' import of it)

from numerics import REL_TOL, rel_error

# A dropout seed whose two 32-bit halves (Philox's key) both matter, the high one negative as int64.
DROPOUT_SEED = torch.tensor([-0x3C6EF372FE94F82B], dtype=torch.int64)


def assert_matches_float64(ours, ref, dtype, exactly_zero=()):
    """(o, lse, dq, dk, dv) against float64: each within REL_TOL of `dtype`, lse in fp32 and -inf
    exactly where the reference's is (rows that see no key). exactly_zero: gradients the reference
    has exactly 0 (every row sees one key: P = 1, dS = P (dP - delta) = 0), where a kernel gets
    dO.V - dO.O to fp32 rounding (different summation orders), i.e. ~1e-7."""
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), ours, ref):
        assert got.shape == want.shape, name
        if name in exactly_zero:
            assert want.abs().max() == 0 and got.abs().max() < 1e-4, name
            continue
        if name == "lse":
            assert got.dtype == torch.float32
            masked = torch.isinf(want)
            assert torch.equal(torch.isinf(got), masked) and (got[masked] < 0).all(), "lse: rows that see no key"
            assert rel_error(got[~masked], want[~masked]) < 1e-6, "lse"
            continue
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        assert rel_error(got, want) <= REL_TOL[dtype], f"{name}: {rel_error(got, want):.3g}"


def mask_revealing_inputs(batch, heads, seqlen_q, seqlen_k, head_dim, dtype, device="cpu"):
    """(q, k, v, do, unit_keys): inputs from whose outputs each kernel's dropout mask reads exactly
    (head_dim >= seqlen_q + seqlen_k; see masks_read_from). q = 0, so every probability is 1 / Sk;
    k random; v's key j and unit_keys' key j the unit vector e_j; dO's row i ones on the first Sk
    columns and e_(Sk + i) after them."""
    assert head_dim >= seqlen_q + seqlen_k, "the columns hold one unit vector per key and per query"
    shape = (batch, heads, seqlen_q, head_dim)
    keys, queries = range(seqlen_k), range(seqlen_q)
    q = torch.zeros(shape, dtype=dtype, device=device)
    k = torch.randn(batch, heads, seqlen_k, head_dim, device=device).to(dtype)
    v = torch.zeros(batch, heads, seqlen_k, head_dim, dtype=dtype, device=device)
    v[..., keys, keys] = 1
    do = torch.zeros(shape, dtype=dtype, device=device)
    do[..., :seqlen_k] = 1
    do[..., queries, range(seqlen_k, seqlen_k + seqlen_q)] = 1
    return q, k, v, do, v.clone()


def masks_read_from(o, dv, dq, seqlen_k):
    """The dropout masks, (B, H, Sq, Sk) bool, that the forward, the dK/dV and the dQ kernels drew
    for mask_revealing_inputs (O and DV of a run with k, DQ of one with unit_keys). With s = 1 /
    (1 - p): o[i, j] = kept(i, j) s / Sk; dV[j, Sk + i] = kept(i, j) s / Sk; dQ[i, j] = scale / Sk
    (kept(i, j) s - delta_i), one value where kept and a smaller one where not (dP[i, j] = 1 before
    the mask, and dQ's column j is key j's alone)."""
    seqlen_q = o.shape[2]
    dq = dq[..., :seqlen_k].float()
    return (o[..., :seqlen_k] != 0, dv[..., seqlen_k:seqlen_k + seqlen_q].transpose(-1, -2) != 0,
            dq > (dq.amax(-1, keepdim=True) + dq.amin(-1, keepdim=True)) / 2)
