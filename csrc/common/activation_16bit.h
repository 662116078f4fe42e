// GELU, SiLU and sigmoid for elementwise kernels whose result is stored in a 16-bit type.
// Torch-free: included by kernel translation units and by a host test driver.
//
// GELU (the erf form): gelu(x) = x * Phi(x), Phi the standard normal CDF. The fp32 formula
// 0.5 x (1 + erff(x / sqrt 2)) costs ~25 instructions an element (erff's two polynomials selected
// per element, then exp2), which made a bias+GELU+residual kernel issue-bound short of copy speed
// on Hopper (bench/NOTES.md section 41). Here Phi(-t) = exp2(q(t)) for t = |x|, q a degree-8
// polynomial fitted to log2 Phi(-t) on [0, 6] (below), and Phi(x) = 1 - Phi(-x) for x >= 0: one
// abs, eight FMAs, one exp2 and three more, ~13 instructions. Its error is far below a 16-bit
// type's rounding (bf16: 2^-9, fp16: 2^-12 relative), and in the negative tail far below the fp32
// formula's, where 1 + erff cancels (relative error ~0.5 at x = -5.5). The polynomial decreases
// on [0, inf), so Phi(-t) falls to 0 past the fitted range (torch's fp32 formula returns 0 from
// x ~ -5.5); +inf gives +inf, and -inf and NaN give NaN, as that formula does.
//
// sigmoid(x) = 1 / (1 + 2^(-x log2 e)) from the hardware exp2 and reciprocal (relative error
// ~2^-21), where expf and an IEEE division take ~15 instructions; silu(x) = x sigmoid(x). Their
// derivatives take 1 - sigmoid(x) without cancellation, which the fp32 forms do not.
//
// fp32 results keep the exact forms of common/activation.h.
#pragma once

#include <cmath>

#include "common/activation.h"

namespace cutlass_ext {
namespace act {

// log2 Phi(-t) = -1 + t (c1 + t (c2 + ... + t c8)): c1..c8, fitted on [0, 6] in fp32 FMAs for the
// least maximum of |error in log2 Phi(-t)| * max(Phi(-t), 1e-3): Phi's absolute error stays below
// 1.3e-7 (what a sum of many derivatives, a bias gradient, accumulates; erff's is ~1e-7) and its
// relative error below 9e-5 in the tail. tests/cpp/activation_16bit_driver.cpp checks both
// against float64.
constexpr float kLogTailC1 = -1.1511133909225464f;
constexpr float kLogTailC2 = -0.4591207504272461f;
constexpr float kLogTailC3 = -0.05279446765780449f;
constexpr float kLogTailC4 = 0.00751905282959342f;
constexpr float kLogTailC5 = -0.0004894990124739707f;
constexpr float kLogTailC6 = -4.365656786831096e-05f;
constexpr float kLogTailC7 = 1.0841226867341902e-05f;
constexpr float kLogTailC8 = -6.041146320967528e-07f;
constexpr float kLog2E = 1.44269504088896340736f;           // log2(e)
constexpr float kHalfLog2E = 0.72134752044448170368f;       // log2(e) / 2
constexpr float kLog2Sqrt2Pi = 1.32574806473616378838f;     // log2(sqrt(2 pi))

// 2^x: the hardware approximation on the GPU (relative error ~2^-22, subnormal results flushed
// to 0), exp2f on the host.
CE_HOST_DEVICE float exp2_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// 1 / x: the hardware approximation on the GPU (relative error ~2^-23, subnormal results flushed
// to 0), a division on the host.
CE_HOST_DEVICE float reciprocal_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f / x;
#endif
}

// Phi(-t) for t >= 0 (NaN for NaN, 0 for +inf).
CE_HOST_DEVICE float normal_tail(float t) {
  float q = fmaf(kLogTailC8, t, kLogTailC7);
  q = fmaf(q, t, kLogTailC6);
  q = fmaf(q, t, kLogTailC5);
  q = fmaf(q, t, kLogTailC4);
  q = fmaf(q, t, kLogTailC3);
  q = fmaf(q, t, kLogTailC2);
  q = fmaf(q, t, kLogTailC1);
  return exp2_fast(fmaf(q, t, -1.f));
}

CE_HOST_DEVICE float normal_cdf_16bit(float x) {
  const float h = normal_tail(fabsf(x));
  return x >= 0.f ? 1.f - h : h;
}

CE_HOST_DEVICE float gelu_16bit(float x) { return x * normal_cdf_16bit(x); }

// dy * d gelu / dz = dy * (Phi(z) + z phi(z)), phi(z) = 2^(-z^2 log2(e) / 2 - log2 sqrt(2 pi)).
CE_HOST_DEVICE float gelu_16bit_backward(float dy, float z) {
  const float pdf = exp2_fast(fmaf(z * z, -kHalfLog2E, -kLog2Sqrt2Pi));
  return dy * fmaf(z, pdf, normal_cdf_16bit(z));
}

// sigmoid(x) and 1 - sigmoid(x), the latter as 2^(-x log2 e) sigmoid(x) for x >= 0, where
// 1 - s would cancel (s rounds to 1 from x ~ 16.6, and s (1 - s) to 0). s is 0 for x = -inf (and
// below ~-88, where 2^(-x log2 e) overflows), 1 for +inf, NaN for NaN.
struct SigmoidPair {
  float s, one_minus_s;
};
CE_HOST_DEVICE SigmoidPair sigmoid_pair_16bit(float x) {
  const float e = exp2_fast(x * -kLog2E);
  const float s = reciprocal_fast(1.f + e);
  return {s, x >= 0.f ? e * s : 1.f - s};
}

// (The unused 1 - s of the pair is dropped by the compiler.)
CE_HOST_DEVICE float sigmoid_16bit(float x) { return sigmoid_pair_16bit(x).s; }

CE_HOST_DEVICE float silu_16bit(float x) { return x * sigmoid_16bit(x); }

CE_HOST_DEVICE float sigmoid_16bit_backward(float dy, float z) {
  const SigmoidPair p = sigmoid_pair_16bit(z);
  return dy * p.s * p.one_minus_s;
}

CE_HOST_DEVICE float silu_16bit_backward(float dy, float z) {
  const SigmoidPair p = sigmoid_pair_16bit(z);
  return dy * p.s * fmaf(z, p.one_minus_s, 1.f);
}

// act::forward / act::backward for a kernel that stores T: GELU, SiLU and sigmoid take the forms
// above where T is a 16-bit type.
template <class T>
CE_HOST_DEVICE float forward_for(int kind, float x) {
  if constexpr (sizeof(T) == 2) {
    if (kind == int(Activation::kGelu)) return gelu_16bit(x);
    if (kind == int(Activation::kSilu)) return silu_16bit(x);
    if (kind == int(Activation::kSigmoid)) return sigmoid_16bit(x);
  }
  return forward(kind, x);
}

template <class T>
CE_HOST_DEVICE float backward_for(int kind, float dy, float saved) {
  if constexpr (sizeof(T) == 2) {
    if (kind == int(Activation::kGelu)) return gelu_16bit_backward(dy, saved);
    if (kind == int(Activation::kSilu)) return silu_16bit_backward(dy, saved);
    if (kind == int(Activation::kSigmoid)) return sigmoid_16bit_backward(dy, saved);
  }
  return backward(kind, dy, saved);
}

}  // namespace act
}  // namespace cutlass_ext
