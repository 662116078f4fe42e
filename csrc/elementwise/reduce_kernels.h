// Sum reduction kernels (torch-free interface).
//
// The binding views every reduction as x[outer, reduce, inner] with the inner elements contiguous
// (strides outer_stride, reduce_stride, 1) and writes out[outer, inner] (contiguous), with fp32
// accumulation:
//   inner == 1: row reduction (a group of lanes per short row, a block per long row, and a long
//               row split across blocks when there are too few rows to fill the GPU);
//   inner  > 1: column reduction (threads own adjacent inner elements, so loads are coalesced
//               along inner; the reduce extent is split across blocks when outer * inner is small).
// Split reductions write fp32 partials[outer, splits, inner] and a second kernel adds the splits
// in a fixed order, so results are deterministic (no atomics).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/sum_plan.h"
#include "common/types.h"

namespace cutlass_ext {

struct SumParams {
  int64_t outer = 0, reduce = 0, inner = 0;
  int64_t outer_stride = 0;   // elements between consecutive outer indices
  int64_t reduce_stride = 0;  // elements between consecutive reduce indices (1 when inner == 1)
  DType dtype = DType::kBF16;
  const void* input = nullptr;
  void* output = nullptr;     // [outer, inner], contiguous
  float* partials = nullptr;  // [outer, plan.splits, inner] fp32 workspace, needed when plan.splits > 1
  SumPlan plan;               // from plan_sum()
};

// Sets p.plan from p's shape and dtype (common/sum_plan.h): among others plan.splits, how many
// blocks share one reduction (1: no workspace, no second stage) so that the grid fills `sm_count`
// multiprocessors of `l2_bytes` of L2 cache. The workspace holds outer * plan.splits * inner floats.
void plan_sum(SumParams& p, int sm_count, int64_t l2_bytes);

LaunchResult sum(SumParams const& p, cudaStream_t stream);

// Second stage of every split column/row reduction (also used by the bias-gradient of
// bias_act's backward): out[o, i] = sum over s = 0, 1, ..., splits-1 of partials[o, s, i],
// added in a fixed order. `out` is contiguous [outer, inner] of `dtype`.
LaunchResult sum_partials(const float* partials, int64_t outer, int splits, int64_t inner, DType dtype,
                          void* out, cudaStream_t stream);

}  // namespace cutlass_ext
