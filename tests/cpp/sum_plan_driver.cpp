// Runs csrc/common/sum_plan.h on lines read from stdin (tests/test_sum_plan_host.py):
// "plan <outer> <reduce> <inner> <vec> <full> <sm_count> <l2_bytes> <row_align>" prints plan_sum_shape's
// "<splits> <col_threads> <row_threads> <row_batch> <block_once> <lane_rest> <row_pack>";
// "pack <base_bytes> <a> <b> <c> <elem_bytes>" prints pack_elements'; "colvec <pack> <full>" column_vec's;
// "lanes <splits> <min_lanes> <max_lanes>" partials_lanes'.
#include <cstdint>
#include <iostream>
#include <string>

#include "common/sum_plan.h"

int main() {
  std::string what;
  while (std::cin >> what) {
    if (what == "pack") {
      uint64_t base;
      int64_t a, b, c;
      int elem;
      std::cin >> base >> a >> b >> c >> elem;
      std::cout << cutlass_ext::pack_elements(base, a, b, c, elem) << "\n";
      continue;
    }
    if (what == "colvec") {
      int pack, full;
      std::cin >> pack >> full;
      std::cout << cutlass_ext::column_vec(pack, full) << "\n";
      continue;
    }
    if (what == "lanes") {
      int64_t splits;
      int lo, hi;
      std::cin >> splits >> lo >> hi;
      std::cout << cutlass_ext::partials_lanes(splits, lo, hi) << "\n";
      continue;
    }
    int64_t outer, reduce, inner, l2_bytes;
    int vec, full, sm_count, row_align;
    std::cin >> outer >> reduce >> inner >> vec >> full >> sm_count >> l2_bytes >> row_align;
    const cutlass_ext::SumPlan p =
        cutlass_ext::plan_sum_shape(outer, reduce, inner, vec, full, sm_count, l2_bytes, row_align);
    std::cout << p.splits << " " << p.col_threads << " " << p.row_threads << " " << p.row_batch << " "
              << int(p.block_once) << " " << int(p.lane_rest) << " " << p.row_pack << "\n";
  }
  return 0;
}
