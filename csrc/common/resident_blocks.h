// Occupancy of hand-written kernels (persistent GEMMs, split-row passes), asked once.
#pragma once

#include <map>
#include <mutex>
#include <tuple>

#include "common/device_utils.cuh"

namespace cutlass_ext {

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) that fit one SM
// of `device`, the current device: asked of the runtime once per kernel, block shape and device
// (a grid of sm_count times this is one wave). At least 1; a failed query is not cached.
inline int cached_resident_blocks(const void* kernel, int threads, int smem, int device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  const auto key = std::make_tuple(kernel, threads, smem, device);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int blocks = resident_blocks_per_sm(kernel, threads, size_t(smem));
  if (blocks < 1) return 1;
  cache.emplace(key, blocks);
  return blocks;
}

}  // namespace cutlass_ext
