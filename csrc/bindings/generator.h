// torch's CUDA generator for kernels that draw their dropout seed from it. The state is reserved
// on the host as torch's own random kernels reserve theirs (CUDAGeneratorImpl::philox_cuda_state):
// outside a CUDA graph it is the generator's seed and offset by value; during capture it points at
// the seed and offset that each replay refills, so every replay draws a new seed. The kernel reads
// it (generator_dropout_seed in common/counter_rng.h): no extra kernel and no host synchronization.
//
// CUTLASS_EXT_TORCH_CUDA (set by cutlass_ext/_build.py when torch has CUDA) links torch's CUDA
// library; without it (a build against a CPU torch, which has no CUDA tensors to call this with)
// reserving raises.
#pragma once

#include <torch/extension.h>

#ifdef CUTLASS_EXT_TORCH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <mutex>
#include <optional>
#endif

#include "bindings/common.h"
#include "common/counter_rng.h"

namespace cutlass_ext {

// torch's CUDA generator state for one call (torch's PhiloxCudaState): seed and offset as values,
// or, while a CUDA graph is captured, pointers that each replay refills plus the call's offset
// within the graph.
struct GeneratorState {
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_in_graph = 0;
  bool captured = false;
};

// Philox offsets one call reserves: the least the generator accepts. The kernels use only the
// offset's value (as part of their seed), never Philox itself.
constexpr uint64_t kGeneratorIncrement = 4;

inline GeneratorState reserve_generator_state(const at::Device& device, const char* op) {
#ifdef CUTLASS_EXT_TORCH_CUDA
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(kGeneratorIncrement);
  }
  GeneratorState g;
  g.captured = state.captured_;
  if (state.captured_) {
    g.seed_ptr = state.seed_.ptr;
    g.offset_ptr = state.offset_.ptr;
    g.offset_in_graph = state.offset_intragraph_;
  } else {
    g.seed = state.seed_.val;
    g.offset = state.offset_.val;
  }
  return g;
#else
  (void)device;
  CE_CHECK(false, op, ": this build of cutlass_ext was made against a torch without CUDA and cannot draw a dropout "
           "seed from torch's CUDA generator; rebuild it against a CUDA torch");
  return {};
#endif
}

}  // namespace cutlass_ext
