// Dropout of a contiguous tensor with the counter-based RNG (common/counter_rng.h), and the seed
// of a call that draws from torch's CUDA generator.
//
// Dropout:
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

// torch's CUDA generator state for one call (the fields of torch's PhiloxCudaState): seed and
// offset as values, or, while a CUDA graph is captured, pointers that each replay refills plus the
// call's offset within the graph.
struct GeneratorState {
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_in_graph = 0;
  bool captured = false;
};

// Writes generator_dropout_seed of the state to `out` (one int64 on the device) from one thread:
// the seed of a call that draws from torch's generator, which its kernels then read as they read
// a given seed. In a CUDA graph the kernel reads the state each replay refills, so every replay
// writes a new seed.
LaunchResult write_generator_seed(GeneratorState const& g, int64_t* out, cudaStream_t stream);

}  // namespace cutlass_ext
