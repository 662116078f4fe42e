// How cutlass_ext.sum launches a reduction of x[outer, reduce, inner] (elementwise/reduce_kernels.cu):
// the splits of the reduced extent, the block shapes and the short rows' batches, from the shape,
// the 16-byte vector width and the SM count. Plain C++: the host tests build it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/int_math.h"

namespace cutlass_ext {
namespace sum_rules {

constexpr int kThreads = 256;     // the group and column kernels' blocks; the long-row kernel's smallest
constexpr int kBlocksPerSm = 4;   // grid target of the split decisions
// Rows up to this many vectors: a group of lanes per row (a warp from 17 vectors), no block-wide
// sum. Rows of 512 16-byte vectors ran faster this way than as a 256-thread block a row on an
// H200: bf16 32768x4096 1.14x, fp32 65536x2048 and 32768x2048 1.20-1.22x; at 1024 (bf16
// 16384x8192, fp32 32768x4096) 1.03-1.07x slower (bench/NOTES.md sections 63 and 64).
constexpr int64_t kMaxGroupVectors = 512;
// Lanes a row in the group kernel: a power of two from 4 to 32, at least the row's vectors up to a
// warp.
constexpr int group_lanes(int64_t vectors) { return vectors <= 4 ? 4 : vectors <= 8 ? 8 : vectors <= 16 ? 16 : 32; }
// Rows a lane group sums together where each lane has one vector a row: the loads of four rows in
// flight at once instead of one, in a quarter of the blocks. 1.07-1.15x on an H200 at bf16 65536x128,
// 262144x64, fp32 65536x128 and fp16 131072x256; no gain where the lanes already have several
// vectors a row (bench/NOTES.md section 64).
constexpr int kRowBatch = 4;
// Rows of 256 to 512 vectors: a warp a row, each lane loading this many of its vectors together.
constexpr int kDeepLoads = 8;
// Whether a row of `vectors` whole 16-byte vectors takes those deep loads (rows of up to
// kMaxGroupVectors; the plan's lane_rest and the launch decide by it alike).
constexpr bool deep_rows(int64_t vectors) { return vectors >= kDeepLoads * 32; }
// How a one-row lane group reads a lane's vectors after its batches of kDeepLoads (LaneRest, as
// SumPlan::lane_rest): one after another's add in an unrolled loop (serial); for 16-bit rows whose
// lanes hold three or more vectors, the count modulo four loaded together first, then batches of
// four (mod_four); a warp's rest of three or more (of the deep kernel, fewer than kDeepLoads a
// lane) loaded together, predicated (batch). The loaded-together forms hold more registers: at one
// or two vectors a lane (bf16 65536x100, 65536x512) their lower occupancy cost 1.07-1.14x, and so
// did a rest of one or two in the deep kernel (bf16 8192x2500 1.06x). Measured on an H200:
// bf16 1024x1020 and 512x2000 1.21-1.22x, 2048x2000 1.15x, 1024x1024 1.08x; deep rests fp32
// 16384x1500 1.18x, 512x2000 1.13x, bf16 1024x4000 1.12x (bench/NOTES.md section 66).
constexpr int kMinRestTogether = 3;
// Unaligned 16-bit short rows (base or pitch off 16 bytes) whose base and pitch are 8- or 4-byte
// aligned are read as packs of that width (4 or 2 elements), four rows a lane group as aligned rows
// are (kRowBatch), where the plan batches their rows and a lane holds at most this many packs; 4-byte
// packs only where they take no more lanes than the row's 16-byte vectors would. Otherwise they read
// a head of single elements, 16-byte vectors, and a tail, one row a group. Measured on an H200
// against the head-vectors-tail form: bf16 65536x130 (4-byte packs, 3 a lane) 1.35x, 32768x130 1.08x,
// 65536x196 1.13x, 65536x100 1.09x, 40003x100 1.06x, 262144x20 1.05x, fp16 131072x36 1.06x; slower
// where the rows are not batched (bf16 4096x130 0.95x), a lane holds 4 packs (16384x250 0.93x,
// 65536x500 0.92x), or 4-byte packs took 32 lanes for 16 (fp16 65536x66 0.87x) (bench/NOTES.md
// section 67).
constexpr int kMaxPacksPerLane = 3;
constexpr int kMinChunkVectors = 2 * kThreads;  // smallest piece of a split row
constexpr int kMinRowsPerThread = 8;      // smallest share of a split column reduction per thread
constexpr int kMaxColumnThreads = 32;     // threads across a column chunk: 512 bytes of a 16-bit row
constexpr int kSplitColumnThreads = 8;    // the same where the rows are split: 128 bytes
// Column sums over rows of this many vectors or more: wide chunks (kMaxColumnThreads) whose splits
// fill the GPU at kWideColumnBlocksPerSm blocks an SM, not narrow chunks at kBlocksPerSm. Measured on
// an H200: fp32 8192x3000 1.16x, 16384x1500 1.14x, 4096x3000 1.07x, 8192x6000 1.06x, 2048x65536
// 1.03x; bf16 8192x6000 1.13x, 4096x3000 1.11x, 8192x3000 1.09x; 0.98-1.02x on the other shapes
// of 128 vectors or more (bench/NOTES.md section 67).
constexpr int64_t kWideColumnVectors = 128;
constexpr int kWideColumnBlocksPerSm = 2;
// The second stage (adding a column sum's splits) loads eight splits a lane at once, and its blocks
// take split lanes enough for one round of those loads (partials_lanes): columns a multiple of 4 at
// kThreads threads a block, fewer float4 columns for more lanes; other columns at up to
// kMaxPartialsThreads threads, 32 columns a block. Measured on an H200 against the former lanes
// (16 for the float4 form, 256 threads for the other), the same kernels: bf16 65536x50 1.20x,
// 65536x36 1.11x, 32768x33 1.10x, 262144x64 1.07x; fp32 32768x33 and 65536x50 1.09x; 0.99-1.00x
// where 64 splits or fewer already took one round (bench/NOTES.md section 68).
constexpr int kPartialsLoads = 8;
constexpr int kMaxPartialsThreads = 1024;
// The long-row block kernel reads evict-first (ld.global.cs) up to this many times the L2's bytes:
// its lines leave L2 before the dirty lines a previous kernel left there, which are then not
// written back during the sum. On an H200 (50 MB of L2), after a zeroing L2 flush: 1.07-1.20x at
// 25-164 MB (fp32 4096x3000, 8192x2500, 2048x3000; bf16 4096x6000, 8192x5000, 2048x16384; fp16
// 4096x20000); from 229 MB mixed: fp32 1.01-1.04x slower (16384x3500, 32768x4096, 8192x8192,
// 1024x65536), bf16 1.02-1.10x faster (bench/NOTES.md section 65). The short rows' kernels always
// read evict-first.
constexpr int64_t kOnceL2Multiple = 4;

}  // namespace sum_rules

// Threads across columns for rows of `vectors` vectors: the next power of two, at most `max_threads`.
inline int column_threads(int64_t vectors, int max_threads) {
  return int(std::min<int64_t>(max_threads, pow2_at_least(vectors)));
}

// Split lanes for the second stage: a power of two of lanes enough for one round of kPartialsLoads
// loads a lane, within [min_lanes, max_lanes] (powers of two).
inline int partials_lanes(int64_t splits, int min_lanes, int max_lanes) {
  const int64_t lanes = pow2_at_least(ceil_div(splits, sum_rules::kPartialsLoads));
  return int(std::max<int64_t>(min_lanes, std::min<int64_t>(max_lanes, lanes)));
}

enum class LaneRest : int { kSerial = 0, kModFour = 1, kBatch = 2 };

// The most vectors a lane of a warp holds past its batches of `depth` where a row's `vectors`
// are dealt to 32 lanes.
inline int64_t max_lane_rest(int64_t vectors, int depth) {
  return std::max((vectors / 32) % depth, ceil_div(vectors, 32) % depth);
}

struct SumPlan {
  int splits = 1;       // blocks sharing one reduction (1: no workspace, no second stage)
  int col_threads = sum_rules::kMaxColumnThreads;  // threads across a column chunk (inner > 1)
  int row_threads = sum_rules::kThreads;           // the long-row kernel's block (inner == 1)
  int row_batch = 1;    // short rows a lane group sums together (inner == 1)
  bool block_once = false;  // the long-row block kernel's loads evict-first (inner == 1)
  LaneRest lane_rest = LaneRest::kSerial;  // one-row lane groups (inner == 1)
  int row_pack = 0;     // unaligned 16-bit short rows: elements a load (4 or 2; 0: a head, then 16 bytes)
};

// The elements of `elem_bytes` in the widest pack of at most 16 bytes that the address `base_bytes`
// and the byte counts `a`, `b` and `c` (strides, extents; 0 for none) are all multiples of.
inline int pack_elements(uint64_t base_bytes, int64_t a, int64_t b, int64_t c, int elem_bytes) {
  int align = 16;
  while (align > elem_bytes && (base_bytes % align != 0 || a % align != 0 || b % align != 0 || c % align != 0)) {
    align /= 2;
  }
  return align / elem_bytes;
}

// The elements a column-sum load takes: 16 bytes (`full` elements), else 8, else 4 (16-bit types),
// else one element, as the first element and the strides and row length in bytes (pack_elements)
// allow.
inline int column_vec(int pack, int full) {
  for (int v = full; v > 1; v /= 2) {
    if (pack >= v) return v;
  }
  return 1;
}

// `full`: elements in 16 bytes (4 for fp32, 8 for 16-bit types); `vec`: elements a load, `full`
// for row sums (inner == 1), column_vec's for column sums. The splits fill `sm_count`
// multiprocessors at the grid target; `l2_bytes` is the device's L2 cache size. `row_align`: the
// elements (pack_elements, at most full) that the rows' base and pitch are aligned to, for inner == 1.
inline SumPlan plan_sum_shape(int64_t outer, int64_t reduce, int64_t inner, int vec, int full, int sm_count,
                              int64_t l2_bytes, int row_align) {
  using namespace sum_rules;
  SumPlan plan;
  const int64_t target = int64_t(kBlocksPerSm) * std::max(sm_count, 1);
  int64_t splits = 1;
  if (inner == 1) {
    const int64_t vectors = reduce / vec;
    // Short rows, one vector a lane: batches of rows where there are still a block an SM or more.
    const int64_t row_vectors = ceil_div(reduce, vec);
    const int64_t batch_rows = int64_t(kThreads / group_lanes(row_vectors)) * kRowBatch;
    if (row_vectors <= 32 && ceil_div(outer, batch_rows) >= sm_count) plan.row_batch = kRowBatch;
    // From a quarter of the target, one block a row instead of splits and a second stage, the
    // fewer the rows the larger the block: 1.02-1.07x at 200-512 rows on an H200 (bench/NOTES.md
    // section 63).
    if (vectors > kMaxGroupVectors && 4 * outer < target) {
      splits = std::min(ceil_div(target, outer), vectors / kMinChunkVectors);
    }
    plan.block_once = outer * reduce * (16 / vec) <= kOnceL2Multiple * l2_bytes;
    // One row a lane group (rows of up to kMaxGroupVectors; longer ones take a block a row).
    const int lanes = group_lanes(row_vectors);
    const bool deep = deep_rows(vectors);  // 256 vectors or more: 32 lanes
    if (row_vectors <= kMaxGroupVectors && deep && max_lane_rest(vectors, kDeepLoads) >= kMinRestTogether) {
      plan.lane_rest = LaneRest::kBatch;
    } else if (row_vectors <= kMaxGroupVectors && !deep && vec == 8 &&
               ceil_div(row_vectors, lanes) >= kMinRestTogether) {
      plan.lane_rest = LaneRest::kModFour;
    }
    if (vec == 8 && row_align >= 2 && row_align < vec && plan.row_batch == kRowBatch) {
      const int pack = row_align >= 4 ? 4 : 2;
      const int64_t packs = ceil_div(reduce, pack);
      if (ceil_div(packs, group_lanes(packs)) <= kMaxPacksPerLane && (pack == 4 || group_lanes(packs) <= lanes)) {
        plan.row_pack = pack;
      }
    }
  } else {
    // Wide chunks (32 threads of a load each) where they alone fill the GPU, or where the rows are
    // long (kWideColumnVectors of 16 bytes), split to two blocks an SM. Otherwise narrow ones (128
    // bytes of a row: 8 threads of 16-byte loads, 16 of 8-byte ones), whose blocks split the rows:
    // more column blocks leave fewer splits to add in the second stage. The grid stays within one
    // wave of resident blocks; a partial second wave of blocks cost 7% at 32768 x 4096.
    const int64_t inner_vecs = ceil_div(inner, vec);
    const int64_t wide = column_threads(inner_vecs, kMaxColumnThreads);
    plan.col_threads = int(wide);
    if (ceil_div(inner, full) >= kWideColumnVectors) {
      const int64_t blocks = ceil_div(inner_vecs, wide) * outer;
      const int64_t rows = kThreads / wide;
      splits = std::min(int64_t(kWideColumnBlocksPerSm) * std::max(sm_count, 1) / blocks,
                        reduce / (rows * kMinRowsPerThread));
    } else if (ceil_div(inner_vecs, wide) * outer < target) {
      plan.col_threads = column_threads(inner_vecs, std::min(kMaxColumnThreads, kSplitColumnThreads * full / vec));
      const int64_t blocks = ceil_div(inner_vecs, plan.col_threads) * outer;
      const int64_t rows = kThreads / plan.col_threads;
      splits = std::min(target / blocks, reduce / (rows * kMinRowsPerThread));
    }
  }
  plan.splits = int(std::max<int64_t>(1, std::min<int64_t>(splits, 65535)));
  // Unsplit long rows below the target (above): the fewer the rows, the larger the block.
  if (inner == 1 && plan.splits == 1 && outer < target) {
    plan.row_threads = 2 * outer < target ? 4 * kThreads : 2 * kThreads;
  }
  return plan;
}

}  // namespace cutlass_ext
