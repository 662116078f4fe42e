// Few-column GEMM (N <= 16: a narrow MLP layer's output, a K-major product with a handful of
// columns), hand-written:
//   D = act(alpha * A B + bias), optionally Aux = the pre-activation; fp16, bf16 and fp32.
// Each output is the dot product of a row of A with a column of B, and each A element takes part
// in at most 16 multiply-adds, so the product is a stream over A. A tensor-core tile would spend
// most of its work on columns that are not there and needs N (and K) padded to 16 bytes, which
// costs copies of B, of the bias and of the output. This kernel reads A (K-major, any row stride
// and alignment), B (any strides) and the bias where they are and writes D unpadded. The
// binding's heuristic gives it N <= 4 (few_column_kernel in bindings/gemm.cpp); N up to 16 runs
// when the config is forced.
//
// B is staged once per block as fp32 in shared memory, zero-filled past K and N. A group of
// kLanes adjacent lanes shares kRows rows of A; lane j reads the 16-byte chunks j, j + kLanes, ...
// of each row, so one load instruction of the group reads one contiguous stretch. The group's
// partial sums are combined by a halving exchange (each step a lane sends half of its values and
// keeps the other half), so that kRows * kN sums cost about kRows * kN shuffles, not
// kRows * kN * log2(kLanes). Blocks are persistent: each walks a contiguous range of row tiles.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/device_utils.cuh"
#include "common/resident_blocks.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext::gemv {

constexpr int kThreads = 256;
constexpr int kMaxN = kGemvMaxN;

// One chunk is one 16-byte access of A: kVec elements of K.
template <class T>
constexpr int chunk_elems() { return 16 / int(sizeof(T)); }

// Floats of one chunk's B rows in shared memory (gemm_params.h).
template <class T, int kN>
constexpr int chunk_stride() { return gemv_chunk_stride(chunk_elems<T>(), kN); }

// Rows a lane group multiplies at once. Each B value read from shared memory serves kRows rows:
// with one row, N = 8 read 32 bytes of B per element of A, and 65536 x 1024 -> 8 was bound by
// shared-memory bandwidth (95 us against 49 for a tensor-core tile, H200). At most 32 sums.
template <int kN>
constexpr int rows_per_group() { return kN >= 16 ? 2 : 4; }

// Sums v[0..kCur) over the lanes of an aligned group (xor offsets kO, kO/2, ..., 1). While more
// than one value is left, a step halves them: a lane whose bit kO is set keeps the upper half
// (adding its partner's upper half), the other the lower half. `base` accumulates the index of
// the first value a lane ends up holding; once one value is left, the remaining steps add it
// across lanes, which then hold the same sum.
template <int kCur, int kO>
struct HalvingSum {
  template <int V>
  __device__ __forceinline__ static void run(float (&v)[V], int lane, int& base) {
    if constexpr (kO > 0) {
      if constexpr (kCur > 1) {
        constexpr int kHalf = kCur / 2;
        const bool upper = (lane & kO) != 0;
#pragma unroll
        for (int i = 0; i < kHalf; ++i) {
          const float send = upper ? v[i] : v[i + kHalf];
          const float keep = upper ? v[i + kHalf] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kO);
        }
        if (upper) base += kHalf;
        HalvingSum<kHalf, kO / 2>::run(v, lane, base);
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], kO);
        HalvingSum<1, kO / 2>::run(v, lane, base);
      }
    }
  }
};

template <class T>
__device__ __forceinline__ float to_float(T x) { return float(x); }

template <class T, int kN, int kLanes>
__global__ void __launch_bounds__(kThreads) gemv_gemm_kernel(GemmParams p, bool vector_a, int64_t tiles_per_block) {
  constexpr int kVec = chunk_elems<T>();
  constexpr int kStride = chunk_stride<T, kN>();
  constexpr int kRows = rows_per_group<kN>();
  constexpr int kGroups = kThreads / kLanes;
  constexpr int kTileRows = kGroups * kRows;
  constexpr int kSums = kRows * kN;
  // B values read per shared-memory access: whole float4s (kN >= 4: a row of kN values;
  // kN < 4: 4 / kN rows).
  constexpr int kRowsPerRead = kN >= 4 ? 1 : 4 / kN;
  extern __shared__ float4 shared_b4[];
  float* const shared_b = reinterpret_cast<float*>(shared_b4);

  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  const int64_t M = p.M, K = p.K;
  const int64_t chunks = ceil_div(K, kVec);
  const int64_t tiles_per_batch = ceil_div(M, kTileRows);
  const int64_t tiles = tiles_per_batch * p.L;
  const int64_t first = int64_t(blockIdx.x) * tiles_per_block;
  const int64_t last = first + tiles_per_block < tiles ? first + tiles_per_block : tiles;
  const T* const bias = static_cast<const T*>(p.bias);
  int64_t staged = -1;  // the batch whose B is in shared memory

  for (int64_t tile = first; tile < last; ++tile) {
    const int64_t l = tile / tiles_per_batch;
    if (l != staged && (staged < 0 || p.b_stride_l != 0)) {
      __syncthreads();  // every group is done with the previous batch's B
      const T* B = static_cast<const T*>(p.B) + l * p.b_stride_l;
      for (int64_t idx = threadIdx.x; idx < chunks * kVec * kN; idx += kThreads) {
        const int64_t k = idx / kN;
        const int n = int(idx % kN);
        const float b = (k < K && n < p.N) ? to_float(B[k * p.b_stride_k + n * p.b_stride_n]) : 0.f;
        shared_b[(k / kVec) * kStride + (k % kVec) * kN + n] = b;
      }
      __syncthreads();
    }
    staged = l;

    // This group's rows; rows past M read row M - 1 and are not stored.
    const int64_t row0 = (tile % tiles_per_batch) * kTileRows + int64_t(group) * kRows;
    const T* rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      rows[r] = static_cast<const T*>(p.A) + l * p.a_stride_l + (row0 + r < M ? row0 + r : M - 1) * p.a_stride_m;
    }
    float sums[kSums];
#pragma unroll
    for (int s = 0; s < kSums; ++s) sums[s] = 0.f;

    // Chunk c of every row times B's chunk c.
    auto multiply = [&](int64_t c, const Pack<T, kVec> (&a)[kRows]) {
      const float* bc = shared_b + c * kStride;
#pragma unroll
      for (int i0 = 0; i0 < kVec; i0 += kRowsPerRead) {
        float b[kRowsPerRead * kN];
#pragma unroll
        for (int q = 0; q < kRowsPerRead * kN / 4; ++q) {
          const float4 v = reinterpret_cast<const float4*>(bc + i0 * kN)[q];
          b[4 * q] = v.x;
          b[4 * q + 1] = v.y;
          b[4 * q + 2] = v.z;
          b[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int ii = 0; ii < kRowsPerRead; ++ii) {
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float x = to_float(a[r].v[i0 + ii]);
#pragma unroll
            for (int n = 0; n < kN; ++n) sums[r * kN + n] = fmaf(x, b[ii * kN + n], sums[r * kN + n]);
          }
        }
      }
    };
    // Whole chunks of aligned rows: one 16-byte load each. The rest (a partial last chunk, or
    // every chunk of unaligned rows): element by element, zeros past K. Two loops, so that the
    // element-wise loads do not share registers with the vector loop.
    // At N = 16 two chunks of every row are loaded before either is multiplied: with one, a lane
    // had only kRows (2) 16-byte loads in flight, and a 13 -> 512 layer's dX (512 -> 13) streamed
    // dZ at about half the copy rate. (At N <= 8, four rows a group, the second chunk's registers
    // made ptxas spill.)
    const int64_t whole = vector_a ? K / kVec : 0;
    int64_t c = lane;
    for (; kN >= 16 && c + kLanes < whole; c += 2 * kLanes) {
      Pack<T, kVec> a[kRows], a2[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        a[r] = load_pack<T, kVec>(rows[r] + c * kVec);
        a2[r] = load_pack<T, kVec>(rows[r] + (c + kLanes) * kVec);
      }
      multiply(c, a);
      multiply(c + kLanes, a2);
    }
    for (; c < whole; c += kLanes) {
      Pack<T, kVec> a[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) a[r] = load_pack<T, kVec>(rows[r] + c * kVec);
      multiply(c, a);
    }
#pragma unroll 1
    for (int64_t c = whole + lane; c < chunks; c += kLanes) {
      Pack<T, kVec> a[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) a[r].v[i] = c * kVec + i < K ? rows[r][c * kVec + i] : T(0.f);
      }
      multiply(c, a);
    }

    int base = 0;
    HalvingSum<kSums, kLanes / 2>::run(sums, lane, base);
    // Past the halving steps the lanes of a (kLanes / kSums)-lane subgroup hold the same sums:
    // its first lane stores them.
    constexpr int kHeld = kSums >= kLanes ? kSums / kLanes : 1;
    constexpr int kCopies = kSums >= kLanes ? 1 : kLanes / kSums;
    if (lane % kCopies != 0) continue;
#pragma unroll
    for (int h = 0; h < kHeld; ++h) {
      const int s = base + h;
      const int r = s / kN, n = s % kN;
      const int64_t m = row0 + r;
      if (m >= M || n >= p.N) continue;
      float z = p.alpha * sums[h];
      if (bias != nullptr) z += to_float(bias[n]);
      if (p.aux != nullptr) static_cast<T*>(p.aux)[l * p.aux_stride_l + m * p.aux_stride_m + n] = T(z);
      static_cast<T*>(p.D)[l * p.d_stride_l + m * p.d_stride_m + n] = T(act::forward_for<T>(p.activation, z));
    }
  }
}

// Lanes sharing a row: enough 16-byte chunks for each lane to have one, at most a warp.
template <class T>
int lanes_for(int64_t K) {
  const int64_t chunks = ceil_div(K, chunk_elems<T>());
  return chunks >= 32 ? 32 : chunks >= 16 ? 16 : chunks >= 8 ? 8 : 4;
}

// Calls f(integral_constant<kN>, integral_constant<kLanes>) for the instantiation of an (N, lanes)
// pair: kN is N rounded up to a power of two (gemv_n_pow2).
template <class F>
void dispatch_shape(int N, int lanes, F&& f) {
  auto with_lanes = [&](auto n) {
    switch (lanes) {
      case 4: return f(n, std::integral_constant<int, 4>{});
      case 8: return f(n, std::integral_constant<int, 8>{});
      case 16: return f(n, std::integral_constant<int, 16>{});
      default: return f(n, std::integral_constant<int, 32>{});
    }
  };
  switch (gemv_n_pow2(N)) {
    case 1: return with_lanes(std::integral_constant<int, 1>{});
    case 2: return with_lanes(std::integral_constant<int, 2>{});
    case 4: return with_lanes(std::integral_constant<int, 4>{});
    case 8: return with_lanes(std::integral_constant<int, 8>{});
    default: return with_lanes(std::integral_constant<int, 16>{});
  }
}

template <class Element>
struct GemmBundle {
  using T = Element;

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    if (p.N > kMaxN) return {"can_implement", "the few-column GEMM takes N <= 16"};
    if (p.C != nullptr) return {"can_implement", "the few-column GEMM has no C source"};
    if (p.a_stride_k != 1 && p.K > 1) return {"can_implement", "the few-column GEMM needs a K-major A"};
    if (p.M == 0 || p.N == 0 || p.L == 0) return {};
    constexpr int kVec = chunk_elems<T>();
    const bool vector_a =
        aligned16(p.A) && p.a_stride_m % kVec == 0 && (p.L == 1 || p.a_stride_l % kVec == 0);
    LaunchResult result;
    dispatch_shape(p.N, lanes_for<T>(p.K), [&](auto n, auto lanes) {
      constexpr int kN = decltype(n)::value, kLanes = decltype(lanes)::value;
      const int64_t smem = gemv_shared_bytes(p.K, p.N, int(sizeof(T)));
      if (smem > kGemvMaxSharedBytes) {
        result = {"can_implement", "the few-column GEMM holds B in at most 72 KB of shared memory (K * N too large)"};
        return;
      }
      const void* kernel = reinterpret_cast<const void*>(gemv_gemm_kernel<T, kN, kLanes>);
      if (smem > 48 * 1024) {
        const cudaError_t err = allow_large_dynamic_shared(kernel, p.device);
        if (err != cudaSuccess) {
          result = {"initialize", cudaGetErrorString(err)};
          return;
        }
      }
      constexpr int kTileRows = (kThreads / kLanes) * rows_per_group<kN>();
      const int64_t tiles = ceil_div(p.M, kTileRows) * p.L;
      const int64_t slots =
          int64_t(std::max(p.sm_count, 1)) * cached_resident_blocks(kernel, kThreads, int(smem), p.device);
      const int64_t per_block = ceil_div(tiles, std::min(tiles, slots));
      const unsigned blocks = unsigned(ceil_div(tiles, per_block));
      gemv_gemm_kernel<T, kN, kLanes><<<blocks, kThreads, size_t(smem), stream>>>(p, vector_a, per_block);
    });
    if (!result.ok()) return result;
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::gemv
