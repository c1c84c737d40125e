// LayerNorm over the last dim of a 2-D tensor: CUDA launchers (csrc/layer_norm.cu).
// Tensor contract: see the schemas in csrc/ops.cpp and remat/ops/layer_norm.py.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace remat {

// x (M, N) float32/float16/bfloat16 with stride(1) == 1; weight, bias: None or (N,), float32 or
// x's dtype (both the same), read in that dtype.
// Returns y (M, N) contiguous in x.dtype, mean (M,) and rstd (M,) in float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps);

// dy, x (M, N) in x.dtype; mean, rstd (M,) float32 from layer_norm_fwd.
// Returns dx (M, N) contiguous, dw (N,) in weight.dtype (or empty(0) without weight),
// db (N,) in bias.dtype (or empty(0) without bias), y (M, N) as layer_norm_fwd wrote it when
// recompute_output (else empty(0)).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    bool recompute_output);

}  // namespace remat
