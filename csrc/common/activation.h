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
// GELU's exact derivative, for the kernels that keep the erff form (fp32 results). SiLU and
// sigmoid have no exact forms here: every kernel takes the exp2 forms of activation_16bit.h
// through act::forward_for / act::backward_for, which also dispatch the forms above.
CE_HOST_DEVICE float gelu_backward(float dy, float z) {
  const float cdf = 0.5f * (1.f + erff(z * kInvSqrt2));
  const float pdf = kInvSqrt2Pi * expf(-0.5f * z * z);
  return dy * (cdf + z * pdf);
}

CE_HOST_DEVICE float gelu_tanh_backward(float dy, float z) {
  const float z2 = z * z;
  const float t = tanhf(kTanhBeta * (z + kTanhKappa * z2 * z));
  const float dinner = kTanhBeta * (1.f + 3.f * kTanhKappa * z2);
  return dy * (0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * dinner);
}

// Whether the backward needs the activation's input z (stored as an auxiliary GEMM output),
// rather than its output y (relu) or nothing (none).
constexpr bool needs_preactivation(int kind) {
  return kind == int(Activation::kGelu) || kind == int(Activation::kGeluTanh) ||
         kind == int(Activation::kSilu) || kind == int(Activation::kSigmoid);
}

}  // namespace act
}  // namespace cutlass_ext
