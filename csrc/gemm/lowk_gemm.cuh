// Short-K GEMM (K <= 64: LoRA rank-r products and merges, narrow input layers), hand-written.
//   D = act(alpha * A B + beta * C + bias), optionally Aux = the pre-activation; 16-bit types.
// With K <= 64 each output element costs at most 64 multiply-adds but 2-3 memory accesses (C read,
// D written), so the kernel is a stream over C and D: a CUTLASS mainloop with a single k-tile per
// output tile leaves its one CTA per SM waiting on the epilogue's loads and stores. Here small
// blocks (64x128 outputs) run several to an SM: each loads its A and B tiles (all of K at once)
// into shared memory, prefetches its C tile into registers, multiplies with mma.sync
// (m16n8k16, fp32 accumulation), stages the fp32 tile through shared memory and writes it back
// with 16-byte accesses.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/device_utils.cuh"
#include "gemm/gemm_params.h"

namespace cutlass_ext::lowk {

constexpr int kTileM = 64, kTileN = 128, kMaxK = 64;
constexpr int kThreads = 256;             // 8 warps: 2 along M x 4 along N, 32x32 outputs each
constexpr int kOperandStride = kMaxK + 8;  // shared rows of A and B^T, padded against bank conflicts
constexpr int kAccStride = kTileN + 8;     // fp32 staging rows
constexpr int kVec = 8;                    // 16-bit elements per 16-byte access
// The epilogue gives each lane 8 adjacent columns (16-byte accesses to C and D): 16 lanes per
// row, 16 rows per pass, 4 passes. A lane reads its 8 fp32 sums as two 16-byte chunks of the
// staging row, the even chunk first in lanes 0-3 of each group of 8 and the odd one first in
// lanes 4-7, so that every 8-lane phase of a read touches 32 distinct banks.
constexpr int kLanesPerRow = kTileN / kVec;               // 16
constexpr int kRowsPerPass = kThreads / kLanesPerRow;     // 16
constexpr int kPasses = kTileM / kRowsPerPass;            // 4

template <class T>
struct alignas(16) Operands {
  T a[kTileM][kOperandStride];  // A tile, K contiguous
  T b[kTileN][kOperandStride];  // B^T tile, K contiguous
};

template <class T>
union SharedStorage {
  Operands<T> operands;
  float acc[kTileM][kAccStride];
};

template <class T>
__device__ __forceinline__ uint32_t pair_at(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Copies a [rows, K] operand tile into shared memory with K contiguous. `k_major`: the operand
// is contiguous along K (vectors along K), else along rows (vectors along rows, transposed on
// the way in). Out-of-range rows and K up to `k_pad` are zero.
template <class T, int kRowsTile>
__device__ __forceinline__ void load_operand(T (*dst)[kOperandStride], const T* src, int64_t stride_row,
                                             int64_t stride_k, bool k_major, int rows, int K, int k_pad) {
  const T zero = T(0.f);
  if (k_major) {
    const int chunks = k_pad / kVec;
    for (int i = threadIdx.x; i < kRowsTile * chunks; i += kThreads) {
      const int r = i / chunks, k = (i % chunks) * kVec;
      Pack<T, kVec> v;
      if (r < rows && k < K) {
        v = load_pack<T, kVec>(src + r * stride_row + k);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v.v[j] = zero;
      }
      store_pack<T, kVec>(&dst[r][k], v);
    }
  } else {
    constexpr int chunks = kRowsTile / kVec;
    for (int i = threadIdx.x; i < chunks * k_pad; i += kThreads) {
      const int k = i / chunks, r = (i % chunks) * kVec;
      Pack<T, kVec> v;
      if (r < rows && k < K) {
        v = load_pack<T, kVec>(src + int64_t(k) * stride_k + r);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v.v[j] = zero;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) dst[r + j][k] = v.v[j];
    }
  }
}

// kAct: the activation, a template parameter so that each instantiation inlines only its own
// (a run-time switch over all of them, unrolled over the epilogue, overflowed the instruction
// cache: 36% of the stalls on an H200).
template <class T, int kAct>
__global__ void __launch_bounds__(kThreads, 3) lowk_gemm_kernel(GemmParams p, bool a_k_major, bool b_k_major) {
  __shared__ SharedStorage<T> smem;
  const int m0 = blockIdx.y * kTileM, n0 = blockIdx.x * kTileN;
  const int64_t l = blockIdx.z;
  const int rows = min(kTileM, p.M - m0), cols = min(kTileN, p.N - n0);
  // Epilogue accesses of this thread: rows e_row + 16 * pass, columns e_col .. e_col + 7.
  const int e_col = (threadIdx.x % kLanesPerRow) * kVec;
  const int e_row = threadIdx.x / kLanesPerRow;
  const bool e_live = e_col < cols;

  // The C tile streams in while the operands load and multiply.
  Pack<T, kVec> c_tile[kPasses];
  const T* C = static_cast<const T*>(p.C);
  if (C != nullptr && e_live) {
    const T* c_row = C + l * p.c_stride_l + int64_t(m0 + e_row) * p.c_stride_m + n0 + e_col;
    const int64_t c_step = int64_t(kRowsPerPass) * p.c_stride_m;
#pragma unroll
    for (int i = 0; i < kPasses; ++i, c_row += c_step) {
      if (e_row + i * kRowsPerPass < rows) c_tile[i] = load_pack<T, kVec>(c_row);
    }
  }

  const int k_pad = (p.K + 15) / 16 * 16;
  const T* A = static_cast<const T*>(p.A) + l * p.a_stride_l + int64_t(m0) * p.a_stride_m;
  const T* B = static_cast<const T*>(p.B) + l * p.b_stride_l + int64_t(n0) * p.b_stride_n;
  load_operand<T, kTileM>(smem.operands.a, A, p.a_stride_m, p.a_stride_k, a_k_major, rows, p.K, k_pad);
  load_operand<T, kTileN>(smem.operands.b, B, p.b_stride_n, p.b_stride_k, b_k_major, cols, p.K, k_pad);
  __syncthreads();

  // Warp (wm, wn) owns rows 32 wm .. +32 and columns 32 wn .. +32: 2 x 4 mma tiles of 16x8.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / 4, wn = warp % 4, g = lane >> 2, t = lane & 3;
  float acc[2][4][4] = {};
  for (int k = 0; k < k_pad; k += 16) {
    uint32_t a[2][4], b[4][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wm * 32 + i * 16 + g;
      a[i][0] = pair_at(&smem.operands.a[r][k + 2 * t]);
      a[i][1] = pair_at(&smem.operands.a[r + 8][k + 2 * t]);
      a[i][2] = pair_at(&smem.operands.a[r][k + 2 * t + 8]);
      a[i][3] = pair_at(&smem.operands.a[r + 8][k + 2 * t + 8]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = wn * 32 + j * 8 + g;
      b[j][0] = pair_at(&smem.operands.b[n][k + 2 * t]);
      b[j][1] = pair_at(&smem.operands.b[n][k + 2 * t + 8]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], a[i], b[j]);
    }
  }
  __syncthreads();  // the operands' shared memory becomes the fp32 staging tile
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = wm * 32 + i * 16 + g, c = wn * 32 + j * 8 + 2 * t;
      *reinterpret_cast<float2*>(&smem.acc[r][c]) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(&smem.acc[r + 8][c]) = make_float2(acc[i][j][2], acc[i][j][3]);
    }
  }
  __syncthreads();

  if (!e_live) return;
  float bias[kVec] = {};
  if (p.bias != nullptr) load_vec<T, kVec>(static_cast<const T*>(p.bias) + n0 + e_col, bias);
  const float alpha = p.alpha, beta = p.beta;
  const bool odd_first = (threadIdx.x >> 2) & 1;
  // Row pointers stepped per pass (the aux one only when there is an aux output: it starts null).
  const bool has_aux = p.aux != nullptr;
  T* d_row = static_cast<T*>(p.D) + l * p.d_stride_l + int64_t(m0 + e_row) * p.d_stride_m + n0 + e_col;
  T* aux_row = has_aux ? static_cast<T*>(p.aux) + l * p.aux_stride_l + int64_t(m0 + e_row) * p.aux_stride_m + n0 + e_col
                       : nullptr;
  const int64_t d_step = int64_t(kRowsPerPass) * p.d_stride_m;
  const int64_t aux_step = has_aux ? int64_t(kRowsPerPass) * p.aux_stride_m : 0;
#pragma unroll
  for (int i = 0; i < kPasses; ++i, d_row += d_step, aux_row += aux_step) {
    const int r = e_row + i * kRowsPerPass;
    if (r >= rows) break;
    const float4* staged = reinterpret_cast<const float4*>(&smem.acc[r][e_col]);
    const float4 first = staged[odd_first ? 1 : 0], second = staged[odd_first ? 0 : 1];
    const float4 lo = odd_first ? second : first, hi = odd_first ? first : second;
    const float sums[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float v[kVec], y[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      v[j] = alpha * sums[j] + bias[j];
      if (C != nullptr) v[j] += beta * float(c_tile[i].v[j]);
      y[j] = act::forward(kAct, v[j]);
    }
    if (has_aux) store_vec<T, kVec>(aux_row, v);
    store_vec<T, kVec>(d_row, y);
  }
}

template <class Element>
struct GemmBundle {
  using T = Element;
  static_assert(sizeof(T) == 2, "the short-K GEMM multiplies 16-bit types");

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    if (p.K > kMaxK) return {"can_implement", "the short-K GEMM takes K <= 64"};
    if (p.L > 65535 || (p.M + kTileM - 1) / kTileM > 65535) {
      return {"can_implement", "the short-K GEMM takes at most 65535 batches and 65535 * 64 rows"};
    }
    // Operand, C and D accesses are 16-byte vectors along the contiguous dimension.
    const bool a_k_major = p.a_stride_k == 1, b_k_major = p.b_stride_k == 1;
    auto ok = [](int64_t s) { return s % kVec == 0; };
    const bool aligned = aligned16(p.A) && aligned16(p.B) && aligned16(p.D) && p.N % kVec == 0 &&
                         p.K % kVec == 0 && ok(a_k_major ? p.a_stride_m : p.a_stride_k) &&
                         ok(b_k_major ? p.b_stride_n : p.b_stride_k) && (a_k_major || p.M % kVec == 0) &&
                         ok(p.d_stride_m) && (p.C == nullptr || (aligned16(p.C) && ok(p.c_stride_m))) &&
                         (p.aux == nullptr || (aligned16(p.aux) && ok(p.aux_stride_m))) &&
                         (p.bias == nullptr || aligned16(p.bias)) &&
                         (p.L == 1 || (ok(p.a_stride_l) && ok(p.b_stride_l) && ok(p.d_stride_l) &&
                                       (p.C == nullptr || ok(p.c_stride_l)) && (p.aux == nullptr || ok(p.aux_stride_l))));
    if (!aligned) return {"can_implement", "the short-K GEMM needs 16-byte aligned operands and rows"};
    if (!(a_k_major || p.a_stride_m == 1) || !(b_k_major || p.b_stride_n == 1)) {
      return {"can_implement", "the short-K GEMM needs a unit stride in each operand"};
    }
    const dim3 grid(unsigned((p.N + kTileN - 1) / kTileN), unsigned((p.M + kTileM - 1) / kTileM), unsigned(p.L));
    dispatch_activation(p.activation, [&](auto act) {
      lowk_gemm_kernel<T, decltype(act)::value><<<grid, kThreads, 0, stream>>>(p, a_k_major, b_k_major);
    });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::lowk
