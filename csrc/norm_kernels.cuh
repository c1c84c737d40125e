// The LayerNorm and RMSNorm kernels and their launchers, over the last dim of a 2-D tensor: forward
// and backward (with optional recomputation of the output). All math in fp32; no atomics, so every
// result is bitwise deterministic. layer_norm.cu and rms_norm.cu include this and each compile the
// instantiations of their own op: two translation units, which the build compiles in parallel
// (143 and 423 kernels an architecture: together they were the extension's longest compile).
//
// RMSNorm is a mode of the same kernels (NormMode::kRms): xhat = x * rstd with rstd from the mean
// of squares, only the fp32 rstd stored (4 bytes a row), no bias, and each stock module's
// rounding of y (the styles "torch", "llama", "gemma", "t5": rms_rounding in rms_norm.cu).
//
// Kernels, top to bottom:
//   layer_norm_fwd_kernel           row cached in registers (N <= kMaxRegisterWidthFwd)
//   layer_norm_fwd_looped_kernel    any N: re-reads the row from global memory
//   layer_norm_bwd_kernel           row cached in registers (N <= kMaxRegisterWidthBwd)
//   layer_norm_bwd_looped_kernel    any N
//   sum_partial_rows_kernel         (common.cuh) (G, N) fp32 partials -> (N,) dw and db, one launch
// then the launchers (run_fwd, run_bwd) and the input checks both ops share.
// Register kernels run one warp per row (kRowsPerWarpBlock rows per block) for narrow rows and
// one block per row otherwise; the host picks the elements per thread (EPT) and block size.
// Everything is in an anonymous namespace: each translation unit gets its own copy of what it uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/string_view.h>

#include "common.cuh"
#include "host.h"

namespace remat {
namespace {

constexpr int kMaxThreads = 512;          // block size cap of every LayerNorm kernel
constexpr int kRowsPerWarpBlock = 4;      // rows (warps) per block in one-warp-per-row mode
constexpr int kLoopedThreads = 512;       // block size of the looped kernels

// ---------------------------------------------------------------------------------------------
// What the kernels compute. LayerNorm: xhat = (x - mean) * rstd, y = xhat * w + b in x's type.
// RMSNorm (kRms): xhat = x * rstd (the same code with mean = 0), rstd = 1/sqrt(mean(x^2) + eps),
// no mean stored and no bias; y = round(xhat) * w' stored as Out, where round is the rounding of
// xhat to Normed and back (none for float) and w' = w, or 1 + w formed in fp32 for Gemma's norm
// (the kernels' runtime weight_plus_one). dy has y's type.
// ---------------------------------------------------------------------------------------------
template <bool kRmsNorm, typename Out, typename Normed = float>
struct NormMode {
  static constexpr bool kRms = kRmsNorm;
  using Y = Out;         // storage type of y and dy
  using Round = Normed;  // xhat is rounded to this type before the weight multiply
};

template <typename T>
using LayerNormMode = NormMode<false, T>;

// ---------------------------------------------------------------------------------------------
// Shared per-element math. Forward and the recomputing backward both call these, so the
// recomputed y is bitwise what the forward wrote (explicit _rn intrinsics: no contraction
// choices left to the compiler).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float normalize(float x, float mean, float rstd) {
  return __fmul_rn(__fsub_rn(x, mean), rstd);
}

// Corrected two-pass statistics. DEV = (sum of d, sum of d^2) with d = x - rough_mean over the
// row. E[x^2] - E[x]^2 would lose every digit for rows whose mean is far above their spread;
// deviations from a first mean do not, and their own mean is that first mean's rounding error,
// added back to the mean and removed from the variance (clamped at 0: rounding may leave a tiny negative).
__device__ __forceinline__ float corrected_mean(float rough_mean, float2 dev, float inv_n) {
  return rough_mean + dev.x * inv_n;
}

__device__ __forceinline__ float corrected_var(float2 dev, float inv_n) {
  const float correction = dev.x * inv_n;
  return fmaxf(dev.y * inv_n - correction * correction, 0.f);
}

// y = xhat * w + b; a missing weight is w = 1, a missing bias b = 0 (exact).
__device__ __forceinline__ float affine(float xhat, float w, float b) { return __fmaf_rn(xhat, w, b); }

// y of MODE from xhat: xhat rounded to Mode::Round (unchanged for float), then affine.
template <typename Mode>
__device__ __forceinline__ float norm_output(float xhat, float w, float b) {
  if constexpr (std::is_same_v<typename Mode::Round, float>) {
    return affine(xhat, w, b);
  } else {
    return affine(to_float(from_float<typename Mode::Round>(xhat)), w, b);
  }
}

// dx from wdy = dy * w', xhat, the row means c1 = mean(wdy * xhat) and c2 = mean(wdy) (LayerNorm
// only: RMSNorm has no mean to differentiate), and rstd; derived above layer_norm_bwd_kernel.
template <bool kRms>
__device__ __forceinline__ float input_grad(float wdy, float xhat, float c1, float c2, float rstd) {
  if constexpr (kRms) {
    return rstd * (wdy - xhat * c1);
  } else {
    return rstd * (wdy - (xhat * c1 + c2));
  }
}

// The row's mean as the forward stored it; 0 for RMSNorm (which stores none).
template <bool kRms>
__device__ __forceinline__ float load_mean(const float* __restrict__ Mean, int64_t row) {
  if constexpr (kRms) {
    return 0.f;
  } else {
    return Mean[row];
  }
}

// Loads VEC parameters at P + col0 (stored as PT: fp32 or x's dtype) as fp32, or VALUE when P is
// null (weight/bias absent).
template <typename PT, int VEC>
__device__ __forceinline__ void load_param(const PT* __restrict__ P, int col0, float value, float* out) {
  if (P != nullptr) {
    load_pack<PT, VEC>(P + col0, out);
  } else {
    fill<VEC>(out, value);
  }
}

// Loads VEC weights at W + col0 as the kernels multiply by them: w (1 when W is null), or 1 + w
// in fp32 for an RMSNorm with plus_one (Gemma's norm forms 1.0 + weight.float()).
template <typename Mode, typename PT, int VEC>
__device__ __forceinline__ void load_weight(const PT* __restrict__ W, int col0, bool plus_one, float* out) {
  load_param<PT, VEC>(W, col0, 1.f, out);
  if constexpr (Mode::kRms) {
    if (plus_one) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = __fadd_rn(out[j], 1.f);
    }
  }
}

// Row sum over the threads that own a row: one warp, or the whole (1-D) block.
template <bool kWarpPerRow, typename V>
__device__ __forceinline__ V row_sum(V v, V* buf) {
  if constexpr (kWarpPerRow) {
    return warp_sum(v);
  } else {
    return block_sum(v, buf);
  }
}

// Column of the first element of chunk I for thread T of a row group of THREADS threads.
// Chunks are interleaved so each pass of a group over the row is one coalesced access.
template <int VEC>
__device__ __forceinline__ int chunk_col(int i, int t, int threads) { return (i * threads + t) * VEC; }

// Number of chunks I with chunk_col(I, T, THREADS) < N (N a multiple of VEC). Tests against it
// are cheap to recompute, which keeps ptxas from holding (and spilling) one predicate per chunk.
template <int VEC>
__device__ __forceinline__ int valid_chunks(int N, int t, int threads) {
  const int n = N / VEC;
  return n > t ? (n - t + threads - 1) / threads : 0;
}

// Loads a row into registers, ITERS chunks of VEC (fp32), zeros past the NVALID valid chunks.
template <typename T, int VEC, int ITERS>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int nvalid, int t, int threads, float* v) {
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int col0 = chunk_col<VEC>(i, t, threads);
    if (i < nvalid) {
      load_pack<T, VEC>(row + col0, v + i * VEC);
    } else {
      fill<VEC>(v + i * VEC, 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, row in registers. Each row group (a warp, or the block) owns one row:
//   LayerNorm: mean, var: corrected two-pass statistics over the cached values
//   RMSNorm:   mean = 0, var = mean(x^2) (one reduction)
//   rstd = 1/sqrt(var+eps), y = norm_output((x - mean) * rstd, w', b)
// Launch: warp mode block (32, kRowsPerWarpBlock), grid ceil(M / kRowsPerWarpBlock);
//         block mode block (threads, 1) with threads * EPT >= N, grid M.
// ---------------------------------------------------------------------------------------------
template <typename T, typename PT, int VEC, int EPT, bool kWarpPerRow, typename Mode>
__global__ void __launch_bounds__(kMaxThreads, 1) layer_norm_fwd_kernel(
    const T* __restrict__ X,   // (M, N), row stride x_stride, unit column stride
    const PT* __restrict__ W,  // (N,) or null
    const PT* __restrict__ B,  // (N,) or null (always for RMSNorm)
    typename Mode::Y* __restrict__ Y,  // (M, N) contiguous
    float* __restrict__ Mean,     // (M,); unused for RMSNorm
    float* __restrict__ Rstd,     // (M,)
    int64_t M, int N, float inv_n, int64_t x_stride, float eps, bool weight_plus_one) {
  static_assert(EPT % VEC == 0, "EPT must be a multiple of VEC");
  constexpr int ITERS = EPT / VEC;
  __shared__ float buf[kMaxThreads / kWarpSize];
  __shared__ float2 dev_buf[kMaxThreads / kWarpSize];

  const int t = threadIdx.x;
  const int threads = kWarpPerRow ? kWarpSize : static_cast<int>(blockDim.x);
  const int64_t row = kWarpPerRow ? static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y
                                  : static_cast<int64_t>(blockIdx.x);
  if (row >= M) return;  // whole warp in warp mode (no block syncs there); never in block mode

  const int nvalid = valid_chunks<VEC>(N, t, threads);
  float v[EPT];
  load_row<T, VEC, ITERS>(X + row * x_stride, nvalid, t, threads, v);

  float mean = 0.f, var;
  if constexpr (Mode::kRms) {
    float squares = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) squares += v[e] * v[e];  // zeros past N
    var = row_sum<kWarpPerRow>(squares, buf) * inv_n;
  } else {
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) sum += v[e];
    const float rough_mean = row_sum<kWarpPerRow>(sum, buf) * inv_n;

    float2 dev = make_float2(0.f, 0.f);  // sums of deviations from rough_mean and of their squares
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      if (i < nvalid) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = v[i * VEC + j] - rough_mean;
          dev.x += d;
          dev.y += d * d;
        }
      }
    }
    dev = row_sum<kWarpPerRow>(dev, dev_buf);
    mean = corrected_mean(rough_mean, dev, inv_n);
    var = corrected_var(dev, inv_n);
  }
  const float rstd = __frsqrt_rn(var + eps);
  if (t == 0) {
    if constexpr (!Mode::kRms) Mean[row] = mean;
    Rstd[row] = rstd;
  }

  typename Mode::Y* y_row = Y + row * static_cast<int64_t>(N);
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int col0 = chunk_col<VEC>(i, t, threads);
    if (i < nvalid) {
      float w[VEC], b[VEC], out[VEC];
      load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
      load_param<PT, VEC>(B, col0, 0.f, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = norm_output<Mode>(normalize(v[i * VEC + j], mean, rstd), w[j], b[j]);
      store_pack<typename Mode::Y, VEC>(y_row + col0, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, any N: one block (kLoopedThreads) per row, passes over the row in global memory:
// LayerNorm sum, deviations and their squares, output; RMSNorm squares, output. Grid M.
// ---------------------------------------------------------------------------------------------
template <typename T, typename PT, int VEC, typename Mode>
__global__ void __launch_bounds__(kLoopedThreads, 1) layer_norm_fwd_looped_kernel(
    const T* __restrict__ X,   // (M, N), row stride x_stride
    const PT* __restrict__ W,  // (N,) or null
    const PT* __restrict__ B,  // (N,) or null (always for RMSNorm)
    typename Mode::Y* __restrict__ Y,  // (M, N) contiguous
    float* __restrict__ Mean,     // (M,); unused for RMSNorm
    float* __restrict__ Rstd,     // (M,)
    int N, float inv_n, int64_t x_stride, float eps, bool weight_plus_one) {
  __shared__ float buf[kLoopedThreads / kWarpSize];
  __shared__ float2 dev_buf[kLoopedThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const T* x_row = X + row * x_stride;
  const int first = threadIdx.x * VEC;
  const int step = blockDim.x * VEC;

  float mean = 0.f, var;
  if constexpr (Mode::kRms) {
    float squares = 0.f;
    for (int col0 = first; col0 < N; col0 += step) {
      float v[VEC];
      load_pack<T, VEC>(x_row + col0, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) squares += v[j] * v[j];
    }
    var = block_sum(squares, buf) * inv_n;
  } else {
    float sum = 0.f;
    for (int col0 = first; col0 < N; col0 += step) {
      float v[VEC];
      load_pack<T, VEC>(x_row + col0, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += v[j];
    }
    const float rough_mean = block_sum(sum, buf) * inv_n;

    float2 dev = make_float2(0.f, 0.f);  // sums of deviations from rough_mean and of their squares
    for (int col0 = first; col0 < N; col0 += step) {
      float v[VEC];
      load_pack<T, VEC>(x_row + col0, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = v[j] - rough_mean;
        dev.x += d;
        dev.y += d * d;
      }
    }
    dev = block_sum(dev, dev_buf);
    mean = corrected_mean(rough_mean, dev, inv_n);
    var = corrected_var(dev, inv_n);
  }
  const float rstd = __frsqrt_rn(var + eps);
  if (threadIdx.x == 0) {
    if constexpr (!Mode::kRms) Mean[row] = mean;
    Rstd[row] = rstd;
  }

  typename Mode::Y* y_row = Y + row * static_cast<int64_t>(N);
  for (int col0 = first; col0 < N; col0 += step) {
    float v[VEC], w[VEC], b[VEC];
    load_pack<T, VEC>(x_row + col0, v);
    load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
    load_param<PT, VEC>(B, col0, 0.f, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = norm_output<Mode>(normalize(v[j], mean, rstd), w[j], b[j]);
    store_pack<typename Mode::Y, VEC>(y_row + col0, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Prefetch of the backward's rows: while a thread computes on one row, cp.async copies its
// chunks of the next row's x and dy into shared memory (two stages, alternating). Each thread
// copies and later reads only its own chunks (slot (stage, tensor, chunk) at
// ((stage * 2 + tensor) * ITERS + chunk) * block threads + thread: consecutive threads,
// consecutive 16 bytes), so no barrier is needed, only a wait for its own copies. Vectorised
// rows whose dy has x's type only (cp.async moves one 16-byte chunk of each here); the kernel
// then takes kPrefetchBytes<ITERS> x block threads of dynamic shared memory.
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, typename Mode>
constexpr bool kPrefetch =
    VEC * static_cast<int>(sizeof(T)) == kMaxVecBytes && std::is_same_v<T, typename Mode::Y>;

template <int ITERS>
constexpr int kPrefetchBytes = 2 * 2 * ITERS * kMaxVecBytes;  // a thread's: 2 stages x (x, dy) x chunks

template <typename T, int VEC, int ITERS, bool kRms>
struct RowPrefetch {
  uint4* slots;  // this thread's first slot
  int stride;    // slots between a thread's consecutive chunks (the block's thread count)
  int nvalid, t, threads, stage = 0;
  float mean = 0.f, rstd = 0.f;            // statistics of the row take() returns
  float next_mean = 0.f, next_rstd = 0.f;  // ... of the row issued last (plain loads, in flight too)

  __device__ RowPrefetch(int nvalid_, int t_, int threads_) : nvalid(nvalid_), t(t_), threads(threads_) {
    extern __shared__ uint4 prefetch_buffer[];
    stride = static_cast<int>(blockDim.x * blockDim.y);
    slots = prefetch_buffer + threadIdx.y * blockDim.x + threadIdx.x;
  }

  __device__ uint4* slot(int s, int tensor, int i) const { return slots + ((s * 2 + tensor) * ITERS + i) * stride; }

  // Starts copying row ROW (nothing when ROW >= M) into the stage not being read, as one group,
  // and loading its mean and rstd.
  __device__ void issue(const T* X, const T* DY, const float* Mean, const float* Rstd, int64_t row, int64_t M,
                        int64_t x_stride, int64_t dy_stride) {
    const int s = stage ^ 1;
    mean = next_mean;
    rstd = next_rstd;
    if (row < M) {
      next_mean = load_mean<kRms>(Mean, row);
      next_rstd = Rstd[row];
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        if (i < nvalid) {
          const int col0 = chunk_col<VEC>(i, t, threads);
          cp_async_16(slot(s, 0, i), X + row * x_stride + col0);
          cp_async_16(slot(s, 1, i), DY + row * dy_stride + col0);
        }
      }
    }
    cp_async_commit();
    stage = s;
  }

  // The row issued before the last one, as fp32 (zeros past the valid chunks): waits for its copies.
  __device__ void take(float* xv, float* gv) const {
    cp_async_wait<1>();
    const int s = stage ^ 1;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      if (i < nvalid) {
        load_pack<T, VEC>(reinterpret_cast<const T*>(slot(s, 0, i)), xv + i * VEC);
        load_pack<T, VEC>(reinterpret_cast<const T*>(slot(s, 1, i)), gv + i * VEC);
      } else {
        fill<VEC>(xv + i * VEC, 0.f);
        fill<VEC>(gv + i * VEC, 0.f);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Backward. Per row, with xhat_i = (x_i - mean) * rstd and y_i = xhat_i * w_i + b_i:
//
//   dL/dxhat_i = dy_i * w_i =: wdy_i
//   dxhat_i/dx_k = rstd * (delta_ik - 1/N - xhat_i * xhat_k / N)
//     (d mean/dx_k = 1/N; d rstd/dx_k = -rstd^3 (x_k - mean) / N = -rstd^2 xhat_k / N)
//   dx_k = sum_i wdy_i dxhat_i/dx_k
//        = rstd * (wdy_k - mean_i(wdy_i) - xhat_k * mean_i(wdy_i * xhat_i))
//   dw_i = sum_rows dy_i * xhat_i,   db_i = sum_rows dy_i
//
// RMSNorm: xhat_i = x_i * rstd, rstd = (mean(x^2) + eps)^(-1/2), so d rstd/dx_k = -rstd^2 xhat_k / N
// as above but without the mean's term:
//   dx_k = rstd * (wdy_k - xhat_k * mean_i(wdy_i * xhat_i))
// with w' = 1 + w in wdy for Gemma's norm (dw unchanged: d w'/d w = 1). The rounding of xhat
// before the weight multiply is taken as the identity, as autograd takes the stock modules' casts.
//
// mean and rstd are the fp32 values the forward stored, so xhat (and with RECOMPUTE_OUTPUT, y)
// are recomputed bitwise as the forward computed them. dw/db: block g accumulates fp32 partial
// sums over the rows it owns (grid-stride, fixed grid G) and writes row g of the (G, N) buffers
// DWp/DBp; sum_partial_rows_kernel reduces them in a fixed order.
//
// Register kernel launch: warp mode block (32, kRowsPerWarpBlock), block mode (threads, 1) with
// threads * EPT >= N; grid G <= rows / rows_per_block, so every block owns at least one row group.
// ---------------------------------------------------------------------------------------------
template <typename T, typename PT, int VEC, int EPT, bool kWarpPerRow, bool RECOMPUTE_OUTPUT, typename Mode>
__global__ void __launch_bounds__(kMaxThreads, 1) layer_norm_bwd_kernel(
    const typename Mode::Y* __restrict__ DY,  // (M, N), row stride dy_stride
    const T* __restrict__ X,         // (M, N), row stride x_stride
    const PT* __restrict__ W,        // (N,) or null
    const PT* __restrict__ B,        // (N,) or null (read only when RECOMPUTE_OUTPUT)
    const float* __restrict__ Mean,  // (M,); unused for RMSNorm
    const float* __restrict__ Rstd,  // (M,)
    T* __restrict__ DX,              // (M, N) contiguous
    typename Mode::Y* __restrict__ Y,  // (M, N) contiguous, written when RECOMPUTE_OUTPUT
    float* __restrict__ DWp,         // (G, N) partial dw, or null (no weight)
    float* __restrict__ DBp,         // (G, N) partial db, or null (no bias)
    int64_t M, int N, float inv_n, int64_t dy_stride, int64_t x_stride, bool weight_plus_one) {
  static_assert(EPT % VEC == 0, "EPT must be a multiple of VEC");
  constexpr int ITERS = EPT / VEC;
  constexpr int kRows = kWarpPerRow ? kRowsPerWarpBlock : 1;
  __shared__ float2 buf[kMaxThreads / kWarpSize];

  const int t = threadIdx.x;
  const int threads = kWarpPerRow ? kWarpSize : static_cast<int>(blockDim.x);
  const int nvalid = valid_chunks<VEC>(N, t, threads);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * kRows;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRows + (kWarpPerRow ? threadIdx.y : 0);
  constexpr bool kPrefetchRows = kPrefetch<T, VEC, Mode>;
  RowPrefetch<T, VEC, ITERS, Mode::kRms> prefetch(nvalid, t, threads);
  if constexpr (kPrefetchRows) prefetch.issue(X, DY, Mean, Rstd, first_row, M, x_stride, dy_stride);

  float dw_acc[EPT], db_acc[EPT];
#pragma unroll
  for (int e = 0; e < EPT; ++e) dw_acc[e] = db_acc[e] = 0.f;

  // Grid-stride over row groups; in block mode `row` is uniform over the block, so the
  // __syncthreads inside row_sum is reached by all threads or none.
  for (int64_t row = first_row; row < M; row += row_step) {
    float xv[EPT], gv[EPT];  // x then xhat; dy then wdy
    float mean, rstd;
    if constexpr (kPrefetchRows) {
      // The loads of the next row start now, before this row's reductions; this row's landed.
      prefetch.issue(X, DY, Mean, Rstd, row + row_step, M, x_stride, dy_stride);
      prefetch.take(xv, gv);
      mean = prefetch.mean;
      rstd = prefetch.rstd;
    } else {
      load_row<T, VEC, ITERS>(X + row * x_stride, nvalid, t, threads, xv);
      load_row<typename Mode::Y, VEC, ITERS>(DY + row * dy_stride, nvalid, t, threads, gv);
      mean = load_mean<Mode::kRms>(Mean, row);
      rstd = Rstd[row];
    }

    float2 sums = make_float2(0.f, 0.f);  // (sum wdy * xhat, sum wdy); RMSNorm uses the first only
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int col0 = chunk_col<VEC>(i, t, threads);
      const bool valid = i < nvalid;
      float w[VEC];
      if (valid) {
        load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
      } else {
        fill<VEC>(w, 0.f);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int e = i * VEC + j;
        const float xhat = valid ? normalize(xv[e], mean, rstd) : 0.f;
        const float dy = gv[e];  // 0 past N
        dw_acc[e] += dy * xhat;
        if constexpr (!Mode::kRms) db_acc[e] += dy;
        const float wdy = dy * w[j];
        sums.x += wdy * xhat;
        sums.y += wdy;
        xv[e] = xhat;
        gv[e] = wdy;
      }
    }
    sums = row_sum<kWarpPerRow>(sums, buf);
    if constexpr (!kWarpPerRow) __syncthreads();  // buf is rewritten by the next row
    const float c1 = sums.x * inv_n;  // mean(wdy * xhat)
    const float c2 = sums.y * inv_n;  // mean(wdy)

    T* dx_row = DX + row * static_cast<int64_t>(N);
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int col0 = chunk_col<VEC>(i, t, threads);
      if (i < nvalid) {
        float out[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const int e = i * VEC + j;
          out[j] = input_grad<Mode::kRms>(gv[e], xv[e], c1, c2, rstd);
        }
        store_pack<T, VEC>(dx_row + col0, out);
        if constexpr (RECOMPUTE_OUTPUT) {
          float w[VEC], b[VEC];
          load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
          load_param<PT, VEC>(B, col0, 0.f, b);
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = norm_output<Mode>(xv[i * VEC + j], w[j], b[j]);
          store_pack<typename Mode::Y, VEC>(Y + row * static_cast<int64_t>(N) + col0, out);
        }
      }
    }
  }

  // Write this block's partial dw/db row.
  const int64_t part = static_cast<int64_t>(blockIdx.x) * N;
  if constexpr (kWarpPerRow) {
    // Sum the kRows warps' accumulators in shared memory, in warp order.
    __shared__ float red[2][kRows][kWarpSize * EPT];
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int col0 = chunk_col<VEC>(i, t, kWarpSize);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        red[0][threadIdx.y][col0 + j] = dw_acc[i * VEC + j];
        red[1][threadIdx.y][col0 + j] = db_acc[i * VEC + j];
      }
    }
    __syncthreads();
    const int width = min(N, kWarpSize * EPT);
    for (int c = threadIdx.y * kWarpSize + t; c < width; c += kRows * kWarpSize) {
      float dw = red[0][0][c], db = red[1][0][c];
#pragma unroll
      for (int r = 1; r < kRows; ++r) {
        dw += red[0][r][c];
        db += red[1][r][c];
      }
      if (DWp != nullptr) DWp[part + c] = dw;
      if (DBp != nullptr) DBp[part + c] = db;
    }
  } else {
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int col0 = chunk_col<VEC>(i, t, threads);
      if (i < nvalid) {
        if (DWp != nullptr) store_pack<float, VEC>(DWp + part + col0, dw_acc + i * VEC);
        if (DBp != nullptr) store_pack<float, VEC>(DBp + part + col0, db_acc + i * VEC);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, any N: one block (kLoopedThreads) per row, grid-stride over rows with grid G <= M.
// Pass 1 reads x, dy: row sums, and adds dy * xhat, dy into this block's partial rows in global
// memory (each column always belongs to the same thread: no races, fixed order; DWp/DBp must
// be zero-initialised). Pass 2 re-reads x, dy and writes dx (and y).
// ---------------------------------------------------------------------------------------------
template <typename T, typename PT, int VEC, bool RECOMPUTE_OUTPUT, typename Mode>
__global__ void __launch_bounds__(kLoopedThreads, 1) layer_norm_bwd_looped_kernel(
    const typename Mode::Y* __restrict__ DY,  // (M, N), row stride dy_stride
    const T* __restrict__ X,         // (M, N), row stride x_stride
    const PT* __restrict__ W,        // (N,) or null
    const PT* __restrict__ B,        // (N,) or null (read only when RECOMPUTE_OUTPUT)
    const float* __restrict__ Mean,  // (M,); unused for RMSNorm
    const float* __restrict__ Rstd,  // (M,)
    T* __restrict__ DX,              // (M, N) contiguous
    typename Mode::Y* __restrict__ Y,  // (M, N) contiguous, written when RECOMPUTE_OUTPUT
    float* __restrict__ DWp,         // (G, N) zero-initialised partial dw, or null
    float* __restrict__ DBp,         // (G, N) zero-initialised partial db, or null
    int64_t M, int N, float inv_n, int64_t dy_stride, int64_t x_stride, bool weight_plus_one) {
  using Y_T = typename Mode::Y;
  __shared__ float2 buf[kLoopedThreads / kWarpSize];
  const int first = threadIdx.x * VEC;
  const int step = blockDim.x * VEC;
  const int64_t part = static_cast<int64_t>(blockIdx.x) * N;

  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const T* x_row = X + row * x_stride;
    const Y_T* dy_row = DY + row * dy_stride;
    const float mean = load_mean<Mode::kRms>(Mean, row);
    const float rstd = Rstd[row];

    float2 sums = make_float2(0.f, 0.f);
    for (int col0 = first; col0 < N; col0 += step) {
      float x[VEC], dy[VEC], w[VEC], dw[VEC], db[VEC];
      load_pack<T, VEC>(x_row + col0, x);
      load_pack<Y_T, VEC>(dy_row + col0, dy);
      load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
      if (DWp != nullptr) load_pack<float, VEC>(DWp + part + col0, dw);
      if (DBp != nullptr) load_pack<float, VEC>(DBp + part + col0, db);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = normalize(x[j], mean, rstd);
        const float wdy = dy[j] * w[j];
        sums.x += wdy * xhat;
        sums.y += wdy;
        dw[j] += dy[j] * xhat;
        db[j] += dy[j];
      }
      if (DWp != nullptr) store_pack<float, VEC>(DWp + part + col0, dw);
      if (DBp != nullptr) store_pack<float, VEC>(DBp + part + col0, db);
    }
    sums = block_sum(sums, buf);
    __syncthreads();  // buf is rewritten by the next row
    const float c1 = sums.x * inv_n;
    const float c2 = sums.y * inv_n;

    T* dx_row = DX + row * static_cast<int64_t>(N);
    for (int col0 = first; col0 < N; col0 += step) {
      float x[VEC], dy[VEC], w[VEC], out[VEC];
      load_pack<T, VEC>(x_row + col0, x);
      load_pack<Y_T, VEC>(dy_row + col0, dy);
      load_weight<Mode, PT, VEC>(W, col0, weight_plus_one, w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        x[j] = normalize(x[j], mean, rstd);  // xhat
        out[j] = input_grad<Mode::kRms>(dy[j] * w[j], x[j], c1, c2, rstd);
      }
      store_pack<T, VEC>(dx_row + col0, out);
      if constexpr (RECOMPUTE_OUTPUT) {
        float b[VEC];
        load_param<PT, VEC>(B, col0, 0.f, b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = norm_output<Mode>(x[j], w[j], b[j]);
        store_pack<Y_T, VEC>(Y + row * static_cast<int64_t>(N) + col0, out);
      }
    }
  }
}

// =============================================================================================
// Host side
// =============================================================================================

// Register-path configuration: one warp per row, or a block of `threads` per row, with EPT
// elements per thread. ept == 0 selects the looped kernels.
struct RowConfig {
  bool warp_per_row;
  int ept;
  int threads;  // per row (32 in warp mode)
};

constexpr int64_t kMaxRegisterWidthFwd = 16384;  // block of <= 512 threads x 32 elements
constexpr int64_t kMaxRegisterWidthBwd = 8192;   // block of <= 512 threads x 16 elements (x4 arrays)
constexpr int64_t kMaxRegisterWidthScalar = 4096;  // scalar (unvectorised) rows: block x 8 elements

int round_up(int64_t value, int multiple) { return static_cast<int>(ceil_div(value, multiple) * multiple); }

// Width thresholds (elements): <= 256 warp/8, <= 512 warp/16, <= 4096 block/8, <= 8192
// block/16, (forward only) <= 16384 block/32, else looped. Unvectorised rows (misaligned, or N
// not a multiple of the vector width) wider than 4096 take the looped kernels: their
// per-element predicates and addresses would spill at larger EPT.
RowConfig pick_config(int64_t N, bool forward, bool vectorized) {
  auto block = [N](int ept) { return RowConfig{false, ept, std::max(64, round_up(ceil_div(N, ept), kWarpSize))}; };
  if (N <= 256) return {true, 8, kWarpSize};
  if (N <= 512) return {true, 16, kWarpSize};
  if (N <= kMaxRegisterWidthScalar) return block(8);
  if (vectorized && N <= kMaxRegisterWidthBwd) return block(16);
  if (vectorized && forward && N <= kMaxRegisterWidthFwd) return block(32);
  return {false, 0, kLoopedThreads};
}

// Fixed backward grid: as many blocks as fit on the device at once (grid-stride needs all of
// them resident, or the last wave would run alone), and no more than there are row groups.
template <typename Kernel>
int backward_grid(Kernel kernel, int threads_per_block, int dynamic_shared, int64_t row_groups, int device) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads_per_block, dynamic_shared));
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count(device);
  return static_cast<int>(std::min(row_groups, resident));
}

// The op families every error message starts with.
constexpr const char* kLayerNorm = "layer_norm";
constexpr const char* kRmsNorm = "rms_norm";

// check_rows, and the row counts the kernels index with int: N >= 1 (a mean over no columns is
// undefined) and M within int.
void check_input(const char* op, const at::Tensor& t, const char* name) {
  check_rows(op, t, name);
  TORCH_CHECK(t.size(1) >= 1, op, ": ", name, " must have N >= 1 columns, got shape ", t.sizes());
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int>::max(), op, ": ", name, " has too many rows: M = ",
              t.size(0));
}

// mean or rstd from the forward: (M,) contiguous float32 on x's device.
void check_stat(const char* op, const at::Tensor& s, const char* name, const at::Tensor& x) {
  TORCH_CHECK(s.device() == x.device(), op, ": ", name, " is on ", s.device(), " but x is on ", x.device());
  TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", s.scalar_type());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == x.size(0), op, ": ", name, " must have shape (", x.size(0),
              ",), got ", s.sizes());
  TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The LayerNorm kernels read weight and bias in their own dtype, fp32 or x's (no conversion per
// call), both the same.
void check_param_dtypes(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                        const at::Tensor& x) {
  for (const auto* p : {&weight, &bias}) {
    TORCH_CHECK(!present(*p) || (*p)->scalar_type() == at::kFloat || (*p)->scalar_type() == x.scalar_type(),
                kLayerNorm, ": weight and bias must be float32 or x's dtype ", x.scalar_type(), ", got ",
                (*p)->scalar_type());
  }
  TORCH_CHECK(!present(weight) || !present(bias) || weight->scalar_type() == bias->scalar_type(), kLayerNorm,
              ": weight and bias must have the same dtype, got ", weight->scalar_type(), " and ",
              bias->scalar_type());
}

// The dtype the kernels read the parameters as: theirs, or x's when there are none.
at::ScalarType param_type(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& x) {
  if (present(weight)) return weight->scalar_type();
  return present(bias) ? bias->scalar_type() : x.scalar_type();
}

// Calls f(PT{}) with PT the parameters' storage type: float, or T (x's) when they are in x's dtype.
template <typename T, typename F>
void dispatch_param_type(at::ScalarType type, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    f(float{});
  } else if (type == at::kFloat) {
    f(float{});
  } else {
    f(T{});
  }
}

// ----------------------------------------- forward -----------------------------------------

struct FwdArgs {
  const void* x;
  const void* w;  // in PT, or null
  const void* b;
  void* y;        // in Mode::Y
  float* mean;    // null for RMSNorm
  float* rstd;
  int64_t M;
  int N;
  float inv_n;  // 1 / N, computed once on the host (no IEEE division in the kernels)
  int64_t x_stride;
  float eps;
  bool weight_plus_one;  // RMSNorm only: scale by 1 + w
};

template <typename T, typename PT, int VEC, typename Mode>
void launch_fwd(const FwdArgs& a, const RowConfig& cfg, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.x);
  const PT* w = static_cast<const PT*>(a.w);
  const PT* b = static_cast<const PT*>(a.b);
  auto* y = static_cast<typename Mode::Y*>(a.y);
  auto run = [&](auto kernel, dim3 grid, dim3 block) {
    kernel<<<grid, block, 0, stream>>>(x, w, b, y, a.mean, a.rstd, a.M, a.N, a.inv_n, a.x_stride, a.eps,
                                       a.weight_plus_one);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const dim3 warp_block(kWarpSize, kRowsPerWarpBlock);
  const dim3 warp_grid(static_cast<unsigned>(ceil_div(a.M, kRowsPerWarpBlock)));
  const dim3 row_grid(static_cast<unsigned>(a.M));
  const dim3 row_block(cfg.threads);
  if (cfg.ept == 0) {
    layer_norm_fwd_looped_kernel<T, PT, VEC, Mode><<<row_grid, row_block, 0, stream>>>(
        x, w, b, y, a.mean, a.rstd, a.N, a.inv_n, a.x_stride, a.eps, a.weight_plus_one);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (cfg.warp_per_row) {
    if (cfg.ept == 8) run(layer_norm_fwd_kernel<T, PT, VEC, 8, true, Mode>, warp_grid, warp_block);
    else run(layer_norm_fwd_kernel<T, PT, VEC, 16, true, Mode>, warp_grid, warp_block);
  } else if (cfg.ept == 8) {
    run(layer_norm_fwd_kernel<T, PT, VEC, 8, false, Mode>, row_grid, row_block);
  } else if constexpr (VEC > 1) {  // pick_config: EPT 16/32 only for vectorised rows
    if (cfg.ept == 16) run(layer_norm_fwd_kernel<T, PT, VEC, 16, false, Mode>, row_grid, row_block);
    else run(layer_norm_fwd_kernel<T, PT, VEC, 32, false, Mode>, row_grid, row_block);
  } else {
    TORCH_CHECK(false, "internal error, no norm forward kernel for EPT ", cfg.ept);
  }
}

// The forward of x (its rows vectorised when they allow it) for parameters in PT and MODE.
template <typename T, typename PT, typename Mode>
void run_fwd(const FwdArgs& args, const at::Tensor& x, cudaStream_t stream) {
  constexpr int kVec = max_vec<T>();
  if (vectorizable(x.data_ptr(), x.stride(0), args.M, args.N, kVec)) {
    launch_fwd<T, PT, kVec, Mode>(args, pick_config(args.N, /*forward=*/true, /*vectorized=*/true), stream);
  } else {
    launch_fwd<T, PT, 1, Mode>(args, pick_config(args.N, /*forward=*/true, /*vectorized=*/false), stream);
  }
}

// ----------------------------------------- backward ----------------------------------------

struct BwdArgs {
  const void* dy;  // in Mode::Y
  const void* x;
  const void* w;  // in PT, or null
  const void* b;
  const float* mean;  // null for RMSNorm
  const float* rstd;
  void* dx;
  void* y;  // in Mode::Y; null unless recompute_output
  int64_t M;
  int N;
  float inv_n;
  int64_t dy_stride;
  int64_t x_stride;
  bool weight_plus_one;
};

struct Partials {
  at::Tensor dw;  // (G, N) fp32 or undefined
  at::Tensor db;
  int G;
};

// Launches the backward kernel for CFG; returns the partial dw/db buffers it filled.
template <typename T, typename PT, int VEC, bool RECOMPUTE_OUTPUT, typename Mode>
Partials launch_bwd(const BwdArgs& a, const RowConfig& cfg, bool need_dw, bool need_db,
                    const at::TensorOptions& float_opts, int device, cudaStream_t stream) {
  const auto* dy = static_cast<const typename Mode::Y*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const PT* w = static_cast<const PT*>(a.w);
  const PT* b = static_cast<const PT*>(a.b);
  T* dx = static_cast<T*>(a.dx);
  auto* y = static_cast<typename Mode::Y*>(a.y);
  Partials parts{};
  // G is sized with the RECOMPUTE_OUTPUT variant of each kernel (the one with more registers, so
  // the fewest resident blocks) whichever variant runs: the order of the dw/db sums, and so their
  // bits, must not depend on whether y is rebuilt. The other variant fits at least as many blocks.
  // prefetch_bytes: a thread's dynamic shared memory (the register kernels' row prefetch).
  auto run = [&](auto kernel, auto sizing_kernel, dim3 block, int rows_per_block, bool zero_init,
                 int prefetch_bytes) {
    const int threads = static_cast<int>(block.x * block.y);
    const int shared = prefetch_bytes * threads;
    for (const void* k : {reinterpret_cast<const void*>(kernel), reinterpret_cast<const void*>(sizing_kernel)}) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    }
    const int64_t row_groups = ceil_div(a.M, rows_per_block);
    parts.G = backward_grid(sizing_kernel, threads, shared, row_groups, device);
    auto make = [&](bool need) {
      if (!need) return at::Tensor();
      return zero_init ? at::zeros({parts.G, a.N}, float_opts) : at::empty({parts.G, a.N}, float_opts);
    };
    parts.dw = make(need_dw);
    parts.db = make(need_db);
    kernel<<<dim3(parts.G), block, shared, stream>>>(dy, x, w, b, a.mean, a.rstd, dx, y,
                                                     float_ptr_or_null(parts.dw), float_ptr_or_null(parts.db), a.M,
                                                     a.N, a.inv_n, a.dy_stride, a.x_stride, a.weight_plus_one);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // The register kernel at EPT elements a thread, one warp or one block per row.
  auto run_register = [&](auto ept, auto warp_per_row) {
    constexpr int kEpt = decltype(ept)::value;
    constexpr bool kWarp = decltype(warp_per_row)::value;
    const dim3 block = kWarp ? dim3(kWarpSize, kRowsPerWarpBlock) : dim3(cfg.threads);
    run(layer_norm_bwd_kernel<T, PT, VEC, kEpt, kWarp, RECOMPUTE_OUTPUT, Mode>,
        layer_norm_bwd_kernel<T, PT, VEC, kEpt, kWarp, true, Mode>, block, kWarp ? kRowsPerWarpBlock : 1, false,
        kPrefetch<T, VEC, Mode> ? kPrefetchBytes<kEpt / VEC> : 0);
  };
  using Ept8 = std::integral_constant<int, 8>;
  using Ept16 = std::integral_constant<int, 16>;
  if (cfg.ept == 0) {
    run(layer_norm_bwd_looped_kernel<T, PT, VEC, RECOMPUTE_OUTPUT, Mode>,
        layer_norm_bwd_looped_kernel<T, PT, VEC, true, Mode>, dim3(cfg.threads), 1, true, 0);
  } else if (cfg.warp_per_row) {
    if (cfg.ept == 8) run_register(Ept8{}, std::true_type{});
    else run_register(Ept16{}, std::true_type{});
  } else if (cfg.ept == 8) {
    run_register(Ept8{}, std::false_type{});
  } else if constexpr (VEC > 1) {  // pick_config: EPT 16 only for vectorised rows
    run_register(Ept16{}, std::false_type{});
  } else {
    TORCH_CHECK(false, "internal error, no norm backward kernel for EPT ", cfg.ept);
  }
  return parts;
}

// The backward of x and dy (vectorised when both allow it) for parameters in PT and MODE;
// returns the partial dw/db buffers.
template <typename T, typename PT, typename Mode>
Partials run_bwd(const BwdArgs& args, const at::Tensor& x, const at::Tensor& dy, bool recompute_output,
                 bool need_dw, bool need_db, cudaStream_t stream) {
  constexpr int kVec = max_vec<T>();
  const bool vec = vectorizable(x.data_ptr(), x.stride(0), args.M, args.N, kVec) &&
                   vectorizable(dy.data_ptr(), dy.stride(0), args.M, args.N, kVec);
  const RowConfig cfg = pick_config(args.N, /*forward=*/false, vec);
  const at::TensorOptions float_opts = x.options().dtype(at::kFloat);
  const int device = x.device().index();
  if (vec && recompute_output) {
    return launch_bwd<T, PT, kVec, true, Mode>(args, cfg, need_dw, need_db, float_opts, device, stream);
  } else if (vec) {
    return launch_bwd<T, PT, kVec, false, Mode>(args, cfg, need_dw, need_db, float_opts, device, stream);
  } else if (recompute_output) {
    return launch_bwd<T, PT, 1, true, Mode>(args, cfg, need_dw, need_db, float_opts, device, stream);
  } else {
    return launch_bwd<T, PT, 1, false, Mode>(args, cfg, need_dw, need_db, float_opts, device, stream);
  }
}

}  // namespace
}  // namespace remat
