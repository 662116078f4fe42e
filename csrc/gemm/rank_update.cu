#include "gemm/rank_update.h"

#include <type_traits>

#include "common/device_utils.cuh"
#include "gemm/mma_sync.cuh"

namespace cutlass_ext {
namespace {

// A block of 8 warps updates a kM x kN tile of W (Tile below). B's kM rows and A's kN-column
// strip are staged in shared memory once, then each warp walks its sub-tiles of 16 rows x 64
// columns with later sub-tiles' W pieces in flight: on 256 x 256 tiles 1-3 sub-tiles ahead through
// a ring of shared-memory stages filled by cp.async, on 128 x 64 tiles (one sub-tile a warp) the
// first sub-tile's during the staging. The pass is bound by the bytes it keeps in flight (ncu:
// neither DRAM nor L2 saturated; the ring made the 256 x 256 tile 1.01-1.08x faster, bench/NOTES.md
// section 60). The tile's size sets the L2 traffic: a block reads r (kM + kN) x 2 bytes of A and B
// for kM kN x 2 bytes of W, 0.375 r / 16 of W's bytes on 128 x 64 tiles and 0.125 r / 16 on
// 256 x 256. The small tile has 16x the blocks, which matters where the large tiles leave a last
// round of blocks mostly empty (see rank_update_tile).
// A sub-tile's 16 x 64 product is 8 m16n8 mma tiles, and the columns of A's strip are stored
// permuted ("slots") within each 64-column group so that the accumulator fragment of lane (g, t)
// holds two 8-column pieces of W's rows g and g + 8: columns 8t .. 8t + 7 (n-tiles 0-3) and
// 32 + 8t .. 32 + 8t + 7 (n-tiles 4-7) of the group. W is then read and written in 16-byte pieces,
// and a warp's access to a row covers 64 adjacent bytes (two whole sectors). Slot 8j + n of n-tile
// j (n = 2t + e in the fragment) holds column 32 (j / 4) + 8t + 2 (j % 4) + e of its group.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroupN = 64;

// kRing: each warp's W pieces come through a ring of shared-memory stages filled by cp.async,
// several sub-tiles ahead, instead of one sub-tile ahead in registers.
template <int kM_, int kN_, int kMinBlocks_, bool kRing>
struct Tile {
  static constexpr int kM = kM_, kN = kN_;
  static constexpr int kMinBlocks = kMinBlocks_;  // blocks an SM (__launch_bounds__)
  static constexpr int kWarpRowGroups = kM / 16 / kWarps;  // 16-row groups a warp
  static constexpr int kColGroups = kN / kGroupN;
  static constexpr int kSubTiles = kWarpRowGroups * kColGroups;  // a warp's
  static constexpr int kSlotStride = kN + 8;  // A strip row in shared memory: conflict-free ldmatrix
  static_assert(kM % (16 * kWarps) == 0 && kN % kGroupN == 0, "whole sub-tiles a warp");
  // Stages of the ring (0: no ring), as many as leave kMinBlocks blocks an SM their shared memory.
  static constexpr int stages(int k_blocks) { return !kRing ? 0 : k_blocks >= 4 ? 2 : k_blocks == 3 ? 3 : 4; }
  // Shared memory of a block: A's strip [16 k_blocks, kSlotStride], B's rows [kM, 16 k_blocks + 8],
  // then the ring [stages][warps][4 pieces][32 lanes] of 16 bytes.
  static constexpr int shared_bytes(int k_blocks) {
    return (16 * k_blocks * kSlotStride + kM * (16 * k_blocks + 8)) * 2 + stages(k_blocks) * kWarps * 4 * 32 * 16;
  }
};
using SmallTile = Tile<128, 64, 3, false>;
using LargeTile = Tile<256, 256, 2, true>;

__host__ __device__ constexpr int slot_of_column(int c) {
  return kGroupN * (c / kGroupN) + 8 * (4 * ((c % kGroupN) / 32) + (c % 8) / 2) + 2 * ((c % 32) / 8) + c % 2;
}

// Calls f(i) for this thread's pieces i = threadIdx.x + k kThreads below kCount, in a loop of a
// fixed count, unrolled, so that all of a thread's loads are in flight at once (a loop bounded by
// threadIdx.x ran them one after another: the 256 x 256 tile took 1.02-1.08x longer).
template <int kCount, class F>
__device__ __forceinline__ void for_thread_pieces(F&& f) {
#pragma unroll
  for (int it = 0; it < ceil_div(kCount, kThreads); ++it) {
    const int i = threadIdx.x + it * kThreads;
    if (kCount % kThreads != 0 && i >= kCount) break;
    f(i);
  }
}

// kKB 16-deep k blocks: r <= 16 kKB, the rest of the last block zero. a_vec: A's rows in 16-byte
// pieces (unit column stride, aligned); b_vec: B's rows in 16-byte pieces (unit rank stride,
// aligned, r a multiple of 8).
template <class T, int kKB, class TileT>
__global__ void __launch_bounds__(kThreads, TileT::kMinBlocks)
    rank_update_kernel(RankUpdateParams p, bool a_vec, bool b_vec) {
  constexpr int kR = 16 * kKB, kTileM = TileT::kM, kTileN = TileT::kN, kSlotStride = TileT::kSlotStride;
  constexpr int kColGroups = TileT::kColGroups, kSubTiles = TileT::kSubTiles;
  constexpr int kBStride = kR + 8;  // B row in shared memory: 48-144 bytes, conflict-free ldmatrix
  extern __shared__ uint4 shared_words[];
  T* const a_s = reinterpret_cast<T*>(shared_words);
  T* const b_s = a_s + kR * kSlotStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  T* const w = static_cast<T*>(p.w);

  // Sub-tile s of this warp: row group kWarpRowGroups warp + s / kColGroups (16 rows), column group
  // s % kColGroups (64 columns). Its pieces for this lane: rows g, g + 8 (h), columns 8t and 32 + 8t
  // (v) of the group.
  auto row_group = [&](int s) { return TileT::kWarpRowGroups * warp + s / kColGroups; };
  auto row_of = [&](int s, int h) { return m0 + 16 * row_group(s) + g + 8 * h; };
  auto col_of = [&](int s, int v) { return n0 + kGroupN * (s % kColGroups) + 8 * t + 32 * v; };
  auto piece_ok = [&](int s, int h, int v) { return row_of(s, h) < p.M && col_of(s, v) < p.N; };
  auto piece_at = [&](int s, int h, int v) { return w + row_of(s, h) * p.ldw + col_of(s, v); };
  auto load_sub = [&](int s, uint4 (&wv)[2][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        wv[h][v] = piece_ok(s, h, v) ? *reinterpret_cast<const uint4*>(piece_at(s, h, v)) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // The ring's pieces of this lane (stage, piece 2h + v): lane-private, so a lane waits for its own
  // copies only. Sub-tile s goes to stage s % kStages; issue_sub commits one group even past the
  // last sub-tile, so that "sub-tile s landed" is always "at most kStages - 1 groups pending".
  constexpr int kStages = TileT::stages(kKB);
  uint4* const ring = reinterpret_cast<uint4*>(b_s + kTileM * kBStride);
  auto ring_piece = [&](int stage, int piece) { return ring + ((stage * kWarps + warp) * 4 + piece) * 32 + lane; };
  auto issue_sub = [&](int s) {
    if constexpr (kStages > 0) {  // (tiles without a ring never call it)
      if (s < kSubTiles) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const bool ok = piece_ok(s, h, v);
            cp_async_16_or_zero(ring_piece(s % kStages, 2 * h + v), ok ? piece_at(s, h, v) : w, ok);
          }
        }
      }
      cp_async_commit();
    }
  };
  // The first sub-tiles' pieces are in flight while A and B are staged.
  uint4 wv[2][2];  // the current sub-tile's pieces
  if constexpr (kStages == 0) {
    load_sub(0, wv);
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue_sub(s);
  }

  // A's strip [kR, kTileN] in slot order, zero past r and N.
  const T* const a = static_cast<const T*>(p.a);
  if (a_vec) {
    for_thread_pieces<kR * (kTileN / 8)>([&](int i) {
      const int k = i / (kTileN / 8), c8 = i % (kTileN / 8);
      const int64_t n = n0 + 8 * c8;
      const uint4 v = k < p.r && n < p.N ? *reinterpret_cast<const uint4*>(a + k * p.a_stride_r + n)
                                         : make_uint4(0, 0, 0, 0);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(&a_s[k * kSlotStride + slot_of_column(8 * c8 + 2 * j)]) = words[j];
      }
    });
  } else {
    for (int i = threadIdx.x; i < kR * kTileN; i += kThreads) {
      const int k = i / kTileN, c = i % kTileN;
      const int64_t n = n0 + c;
      a_s[k * kSlotStride + slot_of_column(c)] = k < p.r && n < p.N ? a[k * p.a_stride_r + n * p.a_stride_n] : T(0.f);
    }
  }
  // B's rows [kTileM, kR], zero past r and M.
  const T* const b = static_cast<const T*>(p.b);
  if (b_vec) {
    for_thread_pieces<kTileM * (kR / 8)>([&](int i) {
      const int m = i / (kR / 8), k8 = i % (kR / 8);
      const uint4 v = m0 + m < p.M && 8 * k8 < p.r
                          ? *reinterpret_cast<const uint4*>(b + (m0 + m) * p.b_stride_m + 8 * k8)
                          : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&b_s[m * kBStride + 8 * k8]) = v;
    });
  } else {
    for (int i = threadIdx.x; i < kTileM * kR; i += kThreads) {
      const int m = i / kR, k = i % kR;
      b_s[m * kBStride + k] = m0 + m < p.M && k < p.r ? b[(m0 + m) * p.b_stride_m + k * p.b_stride_r] : T(0.f);
    }
  }
  __syncthreads();

  const int quad = lane / 8, in_quad = lane % 8;
  uint32_t af[kKB][4];
#pragma unroll 1
  for (int s = 0; s < kSubTiles; ++s) {
    uint4 next[2][2];
    if constexpr (kStages == 0) {
      if (s + 1 < kSubTiles) load_sub(s + 1, next);
    } else {
      issue_sub(s + kStages - 1);
    }
    if (s % kColGroups == 0) {  // a new row group: its B fragments
#pragma unroll
      for (int kb = 0; kb < kKB; ++kb) {
        ldmatrix_x4(af[kb], &b_s[(16 * row_group(s) + (quad % 2) * 8 + in_quad) * kBStride + kb * 16 + (quad / 2) * 8],
                    false);
      }
    }
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
    }
    const T* const strip = a_s + kGroupN * (s % kColGroups);
#pragma unroll
    for (int kb = 0; kb < kKB; ++kb) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        uint32_t bf[4];
        ldmatrix_x4(bf, &strip[(kb * 16 + (quad % 2) * 8 + in_quad) * kSlotStride + 8 * (2 * jj + quad / 2)], true);
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        mma_16816<T>(acc[2 * jj], af[kb], b0);
        mma_16816<T>(acc[2 * jj + 1], af[kb], b1);
      }
    }

    if constexpr (kStages > 0) {
      cp_async_wait_pending<kStages - 1>();  // sub-tile s landed
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int v = 0; v < 2; ++v) wv[h][v] = *ring_piece(s % kStages, 2 * h + v);
      }
    }

    // acc[j][2h + e] is row g + 8h, column 32 (j / 4) + 8t + 2 (j % 4) + e: piece (h, j / 4), word j % 4.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        if (!piece_ok(s, h, v)) continue;
        const uint32_t in[4] = {wv[h][v].x, wv[h][v].y, wv[h][v].z, wv[h][v].w};
        uint32_t out[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 x = unpack_pair<T>(in[q]);
          const float* d = acc[4 * v + q];
          out[q] = pack_pair<T>(fmaf(p.alpha, d[2 * h], x.x), fmaf(p.alpha, d[2 * h + 1], x.y));
        }
        // One 16-byte store (nvcc split a plain uint4 store of these words into four).
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(piece_at(s, h, v)), "r"(out[0]), "r"(out[1]),
                     "r"(out[2]), "r"(out[3])
                     : "memory");
      }
    }
    if constexpr (kStages == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int v = 0; v < 2; ++v) wv[h][v] = next[h][v];
      }
    }
  }
}

template <class T, int kKB, class TileT>
LaunchResult launch_blocks(RankUpdateParams const& p, bool a_vec, bool b_vec, cudaStream_t stream) {
  const auto kernel = rank_update_kernel<T, kKB, TileT>;
  constexpr int kShared = TileT::shared_bytes(kKB);
  if constexpr (kShared > 48 * 1024) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return {"launch", "no current CUDA device"};
    if (allow_large_dynamic_shared(reinterpret_cast<const void*>(kernel), device) != cudaSuccess) {
      return {"initialize", "the rank-r update needs more shared memory than the device allows"};
    }
  }
  const dim3 grid(unsigned(ceil_div(p.N, TileT::kN)), unsigned(ceil_div(p.M, TileT::kM)));
  kernel<<<grid, kThreads, kShared, stream>>>(p, a_vec, b_vec);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  return {};
}

template <class T, class TileT>
LaunchResult launch(RankUpdateParams const& p, bool a_vec, bool b_vec, cudaStream_t stream) {
  const int kb = (p.r + 15) / 16;
  if (kb == 1) return launch_blocks<T, 1, TileT>(p, a_vec, b_vec, stream);
  if (kb == 2) return launch_blocks<T, 2, TileT>(p, a_vec, b_vec, stream);
  if (kb == 3) return launch_blocks<T, 3, TileT>(p, a_vec, b_vec, stream);
  return launch_blocks<T, 4, TileT>(p, a_vec, b_vec, stream);
}

template <class T>
LaunchResult launch(RankUpdateParams const& p, bool a_vec, bool b_vec, cudaStream_t stream) {
  if (rank_update_tile(p) == RankUpdateTile::k256x256) return launch<T, LargeTile>(p, a_vec, b_vec, stream);
  return launch<T, SmallTile>(p, a_vec, b_vec, stream);
}

}  // namespace

RankUpdateTile rank_update_tile(RankUpdateParams const& p) {
  if (p.tile != RankUpdateTile::kAuto) return p.tile;
  // The large tile's block takes up to 103 KB of shared memory (its ring's stages among it): more
  // than a block may have on GPUs of compute capability 8.6 and 8.9 (99 KB), which take the small.
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      LargeTile::shared_bytes((p.r + 15) / 16) > max_dynamic_shared_bytes(device) - int(kSharedRowReserve)) {
    return RankUpdateTile::k128x64;
  }
  // The large tile's blocks run in rounds of 2 an SM. Measured on an H200 with its ring
  // (bench/NOTES.md section 61, 28 merges from 2048 x 2048 to 14336 x 4096): at r <= 32 it is the
  // faster tile or within 2% of the small one on every shape, however few its blocks (2048 x
  // 2048 r = 16, 64 blocks: 1.03x); at r = 64 it loses where its blocks fill under half the SMs'
  // slots (2048 x 2048: 0.91x), the A and B bytes it saves being few against its longer blocks.
  const int64_t blocks = ceil_div(p.M, LargeTile::kM) * ceil_div(p.N, LargeTile::kN);
  const int64_t slots = int64_t(LargeTile::kMinBlocks) * (p.sm_count > 0 ? p.sm_count : 132);
  const int64_t rounds = ceil_div(blocks, slots);
  const double fill = double(blocks) / double(rounds * slots);
  const bool large = p.r <= 32 || fill >= 0.5;
  return large ? RankUpdateTile::k256x256 : RankUpdateTile::k128x64;
}

bool rank_update_supported(RankUpdateParams const& p) {
  if (p.dtype == DType::kF32 || p.r < 1 || p.r > 64 || p.M < 1 || p.N < 1) return false;
  if (p.N % 8 != 0 || p.ldw % 8 != 0 || p.ldw < p.N || !aligned16(p.w)) return false;
  return ceil_div(p.M, SmallTile::kM) <= 65535 && ceil_div(p.N, SmallTile::kN) <= INT32_MAX;
}

LaunchResult rank_update(RankUpdateParams const& p, cudaStream_t stream) {
  if (!rank_update_supported(p)) return {"can_implement", "the rank-r update does not take these operands"};
  const bool a_vec = p.a_stride_n == 1 && p.a_stride_r % 8 == 0 && aligned16(p.a);
  const bool b_vec = p.b_stride_r == 1 && p.b_stride_m % 8 == 0 && p.r % 8 == 0 && aligned16(p.b);
  if (p.dtype == DType::kF16) return launch<cutlass::half_t>(p, a_vec, b_vec, stream);
  return launch<cutlass::bfloat16_t>(p, a_vec, b_vec, stream);
}

}  // namespace cutlass_ext
