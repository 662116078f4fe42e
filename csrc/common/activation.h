// Activation functions shared by the GEMM epilogues and the elementwise kernels.
// Torch-free: included by kernel translation units and by the host binding.
#pragma once

#include <cmath>

#include "common/types.h"

namespace cutlass_ext {

// The integer codes are part of the Python <-> C++ contract: cutlass_ext/ops/_activation.py lists
// the names in this order, and the binding exports activation_names() so a test can compare them.
enum class Activation : int { kNone = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3, kSilu = 4, kSigmoid = 5 };
constexpr int kNumActivations = 6;
constexpr const char* kActivationNames[kNumActivations] = {"none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid"};

namespace act {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kTanhBeta = 0.79788456080286535588f;  // sqrt(2/pi)
constexpr float kTanhKappa = 0.044715f;

// relu keeps NaN (as torch.relu does): NaN < 0 is false.
CE_HOST_DEVICE float relu(float x) { return x < 0.f ? 0.f : x; }
CE_HOST_DEVICE float gelu(float x) { return 0.5f * x * (1.f + erff(x * kInvSqrt2)); }
CE_HOST_DEVICE float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(kTanhBeta * (x + kTanhKappa * x * x * x)));
}
CE_HOST_DEVICE float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
CE_HOST_DEVICE float silu(float x) { return x * sigmoid(x); }

CE_HOST_DEVICE float forward(int kind, float x) {
  switch (kind) {
    case int(Activation::kRelu): return relu(x);
    case int(Activation::kGelu): return gelu(x);
    case int(Activation::kGeluTanh): return gelu_tanh(x);
    case int(Activation::kSilu): return silu(x);
    case int(Activation::kSigmoid): return sigmoid(x);
    default: return x;
  }
}

// d act / d z times dy. `saved` is the activation output y for relu (y > 0 iff z > 0) and the
// pre-activation z for gelu, gelu_tanh, silu and sigmoid; it is unused for kNone.
CE_HOST_DEVICE float backward(int kind, float dy, float saved) {
  switch (kind) {
    case int(Activation::kRelu): return saved > 0.f ? dy : 0.f;
    case int(Activation::kGelu): {
      const float cdf = 0.5f * (1.f + erff(saved * kInvSqrt2));
      const float pdf = kInvSqrt2Pi * expf(-0.5f * saved * saved);
      return dy * (cdf + saved * pdf);
    }
    case int(Activation::kGeluTanh): {
      const float z2 = saved * saved;
      const float t = tanhf(kTanhBeta * (saved + kTanhKappa * z2 * saved));
      const float dinner = kTanhBeta * (1.f + 3.f * kTanhKappa * z2);
      return dy * (0.5f * (1.f + t) + 0.5f * saved * (1.f - t * t) * dinner);
    }
    case int(Activation::kSilu): {
      const float s = sigmoid(saved);
      return dy * s * (1.f + saved * (1.f - s));
    }
    case int(Activation::kSigmoid): {
      const float s = sigmoid(saved);
      return dy * s * (1.f - s);
    }
    default: return dy;
  }
}

// Whether the backward needs the activation's input z (stored as an auxiliary GEMM output),
// rather than its output y (relu) or nothing (none).
constexpr bool needs_preactivation(int kind) {
  return kind == int(Activation::kGelu) || kind == int(Activation::kGeluTanh) ||
         kind == int(Activation::kSilu) || kind == int(Activation::kSigmoid);
}

}  // namespace act
}  // namespace cutlass_ext
