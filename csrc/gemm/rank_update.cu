#include "gemm/rank_update.h"

#include <type_traits>

#include "common/device_utils.cuh"
#include "gemm/mma_sync.cuh"

namespace cutlass_ext {
namespace {

// A block updates a 128 x 64 tile of W: 8 warps of 16 rows each. A warp's 16 x 64 product is 8
// m16n8 mma tiles, and the columns of A's strip are stored in shared memory permuted ("slots") so
// that the accumulator fragment of lane (g, t) holds two 8-column pieces of W's rows g and g + 8:
// columns 8t .. 8t + 7 (n-tiles 0-3) and 32 + 8t .. 32 + 8t + 7 (n-tiles 4-7). W is then read and
// written in 16-byte pieces, and a warp's access to a row covers 64 adjacent bytes (two whole
// sectors). Slot 8j + n of n-tile j (n = 2t + e in the fragment) holds column
// 32 (j / 4) + 8t + 2 (j % 4) + e.
constexpr int kThreads = 256;
constexpr int kTileM = 128;
constexpr int kTileN = 64;
constexpr int kSlotStride = kTileN + 8;  // A strip row in shared memory: 144 bytes, conflict-free ldmatrix

__host__ __device__ constexpr int slot_of_column(int c) {
  return 8 * (4 * (c / 32) + (c % 8) / 2) + 2 * ((c % 32) / 8) + c % 2;
}

// Two 16-bit values of a 32-bit word as fp32 (the low half first), and back, rounded to nearest.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    float lo, hi;
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
    return make_float2(lo, hi);
  }
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t w;
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  }
  return w;
}

// kKB 16-deep k blocks: r <= 16 kKB, the rest of the last block zero. a_vec: A's rows in 16-byte
// pieces (unit column stride, aligned); b_vec: B's rows in 16-byte pieces (unit rank stride,
// aligned, r a multiple of 8).
template <class T, int kKB>
__global__ void __launch_bounds__(kThreads, 3) rank_update_kernel(RankUpdateParams p, bool a_vec, bool b_vec) {
  constexpr int kR = 16 * kKB;
  constexpr int kBStride = kR + 8;  // B row in shared memory: 48-144 bytes, conflict-free ldmatrix
  __shared__ alignas(16) T a_s[kR * kSlotStride];
  __shared__ alignas(16) T b_s[kTileM * kBStride];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN, m0 = int64_t(blockIdx.y) * kTileM;

  // W's pieces first: their loads are in flight while A and B are staged. Raw words, so that
  // each piece is one 16-byte load and one 16-byte store.
  T* const w = static_cast<T*>(p.w);
  const int64_t col = n0 + 8 * t;
  uint4 wv[2][2];
  bool ok[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = m0 + warp * 16 + g + 8 * h;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      ok[h][v] = row < p.M && col + 32 * v < p.N;
      wv[h][v] = ok[h][v] ? *reinterpret_cast<const uint4*>(w + row * p.ldw + col + 32 * v) : make_uint4(0, 0, 0, 0);
    }
  }

  // A's strip [kR, 64] in slot order, zero past r and N.
  const T* const a = static_cast<const T*>(p.a);
  if (a_vec) {
    for (int i = threadIdx.x; i < kR * (kTileN / 8); i += kThreads) {
      const int k = i / (kTileN / 8), c8 = i % (kTileN / 8);
      const int64_t n = n0 + 8 * c8;
      const uint4 v = k < p.r && n < p.N ? *reinterpret_cast<const uint4*>(a + k * p.a_stride_r + n)
                                         : make_uint4(0, 0, 0, 0);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(&a_s[k * kSlotStride + slot_of_column(8 * c8 + 2 * j)]) = words[j];
      }
    }
  } else {
    for (int i = threadIdx.x; i < kR * kTileN; i += kThreads) {
      const int k = i / kTileN, c = i % kTileN;
      const int64_t n = n0 + c;
      a_s[k * kSlotStride + slot_of_column(c)] = k < p.r && n < p.N ? a[k * p.a_stride_r + n * p.a_stride_n] : T(0.f);
    }
  }
  // B's rows [128, kR], zero past r and M.
  const T* const b = static_cast<const T*>(p.b);
  if (b_vec) {
    for (int i = threadIdx.x; i < kTileM * (kR / 8); i += kThreads) {
      const int m = i / (kR / 8), k8 = i % (kR / 8);
      const uint4 v = m0 + m < p.M && 8 * k8 < p.r
                          ? *reinterpret_cast<const uint4*>(b + (m0 + m) * p.b_stride_m + 8 * k8)
                          : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&b_s[m * kBStride + 8 * k8]) = v;
    }
  } else {
    for (int i = threadIdx.x; i < kTileM * kR; i += kThreads) {
      const int m = i / kR, k = i % kR;
      b_s[m * kBStride + k] = m0 + m < p.M && k < p.r ? b[(m0 + m) * p.b_stride_m + k * p.b_stride_r] : T(0.f);
    }
  }
  __syncthreads();

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }
  const int quad = lane / 8, in_quad = lane % 8;
#pragma unroll
  for (int kb = 0; kb < kKB; ++kb) {
    uint32_t af[4];
    ldmatrix_x4(af, &b_s[(warp * 16 + (quad % 2) * 8 + in_quad) * kBStride + kb * 16 + (quad / 2) * 8], false);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t bf[4];
      ldmatrix_x4(bf, &a_s[(kb * 16 + (quad % 2) * 8 + in_quad) * kSlotStride + 8 * (2 * jj + quad / 2)], true);
      const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
      mma_16816<T>(acc[2 * jj], af, b0);
      mma_16816<T>(acc[2 * jj + 1], af, b1);
    }
  }

  // acc[j][2h + e] is row g + 8h, column 32 (j / 4) + 8t + 2 (j % 4) + e: piece j / 4, word j % 4.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = m0 + warp * 16 + g + 8 * h;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      if (!ok[h][v]) continue;
      uint32_t in[4] = {wv[h][v].x, wv[h][v].y, wv[h][v].z, wv[h][v].w}, out[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 x = unpack2<T>(in[q]);
        const float* d = acc[4 * v + q];
        out[q] = pack2<T>(fmaf(p.alpha, d[2 * h], x.x), fmaf(p.alpha, d[2 * h + 1], x.y));
      }
      // One 16-byte store (nvcc split a plain uint4 store of these words into four).
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(w + row * p.ldw + col + 32 * v), "r"(out[0]),
                   "r"(out[1]), "r"(out[2]), "r"(out[3])
                   : "memory");
    }
  }
}

template <class T>
LaunchResult launch(RankUpdateParams const& p, bool a_vec, bool b_vec, cudaStream_t stream) {
  const dim3 grid(unsigned(ceil_div(p.N, kTileN)), unsigned(ceil_div(p.M, kTileM)));
  const int kb = (p.r + 15) / 16;
  if (kb == 1) {
    rank_update_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p, a_vec, b_vec);
  } else if (kb == 2) {
    rank_update_kernel<T, 2><<<grid, kThreads, 0, stream>>>(p, a_vec, b_vec);
  } else if (kb == 3) {
    rank_update_kernel<T, 3><<<grid, kThreads, 0, stream>>>(p, a_vec, b_vec);
  } else {
    rank_update_kernel<T, 4><<<grid, kThreads, 0, stream>>>(p, a_vec, b_vec);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  return {};
}

}  // namespace

bool rank_update_supported(RankUpdateParams const& p) {
  if (p.dtype == DType::kF32 || p.r < 1 || p.r > 64 || p.M < 1 || p.N < 1) return false;
  if (p.N % 8 != 0 || p.ldw % 8 != 0 || p.ldw < p.N || !aligned16(p.w)) return false;
  return ceil_div(p.M, kTileM) <= 65535 && ceil_div(p.N, kTileN) <= INT32_MAX;
}

LaunchResult rank_update(RankUpdateParams const& p, cudaStream_t stream) {
  if (!rank_update_supported(p)) return {"can_implement", "the rank-r update does not take these operands"};
  const bool a_vec = p.a_stride_n == 1 && p.a_stride_r % 8 == 0 && aligned16(p.a);
  const bool b_vec = p.b_stride_r == 1 && p.b_stride_m % 8 == 0 && p.r % 8 == 0 && aligned16(p.b);
  if (p.dtype == DType::kF16) return launch<cutlass::half_t>(p, a_vec, b_vec, stream);
  return launch<cutlass::bfloat16_t>(p, a_vec, b_vec, stream);
}

}  // namespace cutlass_ext
