#include "elementwise/layer_norm_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/activation.h"
#include "common/cluster_rows.cuh"
#include "common/counter_rng.h"
#include "common/device_utils.cuh"

namespace cutlass_ext {
namespace {

// ---------------------------------------------------------------------------------------------
// Forward kernel choice, by row length in vectors (nv = ceil(cols / kVec), kVec = 16 bytes of
// elements on the vector path, 1 on the scalar path). A row is held in registers by kTpr threads,
// kVecs vectors each, so it is read from memory once:
//   nv <= 4, 8, 16, 32     kTpr = 4, 8, 16, 32, kVecs = 1     256-thread blocks, two rows per group
//   nv <= 64, 128, 256     kTpr = 16, 32, 64, kVecs = 4       64-thread blocks (4, 2, 1 rows each)
//   nv <= 512, 1024        kTpr = 128, 256, kVecs = 4         a block per row (bf16 C <= 8192)
//   longer rows            on the vector path, a row of up to 64 KB is copied into one block's
//                          shared memory once (cp.async) and both passes read it from there (one
//                          statistics pass about a per-thread shift; 256-thread blocks where
//                          four rows fit an SM, else 512); a longer row is split over a cluster
//                          of 2-8 blocks, each holding a slice in its shared memory (64 KB where
//                          8 suffice), the slices' moments merged through distributed shared
//                          memory. Rows over ~900 KB (slices that would leave one block an SM):
//                          a cluster of 8 whose blocks hold 64 KB of their slice and read the
//                          rest twice. Otherwise (no clusters, or the scalar path) a block per
//                          row, 512 threads and two passes over the row in memory, with statistics by
//                          exact per-vector moments combined with Chan's formula, so a large
//                          mean does not cancel the variance.
// The backward holds one vector per thread (with_backward_row_config) up to nv = 1024.

// kRows: rows per thread group (the forward kernel's; the backward kernels take one).
template <int kVecs_, int kTpr_, int kThreads_, int kRows_ = 1>
struct RowConfig {
  static constexpr int kVecs = kVecs_, kTpr = kTpr_, kThreads = kThreads_, kRows = kRows_;
  static constexpr int kRowsPerBlock = kThreads / kTpr;
};

// Calls fn(std::integral_constant<int, P>{}) with P the row length nv rounded up to a power of
// two (at least 4); returns false for rows of more than 1024 vectors, too long for registers.
template <class Fn>
bool with_row_vectors(int64_t nv, Fn&& fn) {
  if (nv <= 4) return fn(std::integral_constant<int, 4>{}), true;
  if (nv <= 8) return fn(std::integral_constant<int, 8>{}), true;
  if (nv <= 16) return fn(std::integral_constant<int, 16>{}), true;
  if (nv <= 32) return fn(std::integral_constant<int, 32>{}), true;
  if (nv <= 64) return fn(std::integral_constant<int, 64>{}), true;
  if (nv <= 128) return fn(std::integral_constant<int, 128>{}), true;
  if (nv <= 256) return fn(std::integral_constant<int, 256>{}), true;
  if (nv <= 512) return fn(std::integral_constant<int, 512>{}), true;
  if (nv <= 1024) return fn(std::integral_constant<int, 1024>{}), true;
  return false;
}

// Calls fn(RowConfig<...>{}) with the forward's row-in-registers configuration for rows of nv
// vectors; returns false when the row is too long for one. From 33 vectors on, each thread holds
// four vectors of one row (64 bytes of a 16-bit row) in blocks of at least 64 threads. Measured
// on an H200 (bf16, forward alone, against the earlier two vectors a thread in 256-thread blocks
// with two rows per group, or 512-thread blocks at 8192 columns; bench/NOTES.md section 19):
// 65536x512 40.0 -> 38.2 us, 32768x1024 40.8 -> 38.3, 16384x2048 40.6 -> 37.6, 32768x4096
// 144.1 -> 135.9, 8192x8192 93.1 -> 74.8; with relu 5-17% faster. The short rows keep one
// vector a thread and two rows per group in 256-thread blocks (1.08-1.14x over one row).
template <class Fn>
bool with_row_config(int64_t nv, Fn&& fn) {
  return with_row_vectors(nv, [&](auto vectors) {
    constexpr int kVectors = decltype(vectors)::value;
    if constexpr (kVectors <= 32) {
      fn(RowConfig<1, kVectors, 256, 2>{});
    } else {
      constexpr int kTpr = kVectors / 4;
      fn(RowConfig<4, kTpr, (kTpr > 64 ? kTpr : 64)>{});
    }
  });
}

// The backward's rows in registers: one vector per thread, as many threads per row as the row
// has vectors (rounded up to a power of two), blocks of at least 256 threads. The backward keeps
// x, dy and the dweight/dbias accumulators of each of its vectors in registers: with two vectors
// a thread it needed ~104 registers, two 256-thread blocks per SM (25% occupancy), and ran
// latency-bound at ~35% of DRAM bandwidth (bench/NOTES.md, section 7); with one it needs 64, and
// every config keeps 1024 threads per SM resident.
template <class Fn>
bool with_backward_row_config(int64_t nv, Fn&& fn) {
  return with_row_vectors(nv, [&](auto vectors) {
    constexpr int kVectors = decltype(vectors)::value;
    fn(RowConfig<1, kVectors, (kVectors > 256 ? kVectors : 256)>{});
  });
}

constexpr int kLongThreads = 512;
// Threads of the shared-memory forward (one row per block): 256 where four rows fit one SM's
// shared memory, else kLongThreads. The registers allow two 512-thread or four 256-thread blocks
// per SM, so the narrower blocks keep twice the rows in flight: measured on an H200, 16384x10240
// bf16 1.37x and 8192x16384 1.16x faster; 4096x32768 (three rows fit) was not, and neither was
// the backward's dx kernel (x and dy in shared memory) with 256 threads (bench/NOTES.md).
constexpr int kSharedNarrowThreads = 256;
constexpr int kSharedNarrowMinRows = 4;
// Threads of the forward's cluster CTAs where a slice takes the wide block (three 64 KB slices an
// SM): 384, not kLongThreads. Measured on an H200 against 512 (bench/NOTES.md section 52):
// relu+affine 1.14x at 512x262144, 1.07x at 1024x131072, 1.02x at 2048x65536; the one-CTA rows
// kept 512 (384 measured 0.92x at 4096x32768).
constexpr int kClusterWideThreads = 384;
constexpr int kColThreadsX = 32, kColThreadsY = 8;  // the long path's dweight/dbias column kernel
constexpr int kFinalizeThreadsY = 16;

int vec_width_of(DType dtype) { return dtype == DType::kF32 ? 4 : 8; }

bool vector_ok(const void* ptr, int64_t ld, int vec) { return ptr == nullptr || (aligned16(ptr) && ld % vec == 0); }

bool forward_vectorizable(LayerNormParams const& p) {
  const int vec = vec_width_of(p.dtype);
  return p.cols % vec == 0 && vector_ok(p.x, p.x_ld, vec) && vector_ok(p.y, p.y_ld, vec) &&
         vector_ok(p.weight, 0, vec) && vector_ok(p.bias, 0, vec);
}

bool backward_vectorizable(LayerNormBackwardParams const& p) {
  const int vec = vec_width_of(p.dtype);
  return p.cols % vec == 0 && vector_ok(p.grad, p.grad_ld, vec) && vector_ok(p.x, p.x_ld, vec) &&
         vector_ok(p.grad_x, p.grad_x_ld, vec) && vector_ok(p.weight, 0, vec);
}

// ---------------------------------------------------------------------------------------------
// Device helpers


// weight (or 1) and bias (or 0) of kVec columns.
template <class T, int kVec>
__device__ __forceinline__ void load_affine(const void* weight, const void* bias, int64_t col, float (&w)[kVec],
                                            float (&b)[kVec]) {
  if (weight != nullptr) {
    load_vec<T, kVec>(static_cast<const T*>(weight) + col, w);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) w[j] = 1.f;
  }
  if (bias != nullptr) {
    load_vec<T, kVec>(static_cast<const T*>(bias) + col, b);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = 0.f;
  }
}

// The dropout seed (one int64 in device memory), read where a kernel starts so that the load's
// round trip overlaps the row's loads instead of following the statistics; 0 with dropout off.
template <bool kOn>
__device__ __forceinline__ uint64_t dropout_seed(DropoutParams const& d) {
  if constexpr (kOn) {
    return uint64_t(__ldg(d.seed));
  } else {
    return 0;
  }
}

// Dropout of kVec adjacent elements numbered index, index + 1, ... (in place). On or off at
// compile time: off, apply() is never reached and the keys hold no registers.
struct Dropout {
  CounterRng rng;
  uint32_t cmp;  // dropout_compare_threshold of the keep threshold
  float scale;
  bool on;

  // `seed` from dropout_seed<kOn>: the keys are derived here, after the loads that hide its fetch.
  template <bool kOn>
  static __device__ __forceinline__ Dropout make(DropoutParams const& d, uint64_t seed) {
    if constexpr (kOn) {
      return Dropout{CounterRng(seed), dropout_compare_threshold(d.keep_threshold), d.keep_scale, true};
    } else {
      return Dropout{CounterRng(0), 0, 1.f, false};
    }
  }
  // The same reading the seed here, where nothing else is loaded before the mask is first drawn.
  template <bool kOn>
  static __device__ __forceinline__ Dropout make(DropoutParams const& d) {
    return make<kOn>(d, dropout_seed<kOn>(d));
  }

  // `index` is a multiple of kVec: the vector paths take rows of a multiple of kVec columns and
  // pieces at multiples of kVec (dropout_keep_run's precondition).
  template <int kVec>
  __device__ __forceinline__ void apply(float (&v)[kVec], uint64_t index) const {
    bool keep[kVec];
    dropout_keep_run<kVec>(rng, index, cmp, keep);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = keep[j] ? v[j] * scale : 0.f;
  }

  // Zeroes the dropped elements of the kVec-element piece at `piece` (in shared memory), unscaled:
  // a later pass over the piece then needs only KeptScale, not the mask.
  template <class T, int kVec>
  __device__ __forceinline__ void zero_dropped(T* piece, uint64_t index) const {
    bool keep[kVec];
    dropout_keep_run<kVec>(rng, index, cmp, keep);
    Pack<T, kVec> v = load_pack<T, kVec>(piece);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v.v[j] = keep[j] ? v.v[j] : T(0.f);
    store_pack<T, kVec>(piece, v);
  }
};

// Dropout's backward on a piece whose dropped elements are already zero (Dropout::zero_dropped):
// the kept ones' scale. Gives the same bits as Dropout::apply on the unzeroed piece.
struct KeptScale {
  static constexpr bool on = true;
  float scale;

  template <int kVec>
  __device__ __forceinline__ void apply(float (&v)[kVec], uint64_t) const {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] *= scale;
  }
};

// Sum over the kTpr threads that share a row (kTpr consecutive threads). Every thread of the block
// must call it (kTpr > 32 synchronizes the block); `scratch` holds one float per warp. Sums are
// added in a fixed order, so every thread of a group gets the same bits.
template <int kTpr>
__device__ __forceinline__ float group_sum(float v, float* scratch) {
  if constexpr (kTpr <= 32) {
#pragma unroll
    for (int offset = kTpr / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  } else {
    constexpr int kWarps = kTpr / 32;
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) scratch[warp] = v;
    __syncthreads();
    const int first = warp / kWarps * kWarps;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[first + w];
    return total;
  }
}

// Both sums of (a, b) over the kTpr threads that share a row, for every thread of the group, added
// in the same fixed order as group_sum. Every thread of the block must call it. kTpr > 32 exchanges
// the warps' sums through `scratch` (2 * kThreads / 32 float2): alternate calls must pass alternate
// `parity`, so that one barrier a call suffices (a call's buffer is written again only two calls
// later, after every thread has passed the barrier of the call in between).
template <int kTpr, int kThreads>
__device__ __forceinline__ float2 group_sum2(float a, float b, float2* scratch, int parity) {
  if constexpr (kTpr <= 32) {
    return make_float2(group_sum<kTpr>(a, nullptr), group_sum<kTpr>(b, nullptr));  // shuffles only
  } else {
    constexpr int kWarps = kTpr / 32;
    a = warp_sum(a);
    b = warp_sum(b);
    float2* buf = scratch + parity * (kThreads / 32);
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) buf[warp] = make_float2(a, b);
    __syncthreads();
    const int first = warp / kWarps * kWarps;
    float2 total = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 v = buf[first + w];
      total.x += v.x;
      total.y += v.y;
    }
    return total;
  }
}

// Count, mean and sum of squared deviations of a set of values; merged with Chan's formula.
struct Moments {
  float n, mean, m2;
};

__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  const float n = a.n + b.n;
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float delta = b.mean - a.mean;
  const float wb = b.n / n;
  return {n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
}

// Moments of the whole block, returned to every thread (merged in a fixed order).
template <int kThreads>
__device__ Moments block_moments(Moments m) {
  __shared__ Moments warp_moments[kThreads / 32];
  __shared__ Moments total;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Moments other{__shfl_down_sync(0xffffffffu, m.n, offset), __shfl_down_sync(0xffffffffu, m.mean, offset),
                        __shfl_down_sync(0xffffffffu, m.m2, offset)};
    m = merge(m, other);
  }
  if ((threadIdx.x & 31) == 0) warp_moments[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    Moments t = warp_moments[0];
    for (int w = 1; w < kThreads / 32; ++w) t = merge(t, warp_moments[w]);
    total = t;
  }
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------------------------
// Forward

template <class T, int kVec>
__device__ __forceinline__ void normalize_store(LayerNormParams const& p, Dropout const& drop, int64_t row,
                                                int64_t col, float (&h)[kVec], float mean, float rstd) {
  float w[kVec], b[kVec];
  load_affine<T, kVec>(p.weight, p.bias, col, w, b);
#pragma unroll
  for (int j = 0; j < kVec; ++j) h[j] = (h[j] - mean) * rstd * w[j] + b[j];
  if (drop.on) drop.apply<kVec>(h, uint64_t(row) * uint64_t(p.cols) + uint64_t(col));
  store_vec<T, kVec>(static_cast<T*>(p.y) + row * p.y_ld + col, h);
}

// kVec elements of T as loaded: 16-bit elements in pairs per 32-bit word, so that the packs
// held across the reductions (x, weight and bias) cost kVec * sizeof(T) / 4 registers and each
// element converts to fp32 in one instruction (a shift or a mask for bf16).
template <class T, int kVec>
struct RawVec {
  static constexpr int kWords = (kVec * int(sizeof(T)) + 3) / 4;
  uint32_t w[kWords];
};

template <class T, int kVec>
__device__ __forceinline__ RawVec<T, kVec> load_raw(const T* src) {
  RawVec<T, kVec> r;
  if constexpr (kVec * sizeof(T) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(src);
    r.w[0] = u.x, r.w[1] = u.y, r.w[2] = u.z, r.w[3] = u.w;
  } else if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) r.w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    static_assert(kVec == 1, "16-bit raw vectors are 16 bytes or one element");
    r.w[0] = *reinterpret_cast<const uint16_t*>(src);
  }
  return r;
}

// Every element equal to v.
template <class T, int kVec>
__device__ __forceinline__ RawVec<T, kVec> raw_fill(float v) {
  const T t(v);
  uint32_t bits = 0;
  memcpy(&bits, &t, sizeof(T));
  RawVec<T, kVec> r;
#pragma unroll
  for (int i = 0; i < RawVec<T, kVec>::kWords; ++i) r.w[i] = sizeof(T) == 4 ? bits : (bits | (bits << 16));
  return r;
}

template <class T, int kVec>
__device__ __forceinline__ float raw_at(RawVec<T, kVec> const& r, int j) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(r.w[j]);
  } else if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    const uint32_t w = r.w[j >> 1];
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    const uint32_t w = r.w[j >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((j & 1) ? (w >> 16) : (w & 0xffffu))));
  }
}

// A raw piece of x as the normalization sees it: relu'd on the raw words when kRelu, NaN kept
// (PTX max.NaN, sm_80 and later), two 16-bit elements in one instruction. A compare and a select per
// element cost two; max(-0, +0) gives +0 where relu(-0) is -0, which is the same once the mean is
// subtracted.
template <bool kRelu, class T, int kVec>
__device__ __forceinline__ RawVec<T, kVec> raw_input(RawVec<T, kVec> r) {
  if constexpr (kRelu) {
#pragma unroll
    for (int i = 0; i < RawVec<T, kVec>::kWords; ++i) {
      if constexpr (sizeof(T) == 4) {
        float v = __uint_as_float(r.w[i]);
        asm("max.NaN.f32 %0, %1, %2;" : "=f"(v) : "f"(v), "f"(0.f));
        r.w[i] = __float_as_uint(v);
      } else if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
        asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r.w[i]) : "r"(r.w[i]), "r"(0u));
      } else {
        asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r.w[i]) : "r"(r.w[i]), "r"(0u));
      }
    }
  }
  return r;
}

// Rows held in registers: kTpr threads per row, exact two-pass statistics over the registers,
// kRows rows per thread group (rows kGroups apart), so that one load of the group's weight and
// bias serves kRows rows and the rows' reductions interleave. Every load of a thread (its x
// vectors of every row, then its weight and bias) is issued before any value is used, so the
// rows cost one memory round trip; addresses past a row's end are clamped to its first vector
// and their values ignored. The kernel is issue-bound (ncu: ~70% of issue slots busy at ~60% of
// DRAM bandwidth), so instructions count: the loads stay raw 32-bit words until used (RawVec),
// relu is a template parameter, and an absent weight or bias is a constant pack rather than a
// select per element (bench/NOTES.md section 10). One wave of short blocks after another: a
// persistent grid that kept weight and bias in registers and prefetched the next row measured
// slower, and so did one that streamed rows through shared memory with cp.async.
template <class T, int kVec, int kVecs, int kTpr, int kThreads, bool kRelu, bool kDropout, int kRows>
__global__ void __launch_bounds__(kThreads) layer_norm_fwd_rows_kernel(LayerNormParams p) {
  constexpr int kGroups = kThreads / kTpr;
  constexpr int kRowsPerBlock = kGroups * kRows;
  __shared__ float scratch[kThreads / 32];
  const int lane = threadIdx.x % kTpr;
  const int cols = int(p.cols);  // at most 1024 vectors in registers
  const int64_t first = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kTpr;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);

  int col[kVecs];
  bool col_ok[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    col[i] = (i * kTpr + lane) * kVec;
    col_ok[i] = col[i] < cols;
  }
  bool row_ok[kRows];
  RawVec<T, kVec> xs[kRows][kVecs], ws[kVecs], bs[kVecs];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = first + r * kGroups;
    row_ok[r] = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + (row_ok[r] ? row : 0) * p.x_ld;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) xs[r][i] = load_raw<T, kVec>(x + (col_ok[i] ? col[i] : 0));
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int c = col_ok[i] ? col[i] : 0;
    ws[i] = weight != nullptr ? load_raw<T, kVec>(weight + c) : raw_fill<T, kVec>(1.f);
    bs[i] = bias != nullptr ? load_raw<T, kVec>(bias + c) : raw_fill<T, kVec>(0.f);
  }
  const uint64_t seed = dropout_seed<kDropout>(p.dropout);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) xs[r][i] = raw_input<kRelu>(xs[r][i]);
  }

  auto h_at = [&](int r, int i, int j) { return raw_at<T, kVec>(xs[r][i], j); };
  // This thread's sum of term(h) over the valid columns of row r (per vector, then masked).
  auto row_sum = [&](int r, auto term) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) s += term(h_at(r, i, j));
      if (col_ok[i]) total += s;
    }
    return total;
  };
  const float inv_cols = __frcp_rn(float(cols));
  float mean[kRows], rstd[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) mean[r] = row_sum(r, [](float h) { return h; });
#pragma unroll
  for (int r = 0; r < kRows; ++r) mean[r] = group_sum<kTpr>(mean[r], scratch) * inv_cols;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    rstd[r] = row_sum(r, [&](float h) {
      const float d = h - mean[r];
      return d * d;
    });
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) rstd[r] = rsqrtf(group_sum<kTpr>(rstd[r], scratch) * inv_cols + p.eps);
  const Dropout drop = Dropout::make<kDropout>(p.dropout, seed);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!row_ok[r]) continue;
    const int64_t row = first + r * kGroups;
    if (lane == 0) {
      p.mean[row] = mean[r];
      p.rstd[row] = rstd[r];
    }
    T* y = static_cast<T*>(p.y) + row * p.y_ld;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!col_ok[i]) continue;
      float h[kVec];
      // (h - mean) * rstd, not h * rstd - mean * rstd: one instruction more, but no cancellation
      // when the mean is large against the spread (and exactly 0 for a one-column row).
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        h[j] = fmaf((h_at(r, i, j) - mean[r]) * rstd[r], raw_at<T, kVec>(ws[i], j), raw_at<T, kVec>(bs[i], j));
      }
      if (drop.on) drop.apply<kVec>(h, uint64_t(row) * uint64_t(cols) + uint64_t(col[i]));
      store_vec<T, kVec>(y + col[i], h);
    }
  }
}

// Per-vector moments of kVec values (relu first when asked), merged into m.
template <int kVec>
__device__ __forceinline__ void add_vector_moments(Moments& m, float (&h)[kVec], bool relu) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if (relu) h[j] = act::relu(h[j]);
    s += h[j];
  }
  const float vmean = s / float(kVec);
  float vm2 = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) vm2 += (h[j] - vmean) * (h[j] - vmean);
  m = merge(m, Moments{float(kVec), vmean, vm2});
}

// The row's mean and rstd from its moments; thread 0 stores them for the backward.
__device__ __forceinline__ float2 finish_statistics(LayerNormParams const& p, Moments const& m, int64_t row) {
  const float mean = m.mean;
  const float rstd = rsqrtf(m.m2 / float(p.cols) + p.eps);
  if (threadIdx.x == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  return make_float2(mean, rstd);
}

// Normalizes (relu first when asked) and stores the kVec elements of column col read from src.
template <class T, int kVec>
__device__ __forceinline__ void normalize_piece(LayerNormParams const& p, Dropout const& drop, int64_t row,
                                                int64_t col, const T* src, float2 stats) {
  float h[kVec];
  load_vec<T, kVec>(src, h);
  if (p.relu) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = act::relu(h[j]);
  }
  normalize_store<T, kVec>(p, drop, row, col, h, stats.x, stats.y);
}

// Rows in shared memory (vector path): a block per row; the statistics pass starts on the first
// column group while the others are still being copied in, and the normalize pass reads the row
// from shared memory, so x is read from memory once. The kernel is instruction-bound (ncu at
// 8192x16384 bf16: ~77% of issue slots busy at ~57% of DRAM bandwidth), so:
//  - one statistics pass, not two: each thread sums d = h - shift and d * d, its shift being its
//    own first element, and the squared deviations from the row mean follow from those sums
//    (sum (d - delta)^2 = sum d^2 - 2 delta sum d + n delta^2, delta = mean - shift). The shift
//    is one of the thread's own values, so the cancellation is bounded by a few times the
//    thread's element count in fp32 roundings, the order of the summation's own error; a large
//    common offset of the row cancels exactly as in the two-pass form;
//  - pieces are read as raw words and converted when used, relu at compile time;
//  - whether weight and bias exist is decided once per block, not per piece.
// kCluster: the row is split over a cluster of CTAs (common/cluster_rows.cuh), `slice` columns
// each; every CTA takes its slice's mean and squared deviations as above, and the slices'
// moments are merged as sums over the ranks in every CTA alike (cluster_butterfly).
//
// kSpill (with kCluster): the slice is longer than the CTA's shared memory for it; its first
// `held` columns are copied in as above and the rest (the tail) is read from memory in the
// statistics pass and read again in the normalize pass. The tails of the CTAs in flight (64 KB
// each for 1 MB rows, 25 MB in all) are meant to stay within L2 for the second read, where the
// one-block two-pass kernel's rows in flight (a whole row per block) cannot. Tail pieces are read
// kSpillBatch at a time, so a thread keeps that many loads in flight. Measured on an H200 against
// that kernel: 1.07x at fp32 512x262144, 1.5x at 128x1048576 (bench/NOTES.md section 62).
constexpr int kSpillBatch = 4;

// Calls use(col, piece) for the pieces of src at columns first, first + stride, ... below n, the
// loads of kBatch pieces issued before any of them is used.
template <int kBatch, class T, int kVec, class Use>
__device__ __forceinline__ void for_pieces_batched(const T* src, int first, int n, int stride, Use&& use) {
  for (int base = first; base < n; base += kBatch * stride) {
    RawVec<T, kVec> r[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (base + b * stride < n) r[b] = load_raw<T, kVec>(src + base + b * stride);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (base + b * stride < n) use(base + b * stride, r[b]);
    }
  }
}

template <class T, int kThreads, bool kRelu, bool kDropout, bool kCluster, bool kSpill = false>
__device__ __forceinline__ void layer_norm_fwd_shared_row(LayerNormParams const& p, int slice, int held = 0) {
  static_assert(kCluster || !kSpill, "a slice spills only in a cluster");
  constexpr int kVec = vec_width<T>();
  extern __shared__ __align__(16) unsigned char shared_row_raw[];
  T* row_s = reinterpret_cast<T*>(shared_row_raw);
  const int64_t row = kCluster ? cluster_row() : int64_t(blockIdx.x);
  const int cols = int(p.cols);  // the row (or its slice) fits in shared memory, or the launcher checked int
  const RowSlice part = kCluster ? cluster_slice(p.cols, slice) : RowSlice{0, cols};
  const T* x_part = static_cast<const T*>(p.x) + row * p.x_ld + part.begin;
  const int in_smem = kSpill ? min(part.n, held) : part.n;  // held: a multiple of kVec
  copy_row_async(row_s, x_part, in_smem);
  const uint64_t seed = dropout_seed<kDropout>(p.dropout);
  const int stride = int(blockDim.x) * kVec;

  // The shift: this thread's first element (its round 0, in group 0; a thread with no piece at all
  // has nothing to sum). With a tail it is read from memory (measured so; it is in L2 or on its way).
  const int own_first = int(threadIdx.x) * kVec;
  if constexpr (!kSpill) wait_row_group(0);
  const float shift =
      own_first < part.n
          ? raw_at<T, kVec>(raw_input<kRelu>(load_raw<T, kVec>((kSpill ? x_part : row_s) + own_first)), 0)
          : 0.f;
  float s1 = 0.f, s2 = 0.f;
  int count = 0;
  auto add_piece = [&](RawVec<T, kVec> const& r) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = raw_at<T, kVec>(r, j) - shift;
      s1 += d;
      s2 = fmaf(d, d, s2);
    }
    count += kVec;
  };
  for_own_pieces_landing<T>(in_smem, [&](int col) { add_piece(raw_input<kRelu>(load_raw<T, kVec>(row_s + col))); });
  if constexpr (kSpill) {
    // The tail after the held part, so that little traffic passes through L2 between the tail's
    // first read and its second (below). With y's evict-first stores, 1.00-1.06x as fast on an
    // H200 as reading the tail first, while the held columns' copies land (DRAM read at fp32
    // 512 x 262144: 659 -> 622 MB for the order alone; bench/NOTES.md section 63).
    for_pieces_batched<kSpillBatch, T, kVec>(x_part, in_smem + own_first, part.n, stride,
                                             [&](int, RawVec<T, kVec> const& r) { add_piece(raw_input<kRelu>(r)); });
  }
  __shared__ float scratch[kThreads / 32];
  const float inv_cols = __frcp_rn(float(cols));
  float mean, rstd;
  if constexpr (kCluster) {
    const float inv_n = part.n > 0 ? __frcp_rn(float(part.n)) : 0.f;
    const float slice_mean = group_sum<kThreads>(fmaf(float(count), shift, s1), scratch) * inv_n;
    const float delta = slice_mean - shift;
    const float slice_m2 = group_sum<kThreads>(fmaf(delta, fmaf(float(count), delta, -2.f * s1), s2), scratch);
    // The slices' moments merged as sums over the ranks: the row mean from the slices' sums, then
    // the squared deviations as each slice's own plus its count times its mean's squared distance
    // from the row mean (an exact decomposition; every term is >= 0).
    __shared__ Moments slot;
    const Moments own = cluster_gather(Moments{float(part.n), slice_mean, fmaxf(slice_m2, 0.f)}, &slot,
                                       Moments{0.f, 0.f, 0.f});
    const auto add = [](float a, float b) { return a + b; };
    mean = cluster_butterfly(own.n * own.mean, add) * inv_cols;
    const float d = own.mean - mean;
    rstd = rsqrtf(cluster_butterfly(fmaf(own.n * d, d, own.m2), add) * inv_cols + p.eps);
  } else {
    mean = group_sum<kThreads>(fmaf(float(count), shift, s1), scratch) * inv_cols;
    const float delta = mean - shift;
    const float own_m2 = fmaf(delta, fmaf(float(count), delta, -2.f * s1), s2);
    rstd = rsqrtf(fmaxf(group_sum<kThreads>(own_m2, scratch) * inv_cols, 0.f) + p.eps);
  }
  if (threadIdx.x == 0 && part.begin == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  const Dropout drop = Dropout::make<kDropout>(p.dropout, seed);
  const T* weight = static_cast<const T*>(p.weight) + (p.weight != nullptr ? part.begin : 0);
  const T* bias = static_cast<const T*>(p.bias) + (p.bias != nullptr ? part.begin : 0);
  T* y = static_cast<T*>(p.y) + row * p.y_ld + part.begin;
  const uint64_t first_index = uint64_t(row) * uint64_t(cols) + uint64_t(part.begin);
  auto normalize = [&](auto has_weight, auto has_bias) {
    auto piece = [&](int col, RawVec<T, kVec> const& r) {
      RawVec<T, kVec> w, b;
      if constexpr (decltype(has_weight)::value) {
        w = load_raw<T, kVec>(weight + col);
      } else {
        w = raw_fill<T, kVec>(1.f);
      }
      if constexpr (decltype(has_bias)::value) {
        b = load_raw<T, kVec>(bias + col);
      } else {
        b = raw_fill<T, kVec>(0.f);
      }
      float h[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        h[j] = fmaf((raw_at<T, kVec>(r, j) - mean) * rstd, raw_at<T, kVec>(w, j), raw_at<T, kVec>(b, j));
      }
      if (drop.on) drop.apply<kVec>(h, first_index + uint64_t(col));
      // The spill kernel's y evict-first (st.global.cs), which leaves more of the tails in L2 for
      // their second read.
      store_vec<T, kVec, kSpill>(y + col, h);
    };
    if constexpr (kSpill) {
      // The tail again (mostly from L2), kBatch loads in flight before any store: a store to y
      // may alias x as far as the compiler knows, so it would not move later loads above it. Two
      // for 16-bit types, whose pieces take eight floats each: four spilled at 56 registers.
      // The tail goes before the held part: fewer bytes pass through L2 between its two reads
      // (none of the held part's writes), so more of it is still there. On an H200 the DRAM
      // read of an fp32 512 x 262144 forward fell from 816 to 682 MB against the 537 MB of x,
      // and the kernel ran 1.00-1.05x as fast as with the held part first, no shape slower.
      constexpr int kBatch = sizeof(T) == 4 ? kSpillBatch : kSpillBatch / 2;
      for_pieces_batched<kBatch, T, kVec>(x_part, in_smem + own_first, part.n, stride,
                                          [&](int col, RawVec<T, kVec> const& r) { piece(col, raw_input<kRelu>(r)); });
    }
    for_all_own_pieces<T>(in_smem, [&](int col) { piece(col, raw_input<kRelu>(load_raw<T, kVec>(row_s + col))); });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (p.weight != nullptr) {
    p.bias != nullptr ? normalize(Yes{}, Yes{}) : normalize(Yes{}, No{});
  } else {
    p.bias != nullptr ? normalize(No{}, Yes{}) : normalize(No{}, No{});
  }
  if constexpr (kCluster) cluster_release();
}

template <class T, int kThreads, bool kRelu, bool kDropout>
__global__ void __launch_bounds__(kThreads) layer_norm_fwd_shared_kernel(LayerNormParams p) {
  layer_norm_fwd_shared_row<T, kThreads, kRelu, kDropout, false>(p, int(p.cols));
}

// Three 384-thread CTAs an SM (three slices fit its shared memory): at most 56 registers a thread.
// The 256-thread kernels keep no minimum (0): with a minimum of 1 ptxas gave them 46-56 registers
// instead of 29-35.
template <class T, int kThreads, bool kRelu, bool kDropout>
__global__ void __launch_bounds__(kThreads, kThreads == kClusterWideThreads ? 3 : 0)
    layer_norm_fwd_cluster_kernel(LayerNormParams p, int slice) {
  layer_norm_fwd_shared_row<T, kThreads, kRelu, kDropout, true>(p, slice);
}

// Slices longer than their CTA's shared memory (rows over ~900 KB): `held` columns of each in
// shared memory, the rest read twice (kSpill above); three 384-thread CTAs an SM, as above.
template <class T, bool kRelu, bool kDropout>
__global__ void __launch_bounds__(kClusterWideThreads, 3)
    layer_norm_fwd_cluster_spill_kernel(LayerNormParams p, int slice, int held) {
  layer_norm_fwd_shared_row<T, kClusterWideThreads, kRelu, kDropout, true, true>(p, slice, held);
}

// Rows too long for registers: a block per row, statistics pass then normalize pass.
template <class T, int kVec, int kThreads, bool kDropout>
__global__ void __launch_bounds__(kThreads) layer_norm_fwd_long_kernel(LayerNormParams p) {
  const int64_t row = blockIdx.x;
  const int64_t cols = p.cols;
  const T* x = static_cast<const T*>(p.x) + row * p.x_ld;
  const uint64_t seed = dropout_seed<kDropout>(p.dropout);

  Moments m{0.f, 0.f, 0.f};
  for (int64_t col = int64_t(threadIdx.x) * kVec; col < cols; col += int64_t(kThreads) * kVec) {
    float h[kVec];
    load_vec<T, kVec>(x + col, h);
    add_vector_moments<kVec>(m, h, p.relu);
  }
  const float2 stats = finish_statistics(p, block_moments<kThreads>(m), row);
  const Dropout drop = Dropout::make<kDropout>(p.dropout, seed);
  for (int64_t col = int64_t(threadIdx.x) * kVec; col < cols; col += int64_t(kThreads) * kVec) {
    normalize_piece<T, kVec>(p, drop, row, col, x + col, stats);
  }
}

// fn(relu, dropout) with the call's relu and dropout as std::bool_constant values: the forward
// kernels take both at compile time.
template <class Fn>
auto with_relu_dropout(LayerNormParams const& p, Fn&& fn) {
  using Yes = std::true_type;
  using No = std::false_type;
  const bool dropout = p.dropout.seed != nullptr;
  return p.relu ? (dropout ? fn(Yes{}, Yes{}) : fn(Yes{}, No{})) : (dropout ? fn(No{}, Yes{}) : fn(No{}, No{}));
}

template <class T, int kVec>
void launch_forward_vec(LayerNormParams const& p, cudaStream_t stream) {
  const int64_t nv = (p.cols + kVec - 1) / kVec;
  const bool in_registers = with_row_config(nv, [&](auto cfg) {
    using Cfg = decltype(cfg);
    constexpr int kRows = Cfg::kRows;
    constexpr int64_t kRowsPerBlock = int64_t(Cfg::kRowsPerBlock) * kRows;
    const unsigned blocks = unsigned((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
    auto kernel = with_relu_dropout(p, [](auto relu, auto dropout) {
      return layer_norm_fwd_rows_kernel<T, kVec, Cfg::kVecs, Cfg::kTpr, Cfg::kThreads, decltype(relu)::value,
                                        decltype(dropout)::value, kRows>;
    });
    kernel<<<blocks, Cfg::kThreads, 0, stream>>>(p);
  });
  if (in_registers) return;
  int device = 0;
  if constexpr (kVec == vec_width<T>()) {
    // A cluster of `ranks` CTAs holding `slice` columns each, where the row is long; else one CTA
    // per row where the row fits its shared memory.
    auto launch_shared = [&](auto cluster, int ranks) {
      constexpr bool kCluster = decltype(cluster)::value;
      const int slice = kCluster ? row_cluster_slice(p.cols, ranks, kVec) : int(p.cols);
      const bool narrow = shared_rows_that_fit<T>(slice, &device) >= kSharedNarrowMinRows;
      // The kernel for a block size, relu and dropout.
      auto of = [&](auto threads, auto relu, auto dropout) {
        constexpr int kThreads = decltype(threads)::value;
        constexpr bool kRelu = decltype(relu)::value, kDropout = decltype(dropout)::value;
        if constexpr (kCluster) {
          return layer_norm_fwd_cluster_kernel<T, kThreads, kRelu, kDropout>;
        } else {
          return layer_norm_fwd_shared_kernel<T, kThreads, kRelu, kDropout>;
        }
      };
      using Narrow = std::integral_constant<int, kSharedNarrowThreads>;
      using Wide = std::integral_constant<int, kCluster ? kClusterWideThreads : kLongThreads>;
      auto kernel = with_relu_dropout(p, [&](auto relu, auto dropout) {
        return narrow ? of(Narrow{}, relu, dropout) : of(Wide{}, relu, dropout);
      });
      const int threads = narrow ? kSharedNarrowThreads : Wide::value;
      const size_t bytes = size_t(slice) * sizeof(T);
      if (allow_large_dynamic_shared(reinterpret_cast<const void*>(kernel), device) != cudaSuccess) return false;
      if constexpr (kCluster) {
        return launch_row_clusters(kernel, p.rows, ranks, threads, bytes, stream, p, slice);
      } else {
        kernel<<<unsigned(p.rows), threads, bytes, stream>>>(p);
        return true;
      }
    };
    const int64_t rows_that_fit = shared_rows_that_fit<T>(p.cols, &device);
    int ranks = row_cluster_ranks(p.cols * int64_t(sizeof(T)), shared_budget_bytes(device), device);
    // Slices that leave one CTA an SM (rows over ~900 KB) ran slower than the two-pass kernel
    // below (bf16 256x524288: 276 against 240 us; bench/NOTES.md section 41). Softmax keeps them.
    if (ranks > 1 && shared_rows_that_fit<T>(row_cluster_slice(p.cols, ranks, kVec), &device) < 2) ranks = 0;
    if (ranks > 1 && launch_shared(std::true_type{}, ranks)) return;
    if (rows_that_fit >= 1 && launch_shared(std::false_type{}, 1)) return;
    // Longer rows: the most ranks, each holding kRowClusterSliceBytes of its slice in shared
    // memory and reading the rest twice.
    const int spill_ranks = row_cluster_limit(device);
    if (spill_ranks > 1 && p.cols <= int64_t(INT32_MAX) - int64_t(spill_ranks) * kVec) {
      const int slice = row_cluster_slice(p.cols, spill_ranks, kVec);
      const int held = int(kRowClusterSliceBytes / int64_t(sizeof(T)));
      auto kernel = with_relu_dropout(p, [](auto relu, auto dropout) {
        return layer_norm_fwd_cluster_spill_kernel<T, decltype(relu)::value, decltype(dropout)::value>;
      });
      const size_t bytes = size_t(std::min(slice, held)) * sizeof(T);
      if (allow_large_dynamic_shared(reinterpret_cast<const void*>(kernel), device) == cudaSuccess &&
          launch_row_clusters(kernel, p.rows, spill_ranks, kClusterWideThreads, bytes, stream, p, slice, held)) {
        return;
      }
    }
  }
  auto kernel = p.dropout.seed != nullptr ? layer_norm_fwd_long_kernel<T, kVec, kLongThreads, true>
                                          : layer_norm_fwd_long_kernel<T, kVec, kLongThreads, false>;
  kernel<<<unsigned(p.rows), kLongThreads, 0, stream>>>(p);
}

template <class T>
struct ForwardFn {
  void operator()(LayerNormParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    if (forward_vectorizable(p)) {
      launch_forward_vec<T, kVec>(p, stream);
    } else {
      launch_forward_vec<T, 1>(p, stream);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Backward

// dy after dropout's backward, and xhat, of kVec elements; `positive` gets bit `bit + j` set where
// x > 0 (relu's derivative).
// x_src and g_src point at the piece's x and dy (in memory or in shared memory).
// `relu` is p.relu, passed separately so that a kernel templated on it compiles the relu away.
template <class T, int kVec, class Drop>
__device__ __forceinline__ void backward_inputs(LayerNormBackwardParams const& p, Drop const& drop, int64_t row,
                                                int64_t col, Pack<T, kVec> const& xs, Pack<T, kVec> const& gs,
                                                float mean, float rstd, float (&g)[kVec], float (&xhat)[kVec],
                                                uint32_t& positive, int bit, bool relu) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float h = float(xs.v[j]);
    if (relu) {
      positive |= uint32_t(h > 0.f) << (bit + j);
      h = act::relu(h);
    }
    xhat[j] = (h - mean) * rstd;
    g[j] = float(gs.v[j]);
  }
  if (drop.on) drop.apply<kVec>(g, uint64_t(row) * uint64_t(p.cols) + uint64_t(col));
}

template <class T, int kVec, class Drop>
__device__ __forceinline__ void load_backward_inputs_from(LayerNormBackwardParams const& p, Drop const& drop,
                                                          int64_t row, int64_t col, const T* x_src, const T* g_src,
                                                          float mean, float rstd, float (&g)[kVec],
                                                          float (&xhat)[kVec], uint32_t& positive, int bit) {
  backward_inputs<T, kVec>(p, drop, row, col, load_pack<T, kVec>(x_src), load_pack<T, kVec>(g_src), mean, rstd, g,
                           xhat, positive, bit, p.relu);
}

template <class T, int kVec>
__device__ __forceinline__ void load_backward_inputs(LayerNormBackwardParams const& p, Dropout const& drop,
                                                     int64_t row, int64_t col, float mean, float rstd,
                                                     float (&g)[kVec], float (&xhat)[kVec], uint32_t& positive,
                                                     int bit) {
  load_backward_inputs_from<T, kVec>(p, drop, row, col, static_cast<const T*>(p.x) + row * p.x_ld + col,
                                     static_cast<const T*>(p.grad) + row * p.grad_ld + col, mean, rstd, g, xhat,
                                     positive, bit);
}

// Writes the block's fp32 column partials acc[c] into workspace row `part` of plane `plane`
// ([2, parts, cols]: dweight's partials, then dbias's). Groups of one block add in a fixed order
// through shared memory.
template <int kVec, int kVecs, int kTpr, int kThreads>
__device__ __forceinline__ void write_column_partials(LayerNormBackwardParams const& p, int plane,
                                                      const float (&acc)[kVecs][kVec], float* buf) {
  constexpr int kRowsPerBlock = kThreads / kTpr;
  constexpr int kCapacity = kTpr * kVecs * kVec;
  const int lane = threadIdx.x % kTpr;
  float* out = p.workspace + (int64_t(plane) * gridDim.x + blockIdx.x) * p.cols;
  if constexpr (kRowsPerBlock == 1) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t col = (int64_t(i) * kTpr + lane) * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (col + j < p.cols) out[col + j] = acc[i][j];
      }
    }
  } else {
    const int group = threadIdx.x / kTpr;
    __syncthreads();  // buf may still be read for the previous plane
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) buf[group * kCapacity + (i * kTpr + lane) * kVec + j] = acc[i][j];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < p.cols; c += kThreads) {
      float total = 0.f;
#pragma unroll
      for (int r = 0; r < kRowsPerBlock; ++r) total += buf[r * kCapacity + c];
      out[c] = total;
    }
  }
}

// Rows held in registers; the grid strides over rows so that dweight/dbias have one partial row
// per block. At most 64 registers a thread (1024 threads per SM, the occupancy plan_backward
// assumes; up to 40 bytes spill in some 16-bit instantiations). A thread's columns are the same in
// every row, so its weight is loaded once; each row's x, dy, mean and rstd loads are issued
// together before any is used. Loading the next row during this one's reductions needed more
// registers than 64 (up to 192 bytes of spills) and measured 1.5-2x slower (bench/NOTES.md).
// Like the forward, it is issue-bound (ncu at 65536x512 bf16: ~2x the instructions of
// torch.compile's kernel), so relu and dropout are template parameters, the row means are
// multiplications by 1 / cols, and both row sums share one exchange with one barrier. At the
// 64-register cap every register counts: with dropout's state held across the loop, or an IEEE
// division's call before it, ptxas kept the dweight accumulators in local memory (bench/NOTES.md
// section 16).
template <class T, int kVec, int kVecs, int kTpr, int kThreads, bool kRelu, bool kDropout>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) layer_norm_bwd_rows_kernel(LayerNormBackwardParams p) {
  constexpr int kRowsPerBlock = kThreads / kTpr;
  constexpr int kBufFloats = kRowsPerBlock > 1 ? kThreads * kVecs * kVec : 1;
  static_assert(kVecs * kVec <= 32, "the relu mask holds 32 elements per thread");
  __shared__ float2 scratch[2 * (kThreads / 32)];
  __shared__ float buf[kBufFloats];
  const int lane = threadIdx.x % kTpr;
  const int64_t cols = p.cols;
  const float inv_cols = __fdividef(1.f, float(cols));  // no call (see above); exact for cols = 1
  const bool need_columns = p.grad_weight != nullptr || p.grad_bias != nullptr;
  const uint64_t seed = dropout_seed<kDropout>(p.dropout);
  const T* weight = static_cast<const T*>(p.weight);

  int64_t col[kVecs];
  Pack<T, kVec> ws[kVecs];
  float acc_w[kVecs][kVec], acc_b[kVecs][kVec];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    col[i] = (int64_t(i) * kTpr + lane) * kVec;
    if (weight != nullptr) ws[i] = load_pack<T, kVec>(weight + (col[i] < cols ? col[i] : 0));
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc_w[i][j] = acc_b[i][j] = 0.f;
  }
  const Dropout drop = Dropout::make<kDropout>(p.dropout, seed);

  const int64_t stride = int64_t(gridDim.x) * kRowsPerBlock;
  int parity = 0;
  for (int64_t first = int64_t(blockIdx.x) * kRowsPerBlock; first < p.rows; first += stride) {
    const int64_t row = first + threadIdx.x / kTpr;
    const bool row_ok = row < p.rows;
    // The row's loads, all issued before any is used (past the last row, clamped to it; those
    // values are not used).
    const int64_t r = row_ok ? row : p.rows - 1;
    const T* x = static_cast<const T*>(p.x) + r * p.x_ld;
    const T* dy = static_cast<const T*>(p.grad) + r * p.grad_ld;
    Pack<T, kVec> xs[kVecs], gs[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = col[i] < cols ? col[i] : 0;
      xs[i] = load_pack<T, kVec>(x + c);
      gs[i] = load_pack<T, kVec>(dy + c);
    }
    const float row_mean = p.mean[r], row_rstd = p.rstd[r];
    float g[kVecs][kVec], xhat[kVecs][kVec];
    uint32_t positive = 0;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      backward_inputs<T, kVec>(p, drop, row, col[i], xs[i], gs[i], row_mean, row_rstd, g[i], xhat[i], positive,
                               i * kVec, kRelu);
    }
    float sum_dxhat = 0.f, sum_dxhat_xhat = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (!(row_ok && col[i] < cols)) continue;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float w = weight != nullptr ? float(ws[i].v[j]) : 1.f;
        const float dxhat = __fmul_rn(g[i][j], w);  // rounded as in the dx formula below
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat[i][j];
        acc_w[i][j] += g[i][j] * xhat[i][j];
        acc_b[i][j] += g[i][j];
      }
    }
    if (p.grad_x == nullptr) continue;  // uniform: the same for every thread
    const float2 sums = group_sum2<kTpr, kThreads>(sum_dxhat, sum_dxhat_xhat, scratch, parity);
    parity ^= 1;
    const float a = sums.x * inv_cols;
    const float b = sums.y * inv_cols;
    if (!row_ok) continue;
    T* dx = static_cast<T*>(p.grad_x) + row * p.grad_x_ld;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (col[i] >= cols) continue;
      float out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float w = weight != nullptr ? float(ws[i].v[j]) : 1.f;
        // __fmul_rn: no FMA contraction into the subtraction, so that for C = 1 (where
        // a == g * w exactly and xhat == 0) dx is exactly 0, as the math says.
        out[j] = row_rstd * (__fmul_rn(g[i][j], w) - a - xhat[i][j] * b);
        if (kRelu && !((positive >> (i * kVec + j)) & 1u)) out[j] = 0.f;
      }
      store_vec<T, kVec>(dx + col[i], out);
    }
  }
  if (!need_columns) return;
  write_column_partials<kVec, kVecs, kTpr, kThreads>(p, 0, acc_w, buf);
  write_column_partials<kVec, kVecs, kTpr, kThreads>(p, 1, acc_b, buf);
}

// One piece of a long row's dx: its part of the two row sums (first pass), and dx itself (second
// pass, with a = mean(dxhat), b = mean(dxhat * xhat)). x_src/g_src: the piece in memory or in
// shared memory.
template <class T, int kVec, class Drop>
__device__ __forceinline__ void add_dx_sums(LayerNormBackwardParams const& p, Drop const& drop, int64_t row,
                                            int64_t col, const T* x_src, const T* g_src, float mean, float rstd,
                                            float& sum_dxhat, float& sum_dxhat_xhat) {
  float g[kVec], xhat[kVec], w[kVec], unused[kVec];
  uint32_t positive = 0;
  load_backward_inputs_from<T, kVec>(p, drop, row, col, x_src, g_src, mean, rstd, g, xhat, positive, 0);
  load_affine<T, kVec>(p.weight, nullptr, col, w, unused);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float dxhat = __fmul_rn(g[j], w[j]);
    sum_dxhat += dxhat;
    sum_dxhat_xhat += dxhat * xhat[j];
  }
}

template <class T, int kVec, class Drop>
__device__ __forceinline__ void store_dx_piece(LayerNormBackwardParams const& p, Drop const& drop, int64_t row,
                                               int64_t col, const T* x_src, const T* g_src, float mean, float rstd,
                                               float a, float b) {
  float g[kVec], xhat[kVec], w[kVec], unused[kVec], out[kVec];
  uint32_t positive = 0;
  load_backward_inputs_from<T, kVec>(p, drop, row, col, x_src, g_src, mean, rstd, g, xhat, positive, 0);
  load_affine<T, kVec>(p.weight, nullptr, col, w, unused);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    out[j] = rstd * (__fmul_rn(g[j], w[j]) - a - xhat[j] * b);
    if (p.relu && !((positive >> j) & 1u)) out[j] = 0.f;
  }
  store_vec<T, kVec>(static_cast<T*>(p.grad_x) + row * p.grad_x_ld + col, out);
}

// Rows too long for registers, dx only: a block per row, the two row sums, then dx.
template <class T, int kVec, int kThreads, bool kDropout>
__global__ void __launch_bounds__(kThreads) layer_norm_bwd_long_kernel(LayerNormBackwardParams p) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t cols = p.cols;
  const float mean = p.mean[row], rstd = p.rstd[row];
  const T* x = static_cast<const T*>(p.x) + row * p.x_ld;
  const T* dy = static_cast<const T*>(p.grad) + row * p.grad_ld;
  const Dropout drop = Dropout::make<kDropout>(p.dropout);
  float sum_dxhat = 0.f, sum_dxhat_xhat = 0.f;
  for (int64_t col = int64_t(threadIdx.x) * kVec; col < cols; col += int64_t(kThreads) * kVec) {
    add_dx_sums<T, kVec>(p, drop, row, col, x + col, dy + col, mean, rstd, sum_dxhat, sum_dxhat_xhat);
  }
  const float a = block_sum(sum_dxhat, scratch) / float(cols);
  const float b = block_sum(sum_dxhat_xhat, scratch) / float(cols);
  for (int64_t col = int64_t(threadIdx.x) * kVec; col < cols; col += int64_t(kThreads) * kVec) {
    store_dx_piece<T, kVec>(p, drop, row, col, x + col, dy + col, mean, rstd, a, b);
  }
}

// The same with the row's x and dy in shared memory (vector path, where both fit): each is read
// from memory once, and the sums start on the first column group while the rest land. With
// dropout, the first pass zeroes the dropped elements of its pieces of dy in shared memory (a
// thread's pieces are the same in both passes), so the mask is drawn once per element, not twice.
template <class T, int kThreads, bool kDropout>
__global__ void __launch_bounds__(kThreads) layer_norm_bwd_shared_kernel(LayerNormBackwardParams p) {
  constexpr int kVec = vec_width<T>();
  extern __shared__ __align__(16) unsigned char shared_row_raw[];
  __shared__ float scratch[kThreads / 32];
  T* x_s = reinterpret_cast<T*>(shared_row_raw);
  T* dy_s = x_s + p.cols;  // p.cols is a multiple of kVec: 16-byte aligned
  const int64_t row = blockIdx.x;
  const float mean = p.mean[row], rstd = p.rstd[row];
  copy_row_pair_async(x_s, static_cast<const T*>(p.x) + row * p.x_ld, dy_s,
                      static_cast<const T*>(p.grad) + row * p.grad_ld, p.cols);
  const Dropout drop = Dropout::make<kDropout>(p.dropout);
  // What both passes apply to dy: the kept elements' scale once the first pass has zeroed the
  // dropped ones (with dropout), else nothing.
  const auto dy_drop = [&] {
    if constexpr (kDropout) {
      return KeptScale{drop.scale};
    } else {
      return drop;
    }
  }();
  float sum_dxhat = 0.f, sum_dxhat_xhat = 0.f;
  for_own_pieces_landing<T>(p.cols, [&](int64_t col) {
    if constexpr (kDropout) drop.zero_dropped<T, kVec>(dy_s + col, uint64_t(row) * uint64_t(p.cols) + uint64_t(col));
    add_dx_sums<T, kVec>(p, dy_drop, row, col, x_s + col, dy_s + col, mean, rstd, sum_dxhat, sum_dxhat_xhat);
  });
  const float a = block_sum(sum_dxhat, scratch) / float(p.cols);
  const float b = block_sum(sum_dxhat_xhat, scratch) / float(p.cols);
  for_all_own_pieces<T>(p.cols, [&](int64_t col) {
    store_dx_piece<T, kVec>(p, dy_drop, row, col, x_s + col, dy_s + col, mean, rstd, a, b);
  });
}

// dweight/dbias partials of long rows: column tiles of kColThreadsX * kVec, blockIdx.y a row split.
template <class T, int kVec, bool kDropout>
__global__ void __launch_bounds__(kColThreadsX* kColThreadsY)
layer_norm_bwd_columns_kernel(LayerNormBackwardParams p, int64_t rows_per_split) {
  __shared__ float sums[kColThreadsY][kColThreadsX * kVec];
  const int64_t col = (int64_t(blockIdx.x) * kColThreadsX + threadIdx.x) * kVec;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_split;
  const int64_t row_end = min(p.rows, row_begin + rows_per_split);
  const Dropout drop = Dropout::make<kDropout>(p.dropout);
  float acc_w[kVec], acc_b[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) acc_w[j] = acc_b[j] = 0.f;
  if (col < p.cols) {
    for (int64_t row = row_begin + threadIdx.y; row < row_end; row += kColThreadsY) {
      float g[kVec], xhat[kVec];
      uint32_t positive = 0;
      load_backward_inputs<T, kVec>(p, drop, row, col, p.mean[row], p.rstd[row], g, xhat, positive, 0);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        acc_w[j] += g[j] * xhat[j];
        acc_b[j] += g[j];
      }
    }
  }
  for (int plane = 0; plane < 2; ++plane) {
    __syncthreads();  // sums may still be read for the previous plane
#pragma unroll
    for (int j = 0; j < kVec; ++j) sums[threadIdx.y][threadIdx.x * kVec + j] = plane == 0 ? acc_w[j] : acc_b[j];
    __syncthreads();
    if (threadIdx.y != 0 || col >= p.cols) continue;
    float* out = p.workspace + (int64_t(plane) * gridDim.y + blockIdx.y) * p.cols;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float total = 0.f;
#pragma unroll
      for (int y = 0; y < kColThreadsY; ++y) total += sums[y][threadIdx.x * kVec + j];
      out[col + j] = total;
    }
  }
}

// dweight[c] and dbias[c]: the workspace's partial rows added in a fixed order.
template <class T>
__global__ void __launch_bounds__(32 * kFinalizeThreadsY)
layer_norm_column_finalize_kernel(const float* partials, int64_t parts, int64_t cols, T* grad_weight, T* grad_bias) {
  __shared__ float sums[kFinalizeThreadsY][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  for (int plane = 0; plane < 2; ++plane) {
    T* out = plane == 0 ? grad_weight : grad_bias;
    if (out == nullptr) continue;  // uniform over the block
    const float* in = partials + int64_t(plane) * parts * cols;
    float total = 0.f;
    if (col < cols) {
      for (int64_t s = threadIdx.y; s < parts; s += kFinalizeThreadsY) total += in[s * cols + col];
    }
    __syncthreads();  // sums may still be read for the previous plane
    sums[threadIdx.y][threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
      float t = 0.f;
#pragma unroll
      for (int y = 0; y < kFinalizeThreadsY; ++y) t += sums[y][threadIdx.x];
      out[col] = T(t);
    }
  }
}

// How the backward runs: its kernels' shapes and the number of partial rows of dweight/dbias.
struct BackwardPlan {
  int vec = 1;
  bool in_registers = false;
  int64_t blocks = 0;      // rows kernel: grid size (= partial rows)
  int64_t splits = 0;      // long rows: row splits of the column kernel (= partial rows)
  int64_t col_blocks = 0;  // long rows: column tiles of the column kernel
};

BackwardPlan plan_backward(LayerNormBackwardParams const& p) {
  BackwardPlan plan;
  plan.vec = backward_vectorizable(p) ? vec_width_of(p.dtype) : 1;
  const int64_t nv = (p.cols + plan.vec - 1) / plan.vec;
  plan.in_registers = with_backward_row_config(nv, [&](auto cfg) {
    using Cfg = decltype(cfg);
    // The blocks that fit at once (1024 threads per SM): a single wave, and few partial rows to add.
    const int64_t resident = int64_t(std::max(p.sm_count, 1)) * (1024 / Cfg::kThreads);
    plan.blocks = std::min((p.rows + Cfg::kRowsPerBlock - 1) / Cfg::kRowsPerBlock, resident);
  });
  if (!plan.in_registers) {
    plan.col_blocks = (p.cols + kColThreadsX * plan.vec - 1) / (kColThreadsX * plan.vec);
    const int64_t target = 4 * int64_t(std::max(p.sm_count, 1));
    const int64_t max_splits = std::max<int64_t>(1, p.rows / 32);
    plan.splits = std::clamp<int64_t>((target + plan.col_blocks - 1) / plan.col_blocks, 1, std::min<int64_t>(max_splits, 65535));
  }
  return plan;
}

// dx of rows too long for registers: through shared memory where x and dy fit there together.
template <class T, int kVec>
void launch_backward_dx_long(LayerNormBackwardParams const& p, cudaStream_t stream) {
  const bool dropout = p.dropout.seed != nullptr;
  if constexpr (kVec == vec_width<T>()) {
    int device = 0;
    if (shared_rows_that_fit<T>(2 * p.cols, &device) >= 1) {
      auto kernel = dropout ? layer_norm_bwd_shared_kernel<T, kLongThreads, true>
                            : layer_norm_bwd_shared_kernel<T, kLongThreads, false>;
      if (allow_large_dynamic_shared(reinterpret_cast<const void*>(kernel), device) == cudaSuccess) {
        kernel<<<unsigned(p.rows), kLongThreads, 2 * size_t(p.cols) * sizeof(T), stream>>>(p);
        return;
      }
    }
  }
  auto kernel = dropout ? layer_norm_bwd_long_kernel<T, kVec, kLongThreads, true>
                        : layer_norm_bwd_long_kernel<T, kVec, kLongThreads, false>;
  kernel<<<unsigned(p.rows), kLongThreads, 0, stream>>>(p);
}

template <class T, int kVec>
void launch_backward_vec(LayerNormBackwardParams const& p, BackwardPlan const& plan, cudaStream_t stream) {
  const bool need_columns = p.grad_weight != nullptr || p.grad_bias != nullptr;
  const int64_t nv = (p.cols + kVec - 1) / kVec;
  with_backward_row_config(nv, [&](auto cfg) {
    using Cfg = decltype(cfg);
    auto pick = [&](auto relu) {
      constexpr bool kRelu = decltype(relu)::value;
      return p.dropout.seed != nullptr ? layer_norm_bwd_rows_kernel<T, kVec, Cfg::kVecs, Cfg::kTpr, Cfg::kThreads, kRelu, true>
                                       : layer_norm_bwd_rows_kernel<T, kVec, Cfg::kVecs, Cfg::kTpr, Cfg::kThreads, kRelu, false>;
    };
    auto kernel = p.relu ? pick(std::true_type{}) : pick(std::false_type{});
    kernel<<<unsigned(plan.blocks), Cfg::kThreads, 0, stream>>>(p);
  });
  int64_t parts = plan.blocks;
  if (!plan.in_registers) {
    if (p.grad_x != nullptr) launch_backward_dx_long<T, kVec>(p, stream);
    if (need_columns) {
      const int64_t rows_per_split = (p.rows + plan.splits - 1) / plan.splits;
      const dim3 grid(unsigned(plan.col_blocks), unsigned(plan.splits));
      auto kernel = p.dropout.seed != nullptr ? layer_norm_bwd_columns_kernel<T, kVec, true>
                                              : layer_norm_bwd_columns_kernel<T, kVec, false>;
      kernel<<<grid, dim3(kColThreadsX, kColThreadsY), 0, stream>>>(p, rows_per_split);
    }
    parts = plan.splits;
  }
  if (need_columns) {
    const unsigned blocks = unsigned((p.cols + 31) / 32);
    layer_norm_column_finalize_kernel<T><<<blocks, dim3(32, kFinalizeThreadsY), 0, stream>>>(
        p.workspace, parts, p.cols, static_cast<T*>(p.grad_weight), static_cast<T*>(p.grad_bias));
  }
}

template <class T>
struct BackwardFn {
  void operator()(LayerNormBackwardParams const& p, cudaStream_t stream) const {
    const BackwardPlan plan = plan_backward(p);
    if (plan.vec > 1) {
      launch_backward_vec<T, vec_width<T>()>(p, plan, stream);
    } else {
      launch_backward_vec<T, 1>(p, plan, stream);
    }
  }
};

}  // namespace

LaunchResult layer_norm_forward(LayerNormParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  return dispatch_dtype<ForwardFn>(p, stream);
}

int64_t layer_norm_backward_workspace(LayerNormBackwardParams const& p) {
  if ((p.grad_weight == nullptr && p.grad_bias == nullptr) || p.rows == 0 || p.cols == 0) return 0;
  const BackwardPlan plan = plan_backward(p);
  return 2 * (plan.in_registers ? plan.blocks : plan.splits) * p.cols;
}

LaunchResult layer_norm_backward(LayerNormBackwardParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  if (p.grad_x == nullptr && p.grad_weight == nullptr && p.grad_bias == nullptr) return {};
  return dispatch_dtype<BackwardFn>(p, stream);
}

}  // namespace cutlass_ext
