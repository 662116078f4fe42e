// Types every kernel interface shares. Torch-free and CUTLASS-free.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CE_HOST_DEVICE inline
#endif

namespace cutlass_ext {

enum class DType : int { kF16 = 0, kBF16 = 1, kF32 = 2 };

// Result of one launch. `stage` is nullptr on success, else the step that failed
// ("can_implement", "initialize", "run", "launch") with a static description in `detail`.
struct LaunchResult {
  const char* stage = nullptr;
  const char* detail = nullptr;
  bool ok() const { return stage == nullptr; }
};

// 16-byte alignment: what vectorized loads, stores and TMA need.
CE_HOST_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace cutlass_ext
