// Runs plan_sum_shape (csrc/common/sum_plan.h) on lines "<outer> <reduce> <inner> <vec> <sm_count>"
// read from stdin and prints "<splits> <col_threads> <row_threads> <row_batch>" for each
// (tests/test_sum_plan_host.py).
#include <cstdint>
#include <iostream>

#include "common/sum_plan.h"

int main() {
  int64_t outer, reduce, inner;
  int vec, sm_count;
  while (std::cin >> outer >> reduce >> inner >> vec >> sm_count) {
    const cutlass_ext::SumPlan p = cutlass_ext::plan_sum_shape(outer, reduce, inner, vec, sm_count);
    std::cout << p.splits << " " << p.col_threads << " " << p.row_threads << " " << p.row_batch << "\n";
  }
  return 0;
}
