// Host driver for tests/test_activation_16bit_host.py: the activations of
// csrc/common/activation_16bit.h. Reads one float x a line (inf and nan included) and prints
// gelu_16bit(x), gelu_16bit_backward(1, x), normal_tail(|x|), then silu_fast(x),
// silu_fast_backward(1, x), sigmoid_fast(x) and sigmoid_fast_backward(1, x) in the 16-bit form
// and again in the refined (fp32) form, each to 9 significant digits (enough to round-trip a
// float).
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/activation_16bit.h"

int main() {
  char line[128];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    const float x = std::strtof(line, nullptr);  // takes inf and nan too
    namespace act = cutlass_ext::act;
    std::printf("%.9g %.9g %.9g", act::gelu_16bit(x), act::gelu_16bit_backward(1.f, x), act::normal_tail(std::fabs(x)));
    std::printf(" %.9g %.9g %.9g %.9g", act::silu_fast<false>(x), act::silu_fast_backward<false>(1.f, x),
                act::sigmoid_fast<false>(x), act::sigmoid_fast_backward<false>(1.f, x));
    std::printf(" %.9g %.9g %.9g %.9g\n", act::silu_fast<true>(x), act::silu_fast_backward<true>(1.f, x),
                act::sigmoid_fast<true>(x), act::sigmoid_fast_backward<true>(1.f, x));
  }
  return 0;
}
