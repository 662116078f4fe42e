// Counter-based random numbers for dropout masks: a pure function of (seed, index), so a forward
// kernel and its backward regenerate the same mask without storing it, and any thread can draw the
// number of any element. Torch-free; host and device (CE_HOST_DEVICE).
//
// Definition (all arithmetic on uint32 lanes, wrapping mod 2**32):
//   mix(x)  = x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15
//             (a 32-bit bijection with full avalanche; both multipliers < 2**31, so the Python twin
//             can evaluate it in int64 without overflow)
//   key:      k0 = mix(lo(seed) ^ 0x9e3779b9),  k1 = mix(hi(seed) ^ k0 ^ 0x7f4a7c15)
//   bits(i) = mix(mix(lo(i) ^ k0) + mix(hi(i) ^ k1))            (i: the 64-bit element index)
//   uniform(seed, i) = bits(i) * 2**-32 in [0, 1)
//   dropout keeps element i iff uniform >= p, i.e. iff bits(i) >= keep_threshold(p) = ceil(p * 2**32)
//   (an integer compare, so every implementation agrees bit for bit; p = 1 keeps nothing).
// cutlass_ext/ops/_rng.py is the bit-exact Python twin; a test compares the two.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/types.h"

namespace cutlass_ext {

CE_HOST_DEVICE uint32_t rng_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// The generator of one seed. `bits(index)` is the raw 32-bit draw of element `index`; kernels that
// walk a row whose indices share their high 32 bits can hoist `high_key` out of the loop and call
// `bits_low`.
struct CounterRng {
  uint32_t k0, k1;

  CE_HOST_DEVICE explicit CounterRng(uint64_t seed)
      : k0(rng_mix32(uint32_t(seed) ^ 0x9e3779b9u)),
        k1(rng_mix32(uint32_t(seed >> 32) ^ k0 ^ 0x7f4a7c15u)) {}

  CE_HOST_DEVICE uint32_t high_key(uint32_t index_hi) const { return rng_mix32(index_hi ^ k1); }
  CE_HOST_DEVICE uint32_t bits_low(uint32_t index_lo, uint32_t high) const {
    return rng_mix32(rng_mix32(index_lo ^ k0) + high);
  }
  CE_HOST_DEVICE uint32_t bits(uint64_t index) const {
    return bits_low(uint32_t(index), high_key(uint32_t(index >> 32)));
  }
  CE_HOST_DEVICE float uniform(uint64_t index) const { return float(bits(index)) * 2.3283064365386963e-10f; }
};

// ceil(p * 2**32) for p in [0, 1]: dropout keeps an element iff its bits are >= this.
CE_HOST_DEVICE uint64_t dropout_keep_threshold(double p) {
  if (!(p > 0.0)) return 0;
  if (p >= 1.0) return uint64_t(1) << 32;
  return uint64_t(std::ceil(p * 4294967296.0));
}

// What multiplies a kept element: 1 / (1 - p), and 0 for p = 1 (nothing is kept).
CE_HOST_DEVICE float dropout_keep_scale(double p) { return p >= 1.0 ? 0.f : float(1.0 / (1.0 - p)); }

// The generic interface: does dropout with this threshold keep element `index` under `seed`?
CE_HOST_DEVICE bool dropout_keep(CounterRng const& rng, uint64_t index, uint64_t threshold) {
  return uint64_t(rng.bits(index)) >= threshold;
}
CE_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t index, double p) {
  return dropout_keep(CounterRng(seed), index, dropout_keep_threshold(p));
}

}  // namespace cutlass_ext
