// The fp32 device math of the activations the elementwise kernels apply (gelu.cu, gated.cu): each
// as act(h) = h * g(h), the gate g and what the derivative needs besides it computed once, so a
// backward rebuilds act(h) bitwise as the forward wrote it. Every operation outside
// erff/tanhf/expf is an explicit _rn intrinsic: no contraction choices left to the compiler.
//
//   kGelu      g = Phi(h) = (1 + erf(h / sqrt 2)) / 2
//   kGeluTanh  g = (1 + t) / 2, t = tanh(u), u = sqrt(2/pi) (h + 0.044715 h^3)
//   kQuickGelu g = sigmoid(1.702 h)  (QuickGELU, as CLIP uses it)
//   kSilu      g = sigmoid(h)
//
// Derivatives (act'(h) = g + h g'(h)):
//   kGelu      Phi' = phi, phi(h) = exp(-h^2 / 2) / sqrt(2 pi):  act' = Phi(h) + h phi(h)
//   kGeluTanh  tanh' = 1 - t^2:  act' = (1 + t) / 2 + h (1 - t^2) / 2 * du/dh,
//              du/dh = sqrt(2/pi) (1 + 3 * 0.044715 h^2)
//   sigmoids   s = sigmoid(k h), s' = k s (1 - s):  act' = s + k h s (1 - s)  (k = 1.702 or 1)
// Large |h| stay finite: erff, tanhf and the sigmoid saturate at their limits, so g is 0 or 1.
#pragma once

#include <cuda_runtime.h>

namespace remat {

enum class Activation { kGelu, kGeluTanh, kQuickGelu, kSilu };

constexpr float kSqrtHalf = 0.70710678118654752440f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;
constexpr float kTanhCubic3 = 0.134145f;  // 3 * 0.044715
constexpr float kQuickGeluScale = 1.702f;

// s = sigmoid(z), and s (1 - s) in AUX, from e = exp(-|z|) in (0, 1], which never overflows:
// s = 1 / (1 + e) for z >= 0 and e / (1 + e) for z < 0, and s (1 - s) = e / (1 + e)^2 for either
// sign. Unlike 1 - s, neither cancels in the tails, and s saturates exactly at 0 or 1.
__device__ __forceinline__ float sigmoid_and_slope(float z, float& aux) {
  const float e = expf(-fabsf(z));
  const float r = __frcp_rn(__fadd_rn(1.f, e));
  const float er = __fmul_rn(e, r);
  aux = __fmul_rn(er, r);
  return z >= 0.f ? r : er;
}

// The gate g with act(h) = h * g; AUX receives what activation_derivative needs besides g: t =
// tanh(u) (kGeluTanh), s (1 - s) (the sigmoids) or 0 (kGelu). Dead code in a forward.
template <Activation A>
__device__ __forceinline__ float activation_gate(float h, float& aux) {
  if constexpr (A == Activation::kGeluTanh) {
    // h + 0.044715 h^3 = h (1 + 0.044715 h^2); h^2 = inf for |h| > ~1.8e19 gives u = +-inf, t = +-1.
    const float inner = __fmul_rn(h, __fmaf_rn(kTanhCubic, __fmul_rn(h, h), 1.f));
    const float t = tanhf(__fmul_rn(kSqrt2OverPi, inner));
    aux = t;
    return __fmul_rn(0.5f, __fadd_rn(1.f, t));
  } else if constexpr (A == Activation::kQuickGelu) {
    return sigmoid_and_slope(__fmul_rn(kQuickGeluScale, h), aux);
  } else if constexpr (A == Activation::kSilu) {
    return sigmoid_and_slope(h, aux);
  } else {
    aux = 0.f;
    return __fmul_rn(0.5f, __fadd_rn(1.f, erff(__fmul_rn(h, kSqrtHalf))));
  }
}

__device__ __forceinline__ float activation_value(float h, float g) { return __fmul_rn(h, g); }

// act'(h) from activation_gate's (g, aux); the derivation is at the top of this file.
template <Activation A>
__device__ __forceinline__ float activation_derivative(float h, float g, float aux) {
  if constexpr (A == Activation::kGeluTanh) {
    // sech^2(u) = 1 - t^2, exactly 0 once tanhf saturates (|u| > ~9). There the slope term is 0,
    // also where du/dh overflows (|h| > ~1.8e19: 0 * inf would be NaN), hence the select; its
    // other side adds 0 * h so that h = +-inf still gives NaN, as PyTorch's gelu backward does.
    const float sech2 = __fmaf_rn(-aux, aux, 1.f);
    const float du_dh = __fmul_rn(kSqrt2OverPi, __fmaf_rn(kTanhCubic3, __fmul_rn(h, h), 1.f));
    const float slope = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, h), sech2), du_dh);
    return sech2 > 0.f ? __fadd_rn(g, slope) : __fmaf_rn(0.f, h, g);
  } else if constexpr (A == Activation::kQuickGelu) {
    // Where s (1 - s) underflows to 0 the second term is 0 (h finite; h = +-inf gives NaN).
    return __fadd_rn(g, __fmul_rn(h, __fmul_rn(aux, kQuickGeluScale)));
  } else if constexpr (A == Activation::kSilu) {
    return __fadd_rn(g, __fmul_rn(h, aux));
  } else {
    // phi(h) = exp(-h^2 / 2) / sqrt(2 pi) underflows to 0 for |h| > ~14 (h^2 = inf included),
    // where h * phi(h) = 0 and gelu'(h) = Phi(h).
    const float pdf = __fmul_rn(expf(__fmul_rn(-0.5f, __fmul_rn(h, h))), kInvSqrt2Pi);
    return __fmaf_rn(h, pdf, g);
  }
}

}  // namespace remat
