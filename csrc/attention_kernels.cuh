// Attention on tensor cores, FlashAttention-2 style: the kernels and the choice of their launches.
//
// softmax(scale * q k^T) v for (B, H, S, D) half or bfloat16 tensors with a unit last stride,
// GQA (H a multiple of the key/value heads), any sequence lengths (the tails masked), head dims
// that are a multiple of 8 up to 256 (computed at the next of 32, 64, 96, 128, 256; the columns past
// the head dim are zero-filled on load and never stored). The same contract as the Triton
// kernels (triton_kernels/attention.py):
//   - a window, aligned bottom-right: query i sees key j iff -left <= j - (i + Sk - Sq) <= right.
//     Causal is right = 0; an unbounded side is Sq + Sk (past every key), so one test masks all.
//   - logit softcapping: the scaled score x becomes c tanh(x / c); dS gets the factor 1 - tanh^2.
//   - ALiBi: -slope |i + Sk - Sq - j| added to the (capped) scaled score, a slope per (batch, head).
//   - dropout on the probabilities, kept ones scaled by 1 / (1 - p), with the Triton kernels'
//     mask: a function of (seed, batch * H + head, query, key) by Philox-4x32-10, one call per
//     group of four positions (DropoutMask),
//     drawn again in the backward for dV and dP, never stored. The seed is read on the device.
// Key (or query) blocks no row of a block sees are skipped; blocks every row sees entirely skip
// the mask in the forward. Packed sequences (varlen, as flash_attn_varlen_func): q (total_q, H, D),
// k and v (total_k, Hkv, D), sequence b at rows cu_seqlens[b]..cu_seqlens[b + 1], each attending
// to itself only with every convention above applied to its own lengths; the grid's batch index
// is the sequence's, its blocks sized for the longest, those past a sequence's end exit at once.
//
// Forward (attention_fwd_kernel): a block of 4 warps takes 128 query rows (two 16-row tiles a
// warp) of one (batch, head) up to head dim 64, else 64 (one tile a warp); key/value blocks
// stream through shared memory by cp.async, double-buffered (block j + 1 loads while block j is
// multiplied). Per key block each warp computes its scores
// S = Q K^T with m16n8k16 tensor-core products (Q's fragments stay in registers), masks them,
// and updates an online softmax in base 2 (the scale is multiplied by log2(e) once, so one exp2
// a score): a running row maximum m, a running row sum l, and the fp32 output accumulator
// rescaled by exp2(m_old - m_new). The probabilities, rounded to the input type, are the A
// operand of P V straight from the accumulator registers (the C layout of two 8-column tiles is
// the A layout of one 16-deep step). At the end o = acc / l and lse = (m + log2 l) ln 2, the
// natural log-sum-exp, fp32: all the backward needs besides q, k, v, o.
//
// Backward: the probabilities are recomputed block by block from q, k and lse; nothing
// seqlen_q x seqlen_k is stored. With P = exp2(S log2e scale - lse log2e):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dK = scale dS^T Q,   dQ = scale dS K.
// delta = rowsum(dO * O) first (attention_bwd_preprocess_kernel); then dK and dV
// (attention_dkdv_kernel), a block of 64 keys (16 a warp) walking the query blocks of every
// query head of its key/value head (GQA sums in a fixed order). dQ two ways:
//   - deterministic (bitwise, no atomics): its own kernel (attention_dq_kernel), a block of 64
//     query rows walking the key blocks, which recomputes S and dP: 7 products a score.
//   - one pass (AttentionParams::dq_accum set), as FlashAttention 2: the dK/dV kernel adds each
//     block's scale dS K to an fp32 dQ by atomics (add_dq): 5 products a score, but the order of
//     the sums, and so dQ's last bits, vary from run to run.
//
// Head dim 256: a warp's 16 x 256 fp32 accumulator alone takes 128 registers a thread, so q's
// and dO's rows are read from shared memory at each product instead of kept as fragments, the
// blocks streaming past narrow (32 keys in the forward, 16 in dQ, 16 queries in dK/dV), and a
// dK/dV block accumulates only half the columns (128) of its keys' dK and dV: the two halves of
// a key block are two blocks, each recomputing the block's P and dP (the dK/dV kernel's products
// cost 1.5x those of one pass, the price of not spilling).
//
// Shared-memory tiles hold rows of D 16-bit values as D/8 16-byte chunks, chunk c of row r
// stored at c ^ (r % 8) (mod the chunks a row has): the 8 rows one ldmatrix reads at the same
// chunk fall in different banks. The fragment layouts are in tensor_core.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "tensor_core.cuh"

namespace remat {

// What the launchers pass the kernels. Strides are in elements: batch, head, sequence (the last
// dim's stride is 1).
struct AttentionParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride[3], k_stride[3], v_stride[3];
  void* o;  // the forward's output, the backward's input
  int64_t o_stride[3];
  float* lse;  // fp32 rows: (b, h)'s at b * lse_stride[0] + h * lse_stride[1], contiguous
  const void* dout;  // backward only, from here on
  int64_t dout_stride[3];
  float* delta;  // fp32 workspace laid out as lse: rowsum(dO * O)
  void* dq;
  void* dk;
  void* dv;
  int64_t dq_stride[3], dk_stride[3], dv_stride[3];
  // The one-pass backward (null: the dQ kernel's): fp32 dQ shaped as dq, zeroed, that the dK/dV
  // kernel adds scale dS K to by atomics; the caller rounds it to dq's type.
  float* dq_accum;
  int64_t dq_accum_stride[3];
  int64_t lse_stride[2];  // lse's (and delta's) batch and head strides
  int batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim;  // packed: sequences, and the longest lengths
  // Packed sequences: int32 (batch + 1) cumulative lengths, the tensors' batch strides 0; null otherwise.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  float softmax_scale;
  // Keys a query row sees left and right of its diagonal (see above): set_window.
  int window_left, window_right;
  float softcap_in, softcap_out;  // softmax_scale / c and c log2(e) with softcapping at c, else 0
  const float* alibi_slopes;  // fp32, slope of (b, h) at b * alibi_batch_stride + h; null without ALiBi
  int64_t alibi_batch_stride;
  // Dropout: one int64 seed on the device (null without dropout), the threshold p * 2^31 the top
  // 31 bits of a probability's Philox word must reach for it to be kept, and 1 / (1 - p).
  const int64_t* dropout_seed;
  uint32_t dropout_threshold;
  float dropout_scale;
  bool bf16;  // __nv_bfloat16 when true, else __half
};

// P's window from the caller's causal flag and window_left / window_right (-1: unbounded; the
// right bound is 0 when causal). P's sequence lengths are set first.
__host__ inline void set_window(AttentionParams& p, bool causal, int64_t window_left, int64_t window_right) {
  const int64_t unbounded = static_cast<int64_t>(p.seqlen_q) + p.seqlen_k;
  auto bound = [&](int64_t w) { return static_cast<int>(w < 0 || w > unbounded ? unbounded : w); };
  p.window_left = bound(window_left);
  p.window_right = causal ? 0 : bound(window_right);
}

// P's softcapping at SOFTCAP (none at 0). P's softmax_scale is set first.
__host__ inline void set_softcap(AttentionParams& p, float softcap) {
  p.softcap_in = softcap > 0.f ? p.softmax_scale / softcap : 0.f;
  p.softcap_out = softcap > 0.f ? softcap * 1.4426950408889634f : 0.f;
}

// P's dropout at probability DROPOUT_P (none at 0) with the int64 seed at SEED (device memory),
// the threshold and scale computed as the Triton kernels' (triton_kernels/attention.py).
__host__ inline void set_dropout(AttentionParams& p, double dropout_p, const int64_t* seed) {
  const bool on = dropout_p > 0.0;
  const double threshold = dropout_p * 2147483648.0;  // truncated, at most 2^31 - 1
  p.dropout_seed = on ? seed : nullptr;
  p.dropout_threshold = !on ? 0u : threshold >= 2147483647.0 ? 2147483647u : static_cast<uint32_t>(threshold);
  p.dropout_scale = on ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
}

namespace attn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;  // the kernels' __launch_bounds__(kThreads, 1): without the 1,
                                       // ptxas capped registers (168 at head dim 32) and spilled
constexpr int kRowsPerWarp = 16;  // one m16n8k16 row tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Block shapes by padded head dim D. M: query rows, N: keys. Chosen so that the fp32
// accumulators and fragments fit in registers without spilling (tests/build/test_cuda_compile.py):
//   forward: o (16 x D) and q's fragments per row tile (two tiles a warp up to D = 64); keys
//     stream past in blocks of 64 at D = 96 and 128, else 32.
//   dK/dV: dK and dV (16 x kDkdvCols each) per warp; query blocks stream past, 32 at D = 96 and
//     128, 16 at 256 (its P^T and dS^T blocks are what is left room for).
//   dQ: dQ (16 x D), q's and dO's fragments per warp; key blocks of 32 at D = 96 and 128, 16 at 256.
// Head dim 96 has its own instantiation (rather than running padded to 128) because the head
// dims 72..96 (Phi-3's 96, Phi-2's and OPT's 80) would otherwise pay 4/3 of their products.
template <int D>
struct Tiles {
  // q's (and dO's) A fragments, D / 4 registers each, stay in registers up to D = 128.
  static constexpr bool kRowsInRegisters = D <= 128;
  static constexpr int kFragments = kRowsInRegisters ? D / 16 : 1;  // the fragment arrays' length
  // The forward's row tiles of 16 a warp: two up to D = 64, where the registers hold two tiles'
  // accumulators, scores and q fragments (with key blocks of 32). Each K or V fragment read from
  // shared memory (512 bytes an ldmatrix.x4) then feeds 4 m16n8k16 products instead of 2: 32
  // FLOPs a byte instead of 16, where an H100/H200 SM's tensor cores (~4096 FLOPs a clock) would
  // need 32 to outrun its 128 bytes a clock of shared memory.
  static constexpr int kFwdRowTiles = D <= 64 ? 2 : 1;
  static constexpr int kFwdM = kWarps * kRowsPerWarp * kFwdRowTiles, kFwdN = D > 128 || D <= 64 ? 32 : 64;
  static constexpr int kDkdvM = D > 128 ? 16 : D > 64 ? 32 : 64, kDkdvN = kWarps * kRowsPerWarp;
  static constexpr int kDkdvCols = D > 128 ? 128 : D;  // the dK/dV columns one block accumulates
  static constexpr int kDkdvColumnBlocks = D / kDkdvCols;
  static constexpr int kDqM = kWarps * kRowsPerWarp, kDqN = D > 128 ? 16 : D > 64 ? 32 : 64;
  static constexpr int kTileBytes = D * 2;  // one row of a shared tile
  // Q, and two stages of K and V.
  static constexpr int kFwdSmem = (kFwdM + 4 * kFwdN) * kTileBytes;
  // K, V, two stages of Q and dO, and two of lse and delta (fp32, per query row).
  static constexpr int kDkdvSmem = (2 * kDkdvN + 4 * kDkdvM) * kTileBytes + 4 * kDkdvM * 4;
  // The one-pass backward's dS block besides (M queries x N keys, 16-bit).
  static constexpr int kDkdvOnePassSmem = kDkdvSmem + kDkdvM * kDkdvN * 2;
  // Q, dO, and two stages of K and V.
  static constexpr int kDqSmem = (2 * kDqM + 4 * kDqN) * kTileBytes;
};

constexpr int kPreRows = 16;  // the preprocess: rows a block (4 a warp)

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Element offset of chunk CHUNK (8 values) of row ROW in a swizzled shared tile of width D. An
// ldmatrix reads one chunk of 8 rows 8r..8r+7 at once; they fall in 8 different 16-byte bank
// groups (of a 128-byte line's 8) when: rows of a multiple of 8 chunks (D = 64, 128, 256) start
// at group 0, so the chunk's low 3 bits are XORed with row % 8; rows of 4 mod 8 chunks (D = 32,
// 96) start at group 0 or 4 by the row's parity, so the low 2 bits are XORed with row / 2 % 4.
// Either way a chunk stays in its row's aligned group of 8 (or 4) chunks.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  constexpr int kChunks = D / 8;
  static_assert(kChunks % 4 == 0, "a tile row is a multiple of 4 chunks");
  if constexpr (kChunks % 8 == 0) {
    return row * D + ((chunk ^ (row & 7)) * 8);
  } else {
    return row * D + ((chunk ^ ((row >> 1) & 3)) * 8);
  }
}

// Starts copying ROWS rows, row0.., of a (seqlen, head_dim) slice at BASE (row stride STRIDE)
// into the shared tile TILE; rows past seqlen and columns past head_dim become zeros.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int64_t stride, int row0, int seqlen,
                                          int head_dim) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < seqlen && c * 8 < head_dim;
    const T* src = valid ? base + static_cast<int64_t>(row0 + r) * stride + c * 8 : base;
    tc::cp_async_16(tile + swizzled<D>(r, c), src, valid);
  }
}

// Starts copying key/value block rows n0..n0+N-1 of K and V into stage STAGE of the
// double-buffered shared tiles S_K and S_V (N rows each a stage).
template <typename T, int D, int N>
__device__ __forceinline__ void load_kv_block(T* s_k, T* s_v, int stage, const T* k, const T* v,
                                              const AttentionParams& p, int n0) {
  load_tile<T, D, N>(s_k + stage * N * D, k, p.k_stride[2], n0, p.seqlen_k, p.head_dim);
  load_tile<T, D, N>(s_v + stage * N * D, v, p.v_stride[2], n0, p.seqlen_k, p.head_dim);
}

// The A fragment of 16-deep step KK (k = the tile's columns 16 kk..) of rows row0..row0+15 of a
// shared tile of width D.
template <typename T, int D>
__device__ __forceinline__ void load_a_step(uint32_t (&a)[4], const T* tile, int row0, int kk) {
  const int lane = threadIdx.x % 32, m = lane / 8;
  tc::ldmatrix_x4(a, tile + swizzled<D>(row0 + lane % 8 + 8 * (m & 1), 2 * kk + (m >> 1)));
}

// All D / 16 of them.
template <typename T, int D>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[D / 16][4], const T* tile, int row0) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a_step<T, D>(a[kk], tile, row0, kk);
}

// X, a 16-row tile's accumulator or fragments, as the one tile of the R-tile products' arrays.
template <typename E, int I, int J>
__device__ __forceinline__ auto one_tile(E (&x)[I][J]) -> E (&)[1][I][J] {
  return reinterpret_cast<E(&)[1][I][J]>(x);
}
template <typename E, int I>
__device__ __forceinline__ auto one_tile(E (&x)[I]) -> E (&)[1][I] {
  return reinterpret_cast<E(&)[1][I]>(x);
}

// ACC[r] (16 x N) += A[r] (16 x D) B^T for R row tiles, B^T the N rows 0.. of a shared tile
// (B's columns are its rows, k its columns): S = Q K^T, dP = dO V^T. Each B fragment read from
// shared memory feeds all R tiles' products.
template <typename T, int D, int N, int R>
__device__ __forceinline__ void multiply_tiles_abt(float (&acc)[R][N / 8][4], const uint32_t (&a)[R][D / 16][4],
                                                   const T* tile) {
  const int lane = threadIdx.x % 32, m = lane / 8;
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    const int row = 16 * np + lane % 8 + 8 * (m >> 1);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[4];
      tc::ldmatrix_x4(b, tile + swizzled<D>(row, 2 * kk + (m & 1)));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int r = 0; r < R; ++r) {
        tc::mma_16816<T>(acc[r][2 * np], a[r][kk], b0);
        tc::mma_16816<T>(acc[r][2 * np + 1], a[r][kk], b1);
      }
    }
  }
}

// The same with A read from rows a_row0..a_row0+15 of a shared tile one 16-deep step at a time
// (the k loop outermost): 4 registers of A live instead of D / 4, for the dK/dV kernel, whose
// two accumulators leave no room for A's whole fragments.
template <typename T, int D, int N>
__device__ __forceinline__ void multiply_abt_streamed(float (&acc)[N / 8][4], const T* a_tile, int a_row0,
                                                      const T* tile) {
  const int lane = threadIdx.x % 32, m = lane / 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a_step<T, D>(a, a_tile, a_row0, kk);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b[4];
      tc::ldmatrix_x4(b, tile + swizzled<D>(16 * np + lane % 8 + 8 * (m >> 1), 2 * kk + (m & 1)));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      tc::mma_16816<T>(acc[2 * np], a, b0);
      tc::mma_16816<T>(acc[2 * np + 1], a, b1);
    }
  }
}

// ACC[r] (16 x C) += A[r] B for R row tiles and one 16-deep step KK of k: A's fragments (16 x 16),
// B rows 16 KK.. of a shared tile of width D (k its rows), columns 8 CHUNK0.. (C of them). Each B
// fragment read from shared memory feeds all R tiles' products.
template <typename T, int D, int C, int R>
__device__ __forceinline__ void multiply_tiles_step_b(float (&acc)[R][C / 8][4], const uint32_t (&a)[R][4],
                                                      const T* tile, int kk, int chunk0) {
  const int lane = threadIdx.x % 32, m = lane / 8;
  const int row = 16 * kk + lane % 8 + 8 * (m & 1);
#pragma unroll
  for (int dp = 0; dp < C / 16; ++dp) {
    uint32_t b[4];
    tc::ldmatrix_x4_trans(b, tile + swizzled<D>(row, chunk0 + 2 * dp + (m >> 1)));
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tc::mma_16816<T>(acc[r][2 * dp], a[r], b0);
      tc::mma_16816<T>(acc[r][2 * dp + 1], a[r], b1);
    }
  }
}

// The same for one row tile.
template <typename T, int D, int C>
__device__ __forceinline__ void multiply_step_b(float (&acc)[C / 8][4], const uint32_t (&a)[4], const T* tile, int kk,
                                                int chunk0) {
  multiply_tiles_step_b<T, D, C, 1>(one_tile(acc), one_tile(a), tile, kk, chunk0);
}

// Fragment KK (k 16 kk..16 kk + 15) of P (16 x K fp32 accumulators) rounded to T as the A
// operand of P B: register r holds values 2 (r % 2) and 2 (r % 2) + 1 (low half first) of P's
// tile 2 kk + r / 2 (the C layout of two 8-column tiles is the A layout of one 16-deep step).
template <typename T, int K>
__device__ __forceinline__ void pack_step(uint32_t (&a)[4], const float (&p)[K / 8][4], int kk) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float(&tile)[4] = p[2 * kk + r / 2];
    a[r] = tc::pack2<T>(tile[2 * (r % 2)], tile[2 * (r % 2) + 1]);
  }
}

// All K / 16 fragments of P.
template <typename T, int K>
__device__ __forceinline__ void pack_a(uint32_t (&a)[K / 16][4], const float (&p)[K / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) pack_step<T, K>(a[kk], p, kk);
}

// ACC (16 x C) += A B, A's K / 16 fragments from pack_a, B the K rows 0.. of a shared tile of
// width D (k its rows), columns 8 CHUNK0.. (C of them, all D by default).
template <typename T, int D, int K, int C = D>
__device__ __forceinline__ void multiply_packed_b(float (&acc)[C / 8][4], const uint32_t (&a)[K / 16][4], const T* tile,
                                                  int chunk0 = 0) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) multiply_step_b<T, D, C>(acc, a[kk], tile, kk, chunk0);
}

// ACC[r] (16 x C) += P[r] (16 x K, fp32 accumulators rounded to T) B for R row tiles, B the K
// rows 0.. of a shared tile of width D (k its rows), columns 8 CHUNK0.. (C of them, all D by
// default): o += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <typename T, int D, int K, int R, int C = D>
__device__ __forceinline__ void multiply_tiles_pb(float (&acc)[R][C / 8][4], const float (&p)[R][K / 8][4],
                                                  const T* tile, int chunk0 = 0) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) pack_step<T, K>(a[r], p[r], kk);
    multiply_tiles_step_b<T, D, C, R>(acc, a, tile, kk, chunk0);
  }
}

// The same for one row tile.
template <typename T, int D, int K, int C = D>
__device__ __forceinline__ void multiply_pb(float (&acc)[C / 8][4], const float (&p)[K / 8][4], const T* tile,
                                            int chunk0 = 0) {
  multiply_tiles_pb<T, D, K, 1, C>(one_tile(acc), one_tile(p), tile, chunk0);
}

// The same with A the 16 rows A_ROW0.. of a shared tile of width K (k its columns): the one-pass
// backward's dQ += dS K, dS read back from shared memory.
template <typename T, int D, int K, int C>
__device__ __forceinline__ void multiply_tile_b(float (&acc)[C / 8][4], const T* a_tile, int a_row0, const T* tile,
                                                int chunk0) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    load_a_step<T, K>(a, a_tile, a_row0, kk);
    multiply_step_b<T, D, C>(acc, a, tile, kk, chunk0);
  }
}

// ACC[r] (16 x N) += A[r] B^T for R row tiles, A[r] the 16 rows A_ROW0 + 16 r.. of the shared tile
// A_TILE, from their fragments FRAG where they stay in registers (Tiles<D>::kRowsInRegisters),
// else read from the tile (one tile a warp then).
template <typename T, int D, int N, int R>
__device__ __forceinline__ void multiply_tiles_rows_abt(float (&acc)[R][N / 8][4],
                                                        const uint32_t (&frag)[R][Tiles<D>::kFragments][4],
                                                        const T* a_tile, int a_row0, const T* tile) {
  if constexpr (Tiles<D>::kRowsInRegisters) {
    multiply_tiles_abt<T, D, N, R>(acc, frag, tile);
  } else {
    static_assert(R == 1, "rows streamed from shared memory: one tile a warp");
    multiply_abt_streamed<T, D, N>(acc[0], a_tile, a_row0, tile);
  }
}

// The same for one row tile.
template <typename T, int D, int N>
__device__ __forceinline__ void multiply_rows_abt(float (&acc)[N / 8][4],
                                                  const uint32_t (&frag)[Tiles<D>::kFragments][4], const T* a_tile,
                                                  int a_row0, const T* tile) {
  multiply_tiles_rows_abt<T, D, N, 1>(one_tile(acc), one_tile(frag), a_tile, a_row0, tile);
}

// Loads FRAG from the warp's rows ROW0.. of TILE where they stay in registers; else nothing.
template <typename T, int D>
__device__ __forceinline__ void load_row_fragments(uint32_t (&frag)[Tiles<D>::kFragments][4], const T* tile, int row0) {
  if constexpr (Tiles<D>::kRowsInRegisters) load_a_fragments<T, D>(frag, tile, row0);
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// An accumulator value's coordinates in its 16 x 8N tile: value E of 8-column tile NT of lane
// 4g + t is row g + 8 (E / 2), column 8 NT + 2t + E % 2.
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x % 32) / 4 + 8 * (e >> 1); }
__device__ __forceinline__ int acc_col(int nt, int e) { return 8 * nt + 2 * ((threadIdx.x % 32) % 4) + (e & 1); }

// Sums (or maximises) V over the 4 lanes that hold one row of an accumulator.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Stores ACC (16 x D fp32, times SCALE) as rows row0.. of the (seqlen, head_dim) slice at BASE.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* base, int64_t stride, int row0, int seqlen, int head_dim,
                                           const float (&acc)[D / 8][4], const float (&scale)[2]) {
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = acc_col(dt, 0);
    if (col >= head_dim) continue;  // head_dim is a multiple of 8: a tile is in or out
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + acc_row(2 * r);
      if (row < seqlen) {
        *reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(row) * stride + col) =
            tc::pack2<T>(acc[dt][2 * r] * scale[r], acc[dt][2 * r + 1] * scale[r]);
      }
    }
  }
}

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Offsets of a tensor's (batch, head) slice.
template <typename T>
__device__ __forceinline__ const T* slice(const void* base, const int64_t (&stride)[3], int b, int h) {
  return static_cast<const T*>(base) + b * stride[0] + h * stride[1];
}
template <typename T>
__device__ __forceinline__ T* slice(void* base, const int64_t (&stride)[3], int b, int h) {
  return static_cast<T*>(base) + b * stride[0] + h * stride[1];
}

// PTR moved ROWS rows of STRIDE on (null stays null: a tensor the call has not).
template <typename T>
__device__ __forceinline__ T* rows_on(T* ptr, int64_t rows, int64_t stride) {
  return ptr == nullptr ? ptr : ptr + rows * stride;
}

// The view of P that a block of batch B works in: for packed sequences, sequence B's lengths and
// every tensor's pointer moved to the sequence's first row (their batch strides, lse's too, are
// 0); P itself otherwise (moved by 0 rows: one code path, no selects of every pointer).
template <typename T>
__device__ __forceinline__ AttentionParams in_sequence(const AttentionParams& p, int b) {
  const bool packed = p.cu_seqlens_q != nullptr;
  const int q0 = packed ? p.cu_seqlens_q[b] : 0, k0 = packed ? p.cu_seqlens_k[b] : 0;
  AttentionParams s = p;
  s.seqlen_q = packed ? p.cu_seqlens_q[b + 1] - q0 : p.seqlen_q;
  s.seqlen_k = packed ? p.cu_seqlens_k[b + 1] - k0 : p.seqlen_k;
  s.q = rows_on(static_cast<const T*>(p.q), q0, p.q_stride[2]);
  s.k = rows_on(static_cast<const T*>(p.k), k0, p.k_stride[2]);
  s.v = rows_on(static_cast<const T*>(p.v), k0, p.v_stride[2]);
  s.o = rows_on(static_cast<T*>(p.o), q0, p.o_stride[2]);
  s.dout = rows_on(static_cast<const T*>(p.dout), q0, p.dout_stride[2]);
  s.dq = rows_on(static_cast<T*>(p.dq), q0, p.dq_stride[2]);
  s.dq_accum = rows_on(p.dq_accum, q0, p.dq_accum_stride[2]);
  s.dk = rows_on(static_cast<T*>(p.dk), k0, p.dk_stride[2]);
  s.dv = rows_on(static_cast<T*>(p.dv), k0, p.dv_stride[2]);
  s.lse = rows_on(p.lse, q0, 1);
  s.delta = rows_on(p.delta, q0, 1);
  return s;
}

// The offset of (batch b, head h)'s rows in lse and delta.
__device__ __forceinline__ int64_t lse_rows(const AttentionParams& p, int b, int h) {
  return b * p.lse_stride[0] + h * p.lse_stride[1];
}

// A block's (sequence block, head, batch) from its index in a 1-D grid of BLOCKS sequence blocks
// times HEADS heads times the batch: no grid axis limits the heads or the batch (y and z hold
// 65535 at most).
struct BlockIndex {
  int block, head, batch;
};
__device__ __forceinline__ BlockIndex block_index(int blocks, int heads) {
  const int64_t id = blockIdx.x;
  return {static_cast<int>(id % blocks), static_cast<int>(id / blocks % heads),
          static_cast<int>(id / (static_cast<int64_t>(blocks) * heads))};
}

// The blocks first.. (count of them) of width N along one sequence that hold the positions
// [lo, hi) some row of a block sees (lo, hi in int64: the window's sums may pass int's range).
struct Blocks {
  int first, count;
};
__device__ __forceinline__ Blocks blocks_holding(int64_t lo, int64_t hi, int seqlen, int N) {
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen ? seqlen : hi;
  if (hi <= lo) return {0, 0};
  const int first = static_cast<int>(lo / N);
  return {first, ceil_div(static_cast<int>(hi), N) - first};
}

// The key blocks of width N that query rows m0..m0+M-1 see: keys i + Sk - Sq - left ..
// i + Sk - Sq + right of each row i.
__device__ __forceinline__ Blocks key_blocks(const AttentionParams& p, int m0, int M, int N) {
  const int64_t diag = p.seqlen_k - p.seqlen_q, rows_end = imin(m0 + M, p.seqlen_q);
  return blocks_holding(m0 + diag - p.window_left, rows_end + diag + p.window_right, p.seqlen_k, N);
}

// The query blocks of width M that see keys n0..n0+N-1: rows j - (Sk - Sq) - right ..
// j - (Sk - Sq) + left of each key j.
__device__ __forceinline__ Blocks query_blocks(const AttentionParams& p, int n0, int N, int M) {
  const int64_t diag = p.seqlen_k - p.seqlen_q, keys_end = imin(n0 + N, p.seqlen_k);
  return blocks_holding(n0 - diag - p.window_right, keys_end - diag + p.window_left, p.seqlen_q, M);
}

// Whether query ROW sees key COL (a key past the sequence is seen by none).
__device__ __forceinline__ bool visible(const AttentionParams& p, int row, int col) {
  const int from_diagonal = col - row - (p.seqlen_k - p.seqlen_q);
  return col < p.seqlen_k && from_diagonal >= -p.window_left && from_diagonal <= p.window_right;
}

// Whether every existing query row of m0..m0+M-1 sees every key of n0..n0+N-1.
__device__ __forceinline__ bool sees_all(const AttentionParams& p, int m0, int M, int n0, int N) {
  const int64_t diag = p.seqlen_k - p.seqlen_q, last_row = imin(m0 + M, p.seqlen_q) - 1;
  return n0 + N <= p.seqlen_k && n0 + N - 1 - m0 - diag <= p.window_right &&
         n0 - last_row - diag >= -p.window_left;
}

// The ALiBi slope of (batch B, head H) in base 2; 0 without ALiBi.
__device__ __forceinline__ float alibi_slope_log2(const AttentionParams& p, int b, int h) {
  return p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] * kLog2e : 0.f;
}

// The score in base 2 of the raw product X = q . k of query ROW and key COL: scaled (by
// SCALE_LOG2, the scale times log2 e), softcapped, ALiBi-biased (SLOPE_LOG2 from
// alibi_slope_log2). T gets tanh(scale x / c) under softcapping (the backward's derivative), else 0.
__device__ __forceinline__ float score_log2(const AttentionParams& p, float x, float scale_log2, float slope_log2,
                                            int row, int col, float& t) {
  t = 0.f;
  if (p.softcap_in != 0.f) {
    t = tanhf(x * p.softcap_in);
    x = t * p.softcap_out;
  } else {
    x *= scale_log2;
  }
  if (slope_log2 != 0.f) x -= slope_log2 * fabsf(static_cast<float>(row + (p.seqlen_k - p.seqlen_q) - col));
  return x;
}

// The four output words of Philox-4x32-10 (Salmon et al. 2011; Triton's tl.philox) with key
// (KEY0, KEY1) and counter (C0, C1, C2, 0).
struct PhiloxWords {
  uint32_t w[4];
};
__host__ __device__ __forceinline__ PhiloxWords philox(uint32_t key0, uint32_t key1, uint32_t c0, uint32_t c1,
                                                       uint32_t c2) {
  uint32_t c3 = 0;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint64_t b = static_cast<uint64_t>(0xCD9E8D57u) * c2, a = static_cast<uint64_t>(0xD2511F53u) * c0;
    c0 = static_cast<uint32_t>(b >> 32) ^ c1 ^ key0;
    c1 = static_cast<uint32_t>(b);
    c2 = static_cast<uint32_t>(a >> 32) ^ c3 ^ key1;
    c3 = static_cast<uint32_t>(a);
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Dropout's mask for one (batch, head) slice, as the Triton kernels' _dropout_kept
// (remat.ops.attention.dropout_keep_mask): one Philox call, key the seed and counter (k, q,
// batch * H + head, 0), for the group of positions {q, q + 8} x {k, k + 8} (bit 3 of q and k
// clear); (query i, key j) takes word 2 (i / 8 % 2) + j / 8 % 2, kept when its top 31 bits reach
// the threshold. A function of the positions alone, so every kernel and tile shape draws the same mask.
struct DropoutMask {
  uint32_t key0, key1, slice, threshold;
  // Bit 2 dq + dk of the result: whether (QUERY + 8 dq, KEY + 8 dk) is kept (QUERY, KEY: bit 3 clear).
  __device__ __forceinline__ uint32_t kept_group(int query, int key) const {
    const PhiloxWords r = philox(key0, key1, static_cast<uint32_t>(key), static_cast<uint32_t>(query), slice);
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) bits |= static_cast<uint32_t>((r.w[i] >> 1) >= threshold) << i;
    return bits;
  }
};

// The mask of (batch B, head H); P has dropout (P.dropout_seed is not null).
__device__ __forceinline__ DropoutMask dropout_mask(const AttentionParams& p, int b, int h) {
  const uint64_t seed = static_cast<uint64_t>(*p.dropout_seed);
  return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
          static_cast<uint32_t>(static_cast<int64_t>(b) * p.heads + h), p.dropout_threshold};
}

// Which of this thread's accumulator values of a 16 x 8 TILES block dropout keeps: bit 4 nt + e
// for value e of tile nt, at row ROW0 + acc_row(e) and column COL0 + acc_col(nt, e) (queries
// along the rows, or, with kKeyRows, keys: the dK/dV kernel's transposed blocks). All ones
// without dropout. ROW0 and COL0 are multiples of 16, so a thread's values of tiles 2j and 2j + 1
// with column parity c (values c and c + 2: 8 rows apart; the tiles 8 columns apart) are one
// mask group, one Philox call. Computed before a block's products, in a loop left rolled: the
// 10 Philox rounds unrolled and interleaved took the registers the products need (ptxas
// spilled), where 32 bits are all that live on.
template <int TILES, bool kKeyRows = false>
__device__ __forceinline__ uint32_t kept_bits(const AttentionParams& p, int b, int h, int row0, int col0) {
  static_assert(TILES * 4 <= 32 && TILES % 2 == 0, "one bit per accumulator value, tiles in pairs");
  if (p.dropout_seed == nullptr) return ~0u;
  const DropoutMask mask = dropout_mask(p, b, h);
  uint32_t bits = 0;
#pragma unroll 1
  for (int i = 0; i < TILES; ++i) {  // i = 2 j + c: the pair of tiles j, the column parity c
    const int nt = 2 * (i / 2), c = i % 2;
    const int row = row0 + acc_row(c), col = col0 + acc_col(nt, c);  // the group's first (bit 3 clear)
    const uint32_t group = kKeyRows ? mask.kept_group(col, row) : mask.kept_group(row, col);
    // Group bit 2 dq + dk is the value 8 dq queries and 8 dk keys on: 8 rows on is value c + 2,
    // 8 columns on is tile nt + 1.
#pragma unroll
    for (int dq = 0; dq < 2; ++dq) {
#pragma unroll
      for (int dk = 0; dk < 2; ++dk) {
        const int rows_on = kKeyRows ? dk : dq, columns_on = kKeyRows ? dq : dk;
        bits |= ((group >> (2 * dq + dk)) & 1u) << (4 * (nt + columns_on) + c + 2 * rows_on);
      }
    }
  }
  return bits;
}

// Bit 4 NT + E of BITS (kept_bits's) set: the value is kept.
__device__ __forceinline__ bool is_kept(uint32_t bits, int nt, int e) { return (bits >> (4 * nt + e)) & 1u; }

// lse (natural log) as the backward uses it: log2 units, +inf for rows that see no key or lie
// past the sequence, so that exp2(s - lse) is 0 there rather than NaN.
__device__ __forceinline__ float lse_log2(const float* lse, int row, int seqlen) {
  const float l = row < seqlen ? lse[row] : -INFINITY;
  return l == -INFINITY ? INFINITY : l * kLog2e;
}

// ----------------------------------------------------------------------------------- forward ----

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd_kernel(const AttentionParams params) {
  constexpr int M = Tiles<D>::kFwdM, N = Tiles<D>::kFwdN, R = Tiles<D>::kFwdRowTiles;
  REMAT_DYNAMIC_SMEM(unsigned char, smem);
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_k = s_q + M * D;  // two stages each
  T* s_v = s_k + 2 * N * D;
  const BlockIndex at = block_index(ceil_div(params.seqlen_q, M), params.heads);
  const AttentionParams p = in_sequence<T>(params, at.batch);
  const int b = at.batch, h = at.head, kv_h = h / (p.heads / p.kv_heads);
  const int m0 = at.block * M, warp = threadIdx.x / 32;
  if (m0 >= p.seqlen_q) return;  // past a packed sequence's end
  const T* q = slice<T>(p.q, p.q_stride, b, h);
  const T* k = slice<T>(p.k, p.k_stride, b, kv_h);
  const T* v = slice<T>(p.v, p.v_stride, b, kv_h);
  const Blocks keys = key_blocks(p, m0, M, N);
  const float scale_log2 = p.softmax_scale * kLog2e, slope_log2 = alibi_slope_log2(p, b, h);
  const bool dropout = p.dropout_seed != nullptr;
  // The warp's R row tiles: rows tile_row(r).. of the block (16 each).
  auto tile_row = [&](int r) { return (warp * R + r) * kRowsPerWarp; };

  float acc[R][D / 8][4];
  float row_max[R][2], row_sum[R][2];  // thread-partial sums
#pragma unroll
  for (int r = 0; r < R; ++r) {
    zero(acc[r]);
    row_max[r][0] = row_max[r][1] = -INFINITY;
    row_sum[r][0] = row_sum[r][1] = 0.f;
  }
  uint32_t q_frag[R][Tiles<D>::kFragments][4];
  if (keys.count > 0) {
    load_tile<T, D, M>(s_q, q, p.q_stride[2], m0, p.seqlen_q, p.head_dim);
    load_kv_block<T, D, N>(s_k, s_v, 0, k, v, p, keys.first * N);
    tc::cp_async_commit();
  }
  for (int j = 0; j < keys.count; ++j) {
    // Block j has landed for every thread, and every thread is done with block j - 1's stage.
    tc::cp_async_wait<0>();
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) load_row_fragments<T, D>(q_frag[r], s_q, tile_row(r));
    }
    const int stage = j & 1, n0 = (keys.first + j) * N;
    if (j + 1 < keys.count) {
      load_kv_block<T, D, N>(s_k, s_v, stage ^ 1, k, v, p, n0 + N);
      tc::cp_async_commit();
    }
    const T* k_tile = s_k + stage * N * D;
    uint32_t kept[R];
#pragma unroll
    for (int r = 0; r < R; ++r) kept[r] = kept_bits<N / 8>(p, b, h, m0 + tile_row(r), n0);
    float s[R][N / 8][4];
#pragma unroll
    for (int r = 0; r < R; ++r) zero(s[r]);
    multiply_tiles_rows_abt<T, D, N, R>(s, q_frag, s_q, tile_row(0), k_tile);

    const bool masked = !sees_all(p, m0, M, n0, N);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row0 = m0 + tile_row(r);
      // The scores (scaled, capped, biased), masked (the tail of the keys, the window), and the
      // block's row maxima.
      float block_max[2] = {row_max[r][0], row_max[r][1]};
#pragma unroll
      for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + acc_col(nt, e), row = row0 + acc_row(e);
          float t;
          const float x = score_log2(p, s[r][nt][e], scale_log2, slope_log2, row, col, t);
          s[r][nt][e] = !masked || visible(p, row, col) ? x : -INFINITY;
          block_max[e >> 1] = fmaxf(block_max[e >> 1], s[r][nt][e]);
        }
      }
      // The online softmax: rescale what was summed so far to the new maxima.
      float shift[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float new_max = quad_max(block_max[i]);
        shift[i] = new_max == -INFINITY ? 0.f : new_max;  // a row that has seen no key yet stays at 0
        alpha[i] = exp2f(row_max[r][i] - shift[i]);
        row_max[r][i] = new_max;
        row_sum[r][i] *= alpha[i];
      }
#pragma unroll
      for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[r][nt][e] = exp2f(s[r][nt][e] - shift[e >> 1]);
          row_sum[r][e >> 1] += s[r][nt][e];
        }
      }
      if (dropout) {  // after the sums: dropout acts on the normalised probabilities (1 / (1 - p) at the end)
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[r][nt][e] = is_kept(kept[r], nt, e) ? s[r][nt][e] : 0.f;
        }
      }
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][dt][e] *= alpha[e >> 1];
      }
    }
    multiply_tiles_pb<T, D, N, R>(acc, s, s_v + stage * N * D);
  }

  // o = acc / l (times 1 / (1 - p) under dropout); lse = (m + log2 l) ln 2, -inf (and o = 0)
  // for rows that saw no key.
  float* lse = p.lse + lse_rows(p, b, h);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row0 = m0 + tile_row(r);
    float inv_sum[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float total = quad_sum(row_sum[r][i]);
      inv_sum[i] = total > 0.f ? p.dropout_scale / total : 0.f;
      const int row = row0 + acc_row(2 * i);
      if (threadIdx.x % 4 == 0 && row < p.seqlen_q) {
        lse[row] = total > 0.f ? (row_max[r][i] + log2f(total)) * kLn2 : -INFINITY;
      }
    }
    store_rows<T, D>(slice<T>(p.o, p.o_stride, b, h), p.o_stride[2], row0, p.seqlen_q, p.head_dim, acc[r], inv_sum);
  }
}

// ---------------------------------------------------------------------------------- backward ----

// delta = rowsum(dO * O) in fp32, a warp a row.
template <typename T>
__global__ void __launch_bounds__(kThreads) attention_bwd_preprocess_kernel(const AttentionParams params) {
  const BlockIndex at = block_index(ceil_div(params.seqlen_q, kPreRows), params.heads);
  const AttentionParams p = in_sequence<T>(params, at.batch);
  const int b = at.batch, h = at.head, lane = threadIdx.x % 32;
  const T* o = slice<T>(p.o, p.o_stride, b, h);
  const T* dout = slice<T>(p.dout, p.dout_stride, b, h);
  float* delta = p.delta + lse_rows(p, b, h);
  for (int row = at.block * kPreRows + threadIdx.x / 32; row < imin((at.block + 1) * kPreRows, p.seqlen_q);
       row += kWarps) {
    float sum = 0.f;
    for (int col = lane; col < p.head_dim; col += 32) {
      sum += to_f32(o[row * p.o_stride[2] + col]) * to_f32(dout[row * p.dout_stride[2] + col]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) delta[row] = sum;
  }
}

// The one-pass backward (P.dq_accum set) adds dQ in the dK/dV kernel: rows m0..m0+M-1 of query
// head h, columns col0..col0+C-1 (the block's), += scale dS K over the block's N keys, by fp32
// atomic adds (so the order in which a row's key blocks are summed varies from run to run).
// First every warp stores its dS^T (16 keys x M queries, DS_A: pack_a's fragments, rounded to T
// as the dQ kernel rounds dS) into S_DS as rows of queries (store_ds); after a barrier, warp w
// multiplies row tile w % (M / 16) of dS by column group w / (M / 16) of K's block (add_dq).
template <typename T, int D>
__device__ __forceinline__ void store_ds(T* s_ds, const uint32_t (&ds_a)[Tiles<D>::kDkdvM / 16][4]) {
  constexpr int M = Tiles<D>::kDkdvM, N = Tiles<D>::kDkdvN;
  const int warp = threadIdx.x / 32;
  // Value e of tile nt is query 8 nt + acc_col(0, e) and key 16 warp + acc_row(e): its swizzled
  // place is 8 nt rows past that of tile 0 (8 rows keep the swizzle), so 4 offsets serve them all.
  uint16_t* ds_bits = reinterpret_cast<uint16_t*>(s_ds);
  int offset[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int query = acc_col(0, e), key = warp * kRowsPerWarp + acc_row(e);
    offset[e] = swizzled<N>(query, key / 8) + key % 8;
  }
#pragma unroll
  for (int nt = 0; nt < M / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t pair = ds_a[nt / 2][2 * (nt % 2) + e / 2];
      ds_bits[offset[e] + 8 * nt * N] = static_cast<uint16_t>(pair >> (16 * (e % 2)));
    }
  }
}

// DST[0] += X and DST[1] += Y by fp32 atomics: one vector atomic on sm_90 (DST 8-byte aligned:
// dQ's rows start at multiples of the head dim, the columns are even), two before it.
__device__ __forceinline__ void atomic_add2(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// The product and the atomic adds, kChunk columns at a time in a loop left rolled: the kernel's
// dK and dV accumulators leave no registers for a wider one.
template <typename T, int D>
__device__ __forceinline__ void add_dq(const AttentionParams& p, const T* s_ds, const T* s_k, int b, int h, int m0,
                                       int col0) {
  constexpr int M = Tiles<D>::kDkdvM, N = Tiles<D>::kDkdvN, C = Tiles<D>::kDkdvCols;
  constexpr int kRowTiles = M / kRowsPerWarp, kColumns = C / (kWarps / kRowTiles);
  constexpr int kChunk = kColumns % 32 == 0 ? 32 : 16;
  static_assert(kWarps % kRowTiles == 0 && kColumns % kChunk == 0, "the warps split dQ's block evenly");
  const int warp = threadIdx.x / 32, row0 = m0 + warp % kRowTiles * kRowsPerWarp;
  float* dq_rows = p.dq_accum + b * p.dq_accum_stride[0] + h * p.dq_accum_stride[1];
  __syncthreads();  // every warp's dS is in S_DS
#pragma unroll 1
  for (int first_col = col0 + warp / kRowTiles * kColumns, end = first_col + kColumns; first_col < end;
       first_col += kChunk) {
    float dq[kChunk / 8][4];
    zero(dq);
    multiply_tile_b<T, D, N, kChunk>(dq, s_ds, row0 - m0, s_k, first_col / 8);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + acc_row(2 * r);
      if (row >= p.seqlen_q) continue;
      float* dq_row = dq_rows + static_cast<int64_t>(row) * p.dq_accum_stride[2];
#pragma unroll
      for (int dt = 0; dt < kChunk / 8; ++dt) {
        const int col = first_col + acc_col(dt, 2 * r);
        if (col >= p.head_dim) continue;  // head_dim is a multiple of 8: a tile is in or out
        atomic_add2(dq_row + col, dq[dt][2 * r] * p.softmax_scale, dq[dt][2 * r + 1] * p.softmax_scale);
      }
    }
  }
}

// dK and dV of 64 keys (16 a warp) of one (batch, key/value head); at D = 256, of half their
// columns (Tiles<D>::kDkdvColumnBlocks blocks a key block, the fastest varying block index).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) attention_dkdv_kernel(const AttentionParams params) {
  constexpr int M = Tiles<D>::kDkdvM, N = Tiles<D>::kDkdvN, C = Tiles<D>::kDkdvCols;
  constexpr int kColumnBlocks = Tiles<D>::kDkdvColumnBlocks;
  REMAT_DYNAMIC_SMEM(unsigned char, smem);
  T* s_k = reinterpret_cast<T*>(smem);
  T* s_v = s_k + N * D;
  T* s_q = s_v + N * D;  // two stages each, from here on
  T* s_do = s_q + 2 * M * D;
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * M * D);  // log2 units (lse_log2)
  float* s_delta = s_lse + 2 * M;
  T* s_ds = reinterpret_cast<T*>(s_delta + 2 * M);  // the one-pass backward's dS block (add_dq)
  const BlockIndex at = block_index(ceil_div(params.seqlen_k, N) * kColumnBlocks, params.kv_heads);
  const AttentionParams p = in_sequence<T>(params, at.batch);
  const int b = at.batch, kv_h = at.head, n0 = at.block / kColumnBlocks * N, warp = threadIdx.x / 32;
  const int col0 = at.block % kColumnBlocks * C;  // the first dK/dV column of this block
  if (n0 >= p.seqlen_k) return;  // past a packed sequence's end
  const int group = p.heads / p.kv_heads;
  // The iterations: every query block that sees one of these keys, of every query head of the group.
  const Blocks queries = query_blocks(p, n0, N, M);
  const int iterations = group * queries.count;
  const float scale_log2 = p.softmax_scale * kLog2e;
  const bool one_pass = p.dq_accum != nullptr;

  // Starts the loads of iteration IT into STAGE: q and dO by cp.async, lse and delta by plain
  // loads (their rows need not be 16-byte aligned).
  auto issue = [&](int it, int stage) {
    const int h = kv_h * group + it / queries.count, m0 = (queries.first + it % queries.count) * M;
    load_tile<T, D, M>(s_q + stage * M * D, slice<T>(p.q, p.q_stride, b, h), p.q_stride[2], m0, p.seqlen_q,
                       p.head_dim);
    load_tile<T, D, M>(s_do + stage * M * D, slice<T>(p.dout, p.dout_stride, b, h), p.dout_stride[2], m0,
                       p.seqlen_q, p.head_dim);
    const int64_t rows = lse_rows(p, b, h);
    for (int i = threadIdx.x; i < M; i += kThreads) {
      s_lse[stage * M + i] = lse_log2(p.lse + rows, m0 + i, p.seqlen_q);
      s_delta[stage * M + i] = m0 + i < p.seqlen_q ? p.delta[rows + m0 + i] : 0.f;
    }
  };

  float dk[C / 8][4], dv[C / 8][4];
  zero(dk);
  zero(dv);
  if (iterations > 0) {
    load_tile<T, D, N>(s_k, slice<T>(p.k, p.k_stride, b, kv_h), p.k_stride[2], n0, p.seqlen_k, p.head_dim);
    load_tile<T, D, N>(s_v, slice<T>(p.v, p.v_stride, b, kv_h), p.v_stride[2], n0, p.seqlen_k, p.head_dim);
    issue(0, 0);
    tc::cp_async_commit();
  }
  for (int it = 0; it < iterations; ++it) {
    tc::cp_async_wait<0>();
    __syncthreads();
    const int stage = it & 1, m0 = (queries.first + it % queries.count) * M;
    const int h = kv_h * group + it / queries.count, key0 = n0 + warp * kRowsPerWarp;
    const float slope_log2 = alibi_slope_log2(p, b, h);
    if (it + 1 < iterations) {
      issue(it + 1, stage ^ 1);
      tc::cp_async_commit();
    }
    const T* q = s_q + stage * M * D;
    const T* dout = s_do + stage * M * D;
    const float* lse = s_lse + stage * M;
    const float* delta = s_delta + stage * M;
    const uint32_t kept = kept_bits<M / 8, true>(p, b, h, key0, m0);

    // dP^T = V dO^T and the raw scores K Q^T (16 keys x M queries); then, where the query sees
    // the key, P^T = exp2(score - lse) and dS^T = P^T * (dP^T - delta) (1 - tanh^2 under the
    // cap; t = 0 otherwise, so the factor is exactly 1). Then dV += P^T dO and dK += dS^T Q.
    // Dropout: dV takes the dropped P^T and dS^T the dropped dP^T (each kept entry times 1 / (1 - p);
    // without dropout every entry is kept and the scale is 1).
    float pt[M / 8][4], dst[M / 8][4];
    zero(dst);
    zero(pt);
    multiply_abt_streamed<T, D, M>(dst, s_v, warp * kRowsPerWarp, dout);
    multiply_abt_streamed<T, D, M>(pt, s_k, warp * kRowsPerWarp, q);
#pragma unroll
    for (int nt = 0; nt < M / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = acc_col(nt, e), query = m0 + col, key = key0 + acc_row(e);
        float t;
        const float x = score_log2(p, pt[nt][e], scale_log2, slope_log2, query, key, t);
        const float prob = visible(p, query, key) ? exp2f(x - lse[col]) : 0.f;
        const bool keep = is_kept(kept, nt, e);
        const float dp = keep ? dst[nt][e] * p.dropout_scale : 0.f;
        pt[nt][e] = keep ? prob * p.dropout_scale : 0.f;
        dst[nt][e] = prob * (dp - delta[col]) * (1.f - t * t);
      }
    }
    uint32_t ds_a[M / 16][4];  // dS^T rounded to T: dK's A operand, and the one pass's dS (store_ds)
    pack_a<T, M>(ds_a, dst);
    if (one_pass) store_ds<T, D>(s_ds, ds_a);
    multiply_pb<T, D, M, C>(dv, pt, dout, col0 / 8);
    multiply_packed_b<T, D, M, C>(dk, ds_a, q, col0 / 8);
    if (one_pass) add_dq<T, D>(p, s_ds, s_k, b, h, m0, col0);
  }
  const float scale[2] = {p.softmax_scale, p.softmax_scale}, one[2] = {1.f, 1.f};
  const int key0 = n0 + warp * kRowsPerWarp;
  store_rows<T, C>(slice<T>(p.dk, p.dk_stride, b, kv_h) + col0, p.dk_stride[2], key0, p.seqlen_k,
                   p.head_dim - col0, dk, scale);
  store_rows<T, C>(slice<T>(p.dv, p.dv_stride, b, kv_h) + col0, p.dv_stride[2], key0, p.seqlen_k,
                   p.head_dim - col0, dv, one);
}

// dQ of 64 query rows (16 a warp) of one (batch, head).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) attention_dq_kernel(const AttentionParams params) {
  constexpr int M = Tiles<D>::kDqM, N = Tiles<D>::kDqN;
  REMAT_DYNAMIC_SMEM(unsigned char, smem);
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_do = s_q + M * D;
  T* s_k = s_do + M * D;  // two stages each
  T* s_v = s_k + 2 * N * D;
  const BlockIndex at = block_index(ceil_div(params.seqlen_q, M), params.heads);
  const AttentionParams p = in_sequence<T>(params, at.batch);
  const int b = at.batch, h = at.head, kv_h = h / (p.heads / p.kv_heads);
  const int m0 = at.block * M, warp = threadIdx.x / 32, row0 = m0 + warp * kRowsPerWarp;
  if (m0 >= p.seqlen_q) return;  // past a packed sequence's end
  const T* k = slice<T>(p.k, p.k_stride, b, kv_h);
  const T* v = slice<T>(p.v, p.v_stride, b, kv_h);
  const Blocks keys = key_blocks(p, m0, M, N);
  const float scale_log2 = p.softmax_scale * kLog2e, slope_log2 = alibi_slope_log2(p, b, h);
  const int64_t rows = lse_rows(p, b, h);
  float lse[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + acc_row(2 * r);
    lse[r] = lse_log2(p.lse + rows, row, p.seqlen_q);
    delta[r] = row < p.seqlen_q ? p.delta[rows + row] : 0.f;
  }

  float dq[D / 8][4];
  zero(dq);
  uint32_t q_frag[Tiles<D>::kFragments][4], do_frag[Tiles<D>::kFragments][4];
  if (keys.count > 0) {
    load_tile<T, D, M>(s_q, slice<T>(p.q, p.q_stride, b, h), p.q_stride[2], m0, p.seqlen_q, p.head_dim);
    load_tile<T, D, M>(s_do, slice<T>(p.dout, p.dout_stride, b, h), p.dout_stride[2], m0, p.seqlen_q, p.head_dim);
    load_kv_block<T, D, N>(s_k, s_v, 0, k, v, p, keys.first * N);
    tc::cp_async_commit();
  }
  for (int j = 0; j < keys.count; ++j) {
    tc::cp_async_wait<0>();
    __syncthreads();
    if (j == 0) {
      load_row_fragments<T, D>(q_frag, s_q, warp * kRowsPerWarp);
      load_row_fragments<T, D>(do_frag, s_do, warp * kRowsPerWarp);
    }
    const int stage = j & 1, n0 = (keys.first + j) * N;
    if (j + 1 < keys.count) {
      load_kv_block<T, D, N>(s_k, s_v, stage ^ 1, k, v, p, n0 + N);
      tc::cp_async_commit();
    }
    const T* k_tile = s_k + stage * N * D;
    const uint32_t kept = kept_bits<N / 8>(p, b, h, row0, n0);
    float s[N / 8][4], ds[N / 8][4];
    zero(s);
    zero(ds);
    multiply_rows_abt<T, D, N>(s, q_frag, s_q, warp * kRowsPerWarp, k_tile);
    multiply_rows_abt<T, D, N>(ds, do_frag, s_do, warp * kRowsPerWarp, s_v + stage * N * D);  // dP = dO V^T
    // dS = P * (dP - delta) (times 1 - tanh^2 under the cap), dP dropped under dropout. The key
    // tail is masked explicitly: its zero keys score 0, and exp2(0 - lse) may overflow where the
    // row's scores are all very negative.
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + acc_col(nt, e), row = row0 + acc_row(e);
        float t;
        const float x = score_log2(p, s[nt][e], scale_log2, slope_log2, row, col, t);
        const float prob = visible(p, row, col) ? exp2f(x - lse[e >> 1]) : 0.f;
        const float dp = is_kept(kept, nt, e) ? ds[nt][e] * p.dropout_scale : 0.f;
        ds[nt][e] = prob * (dp - delta[e >> 1]) * (1.f - t * t);
      }
    }
    multiply_pb<T, D, N>(dq, ds, k_tile);
  }
  const float scale[2] = {p.softmax_scale, p.softmax_scale};
  store_rows<T, D>(slice<T>(p.dq, p.dq_stride, b, h), p.dq_stride[2], row0, p.seqlen_q, p.head_dim, dq, scale);
}

// ------------------------------------------------------------------------------ the launches ----

// The tile width a head dim runs at; 0 when these kernels do not take it.
__host__ inline int padded_head_dim(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return 0;
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : head_dim <= 128 ? 128 : 256;
}

// Calls f(T{}, std::integral_constant<int, D>{}) for the storage type and padded head dim of P.
template <class F>
__host__ void dispatch(const AttentionParams& p, F&& f) {
  auto by_dim = [&](auto type) {
    switch (padded_head_dim(p.head_dim)) {
      case 32: return f(type, std::integral_constant<int, 32>{});
      case 64: return f(type, std::integral_constant<int, 64>{});
      case 96: return f(type, std::integral_constant<int, 96>{});
      case 128: return f(type, std::integral_constant<int, 128>{});
      default: return f(type, std::integral_constant<int, 256>{});
    }
  };
  if (p.bf16) {
    by_dim(__nv_bfloat16{});
  } else {
    by_dim(__half{});
  }
}

}  // namespace attn

// The blocks of a 1-D grid of BLOCKS sequence blocks x HEADS x BATCH (see block_index), in int64:
// the host checks that every launch's fits in grid.x (csrc/attention.cu's check_grids).
__host__ inline int64_t grid_blocks(int blocks, int heads, int batch) {
  return static_cast<int64_t>(blocks) * heads * batch;
}

// The forward's launch: LAUNCH(kernel, grid blocks, threads, shared memory bytes, params), once.
// A launcher skips a grid with no blocks.
template <class Launch>
__host__ void attention_forward(const AttentionParams& p, Launch&& launch) {
  attn::dispatch(p, [&](auto type, auto dim) {
    using T = decltype(type);
    constexpr int D = decltype(dim)::value;
    using Tiles = attn::Tiles<D>;
    launch(attn::attention_fwd_kernel<T, D>, grid_blocks(attn::ceil_div(p.seqlen_q, Tiles::kFwdM), p.heads, p.batch),
           attn::kThreads, Tiles::kFwdSmem, p);
  });
}

// The backward's launches, in order: delta, then dK/dV, then dQ; one pass (P.dq_accum set): delta,
// then dK/dV adding dQ.
template <class Launch>
__host__ void attention_backward(const AttentionParams& p, Launch&& launch) {
  const bool one_pass = p.dq_accum != nullptr;
  attn::dispatch(p, [&](auto type, auto dim) {
    using T = decltype(type);
    constexpr int D = decltype(dim)::value;
    using Tiles = attn::Tiles<D>;
    launch(attn::attention_bwd_preprocess_kernel<T>,
           grid_blocks(attn::ceil_div(p.seqlen_q, attn::kPreRows), p.heads, p.batch), attn::kThreads, 0, p);
    launch(attn::attention_dkdv_kernel<T, D>,
           grid_blocks(attn::ceil_div(p.seqlen_k, Tiles::kDkdvN) * Tiles::kDkdvColumnBlocks, p.kv_heads, p.batch),
           attn::kThreads, one_pass ? Tiles::kDkdvOnePassSmem : Tiles::kDkdvSmem, p);
    if (one_pass) return;
    launch(attn::attention_dq_kernel<T, D>, grid_blocks(attn::ceil_div(p.seqlen_q, Tiles::kDqM), p.heads, p.batch),
           attn::kThreads, Tiles::kDqSmem, p);
  });
}

}  // namespace remat
