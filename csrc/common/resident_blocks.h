// Occupancy of hand-written kernels (persistent GEMMs, split-row reductions), asked once.
#pragma once

#include <algorithm>
#include <cstdint>
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

// Row splits for a grid of col_blocks x splits blocks that each walk rows / splits rows: as many
// as fill one wave of `wave` blocks (sm_count x resident blocks) without starting a second, at
// least 1 and at most max_splits. A second, partial wave runs its blocks after the first ones
// finish: the pass then takes two block times for 1.x waves of work.
inline int one_wave_row_splits(int64_t col_blocks, int64_t wave, int64_t max_splits) {
  const int64_t splits = std::min({wave / std::max<int64_t>(col_blocks, 1), max_splits, int64_t(65535)});
  return int(std::max<int64_t>(1, splits));
}

}  // namespace cutlass_ext
