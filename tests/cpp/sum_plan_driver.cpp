// Runs csrc/common/sum_plan.h on lines read from stdin (tests/test_sum_plan_host.py):
// "plan <outer> <reduce> <inner> <vec> <sm_count> <l2_bytes> <row_align>" prints plan_sum_shape's
// "<splits> <col_threads> <row_threads> <row_batch> <block_once> <lane_rest> <row_pack>";
// "align <base_bytes> <pitch_bytes> <elem_bytes>" prints row_alignment's elements.
#include <cstdint>
#include <iostream>
#include <string>

#include "common/sum_plan.h"

int main() {
  std::string what;
  while (std::cin >> what) {
    if (what == "align") {
      uint64_t base;
      int64_t pitch;
      int elem;
      std::cin >> base >> pitch >> elem;
      std::cout << cutlass_ext::row_alignment(base, pitch, elem) << "\n";
      continue;
    }
    int64_t outer, reduce, inner, l2_bytes;
    int vec, sm_count, row_align;
    std::cin >> outer >> reduce >> inner >> vec >> sm_count >> l2_bytes >> row_align;
    const cutlass_ext::SumPlan p = cutlass_ext::plan_sum_shape(outer, reduce, inner, vec, sm_count, l2_bytes, row_align);
    std::cout << p.splits << " " << p.col_threads << " " << p.row_threads << " " << p.row_batch << " " << int(p.block_once) << " "
              << int(p.lane_rest) << " " << p.row_pack << "\n";
  }
  return 0;
}
