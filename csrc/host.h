// Host-side helpers shared by the op families (csrc/*.cu): argument checks whose errors name the
// op family and the argument, parameters prepared for the kernels' vector loads, output
// allocation, and device queries. Device-side code lives in common.cuh.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/string_view.h>
#include <cuda_runtime.h>

#include "activations.cuh"
#include "common.cuh"

namespace remat {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// True when P is aligned to BYTES.
inline bool is_aligned(const void* p, int bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

// The storage types the kernels read and write.
inline bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// An optional tensor argument that was given (None arrives as nullopt or an undefined tensor).
inline bool present(const std::optional<at::Tensor>& p) { return p.has_value() && p->defined(); }

// ------------------------------------------------------------------------- argument checks ----
// Every message starts with the op family OP ("gelu", "layer_norm") and names the argument.

// "'a', 'b' or 'c'": the names of CHOICES, for an error message.
template <typename V, std::size_t K>
std::string quoted_names(const std::pair<const char*, V> (&choices)[K]) {
  std::string names;
  for (std::size_t i = 0; i < K; ++i) {
    if (i > 0) names += i + 1 == K ? " or " : ", ";
    names += "'" + std::string(choices[i].first) + "'";
  }
  return names;
}

// The value CHOICES pairs with the name VALUE; any other name is an error naming the argument
// and listing the names: "gelu: approximate must be 'none', 'tanh' or 'quick', got 'exact'".
template <typename V, std::size_t K>
V parse_choice(const char* op, const char* name, c10::string_view value,
               const std::pair<const char*, V> (&choices)[K]) {
  std::size_t i = 0;
  while (i < K && value != c10::string_view(choices[i].first)) ++i;
  TORCH_CHECK(i < K, op, ": ", name, " must be ", quoted_names(choices), ", got '",
              std::string(value.data(), value.size()), "'");
  return choices[i].second;
}

// T (M, N): a CUDA tensor of a storage type, unit column stride, any non-negative row stride, and
// N small enough for int column indices with room to step past the last pack.
inline void check_rows(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D (M, N), got shape ", t.sizes());
  TORCH_CHECK(is_float_type(t.scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name,
              " must have a unit stride in its last dim, got strides ", t.strides());
  TORCH_CHECK(t.stride(0) >= 0, op, ": ", name, " has a negative row stride");
  TORCH_CHECK(t.size(1) <= std::numeric_limits<int>::max() / 2, op, ": ", name, " is too wide: N = ", t.size(1));
}

// T on the device of REF (named REF_NAME), with its shape.
inline void check_shape_like(const char* op, const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " must have ", ref_name, "'s shape ", ref.sizes(), ", got ",
              t.sizes());
}

// T on REF's device, with REF's shape and dtype.
inline void check_like(const char* op, const at::Tensor& t, const char* name, const at::Tensor& ref,
                       const char* ref_name) {
  check_shape_like(op, t, name, ref, ref_name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
              ref.scalar_type(), ", got ", t.scalar_type());
}

// T (a gradient such as dy) on X's device, with X's shape and dtype.
inline void check_like_x(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  check_like(op, t, name, x, "x");
}

// A per-column parameter (weight, bias): None, or (N,) contiguous of a storage type on X's device.
inline void check_param(const char* op, const std::optional<at::Tensor>& p, const char* name, const at::Tensor& x) {
  if (!present(p)) return;
  TORCH_CHECK(p->device() == x.device(), op, ": ", name, " is on ", p->device(), " but x is on ", x.device());
  TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(1), op, ": ", name, " must have shape (", x.size(1),
              ",), got ", p->sizes());
  TORCH_CHECK(p->is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(is_float_type(p->scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
              p->scalar_type());
}

// ----------------------------------------------------------------- data for the vector loads ----

// Rows of VEC-element packs need an aligned base and every row start to stay aligned.
inline bool vectorizable(const void* ptr, int64_t row_stride, int64_t M, int64_t N, int vec) {
  return is_aligned(ptr, kMaxVecBytes) && N % vec == 0 && (M <= 1 || row_stride % vec == 0);
}

// A contiguous T itself when its data are 16-byte aligned, else an aligned copy (a fresh
// allocation always is).
inline at::Tensor aligned(const at::Tensor& t) {
  return is_aligned(t.data_ptr(), kMaxVecBytes) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// A checked parameter as the kernels read it, in its own dtype; undefined when absent.
inline at::Tensor aligned_param(const std::optional<at::Tensor>& p) { return present(p) ? aligned(*p) : at::Tensor(); }

// A checked parameter converted once to fp32 for the kernels; undefined when absent.
inline at::Tensor param_as_float(const std::optional<at::Tensor>& p) {
  return present(p) ? aligned(p->to(at::kFloat).contiguous()) : at::Tensor();
}

inline const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

inline float* float_ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// ---------------------------------------------------------------------------------- outputs ----

// A new (M, N) output like the rows X: contiguous, on X's device, in DTYPE (default X's).
inline at::Tensor empty_rows(const at::Tensor& x, std::optional<at::ScalarType> dtype = std::nullopt) {
  return at::empty({x.size(0), x.size(1)},
                   x.options().dtype(dtype.value_or(x.scalar_type())).memory_format(at::MemoryFormat::Contiguous));
}

// What an op returns in place of an output that was not asked for: empty(0) in X's dtype.
inline at::Tensor not_requested(const at::Tensor& x) { return at::empty({0}, x.options()); }

// The recomputed output of a backward: (M, N) like X when RECOMPUTE_OUTPUT, else not_requested.
inline at::Tensor recomputed_output(bool recompute_output, const at::Tensor& x) {
  return recompute_output ? empty_rows(x) : not_requested(x);
}

// The gradient of a per-column parameter P, summed over the rows of X: (N,) in P's dtype, zeros
// when X has no elements (a sum over nothing), not_requested when P is absent.
inline at::Tensor param_grad(const std::optional<at::Tensor>& p, const at::Tensor& x) {
  if (!present(p)) return not_requested(x);
  return x.numel() == 0 ? at::zeros({x.size(1)}, p->options()) : at::empty({x.size(1)}, p->options());
}

// ------------------------------------------------------------- elementwise tiles (gelu, gated) ----
// The elementwise kernels see their tensors as rows (M, N) with a row stride and unit column
// stride. A block of kTileThreads threads is (BX, BY): thread (tx, ty) owns one pack of VEC
// columns, pack p = blockIdx.x * BX + tx (columns [p * VEC, p * VEC + VEC)), of the rows
// blockIdx.y * BY + ty + k * G * BY, k = 0, 1, ... (G = gridDim.y row groups).

constexpr int kTileThreads = 256;      // threads a block, as (BX, BY) = (pack columns, rows)
constexpr int kTileMinBlocksPerSm = 4;  // __launch_bounds__: at most 64 registers a thread
constexpr int kTileGridBlocksPerSm = 8;  // grid target: column tiles * G ~ kTileGridBlocksPerSm * SMs

struct TileLaunch {
  dim3 grid;
  dim3 block;
};

// Block shape and grid for rows of NPR packs. BX: the next power of two for narrow rows (<= 32
// packs: a warp then covers 32 / BX whole row segments), else the one of 32..256 that pads the
// row least (ties: the wider). BY = kTileThreads / BX rows. G row groups: about BLOCKS_PER_SM
// blocks per SM in all, and no more than give every thread MIN_ROWS rows. Depends only on
// (M, NPR, SM count): a reduction over rows (GELU's dbias) has its summation order fixed by them.
inline TileLaunch plan_tiles(int64_t M, int npr, int sms, int blocks_per_sm, int min_rows) {
  int bx = 1;
  if (npr <= kWarpSize) {
    while (bx < npr) bx *= 2;
  } else {
    bx = kWarpSize;
    for (int c = kWarpSize * 2; c <= kTileThreads; c *= 2) {
      if (ceil_div(npr, c) * c <= ceil_div(npr, bx) * bx) bx = c;
    }
  }
  const int by = kTileThreads / bx;
  const int64_t tiles = ceil_div(npr, bx);
  int64_t groups = std::max<int64_t>(1, static_cast<int64_t>(blocks_per_sm) * sms / tiles);
  groups = std::min(groups, ceil_div(M, static_cast<int64_t>(by) * min_rows));
  groups = std::max<int64_t>(1, std::min<int64_t>(groups, 65535));
  return {dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(groups)), dim3(bx, by)};
}

// Calls f(std::integral_constant<Activation, A>{}) for the A of AS that equals ACTIVATION: the
// kernels are compiled for AS only.
template <Activation... As, typename F>
void dispatch_activation(Activation activation, F&& f) {
  const bool found = ((activation == As && (f(std::integral_constant<Activation, As>{}), true)) || ...);
  TORCH_CHECK(found, "internal error: no kernel compiled for activation ", static_cast<int>(activation));
}

// ----------------------------------------------------------------------------------- device ----

inline int sm_count(int device) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms, 1);
}

inline cudaStream_t current_stream(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

}  // namespace remat
