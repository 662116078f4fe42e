// One pass over a [M, N] matrix X that multiplies it by two rank-r operands at once (16-bit
// types, r <= 32), for LoRA's rank-r products:
//   rows = X P      [M, r]   (P [N, r], any strides)      written as rows_t [r, M] and/or rows_s [M, r]
//   cols = X^T Q    [N, r]   (Q given as [r, M], contiguous) written to cols with any strides
// each with its own scale. In LoRA's backward X is dz: U = dz B and dB = s dz^T t read dz once
// instead of twice, and U comes out both as the [r, M] tensor dA reads and as the scaled [M, r]
// operand of the extended-K dx GEMM, which were separate copies. In the forward X is drop(x) and
// only `rows` is asked for: t^T and s t in one pass.
//
// Blocks own a 512-column slab of X and a contiguous range of its rows; each block's sums over
// its columns (rows) and over its rows (cols) are fp32 partials in `workspace`, which a second
// kernel adds in a fixed order (deterministic), scales and writes in the output layouts.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

struct RankPassParams {
  DType dtype = DType::kBF16;
  int64_t M = 0, N = 0;
  int r = 0;
  const void* x = nullptr;  // [M, N], unit column stride, row stride ldx
  int64_t ldx = 0;
  // rows = X P, P[n, j] at p + n * p_stride_n + j * p_stride_r (nullptr: not computed)
  const void* p = nullptr;
  int64_t p_stride_n = 0, p_stride_r = 0;
  void* rows_t = nullptr;  // [r, M] contiguous, rows_t_scale * rows^T (nullptr: not written)
  float rows_t_scale = 1.f;
  void* rows_s = nullptr;  // [M, r] contiguous, rows_s_scale * rows (nullptr: not written)
  float rows_s_scale = 1.f;
  // cols = X^T Q, Q[m, j] at q + j * M + m (nullptr: not computed)
  const void* q = nullptr;
  void* cols = nullptr;  // cols_scale * cols[n, j] at cols + n * cols_stride_n + j * cols_stride_r
  int64_t cols_stride_n = 0, cols_stride_r = 0;
  float cols_scale = 1.f;
  int sm_count = 132;
  float* workspace = nullptr;  // rank_pass_workspace_floats(*this) floats, 16-byte aligned
};

// Whether rank_pass takes these operands: a 16-bit dtype, 1 <= r <= 32, N and ldx multiples of 8
// and x 16-byte aligned (X is copied in 16-byte pieces), and with Q also M a multiple of 8 and q
// 16-byte aligned. Where it does not, the caller runs the products as GEMMs.
bool rank_pass_supported(RankPassParams const& p);

// fp32 partial sums the pass needs (its grid depends on M, N, r and sm_count).
int64_t rank_pass_workspace_floats(RankPassParams const& p);

LaunchResult rank_pass(RankPassParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
