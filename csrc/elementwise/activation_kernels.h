// Hand-written activation kernels around the GEMMs (torch-free interface).
//
// act_grad: the fused backward of act(Z + bias) over a [rows, cols] matrix, in one pass:
//   dZ[r, c]   = dY[r, c] * act'(saved[r, c])         (written when grad_input != nullptr)
//   dbias[c]   = sum_r dZ[r, c]                        (written when grad_bias != nullptr)
// The column sums are deterministic: each block reduces a fixed row range into fp32 partials
// (its threads' rows added in a fixed tree), and sum_partials adds the blocks' partials in order.
//
// activation_forward: y = act(z) elementwise, for GEMM paths that cannot store an aux output.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

struct ActGradParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  int activation = 0;
  const void* grad = nullptr;  // dY
  int64_t grad_ld = 0;
  const void* saved = nullptr;  // y for relu, z for gelu/gelu_tanh/silu, unused for none
  int64_t saved_ld = 0;
  void* grad_input = nullptr;  // dZ, may be null
  int64_t grad_input_ld = 0;
  void* grad_bias = nullptr;  // [cols], may be null
  float* partials = nullptr;  // [row_splits, cols] fp32 workspace, needed when row_splits > 1
  int row_splits = 1;
};

// Picks the row split for a grid that fills one wave of `sm_count` multiprocessors of `device`
// (the current device) with the kernel of `dtype` and `activation`.
int act_grad_row_splits(int64_t rows, int64_t cols, DType dtype, int activation, int sm_count, int device);

LaunchResult act_grad(ActGradParams const& p, cudaStream_t stream);

struct ActForwardParams {
  int64_t numel = 0;
  DType dtype = DType::kBF16;
  int activation = 0;
  const void* input = nullptr;  // contiguous
  void* output = nullptr;       // contiguous
};

LaunchResult activation_forward(ActForwardParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
