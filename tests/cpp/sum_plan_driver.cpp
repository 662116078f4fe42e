// Runs plan_sum_shape (csrc/common/sum_plan.h) on lines
// "<outer> <reduce> <inner> <vec> <sm_count> <l2_bytes>" read from stdin and prints
// "<splits> <col_threads> <row_threads> <row_batch> <block_once> <lane_rest>" for each
// (tests/test_sum_plan_host.py).
#include <cstdint>
#include <iostream>

#include "common/sum_plan.h"

int main() {
  int64_t outer, reduce, inner;
  int64_t l2_bytes;
  int vec, sm_count;
  while (std::cin >> outer >> reduce >> inner >> vec >> sm_count >> l2_bytes) {
    const cutlass_ext::SumPlan p = cutlass_ext::plan_sum_shape(outer, reduce, inner, vec, sm_count, l2_bytes);
    std::cout << p.splits << " " << p.col_threads << " " << p.row_threads << " " << p.row_batch << " " << int(p.block_once) << " "
              << int(p.lane_rest) << "\n";
  }
  return 0;
}
