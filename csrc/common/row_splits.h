// How many row splits a split-row pass (a bias or column-sum gradient over rows) launches, from
// its column blocks and the blocks one wave of the device holds. Plain C++: the host tests build it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace cutlass_ext {

// Row splits for a grid of col_blocks x s blocks that each walk rows / s rows of their column
// chunk. Blocks run in waves of `wave` (sm_count x resident blocks), and a partial last wave costs
// a whole block time, so the pass uses a fraction col_blocks * s / (waves(s) * wave) of the slots,
// waves(s) = ceil(col_blocks * s / wave). Where all max_splits splits fit one wave, returns
// max_splits; else the smallest s within 2% of the best fraction over 1..min(max_splits,
// 4 * ceil(wave / col_blocks)) (the bound keeps the partials, s rows of column sums, small).
// Measured on an H200 (bench/NOTES.md section 42): at 65536x512 bf16 the bias_act backward went
// from 1.33 waves to one, and bias+SiLU forward+backward from 131.6 to 110.6 us.
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
