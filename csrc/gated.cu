// Gated activations y = act(gate) * up (SwiGLU, GeGLU), act = SiLU, GELU (erf) or GELU (tanh),
// forward and backward; the backward rebuilds act(gate) from gate and can also rebuild y
// (RECOMPUTE_OUTPUT, for the down projection's weight gradient), bitwise as the forward wrote it.
// All math in fp32, no reduction: one pass over independent elements in each direction.
//
// Kernels, top to bottom:
//   gated_fwd_kernel   y = act(gate) * up
//   gated_bwd_kernel   d_gate = dy * up * act'(gate), d_up = dy * act(gate), y on request
// then the launchers, the entry points and their registration as torch.ops.remat_C.gated_fwd/_bwd.
//
// Layout: gate, up and dy are rows (M, N), each with its own row stride (gate and up may be the
// two halves of one (M, 2N) projection output, read in place), tiled as host.h's elementwise
// tiles. VEC = 16 bytes of T when every input allows it (aligned base, N and row strides
// multiples of VEC; the outputs are fresh and contiguous, so N % VEC == 0 aligns their rows),
// else 1: the up half of an (M, 2N) tensor at a ragged N is read element by element.
//
// Rounding (ROUND_ACTIVATION): transformers' gated MLPs compute act_fn(gate) * up in the input
// dtype, so act(gate) is rounded to T before the multiply, then the product again. The fp32
// product of two 16-bit values is exact, so rounding it once to T gives the stock product.
// Without ROUND_ACTIVATION the product is rounded once, at the end. d_up = dy * (the same
// act(gate) the product used); d_gate takes the rounding as the identity, as autograd does.

#include <cstdint>
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

// Rows a thread loads before it computes (all loads issued first): one 16-byte pack a tensor for
// 16-bit types, two for fp32, as GELU's backward does with its two inputs; the gated backward has
// three inputs and still fits the 64 registers of __launch_bounds__ (kTileMinBlocksPerSm).
constexpr int gated_unroll(int vec) { return vec >= 8 ? 1 : 2; }

// ---------------------------------------------------------------------------------------------
// Shared per-element math: the forward and the recomputing backward both call gated_activation
// and gated_product, so the recomputed y is bitwise what the forward wrote.
// ---------------------------------------------------------------------------------------------

// a = act(h), rounded through T when ROUND_ACTIVATION; G and AUX receive activation_gate's
// outputs for the derivative.
template <typename T, Activation A, bool ROUND_ACTIVATION>
__device__ __forceinline__ float gated_activation(float h, float& g, float& aux) {
  g = activation_gate<A>(h, aux);
  const float a = activation_value(h, g);
  if constexpr (ROUND_ACTIVATION) {
    return to_float(from_float<T>(a));
  } else {
    return a;
  }
}

__device__ __forceinline__ float gated_product(float a, float up) { return __fmul_rn(a, up); }

// ---------------------------------------------------------------------------------------------
// Forward: y = act(gate) * up. Each thread: gated_unroll(VEC) rows at a time, all loads issued
// before any math. Launch: block (BX, BY), BX * BY = kTileThreads; grid (ceil(N / VEC / BX), G).
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, Activation A, bool ROUND_ACTIVATION>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocksPerSm) gated_fwd_kernel(
    const T* __restrict__ Gate,  // (M, N), row stride gate_stride, unit column stride
    const T* __restrict__ Up,    // (M, N), row stride up_stride, unit column stride
    T* __restrict__ Y,           // (M, N) contiguous
    int64_t M, int N, int64_t gate_stride, int64_t up_stride) {
  constexpr int kUnroll = gated_unroll(VEC);
  const int col0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (col0 >= N) return;  // N is a multiple of VEC: a pack is all in or all out
  Pack<T, VEC> gp[kUnroll], up[kUnroll];
  for_each_tile_row<kUnroll>(
      M,
      [&](int u, int64_t row) {
        gp[u] = load_raw_pack<T, VEC>(Gate + row * gate_stride + col0);
        up[u] = load_raw_pack<T, VEC>(Up + row * up_stride + col0);
      },
      [&](int u, int64_t row) {
        float y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float g, aux;
          const float a = gated_activation<T, A, ROUND_ACTIVATION>(to_float(gp[u].v[j]), g, aux);
          y[j] = gated_product(a, to_float(up[u].v[j]));
        }
        store_pack<T, VEC>(Y + row * N + col0, y);
      });
}

// ---------------------------------------------------------------------------------------------
// Backward. Per element, y = a * up with a = act(h), h = gate:
//
//   d_up = dy * a,   d_gate = dy * up * act'(h)   (act' as derived in activations.cuh)
//
// One pass reads gate, up and dy once, rebuilds a and act'(h) in registers and writes d_gate and
// d_up into one contiguous (M, 2N) tensor, [d_gate | d_up] a row (the gradient of a fused
// gate_up projection as it is; two strided views for separate projections), and with
// RECOMPUTE_OUTPUT y. Launch as the forward.
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, Activation A, bool ROUND_ACTIVATION, bool RECOMPUTE_OUTPUT>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocksPerSm) gated_bwd_kernel(
    const T* __restrict__ DY,    // (M, N), row stride dy_stride, unit column stride
    const T* __restrict__ Gate,  // (M, N), row stride gate_stride
    const T* __restrict__ Up,    // (M, N), row stride up_stride
    T* __restrict__ DGateUp,     // (M, 2N) contiguous: d_gate in columns [0, N), d_up in [N, 2N)
    T* __restrict__ Y,           // (M, N) contiguous; written only when RECOMPUTE_OUTPUT
    int64_t M, int N, int64_t dy_stride, int64_t gate_stride, int64_t up_stride) {
  constexpr int kUnroll = gated_unroll(VEC);
  const int col0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (col0 >= N) return;
  Pack<T, VEC> gp[kUnroll], up[kUnroll], dp[kUnroll];
  for_each_tile_row<kUnroll>(
      M,
      [&](int u, int64_t row) {
        gp[u] = load_raw_pack<T, VEC>(Gate + row * gate_stride + col0);
        up[u] = load_raw_pack<T, VEC>(Up + row * up_stride + col0);
        dp[u] = load_raw_pack<T, VEC>(DY + row * dy_stride + col0);
      },
      [&](int u, int64_t row) {
        float d_gate[VEC], d_up[VEC], y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float h = to_float(gp[u].v[j]);
          const float upv = to_float(up[u].v[j]);
          const float dy = to_float(dp[u].v[j]);
          float g, aux;
          const float a = gated_activation<T, A, ROUND_ACTIVATION>(h, g, aux);
          d_gate[j] = __fmul_rn(__fmul_rn(dy, upv), activation_derivative<A>(h, g, aux));
          d_up[j] = __fmul_rn(dy, a);
          if constexpr (RECOMPUTE_OUTPUT) y[j] = gated_product(a, upv);
        }
        T* grad_row = DGateUp + row * (2 * static_cast<int64_t>(N));
        store_pack<T, VEC>(grad_row + col0, d_gate);
        store_pack<T, VEC>(grad_row + N + col0, d_up);
        if constexpr (RECOMPUTE_OUTPUT) store_pack<T, VEC>(Y + row * N + col0, y);
      });
}

// =============================================================================================
// Host side
// =============================================================================================

constexpr const char* kOp = "gated";  // the op family every error message starts with

// The activation argument's names.
constexpr std::pair<const char*, Activation> kActivations[] = {
    {"silu", Activation::kSilu}, {"gelu", Activation::kGelu}, {"gelu_tanh", Activation::kGeluTanh}};

// Calls f(std::integral_constant<Activation, A>{}) for a gated activation A.
template <typename F>
void dispatch_gated(Activation activation, F&& f) {
  dispatch_activation<Activation::kSilu, Activation::kGelu, Activation::kGeluTanh>(activation, f);
}

// Calls f(std::bool_constant<B>{}) for B = FLAG.
template <typename F>
void dispatch_bool(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// gate and up: rows of one dtype and shape on one device (check_rows each).
void check_gate_and_up(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(kOp, gate, "gate");
  check_rows(kOp, up, "up");
  check_like(kOp, up, "up", gate, "gate");
}

// The launch of both kernels for (M, N) rows of VEC-element packs.
TileLaunch plan(int64_t M, int64_t N, int vec, const at::Tensor& gate) {
  const int sms = sm_count(gate.device().index());
  return plan_tiles(M, static_cast<int>(N) / vec, sms, kTileGridBlocksPerSm, gated_unroll(vec));
}

// =============================================================================================
// Entry points (the CUDA kernels of the ops registered at the end of this file)
// =============================================================================================

// gate, up (M, N) of one dtype (float32/float16/bfloat16), unit column stride, each its own row
// stride; activation "silu", "gelu" (erf) or "gelu_tanh"; round_activation as above.
// Returns y = act(gate) * up, (M, N) contiguous in gate's dtype.
at::Tensor gated_fwd(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation,
                     bool round_activation) {
  const Activation act = parse_choice(kOp, "activation", activation, kActivations);
  check_gate_and_up(gate, up);
  const int64_t M = gate.size(0);
  const int64_t N = gate.size(1);
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor y = empty_rows(gate);
  if (M == 0 || N == 0) return y;

  cudaStream_t stream = current_stream(gate);
  REMAT_DISPATCH_FLOAT_TYPES(gate.scalar_type(), "remat_gated_fwd", [&] {
    constexpr int kVec = max_vec<scalar_t>();
    const bool vec = vectorizable(gate.data_ptr(), gate.stride(0), M, N, kVec) &&
                     vectorizable(up.data_ptr(), up.stride(0), M, N, kVec);
    auto run = [&](auto kernel, int v) {
      const TileLaunch l = plan(M, N, v, gate);
      kernel<<<l.grid, l.block, 0, stream>>>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(),
                                             y.data_ptr<scalar_t>(), M, static_cast<int>(N), gate.stride(0),
                                             up.stride(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    dispatch_gated(act, [&](auto a) {
      dispatch_bool(round_activation, [&](auto round) {
        constexpr Activation kAct = decltype(a)::value;
        constexpr bool kRound = decltype(round)::value;
        if (vec) run(gated_fwd_kernel<scalar_t, kVec, kAct, kRound>, kVec);
        else run(gated_fwd_kernel<scalar_t, 1, kAct, kRound>, 1);
      });
    });
  });
  return y;
}

// dy (M, N) in gate's dtype, unit column stride, its own row stride; gate, up, activation,
// round_activation as gated_fwd. Returns d_gate_up (M, 2N) contiguous in gate's dtype, d_gate in
// its first N columns and d_up in the last N; y (M, N) bitwise as gated_fwd wrote it when
// recompute_output, else empty(0) of gate's dtype.
std::tuple<at::Tensor, at::Tensor> gated_bwd(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                                             c10::string_view activation, bool recompute_output,
                                             bool round_activation) {
  const Activation act = parse_choice(kOp, "activation", activation, kActivations);
  check_gate_and_up(gate, up);
  check_rows(kOp, dy, "dy");
  check_like(kOp, dy, "dy", gate, "gate");
  const int64_t M = gate.size(0);
  const int64_t N = gate.size(1);
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor d_gate_up = at::empty({M, 2 * N}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor y = recomputed_output(recompute_output, gate);
  if (M == 0 || N == 0) return {d_gate_up, y};

  cudaStream_t stream = current_stream(gate);
  REMAT_DISPATCH_FLOAT_TYPES(gate.scalar_type(), "remat_gated_bwd", [&] {
    constexpr int kVec = max_vec<scalar_t>();
    const bool vec = vectorizable(gate.data_ptr(), gate.stride(0), M, N, kVec) &&
                     vectorizable(up.data_ptr(), up.stride(0), M, N, kVec) &&
                     vectorizable(dy.data_ptr(), dy.stride(0), M, N, kVec);
    scalar_t* y_ptr = recompute_output ? y.data_ptr<scalar_t>() : nullptr;
    auto run = [&](auto kernel, int v) {
      const TileLaunch l = plan(M, N, v, gate);
      kernel<<<l.grid, l.block, 0, stream>>>(dy.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(),
                                             up.data_ptr<scalar_t>(), d_gate_up.data_ptr<scalar_t>(), y_ptr, M,
                                             static_cast<int>(N), dy.stride(0), gate.stride(0), up.stride(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    dispatch_gated(act, [&](auto a) {
      dispatch_bool(round_activation, [&](auto round) {
        dispatch_bool(recompute_output, [&](auto recompute) {
          constexpr Activation kAct = decltype(a)::value;
          constexpr bool kRound = decltype(round)::value;
          constexpr bool kRecompute = decltype(recompute)::value;
          if (vec) run(gated_bwd_kernel<scalar_t, kVec, kAct, kRound, kRecompute>, kVec);
          else run(gated_bwd_kernel<scalar_t, 1, kAct, kRound, kRecompute>, 1);
        });
      });
    });
  });
  return {d_gate_up, y};
}

}  // namespace
}  // namespace remat

// =============================================================================================
// Registration: the schemas (torch.ops.remat_C.gated_*; tensor contract above and in
// remat/ops/gated_reference.py: gated_fwd_ref, gated_bwd_ref) and their CUDA kernels. The fake
// kernels and autograd are registered from Python.
// =============================================================================================

TORCH_LIBRARY_FRAGMENT(remat_C, m) {
  m.def("gated_fwd(Tensor gate, Tensor up, str activation, bool round_activation) -> Tensor");
  m.def(
      "gated_bwd(Tensor dy, Tensor gate, Tensor up, str activation, bool recompute_output, "
      "bool round_activation) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("gated_fwd", &remat::gated_fwd);
  m.impl("gated_bwd", &remat::gated_bwd);
}
