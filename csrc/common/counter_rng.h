// Counter-based random numbers for dropout masks: a pure function of (seed, index), so a forward
// kernel and its backward regenerate the same mask without storing it, and any thread can draw the
// number of any element. Torch-free; host and device (CE_HOST_DEVICE).
//
// Definition (all arithmetic on uint32 lanes, wrapping mod 2**32):
//   mix(x)  = x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15
//             (a 32-bit bijection with full avalanche; both multipliers < 2**31, so the Python twin
//             can evaluate it in int64 without overflow)
//   key:      k0 = mix(lo(seed) ^ 0x9e3779b9),  k1 = mix(hi(seed) ^ k0 ^ 0x7f4a7c15),
//             m = mix(k1 ^ 0x85ebca6b) | 1       (an odd multiplier that depends on all 64 seed bits)
//   bits(n) = mix(m * lo(n) + k1 * hi(n) + k0)              (n: a 64-bit counter)
//   draw(i) = 16 bits of bits(i >> 1): the low half for even i, the high half for odd i
//             (element i's draw; one 32-bit hash serves two neighbouring elements)
//   dropout keeps element i iff draw(i) >= keep_threshold(p) = ceil(p * 2**16), an integer
//   compare, so every implementation agrees bit for bit; p = 1 gives 2**16 and keeps nothing.
//   The keep probability is 1 - ceil(p * 2**16) / 2**16: p rounded up to a multiple of 2**-16.
//
// One mix per hash: consecutive counters feed mix an arithmetic progression of odd step m, so a
// run of pairs costs one add and one mix each, and counters below 2**32 (tensors up to 2**33
// elements) get distinct inputs. The step is seed-dependent on purpose: with a fixed step, two
// seeds' masks would be shifted copies of each other (their inputs differ by a constant); with
// steps m and m' they meet only where m * n + k0 = m' * n' + k0', scattered over 2**32 counters.
// Past 2**32 counters the inputs repeat: counter (h + 1, lo) hashes as (h, lo + k1 / m mod 2**32),
// so in a tensor of more than 2**33 elements each further 2**33-element block has the first one's
// mask rotated by a seed-dependent offset.
// cutlass_ext/ops/_rng.py is the bit-exact Python twin; a test compares the two.
//
// Kernels compare in the high half of a word: draw(i) >= t iff (draw(i) << 16) >= compare_threshold(t),
// where the high-half value of an even element is bits << 16; an odd element compares the whole
// word bits (its low half cannot lift it past t << 16), with t = 2**16 handled apart (dropout_keep_run).
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

// The generator of one seed. `bits(n)` is the 32-bit hash of counter n: mix of `mix_input(n)`, and
// the input of counter n + j is mix_input(n) + j * m while the high half stays (dropout_keep_run).
struct CounterRng {
  uint32_t k0, k1, m;

  CE_HOST_DEVICE explicit CounterRng(uint64_t seed)
      : k0(rng_mix32(uint32_t(seed) ^ 0x9e3779b9u)),
        k1(rng_mix32(uint32_t(seed >> 32) ^ k0 ^ 0x7f4a7c15u)),
        m(rng_mix32(k1 ^ 0x85ebca6bu) | 1u) {}

  CE_HOST_DEVICE uint32_t mix_input(uint64_t counter) const {
    return m * uint32_t(counter) + k1 * uint32_t(counter >> 32) + k0;
  }
  CE_HOST_DEVICE uint32_t bits(uint64_t counter) const { return rng_mix32(mix_input(counter)); }
  // Element i's 16-bit draw.
  CE_HOST_DEVICE uint32_t draw(uint64_t index) const {
    return (bits(index >> 1) >> ((index & 1) * 16)) & 0xffffu;
  }
};

// ceil(p * 2**16) for p in [0, 1]: dropout keeps an element iff its draw is >= this.
CE_HOST_DEVICE uint32_t dropout_keep_threshold(double p) {
  if (!(p > 0.0)) return 0;
  if (p >= 1.0) return 1u << 16;
  return uint32_t(std::ceil(p * 65536.0));
}

// The threshold in compare form: draw << 16 >= this iff draw >= t. t = 2**16 maps to a value no
// shifted draw reaches (their low 16 bits are zero).
CE_HOST_DEVICE uint32_t dropout_compare_threshold(uint32_t t) { return t >= (1u << 16) ? 0xffff0001u : t << 16; }

// What multiplies a kept element: 1 / (1 - p), and 0 for p = 1 (nothing is kept).
CE_HOST_DEVICE float dropout_keep_scale(double p) { return p >= 1.0 ? 0.f : float(1.0 / (1.0 - p)); }

// Keep flags of kN elements index, index + 1, ... with `cmp` = dropout_compare_threshold(t). One
// element (kN = 1) at any index; kN >= 2 from kN / 2 hashes, with the precondition that index is a
// multiple of kN (a power of two), so that the pairs share their high 32 counter bits. The vector
// paths of the kernels number their vectors that way.
template <int kN>
CE_HOST_DEVICE void dropout_keep_run(CounterRng const& rng, uint64_t index, uint32_t cmp, bool (&keep)[kN]) {
  static_assert(kN >= 1 && (kN & (kN - 1)) == 0, "kN must be a power of two");
  if constexpr (kN == 1) {
    keep[0] = (rng.draw(index) << 16) >= cmp;
  } else {
    // The pairs share their high counter bits, so their mix inputs step by m from the first one's.
    // An odd element compares the whole word: for t < 2**16 (cmp = t << 16), h >= cmp iff h's high
    // half is >= t, so no mask is needed; t = 2**16 keeps nothing, a flag the compare ANDs in.
    const bool some_kept = cmp <= 0xffff0000u;
    uint32_t input = rng.mix_input(index >> 1);
#pragma unroll
    for (int j = 0; j < kN / 2; ++j, input += rng.m) {
      const uint32_t h = rng_mix32(input);
      keep[2 * j] = (h << 16) >= cmp;
      keep[2 * j + 1] = some_kept && h >= cmp;
    }
  }
}

}  // namespace cutlass_ext
