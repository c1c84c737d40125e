// Host-side helpers shared by the op families (csrc/*.cu): argument checks whose errors name the
// op family and the argument, parameters prepared for the kernels' vector loads, output
// allocation, and device queries. Device-side code lives in common.cuh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

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

// T (a gradient such as dy) on X's device, with X's shape and dtype.
inline void check_like_x(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": ", name, " must have x's shape ", x.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(),
              ", got ", t.scalar_type());
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

// A new (M, N) output like the rows X: contiguous, X's dtype and device.
inline at::Tensor empty_rows(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(1)}, x.options().memory_format(at::MemoryFormat::Contiguous));
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
