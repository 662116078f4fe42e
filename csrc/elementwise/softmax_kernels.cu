#include "elementwise/softmax_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/cluster_rows.cuh"
#include "common/device_utils.cuh"

namespace cutlass_ext {
namespace {

// ---------------------------------------------------------------------------------------------
// Path thresholds (elements per row)

constexpr int kWarpBlockThreads = 128;  // short rows: 128 / lanes-per-row rows per block
constexpr int kWarpMaxCols = 1024;      // short rows: up to 32 fp32 per lane
constexpr int kRowMaxThreads = 1024;    // medium rows: one block of up to 1024 threads per row
constexpr int kMaxWarpsPerSm = 64;      // resident warps of an SM (2048 threads, sm_80 and sm_90)
// Medium rows keep up to this many elements per thread in registers (at most 64 registers at
// 1024 threads without spills): forward x only (16 on the scalar path, whose 32 separate
// addresses would spill), backward dy and y.
constexpr int kForwardMaxElems = 32;
constexpr int kForwardScalarMaxElems = 16;
constexpr int kBackwardMaxElems = 16;
constexpr int64_t kForwardMaxRowCols = int64_t(kRowMaxThreads) * kForwardMaxElems;    // 32768
// Forward rows longer than this go through shared memory where they can (16-byte vector path):
// a block of 1024 threads with the row in registers spends its time in the block-wide reductions.
// Measured on an H200 (bf16 unless said, bench/NOTES.md section 28), registers against shared
// memory: 32768x8200 352 -> 316 us, 8192x16384 176 -> 135, 16384x12288 280 -> 206, 4096x32768
// 265 -> 136, fp32 8192x16384 306 -> 265.
constexpr int64_t kSharedRowsAbove = 8192;
constexpr int64_t kBackwardMaxRowCols = int64_t(kRowMaxThreads) * kBackwardMaxElems;  // 16384
// Long rows: 512 threads, each with 4 vector loads in flight per step (2 of dy and 2 of y in the
// backward), which keeps them at 2 blocks per multiprocessor.
constexpr int kLongThreads = 512;
// Threads of the row-cluster CTAs (forward and backward; their kernels use 31-34 registers, so
// three 64 KB-slice CTAs an SM either way): 384 against 512 measured on an H200 (bench/NOTES.md
// section 62) bf16 forward 1.02-1.03x at 1024x131072 and 512x262144, fwd+bwd 1.03x at 512x262144,
// fp32 1.00-1.02x, no shape slower.
constexpr int kClusterThreads = 384;
constexpr int kLongUnroll = 4;
constexpr int kLongBackwardUnroll = 2;
// Row splitting: aim for 4 blocks per multiprocessor; no chunk shorter than 8192 elements.
constexpr int kSplitBlocksPerSm = 4;
constexpr int64_t kMinSplitChunk = 8192;
constexpr int64_t kSplitChunkAlign = 256;  // chunk starts stay multiples of every vector width

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Softmax arithmetic. A row's exponentials are taken against shift(max): the max itself, or 0
// when the max is -inf (an all -inf row, whose exponentials are then all 0 and whose sum is 0,
// which inverse_or_zero turns into a row of zeros). NaN needs no special case: fmaxf skips it,
// but exp(NaN - shift) is NaN, so the sum and then every output of the row become NaN.

__device__ __forceinline__ float shift_of(float row_max) { return row_max == -INFINITY ? 0.f : row_max; }

// 2^x without exp2f's handling of subnormal arguments and results (three instructions around the
// MUFU one on sm_90): results below 2^-126, probabilities under 1.2e-38, become zero.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float exp_shifted(float z, float shift) { return ex2_ftz((z - shift) * kLog2e); }

// A sum taken against shift(old_max), re-expressed against shift(new_max), new_max >= old_max.
// A part that saw only -inf holds 0 (or NaN) and keeps it: s * 0, never 0 * exp(+huge).
__device__ __forceinline__ float rescale(float sum, float old_max, float new_max) {
  return old_max == -INFINITY ? sum * 0.f : sum * ex2_ftz((old_max - shift_of(new_max)) * kLog2e);
}

__device__ __forceinline__ float inverse_or_zero(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }

struct RowStats {
  float max, sum;
};


// Reductions over the threads that share a row: kLanes adjacent lanes of a warp, or the block.
template <int kLanes>
struct LaneGroupReduce {
  __device__ __forceinline__ float max(float v) const {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
  }
  __device__ __forceinline__ float sum(float v) const {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
  // Whether any row of the warp has `p` (a choice the whole warp then makes, as its shuffles
  // need every lane).
  __device__ __forceinline__ bool any(bool p) const { return __any_sync(0xffffffffu, p); }
};

struct BlockReduce {
  float* scratch;  // 32 floats of shared memory
  __device__ __forceinline__ float max(float v) const { return block_max(v, scratch); }
  __device__ __forceinline__ float sum(float v) const { return block_sum(v, scratch); }
  __device__ __forceinline__ bool any(bool p) const { return p; }  // p derives from a block reduction
};

// ---------------------------------------------------------------------------------------------
// Rows held in registers (short and medium rows). Thread `lane` of the `lanes` threads sharing a
// row holds packs k = 0..kPacks-1 at columns (k * lanes + lane) * kVec, so each load instruction
// of the group reads one contiguous stretch. A thread of an inactive row passes cols = 0: it
// stores nothing (and the forward loads nothing) but still takes part in the group's reductions.

// The backward loads every 16-byte pack of dy and y before any is used, packs past the row's end
// (or of an inactive row) from column 0 of the row pointer, which is always in bounds: with each
// load inside its own `col < cols` branch, the compiler issued a pack's loads only after the
// previous pack's values were used, one memory round trip per pack. Measured on an H200
// (bench/NOTES.md section 17): 32768 x 1024 bf16 and fp16 backward 1.03-1.04x faster. The forward
// was not: the same loads left its time unchanged in bf16 and made fp32 up to 11% slower, so it
// keeps its loads in the branches.
template <class T, int kVec, int kPacks>
__device__ __forceinline__ void load_row_packs(const T* src, int lane, int lanes, int64_t cols,
                                               Pack<T, kVec> (&packs)[kPacks]) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t col = (int64_t(k) * lanes + lane) * kVec;
    packs[k] = load_pack<T, kVec>(src + (col < cols ? col : 0));
  }
}

// 16-bit rows work in base 2: with c = scale * log2(e), shift = the row max of x * c rounded
// down, then 2^(x * c - shift) as one fused multiply-add (exact product, one rounding) and one
// MUFU instruction an element; the natural-base form takes a multiply, a subtract and a multiply
// around it. The rounding of the max offsets every exponent alike, which the normalization
// cancels: rounded down, the offset lies in [0, ulp(shift)), so the largest exponent is never
// negative (a row of zeros) and stays below 2^6 (no overflow) while |shift| < 2^30. Rows past
// that (logits of magnitude 7e8 and more, or +inf) take the natural-base form, which has no such
// offset, and so do float32 rows (measured on an H200, bench/NOTES.md: the base-2 form made the
// 16-bit forward 2-7% faster and the float32 one 5% slower).
constexpr float kBase2MaxShift = 1073741824.f;  // 2^30

template <class T, int kVec, int kPacks, class Reduce, bool kAhead = false>
__device__ __forceinline__ void softmax_row_in_registers(const T* x, T* y, int lane, int lanes, int64_t cols,
                                                         float scale, Reduce const& reduce) {
  float v[kPacks][kVec];
  float s = 0.f;
  bool natural = true;  // float32 rows, or 16-bit rows past the base-2 form's range
  if constexpr (sizeof(T) == 2) {
    const float scale2 = scale * kLog2e;
    float m = -INFINITY;
    Pack<T, kVec> ahead[kAhead ? kPacks : 1];
    if constexpr (kAhead) load_row_packs<T, kVec, kPacks>(x, lane, lanes, cols, ahead);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t col = (int64_t(k) * lanes + lane) * kVec;
      if (col < cols) {
        if constexpr (kAhead) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) v[k][i] = float(ahead[k].v[i]);
        } else {
          load_vec<T, kVec>(x + col, v[k]);
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) m = fmaxf(m, __fmul_rd(v[k][i], scale2));
      }
    }
    const float shift = shift_of(reduce.max(m));
    natural = reduce.any(fabsf(shift) >= kBase2MaxShift);
    if (!natural) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        if ((int64_t(k) * lanes + lane) * kVec < cols) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            v[k][i] = ex2_ftz(fmaf(v[k][i], scale2, -shift));
            s += v[k][i];
          }
        }
      }
    }
  }
  if (natural) {
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t col = (int64_t(k) * lanes + lane) * kVec;
      if (col < cols) {
        if constexpr (sizeof(T) == 4) load_vec<T, kVec>(x + col, v[k]);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          v[k][i] *= scale;
          m = fmaxf(m, v[k][i]);
        }
      } else if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[k][i] = -INFINITY;  // then no guard below (fewer registers)
      }
    }
    const float shift = shift_of(reduce.max(m));
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if (sizeof(T) == 4 || (int64_t(k) * lanes + lane) * kVec < cols) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          v[k][i] = exp_shifted(v[k][i], shift);
          s += v[k][i];
        }
      }
    }
  }
  const float inv = inverse_or_zero(reduce.sum(s));
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t col = (int64_t(k) * lanes + lane) * kVec;
    if (col < cols) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[k][i] *= inv;
      store_vec<T, kVec>(y + col, v[k]);
    }
  }
}

// The pack's bits, unchanged, as the result of an empty asm statement: what was computed from the
// pack before cannot be reused after, so the compiler keeps the pack (not values derived from it)
// in registers across the statement.
template <class T, int kVec>
__device__ __forceinline__ void opaque_pack(Pack<T, kVec>& pk) {
  if constexpr (sizeof(pk) % 4 == 0) {
    uint32_t w[sizeof(pk) / 4];
    memcpy(w, &pk, sizeof(pk));
#pragma unroll
    for (int i = 0; i < int(sizeof(pk) / 4); ++i) asm volatile("" : "+r"(w[i]));
    memcpy(&pk, w, sizeof(pk));
  } else {
    unsigned short h[sizeof(pk) / 2];
    memcpy(h, &pk, sizeof(pk));
#pragma unroll
    for (int i = 0; i < int(sizeof(pk) / 2); ++i) asm volatile("" : "+h"(h[i]));
    memcpy(&pk, h, sizeof(pk));
  }
}

// dy and y stay packed as loaded (16-bit elements two to a register) and are converted where used,
// twice: at 32 columns a lane (1024 bf16 columns a warp) fp32 copies of both took 64 registers,
// which held the kernel at 37.5% occupancy, latency-bound (bench/NOTES.md section 16).
template <class T, int kVec, int kPacks, class Reduce>
__device__ __forceinline__ void softmax_backward_row_in_registers(const T* dy, const T* y, T* dx, int lane, int lanes,
                                                                  int64_t cols, float scale, Reduce const& reduce) {
  // Loaded ahead in 16-byte packs; element by element (unaligned rows) the 32 loads ahead of 16
  // packs spilled (84-104 bytes), so those stay in the branches.
  constexpr bool kAhead = kVec > 1;
  Pack<T, kVec> g[kPacks], o[kPacks];
  if constexpr (kAhead) {
    load_row_packs<T, kVec, kPacks>(dy, lane, lanes, cols, g);
    load_row_packs<T, kVec, kPacks>(y, lane, lanes, cols, o);
  }
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t col = (int64_t(k) * lanes + lane) * kVec;
    if (col < cols) {
      if constexpr (!kAhead) {
        g[k] = load_pack<T, kVec>(dy + col);
        o[k] = load_pack<T, kVec>(y + col);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) dot = fmaf(float(g[k].v[i]), float(o[k].v[i]), dot);
    }
  }
  dot = reduce.sum(dot);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t col = (int64_t(k) * lanes + lane) * kVec;
    if (col < cols) {
      opaque_pack<T, kVec>(g[k]);  // convert again here rather than keep the fp32 values from above
      opaque_pack<T, kVec>(o[k]);
      float out[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] = scale * float(o[k].v[i]) * (float(g[k].v[i]) - dot);
      store_vec<T, kVec>(dx + col, out);
    }
  }
}

// Short rows: kLanes lanes per row (kLanes a power of two <= 32), kPacks packs per lane. kAhead
// (16-bit rows): a lane's packs are all loaded before the row's maximum (ForwardOp::warp_kernel).
template <class T, int kVec, int kLanes, int kPacks, bool kAhead = false>
__global__ void __launch_bounds__(kWarpBlockThreads) softmax_warp_kernel(SoftmaxParams p) {
  constexpr int kRowsPerBlock = kWarpBlockThreads / kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const bool active = row < p.rows;
  const int64_t r = active ? row : 0;
  softmax_row_in_registers<T, kVec, kPacks, LaneGroupReduce<kLanes>, kAhead>(
      static_cast<const T*>(p.x) + r * p.x_ld, static_cast<T*>(p.y) + r * p.y_ld, int(threadIdx.x % kLanes), kLanes,
      active ? p.cols : 0, p.scale, LaneGroupReduce<kLanes>{});
}

template <class T, int kVec, int kLanes, int kPacks>
__global__ void __launch_bounds__(kWarpBlockThreads) softmax_backward_warp_kernel(SoftmaxBackwardParams p) {
  constexpr int kRowsPerBlock = kWarpBlockThreads / kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const bool active = row < p.rows;
  const int64_t r = active ? row : 0;
  softmax_backward_row_in_registers<T, kVec, kPacks>(
      static_cast<const T*>(p.grad) + r * p.grad_ld, static_cast<const T*>(p.y) + r * p.y_ld,
      static_cast<T*>(p.grad_input) + r * p.grad_input_ld, int(threadIdx.x % kLanes), kLanes, active ? p.cols : 0,
      p.scale, LaneGroupReduce<kLanes>{});
}

// Medium rows: one block per row; the block size (a multiple of 32) is chosen at launch.
template <class T, int kVec, int kPacks>
__global__ void __launch_bounds__(kRowMaxThreads) softmax_row_kernel(SoftmaxParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  softmax_row_in_registers<T, kVec, kPacks>(static_cast<const T*>(p.x) + row * p.x_ld,
                                            static_cast<T*>(p.y) + row * p.y_ld, int(threadIdx.x), int(blockDim.x),
                                            p.cols, p.scale, BlockReduce{scratch});
}

template <class T, int kVec, int kPacks>
__global__ void __launch_bounds__(kRowMaxThreads) softmax_backward_row_kernel(SoftmaxBackwardParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  softmax_backward_row_in_registers<T, kVec, kPacks>(
      static_cast<const T*>(p.grad) + row * p.grad_ld, static_cast<const T*>(p.y) + row * p.y_ld,
      static_cast<T*>(p.grad_input) + row * p.grad_input_ld, int(threadIdx.x), int(blockDim.x), p.cols, p.scale,
      BlockReduce{scratch});
}

// ---------------------------------------------------------------------------------------------
// Long rows: the block streams columns [begin, end) of a row, kLongUnroll vector loads per
// thread in flight per step.

// (max, sum of exp against shift(max)) of scale * x over [begin, end), for the whole block. The
// running sum is rescaled once per step, when the step's max exceeds the running one.
template <class T, int kVec>
__device__ RowStats chunk_stats(const T* x, int64_t begin, int64_t end, float scale, float* scratch) {
  const int64_t step = int64_t(blockDim.x) * kVec;
  float m = -INFINITY, s = 0.f;
  for (int64_t base = begin + int64_t(threadIdx.x) * kVec; base < end; base += step * kLongUnroll) {
    float v[kLongUnroll][kVec];
    float step_max = m;
#pragma unroll
    for (int u = 0; u < kLongUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) {
        load_vec<T, kVec>(x + col, v[u]);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          v[u][i] *= scale;
          step_max = fmaxf(step_max, v[u][i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[u][i] = -INFINITY;
      }
    }
    s = rescale(s, m, step_max);
    const float shift = shift_of(step_max);
#pragma unroll
    for (int u = 0; u < kLongUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) s += exp_shifted(v[u][i], shift);
    }
    m = step_max;
  }
  const float block_m = block_max(m, scratch);
  return {block_m, block_sum(rescale(s, m, block_m), scratch)};
}

template <class T, int kVec>
__device__ void chunk_write(const T* x, T* y, int64_t begin, int64_t end, float scale, float shift, float inv) {
  const int64_t step = int64_t(blockDim.x) * kVec;
  for (int64_t base = begin + int64_t(threadIdx.x) * kVec; base < end; base += step * kLongUnroll) {
    float v[kLongUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kLongUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) load_vec<T, kVec>(x + col, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kLongUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[u][i] = exp_shifted(v[u][i] * scale, shift) * inv;
        store_vec<T, kVec>(y + col, v[u]);
      }
    }
  }
}

template <class T, int kVec>
__device__ float chunk_dot(const T* dy, const T* y, int64_t begin, int64_t end, float* scratch) {
  const int64_t step = int64_t(blockDim.x) * kVec;
  float dot = 0.f;
  for (int64_t base = begin + int64_t(threadIdx.x) * kVec; base < end; base += step * kLongBackwardUnroll) {
    float g[kLongBackwardUnroll][kVec], o[kLongBackwardUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kLongBackwardUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) {
        load_vec<T, kVec>(dy + col, g[u]);
        load_vec<T, kVec>(y + col, o[u]);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[u][i] = o[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kLongBackwardUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) dot = fmaf(g[u][i], o[u][i], dot);
    }
  }
  return block_sum(dot, scratch);
}

template <class T, int kVec>
__device__ void chunk_write_grad(const T* dy, const T* y, T* dx, int64_t begin, int64_t end, float scale, float dot) {
  const int64_t step = int64_t(blockDim.x) * kVec;
  for (int64_t base = begin + int64_t(threadIdx.x) * kVec; base < end; base += step * kLongBackwardUnroll) {
    float g[kLongBackwardUnroll][kVec], o[kLongBackwardUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kLongBackwardUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) {
        load_vec<T, kVec>(dy + col, g[u]);
        load_vec<T, kVec>(y + col, o[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kLongBackwardUnroll; ++u) {
      const int64_t col = base + u * step;
      if (col < end) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[u][i] = scale * o[u][i] * (g[u][i] - dot);
        store_vec<T, kVec>(dx + col, g[u]);
      }
    }
  }
}

// One block per long row: stats pass, then write pass.
template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads) softmax_long_kernel(SoftmaxParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.x_ld;
  const RowStats st = chunk_stats<T, kVec>(x, 0, p.cols, p.scale, scratch);
  chunk_write<T, kVec>(x, static_cast<T*>(p.y) + row * p.y_ld, 0, p.cols, p.scale, shift_of(st.max),
                       inverse_or_zero(st.sum));
}

template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads) softmax_backward_long_kernel(SoftmaxBackwardParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* dy = static_cast<const T*>(p.grad) + row * p.grad_ld;
  const T* y = static_cast<const T*>(p.y) + row * p.y_ld;
  const float dot = chunk_dot<T, kVec>(dy, y, 0, p.cols, scratch);
  chunk_write_grad<T, kVec>(dy, y, static_cast<T*>(p.grad_input) + row * p.grad_input_ld, 0, p.cols, p.scale, dot);
}

// Rows in shared memory (vector path, one block per row): the (max, sum) pass starts on the
// first column group while the others are still being copied in; the write pass reads the row
// from shared memory, so x is read from memory once. kCluster: the row is split over a cluster of
// CTAs, `slice` columns each (common/cluster_rows.cuh), whose (max, sum) pairs every CTA combines
// alike (cluster_butterfly).
template <class T, bool kCluster>
__device__ __forceinline__ void softmax_shared_row(SoftmaxParams const& p, int slice) {
  constexpr int kVec = vec_width<T>();
  extern __shared__ __align__(16) unsigned char shared_row_raw[];
  __shared__ float scratch[32];
  T* row_s = reinterpret_cast<T*>(shared_row_raw);
  const int64_t row = kCluster ? cluster_row() : int64_t(blockIdx.x);
  const RowSlice part = kCluster ? cluster_slice(p.cols, slice) : RowSlice{0, int(p.cols)};
  copy_row_async(row_s, static_cast<const T*>(p.x) + row * p.x_ld + part.begin, part.n);

  float m = -INFINITY, s = 0.f;
  for_own_pieces_landing<T>(part.n, [&](int64_t col) {
    float v[kVec];
    load_vec<T, kVec>(row_s + col, v);
    float vmax = m;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      v[i] *= p.scale;
      vmax = fmaxf(vmax, v[i]);
    }
    s = rescale(s, m, vmax);
    const float shift = shift_of(vmax);
#pragma unroll
    for (int i = 0; i < kVec; ++i) s += exp_shifted(v[i], shift);
    m = vmax;
  });
  float row_max = block_max(m, scratch);
  float sum = block_sum(rescale(s, m, row_max), scratch);
  if constexpr (kCluster) {
    // (max, sum against shift(max)) pairs, combined as the long rows' steps are.
    __shared__ float2 slot;
    const float2 own = cluster_gather(make_float2(row_max, sum), &slot, make_float2(-INFINITY, 0.f));
    const float2 total = cluster_butterfly(own, [](float2 a, float2 b) {
      const float m = fmaxf(a.x, b.x);
      return make_float2(m, rescale(a.y, a.x, m) + rescale(b.y, b.x, m));
    });
    row_max = total.x;
    sum = total.y;
  }
  const float shift = shift_of(row_max);
  const float inv = inverse_or_zero(sum);
  T* y = static_cast<T*>(p.y) + row * p.y_ld + part.begin;
  for_all_own_pieces<T>(part.n, [&](int64_t col) {
    float v[kVec];
    load_vec<T, kVec>(row_s + col, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = exp_shifted(v[i] * p.scale, shift) * inv;
    store_vec<T, kVec>(y + col, v);
  });
  if constexpr (kCluster) cluster_release();
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_shared_kernel(SoftmaxParams p) {
  softmax_shared_row<T, false>(p, int(p.cols));
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_cluster_kernel(SoftmaxParams p, int slice) {
  softmax_shared_row<T, true>(p, slice);
}

// The backward's rows in shared memory (vector path, one block per row or a cluster of blocks
// holding `slice` columns each): dy and y are copied in once, the sum of dy * y starts on the first
// column group while the rest land, and dx is written from shared memory, so dy and y are read
// from memory once (the two-pass kernels read them twice).
template <class T, bool kCluster>
__device__ __forceinline__ void softmax_backward_shared_row(SoftmaxBackwardParams const& p, int slice) {
  constexpr int kVec = vec_width<T>();
  extern __shared__ __align__(16) unsigned char shared_row_raw[];
  __shared__ float scratch[32];
  const int64_t row = kCluster ? cluster_row() : int64_t(blockIdx.x);
  const RowSlice part = kCluster ? cluster_slice(p.cols, slice) : RowSlice{0, int(p.cols)};
  T* dy_s = reinterpret_cast<T*>(shared_row_raw);
  T* y_s = dy_s + (kCluster ? slice : p.cols);  // a multiple of kVec: 16-byte aligned
  copy_row_pair_async(dy_s, static_cast<const T*>(p.grad) + row * p.grad_ld + part.begin, y_s,
                      static_cast<const T*>(p.y) + row * p.y_ld + part.begin, part.n);
  float dot = 0.f;
  for_own_pieces_landing<T>(part.n, [&](int64_t col) {
    float g[kVec], o[kVec];
    load_vec<T, kVec>(dy_s + col, g);
    load_vec<T, kVec>(y_s + col, o);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dot = fmaf(g[i], o[i], dot);
  });
  dot = block_sum(dot, scratch);
  if constexpr (kCluster) {
    __shared__ float slot;
    dot = cluster_butterfly(cluster_gather(dot, &slot, 0.f), [](float a, float b) { return a + b; });
  }
  T* dx = static_cast<T*>(p.grad_input) + row * p.grad_input_ld + part.begin;
  for_all_own_pieces<T>(part.n, [&](int64_t col) {
    float g[kVec], o[kVec];
    load_vec<T, kVec>(dy_s + col, g);
    load_vec<T, kVec>(y_s + col, o);
#pragma unroll
    for (int i = 0; i < kVec; ++i) g[i] = p.scale * o[i] * (g[i] - dot);
    store_vec<T, kVec>(dx + col, g);
  });
  if constexpr (kCluster) cluster_release();
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_backward_shared_kernel(SoftmaxBackwardParams p) {
  softmax_backward_shared_row<T, false>(p, int(p.cols));
}

template <class T>
__global__ void __launch_bounds__(kLongThreads) softmax_backward_cluster_kernel(SoftmaxBackwardParams p, int slice) {
  softmax_backward_shared_row<T, true>(p, slice);
}

// Split rows: grid (chunks, rows). The first kernel stores each chunk's partial; the second lets
// every block combine its row's partials (lane-strided, then a fixed shuffle tree, so every block
// gets identical bits) and writes its chunk.
template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads) softmax_partial_stats_kernel(SoftmaxParams p, int64_t chunk) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.y, begin = int64_t(blockIdx.x) * chunk;
  const RowStats st = chunk_stats<T, kVec>(static_cast<const T*>(p.x) + row * p.x_ld, begin,
                                           min(p.cols, begin + chunk), p.scale, scratch);
  if (threadIdx.x == 0) {
    float* out = p.partials + (row * p.row_splits + blockIdx.x) * 2;
    out[0] = st.max;
    out[1] = st.sum;
  }
}

template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads) softmax_split_write_kernel(SoftmaxParams p, int64_t chunk) {
  const int64_t row = blockIdx.y, begin = int64_t(blockIdx.x) * chunk;
  const float* part = p.partials + row * p.row_splits * 2;
  const int lane = threadIdx.x & 31, n = int(gridDim.x);
  float m = -INFINITY;
  for (int i = lane; i < n; i += 32) m = fmaxf(m, part[2 * i]);
  m = warp_max(m);
  float s = 0.f;
  for (int i = lane; i < n; i += 32) s += rescale(part[2 * i + 1], part[2 * i], m);
  s = warp_sum(s);
  chunk_write<T, kVec>(static_cast<const T*>(p.x) + row * p.x_ld, static_cast<T*>(p.y) + row * p.y_ld, begin,
                       min(p.cols, begin + chunk), p.scale, shift_of(m), inverse_or_zero(s));
}

template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads)
softmax_backward_partial_dot_kernel(SoftmaxBackwardParams p, int64_t chunk) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.y, begin = int64_t(blockIdx.x) * chunk;
  const float dot = chunk_dot<T, kVec>(static_cast<const T*>(p.grad) + row * p.grad_ld,
                                       static_cast<const T*>(p.y) + row * p.y_ld, begin,
                                       min(p.cols, begin + chunk), scratch);
  if (threadIdx.x == 0) p.partials[row * p.row_splits + blockIdx.x] = dot;
}

template <class T, int kVec>
__global__ void __launch_bounds__(kLongThreads)
softmax_backward_split_write_kernel(SoftmaxBackwardParams p, int64_t chunk) {
  const int64_t row = blockIdx.y, begin = int64_t(blockIdx.x) * chunk;
  const float* part = p.partials + row * p.row_splits;
  const int lane = threadIdx.x & 31, n = int(gridDim.x);
  float dot = 0.f;
  for (int i = lane; i < n; i += 32) dot += part[i];
  dot = warp_sum(dot);
  chunk_write_grad<T, kVec>(static_cast<const T*>(p.grad) + row * p.grad_ld, static_cast<const T*>(p.y) + row * p.y_ld,
                            static_cast<T*>(p.grad_input) + row * p.grad_input_ld, begin,
                            min(p.cols, begin + chunk), p.scale, dot);
}

// ---------------------------------------------------------------------------------------------
// Host launchers. One template per path serves forward and backward: Op supplies the kernels.

// Rows in shared memory (vector path), `buffers` rows of T per row (x; or dy and y), read from
// memory once: in one block where they fit, else split over a cluster of blocks; few rows (which
// the caller splits) over at least as many blocks a row as the split would take. false where
// neither applies (the caller then runs the two-pass or split kernels). Measured on an H200 (bf16,
// forward, bench/NOTES.md section 28): a 128 KB row in one block 147 us at 2048x65536 against 163
// over two; 1024x131072 and 512x262144 237 and 224 us in two passes against 165 and 169 over four
// and eight; 64x262144 44 us split against 31 over eight.
template <class T, class Params>
bool launch_shared_rows(Params const& p, int buffers, void (*single)(Params), void (*cluster)(Params, int),
                        cudaStream_t stream) {
  int device = 0;
  const int64_t rows_that_fit = shared_rows_that_fit<T>(buffers * p.cols, &device);
  int ranks = rows_that_fit >= 1 && p.row_splits <= 1
                  ? 1
                  : row_cluster_ranks(buffers * p.cols * int64_t(sizeof(T)), shared_budget_bytes(device), device);
  if (ranks >= 1 && p.row_splits > ranks) {
    ranks = int(std::min<int64_t>(pow2_at_least(p.row_splits), row_cluster_limit(device)));
  }
  if (ranks > 1) {
    const int slice = row_cluster_slice(p.cols, ranks, vec_width<T>());
    const size_t bytes = size_t(buffers) * size_t(slice) * sizeof(T);
    if (allow_large_dynamic_shared(reinterpret_cast<const void*>(cluster), device) == cudaSuccess &&
        launch_row_clusters(cluster, p.rows, ranks, kClusterThreads, bytes, stream, p, slice)) {
      return true;
    }
  }
  if (p.row_splits > 1 || rows_that_fit < 1) return false;
  if (allow_large_dynamic_shared(reinterpret_cast<const void*>(single), device) != cudaSuccess) return false;
  single<<<unsigned(p.rows), kLongThreads, size_t(buffers) * size_t(p.cols) * sizeof(T), stream>>>(p);
  return true;
}

// Threads of the block-per-row kernel for rows of `cols` columns at `packs` packs of `vec` elements
// a thread: whole warps.
inline int64_t row_block_threads(int64_t cols, int vec, int packs) {
  return std::max<int64_t>(32, (ceil_div(ceil_div(cols, vec), packs) + 31) / 32 * 32);
}

template <class T, int kVec>
struct ForwardOp {
  using Params = SoftmaxParams;
  static constexpr int kMaxElems = kVec > 1 ? kForwardMaxElems : kForwardScalarMaxElems;
  static constexpr int64_t kMaxRowCols = int64_t(kRowMaxThreads) * kMaxElems;
  // Short rows longer than this take a block per row (launch_paths): 16-bit rows of 16-byte packs
  // only.
  static constexpr int64_t kBlockRowsAbove = (sizeof(T) == 2 && kVec > 1) ? 512 : kWarpMaxCols;
  // Those rows take two packs a thread (64 threads for 1024 columns), unless one pack a thread
  // leaves fewer threads idle (fewer than twice the threads) or the rows' warps at one pack a
  // thread fit on the SMs at once (64 an SM). Measured on an H200 (bf16, kernel time after a zeroing L2 flush, bench/NOTES.md sections
  // 18 and 76): two packs 32768x1024 35.2 us against 38.0 with one, 4096x1024 6.34 against 6.75;
  // one pack 1024x1024 3.07 against 3.52, 2048x1024 4.24 against 4.77, 1024x768 2.82 against 3.36,
  // 4096x640 5.34 against 5.97 (two packs leave 24 of 64 threads idle).
  static bool one_pack_rows(SoftmaxParams const& p) {
    const int64_t one = row_block_threads(p.cols, kVec, 1);
    if (one < 2 * row_block_threads(p.cols, kVec, 2)) return true;
    return p.sm_count > 0 && p.rows * (one / 32) <= int64_t(kMaxWarpsPerSm) * p.sm_count;
  }
  // 16-bit rows of 16-byte packs load all their packs before the maximum: a lane's loads were
  // otherwise issued one pack after another's max. 1.00-1.04x on an H200, bitwise equal (bf16
  // 4096x128 and 4096x512 1.04x, 65536x128 1.04x, 1024x1024 1.04x, 32768x1024 1.00x; bench/NOTES.md
  // section 67). Float32 rows keep their loads: the loaded-ahead form was 11% slower there (section 17).
  template <int kLanes, int kPacks>
  static auto warp_kernel() {
    return softmax_warp_kernel<T, kVec, kLanes, kPacks, (sizeof(T) == 2 && kVec > 1)>;
  }
  template <int kPacks>
  static auto row_kernel() { return softmax_row_kernel<T, kVec, kPacks>; }
  static auto long_kernel() { return softmax_long_kernel<T, kVec>; }
  static auto partial_kernel() { return softmax_partial_stats_kernel<T, kVec>; }
  static auto split_write_kernel() { return softmax_split_write_kernel<T, kVec>; }
  // Rows over this many columns try shared memory first (launch_shared_rows).
  static constexpr int64_t kSharedAbove = kSharedRowsAbove;
  static bool launch_shared(SoftmaxParams const& p, cudaStream_t stream) {
    if constexpr (kVec == vec_width<T>()) {
      return launch_shared_rows<T>(p, 1, softmax_shared_kernel<T>, softmax_cluster_kernel<T>, stream);
    }
    return false;
  }
};

template <class T, int kVec>
struct BackwardOp {
  using Params = SoftmaxBackwardParams;
  static constexpr int kMaxElems = kBackwardMaxElems;
  static constexpr int64_t kMaxRowCols = kBackwardMaxRowCols;
  // 16-bit rows of 513-1024 columns: a block per row, one pack of dy and one of y a thread, instead
  // of a warp with four of each a lane. Measured on an H200 (bf16, kernel time after a zeroing L2
  // flush, bench/NOTES.md section 76): 1024x1024 3.62 us against 3.78, 2048x1024 5.12 against 5.33,
  // 8192x1024 14.34 against 14.74, 32768x1024 49.0 against 49.3, 1024x768 3.17 against 3.30,
  // 4096x640 6.08 against 6.30, 4096x1024 a tie (8.50 against 8.51).
  static constexpr int64_t kBlockRowsAbove = (sizeof(T) == 2 && kVec > 1) ? 512 : kWarpMaxCols;
  static bool one_pack_rows(SoftmaxBackwardParams const&) { return true; }
  template <int kLanes, int kPacks>
  static auto warp_kernel() { return softmax_backward_warp_kernel<T, kVec, kLanes, kPacks>; }
  template <int kPacks>
  static auto row_kernel() { return softmax_backward_row_kernel<T, kVec, kPacks>; }
  static auto long_kernel() { return softmax_backward_long_kernel<T, kVec>; }
  static auto partial_kernel() { return softmax_backward_partial_dot_kernel<T, kVec>; }
  static auto split_write_kernel() { return softmax_backward_split_write_kernel<T, kVec>; }
  // The backward keeps its register rows (dy and y) up to kBackwardMaxRowCols columns.
  static constexpr int64_t kSharedAbove = kBackwardMaxRowCols;
  static bool launch_shared(SoftmaxBackwardParams const& p, cudaStream_t stream) {
    if constexpr (kVec == vec_width<T>()) {
      return launch_shared_rows<T>(p, 2, softmax_backward_shared_kernel<T>, softmax_backward_cluster_kernel<T>,
                                   stream);
    }
    return false;
  }
};

template <class Op, int kVec, int kLanes, int kPacks>
void launch_warp(typename Op::Params const& p, cudaStream_t stream) {
  // Instantiated only where a row of up to kWarpMaxCols can need it.
  if constexpr (kLanes * kPacks * kVec <= kWarpMaxCols) {
    constexpr int kRowsPerBlock = kWarpBlockThreads / kLanes;
    const int64_t blocks = ceil_div(p.rows, kRowsPerBlock);
    Op::template warp_kernel<kLanes, kPacks>()<<<unsigned(blocks), kWarpBlockThreads, 0, stream>>>(p);
  }
}

// At least 2 packs per lane (32 bytes in flight per thread at full occupancy): rows of up to 32
// packs take a power-of-two part of a warp, longer ones a whole warp with 2..32 packs per lane.
template <class Op, int kVec>
void launch_short(typename Op::Params const& p, cudaStream_t stream) {
  const int64_t packs = ceil_div(p.cols, kVec);
  if (packs <= 32) {
    switch (pow2_at_least(ceil_div(packs, 2))) {
      case 1: return launch_warp<Op, kVec, 1, 2>(p, stream);
      case 2: return launch_warp<Op, kVec, 2, 2>(p, stream);
      case 4: return launch_warp<Op, kVec, 4, 2>(p, stream);
      case 8: return launch_warp<Op, kVec, 8, 2>(p, stream);
      default: return launch_warp<Op, kVec, 16, 2>(p, stream);
    }
  }
  switch (pow2_at_least(ceil_div(packs, 32))) {
    case 2: return launch_warp<Op, kVec, 32, 2>(p, stream);
    case 4: return launch_warp<Op, kVec, 32, 4>(p, stream);
    case 8: return launch_warp<Op, kVec, 32, 8>(p, stream);
    case 16: return launch_warp<Op, kVec, 32, 16>(p, stream);
    default: return launch_warp<Op, kVec, 32, 32>(p, stream);
  }
}

template <class Op, int kVec, int kElems>
void launch_row(typename Op::Params const& p, cudaStream_t stream) {
  if constexpr (kElems <= Op::kMaxElems) {
    constexpr int kPacks = kElems / kVec;
    const int64_t threads = row_block_threads(p.cols, kVec, kPacks);
    Op::template row_kernel<kPacks>()<<<unsigned(p.rows), unsigned(threads), 0, stream>>>(p);
  }
}

// Forward: 16 elements per thread (at most 32 registers, so 2048 threads and 64 KB of loads in
// flight per multiprocessor), 32 for rows longer than 16384. Backward: 8 of dy and 8 of y per
// thread, 16 for rows longer than 8192. The forward's vector-path rows over kSharedRowsAbove
// columns come here only where launch_shared_rows could not launch (shared memory refused).
template <class Op, int kVec>
void launch_medium(typename Op::Params const& p, cudaStream_t stream) {
  constexpr int kElems = Op::kMaxElems / 2;
  if (p.cols <= int64_t(kRowMaxThreads) * kElems) return launch_row<Op, kVec, kElems>(p, stream);
  return launch_row<Op, kVec, Op::kMaxElems>(p, stream);
}

// Rows that Op::launch_shared did not take (launch_paths asks it first).
template <class Op, int kVec>
void launch_long(typename Op::Params const& p, cudaStream_t stream) {
  if (p.row_splits <= 1) {
    Op::long_kernel()<<<unsigned(p.rows), kLongThreads, 0, stream>>>(p);
    return;
  }
  const int64_t chunk = ceil_div(ceil_div(p.cols, p.row_splits), kSplitChunkAlign) * kSplitChunkAlign;
  const dim3 grid(unsigned(ceil_div(p.cols, chunk)), unsigned(p.rows));
  Op::partial_kernel()<<<grid, kLongThreads, 0, stream>>>(p, chunk);
  Op::split_write_kernel()<<<grid, kLongThreads, 0, stream>>>(p, chunk);
}

// 16-bit rows of 513-1024 columns run a block per row (Op::kBlockRowsAbove) instead of a warp with
// up to four packs a lane: the forward with two 16-byte packs a thread, or one where
// Op::one_pack_rows says so; the backward with one pack of dy and one of y a thread.
template <class Op, int kVec>
void launch_paths(typename Op::Params const& p, cudaStream_t stream) {
  if constexpr (Op::kBlockRowsAbove < kWarpMaxCols) {
    if (p.cols > Op::kBlockRowsAbove && p.cols <= kWarpMaxCols) {
      if (Op::one_pack_rows(p)) return launch_row<Op, kVec, kVec>(p, stream);
      return launch_row<Op, kVec, 2 * kVec>(p, stream);
    }
  }
  if (p.cols <= kWarpMaxCols) return launch_short<Op, kVec>(p, stream);
  if (p.cols > Op::kSharedAbove && Op::launch_shared(p, stream)) return;
  if (p.cols <= Op::kMaxRowCols) return launch_medium<Op, kVec>(p, stream);
  launch_long<Op, kVec>(p, stream);
}

bool vector_ok(const void* base, int64_t ld, int64_t rows, int vec) {
  return aligned16(base) && (rows <= 1 || ld % vec == 0);
}

template <class T>
struct ForwardFn {
  void operator()(SoftmaxParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    if (p.cols % kVec == 0 && vector_ok(p.x, p.x_ld, p.rows, kVec) && vector_ok(p.y, p.y_ld, p.rows, kVec)) {
      launch_paths<ForwardOp<T, kVec>, kVec>(p, stream);
    } else {
      launch_paths<ForwardOp<T, 1>, 1>(p, stream);
    }
  }
};

template <class T>
struct BackwardFn {
  void operator()(SoftmaxBackwardParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    if (p.cols % kVec == 0 && vector_ok(p.grad, p.grad_ld, p.rows, kVec) && vector_ok(p.y, p.y_ld, p.rows, kVec) &&
        vector_ok(p.grad_input, p.grad_input_ld, p.rows, kVec)) {
      launch_paths<BackwardOp<T, kVec>, kVec>(p, stream);
    } else {
      launch_paths<BackwardOp<T, 1>, 1>(p, stream);
    }
  }
};

template <class P>
LaunchResult check_params(P const& p) {
  if (p.rows > 0x7fffffff) return {"launch", "more than 2^31 - 1 rows"};
  if (p.row_splits > 1 && p.partials == nullptr) return {"launch", "row_splits > 1 needs a partials workspace"};
  if (p.row_splits > 1 && p.rows > 65535) return {"launch", "split rows are limited to 65535 rows"};
  return {};
}

}  // namespace

int softmax_row_splits(int64_t rows, int64_t cols, bool backward, int sm_count) {
  const int64_t max_row_cols = backward ? kBackwardMaxRowCols : kForwardMaxRowCols;
  const int64_t target_blocks = int64_t(kSplitBlocksPerSm) * std::max(sm_count, 1);
  if (cols <= max_row_cols || rows <= 0 || rows >= target_blocks) return 1;
  const int64_t splits = std::min(ceil_div(target_blocks, rows), ceil_div(cols, kMinSplitChunk));
  return int(std::max<int64_t>(1, splits));
}

int64_t softmax_partials_floats(int64_t rows, int row_splits, bool backward) {
  return row_splits > 1 ? rows * row_splits * (backward ? 1 : 2) : 0;
}

LaunchResult softmax_forward(SoftmaxParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  const LaunchResult bad = check_params(p);
  if (!bad.ok()) return bad;
  return dispatch_dtype<ForwardFn>(p, stream);
}

LaunchResult softmax_backward(SoftmaxBackwardParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  const LaunchResult bad = check_params(p);
  if (!bad.ok()) return bad;
  return dispatch_dtype<BackwardFn>(p, stream);
}

}  // namespace cutlass_ext
