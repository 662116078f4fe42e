// Narrow GEMM (N <= 64 output columns, K <= 256, many rows: a DLRM-style MLP's narrow layers and
// their dX = dZ W), hand-written:
//   D = act(alpha * A B + bias), optionally Aux = the pre-activation; 16-bit types.
// The product is a stream over A: at 65536 x 64 -> 16 each row of A (128 bytes) feeds 16 outputs.
// CUTLASS's tiles run it as one or two k-steps a tile with a fixed cost per tile (TMA descriptors,
// the pipeline's barriers, a column-major store of the transposed tile): 14.3 us of kernel time
// on an H200 where cuBLAS took 4.7 (bench/NOTES.md section 23). Here every block owns 64 or 128
// rows (16 or 32 a warp) and all of N, copies its rows of A and the whole of B into shared memory
// with one batch of cp.async (nothing waits between tiles: there is one tile a block, and a wave
// of blocks keeps the loads of several blocks an SM in flight), multiplies with mma.sync (m16n8k16,
// fp32 accumulation) on fragments from ldmatrix, adds the bias in the accumulators and writes D
// (and Aux) through a staging piece of shared memory a warp, as whole rows. A is K-major
// (row-major X); B K-major (the weight [N, K] of a forward) or N-major (the same weight as dX's
// B). K (and N for an N-major B) and the row strides are multiples of 16 bytes, the data 16-byte
// aligned; the bindings check this before choosing the kernel.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/device_utils.cuh"
#include "gemm/gemm_params.h"
#include "gemm/mma_sync.cuh"
#include "gemm/narrow_limits.h"

namespace cutlass_ext::narrow {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Rows of A (and D) a block: kTiles 16-row MMA tiles a warp.
template <int kTiles>
__host__ __device__ constexpr int rows_of() { return kWarps * 16 * kTiles; }
constexpr int kMaxN = kNarrowMaxN;
constexpr int kMaxK = kNarrowMaxK;
constexpr int kVec = 8;  // 16-bit elements per 16-byte access

// Shared-memory row lengths in elements: a K-major tile is [line][k] with k_pad + kVec a row, an
// N-major B tile [k][n] with kN + kVec. The extra 16-byte piece makes the rows an odd number of
// 16-byte pieces long, so the eight rows an ldmatrix phase reads start on distinct banks.
__host__ __device__ constexpr int k_row(int k_pad) { return k_pad + kVec; }
template <int kN>
__host__ __device__ constexpr int n_row() { return kN + kVec; }

// Bytes of dynamic shared memory: the B tile, the A tile, then the epilogue's staging rows.
template <int kN>
__host__ __device__ constexpr int b_elems(int k_pad, bool b_k_major) {
  return b_k_major ? kN * k_row(k_pad) : k_pad * n_row<kN>();
}
template <int kN, int kTiles>
__host__ __device__ constexpr int shared_bytes(int k_pad, bool b_k_major) {
  return (b_elems<kN>(k_pad, b_k_major) + rows_of<kTiles>() * (k_row(k_pad) + n_row<kN>())) * 2;
}

// The 16-byte pieces i = threadIdx.x, threadIdx.x + kThreads, ... of a [lines][chunks] tile, as
// (line, chunk) pairs stepped without a division: the chunk count is known only at run time, and
// a division for every piece (ten in the PTX, each a ~20-instruction SASS routine) delayed the
// issue of a block's loads (ncu at 65536 x 64 -> 16: 2.17M warp instructions against cuBLAS's
// 0.50M). One division a thread, then adds.
struct PieceWalk {
  int chunks, line0, chunk0, line_step, chunk_step;
  __device__ explicit PieceWalk(int chunks_)
      : chunks(chunks_),
        line0(int(threadIdx.x) / chunks_),
        chunk0(int(threadIdx.x) - line0 * chunks_),
        line_step(kThreads / chunks_),
        chunk_step(kThreads - line_step * chunks_) {}
  template <class F>
  __device__ __forceinline__ void run(int lines, F&& f) const {
    int line = line0, chunk = chunk0;
    while (line < lines) {
      f(line, chunk);
      line += line_step;
      chunk += chunk_step;
      if (chunk >= chunks) {
        chunk -= chunks;
        ++line;
      }
    }
  }
};

template <class T, int kN, int kTiles, int kAct>
__global__ void __launch_bounds__(kThreads) narrow_gemm_kernel(GemmParams p, bool b_k_major) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int k_pad = (p.K + 15) / 16 * 16;
  const int krow = k_row(k_pad);
  T* const b_tile = reinterpret_cast<T*>(shared);
  T* const a_tile = b_tile + b_elems<kN>(k_pad, b_k_major);
  constexpr int kRows = rows_of<kTiles>();
  const int64_t l = blockIdx.y;
  const int m0 = blockIdx.x * kRows;

  // One batch of copies: B (all N lines, zero past N and K), then this block's rows of A (zero
  // past M and K). K and the row strides are multiples of kVec, so each 16-byte piece is all in or
  // all out.
  const T* const B = static_cast<const T*>(p.B) + l * p.b_stride_l;
  const PieceWalk walk(k_pad / kVec);
  if (b_k_major) {
    walk.run(kN, [&](int n, int chunk) {
      const int k = chunk * kVec;
      const bool valid = n < p.N && k < p.K;
      cp_async_16_or_zero(b_tile + n * krow + k, valid ? B + int64_t(n) * p.b_stride_n + k : B, valid);
    });
  } else {
    constexpr int kChunksN = kN / kVec;
    for (int i = threadIdx.x; i < k_pad * kChunksN; i += kThreads) {
      const int k = i / kChunksN, n = (i % kChunksN) * kVec;
      const bool valid = n < p.N && k < p.K;
      cp_async_16_or_zero(b_tile + k * n_row<kN>() + n, valid ? B + int64_t(k) * p.b_stride_k + n : B, valid);
    }
  }
  const T* const A = static_cast<const T*>(p.A) + l * p.a_stride_l + int64_t(m0) * p.a_stride_m;
  const int rows = min(kRows, p.M - m0);
  walk.run(kRows, [&](int r, int chunk) {
    const int k = chunk * kVec;
    const bool valid = r < rows && k < p.K;
    cp_async_16_or_zero(a_tile + r * krow + k, valid ? A + int64_t(r) * p.a_stride_m + k : A, valid);
  });
  cp_async_commit();
  // This lane's bias columns (see the epilogue), loaded while the copies are in flight rather than
  // after the product, where they cost a second memory round trip.
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const T* const bias = static_cast<const T*>(p.bias);
  float bias_v[kN / 8][2];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int c = 8 * j + 2 * t;
    bias_v[j][0] = bias != nullptr && c < p.N ? float(bias[c]) : 0.f;
    bias_v[j][1] = bias != nullptr && c + 1 < p.N ? float(bias[c + 1]) : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();

  // Warp w owns rows 16 kTiles w .. 16 kTiles (w + 1) - 1 and every column: kTiles x kN / 8 mma
  // tiles of 16x8, each B fragment used by kTiles of them. ldmatrix lane l addresses row l % 8 of
  // matrix l / 8.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_lo = (lane >> 3) & 1, q_hi = lane >> 4, row8 = lane & 7;
  float acc[kTiles][kN / 8][4] = {};
  for (int k0 = 0; k0 < k_pad; k0 += 16) {
    uint32_t a[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      ldmatrix_x4(a[i], a_tile + ((warp * kTiles + i) * 16 + row8 + 8 * q_lo) * krow + k0 + 8 * q_hi, false);
    }
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) {
      const int n = j * 16;
      const T* row = b_k_major ? b_tile + (n + row8 + 8 * q_hi) * krow + k0 + 8 * q_lo
                               : b_tile + (k0 + row8 + 8 * q_lo) * n_row<kN>() + n + 8 * q_hi;
      uint32_t r[4];
      ldmatrix_x4(r, row, !b_k_major);
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        mma_16816<T>(acc[i][2 * j], a[i], b0);
        mma_16816<T>(acc[i][2 * j + 1], a[i], b1);
      }
    }
  }

  // The epilogue: lane (g, t) holds rows g and g + 8 of each of the warp's 16-row tiles, columns
  // 8 j + 2 t and 8 j + 2 t + 1 of each mma tile j. The warp stages its rows (Aux first where
  // there is one, then D) in its own piece of shared memory and writes them as 16-byte pieces,
  // whole rows of D a lane group at a time: with 4-byte stores straight from the accumulators
  // each 32-byte sector was written by two instructions, and 65536 x 64 -> 64 took 21.5 us
  // against 14.2 for a CUTLASS tile (H200).
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const float b0 = bias_v[j][0], b1 = bias_v[j][1];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[i][j][2 * h] = p.alpha * acc[i][j][2 * h] + b0;
        acc[i][j][2 * h + 1] = p.alpha * acc[i][j][2 * h + 1] + b1;
      }
    }
  }
  constexpr int kStageRow = n_row<kN>();
  constexpr int kChunksN = kN / kVec;
  T* const stage = a_tile + kRows * krow + warp * 16 * kTiles * kStageRow;
  const int r0 = warp * 16 * kTiles, rows_here = min(16 * kTiles, rows - r0);
  auto stage_and_store = [&](T* out, int64_t stride, bool activate) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          Pack<T, 2> pk;
          pk.v[0] = T(activate ? act::forward_for<T>(kAct, acc[i][j][2 * h]) : acc[i][j][2 * h]);
          pk.v[1] = T(activate ? act::forward_for<T>(kAct, acc[i][j][2 * h + 1]) : acc[i][j][2 * h + 1]);
          *reinterpret_cast<Pack<T, 2>*>(stage + (16 * i + g + 8 * h) * kStageRow + 8 * j + 2 * t) = pk;
        }
      }
    }
    __syncwarp();
    const bool vector = p.N % kVec == 0 && stride % kVec == 0 && aligned16(out);
#pragma unroll
    for (int i = lane; i < 16 * kTiles * kChunksN; i += 32) {
      const int r = i / kChunksN, c = (i % kChunksN) * kVec;
      if (r >= rows_here || c >= p.N) continue;
      T* const dst = out + int64_t(r0 + r) * stride + c;
      const T* const src = stage + r * kStageRow + c;
      if (vector) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int e = 0; e < kVec && c + e < p.N; ++e) dst[e] = src[e];
      }
    }
    __syncwarp();
  };
  if (p.aux != nullptr) {
    stage_and_store(static_cast<T*>(p.aux) + l * p.aux_stride_l + int64_t(m0) * p.aux_stride_m, p.aux_stride_m,
                    false);
  }
  stage_and_store(static_cast<T*>(p.D) + l * p.d_stride_l + int64_t(m0) * p.d_stride_m, p.d_stride_m, true);
}

template <class Element>
struct GemmBundle {
  using T = Element;
  static_assert(sizeof(T) == 2, "the narrow GEMM multiplies 16-bit types");

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    if (p.N > kMaxN || p.K > kMaxK) return {"can_implement", "the narrow GEMM takes N <= 64 and K <= 256"};
    if (p.C != nullptr) return {"can_implement", "the narrow GEMM adds no C source"};
    auto ok = [](int64_t s) { return s % kVec == 0; };
    const bool b_k_major = p.b_stride_k == 1 || p.K == 1;
    const bool a_ok =
        p.a_stride_k == 1 && aligned16(p.A) && (p.M == 1 || ok(p.a_stride_m)) && (p.L == 1 || ok(p.a_stride_l));
    const bool b_ok =
        aligned16(p.B) && (p.L == 1 || ok(p.b_stride_l)) &&
        (b_k_major ? (p.N == 1 || ok(p.b_stride_n)) : p.b_stride_n == 1 && p.N % kVec == 0 && ok(p.b_stride_k));
    if (!a_ok || !b_ok || p.K % kVec != 0) {
      return {"can_implement", "the narrow GEMM needs a K-major A, a K- or N-major B, K (and N for an N-major B) and "
                               "the row strides multiples of 16 bytes, and 16-byte aligned operands"};
    }
    if (p.L > 65535) return {"can_implement", "the narrow GEMM takes at most 65535 batches"};
    if (p.M == 0 || p.N == 0) return {};
    const int k_pad = (p.K + 15) / 16 * 16;
    // Two 16-row tiles a warp (128-row blocks) where those blocks still give every SM one: each B
    // fragment then serves two MMAs and B is copied half as often. Measured on an H200 (bf16,
    // CUDA-graph replays): 65536 x 64 -> 16 12.5 -> 11.4 us, its dX (65536 x 16 -> 64) 12.0 ->
    // 10.4, 65536 x 128 -> 16 16.5 -> 14.8, 32768 x 64 -> 16 9.7 -> 9.1; 2048 and 8192 rows
    // (16-64 such blocks) 7.4 against 7.5-7.6 with one tile a warp.
    const bool two_tiles = (p.M + rows_of<2>() - 1) / rows_of<2>() * int64_t(p.L) >= p.sm_count;
    LaunchResult result;
    auto launch = [&](auto act, auto n, auto tiles) {
      constexpr int kAct = decltype(act)::value;
      constexpr int kN = decltype(n)::value;
      constexpr int kTiles = decltype(tiles)::value;
      const dim3 grid(unsigned((p.M + rows_of<kTiles>() - 1) / rows_of<kTiles>()), unsigned(p.L));
      const int smem = shared_bytes<kN, kTiles>(k_pad, b_k_major);
      const void* kernel = reinterpret_cast<const void*>(narrow_gemm_kernel<T, kN, kTiles, kAct>);
      const cudaError_t err = allow_large_dynamic_shared(kernel, p.device);
      if (err != cudaSuccess) {
        result = {"initialize", cudaGetErrorString(err)};
        return;
      }
      narrow_gemm_kernel<T, kN, kTiles, kAct><<<grid, kThreads, smem, stream>>>(p, b_k_major);
    };
    auto with_n = [&](auto act, auto tiles) {
      if (p.N <= 16) {
        launch(act, std::integral_constant<int, 16>{}, tiles);
      } else if (p.N <= 32) {
        launch(act, std::integral_constant<int, 32>{}, tiles);
      } else {
        launch(act, std::integral_constant<int, 64>{}, tiles);
      }
    };
    dispatch_activation(p.activation, [&](auto act) {
      if (two_tiles) {
        with_n(act, std::integral_constant<int, 2>{});
      } else {
        with_n(act, std::integral_constant<int, 1>{});
      }
    });
    if (!result.ok()) return result;
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::narrow
