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

// Row splits for a grid of col_blocks x s blocks that each walk rows / s rows of their column
// chunk. Blocks run in waves of `wave` (sm_count x resident blocks), and a partial last wave costs
// a whole block time, so the pass uses a fraction col_blocks * s / (waves(s) * wave) of the slots,
// waves(s) = ceil(col_blocks * s / wave). Returns the smallest s within 2% of the best fraction over
// 1..min(max_splits, 4 * ceil(wave / col_blocks)); the bound keeps the partials (s rows of column
// sums) small. Where max_splits all fit one wave, all of them. Measured on an H200 (bench/NOTES.md section 42): at 65536x512 bf16 the bias_act
// backward went from 1.33 waves to one, and bias+SiLU forward+backward from 131.6 to 110.6 us.
inline int wave_row_splits(int64_t col_blocks, int64_t wave, int64_t max_splits) {
  col_blocks = std::max<int64_t>(col_blocks, 1);
  wave = std::max<int64_t>(wave, 1);
  // Every split allowed fits in one wave: take them all (fewer would idle slots, and rows / s that
  // is not a multiple of the block's rows leaves some threads one more dependent round trip).
  if (max_splits * col_blocks <= wave) return int(std::max<int64_t>(1, std::min<int64_t>(max_splits, 65535)));
  const int64_t limit =
      std::max<int64_t>(1, std::min({max_splits, int64_t(65535), 4 * ((wave + col_blocks - 1) / col_blocks)}));
  auto used = [&](int64_t s) {
    const int64_t blocks = col_blocks * s;
    return double(blocks) / double((blocks + wave - 1) / wave * wave);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= limit; ++s) best = std::max(best, used(s));
  for (int64_t s = 1; s <= limit; ++s) {
    if (used(s) >= best - 0.02) return int(s);
  }
  return 1;
}

}  // namespace cutlass_ext
