// Fused pointwise kernels (torch-free interface).
//
// bias_act_forward:  y[r, c] = act(scale * x[r, c] + bias[c] + residual[r, c])
//   One read of x (and residual), one write of y; each thread owns a fixed column chunk, loads
//   its bias once and walks rows. bias and residual may be null. With `mask` (relu only) it also
//   stores the backward's mask: bit e of the mask words is z > 0 for y's flat element e.
// bias_act_backward: one pass that recomputes z = scale * x + bias + residual and dz = dy * act'(z),
//   writes grad_x = scale * dz and/or grad_residual = dz, and reduces grad_bias[c] = sum_r dz[r, c]
//   into fp32 partials per row split; sum_partials (reduce_kernels.h) adds them in a fixed order.
//   With the forward's relu mask it reads dy and the mask in place of x, bias and residual.
// add: out = a + b elementwise over contiguous buffers (fp32 math).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

// Matrices are [rows, cols] with unit column stride and row stride `*_ld` (elements); outputs
// are contiguous (ld = cols).
struct BiasActParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  int activation = 0;  // Activation code (common/activation.h)
  float scale = 1.f;
  const void* x = nullptr;
  int64_t x_ld = 0;
  const void* bias = nullptr;  // [cols], contiguous; may be null
  const void* residual = nullptr;  // may be null
  int64_t residual_ld = 0;
  void* y = nullptr;
  uint32_t* mask = nullptr;  // relu only, may be null: mask_words(rows * cols) words, bit e = (z_e > 0)
  int sm_count = 1;
};

// The longest rows the masked forward takes (2^26 elements; longer ones save x instead).
constexpr int64_t kMaxMaskCols = int64_t(1) << 26;

// Words of the relu mask of `numel` elements: one bit an element, bit e % 32 of word e / 32.
constexpr int64_t mask_words(int64_t numel) { return (numel + 31) / 32; }

LaunchResult bias_act_forward(BiasActParams const& p, cudaStream_t stream);

// 128 bytes: a kernel parameter of that size is read into registers once, where a larger one (136
// bytes, measured with nvcc 13.0) is read where used, which moved the registers of most backward
// kernels by up to 15 either way. row_splits fills the hole after scale.
struct BiasActBackwardParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  int activation = 0;
  float scale = 1.f;
  int row_splits = 1;  // from bias_act_backward_row_splits()
  const void* grad = nullptr;  // dY
  int64_t grad_ld = 0;
  const void* x = nullptr;
  int64_t x_ld = 0;
  const void* bias = nullptr;      // may be null
  const void* residual = nullptr;  // may be null
  int64_t residual_ld = 0;
  const uint32_t* mask = nullptr;  // relu's forward mask (BiasActParams::mask); x, bias, residual unused
  void* grad_x = nullptr;         // scale * dz, may be null
  void* grad_residual = nullptr;  // dz, may be null
  void* grad_bias = nullptr;      // [cols], may be null
  float* partials = nullptr;      // [row_splits, cols] fp32 workspace, needed when grad_bias && row_splits > 1
};
static_assert(sizeof(BiasActBackwardParams) == 128, "see above");

// Row split of the backward grid that fills the waves of `sm_count` multiprocessors of `device`
// (the current device) with the kernel of `dtype`, `activation` and what it reads: a residual, or
// relu's mask in place of x, bias and residual.
int bias_act_backward_row_splits(int64_t rows, int64_t cols, DType dtype, int activation, bool residual, bool mask,
                                 int sm_count, int device);

LaunchResult bias_act_backward(BiasActBackwardParams const& p, cudaStream_t stream);

struct AddParams {
  int64_t numel = 0;
  DType dtype = DType::kBF16;
  const void* a = nullptr;  // contiguous
  const void* b = nullptr;  // contiguous
  void* out = nullptr;      // contiguous
};

LaunchResult add(AddParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
