"""Fused attention (FlashAttention-2 style) in Triton; the backward recomputes the probabilities.

The forward keeps only what is cheap to store: q, k, v (the caller's), the output o, and per
query row the fp32 log-sum-exp of the scaled scores (4 bytes a row). The backward rebuilds the
probabilities P = exp(S - lse) block by block from q, k and the lse in the same kernels that
compute the gradients: nothing of size seqlen_q x seqlen_k is ever written to memory.

Layout of this file, top to bottom:
  1. configuration: (head dim, causal, dtype) -> block sizes, warps and stages, no autotuning
  2. forward kernel: online softmax over key/value blocks, writes o and the lse
  3. backward kernels: delta = rowsum(dO * O); dK/dV (one program per key block, looping over
     query blocks and the query heads of its group); dQ (one program per query block, looping
     over key blocks). No atomics: every output element is written by exactly one program.
  4. launchers: attention_fwd, attention_bwd
  5. aot_cases(): every launch configuration above, for the ahead-of-time compile test

Tensor contract:
  q (B, H, Sq, D); k, v (B, H_kv, Sk, D) with H_kv dividing H (GQA/MQA; query head h reads
  key/value head h // (H // H_kv)); any strides as long as the last dim has stride 1.
  o (B, H, Sq, D) contiguous in q's dtype; lse (B, H, Sq) contiguous fp32, NATURAL log:
  lse[i] = log(sum_j exp(scale * q_i . k_j)) over the keys row i may see, -inf for a row that
  sees no key (causal with Sq > Sk), whose output is 0 and whose gradients are 0.
  dq, dk, dv contiguous, in the dtype and shape of q, k, v.

Conventions:
  - Inside the kernels scores are in base 2: qk_scale = softmax_scale * log2(e), so exp is exp2.
  - Causal masking is aligned to the bottom-right corner (FlashAttention >= 2.1): query i sees
    key j iff j <= i + (Sk - Sq). With Sq == Sk this is the usual lower triangle.
  - Masked scores are set to a large finite negative (-1e30), never -inf, so the running
    maximum of a row that has seen no key yet stays finite and no inf - inf can occur; the
    probabilities of masked entries are then zeroed explicitly.
  - The head dim is padded to the next power of two (80 and 96 -> 128) with masked loads.
  - fp16/bf16: tl.dot on the inputs with fp32 accumulation; P and dS are rounded to the input
    dtype before their matmuls (as FlashAttention does). fp32: tl.dot with
    input_precision="ieee" (full fp32, no tf32), so fp32 results match an fp32 reference.
"""

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2, unit_last_stride

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): log(x) = log2(x) * LN2

# Head dims the kernels are compiled and tested for (checked by the op layer; others fall back).
HEAD_DIMS = (32, 64, 80, 96, 128, 256)

# ---------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded head dim, for fp16/bf16 on
# sm_80/sm_90. BLOCK_M is the query block, BLOCK_N the key block. Causal and non-causal share
# an entry (the causal loops are shorter, not different); bf16 and fp16 share one (same sizes).
# Chosen so that nothing spills on sm_80 or sm_90 (tests/test_attention.py compiles them all):
#   fwd:  a (BLOCK_M, D) fp32 accumulator and the q tile stay in registers across the loop.
#   dkdv: k, v tiles and two (BLOCK_N, D) fp32 accumulators stay in registers; query blocks
#         stream past, so BLOCK_M is the small one.
#   dq:   q, dO tiles and a (BLOCK_M, D) fp32 accumulator stay; key blocks stream past.
_HALF_CONFIGS = {
    "fwd": {32: (128, 64, 4, 3), 64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},
    "dkdv": {32: (32, 128, 4, 3), 64: (32, 128, 8, 3), 128: (32, 64, 8, 2), 256: (16, 64, 8, 2)},
    "dq": {32: (128, 32, 4, 3), 64: (128, 32, 4, 3), 128: (64, 32, 4, 2), 256: (64, 32, 8, 2)},
}
# fp32 tiles take twice the registers and shared memory of half ones: smaller blocks.
# At padded head dim 128 (head dims 80, 96, 128) larger or pipelined fp32 tiles used 8-40 bytes
# of stack on sm_80 or sm_90; these 16 x 16 single-stage tiles use none.
_FP32_CONFIGS = {
    "fwd": {32: (32, 32, 4, 2), 64: (32, 32, 4, 2), 128: (16, 16, 4, 1), 256: (16, 32, 8, 1)},
    "dkdv": {32: (16, 32, 4, 2), 64: (16, 32, 4, 2), 128: (16, 16, 8, 1), 256: (16, 16, 8, 1)},
    "dq": {32: (32, 16, 4, 2), 64: (32, 16, 4, 2), 128: (16, 16, 8, 1), 256: (16, 16, 8, 1)},
}
# Under the Triton interpreter (CPU tensors) one small configuration: fast, and sequence lengths
# of a few dozen already span several blocks, so the loops and tail masks are exercised.
_INTERPRETER_CONFIG = (16, 16, 4, 1)
# Backward preprocess (delta = rowsum(dO * O)): rows per program, and warps.
_PRE_BLOCK_M, _PRE_WARPS = 64, 8  # 8 warps: o and dO tiles of 64 x 256 fp32 fit without spilling
_PRE_BLOCK_M_INTERPRETER = 16


def padded_head_dim(head_dim: int) -> int:
    """The power-of-two tile width a head dim runs at (80 and 96 run padded to 128)."""
    return max(16, next_power_of_2(head_dim))


def _config(kind, head_dim, dtype, device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for kernel `kind` ("fwd", "dkdv", "dq")."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    table = _FP32_CONFIGS if dtype == torch.float32 else _HALF_CONFIGS
    return table[kind][padded_head_dim(head_dim)]


# ---------------------------------------------------------------------------------------------
# 2. Forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, IEEE_FP32: tl.constexpr):
    # fp32 operands: full-precision products (tl.dot's default for fp32 is tf32 on a GPU, which
    # would make fp32 attention as inexact as bf16's mantissa). Half operands ignore this.
    if IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _visible(rows, cols, seqlen_q, seqlen_k, CAUSAL: tl.constexpr):
    # (len(rows), len(cols)) mask of the (query, key) pairs that take part: both in range and,
    # when causal, key j at most i + (Sk - Sq) (bottom-right aligned).
    ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q))
    return ok


@triton.jit
def _causal_key_end(block_start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    # One past the last key the query rows [block_start_m, block_start_m + BLOCK_M) may see.
    end = seqlen_k
    if CAUSAL:
        end = tl.minimum(seqlen_k, tl.maximum(0, block_start_m + BLOCK_M + seqlen_k - seqlen_q))
    return end


@triton.jit
def _attn_fwd_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    O,  # (B, H, Sq, D) output, strides stride_ob, stride_oh, stride_om, 1
    LSE,  # (B, H, Sq) fp32 output (natural log), strides stride_lb, stride_lh, 1
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    seqlen_q,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e)
    GROUP: tl.constexpr,  # H // H_kv: query heads per key/value head
    HEAD_DIM: tl.constexpr,  # D
    D_PAD: tl.constexpr,  # next power of two >= D
    CAUSAL: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
):
    # Grid (cdiv(Sq, BLOCK_M), H, B): one query block of one head per program.
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    Q += batch * stride_qb + head * stride_qh
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    O += batch * stride_ob + head * stride_oh
    LSE += batch * stride_lb + head * stride_lh

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM  # constant-folded when D is a power of two
    row_ok = rows < seqlen_q
    q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Online softmax state, base 2: m_i the running max of the scaled scores, l_i the running sum
    # of exp2(s - m_i), acc the running sum of exp2(s - m_i) * v.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    # Causal: key blocks right of the diagonal are skipped entirely (a row block whose rows see
    # no key at all runs zero iterations).
    end_n = _causal_key_end(start_m, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < seqlen_k
        kt = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        s = _dot(q, kt, IEEE_FP32) * qk_scale
        visible = _visible(rows, cols, seqlen_q, seqlen_k, CAUSAL)
        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Zeroed explicitly: in a row with no visible key yet, m_new is -1e30 too and
        # exp2(s - m_new) would be 1 for the masked entries.
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_FP32)
        m_i = m_new

    # A row that saw no key (l_i == 0) gets o = 0 and lse = -inf (log of an empty sum).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + rows[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# 3. Backward
# ---------------------------------------------------------------------------------------------
# Gradient derivation, per head, with c = softmax_scale, S = c * Q K^T, P = softmax_rows(S),
# O = P V and dO the incoming gradient:
#
#   dV = P^T dO                                  (O is linear in V)
#   dP = dO V^T
#   dS_ij = sum_k dP_ik * dP_ik/dS_ij = P_ij * (dP_ij - sum_k P_ik dP_ik)   (softmax Jacobian)
#         = P_ij * (dP_ij - delta_i),   delta_i = sum_k P_ik (dO_i . V_k) = dO_i . O_i
#   dQ = c * dS K,    dK = c * dS^T Q
#
# delta is a cheap row reduction of dO * O (preprocess kernel), so neither dP nor P is needed as
# a whole: each (query block, key block) tile recomputes P_ij = exp(S_ij - lse_i) from q, k and
# the forward's lse (exactly the normalised probabilities, no second max pass), then dP and dS
# for that tile only. Masked pairs get P = 0 and therefore dS = 0.
#
# Two kernels so that every output has one writer (deterministic, no atomics):
#   dK/dV: a program owns a key block of one key/value head; it loops over the query heads of
#          the GROUP sharing that key/value head (GQA: their contributions sum here, in a fixed
#          order) and, for each, over the query blocks that can see its keys.
#   dQ:    a program owns a query block of one query head and loops over the visible key blocks.
# The dQ kernel recomputes S and dP a second time: the price of no atomics.
@triton.jit
def _attn_bwd_preprocess_kernel(
    O,  # (B, H, Sq, D) forward output, strides stride_ob, stride_oh, stride_om, 1
    DO,  # (B, H, Sq, D) gradient of o, strides stride_dob, stride_doh, stride_dom, 1
    Delta,  # (B, H, Sq) fp32 output, strides stride_lb, stride_lh, 1
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # Grid (cdiv(Sq, BLOCK_M), H, B). delta_i = sum_d dO_id * O_id in fp32.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + batch * stride_ob + head * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + batch * stride_lb + head * stride_lh + rows, tl.sum(o * do, 1), mask=rows < seqlen_q)


@triton.jit
def _load_lse_base2(LSE, rows, seqlen_q):
    # The forward's natural-log lse in base 2. A row that sees no key has lse = -inf; it becomes 0
    # here (its probabilities are all masked to 0 anyway) so no inf enters the arithmetic.
    lse = tl.load(LSE + rows, mask=rows < seqlen_q, other=0.0)
    return tl.where(lse > -1.0e30, lse * 1.4426950408889634, 0.0)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    DO,  # (B, H, Sq, D) strides stride_dob, stride_doh, stride_dom, 1
    LSE,  # (B, H, Sq) fp32, natural log, strides stride_lb, stride_lh, 1
    Delta,  # (B, H, Sq) fp32, same strides as LSE
    DK,  # (B, H_kv, Sk, D) output, strides stride_dkb, stride_dkh, stride_dkn, 1
    DV,  # (B, H_kv, Sk, D) output, strides stride_dvb, stride_dvh, stride_dvn, 1
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    seqlen_q,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per step
    BLOCK_N: tl.constexpr,  # keys per program
):
    # Grid (cdiv(Sk, BLOCK_N), H_kv, B). Works on transposed tiles (keys x queries) so that the
    # accumulations dV += P^T dO and dK += dS^T Q are plain (BLOCK_N, BLOCK_M) x (BLOCK_M, D) dots.
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    DK += batch * stride_dkb + kv_head * stride_dkh
    DV += batch * stride_dvb + kv_head * stride_dvh

    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (cols[:, None] < seqlen_k) & d_ok[None, :]
    k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)

    # Causal: query row i sees key start_n only if i >= start_n - (Sk - Sq); earlier query blocks
    # contribute nothing to these keys.
    start_m_first = 0
    if CAUSAL:
        start_m_first = (tl.maximum(0, start_n - (seqlen_k - seqlen_q)) // BLOCK_M) * BLOCK_M

    for g in range(GROUP):
        head = kv_head * GROUP + g
        Qh = Q + batch * stride_qb + head * stride_qh
        DOh = DO + batch * stride_dob + head * stride_doh
        LSEh = LSE + batch * stride_lb + head * stride_lh
        Deltah = Delta + batch * stride_lb + head * stride_lh
        for start_m in range(start_m_first, seqlen_q, BLOCK_M):
            rows = start_m + offs_m
            q_mask = (rows[:, None] < seqlen_q) & d_ok[None, :]
            q = tl.load(Qh + rows[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DOh + rows[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
            lse = _load_lse_base2(LSEh, rows, seqlen_q)
            delta = tl.load(Deltah + rows, mask=rows < seqlen_q, other=0.0)

            # P^T recomputed: (BLOCK_N, BLOCK_M).
            st = _dot(k, tl.trans(q), IEEE_FP32) * qk_scale
            visible_t = tl.trans(_visible(rows, cols, seqlen_q, seqlen_k, CAUSAL))
            pt = tl.where(visible_t, tl.exp2(st - lse[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, IEEE_FP32)
            dpt = _dot(v, tl.trans(do), IEEE_FP32)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, IEEE_FP32)

    dk *= softmax_scale
    tl.store(DK + cols[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + cols[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q,  # (B, H, Sq, D) strides stride_qb, stride_qh, stride_qm, 1
    K,  # (B, H_kv, Sk, D) strides stride_kb, stride_kh, stride_kn, 1
    V,  # (B, H_kv, Sk, D) strides stride_vb, stride_vh, stride_vn, 1
    DO,  # (B, H, Sq, D) strides stride_dob, stride_doh, stride_dom, 1
    LSE,  # (B, H, Sq) fp32, natural log, strides stride_lb, stride_lh, 1
    Delta,  # (B, H, Sq) fp32, same strides as LSE
    DQ,  # (B, H, Sq, D) output, strides stride_dqb, stride_dqh, stride_dqm, 1
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqm,
    seqlen_q,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e)
    softmax_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
):
    # Grid (cdiv(Sq, BLOCK_M), H, B).
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    Q += batch * stride_qb + head * stride_qh
    DO += batch * stride_dob + head * stride_doh
    LSE += batch * stride_lb + head * stride_lh
    Delta += batch * stride_lb + head * stride_lh
    DQ += batch * stride_dqb + head * stride_dqh
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_mask = (rows[:, None] < seqlen_q) & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
    lse = _load_lse_base2(LSE, rows, seqlen_q)
    delta = tl.load(Delta + rows, mask=rows < seqlen_q, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    end_n = _causal_key_end(start_m, seqlen_q, seqlen_k, BLOCK_M, CAUSAL)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seqlen_k) & d_ok[None, :]
        k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), IEEE_FP32) * qk_scale
        visible = _visible(rows, cols, seqlen_q, seqlen_k, CAUSAL)
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE_FP32)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE_FP32)

    dq *= softmax_scale
    tl.store(DQ + rows[:, None] * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------
# 4. Launchers
# ---------------------------------------------------------------------------------------------
def _common_constexprs(q, k, causal):
    head_dim = q.shape[-1]
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=padded_head_dim(head_dim),
        CAUSAL=bool(causal),
        IEEE_FP32=q.dtype == torch.float32,
    )


def attention_fwd(q, k, v, causal, softmax_scale):
    """(o, lse): o (B, H, Sq, D) in q's dtype laid out as (B, Sq, H, D), lse (B, H, Sq) fp32 natural log."""
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    # o is laid out as (B, Sq, H, D), the contract of remat.ops.attention.attention_fwd.
    o = q.new_empty((batch, seqlen_q, heads, head_dim)).transpose(1, 2)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if seqlen_k == 0:  # no key at all: every row sees an empty set
        return o.zero_(), lse.fill_(float("-inf"))
    block_m, block_n, warps, stages = _config("fwd", head_dim, q.dtype, q.device)
    _attn_fwd_kernel[(cdiv(seqlen_q, block_m), heads, batch)](
        q, k, v, o, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        seqlen_q, seqlen_k, softmax_scale * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_common_constexprs(q, k, causal),
    )
    return o, lse


def attention_bwd(do, q, k, v, o, lse, causal, softmax_scale):
    """(dq, dk, dv), contiguous, in the shapes and dtypes of q, k, v."""
    do, q, k, v, o = (unit_last_stride(t) for t in (do, q, k, v, o))
    lse = lse.contiguous()
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        # Sq == 0 (no query: k and v get no gradient) or Sk == 0 (o was 0: q gets none).
        return dq.zero_(), dk.zero_(), dv.zero_()
    device = q.device
    d_pad = padded_head_dim(head_dim)

    delta = torch.empty_like(lse)
    pre_block = _PRE_BLOCK_M if device.type == "cuda" else _PRE_BLOCK_M_INTERPRETER
    _attn_bwd_preprocess_kernel[(cdiv(seqlen_q, pre_block), heads, batch)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], *lse.stride()[:2], seqlen_q,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=pre_block, num_warps=_PRE_WARPS,
    )

    common = _common_constexprs(q, k, causal)
    strides_in = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2])
    scales = (softmax_scale * LOG2E, softmax_scale)

    block_m, block_n, warps, stages = _config("dkdv", head_dim, q.dtype, device)
    _attn_bwd_dkdv_kernel[(cdiv(seqlen_k, block_n), kv_heads, batch)](
        q, k, v, do, lse, delta, dk, dv, *strides_in, *dk.stride()[:3], *dv.stride()[:3],
        seqlen_q, seqlen_k, *scales,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    block_m, block_n, warps, stages = _config("dq", head_dim, q.dtype, device)
    _attn_bwd_dq_kernel[(cdiv(seqlen_q, block_m), heads, batch)](
        q, k, v, do, lse, delta, dq, *strides_in, *dq.stride()[:3],
        seqlen_q, seqlen_k, *scales,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# 5. Ahead-of-time compile cases
# ---------------------------------------------------------------------------------------------
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# GQA group sizes are constexprs too; production launches any, but the group only changes the
# trip count of an outer loop, so one value (1) is compiled here.
_AOT_GROUP = 1


def _strides(*prefixes):
    return {f"stride_{p}{s}": "i32" for p in prefixes for s in ("b", "h", "m" if p in ("q", "o", "do", "dq") else "n")}


def aot_cases(dtypes=(torch.float16, torch.bfloat16, torch.float32), head_dims=HEAD_DIMS, causals=(False, True)):
    """Every (kernel, signature, constexprs, num_warps, num_stages) the launchers above can launch.

    Distinct configurations only: head dims 80 and 96 compile separately from 128 (HEAD_DIM is
    a constexpr) although they share its block sizes. The strides are typed i32 (the common
    case; Triton specialises to i64 only for huge tensors).
    """
    cases = []
    for dtype in dtypes:
        t = _TYPE_NAMES[dtype]
        for head_dim in head_dims:
            d_pad = padded_head_dim(head_dim)
            table = _FP32_CONFIGS if dtype == torch.float32 else _HALF_CONFIGS
            base = dict(HEAD_DIM=head_dim, D_PAD=d_pad, IEEE_FP32=dtype == torch.float32)
            for causal in causals:
                tag = f"{t}_d{head_dim}_{'causal' if causal else 'full'}"
                flags = dict(base, GROUP=_AOT_GROUP, CAUSAL=causal)
                flag_sig = {name: "constexpr" for name in ("GROUP", "HEAD_DIM", "D_PAD", "CAUSAL", "IEEE_FP32",
                                                           "BLOCK_M", "BLOCK_N")}
                bm, bn, w, st = table["fwd"][d_pad]
                cases.append(dict(
                    name=f"fwd_{tag}_BM{bm}_BN{bn}_w{w}_s{st}",
                    kernel=_attn_fwd_kernel,
                    signature={"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "O": f"*{t}", "LSE": "*fp32",
                               **_strides("q", "k", "v", "o"), "stride_lb": "i32", "stride_lh": "i32",
                               "seqlen_q": "i32", "seqlen_k": "i32", "qk_scale": "fp32", **flag_sig},
                    constexprs=dict(flags, BLOCK_M=bm, BLOCK_N=bn),
                    num_warps=w, num_stages=st,
                    divisible_by_16=["Q", "K", "V", "O", "LSE", "stride_qb", "stride_qh", "stride_qm",
                                     "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn",
                                     "stride_ob", "stride_oh", "stride_om"],
                ))
                bwd_sig = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "DO": f"*{t}", "LSE": "*fp32", "Delta": "*fp32"}
                in_strides = {**_strides("q", "k", "v", "do"), "stride_lb": "i32", "stride_lh": "i32"}
                scalars = {"seqlen_q": "i32", "seqlen_k": "i32", "qk_scale": "fp32", "softmax_scale": "fp32"}
                div16 = ["Q", "K", "V", "DO", "LSE", "Delta", *[n for n in in_strides if not n.startswith("stride_l")]]
                bm, bn, w, st = table["dkdv"][d_pad]
                cases.append(dict(
                    name=f"dkdv_{tag}_BM{bm}_BN{bn}_w{w}_s{st}",
                    kernel=_attn_bwd_dkdv_kernel,
                    signature={**bwd_sig, "DK": f"*{t}", "DV": f"*{t}", **in_strides, **_strides("dk", "dv"),
                               **scalars, **flag_sig},
                    constexprs=dict(flags, BLOCK_M=bm, BLOCK_N=bn),
                    num_warps=w, num_stages=st,
                    divisible_by_16=div16 + ["DK", "DV", *_strides("dk", "dv")],
                ))
                bm, bn, w, st = table["dq"][d_pad]
                cases.append(dict(
                    name=f"dq_{tag}_BM{bm}_BN{bn}_w{w}_s{st}",
                    kernel=_attn_bwd_dq_kernel,
                    signature={**bwd_sig, "DQ": f"*{t}", **in_strides, **_strides("dq"), **scalars, **flag_sig},
                    constexprs=dict(flags, BLOCK_M=bm, BLOCK_N=bn),
                    num_warps=w, num_stages=st,
                    divisible_by_16=div16 + ["DQ", *_strides("dq")],
                ))
            cases.append(dict(
                name=f"pre_{t}_d{head_dim}_BM{_PRE_BLOCK_M}",
                kernel=_attn_bwd_preprocess_kernel,
                signature={"O": f"*{t}", "DO": f"*{t}", "Delta": "*fp32", **_strides("o", "do"),
                           "stride_lb": "i32", "stride_lh": "i32", "seqlen_q": "i32",
                           "HEAD_DIM": "constexpr", "D_PAD": "constexpr", "BLOCK_M": "constexpr"},
                constexprs=dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=_PRE_BLOCK_M),
                num_warps=_PRE_WARPS,
                divisible_by_16=["O", "DO", "Delta", *_strides("o", "do")],
            ))
    return cases
