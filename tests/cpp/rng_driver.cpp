// Host driver for tests/test_rng_host.py: the dropout keep flags exactly as the vector kernels
// draw them (dropout_keep_run, eight elements from four pair hashes) and one element at a time.
// Reads lines "seed index p" (index a multiple of 8) and prints, per line, the 8 flags of each
// form as two strings of 0/1.
#include <cstdint>
#include <cstdio>
#include <iostream>

#include "common/counter_rng.h"

int main() {
  long long seed = 0, index = 0;
  double p = 0.0;
  while (std::cin >> seed >> index >> p) {
    const cutlass_ext::CounterRng rng{static_cast<uint64_t>(seed)};
    const uint32_t cmp = cutlass_ext::dropout_compare_threshold(cutlass_ext::dropout_keep_threshold(p));
    bool run[8], one[8];
    cutlass_ext::dropout_keep_run<8>(rng, uint64_t(index), cmp, run);
    for (int j = 0; j < 8; ++j) {
      bool keep[1];
      cutlass_ext::dropout_keep_run<1>(rng, uint64_t(index) + j, cmp, keep);
      one[j] = keep[0];
    }
    for (bool b : run) std::putchar(b ? '1' : '0');
    std::putchar(' ');
    for (bool b : one) std::putchar(b ? '1' : '0');
    std::putchar('\n');
  }
  return 0;
}
