// Fused ReLU + LayerNorm + dropout over the last dimension of a [rows, cols] matrix (torch-free).
//
// Forward, one pass over x:
//   h = relu(x) (when relu), mean = sum(h) / C, rstd = 1 / sqrt(sum((h - mean)^2) / C + eps)
//   y = dropout((h - mean) * rstd * weight + bias)     (dropout: keep iff counter_rng draw >= threshold,
//                                                       kept values times keep_scale)
// mean and rstd (fp32, [rows]) are written for the backward.
//
// Backward, per row with g = dropout'(dy), xhat = (h - mean) * rstd, dxhat = g * weight:
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) * (x > 0 when relu)
//   dweight[c] = sum_r g * xhat,  dbias[c] = sum_r g
// The column sums are deterministic: blocks write fp32 partial rows, a second kernel adds them in
// a fixed order. Dropout's mask is regenerated from the seed; element (r, c) is index r * cols + c.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

// Dropout as the kernels see it: active when `seed` (one int64 in device memory) is not null.
struct DropoutParams {
  const int64_t* seed = nullptr;
  uint32_t keep_threshold = 0;  // dropout_keep_threshold(p): 0 .. 2**16
  float keep_scale = 1.f;       // dropout_keep_scale(p)
};

struct LayerNormParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  const void* x = nullptr;  // [rows, cols], unit column stride
  int64_t x_ld = 0;
  const void* weight = nullptr;  // [cols] contiguous, may be null
  const void* bias = nullptr;    // [cols] contiguous, may be null
  void* y = nullptr;             // [rows, cols]
  int64_t y_ld = 0;
  float* mean = nullptr;  // [rows]
  float* rstd = nullptr;  // [rows]
  float eps = 1e-5f;
  bool relu = false;
  DropoutParams dropout;
};

LaunchResult layer_norm_forward(LayerNormParams const& p, cudaStream_t stream);

struct LayerNormBackwardParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  const void* grad = nullptr;  // dy [rows, cols], unit column stride
  int64_t grad_ld = 0;
  const void* x = nullptr;  // [rows, cols], unit column stride
  int64_t x_ld = 0;
  const void* weight = nullptr;  // [cols] contiguous, may be null
  const float* mean = nullptr;   // [rows]
  const float* rstd = nullptr;   // [rows]
  bool relu = false;
  DropoutParams dropout;
  void* grad_x = nullptr;  // [rows, cols], may be null
  int64_t grad_x_ld = 0;
  void* grad_weight = nullptr;  // [cols], may be null
  void* grad_bias = nullptr;    // [cols], may be null
  float* workspace = nullptr;   // layer_norm_backward_workspace(p) floats, when grad_weight or grad_bias
  int sm_count = 1;
};

// fp32 elements of workspace the backward needs (0 when neither grad_weight nor grad_bias is
// requested). Call it with every other field of `p` set: the kernel choice depends on them.
int64_t layer_norm_backward_workspace(LayerNormBackwardParams const& p);

LaunchResult layer_norm_backward(LayerNormBackwardParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
