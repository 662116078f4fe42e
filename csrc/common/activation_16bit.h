// GELU for elementwise kernels and GEMM epilogues whose result is stored in a 16-bit type, and
// SiLU and sigmoid for all result types. Torch-free: included by kernel translation units and by
// a host test driver.
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
// sigmoid(x) = 1 / (1 + 2^(-x log2 e)) from the hardware exp2 and reciprocal, where expf and an
// IEEE division take ~15 instructions; silu(x) = x sigmoid(x). Their derivatives take
// 1 - sigmoid(x) without cancellation, which 1 - s computed from s does not. For 16-bit
// results the exponent is x log2 e rounded to fp32 (relative error up to 1.8e-6 at |x| = 30, far
// below a 16-bit unit). For fp32 results its rounding error is added back to first order (three
// FMAs and a select), which leaves a few roundings and the exp2's and reciprocal's own errors,
// ~5e-7 in all: a few fp32 units where expf and the division give one or two. With the exact
// forms fp32 bias+SiLU ran 3% slower than bias+ReLU (bench/NOTES.md section 78).
//
// fp32 GELU keeps the erff form of common/activation.h: the polynomial's relative error in the
// tail (9e-5) is far above fp32's rounding.
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
constexpr float kLog2ELow = 1.92596298909109e-08f;          // log2(e) - kLog2E
constexpr float kLn2 = 0.69314718055994530942f;             // ln(2)
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

// 2^(-x log2 e) = e^-x. kRefined (fp32 results): t = x * -kLog2E is rounded, and its error
// t_lo (exact from an FMA, plus x times the constant's own error) is put back as
// 2^t (1 + t_lo ln 2); not for |x| >= 128, where the result is 0 or inf either way and t_lo
// would be NaN for an infinite x (NaN stays NaN: the comparison is false).
template <bool kRefined>
CE_HOST_DEVICE float exp_neg_fast(float x) {
  const float t = x * -kLog2E;
  const float e = exp2_fast(t);
  if constexpr (kRefined) {
    const float t_lo = fmaf(x, -kLog2ELow, fmaf(x, -kLog2E, -t));
    return fabsf(x) < 128.f ? fmaf(e, t_lo * kLn2, e) : e;
  } else {
    return e;
  }
}

// sigmoid(x) and 1 - sigmoid(x), the latter as e^-x sigmoid(x) for x >= 0, where 1 - s would
// cancel (s rounds to 1 from x ~ 16.6, and s (1 - s) to 0). s is 0 for x = -inf (and below
// ~-87.3 on the GPU, where s would be subnormal and the reciprocal flushes it), 1 for +inf, NaN
// for NaN.
struct SigmoidPair {
  float s, one_minus_s;
};
template <bool kRefined>
CE_HOST_DEVICE SigmoidPair sigmoid_pair_fast(float x) {
  const float e = exp_neg_fast<kRefined>(x);
  const float s = reciprocal_fast(1.f + e);
  return {s, x >= 0.f ? e * s : 1.f - s};
}

// (The unused 1 - s of the pair is dropped by the compiler.)
template <bool kRefined>
CE_HOST_DEVICE float sigmoid_fast(float x) { return sigmoid_pair_fast<kRefined>(x).s; }

template <bool kRefined>
CE_HOST_DEVICE float silu_fast(float x) { return x * sigmoid_fast<kRefined>(x); }

template <bool kRefined>
CE_HOST_DEVICE float sigmoid_fast_backward(float dy, float z) {
  const SigmoidPair p = sigmoid_pair_fast<kRefined>(z);
  return dy * p.s * p.one_minus_s;
}

template <bool kRefined>
CE_HOST_DEVICE float silu_fast_backward(float dy, float z) {
  const SigmoidPair p = sigmoid_pair_fast<kRefined>(z);
  return dy * p.s * fmaf(z, p.one_minus_s, 1.f);
}

// The activation of a kernel that stores T, and its derivative times dy. `saved` is the
// activation's output y for relu (y > 0 iff z > 0) and its input z for the others; none ignores
// it. SiLU and sigmoid take the exp2 forms above (refined where T is wider than 16 bits), GELU too
// where T is a 16-bit type; fp32 GELU and GELU-tanh keep common/activation.h's forms.
template <class T>
CE_HOST_DEVICE float forward_for(int kind, float x) {
  constexpr bool k16Bit = sizeof(T) == 2;
  switch (kind) {
    case int(Activation::kRelu): return relu(x);
    case int(Activation::kGelu): return k16Bit ? gelu_16bit(x) : gelu(x);
    case int(Activation::kGeluTanh): return gelu_tanh(x);
    case int(Activation::kSilu): return silu_fast<!k16Bit>(x);
    case int(Activation::kSigmoid): return sigmoid_fast<!k16Bit>(x);
    default: return x;
  }
}

template <class T>
CE_HOST_DEVICE float backward_for(int kind, float dy, float saved) {
  constexpr bool k16Bit = sizeof(T) == 2;
  switch (kind) {
    case int(Activation::kRelu): return saved > 0.f ? dy : 0.f;
    case int(Activation::kGelu): return k16Bit ? gelu_16bit_backward(dy, saved) : gelu_backward(dy, saved);
    case int(Activation::kGeluTanh): return gelu_tanh_backward(dy, saved);
    case int(Activation::kSilu): return silu_fast_backward<!k16Bit>(dy, saved);
    case int(Activation::kSigmoid): return sigmoid_fast_backward<!k16Bit>(dy, saved);
    default: return dy;
  }
}

}  // namespace act
}  // namespace cutlass_ext
