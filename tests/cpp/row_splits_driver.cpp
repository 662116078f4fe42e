// Runs wave_row_splits (csrc/common/row_splits.h) on lines "<col_blocks> <wave> <max_splits>" read
// from stdin and prints the split count of each (tests/test_row_splits_host.py).
#include <cstdint>
#include <iostream>

#include "common/row_splits.h"

int main() {
  int64_t col_blocks, wave, max_splits;
  while (std::cin >> col_blocks >> wave >> max_splits) {
    std::cout << cutlass_ext::wave_row_splits(col_blocks, wave, max_splits) << "\n";
  }
  return 0;
}
