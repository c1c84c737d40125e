// GELU (exact erf, tanh approximation, or QuickGELU x * sigmoid(1.702 x)) with an optional fused
// bias, forward and backward; the backward rebuilds h = x + bias from x and can also rebuild
// y = gelu(h) (RECOMPUTE_OUTPUT), bitwise as the forward wrote it. All math in fp32; no atomics:
// every result is bitwise deterministic for a given shape, layout and device.
//
// Kernels, top to bottom:
//   gelu_fwd_kernel           y = gelu(x + bias)
//   gelu_bwd_kernel           dx = dy * gelu'(x + bias), dbias partials (G, N), y on request
//   sum_partial_rows_kernel   (common.cuh) (G, N) fp32 partials -> dbias (N,)
// then the launchers, the entry points and their registration as torch.ops.remat_C.gelu_fwd/_bwd.
//
// Layout: both kernels see x as rows (M, N), tiled as host.h's elementwise tiles: thread (tx, ty)
// of a (BX, BY) block owns one pack of VEC columns of every G * BY-th row. Its bias pack is
// loaded once; with a bias, the backward accumulates dbias in VEC fp32 registers over those rows.
// VEC = 16 bytes of T when the data allow it (aligned base, N and row strides multiples of VEC),
// else 1. Without a bias and with dense rows, the launcher views the data as one flat array cut
// into rows of a power-of-two width, so any N (N = 1 included) gets whole-vector rows.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include "activations.cuh"
#include "common.cuh"
#include "host.h"

namespace remat {
namespace {

// Rows a thread loads before it computes (all loads issued first): 16 elements a tensor in the
// forward, 8 in the backward (x and dy), i.e. 64 / 32 bytes of fp32 / 16-bit types in flight a
// thread. More unrolling of 16-bit packs spills at the 64-register cap of __launch_bounds__
// (kTileMinBlocksPerSm).
constexpr int fwd_unroll(int vec) { return vec >= 8 ? 2 : 4; }
constexpr int bwd_unroll(int vec) { return vec >= 8 ? 1 : 2; }
constexpr int kMinBiasRowsPerThread = 8;  // bias backward: fewer row groups, smaller (G, N) partials
constexpr int kMaxFlatWidth = 4096;  // dense rows without bias: flat rows of up to this many elements

// ---------------------------------------------------------------------------------------------
// Per-element math: activation_gate, activation_value and activation_derivative (activations.cuh)
// for A = kGelu, kGeluTanh or kQuickGelu. The forward and the recomputing backward both call
// activation_gate and activation_value, so the recomputed y is bitwise what the forward wrote.
// ---------------------------------------------------------------------------------------------

// h = x + bias (x alone without a bias).
template <bool HAS_BIAS>
__device__ __forceinline__ float pre_activation(float x, float b) {
  if constexpr (HAS_BIAS) {
    return __fadd_rn(x, b);
  } else {
    return x;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: y = gelu(x + bias). Each thread: its bias pack once, then fwd_unroll(VEC) rows at a time
// (all loads issued before any math). No block-wide synchronisation: idle threads return.
// Launch: block (BX, BY), BX * BY = kTileThreads; grid (ceil(N / VEC / BX), G).
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, bool HAS_BIAS, Activation A>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocksPerSm) gelu_fwd_kernel(
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

  Pack<T, VEC> xp[kUnroll];
  for_each_tile_row<kUnroll>(
      M, [&](int u, int64_t row) { xp[u] = load_raw_pack<T, VEC>(X + row * x_stride + col0); },
      [&](int u, int64_t row) {
        float y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float h = pre_activation<HAS_BIAS>(to_float(xp[u].v[j]), b[j]);
          float aux;
          y[j] = activation_value(h, activation_gate<A>(h, aux));
        }
        store_pack<T, VEC>(Y + row * N + col0, y);
      });
}

// ---------------------------------------------------------------------------------------------
// Backward. Per element, h = x + bias (bias = 0 when absent), y = gelu(h):
//
//   dx = dy * gelu'(h),   dbias_j = sum over rows i of dy_ij * gelu'(h_ij)   (dh/dbias = 1)
//
// with gelu'(h) as derived in activations.cuh for each approximation.
//
// Nothing but x (and the bias) is needed: one pass reads x and dy once, rebuilds h, the gate and
// gelu'(h) in registers, writes dx and, with RECOMPUTE_OUTPUT, y = gelu(h) through the forward's
// own activation_gate/activation_value (bitwise equal). dbias sums the fp32 products
// dy * gelu'(h), not dx rounded to T: each thread accumulates its pack over its rows in
// increasing row order; the BY threads of a pack column are then summed in ty order through
// shared memory, and block (column tile, g) writes columns of row g of the (G, N) buffer DBp;
// sum_partial_rows_kernel adds the G rows in a fixed order. G depends only on (M, N, VEC, SM count), never on
// RECOMPUTE_OUTPUT, so dbias is bitwise the same with and without it.
// Launch: block (BX, BY), BX * BY = kTileThreads; grid (ceil(N / VEC / BX), G).
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, bool HAS_BIAS, Activation A, bool RECOMPUTE_OUTPUT>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocksPerSm) gelu_bwd_kernel(
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
    Pack<T, VEC> xp[kUnroll], gp[kUnroll];
    for_each_tile_row<kUnroll>(
        M,
        [&](int u, int64_t row) {
          xp[u] = load_raw_pack<T, VEC>(X + row * x_stride + col0);
          gp[u] = load_raw_pack<T, VEC>(DY + row * dy_stride + col0);
        },
        [&](int u, int64_t row) {
          float dx[VEC], y[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float h = pre_activation<HAS_BIAS>(to_float(xp[u].v[j]), b[j]);
            float aux;
            const float g = activation_gate<A>(h, aux);
            dx[j] = __fmul_rn(to_float(gp[u].v[j]), activation_derivative<A>(h, g, aux));
            if constexpr (HAS_BIAS) acc[j] = __fadd_rn(acc[j], dx[j]);  // fp32, before rounding to T
            if constexpr (RECOMPUTE_OUTPUT) y[j] = activation_value(h, g);
          }
          store_pack<T, VEC>(DX + row * N + col0, dx);
          if constexpr (RECOMPUTE_OUTPUT) store_pack<T, VEC>(Y + row * N + col0, y);
        });
  }

  if constexpr (HAS_BIAS) {
    const int64_t part = static_cast<int64_t>(blockIdx.y) * N;  // row blockIdx.y of DBp
    if (blockDim.y == 1) {  // block-uniform: one thread per pack column, nothing to combine
      if (active) store_pack<float, VEC>(DBp + part + col0, acc);
      return;
    }
    // red[ty][tx * VEC + j] = acc[j]; then column c of the tile = sum over ty, in ty order.
    __shared__ float red[kTileThreads * VEC];
    const int width = blockDim.x * VEC;  // columns in this block's tile
#pragma unroll
    for (int j = 0; j < VEC; ++j) red[threadIdx.y * width + threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    const int tile0 = blockIdx.x * width;
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < width; c += kTileThreads) {
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

// The approximate argument's names.
constexpr std::pair<const char*, Activation> kApproximations[] = {
    {"none", Activation::kGelu}, {"tanh", Activation::kGeluTanh}, {"quick", Activation::kQuickGelu}};

Activation parse_approximate(c10::string_view approximate) {
  return parse_choice(kOp, "approximate", approximate, kApproximations);
}

// Calls f(std::integral_constant<Activation, A>{}) for the GELU approximation A.
template <typename F>
void dispatch_gelu(Activation approximate, F&& f) {
  dispatch_activation<Activation::kGelu, Activation::kGeluTanh, Activation::kQuickGelu>(approximate, f);
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

// ----------------------------------------- forward -----------------------------------------

template <typename T, int VEC>
void launch_fwd(const T* x, const float* b, T* y, const Rows& r, Activation approximate, int sms,
                cudaStream_t stream) {
  const TileLaunch l = plan_tiles(r.M, r.N / VEC, sms, kTileGridBlocksPerSm, fwd_unroll(VEC));
  auto run = [&](auto kernel) {
    kernel<<<l.grid, l.block, 0, stream>>>(x, b, y, r.M, r.N, r.x_stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  dispatch_gelu(approximate, [&](auto a) {
    if (b != nullptr) run(gelu_fwd_kernel<T, VEC, true, decltype(a)::value>);
    else run(gelu_fwd_kernel<T, VEC, false, decltype(a)::value>);
  });
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
void launch_bwd_kernel(const BwdPointers& p, float* dbp, const Rows& r, const TileLaunch& l,
                       Activation approximate, cudaStream_t stream) {
  auto run = [&](auto kernel) {
    kernel<<<l.grid, l.block, 0, stream>>>(static_cast<const T*>(p.dy), static_cast<const T*>(p.x), p.b,
                                           static_cast<T*>(p.dx), static_cast<T*>(p.y), dbp, r.M, r.N,
                                           r.dy_stride, r.x_stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  dispatch_gelu(approximate,
                [&](auto a) { run(gelu_bwd_kernel<T, VEC, HAS_BIAS, decltype(a)::value, RECOMPUTE_OUTPUT>); });
}

// Launches the backward; returns the (G, N) fp32 dbias partials with a bias, else undefined.
template <typename T, int VEC>
at::Tensor launch_bwd(const BwdPointers& p, const Rows& r, Activation approximate, bool recompute_output, int sms,
                      const at::TensorOptions& float_opts, cudaStream_t stream) {
  const bool has_bias = p.b != nullptr;
  // With a bias, one wave of blocks (kTileMinBlocksPerSm are resident by __launch_bounds__) and at
  // least kMinBiasRowsPerThread rows a thread keep the (G, N) partials small next to x and dy.
  const TileLaunch l = has_bias ? plan_tiles(r.M, r.N / VEC, sms, kTileMinBlocksPerSm, kMinBiasRowsPerThread)
                                : plan_tiles(r.M, r.N / VEC, sms, kTileGridBlocksPerSm, bwd_unroll(VEC));
  at::Tensor partials;
  if (has_bias) {
    partials = at::empty({static_cast<int64_t>(l.grid.y), r.N}, float_opts);
    float* dbp = partials.data_ptr<float>();
    if (recompute_output) launch_bwd_kernel<T, VEC, true, true>(p, dbp, r, l, approximate, stream);
    else launch_bwd_kernel<T, VEC, true, false>(p, dbp, r, l, approximate, stream);
  } else {
    if (recompute_output) launch_bwd_kernel<T, VEC, false, true>(p, nullptr, r, l, approximate, stream);
    else launch_bwd_kernel<T, VEC, false, false>(p, nullptr, r, l, approximate, stream);
  }
  return partials;
}

// =============================================================================================
// Entry points (the CUDA kernels of the ops registered at the end of this file)
// =============================================================================================

// x (M, N) float32/float16/bfloat16 with stride(1) == 1 and any row stride; bias None or (N,)
// float32/float16/bfloat16; approximate "none" (erf), "tanh" or "quick" (x * sigmoid(1.702 x)).
// Returns y = gelu(x + bias), (M, N) contiguous in x.dtype.
at::Tensor gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view approximate) {
  const Activation act = parse_approximate(approximate);
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
      launch_fwd<scalar_t, kVec>(xp, bp, yp, r, act, sms, stream);
    } else {
      launch_fwd<scalar_t, 1>(xp, bp, yp, r, act, sms, stream);
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
  const Activation act = parse_approximate(approximate);
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
      partials = launch_bwd<scalar_t, kVec>(p, r, act, recompute_output, sms, float_opts, stream);
    } else {
      partials = launch_bwd<scalar_t, 1>(p, r, act, recompute_output, sms, float_opts, stream);
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
