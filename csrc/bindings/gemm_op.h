// The GEMM entry point of the host bindings (defined in gemm.cpp): layouts from strides, kernel
// selection, workspace and launch. Every GEMM-shaped op (linear, matmul, their backward, LoRA)
// goes through gemm_op.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

namespace cutlass_ext {

// How GEMMs run, from torch's fp32 precision setting and the benchmark overrides.
struct GemmOptions {
  bool exact_f32 = false;  // fp32 on the FMA units (precision "highest") rather than TF32
  std::string config;      // CUTLASS_EXT_GEMM_CONFIG: force one config by name
  int swizzle = 0;         // CUTLASS_EXT_GEMM_SWIZZLE: 1, 2, 4 or 8; 0 = heuristic
  int raster = 0;          // CUTLASS_EXT_GEMM_RASTER: along_m (1) or along_n (2); 0 = CUTLASS's heuristic
  int gemm_arch = 0;       // CUTLASS_EXT_GEMM_ARCH: 90 or 80 (Ampere kernels, also on Hopper); 0 = the GPU's
};

GemmOptions gemm_options();

// What the epilogue does beyond bias and activation.
struct GemmExtra {
  float alpha = 1.f;  // scales A @ B (and A2 @ B2)
  at::Tensor c;       // when defined, added (beta = 1): shaped like the product
  at::Tensor out;     // when defined, D is written here (it may be `c`: an in-place update)
  // When defined, a second product A2 @ B2 ([M, K2] @ [K2, N]) is added to A @ B: inside the
  // same K loop where an extended-K kernel serves the call, else computed first and accumulated
  // as C. Not combined with `c`.
  at::Tensor a2, b2;
  // Where the extended-K kernel serves the call, launch it as a programmatic dependent of the
  // kernel before it (GemmParams::dependent_launch): for LoRA, whose rank-r pass finish lets it
  // launch at once. The kernel waits for that grid before its first load, so any kernel may come
  // before it.
  bool dependent = false;
};

// D = act(alpha * (A @ B + A2 @ B2) + C + bias) and, when want_aux and the activation's backward
// needs it, the pre-activation. a: [M, K] or [L, M, K]; b: [K, N] or [L, K, N], any strides; bias: [N].
// activation is a cutlass_ext::Activation code. Returns (D, Aux); Aux is undefined unless stored
// (an op returning it passes or_empty(Aux)).
std::tuple<at::Tensor, at::Tensor> gemm_op(const at::Tensor& a, const at::Tensor& b,
                                           const c10::optional<at::Tensor>& bias, int64_t activation,
                                           bool want_aux, const GemmOptions& opts, const GemmExtra& extra = {});

// The fused backward of act(Z + bias) over a [rows, cols] gradient: (dZ, dbias), each only when
// requested (empty otherwise; dZ is also empty for activation "none", where it equals grad).
// `saved` is y for relu and Z for the activations in act::needs_preactivation.
std::tuple<at::Tensor, at::Tensor> act_grad_cuda(const at::Tensor& grad, const c10::optional<at::Tensor>& saved,
                                                 c10::string_view activation_name, bool need_input_grad,
                                                 bool need_bias_grad);

}  // namespace cutlass_ext
