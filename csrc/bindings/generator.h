// torch's CUDA generator for ops that draw their dropout seed from it. The state is reserved on
// the host as torch's own random kernels reserve theirs (CUDAGeneratorImpl::philox_cuda_state):
// outside a CUDA graph it is the generator's seed and offset by value; during capture it points at
// the seed and offset that each replay refills. write_generator_seed (elementwise/dropout_kernels.h),
// a one-thread kernel, turns it into the call's seed in device memory, where the op's kernels read
// it as they read a given seed: every graph replay writes a new one, and nothing waits on the host.
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
#include "elementwise/dropout_kernels.h"

namespace cutlass_ext {

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

// Writes the seed of a call with dropout, drawn from torch's CUDA generator, to `out` ([1] int64
// on a CUDA device), on the current stream.
inline void draw_generator_seed(const at::Tensor& out, const char* op) {
  const GeneratorState g = reserve_generator_state(out.device(), op);
  check_launch(write_generator_seed(g, out.data_ptr<int64_t>(), current_stream(out.device())), op,
               "write_generator_seed");
}

}  // namespace cutlass_ext
