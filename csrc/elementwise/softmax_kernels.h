// Hand-written softmax kernels (torch-free interface). Rows are `cols` contiguous elements, one
// row every `*_ld` elements; math in fp32, results in the tensors' dtype.
//
// softmax_forward:  y = softmax(scale * x) per row. -inf entries get 0; a row that is all -inf
//                   gives zeros (not NaN); a NaN anywhere in a row makes the whole row NaN.
// softmax_backward: dx = scale * y * (dy - sum(dy * y)) per row, one fused pass per row.
//
// Paths, chosen by row length (softmax_kernels.cu has the thresholds):
//   short rows:  a warp (or a power-of-two part of one) per row, the row in registers;
//   medium rows: a block per row, the row in registers (x, or dy and y, read once); on the vector
//                path only up to 8192 columns (forward) and 16384 (backward), longer rows as the
//                long ones;
//   long rows:   on the vector path, the row (x, or dy and y) in one block's shared memory where
//                it fits, else (and where rows are few) split over a cluster of blocks that hold a
//                slice each in shared memory (Hopper): read once. Otherwise a block per row, a
//                reduction pass then a write pass (reads the row twice); with few rows each row is
//                split over `row_splits` blocks: a first kernel writes per-chunk partials to
//                `partials`, a second combines them in a fixed order and writes its chunk
//                (deterministic, no atomics).
// 16-byte vector accesses when every base is 16-byte aligned and cols and the row strides are
// multiples of the vector width; scalar accesses otherwise.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

struct SoftmaxParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  float scale = 1.f;
  const void* x = nullptr;
  int64_t x_ld = 0;
  void* y = nullptr;
  int64_t y_ld = 0;
  float* partials = nullptr;  // [rows, row_splits, 2] fp32 (max, sum) workspace when row_splits > 1
  int row_splits = 1;
  int sm_count = 0;  // the device's multiprocessors (0: unknown), for the launch shape of short rows
};

struct SoftmaxBackwardParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kBF16;
  float scale = 1.f;
  const void* grad = nullptr;  // dy
  int64_t grad_ld = 0;
  const void* y = nullptr;  // the forward's output
  int64_t y_ld = 0;
  void* grad_input = nullptr;  // dx
  int64_t grad_input_ld = 0;
  float* partials = nullptr;  // [rows, row_splits] fp32 sum(dy * y) workspace when row_splits > 1
  int row_splits = 1;
};

// How many blocks share one row (1 unless rows are long and too few to fill `sm_count`
// multiprocessors); the caller sizes `partials` from it (unused where a cluster takes the rows).
int softmax_row_splits(int64_t rows, int64_t cols, bool backward, int sm_count);

// Floats of `partials` needed for `row_splits` > 1 (0 otherwise).
int64_t softmax_partials_floats(int64_t rows, int row_splits, bool backward);

LaunchResult softmax_forward(SoftmaxParams const& p, cudaStream_t stream);
LaunchResult softmax_backward(SoftmaxBackwardParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
