// GELU (exact erf, or tanh approximation) with an optional fused bias: CUDA launchers (csrc/gelu.cu).
// Tensor contract: see the schemas in csrc/ops.cpp and remat/ops/gelu.py (gelu_fwd_ref, gelu_bwd_ref).
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace remat {

// x (M, N) float32/float16/bfloat16 with stride(1) == 1 and any row stride; bias None or (N,)
// float32/float16/bfloat16; approximate "none" (erf) or "tanh".
// Returns y = gelu(x + bias), (M, N) contiguous in x.dtype.
at::Tensor gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view approximate);

// dy (M, N) in x.dtype, stride(1) == 1, its own row stride; x, bias, approximate as gelu_fwd.
// Returns dx (M, N) contiguous in x.dtype; dbias (N,) in bias.dtype (empty(0) of x.dtype without
// bias), summed over rows in fp32 from dy * gelu'(x + bias) before rounding; y (M, N) bitwise as
// gelu_fwd wrote it when recompute_output (else empty(0) of x.dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                        const std::optional<at::Tensor>& bias,
                                                        c10::string_view approximate, bool recompute_output);

}  // namespace remat
