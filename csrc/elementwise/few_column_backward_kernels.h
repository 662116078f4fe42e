// The backward of a linear layer with few output columns (a 256 -> 1 scoring head, a 64 -> 16
// bottom-MLP layer; few_column_backward_serves below), hand-written and torch-free:
//   dZ[r, n]  = dY[r, n] * act'(saved[r, n])
//   dX[r, k]  = sum_n dZ[r, n] W[n, k]           (written when grad_x != nullptr)
//   dW[n, k]  = sum_r dZ[r, n] X[r, k]           (written when grad_w != nullptr)
//   dbias[n]  = sum_r dZ[r, n]                   (written when grad_bias != nullptr)
// The GEMM path runs this as four or five kernels (act'/bias sum, a K = N product for dX that
// writes X's size, a K-sliced product for dW that reads X, and their reductions), each a short
// launch on these shapes. Here one pass reads X once and writes dX once: a block walks a range of
// rows of one column chunk, computes their dZ once into shared memory, and each thread forms its
// dX columns from W (held in registers) and keeps fp32 dW sums. dW and dbias are deterministic:
// the blocks' sums are added in a fixed tree, the row splits by a second kernel in a fixed order.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

constexpr int kFewColumnBackwardMaxN = 16;

// Whether the one-pass backward serves a layer of n output columns over k inputs and `rows` rows:
// up to 4 columns always; 5-16 columns on up to 2^20 elements of X, where the GEMM path's
// launches dominate. Above that the pass fell behind the GEMM path (measured on an H200, bf16:
// 1.1-1.3x its speed at 2048-8192 x 64 -> 16 and 2048 x 256 -> 16, 0.93x at 65536 x 64 -> 16,
// 0.61x at 32768 x 256 -> 16).
inline bool few_column_backward_serves(int64_t rows, int64_t k, int64_t n) {
  return n >= 1 && (n <= 4 || (n <= kFewColumnBackwardMaxN && rows * k <= (int64_t(1) << 20)));
}

struct FewColumnBackwardParams {
  int64_t rows = 0, k = 0;
  int n = 0;  // 1 .. kFewColumnBackwardMaxN
  DType dtype = DType::kBF16;
  int activation = 0;
  const void* grad = nullptr;  // dY [rows, n]
  int64_t grad_stride_r = 0, grad_stride_n = 0;
  const void* saved = nullptr;  // y for relu, z for the smooth activations; unused for none
  int64_t saved_stride_r = 0, saved_stride_n = 0;
  const void* x = nullptr;  // X [rows, k]: read when grad_w is wanted
  int64_t x_stride_r = 0, x_stride_k = 0;
  const void* w = nullptr;  // W [n, k]: read when grad_x is wanted
  int64_t w_stride_n = 0, w_stride_k = 0;
  void* grad_x = nullptr;  // [rows, k], contiguous
  void* grad_w = nullptr;  // n * k elements, (n, k) at n * grad_w_stride_n + k * grad_w_stride_k
  int64_t grad_w_stride_n = 0, grad_w_stride_k = 0;
  void* grad_bias = nullptr;  // [n]
  float* partials = nullptr;  // [splits, n * k + n] fp32, needed when splits > 1 and dW or dbias is wanted
  int splits = 1;             // from plan_few_column_backward(), with:
  int64_t rows_per_split = 0;
};

// Sets p.splits (how many blocks share one column chunk's rows, so that the grid fills `sm_count`
// multiprocessors once) and p.rows_per_split. Reads the shape, dtype, strides and which pointers
// are set (their alignment picks the kernel), so call it after setting them.
void plan_few_column_backward(FewColumnBackwardParams& p, int sm_count);

LaunchResult few_column_backward(FewColumnBackwardParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
