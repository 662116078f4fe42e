// Dropout of a contiguous tensor with the counter-based RNG (common/counter_rng.h):
//   out[i] = in[i] * keep(seed, index_offset + i) / (1 - p)
// The mask is a pure function of (seed, element index), so the backward of an op that dropped
// its input regenerates it instead of storing it. `in` and `out` may be the same buffer. The
// seed is read from device memory (a tensor drawn from torch's generator), so CUDA-graph
// replays draw fresh masks without a host round trip.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

struct DropoutTensorParams {
  int64_t numel = 0;
  DType dtype = DType::kBF16;
  const void* input = nullptr;
  void* output = nullptr;
  const int64_t* seed = nullptr;  // one int64 on the device
  double p = 0.0;
  int sm_count = 132;  // sizes the grid
};

LaunchResult dropout_forward(DropoutTensorParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
