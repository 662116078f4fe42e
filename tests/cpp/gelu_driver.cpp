// Host driver for tests/test_gelu_host.py: the 16-bit GELU forms of csrc/common/gelu_16bit.h.
// Reads one float x a line (inf and nan included) and prints gelu_16bit(x), gelu_16bit_backward(1, x) and
// normal_tail(|x|), each to 9 significant digits (enough to round-trip a float).
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/gelu_16bit.h"

int main() {
  char line[128];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    const float x = std::strtof(line, nullptr);  // takes inf and nan too
    namespace act = cutlass_ext::act;
    std::printf("%.9g %.9g %.9g\n", act::gelu_16bit(x), act::gelu_16bit_backward(1.f, x),
                act::normal_tail(std::fabs(x)));
  }
  return 0;
}
