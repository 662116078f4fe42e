// Integer helpers shared by host launch code and kernels. Plain C++: the host tests build it.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace cutlass_ext {

CE_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The smallest power of two >= n (1 for n <= 1).
inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace cutlass_ext
