// RMSNorm forward and backward (with optional recomputation of the output) over the last dim of a
// 2-D tensor, rounded as each stock module rounds (the styles): the entry points of
// torch.ops.remat_C.rms_norm_fwd / _bwd and their registration. The kernels are LayerNorm's in
// their RMS mode (norm_kernels.cuh).

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include "common.cuh"
#include "host.h"
#include "norm_kernels.cuh"

namespace remat {
namespace {

enum class RmsStyle { kTorch, kLlama, kGemma, kT5 };

constexpr std::pair<const char*, RmsStyle> kRmsStyles[] = {
    {"torch", RmsStyle::kTorch}, {"llama", RmsStyle::kLlama}, {"gemma", RmsStyle::kGemma}, {"t5", RmsStyle::kT5}};

// How a style's stock module rounds y, every product in fp32 (the rounding of xhat to a 16-bit
// type and the product of two 16-bit values are exact in fp32, so one rounding of the fp32
// product to y's type is the stock module's):
//   torch  torch.nn.RMSNorm / F.rms_norm: y = (xhat * w) cast to x's dtype.
//   llama  LlamaRMSNorm: xhat cast to x's dtype, then w * that in the promoted dtype of w and x.
//   gemma  GemmaRMSNorm: y = (xhat * (1 + w)) cast to x's dtype, 1 + w formed in fp32.
//   t5     T5LayerNorm: xhat cast to w's dtype when that is 16-bit, then w * that, in w's dtype.
struct RmsRounding {
  at::ScalarType normed;  // xhat is rounded to this before the weight multiply (float: not rounded)
  at::ScalarType y;       // y's dtype, and dy's
  bool weight_plus_one;   // scale by 1 + w instead of w
};

RmsRounding rms_rounding(RmsStyle style, const at::Tensor& x, const std::optional<at::Tensor>& weight) {
  const at::ScalarType x_type = x.scalar_type();
  if (!present(weight)) return {at::kFloat, x_type, false};  // style "torch" (check_weight_required)
  const at::ScalarType w_type = weight->scalar_type();
  switch (style) {
    case RmsStyle::kLlama:
      return {x_type, c10::promoteTypes(x_type, w_type), false};
    case RmsStyle::kGemma:
      return {at::kFloat, x_type, true};
    case RmsStyle::kT5:
      return {w_type, w_type, false};  // rounding to an fp32 weight's dtype is no rounding
    case RmsStyle::kTorch:
    default:
      return {at::kFloat, x_type, false};
  }
}

void check_weight_required(RmsStyle style, c10::string_view name, const std::optional<at::Tensor>& weight) {
  TORCH_CHECK(present(weight) || style == RmsStyle::kTorch, kRmsNorm, ": weight is required for style '",
              std::string(name.data(), name.size()), "' (its stock module always has one)");
}

void check_eps(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, kRmsNorm, ": eps must be a non-negative float, got ", eps);
}

// The RMSNorm weight as the kernels read it: in its own dtype when that is fp32 or x's, else
// converted once to fp32 (exact); undefined when absent.
at::Tensor rms_weight(const std::optional<at::Tensor>& weight, const at::Tensor& x) {
  if (!present(weight)) return at::Tensor();
  const at::ScalarType type = weight->scalar_type();
  return type == at::kFloat || type == x.scalar_type() ? aligned(*weight) : param_as_float(weight);
}

// Calls f(PT{}, Mode{}) for the RMSNorm kernels of x type T that round as R, with PT the storage
// type of the weight as rms_weight gives it (W_TYPE: fp32 or x's). Only the combinations
// rms_rounding produces are compiled: per 16-bit x type six, per fp32 x three.
template <typename T, typename F>
void dispatch_rms_mode(at::ScalarType w_type, const RmsRounding& r, F&& f) {
  constexpr at::ScalarType kX = c10::CppTypeToScalarType<T>::value;
  auto weight_is = [&](at::ScalarType expected) {
    TORCH_CHECK(w_type == expected, "internal error: rms_norm weight read as ", w_type, ", expected ", expected);
  };
  if (r.y == kX && r.normed == at::kFloat) {  // torch, gemma; every style on fp32 x with an fp32 y
    dispatch_param_type<T>(w_type, [&](auto pt) { f(pt, NormMode<true, T>{}); });
  } else if (r.y == kX) {  // llama, t5 with a weight of x's 16-bit dtype: xhat rounded to it
    weight_is(kX);
    f(T{}, NormMode<true, T, T>{});
  } else if (r.y == at::kFloat) {  // 16-bit x, a weight of another dtype: llama (xhat rounded), t5
    weight_is(at::kFloat);
    if (r.normed == at::kFloat) f(float{}, NormMode<true, float>{});
    else f(float{}, NormMode<true, float, T>{});
  } else {  // t5 with a 16-bit weight of another dtype than x: xhat and y in the weight's dtype
    weight_is(at::kFloat);
    auto in_weight_type = [&](auto out) {
      using Out = decltype(out);
      if constexpr (std::is_same_v<Out, T>) {
        TORCH_CHECK(false, "internal error: rms_norm y in x's dtype reached the other-dtype kernels");
      } else {
        f(float{}, NormMode<true, Out, Out>{});
      }
    };
    if (r.y == at::kBFloat16) in_weight_type(c10::BFloat16{});
    else in_weight_type(c10::Half{});
  }
}

// =============================================================================================
// Entry points (the CUDA kernels of the ops registered at the end of this file)
// =============================================================================================

// x (M, N) float32/float16/bfloat16 with stride(1) == 1; weight None (style "torch" only) or (N,)
// of any of those dtypes; eps a finite float >= 0; style "torch", "llama", "gemma" or "t5"
// (rms_rounding). Returns y (M, N) contiguous in the style's y dtype (x's, but for "llama" and
// "t5" with a weight of another dtype) and rstd (M,) float32.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                double eps, c10::string_view style) {
  const RmsStyle s = parse_choice(kRmsNorm, "style", style, kRmsStyles);
  check_input(kRmsNorm, x, "x");
  check_param(kRmsNorm, weight, "weight", x);
  check_weight_required(s, style, weight);
  check_eps(eps);
  const RmsRounding r = rms_rounding(s, x, weight);
  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = empty_rows(x, r.y);
  at::Tensor rstd = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {y, rstd};

  const at::Tensor w = rms_weight(weight, x);
  const FwdArgs args{x.data_ptr(), ptr_or_null(w), nullptr, y.data_ptr(), nullptr, rstd.data_ptr<float>(), M,
                     static_cast<int>(N), 1.f / static_cast<float>(N), x.stride(0), static_cast<float>(eps),
                     r.weight_plus_one};
  cudaStream_t stream = current_stream(x);
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_rms_norm_fwd", [&] {
    dispatch_rms_mode<scalar_t>(w.defined() ? w.scalar_type() : x.scalar_type(), r, [&](auto pt, auto mode) {
      run_fwd<scalar_t, decltype(pt), decltype(mode)>(args, x, stream);
    });
  });
  return {y, rstd};
}

// dy (M, N) in the style's y dtype; x, weight, style as rms_norm_fwd; rstd (M,) float32 from it.
// Returns dx (M, N) contiguous in x.dtype; dw (N,) in weight.dtype (empty(0) of x.dtype without a
// weight), summed over rows in a fixed order; y (M, N) bitwise as rms_norm_fwd wrote it when
// recompute_output (else empty(0) of y's dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                            const std::optional<at::Tensor>& weight,
                                                            const at::Tensor& rstd, c10::string_view style,
                                                            bool recompute_output) {
  const RmsStyle s = parse_choice(kRmsNorm, "style", style, kRmsStyles);
  check_input(kRmsNorm, x, "x");
  check_input(kRmsNorm, dy, "dy");
  check_shape_like(kRmsNorm, dy, "dy", x, "x");
  check_param(kRmsNorm, weight, "weight", x);
  check_weight_required(s, style, weight);
  check_stat(kRmsNorm, rstd, "rstd", x);
  const RmsRounding r = rms_rounding(s, x, weight);
  TORCH_CHECK(dy.scalar_type() == r.y, kRmsNorm, ": dy must have y's dtype ", r.y, ", got ", dy.scalar_type());

  const int64_t M = x.size(0);
  const int64_t N = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = empty_rows(x);
  at::Tensor y = recompute_output ? empty_rows(x, r.y) : at::empty({0}, x.options().dtype(r.y));
  at::Tensor dw = param_grad(weight, x);
  if (M == 0) return {dx, dw, y};

  const at::Tensor w = rms_weight(weight, x);
  const BwdArgs args{dy.data_ptr(), x.data_ptr(), ptr_or_null(w), nullptr, nullptr, rstd.data_ptr<float>(),
                     dx.data_ptr(), recompute_output ? y.data_ptr() : nullptr, M, static_cast<int>(N),
                     1.f / static_cast<float>(N), dy.stride(0), x.stride(0), r.weight_plus_one};
  cudaStream_t stream = current_stream(x);
  Partials parts;
  REMAT_DISPATCH_FLOAT_TYPES(x.scalar_type(), "remat_rms_norm_bwd", [&] {
    dispatch_rms_mode<scalar_t>(w.defined() ? w.scalar_type() : x.scalar_type(), r, [&](auto pt, auto mode) {
      parts = run_bwd<scalar_t, decltype(pt), decltype(mode)>(args, x, dy, recompute_output, present(weight),
                                                              /*need_db=*/false, stream);
    });
  });
  if (present(weight)) sum_partial_rows(parts.dw, dw, stream);
  return {dx, dw, y};
}

}  // namespace
}  // namespace remat

// Registration: the schemas (tensor contract above and in remat/ops/rms_norm.py) and their CUDA
// kernels. The fake kernels and autograd are registered from Python.
TORCH_LIBRARY_FRAGMENT(remat_C, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, float eps, str style) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, str style, bool recompute_output) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(remat_C, CUDA, m) {
  m.impl("rms_norm_fwd", &remat::rms_norm_fwd);
  m.impl("rms_norm_bwd", &remat::rms_norm_bwd);
}
