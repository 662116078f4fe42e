// Short-K GEMM (K <= 64: LoRA rank-r products and merges, narrow input layers), hand-written.
//   D = act(alpha * A B + beta * C + bias), optionally Aux = the pre-activation; 16-bit types.
// With K <= 64 each output element costs at most 64 multiply-adds but 2-3 memory accesses (C read,
// D written), so the kernel is a stream over C and D. Persistent blocks (as many as fit the SMs)
// each walk a contiguous range of 64x128 output tiles, M fastest, or (warp_staged kernels) one
// column of tiles striped across the wave (striped_stride). While a tile is multiplied and
// written, the next tile's A (and C) tiles, and for warp_staged kernels the one after too, are
// already on their way into shared memory by cp.async, so a block does not wait on a load
// between tiles; the B tile is reloaded only when the block's walk enters the next column of
// tiles (or batch). Operands are copied in their own layout with 16-byte accesses (a contiguous
// operand whose rows are not 16-byte pieces, such as a 13-feature input layer's X, as one run of
// pieces that is then spread in shared memory; other unaligned ones element by element) and fed
// to mma.sync (m16n8k16, fp32 accumulation) by ldmatrix, transposing M- or N-major tiles on the
// way (.trans). On the vector path without C (warp_staged), each warp converts its finished
// 16x64 piece to 16 bits in registers, stages it in a shared tile of its own by stmatrix and
// writes it with 16-byte accesses (no block barrier); otherwise the fp32 tile is staged through
// shared memory (beside the C tile) and written with 16-byte accesses.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/device_utils.cuh"
#include "common/resident_blocks.h"
#include "gemm/gemm_params.h"
#include "gemm/mma_sync.cuh"

namespace cutlass_ext::lowk {

constexpr int kTileM = 64, kTileN = 128, kMaxK = 64;
constexpr int kThreads = 256;  // 8 warps over a tile (WarpLayout)
constexpr int kWarps = kThreads / 32;
// The warps over a tile: staged as one fp32 tile, 2 along M x 4 along N (32x32 pieces); staged
// by warps (kWarpStaged, below), 4 x 2 (16x64 pieces), so that a warp's 16-byte stores write
// whole 128-byte lines of D, four rows an instruction (32x32 pieces, eight 64-byte row pieces an
// instruction, ran 1.3x slower: H200, 11008 x 4096 x 16, bench/kernels/lowk_shapes).
template <bool kWarpStaged>
struct WarpLayout {
  static constexpr int kAlongM = kWarpStaged ? 4 : 2, kAlongN = kWarps / kAlongM;
  static constexpr int kRows = kTileM / kAlongM, kCols = kTileN / kAlongN;
  static constexpr int kMI = kRows / 16, kNJ = kCols / 8;  // mma tiles of 16x8
};
constexpr int kVec = 8;        // 16-bit elements per 16-byte access
// Shared operand tiles, each in its operand's own layout, rows padded by one 16-byte piece so
// that the eight rows an ldmatrix phase reads start on distinct banks.
constexpr int kKRow = kMaxK + kVec;   // K-major tiles: [line][k]
constexpr int kARow = kTileM + kVec;  // M-major A tiles: [k][m]
constexpr int kBRow = kTileN + kVec;  // N-major B tiles: [k][n]
constexpr int kAccRow = kTileN + 8;   // fp32 staging rows
// A warp's 16-bit staging tile (no C): rows of 144 bytes, so that the eight rows of an stmatrix
// phase, and the eight 16-byte pieces of a row that a read phase takes, fall on distinct banks.
constexpr int kStageRow = WarpLayout<true>::kCols + kVec;
constexpr int kWarpStageElems = WarpLayout<true>::kRows * kStageRow;
constexpr int kAElems = kTileM * kKRow > kMaxK * kARow ? kTileM * kKRow : kMaxK * kARow;
constexpr int kBElems = kTileN * kKRow > kMaxK * kBRow ? kTileN * kKRow : kMaxK * kBRow;
constexpr int kCElems = kTileM * kTileN;
// Tiles of A (and C) in flight: the next one, or with warp staging the next two (its tiles are
// shorter: at one tile ahead a block waited on each tile's loads).
__host__ __device__ constexpr int a_stages(bool warp_staged) { return warp_staged ? 3 : 2; }
// Dynamic shared memory: the staging space (the fp32 tile, or the warps' 16-bit tiles), the B
// tile, a_stages A tiles, the bias of B's columns, (with C) two C tiles and (with a packed A,
// below) a_stages A tiles as they lie in memory. The staging space also holds a packed
// B's raw tile (kTileN lines of up to kMaxK elements) while B is copied and spread.
constexpr int kWarpStageBytes = kWarps * kWarpStageElems * 2, kBRawBytes = kTileN * kMaxK * 2;
__host__ __device__ constexpr int stage_bytes(bool warp_staged) {
  return warp_staged ? (kWarpStageBytes > kBRawBytes ? kWarpStageBytes : kBRawBytes) : kTileM * kAccRow * 4;
}
__host__ __device__ constexpr int b_offset(bool warp_staged) { return stage_bytes(warp_staged); }
__host__ __device__ constexpr int a_offset(bool warp_staged) { return b_offset(warp_staged) + kBElems * 2; }
__host__ __device__ constexpr int bias_offset(bool warp_staged) {
  return a_offset(warp_staged) + a_stages(warp_staged) * kAElems * 2;
}
__host__ __device__ constexpr int c_offset(bool warp_staged) { return bias_offset(warp_staged) + kTileN * 2; }
// Bytes before the packed A's raw tiles: the C tiles only where C is read.
__host__ __device__ constexpr int shared_bytes(bool warp_staged, bool reads_c) {
  return c_offset(warp_staged) + (reads_c ? 2 * kCElems * 2 : 0);
}

// How a block copies its operand tiles: all in 16-byte pieces in their own layout (kVector);
// a packed operand (below) copied as one contiguous run of 16-byte pieces and spread into the
// K-major tile in shared memory, the other in 16-byte pieces (kPacked); or element by element
// (kElementwise).
// A packed operand is K-major with a row stride of exactly K (a contiguous [lines, K] matrix,
// such as a 13-feature input layer's X and weight), so that a tile of lines is one contiguous
// run of memory, and that run starts on 16 bytes (the operand 16-byte aligned: tiles start at
// line multiples of 64, 64 K elements being a multiple of 16 bytes).
constexpr int kVector = 0, kPacked = 1, kElementwise = 2;
// Whether a kernel's warps stage their finished pieces in 16 bits, keep two tiles of A in flight
// and may walk striped (TileCursor): the vector path without C. The kernels with C, and the
// packed and element-wise paths, keep the fp32 staging tile, one tile of A ahead and contiguous
// ranges: with all three changes the training steps whose products take those paths (a 13 -> 512
// layer, one-row steps) ran 1.05-1.10x slower than before (H200, across two runs; not measured
// per kernel).
__host__ __device__ constexpr bool warp_staged(bool with_c, int copy) { return !with_c && copy == kVector; }
// Blocks an SM each path's instantiation is compiled for. The packed path at three (80
// registers) spilled 60-72 bytes a thread; at two it keeps everything in registers (128) and was
// faster on every shape measured (H200, bf16, bench/results/lowk-packed-ab-h200.json): 8192 x 13
// -> 512 13.5-13.9 us against 16.7-17.0 at three, 65536 x 13 -> 512 49.4-50.0 against 51.1-51.5.
__host__ __device__ constexpr int min_blocks(int copy) { return copy == kPacked ? 2 : 3; }
// Elements of one raw (as-in-memory) A tile of a packed A: kTileM K, rounded to 16 bytes.
__host__ __device__ constexpr int raw_a_elems(int K) { return (kTileM * K + kVec - 1) / kVec * kVec; }
// The epilogue gives each lane 8 adjacent columns (16-byte accesses to C and D): 16 lanes per
// row, 16 rows per pass, 4 passes. A lane reads its 8 fp32 sums as two 16-byte chunks of the
// staging row, the even chunk first in lanes 0-3 of each group of 8 and the odd one first in
// lanes 4-7, so that every 8-lane phase of a read touches 32 distinct banks.
constexpr int kLanesPerRow = kTileN / kVec;            // 16
constexpr int kRowsPerPass = kThreads / kLanesPerRow;  // 16
constexpr int kPasses = kTileM / kRowsPerPass;         // 4

// Starts copying an operand tile of kLines lines (rows of A, columns of B) by k_pad into shared
// memory in its own layout: K-major as [line][k] (kKRow a row), else [k][line] (kLineRow a
// row). Lines from `valid_lines` on and k from K on are zero. With `vector`, K is a multiple of
// kVec, and so is valid_lines for an MN-major tile (run() checks), so every 16-byte piece is all
// in or all out. Without it (K or a stride not a multiple of 16 bytes: a 13-feature input layer,
// the K = 1 product of a one-column layer's backward) the tile is copied element by element
// with plain loads, which the same wait and barrier as the asynchronous copies make visible.
template <class T, int kLines, int kLineRow, bool kElementwise>
__device__ __forceinline__ void copy_operand(T* dst, const T* src, int64_t stride_line, int64_t stride_k,
                                             bool k_major, bool vector, int valid_lines, int K, int k_pad) {
  if (kElementwise && !vector) {
    // Each thread's loads of 16 columns of k (the whole tile when K <= 16) are issued before any
    // of their stores, so that the tile costs one memory round trip, not one per element.
    constexpr int kBatch = kLines * 16 / kThreads;
    static_assert(kBatch >= 1 && kLines * 16 % kThreads == 0, "a batch covers 16 columns of k");
    for (int base = 0; base < kLines * k_pad; base += kBatch * kThreads) {
      T v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + int(threadIdx.x);
        const int line = k_major ? i / k_pad : i % kLines;
        const int k = k_major ? i % k_pad : i / kLines;
        v[j] = (line < valid_lines && k < K) ? src[line * stride_line + k * stride_k] : T(0.f);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + int(threadIdx.x);
        const int line = k_major ? i / k_pad : i % kLines;
        const int k = k_major ? i % k_pad : i / kLines;
        dst[k_major ? line * kKRow + k : k * kLineRow + line] = v[j];
      }
    }
    return;
  }
  if (k_major) {
    const int chunks = k_pad / kVec;
    for (int i = threadIdx.x; i < kLines * chunks; i += kThreads) {
      const int line = i / chunks, k = (i % chunks) * kVec;
      const bool valid = line < valid_lines && k < K;
      cp_async_16_or_zero(dst + line * kKRow + k, valid ? src + line * stride_line + k : src, valid);
    }
  } else {
    constexpr int chunks = kLines / kVec;
    for (int i = threadIdx.x; i < chunks * k_pad; i += kThreads) {
      const int k = i / chunks, line = (i % chunks) * kVec;
      const bool valid = line < valid_lines && k < K;
      cp_async_16_or_zero(dst + k * kLineRow + line, valid ? src + k * stride_k + line : src, valid);
    }
  }
}

// Starts copying a packed operand's tile (lines line0 .. line0 + kLines - 1 of a contiguous
// [lines, K] matrix, `src` pointing at line0) into `raw` as it lies in memory: the first
// min(valid_lines, kLines) K elements, in 16-byte pieces, the piece that crosses their end zero-filled.
template <class T, int kLines>
__device__ __forceinline__ void copy_packed(T* raw, const T* src, int valid_lines, int K) {
  const int bytes = min(max(valid_lines, 0), kLines) * K * int(sizeof(T));
  for (int i = threadIdx.x; 16 * i < bytes; i += kThreads) {
    cp_async_16_first(raw + i * kVec, src + i * kVec, min(16, bytes - 16 * i));
  }
}

// Spreads a raw tile (copy_packed's) into the K-major tile [line][k] (kKRow a row) that the MMAs
// read, zero past valid_lines and K. A thread owns one line and every (kThreads / kLines)-th
// 16-byte piece of it: the piece's kVec elements are read from the raw tile first, then stored
// as one access. (Element by element, with a division per element, this took 438 of the 1261
// instructions a warp of a one-tile block executes at 2048 x 13 -> 512: ncu, H200.)
template <class T, int kLines>
__device__ __forceinline__ void spread_packed(T* dst, const T* raw, int valid_lines, int K, int k_pad) {
  static_assert(kThreads % kLines == 0 && kVec == 8, "whole lines a thread, 16-bit elements");
  constexpr int kStep = kThreads / kLines * kVec;
  const int line = int(threadIdx.x) % kLines;
  const bool line_valid = line < valid_lines;
  // As 16-bit words (zero is all zero bits for both types), packed in pairs into one uint4.
  const uint16_t* src = reinterpret_cast<const uint16_t*>(raw) + line * K;
  T* out = dst + line * kKRow;
  for (int k0 = int(threadIdx.x) / kLines * kVec; k0 < k_pad; k0 += kStep) {
    uint32_t h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = line_valid && k0 + j < K ? src[k0 + j] : 0u;
    *reinterpret_cast<uint4*>(out + k0) = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16,
                                                     h[6] | h[7] << 16);
  }
}

// An output tile: batch l, row tile and column tile. A block walks either a contiguous range of
// tiles, M fastest, then N, then L (stride 0), or, striped, one column of tiles, every stride-th
// row tile from its first, on into the next batch (so that the blocks running at once write
// neighbouring tiles of the same rows). A block divides once, for its first tile, and steps from
// there: ncu showed the kernel issue-bound (an instruction issued on 72% of cycles) when every
// tile's position came from 64-bit divisions.
struct TileCursor {
  int l, m_tile, n_tile;
  __device__ __forceinline__ void next(int tiles_m, int tiles_n, int stride) {
    if (stride > 0) {
      m_tile += stride;
      while (m_tile >= tiles_m) {
        m_tile -= tiles_m;
        ++l;
      }
      return;
    }
    if (++m_tile == tiles_m) {
      m_tile = 0;
      if (++n_tile == tiles_n) {
        n_tile = 0;
        ++l;
      }
    }
  }
};

// kAct: the activation, a template parameter so that each instantiation inlines only its own
// (a run-time switch over all of them, unrolled over the epilogue, overflowed the instruction
// cache: 36% of the stalls on an H200). kCopy: how the operand tiles are copied (kVector,
// kPacked or kElementwise, each its own instantiation: compiled into every kernel, the element-wise
// path made ptxas spill at 80 registers). kWithC: the kernel reads C (its kernels also run
// products without C); without it p.C is ignored.
template <class T, int kAct, int kCopy, bool kWithC>
__global__ void __launch_bounds__(kThreads, min_blocks(kCopy))
    lowk_gemm_kernel(GemmParams p, bool a_k_major, bool b_k_major, bool a_vector, bool b_vector, bool a_packed,
                     bool b_packed, int walk_stride) {
  constexpr bool kByElement = kCopy == kElementwise;
  extern __shared__ __align__(16) unsigned char shared[];
  auto staged = reinterpret_cast<float (*)[kAccRow]>(shared);
  constexpr bool kWarpStaged = warp_staged(kWithC, kCopy);
  const int stride = kWarpStaged ? walk_stride : 0;  // a constant 0 elsewhere: no striped code there
  T* const b_tile = reinterpret_cast<T*>(shared + b_offset(kWarpStaged));
  T* const a_tiles = reinterpret_cast<T*>(shared + a_offset(kWarpStaged));
  T* const c_tiles = reinterpret_cast<T*>(shared + c_offset(kWarpStaged));
  T* const bias_tile = reinterpret_cast<T*>(shared + bias_offset(kWarpStaged));
  // Raw tiles of packed operands: B's in the staging space (B is copied and spread between a
  // tile's epilogue and the next product, when the staging space is free), A's a_stages after
  // everything else.
  T* const b_raw = reinterpret_cast<T*>(shared);
  T* const a_raws = reinterpret_cast<T*>(shared + shared_bytes(kWarpStaged, kWithC && p.C != nullptr));
  const bool a_spread = kCopy == kPacked && a_packed, b_spread = kCopy == kPacked && b_packed;

  const int tiles_m = (p.M + kTileM - 1) / kTileM, tiles_n = (p.N + kTileN - 1) / kTileN;
  TileCursor tile;
  int count;  // a block's tiles (run() takes fewer than 2^31 in all)
  if (stride > 0) {  // striped: stride x tiles_n blocks
    const int first = int(blockIdx.x) / tiles_n, rows = tiles_m * p.L;
    if (first >= rows) return;
    count = (rows - 1 - first) / stride + 1;
    tile = {first / tiles_m, first % tiles_m, int(blockIdx.x) % tiles_n};
  } else {
    const int64_t per_batch = int64_t(tiles_m) * tiles_n, total = per_batch * p.L;
    const int64_t begin = total * blockIdx.x / gridDim.x, end = total * (blockIdx.x + 1) / gridDim.x;
    if (begin >= end) return;
    const int64_t l = begin / per_batch, rest = begin - l * per_batch;
    tile = {int(l), int(rest % tiles_m), int(rest / tiles_m)};
    count = int(end - begin);
  }
  const int k_pad = (p.K + 15) / 16 * 16;
  const T* const C = kWithC ? static_cast<const T*>(p.C) : nullptr;
  // Epilogue accesses of this thread: rows e_row + 16 * pass, columns e_col .. e_col + 7.
  const int e_col = (threadIdx.x % kLanesPerRow) * kVec;
  const int e_row = threadIdx.x / kLanesPerRow;

  // Starts the copies of tile t's A tile and C tile (this thread's own epilogue pieces) into
  // buffer `buf` (the caller closes the commit group).
  auto copy_a_and_c = [&](TileCursor const& at, int buf) {
    const int64_t l = at.l;
    const int m0 = at.m_tile * kTileM, n0 = at.n_tile * kTileN;
    const T* A = static_cast<const T*>(p.A) + l * p.a_stride_l + int64_t(m0) * p.a_stride_m;
    if (a_spread) {
      copy_packed<T, kTileM>(a_raws + buf * raw_a_elems(p.K), A, p.M - m0, p.K);
    } else {
      copy_operand<T, kTileM, kARow, kByElement>(a_tiles + buf * kAElems, A, p.a_stride_m, p.a_stride_k, a_k_major,
                                                 a_vector, p.M - m0, p.K, k_pad);
    }
    if (C != nullptr && e_col < p.N - n0) {
      const T* c_row = C + l * p.c_stride_l + int64_t(m0 + e_row) * p.c_stride_m + n0 + e_col;
      T* c_dst = c_tiles + buf * kCElems + e_row * kTileN + e_col;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        if (m0 + e_row + i * kRowsPerPass < p.M) {
          cp_async_16(c_dst + i * kRowsPerPass * kTileN, c_row + int64_t(i) * kRowsPerPass * p.c_stride_m);
        }
      }
    }
  };
  auto copy_b = [&](int64_t l, int n0) {
    const T* B = static_cast<const T*>(p.B) + l * p.b_stride_l + int64_t(n0) * p.b_stride_n;
    if (b_spread) {
      copy_packed<T, kTileN>(b_raw, B, p.N - n0, p.K);
    } else {
      copy_operand<T, kTileN, kBRow, kByElement>(b_tile, B, p.b_stride_n, p.b_stride_k, b_k_major, b_vector,
                                                 p.N - n0, p.K, k_pad);
    }
    // The bias of these columns, with B: the epilogue reads it from shared memory instead of
    // waiting on a load of its own after the product (N is a multiple of kVec). Not in the
    // vector path, which these registers would make spill at 80 (the epilogue loads it there).
    if (kCopy != kVector && threadIdx.x < kTileN / kVec) {
      const int c = n0 + int(threadIdx.x) * kVec;
      const bool valid = p.bias != nullptr && c < p.N;
      // (D stands in as the 16-byte aligned address of a zero-filled piece: B may be unaligned.)
      cp_async_16_or_zero(bias_tile + threadIdx.x * kVec, valid ? static_cast<const T*>(p.bias) + c : p.D, valid);
    }
  };

  // B with the first tile's A, then the A tiles ahead: one commit group a tile (empty past the
  // block's last), so that "tile `step` landed" is always "at most kStages - 2 groups pending".
  constexpr int kStages = a_stages(kWarpStaged);
  int b_l = tile.l, b_n0 = tile.n_tile * kTileN;
  copy_b(b_l, b_n0);
  // The cursor kStages - 1 tiles ahead (two stages derive it from `tile` instead: a cursor kept
  // live through the loop made those kernels spill at 80 registers).
  TileCursor ahead = tile;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) copy_a_and_c(ahead, s);
    cp_async_commit();
    if (kStages > 2) ahead.next(tiles_m, tiles_n, stride);
  }

  // ldmatrix rows of this lane: lane l addresses row l % 8 of matrix l / 8.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp / WarpLayout<kWarpStaged>::kAlongN, wn = warp % WarpLayout<kWarpStaged>::kAlongN;
  const int q_lo = (lane >> 3) & 1, q_hi = lane >> 4, row8 = lane & 7;
  for (int step = 0; step < count; ++step, tile.next(tiles_m, tiles_n, stride)) {
    const int buf = step % kStages;
    const int64_t l = tile.l;
    const int m0 = tile.m_tile * kTileM, n0 = tile.n_tile * kTileN;
    // This tile's copies have landed, and every thread is past the previous tile (its multiply
    // read the A buffer refilled below and the B tile, its epilogue the staging space and the C
    // buffer refilled below).
    cp_async_wait_pending<kStages - 2>();
    __syncthreads();
    bool b_landed = step == 0;
    if (l != b_l || n0 != b_n0) {  // the range moved on to the next column of tiles
      copy_b(l, n0);
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      b_l = l;
      b_n0 = n0;
      b_landed = true;
    }
    if (kCopy == kPacked) {  // raw tiles into the MMAs' layout
      if (b_spread && b_landed) spread_packed<T, kTileN>(b_tile, b_raw, p.N - n0, p.K, k_pad);
      if (a_spread) {
        spread_packed<T, kTileM>(a_tiles + buf * kAElems, a_raws + buf * raw_a_elems(p.K), p.M - m0, p.K, k_pad);
      }
      __syncthreads();
    }
    if constexpr (kStages == 2) {
      if (step + 1 < count) {
        TileCursor following = tile;
        following.next(tiles_m, tiles_n, stride);
        copy_a_and_c(following, buf ^ 1);
      }
    } else {
      if (step + kStages - 1 < count) copy_a_and_c(ahead, (step + kStages - 1) % kStages);
      ahead.next(tiles_m, tiles_n, stride);
    }
    cp_async_commit();

    // Warp (wm, wn) owns rows kRows wm .. +kRows and columns kCols wn .. +kCols: kMI x kNJ mma
    // tiles of 16x8. Fragments by ldmatrix: K-major tiles as stored, MN-major ones transposed.
    using Warps = WarpLayout<kWarpStaged>;
    constexpr int kMI = Warps::kMI, kNJ = Warps::kNJ;
    const int warp_row = wm * Warps::kRows, warp_col = wn * Warps::kCols;
    const T* a_tile = a_tiles + buf * kAElems;
    float acc[kMI][kNJ][4] = {};
#pragma unroll 1
    for (int k0 = 0; k0 < k_pad; k0 += 16) {
      uint32_t a[kMI][4], b[kNJ][2];
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
        const int m = warp_row + i * 16;
        const T* row = a_k_major ? a_tile + (m + row8 + 8 * q_lo) * kKRow + k0 + 8 * q_hi
                                 : a_tile + (k0 + row8 + 8 * q_hi) * kARow + m + 8 * q_lo;
        ldmatrix_x4(a[i], row, !a_k_major);
      }
#pragma unroll
      for (int j = 0; j < kNJ / 2; ++j) {
        const int n = warp_col + j * 16;
        const T* row = b_k_major ? b_tile + (n + row8 + 8 * q_hi) * kKRow + k0 + 8 * q_lo
                                 : b_tile + (k0 + row8 + 8 * q_lo) * kBRow + n + 8 * q_hi;
        uint32_t r[4];
        ldmatrix_x4(r, row, !b_k_major);
        b[2 * j][0] = r[0];
        b[2 * j][1] = r[1];
        b[2 * j + 1][0] = r[2];
        b[2 * j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
#pragma unroll
        for (int j = 0; j < kNJ; ++j) mma_16816<T>(acc[i][j], a[i], b[j]);
      }
    }
    const int g = lane >> 2, tq = lane & 3;
    if constexpr (kWarpStaged) {
      // Lane (g, tq) holds rows 16 i + g (+ 8) and columns 8 j + 2 tq (+ 1) of the warp's piece.
      // Its bias, from memory (the vector path copies none with B), zero past N.
      float bias[kNJ][2] = {};
      if (p.bias != nullptr) {
#pragma unroll
        for (int j = 0; j < kNJ; ++j) {
          const int c = warp_col + 8 * j + 2 * tq;
          if (n0 + c < p.N) {
            const T* b = static_cast<const T*>(p.bias) + n0 + c;
            bias[j][0] = float(b[0]);
            bias[j][1] = float(b[1]);
          }
        }
      }
      T* const stage = reinterpret_cast<T*>(shared) + warp * kWarpStageElems;
      // stmatrix rows of this lane: row l % 8 of matrix l / 8, the matrices being (top, bottom)
      // halves of two adjacent 8-column tiles.
      T* const st_row = stage + (8 * q_lo + row8) * kStageRow + 8 * q_hi;
      // 16-byte reads of the staged piece: lane l takes piece l % 8 of row l / 8 (+ 4 per pass).
      constexpr int kPieces = Warps::kCols / kVec, kRowsPerRead = 32 / kPieces;
      const int r_row = lane / kPieces, r_col = kVec * (lane % kPieces);
      const int rows = min(kTileM, p.M - m0) - warp_row;
      const bool col_ok = warp_col + r_col < min(kTileN, p.N - n0);
      // The pre-activation, once for both outputs.
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
#pragma unroll
        for (int j = 0; j < kNJ; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] = p.alpha * acc[i][j][e] + bias[j][e & 1];
        }
      }
      auto write_piece = [&](T* out, int64_t stride_m, bool pre_activation) {
        // Two adjacent 8-column tiles at a time: their four 8x8 halves are one stmatrix.
#pragma unroll
        for (int i = 0; i < kMI; ++i) {
#pragma unroll
          for (int jp = 0; jp < kNJ / 2; ++jp) {
            uint32_t r[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int j = 2 * jp + h;
              float v[4];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                v[e] = pre_activation ? acc[i][j][e] : act::forward_for<T>(kAct, acc[i][j][e]);
              }
              r[2 * h] = pack_pair<T>(v[0], v[1]);
              r[2 * h + 1] = pack_pair<T>(v[2], v[3]);
            }
            stmatrix_x4(st_row + 16 * i * kStageRow + 16 * jp, r);
          }
        }
        __syncwarp();
        // One 64-bit step a pass (per-pass products of 64-bit strides cost ~10 instructions a store).
        T* dst = out + l * (pre_activation ? p.aux_stride_l : p.d_stride_l) +
                 int64_t(m0 + warp_row + r_row) * stride_m + n0 + warp_col + r_col;
        const int64_t step = kRowsPerRead * stride_m;
        const T* src = stage + r_row * kStageRow + r_col;
#pragma unroll
        for (int pass = 0; pass < Warps::kRows / kRowsPerRead;
             ++pass, dst += step, src += kRowsPerRead * kStageRow) {
          if (col_ok && r_row + kRowsPerRead * pass < rows) {
            store_pack<T, kVec>(dst, *reinterpret_cast<const Pack<T, kVec>*>(src));
          }
        }
        __syncwarp();
      };
      if (p.aux != nullptr) write_piece(static_cast<T*>(p.aux), p.aux_stride_m, true);
      write_piece(static_cast<T*>(p.D), p.d_stride_m, false);
    } else {
#pragma unroll
      for (int i = 0; i < kMI; ++i) {
#pragma unroll
        for (int j = 0; j < kNJ; ++j) {
          const int r = warp_row + i * 16 + g, c = warp_col + j * 8 + 2 * tq;
          *reinterpret_cast<float2*>(&staged[r][c]) = make_float2(acc[i][j][0], acc[i][j][1]);
          *reinterpret_cast<float2*>(&staged[r + 8][c]) = make_float2(acc[i][j][2], acc[i][j][3]);
        }
      }
      __syncthreads();

      const int rows = min(kTileM, p.M - m0), cols = min(kTileN, p.N - n0);
      if (e_col < cols) {
        float bias[kVec] = {};
        if (kCopy != kVector) {
          load_vec<T, kVec>(bias_tile + e_col, bias);
        } else if (p.bias != nullptr) {
          load_vec<T, kVec>(static_cast<const T*>(p.bias) + n0 + e_col, bias);
        }
        const float alpha = p.alpha, beta = p.beta;
        const bool odd_first = (threadIdx.x >> 2) & 1;
        // Row pointers stepped per pass (the aux one only when there is an aux output).
        const bool has_aux = p.aux != nullptr;
        T* d_row = static_cast<T*>(p.D) + l * p.d_stride_l + int64_t(m0 + e_row) * p.d_stride_m + n0 + e_col;
        T* aux_row = has_aux ? static_cast<T*>(p.aux) + l * p.aux_stride_l + int64_t(m0 + e_row) * p.aux_stride_m +
                                   n0 + e_col
                             : nullptr;
        const int64_t d_step = int64_t(kRowsPerPass) * p.d_stride_m;
        const int64_t aux_step = has_aux ? int64_t(kRowsPerPass) * p.aux_stride_m : 0;
        const T* c_src = c_tiles + buf * kCElems + e_row * kTileN + e_col;
#pragma unroll
        for (int i = 0; i < kPasses; ++i, d_row += d_step, aux_row += aux_step) {
          const int r = e_row + i * kRowsPerPass;
          if (r >= rows) break;
          const float4* sums4 = reinterpret_cast<const float4*>(&staged[r][e_col]);
          const float4 first = sums4[odd_first ? 1 : 0], second = sums4[odd_first ? 0 : 1];
          const float4 lo = odd_first ? second : first, hi = odd_first ? first : second;
          const float sums[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          float v[kVec], y[kVec];
          Pack<T, kVec> c_piece;
          if (C != nullptr) c_piece = load_pack<T, kVec>(c_src + i * kRowsPerPass * kTileN);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            v[j] = alpha * sums[j] + bias[j];
            if (C != nullptr) v[j] += beta * float(c_piece.v[j]);
            y[j] = act::forward_for<T>(kAct, v[j]);
          }
          if (has_aux) store_vec<T, kVec>(aux_row, v);
          store_vec<T, kVec>(d_row, y);
        }
      }
    }
  }
}

// A warp_staged kernel's striped stride (TileCursor), or 0 for contiguous ranges: forced by
// raster (1 along M: ranges; 2 along N: striped, where the columns of tiles fit the wave), else
// striped where there are more tiles than one wave holds and the striped grid (stride x tiles_n
// blocks) keeps at least 31/32 of the wave. Striped, a block never reloads B; measured against ranges (H200, bf16,
// bench/kernels/lowk_shapes): 8192 x 4096 x 32 and 65536 x 512 x 64 with bias and ReLU
// 1.03-1.06x, 4096-column weight gradients 0.99-1.01x, but 0.90-0.93x at 11008 columns, whose
// striped grid leaves 13% of the wave idle.
inline int striped_stride(int raster, int64_t tiles, int64_t tiles_n, int64_t slots) {
  if (raster == 1 || tiles_n > slots) return 0;
  const int stride = int(std::min(slots / tiles_n, tiles / tiles_n));
  if (raster == 2) return stride;
  return tiles > slots && stride * tiles_n * 32 >= slots * 31 ? stride : 0;
}

// kWithC: the kernels that add beta * C (they also run products without C, on the fp32 staging
// epilogue); without it, products without C only.
template <class Element, bool kWithC = false>
struct GemmBundle {
  using T = Element;
  static_assert(sizeof(T) == 2, "the short-K GEMM multiplies 16-bit types");

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    if (p.K > kMaxK) return {"can_implement", "the short-K GEMM takes K <= 64"};
    if (!kWithC && p.C != nullptr) return {"can_implement", "this short-K kernel reads no C (its with-C twin does)"};
    auto ok = [](int64_t s) { return s % kVec == 0; };
    // C, D, Aux and the bias are read and written in 16-byte pieces.
    const bool epilogue_aligned =
        aligned16(p.D) && p.N % kVec == 0 && ok(p.d_stride_m) &&
        (p.C == nullptr || (aligned16(p.C) && ok(p.c_stride_m))) &&
        (p.aux == nullptr || (aligned16(p.aux) && ok(p.aux_stride_m))) && (p.bias == nullptr || aligned16(p.bias)) &&
        (p.L == 1 ||
         (ok(p.d_stride_l) && (p.C == nullptr || ok(p.c_stride_l)) && (p.aux == nullptr || ok(p.aux_stride_l))));
    if (!epilogue_aligned) return {"can_implement", "the short-K GEMM needs 16-byte aligned C, D, Aux, bias and rows"};
    // Operands are copied in 16-byte pieces along their unit stride where they allow it, else
    // element by element (copy_operand). A depth-1 operand counts as K-major.
    const bool a_k_major = p.a_stride_k == 1 || p.K == 1, b_k_major = p.b_stride_k == 1 || p.K == 1;
    const bool a_vector = aligned16(p.A) && (p.L == 1 || ok(p.a_stride_l)) &&
                          (a_k_major ? p.a_stride_k == 1 && p.K % kVec == 0 && ok(p.a_stride_m)
                                     : p.a_stride_m == 1 && p.M % kVec == 0 && ok(p.a_stride_k));
    const bool b_vector = aligned16(p.B) && (p.L == 1 || ok(p.b_stride_l)) &&
                          (b_k_major ? p.b_stride_k == 1 && p.K % kVec == 0 && ok(p.b_stride_n)
                                     : p.b_stride_n == 1 && p.N % kVec == 0 && ok(p.b_stride_k));
    // Packed operands (see kPacked): contiguous K-major [lines, K] matrices, 16-byte aligned,
    // batches 16 bytes apart.
    auto packed = [&](const void* ptr, int64_t stride_line, int64_t stride_k, int64_t stride_l, int64_t lines) {
      return (p.K == 1 || stride_k == 1) && (lines == 1 || stride_line == p.K) && aligned16(ptr) &&
             (p.L == 1 || ok(stride_l));
    };
    const bool a_packed = !a_vector && packed(p.A, p.a_stride_m, p.a_stride_k, p.a_stride_l, p.M);
    const bool b_packed = !b_vector && packed(p.B, p.b_stride_n, p.b_stride_k, p.b_stride_l, p.N);
    const int copy = a_vector && b_vector                                 ? kVector
                     : (a_vector || a_packed) && (b_vector || b_packed) ? kPacked
                                                                          : kElementwise;
    const int64_t tiles = int64_t((p.M + kTileM - 1) / kTileM) * ((p.N + kTileN - 1) / kTileN) * p.L;
    if (tiles == 0) return {};
    if (tiles > INT32_MAX) return {"can_implement", "the short-K GEMM takes fewer than 2^31 tiles of 64x128"};
    LaunchResult result;
    auto launch = [&](auto act, auto copy_kind) {
      constexpr int kAct = decltype(act)::value;
      constexpr int kCopy = decltype(copy_kind)::value;
      constexpr bool kWarpStaged = warp_staged(kWithC, kCopy);
      const int smem = shared_bytes(kWarpStaged, kWithC && p.C != nullptr) +
                       (kCopy == kPacked && a_packed ? a_stages(kWarpStaged) * raw_a_elems(p.K) * int(sizeof(T)) : 0);
      const void* kernel = reinterpret_cast<const void*>(lowk_gemm_kernel<T, kAct, kCopy, kWithC>);
      const cudaError_t err = allow_large_dynamic_shared(kernel, p.device);
      if (err != cudaSuccess) {
        result = {"initialize", cudaGetErrorString(err)};
        return;
      }
      // Persistent blocks: one wave, each walking its share of the tiles (striped_stride).
      const int64_t slots =
          int64_t(std::max(p.sm_count, 1)) * cached_resident_blocks(kernel, kThreads, smem, p.device);
      const int64_t tiles_n = (p.N + kTileN - 1) / kTileN;
      const int stride = kWarpStaged ? striped_stride(p.raster, tiles, tiles_n, slots) : 0;
      const unsigned blocks = unsigned(stride > 0 ? stride * tiles_n : std::min(tiles, slots));
      lowk_gemm_kernel<T, kAct, kCopy, kWithC><<<blocks, kThreads, smem, stream>>>(
          p, a_k_major, b_k_major, a_vector, b_vector, a_packed, b_packed, stride);
    };
    dispatch_activation(p.activation, [&](auto act) {
      if (copy == kVector) {
        launch(act, std::integral_constant<int, kVector>{});
      } else if (copy == kPacked) {
        launch(act, std::integral_constant<int, kPacked>{});
      } else {
        launch(act, std::integral_constant<int, kElementwise>{});
      }
    });
    if (!result.ok()) return result;
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::lowk
