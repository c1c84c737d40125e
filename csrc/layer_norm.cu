// LayerNorm forward and backward (with optional recomputation of the output) over the last dim of
// a 2-D tensor: the entry points of torch.ops.remat_C.layer_norm_fwd / _bwd and their registration.
// The kernels (shared with RMSNorm, a mode of them) are in norm_kernels.cuh.

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"
#include "host.h"
#include "norm_kernels.cuh"

namespace remat {
namespace {

// x (M, N) float32/float16/bfloat16 with stride(1) == 1; weight, bias: None or (N,), float32 or
// x's dtype (both the same), read in that dtype.
// Returns y (M, N) contiguous in x.dtype, mean (M,) and rstd (M,) in float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps) {
  check_input(kLayerNorm, x, "x");
  check_param(kLayerNorm, weight, "weight", x);
  check_param(kLayerNorm, bias, "bias", x);
  check_param_dtypes(weight, bias, x);
  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = empty_rows(x);
  at::Tensor mean = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {y, mean, rstd};

  const at::Tensor w = aligned_param(weight);
  const at::Tensor b = aligned_param(bias);
  const FwdArgs args{x.data_ptr(), ptr_or_null(w), ptr_or_null(b), y.data_ptr(),
                     mean.data_ptr<float>(), rstd.data_ptr<float>(), M, static_cast<int>(N),
                     1.f / static_cast<float>(N), x.stride(0), static_cast<float>(eps), false};
  cudaStream_t stream = current_stream(x);
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_layer_norm_fwd", [&] {
    dispatch_param_type<scalar_t>(param_type(weight, bias, x), [&](auto pt) {
      run_fwd<scalar_t, decltype(pt), LayerNormMode<scalar_t>>(args, x, stream);
    });
  });
  return {y, mean, rstd};
}

// dy, x (M, N) in x.dtype; mean, rstd (M,) float32 from layer_norm_fwd.
// Returns dx (M, N) contiguous, dw (N,) in weight.dtype (or empty(0) without weight),
// db (N,) in bias.dtype (or empty(0) without bias), y (M, N) as layer_norm_fwd wrote it when
// recompute_output (else empty(0)).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    bool recompute_output) {
  check_input(kLayerNorm, x, "x");
  check_input(kLayerNorm, dy, "dy");
  check_like_x(kLayerNorm, dy, "dy", x);
  check_param(kLayerNorm, weight, "weight", x);
  check_param(kLayerNorm, bias, "bias", x);
  check_stat(kLayerNorm, mean, "mean", x);
  check_stat(kLayerNorm, rstd, "rstd", x);
  check_param_dtypes(weight, bias, x);

  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = empty_rows(x);
  at::Tensor y = recomputed_output(recompute_output, x);
  at::Tensor dw = param_grad(weight, x);
  at::Tensor db = param_grad(bias, x);
  if (M == 0) return {dx, dw, db, y};

  const at::Tensor w = aligned_param(weight);
  const at::Tensor b = aligned_param(bias);
  const BwdArgs args{dy.data_ptr(), x.data_ptr(), ptr_or_null(w), ptr_or_null(b),
                     mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                     recompute_output ? y.data_ptr() : nullptr, M, static_cast<int>(N),
                     1.f / static_cast<float>(N), dy.stride(0), x.stride(0), false};
  cudaStream_t stream = current_stream(x);
  Partials parts;
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_layer_norm_bwd", [&] {
    dispatch_param_type<scalar_t>(param_type(weight, bias, x), [&](auto pt) {
      parts = run_bwd<scalar_t, decltype(pt), LayerNormMode<scalar_t>>(args, x, dy, recompute_output,
                                                                        present(weight), present(bias), stream);
    });
  });
  sum_partial_rows(parts.dw, dw, parts.db, db, stream);  // dw and db in one launch
  return {dx, dw, db, y};
}

}  // namespace
}  // namespace remat

// Registration: the schemas (tensor contract above and in remat/ops/layer_norm.py) and their CUDA
// kernels. The fake kernels and autograd are registered from Python.
TORCH_LIBRARY_FRAGMENT(remat_C, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "bool recompute_output) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("layer_norm_fwd", &remat::layer_norm_fwd);
  m.impl("layer_norm_bwd", &remat::layer_norm_bwd);
}
