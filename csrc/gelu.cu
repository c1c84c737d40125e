// GELU (exact erf, or tanh approximation) with an optional fused bias, forward and backward; the
// backward rebuilds h = x + bias from x and can also rebuild y = gelu(h) (RECOMPUTE_OUTPUT),
// bitwise as the forward wrote it. All math in fp32; no atomics: every result is bitwise
// deterministic for a given shape, layout and device.
//
// Kernels, top to bottom:
//   gelu_fwd_kernel           y = gelu(x + bias)
//   gelu_bwd_kernel           dx = dy * gelu'(x + bias), dbias partials (G, N), y on request
//   sum_partial_rows_kernel   (common.cuh) (G, N) fp32 partials -> dbias (N,)
// then the launchers, the entry points and their registration as torch.ops.remat_C.gelu_fwd/_bwd.
//
// Layout: both kernels see x as rows (M, N) with a row stride and unit column stride. A block of
// kThreads threads is (BX, BY): thread (tx, ty) owns one pack of VEC columns, pack
// p = blockIdx.x * BX + tx (columns [p * VEC, p * VEC + VEC)), of the rows
// blockIdx.y * BY + ty + k * G * BY, k = 0, 1, ... (G = gridDim.y row groups). Its bias pack is
// loaded once; with a bias, the backward accumulates dbias in VEC fp32 registers over those rows.
// VEC = 16 bytes of T when the data allow it (aligned base, N and row strides multiples of VEC),
// else 1. Without a bias and with dense rows, the launcher views the data as one flat array cut
// into rows of a power-of-two width, so any N (N = 1 included) gets whole-vector rows.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include "common.cuh"
#include "host.h"

namespace remat {
namespace {

constexpr int kThreads = 256;        // threads a block, as (BX, BY) = (pack columns, rows)
constexpr int kMinBlocksPerSm = 4;   // __launch_bounds__: at most 64 registers a thread
// Rows a thread loads before it computes (all loads issued first): 16 elements a tensor in the
// forward, 8 in the backward (x and dy), i.e. 64 / 32 bytes of fp32 / 16-bit types in flight a
// thread. More unrolling of 16-bit packs spills at the 64-register cap of __launch_bounds__.
constexpr int fwd_unroll(int vec) { return vec >= 8 ? 2 : 4; }
constexpr int bwd_unroll(int vec) { return vec >= 8 ? 1 : 2; }
constexpr int kGridBlocksPerSm = 8;  // grid target: column tiles * G ~ kGridBlocksPerSm * SMs
constexpr int kMinBiasRowsPerThread = 8;  // bias backward: fewer row groups, smaller (G, N) partials
constexpr int kMaxFlatWidth = 4096;  // dense rows without bias: flat rows of up to this many elements

// ---------------------------------------------------------------------------------------------
// Shared per-element math. The forward and the recomputing backward both call gelu_gate and
// gelu_value, so the recomputed y is bitwise what the forward wrote: every operation outside
// erff/tanhf/expf is an explicit _rn intrinsic (no contraction choices left to the compiler).
//
//   exact: gelu(h) = h * g, g = Phi(h) = (1 + erf(h / sqrt 2)) / 2
//   tanh:  gelu(h) = h * g, g = (1 + t) / 2, t = tanh(u), u = sqrt(2/pi) (h + 0.044715 h^3)
// Large |h| stay finite: erff and tanhf saturate at +-1 (u = +-inf included), so g is 0 or 1.
// ---------------------------------------------------------------------------------------------
constexpr float kSqrtHalf = 0.70710678118654752440f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;
constexpr float kTanhCubic3 = 0.134145f;  // 3 * 0.044715

// h = x + bias (x alone without a bias).
template <bool HAS_BIAS>
__device__ __forceinline__ float pre_activation(float x, float b) {
  if constexpr (HAS_BIAS) {
    return __fadd_rn(x, b);
  } else {
    return x;
  }
}

// The gate g with gelu(h) = h * g; T_OUT receives t = tanh(u) (tanh) or 0 (exact), which only the
// derivative uses (dead code in the forward).
template <bool TANH>
__device__ __forceinline__ float gelu_gate(float h, float& t_out) {
  if constexpr (TANH) {
    // h + 0.044715 h^3 = h (1 + 0.044715 h^2); h^2 = inf for |h| > ~1.8e19 gives u = +-inf, t = +-1.
    const float inner = __fmul_rn(h, __fmaf_rn(kTanhCubic, __fmul_rn(h, h), 1.f));
    const float t = tanhf(__fmul_rn(kSqrt2OverPi, inner));
    t_out = t;
    return __fmul_rn(0.5f, __fadd_rn(1.f, t));
  } else {
    t_out = 0.f;
    return __fmul_rn(0.5f, __fadd_rn(1.f, erff(__fmul_rn(h, kSqrtHalf))));
  }
}

__device__ __forceinline__ float gelu_value(float h, float g) { return __fmul_rn(h, g); }

// gelu'(h) from gelu_gate's (g, t); the derivation is above gelu_bwd_kernel.
template <bool TANH>
__device__ __forceinline__ float gelu_derivative(float h, float g, float t) {
  if constexpr (TANH) {
    // sech^2(u) = 1 - t^2, exactly 0 once tanhf saturates (|u| > ~9). There the slope term is 0,
    // also where du/dh overflows (|h| > ~1.8e19: 0 * inf would be NaN), hence the select; its
    // other side adds 0 * h so that h = +-inf still gives NaN, as PyTorch's gelu backward does.
    const float sech2 = __fmaf_rn(-t, t, 1.f);
    const float du_dh = __fmul_rn(kSqrt2OverPi, __fmaf_rn(kTanhCubic3, __fmul_rn(h, h), 1.f));
    const float slope = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, h), sech2), du_dh);
    return sech2 > 0.f ? __fadd_rn(g, slope) : __fmaf_rn(0.f, h, g);
  } else {
    // phi(h) = exp(-h^2 / 2) / sqrt(2 pi) underflows to 0 for |h| > ~14 (h^2 = inf included),
    // where h * phi(h) = 0 and gelu'(h) = Phi(h).
    const float pdf = __fmul_rn(expf(__fmul_rn(-0.5f, __fmul_rn(h, h))), kInvSqrt2Pi);
    return __fmaf_rn(h, pdf, g);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: y = gelu(x + bias). Each thread: its bias pack once, then fwd_unroll(VEC) rows at a time
// (all loads issued before any math). No block-wide synchronisation: idle threads return.
// Launch: block (BX, BY), BX * BY = kThreads; grid (ceil(N / VEC / BX), G).
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, bool HAS_BIAS, bool TANH>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) gelu_fwd_kernel(
    const T* __restrict__ X,      // (M, N), row stride x_stride, unit column stride
    const float* __restrict__ B,  // (N,) fp32; read only when HAS_BIAS
    T* __restrict__ Y,            // (M, N) contiguous
    int64_t M, int N, int64_t x_stride) {
  constexpr int kUnroll = fwd_unroll(VEC);
  const int col0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (col0 >= N) return;  // N is a multiple of VEC: a pack is all in or all out
  float b[VEC];
  if constexpr (HAS_BIAS) {
    load_pack<float, VEC>(B + col0, b);
  } else {
    fill<VEC>(b, 0.f);  // unused
  }

  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < M;
       row0 += row_step * kUnroll) {
    Pack<T, VEC> xp[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = row0 + u * row_step;
      if (row < M) xp[u] = load_raw_pack<T, VEC>(X + row * x_stride + col0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = row0 + u * row_step;
      if (row < M) {
        float y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float h = pre_activation<HAS_BIAS>(to_float(xp[u].v[j]), b[j]);
          float t;
          y[j] = gelu_value(h, gelu_gate<TANH>(h, t));
        }
        store_pack<T, VEC>(Y + row * N + col0, y);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. Per element, h = x + bias (bias = 0 when absent), y = gelu(h):
//
//   dx = dy * gelu'(h),   dbias_j = sum over rows i of dy_ij * gelu'(h_ij)   (dh/dbias = 1)
//
//   exact: gelu(h) = h Phi(h), Phi' = phi, phi(h) = exp(-h^2 / 2) / sqrt(2 pi), so
//          gelu'(h) = Phi(h) + h phi(h)
//   tanh:  gelu(h) = h (1 + t) / 2, t = tanh(u), u = sqrt(2/pi) (h + 0.044715 h^3), tanh' = 1 - t^2:
//          gelu'(h) = (1 + t) / 2 + h (1 - t^2) / 2 * du/dh,  du/dh = sqrt(2/pi) (1 + 3 * 0.044715 h^2)
//
// Nothing but x (and the bias) is needed: one pass reads x and dy once, rebuilds h, the gate and
// gelu'(h) in registers, writes dx and, with RECOMPUTE_OUTPUT, y = gelu(h) through the forward's
// own gelu_gate/gelu_value (bitwise equal). dbias sums the fp32 products dy * gelu'(h), not dx
// rounded to T: each thread accumulates its pack over its rows in increasing row order; the BY
// threads of a pack column are then summed in ty order through shared memory, and block
// (column tile, g) writes columns of row g of the (G, N) buffer DBp; sum_partial_rows_kernel
// adds the G rows in a fixed order. G depends only on (M, N, VEC, SM count), never on
// RECOMPUTE_OUTPUT, so dbias is bitwise the same with and without it.
// Launch: block (BX, BY), BX * BY = kThreads; grid (ceil(N / VEC / BX), G).
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, bool HAS_BIAS, bool TANH, bool RECOMPUTE_OUTPUT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) gelu_bwd_kernel(
    const T* __restrict__ DY,     // (M, N), row stride dy_stride, unit column stride
    const T* __restrict__ X,      // (M, N), row stride x_stride, unit column stride
    const float* __restrict__ B,  // (N,) fp32; read only when HAS_BIAS
    T* __restrict__ DX,           // (M, N) contiguous
    T* __restrict__ Y,            // (M, N) contiguous; written only when RECOMPUTE_OUTPUT
    float* __restrict__ DBp,      // (G, N) fp32 partial dbias; written only when HAS_BIAS
    int64_t M, int N, int64_t dy_stride, int64_t x_stride) {
  constexpr int kUnroll = bwd_unroll(VEC);
  const int col0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  const bool active = col0 < N;  // N is a multiple of VEC: a pack is all in or all out
  float b[VEC], acc[VEC];
  fill<VEC>(acc, 0.f);

  if (active) {  // no return: with a bias every thread reaches the __syncthreads below
    if constexpr (HAS_BIAS) {
      load_pack<float, VEC>(B + col0, b);
    } else {
      fill<VEC>(b, 0.f);  // unused
    }
    const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < M;
         row0 += row_step * kUnroll) {
      Pack<T, VEC> xp[kUnroll], gp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = row0 + u * row_step;
        if (row < M) {
          xp[u] = load_raw_pack<T, VEC>(X + row * x_stride + col0);
          gp[u] = load_raw_pack<T, VEC>(DY + row * dy_stride + col0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = row0 + u * row_step;
        if (row < M) {
          float dx[VEC], y[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float h = pre_activation<HAS_BIAS>(to_float(xp[u].v[j]), b[j]);
            float t;
            const float g = gelu_gate<TANH>(h, t);
            dx[j] = __fmul_rn(to_float(gp[u].v[j]), gelu_derivative<TANH>(h, g, t));
            if constexpr (HAS_BIAS) acc[j] = __fadd_rn(acc[j], dx[j]);  // fp32, before rounding to T
            if constexpr (RECOMPUTE_OUTPUT) y[j] = gelu_value(h, g);
          }
          store_pack<T, VEC>(DX + row * N + col0, dx);
          if constexpr (RECOMPUTE_OUTPUT) store_pack<T, VEC>(Y + row * N + col0, y);
        }
      }
    }
  }

  if constexpr (HAS_BIAS) {
    const int64_t part = static_cast<int64_t>(blockIdx.y) * N;  // row blockIdx.y of DBp
    if (blockDim.y == 1) {  // block-uniform: one thread per pack column, nothing to combine
      if (active) store_pack<float, VEC>(DBp + part + col0, acc);
      return;
    }
    // red[ty][tx * VEC + j] = acc[j]; then column c of the tile = sum over ty, in ty order.
    __shared__ float red[kThreads * VEC];
    const int width = blockDim.x * VEC;  // columns in this block's tile
#pragma unroll
    for (int j = 0; j < VEC; ++j) red[threadIdx.y * width + threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    const int tile0 = blockIdx.x * width;
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < width; c += kThreads) {
      if (tile0 + c < N) {
        float s = red[c];
        for (int r = 1; r < static_cast<int>(blockDim.y); ++r) s += red[r * width + c];
        DBp[part + tile0 + c] = s;
      }
    }
  }
}

// =============================================================================================
// Host side
// =============================================================================================

constexpr const char* kOp = "gelu";  // the op family every error message starts with

// "none" -> false, "tanh" -> true; anything else is an error naming the argument.
bool parse_approximate(c10::string_view approximate) {
  if (approximate == c10::string_view("tanh")) return true;
  TORCH_CHECK(approximate == c10::string_view("none"), kOp, ": approximate must be 'none' or 'tanh', got '",
              std::string(approximate.data(), approximate.size()), "'");
  return false;
}

// True when the rows of a 2-D tensor are back to back (one flat array).
bool dense_rows(const at::Tensor& t) { return t.size(0) <= 1 || t.stride(0) == t.size(1); }

// The (M, N) problem the kernels see: the tensor's own rows, or, for a dense tensor without a
// bias, the flat array cut into rows of W = the largest power of two dividing M * N, up to
// kMaxFlatWidth (W >= VEC whenever M * N is a multiple of VEC).
struct Rows {
  int64_t M;
  int N;
  int64_t x_stride;
  int64_t dy_stride;
};

Rows flat_rows(int64_t M, int64_t N) {
  const int64_t total = M * N;
  int64_t width = 1;
  while (width < kMaxFlatWidth && total % (width * 2) == 0) width *= 2;
  return {total / width, static_cast<int>(width), width, width};
}

// Block shape and grid for rows of NPR packs. BX: the next power of two for narrow rows (<= 32
// packs: a warp then covers 32 / BX whole row segments), else the one of 32..256 that pads the
// row least (ties: the wider). BY = kThreads / BX rows. G row groups: about BLOCKS_PER_SM blocks
// per SM in all, and no more than give every thread MIN_ROWS rows. Depends only on
// (M, NPR, SM count): with a bias, the dbias summation order is fixed by them.
struct Launch {
  dim3 grid;
  dim3 block;
};

Launch plan_launch(int64_t M, int npr, int sms, int blocks_per_sm, int min_rows) {
  int bx = 1;
  if (npr <= kWarpSize) {
    while (bx < npr) bx *= 2;
  } else {
    bx = kWarpSize;
    for (int c = kWarpSize * 2; c <= kThreads; c *= 2) {
      if (ceil_div(npr, c) * c <= ceil_div(npr, bx) * bx) bx = c;
    }
  }
  const int by = kThreads / bx;
  const int64_t tiles = ceil_div(npr, bx);
  int64_t groups = std::max<int64_t>(1, static_cast<int64_t>(blocks_per_sm) * sms / tiles);
  groups = std::min(groups, ceil_div(M, static_cast<int64_t>(by) * min_rows));
  groups = std::max<int64_t>(1, std::min<int64_t>(groups, 65535));
  return {dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(groups)), dim3(bx, by)};
}

// ----------------------------------------- forward -----------------------------------------

template <typename T, int VEC>
void launch_fwd(const T* x, const float* b, T* y, const Rows& r, bool tanh, int sms, cudaStream_t stream) {
  const Launch l = plan_launch(r.M, r.N / VEC, sms, kGridBlocksPerSm, fwd_unroll(VEC));
  auto run = [&](auto kernel) {
    kernel<<<l.grid, l.block, 0, stream>>>(x, b, y, r.M, r.N, r.x_stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (b != nullptr) {
    if (tanh) run(gelu_fwd_kernel<T, VEC, true, true>);
    else run(gelu_fwd_kernel<T, VEC, true, false>);
  } else {
    if (tanh) run(gelu_fwd_kernel<T, VEC, false, true>);
    else run(gelu_fwd_kernel<T, VEC, false, false>);
  }
}

// ----------------------------------------- backward ----------------------------------------

struct BwdPointers {
  const void* dy;
  const void* x;
  const float* b;
  void* dx;
  void* y;  // null unless recompute_output
};

template <typename T, int VEC, bool HAS_BIAS, bool RECOMPUTE_OUTPUT>
void launch_bwd_kernel(const BwdPointers& p, float* dbp, const Rows& r, const Launch& l, bool tanh,
                       cudaStream_t stream) {
  auto run = [&](auto kernel) {
    kernel<<<l.grid, l.block, 0, stream>>>(static_cast<const T*>(p.dy), static_cast<const T*>(p.x), p.b,
                                           static_cast<T*>(p.dx), static_cast<T*>(p.y), dbp, r.M, r.N,
                                           r.dy_stride, r.x_stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (tanh) run(gelu_bwd_kernel<T, VEC, HAS_BIAS, true, RECOMPUTE_OUTPUT>);
  else run(gelu_bwd_kernel<T, VEC, HAS_BIAS, false, RECOMPUTE_OUTPUT>);
}

// Launches the backward; returns the (G, N) fp32 dbias partials with a bias, else undefined.
template <typename T, int VEC>
at::Tensor launch_bwd(const BwdPointers& p, const Rows& r, bool tanh, bool recompute_output, int sms,
                      const at::TensorOptions& float_opts, cudaStream_t stream) {
  const bool has_bias = p.b != nullptr;
  // With a bias, one wave of blocks (kMinBlocksPerSm are resident by __launch_bounds__) and at
  // least kMinBiasRowsPerThread rows a thread keep the (G, N) partials small next to x and dy.
  const Launch l = has_bias ? plan_launch(r.M, r.N / VEC, sms, kMinBlocksPerSm, kMinBiasRowsPerThread)
                            : plan_launch(r.M, r.N / VEC, sms, kGridBlocksPerSm, bwd_unroll(VEC));
  at::Tensor partials;
  if (has_bias) {
    partials = at::empty({static_cast<int64_t>(l.grid.y), r.N}, float_opts);
    float* dbp = partials.data_ptr<float>();
    if (recompute_output) launch_bwd_kernel<T, VEC, true, true>(p, dbp, r, l, tanh, stream);
    else launch_bwd_kernel<T, VEC, true, false>(p, dbp, r, l, tanh, stream);
  } else {
    if (recompute_output) launch_bwd_kernel<T, VEC, false, true>(p, nullptr, r, l, tanh, stream);
    else launch_bwd_kernel<T, VEC, false, false>(p, nullptr, r, l, tanh, stream);
  }
  return partials;
}

// =============================================================================================
// Entry points (the CUDA kernels of the ops registered at the end of this file)
// =============================================================================================

// x (M, N) float32/float16/bfloat16 with stride(1) == 1 and any row stride; bias None or (N,)
// float32/float16/bfloat16; approximate "none" (erf) or "tanh".
// Returns y = gelu(x + bias), (M, N) contiguous in x.dtype.
at::Tensor gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view approximate) {
  const bool tanh = parse_approximate(approximate);
  check_rows(kOp, x, "x");
  check_param(kOp, bias, "bias", x);

  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = empty_rows(x);
  if (M == 0 || N == 0) return y;

  const at::Tensor b = param_as_float(bias);
  // Without a bias, a dense x is one flat array (y always is): any N gets vector loads.
  const Rows r = (!present(bias) && dense_rows(x)) ? flat_rows(M, N) : Rows{M, static_cast<int>(N), x.stride(0), N};
  const int sms = sm_count(x.device().index());
  cudaStream_t stream = current_stream(x);
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_gelu_fwd", [&] {
    constexpr int kVec = max_vec<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float* bp = float_ptr_or_null(b);
    if (vectorizable(xp, r.x_stride, r.M, r.N, kVec) && is_aligned(yp, kMaxVecBytes)) {
      launch_fwd<scalar_t, kVec>(xp, bp, yp, r, tanh, sms, stream);
    } else {
      launch_fwd<scalar_t, 1>(xp, bp, yp, r, tanh, sms, stream);
    }
  });
  return y;
}

// dy (M, N) in x.dtype, stride(1) == 1, its own row stride; x, bias, approximate as gelu_fwd.
// Returns dx (M, N) contiguous in x.dtype; dbias (N,) in bias.dtype (empty(0) of x.dtype without
// bias), summed over rows in fp32 from dy * gelu'(x + bias) before rounding; y (M, N) bitwise as
// gelu_fwd wrote it when recompute_output (else empty(0) of x.dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                        const std::optional<at::Tensor>& bias,
                                                        c10::string_view approximate, bool recompute_output) {
  const bool tanh = parse_approximate(approximate);
  check_rows(kOp, x, "x");
  check_rows(kOp, dy, "dy");
  check_like_x(kOp, dy, "dy", x);
  check_param(kOp, bias, "bias", x);

  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const bool has_bias = present(bias);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = empty_rows(x);
  at::Tensor y = recomputed_output(recompute_output, x);
  at::Tensor dbias = param_grad(bias, x);
  if (M == 0 || N == 0) return {dx, dbias, y};

  const at::Tensor b = param_as_float(bias);
  const BwdPointers p{dy.data_ptr(), x.data_ptr(), float_ptr_or_null(b), dx.data_ptr(),
                      recompute_output ? y.data_ptr() : nullptr};
  const Rows r = (!has_bias && dense_rows(x) && dense_rows(dy))
                     ? flat_rows(M, N)
                     : Rows{M, static_cast<int>(N), x.stride(0), dy.stride(0)};
  const int sms = sm_count(x.device().index());
  cudaStream_t stream = current_stream(x);
  const at::TensorOptions float_opts = x.options().dtype(at::kFloat);
  at::Tensor partials;
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_gelu_bwd", [&] {
    constexpr int kVec = max_vec<scalar_t>();
    const bool vec = vectorizable(p.x, r.x_stride, r.M, r.N, kVec) &&
                     vectorizable(p.dy, r.dy_stride, r.M, r.N, kVec) && is_aligned(p.dx, kMaxVecBytes) &&
                     (p.y == nullptr || is_aligned(p.y, kMaxVecBytes));
    if (vec) {
      partials = launch_bwd<scalar_t, kVec>(p, r, tanh, recompute_output, sms, float_opts, stream);
    } else {
      partials = launch_bwd<scalar_t, 1>(p, r, tanh, recompute_output, sms, float_opts, stream);
    }
  });
  if (has_bias) sum_partial_rows(partials, dbias, stream);
  return {dx, dbias, y};
}

}  // namespace
}  // namespace remat

// =============================================================================================
// Registration: the schemas (torch.ops.remat_C.gelu_*; tensor contract above and in
// remat/ops/gelu.py: gelu_fwd_ref, gelu_bwd_ref) and their CUDA kernels. The fake kernels and
// autograd are registered from Python.
// =============================================================================================

TORCH_LIBRARY_FRAGMENT(remat_C, m) {
  m.def("gelu_fwd(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "gelu_bwd(Tensor dy, Tensor x, Tensor? bias, str approximate, bool recompute_output) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("gelu_fwd", &remat::gelu_fwd);
  m.impl("gelu_bwd", &remat::gelu_bwd);
}
