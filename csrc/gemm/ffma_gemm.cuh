// Short-K fp32 GEMM on the FMA units (K <= 32: a narrow input layer such as a recommender's 13
// dense features), hand-written:
//   D = act(alpha * A B + bias), optionally Aux = the pre-activation; exact fp32.
// With K <= 32 an output costs at most 32 multiply-adds against 4-8 bytes written, so the
// product is a stream of D at the FMA units' pace: on an H200 (~67 TFLOP/s of fp32 FMA against
// ~3.5 TB/s of writes) the two meet near K = 30. The TF32 tensor-core tiles need K and the row
// strides in 16-byte pieces, so a 13-wide A and weight were first copied to 16-wide buffers (two
// more launches, 17 us against cuBLASLt's 8 at 2048 x 13 -> 512). This kernel reads A, B and the
// bias where they are (any strides and alignment) and writes D unpadded, in one launch, and it
// multiplies in fp32, so under the TF32 policy it is only more exact.
//
// A block takes one 128-wide column tile of D and a range of 64-row tiles under it: B's K x 128
// tile is read into shared memory once, transposed to [k][n], and while a row tile is multiplied
// and written, the next one's A (64 x K) is already on its way into registers, to be stored
// transposed to [k][m] in the other of two buffers. Thread (ty, tx) of a 16 x 16 grid owns rows
// 4 ty .. 4 ty + 3 and the columns 4 tx .. 4 tx + 3 and 64 + 4 tx .. 64 + 4 tx + 3, so a warp's
// half stores 256 contiguous bytes of a row and each k step reads three 16-byte vectors of shared
// memory for 32 multiply-adds.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation_16bit.h"
#include "common/device_utils.cuh"
#include "common/resident_blocks.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext::ffma {

constexpr int kTileM = 64, kTileN = 128, kMaxK = 32;
constexpr int kThreads = 256;
// Shared rows padded by 4 floats: the transposing stores of a K-major tile (consecutive threads,
// consecutive k of one line) land 4 banks apart instead of on one bank, and rows stay 16-byte
// aligned for the vector reads.
constexpr int kARow = kTileM + 4, kBRow = kTileN + 4;

// A tile of kLines lines (rows of A, columns of B) by up to kMaxK depths, held in registers
// between its load and its store. Slot s of the kLines x kMaxK slots is element (line, k), taken
// along the operand's unit stride (k when stride_k is 1, else the line) so that a warp's loads
// are contiguous; powers of two make the split a shift and a mask. Past K or valid_lines a slot
// is not loaded (zero) and, past K, not stored.
template <int kLines>
struct TileInRegisters {
  static constexpr int kPerThread = kLines * kMaxK / kThreads;
  float v[kPerThread];

  __device__ __forceinline__ static void slot(int j, bool along_k, int& line, int& k) {
    const int s = j * kThreads + int(threadIdx.x);
    line = along_k ? s / kMaxK : s % kLines;
    k = along_k ? s % kMaxK : s / kLines;
  }

  __device__ __forceinline__ void load(const float* src, int64_t stride_line, int64_t stride_k, bool along_k,
                                       int valid_lines, int K) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      int line, k;
      slot(j, along_k, line, k);
      v[j] = (k < K && line < valid_lines) ? src[line * stride_line + k * stride_k] : 0.f;
    }
  }

  // dst[k * kRow + line] for k < K.
  template <int kRow>
  __device__ __forceinline__ void store(float* dst, bool along_k, int K) const {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      int line, k;
      slot(j, along_k, line, k);
      if (k < K) dst[k * kRow + line] = v[j];
    }
  }
};

// Four adjacent outputs of one row: one 16-byte store where `vector` (the row and column are
// 16-byte aligned and the four are all inside N), else element by element within N.
__device__ __forceinline__ void store4(float* dst, const float (&v)[4], bool vector, int valid) {
  if (vector) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < valid) dst[j] = v[j];
    }
  }
}

// kAct: the activation, a template parameter so that each instantiation inlines only its own.
template <int kAct>
__global__ void __launch_bounds__(kThreads, 2) ffma_gemm_kernel(GemmParams p, int tiles_per_block, bool vector_out) {
  __shared__ __align__(16) float a_tile[2][kMaxK * kARow];
  __shared__ __align__(16) float b_tile[kMaxK * kBRow];
  const int tiles_m = (p.M + kTileM - 1) / kTileM;
  const int t_begin = int(blockIdx.x) * tiles_per_block;
  const int t_end = min(t_begin + tiles_per_block, tiles_m);
  if (t_begin >= t_end) return;
  const int64_t l = blockIdx.z;
  const int n0 = int(blockIdx.y) * kTileN, K = p.K;
  const bool a_along_k = p.a_stride_k == 1, b_along_k = p.b_stride_k == 1;
  const float* const A = static_cast<const float*>(p.A) + l * p.a_stride_l;
  TileInRegisters<kTileM> a;
  auto load_a = [&](int t) {
    a.load(A + int64_t(t) * kTileM * p.a_stride_m, p.a_stride_m, p.a_stride_k, a_along_k, p.M - t * kTileM, K);
  };
  {
    // B's and the first A tile's loads in flight together: one memory round trip.
    TileInRegisters<kTileN> b;
    b.load(static_cast<const float*>(p.B) + l * p.b_stride_l + int64_t(n0) * p.b_stride_n, p.b_stride_n,
           p.b_stride_k, b_along_k, p.N - n0, K);
    load_a(t_begin);
    b.store<kBRow>(b_tile, b_along_k, K);
  }
  a.store<kARow>(a_tile[0], a_along_k, K);

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  // Columns of this thread: two groups of four, at c0[g] .. c0[g] + 3 of the tile.
  const int c0[2] = {4 * tx, 64 + 4 * tx};
  const int cols = p.N - n0;
  float bias[8] = {};
  if (p.bias != nullptr) {
    const float* b = static_cast<const float*>(p.bias) + n0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0[j / 4] + j % 4;
      if (c < cols) bias[j] = b[c];
    }
  }
  const bool has_aux = p.aux != nullptr;
  float* const d = static_cast<float*>(p.D) + l * p.d_stride_l + n0;
  float* const aux = has_aux ? static_cast<float*>(p.aux) + l * p.aux_stride_l + n0 : nullptr;

  for (int t = t_begin; t < t_end; ++t) {
    const int buf = (t - t_begin) & 1;
    // Tile t's A is in a_tile[buf] (and B in b_tile) for every thread, and every thread is past
    // tile t - 1, which read the other buffer.
    __syncthreads();
    const bool next = t + 1 < t_end;
    if (next) load_a(t + 1);

    const float* at = a_tile[buf];
    float acc[4][8] = {};
#pragma unroll 2
    for (int k = 0; k < K; ++k) {
      const float4 av4 = *reinterpret_cast<const float4*>(&at[k * kARow + 4 * ty]);
      const float4 b0 = *reinterpret_cast<const float4*>(&b_tile[k * kBRow + 4 * tx]);
      const float4 b1 = *reinterpret_cast<const float4*>(&b_tile[k * kBRow + 64 + 4 * tx]);
      const float av[4] = {av4.x, av4.y, av4.z, av4.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = t * kTileM + 4 * ty + i;
      if (m >= p.M) break;
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const int valid = cols - c0[g];
        if (valid <= 0) continue;
        float v[4], y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[j] = p.alpha * acc[i][4 * g + j] + bias[4 * g + j];
          y[j] = act::forward_for<float>(kAct, v[j]);
        }
        const bool vector = vector_out && valid >= 4;
        if (has_aux) store4(aux + int64_t(m) * p.aux_stride_m + c0[g], v, vector, valid);
        store4(d + int64_t(m) * p.d_stride_m + c0[g], y, vector, valid);
      }
    }
    if (next) a.store<kARow>(a_tile[buf ^ 1], a_along_k, K);
  }
}

template <class Element>
struct GemmBundle {
  static_assert(sizeof(Element) == 4, "the FMA-unit short-K GEMM multiplies fp32");

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    if (p.K > kMaxK) return {"can_implement", "the FMA-unit short-K GEMM takes K <= 32"};
    if (p.C != nullptr) return {"can_implement", "the FMA-unit short-K GEMM has no C source"};
    if (p.M == 0 || p.N == 0 || p.L == 0) return {};
    const int64_t tiles_m = (int64_t(p.M) + kTileM - 1) / kTileM, tiles_n = (int64_t(p.N) + kTileN - 1) / kTileN;
    if (tiles_m > INT32_MAX || tiles_n > 65535 || p.L > 65535) {
      return {"can_implement", "the FMA-unit short-K GEMM takes N < 2^23 and at most 65535 batches"};
    }
    // Four adjacent outputs are one 16-byte store where every row of D (and Aux) starts on 16 bytes.
    auto rows16 = [&](const void* base, int64_t stride_m, int64_t stride_l) {
      return aligned16(base) && stride_m % 4 == 0 && (p.L == 1 || stride_l % 4 == 0);
    };
    const bool vector_out = rows16(p.D, p.d_stride_m, p.d_stride_l) &&
                            (p.aux == nullptr || rows16(p.aux, p.aux_stride_m, p.aux_stride_l));
    dispatch_activation(p.activation, [&](auto act) {
      const void* kernel = reinterpret_cast<const void*>(ffma_gemm_kernel<decltype(act)::value>);
      // As many blocks as fit the SMs at once: each column tile's row tiles split into equal ranges.
      const int64_t slots = int64_t(std::max(p.sm_count, 1)) * cached_resident_blocks(kernel, kThreads, 0, p.device);
      const int64_t ranges = std::clamp<int64_t>(slots / (tiles_n * p.L), 1, tiles_m);
      const int tiles_per_block = int((tiles_m + ranges - 1) / ranges);
      const dim3 grid(unsigned((tiles_m + tiles_per_block - 1) / tiles_per_block), unsigned(tiles_n), unsigned(p.L));
      ffma_gemm_kernel<decltype(act)::value><<<grid, kThreads, 0, stream>>>(p, tiles_per_block, vector_out);
    });
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::ffma
