#include "elementwise/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/dependent_launch.h"
#include "common/device_utils.cuh"
#include "common/sum_plan.h"
#include "elementwise/column_sums.cuh"

namespace cutlass_ext {
namespace {

using namespace sum_rules;  // the constants that plan_sum_shape (common/sum_plan.h) decides with
constexpr int kUnroll = 4;                // loads per thread in flight together
constexpr int kColumnUnroll = 8;          // rows per thread in flight together in column reductions

template <class T, int kVec>
__device__ __forceinline__ float pack_sum(Pack<T, kVec> const& v) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) s += float(v.v[i]);
  return s;
}

// ------------------------------------------------------------------------------------------------
// Row reductions (inner == 1): row `o` is input[o * outer_stride + (0 .. reduce-1)].

// Rows that start off a 16-byte boundary (kPeel: a row pitch that is not a whole number of 16-byte
// vectors, or an offset view): the row's first elements up to the next boundary, fewer than kVec,
// are read one at a time, the rest as 16-byte vectors from there. Returns that head's length.
template <class T, int kVec>
__device__ __forceinline__ int row_head(const T* in, int64_t reduce) {
  const int off = int(reinterpret_cast<uintptr_t>(in) & 15) / int(sizeof(T));
  const int head = (kVec - off) % kVec;
  return reduce < head ? int(reduce) : head;
}

// How a one-row lane group reads its vectors after the kDepth batches (sum_rules::kMinRestTogether).
constexpr int kRestSerial = int(LaneRest::kSerial);    // an unrolled loop: one load after another's add
constexpr int kRestModFour = int(LaneRest::kModFour);  // the lane's count modulo four together, then fours
constexpr int kRestBatch = int(LaneRest::kBatch);      // fewer than kDepth left: together, predicated

// Short rows: kGroup adjacent lanes per row, kThreads / kGroup rows per block, grid-stride over
// rows in whole warps (so every lane of a warp reaches the shuffles). A lane group sums kRows rows
// together, their loads in flight at once; the warp's rows of one batch are kRowsPerWarp apart, so
// that each load instruction of the warp reads adjacent rows. With kRows == 1, each lane loads
// kDepth (> 1) of its row's vectors together, then the rest as kRest says (SumPlan::lane_rest).
template <class T, int kVec, int kGroup, int kRows, int kDepth, bool kPeel, int kRest>
__device__ __forceinline__ void sum_rows_group(SumParams const& p) {
  static_assert(!kPeel || kRows == 1, "rows of different heads are not batched");
  constexpr int kRowsPerWarp = 32 / kGroup;
  const int lane = threadIdx.x % kGroup;
  const int64_t warp = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int64_t warp_step = int64_t(gridDim.x) * (kThreads / 32) * kRowsPerWarp * kRows;
  const int64_t vectors = p.reduce / kVec;
  const T* input = static_cast<const T*>(p.input);
  for (int64_t base = warp * kRowsPerWarp * kRows; base < p.outer; base += warp_step) {
    const int64_t row0 = base + (threadIdx.x % 32) / kGroup;
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
    if constexpr (kRows == 1) {
      if (row0 < p.outer) {
        const T* in = input + row0 * p.outer_stride;
        int64_t reduce = p.reduce, vectors = p.reduce / kVec;
        // The head's loads (predicated, a lane's at most two) are issued first and added last, so
        // that the vectors' loads do not wait for them.
        constexpr int kHeadLoads = kPeel ? (kVec - 2 + kGroup) / kGroup : 0;
        T head_x[kHeadLoads > 0 ? kHeadLoads : 1];
        if constexpr (kPeel) {
          const int head = row_head<T, kVec>(in, reduce);
#pragma unroll
          for (int h = 0; h < kHeadLoads; ++h) {
            head_x[h] = T(0.f);
            if (lane + h * kGroup < head) head_x[h] = in[lane + h * kGroup];
          }
          in += head;
          reduce -= head;
          vectors = reduce / kVec;
        }
        // The row's last reduce % kVec elements likewise: issued before the vectors, added after
        // them. A loop after the vectors' adds issued them a memory round trip later: 1.04-1.17x
        // on an H200 (fp32 65536x130 1.17x, bf16 65536x500 1.16x, 16384x1001 1.11x, 65536x130
        // 1.08x; bench/NOTES.md section 66), same bits, and fewer registers.
        constexpr int kTailLoads = (kVec - 1 + kGroup - 1) / kGroup;
        T tail_x[kTailLoads];
#pragma unroll
        for (int t = 0; t < kTailLoads; ++t) {
          const int64_t e = vectors * kVec + lane + t * kGroup;
          tail_x[t] = T(0.f);
          if (e < reduce) tail_x[t] = in[e];
        }
        int64_t v = lane;
        if constexpr (kDepth > 1) {
          for (; v + (kDepth - 1) * kGroup < vectors; v += kDepth * kGroup) {
            Pack<T, kVec> x[kDepth];
#pragma unroll
            for (int u = 0; u < kDepth; ++u) x[u] = load_pack_once<T, kVec>(in + (v + u * kGroup) * kVec);
#pragma unroll
            for (int u = 0; u < kDepth; ++u) acc[0] += pack_sum<T, kVec>(x[u]);
          }
        }
        if constexpr (kRest == kRestBatch) {
          static_assert(kDepth > 1, "fewer than kDepth left a lane");
          Pack<T, kVec> x[kDepth - 1];
#pragma unroll
          for (int u = 0; u < kDepth - 1; ++u) {
            if (v + u * kGroup < vectors) x[u] = load_pack_once<T, kVec>(in + (v + u * kGroup) * kVec);
          }
#pragma unroll
          for (int u = 0; u < kDepth - 1; ++u) {
            if (v + u * kGroup < vectors) acc[0] += pack_sum<T, kVec>(x[u]);
          }
        } else if constexpr (kRest == kRestModFour) {
          // This lane's vectors modulo four first, loaded together (predicated), then unguarded
          // batches of four: no load waits for another's add.
          constexpr int kBatch = 4;
          const int64_t mine = v < vectors ? (vectors - v + kGroup - 1) / kGroup : 0;
          const int first = int(mine % kBatch);
          Pack<T, kVec> x[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch - 1; ++u) {
            if (u < first) x[u] = load_pack_once<T, kVec>(in + (v + u * kGroup) * kVec);
          }
#pragma unroll
          for (int u = 0; u < kBatch - 1; ++u) {
            if (u < first) acc[0] += pack_sum<T, kVec>(x[u]);
          }
          for (v += first * kGroup; v < vectors; v += kBatch * kGroup) {
#pragma unroll
            for (int u = 0; u < kBatch; ++u) x[u] = load_pack_once<T, kVec>(in + (v + u * kGroup) * kVec);
#pragma unroll
            for (int u = 0; u < kBatch; ++u) acc[0] += pack_sum<T, kVec>(x[u]);
          }
        } else {
#pragma unroll 4
          for (; v < vectors; v += kGroup) acc[0] += pack_sum<T, kVec>(load_pack_once<T, kVec>(in + v * kVec));
        }
#pragma unroll
        for (int t = 0; t < kTailLoads; ++t) acc[0] += float(tail_x[t]);
#pragma unroll
        for (int h = 0; h < kHeadLoads; ++h) acc[0] += float(head_x[h]);
      }
    } else {
      for (int64_t v = lane; v < vectors; v += kGroup) {
        Pack<T, kVec> x[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (row0 + r * kRowsPerWarp < p.outer) {
            x[r] = load_pack_once<T, kVec>(input + (row0 + r * kRowsPerWarp) * p.outer_stride + v * kVec);
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (row0 + r * kRowsPerWarp < p.outer) acc[r] += pack_sum<T, kVec>(x[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r * kRowsPerWarp;
        if (row >= p.outer) continue;
        const T* in = input + row * p.outer_stride;
        for (int64_t e = vectors * kVec + lane; e < p.reduce; e += kGroup) acc[r] += float(in[e]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int offset = kGroup / 2; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
      const int64_t row = row0 + r * kRowsPerWarp;
      if (row < p.outer && lane == 0) static_cast<T*>(p.output)[row] = T(acc[r]);
    }
  }
}

// Rows a lane group at a time under a minimum of 2048 threads an SM (at most 32 registers: ptxas
// gave fp32 34 otherwise, which leaves room for 1536); the row batches and the four-at-a-time rest
// hold more registers for their loads in flight (the latter spilled at 32) and keep no minimum.
constexpr int kFullSmThreads = 2048;
template <class T, int kVec, int kGroup, int kRows, bool kPeel, int kRest>
__global__ void __launch_bounds__(kThreads,
                                  kRows == 1 && !kPeel && kRest == kRestSerial ? kFullSmThreads / kThreads : 0)
    sum_rows_group_kernel(SumParams p) {
  sum_rows_group<T, kVec, kGroup, kRows, 1, kPeel, kRest>(p);
}

// Rows of 256 to 512 vectors (8 to 16 a lane): eight loads a lane issued together. Under
// __launch_bounds__(256) alone ptxas kept such a loop near 32 registers and interleaved its loads
// with the adds (SASS: at most four in flight); a minimum of one block an SM lets it issue all
// eight first (94 registers for fp32). 1.02-1.08x on an H200 (fp32 1024x2048 1.08x, 65536x1024
// 1.05x, 65536x2048 1.02x; bf16 32768x4096 and 65536x2048 1.02x; bench/NOTES.md section 64).
// A rest of three or more vectors left to some lane loads together too (kRestBatch; 80 -> 111
// registers for fp32, 51 -> 82 for bf16, aligned rows).
template <class T, int kVec, bool kPeel, int kRest>
__global__ void __launch_bounds__(kThreads, 1) sum_rows_deep_kernel(SumParams p) {
  sum_rows_group<T, kVec, 32, 1, kDeepLoads, kPeel, kRest>(p);
}

template <class T, int kVec, bool kOnce>
__device__ __forceinline__ Pack<T, kVec> load_row_pack(const T* src) {
  if constexpr (kOnce) {
    return load_pack_once<T, kVec>(src);
  } else {
    return load_pack<T, kVec>(src);
  }
}

// Long rows: block (row, split) of kBlock threads sums the split-th chunk of chunk_vectors vectors
// of its row; the tail elements (reduce % kVec) belong to the last split. Evict-first loads
// (kOnce) up to a few times the L2's size, plain ones above (sum_rules::kOnceL2Multiple).
// 16-bit rows under a minimum of 2048 threads an SM: ptxas otherwise gave their 16-byte form 33-38
// registers, which a register file of 64K holds for 1536 threads (1024 at 1024-thread blocks), and
// bf16 512x262144 read 1.09-1.11x slower, 2048x65536 and 16384x8192 up to 1.06x, on an H200. fp32
// keeps no minimum: at 32 registers its loop spilled, and it ran 1.06-1.12x slower (bench/NOTES.md
// section 65).
template <class T, int kVec, int kBlock, bool kOnce, bool kPeel>
__global__ void __launch_bounds__(kBlock, sizeof(T) == 2 ? kFullSmThreads / kBlock : 0)
    sum_rows_block_kernel(SumParams p, int64_t chunk_vectors) {
  __shared__ float scratch[kBlock / 32];
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y;
  const T* in = static_cast<const T*>(p.input) + row * p.outer_stride;
  int64_t reduce = p.reduce;
  float acc = 0.f;
  // The head belongs to the first split, its load (predicated) issued first and added last; the
  // chunks count the row's own vectors.
  T head_x = T(0.f);
  if constexpr (kPeel) {
    const int head = row_head<T, kVec>(in, reduce);
    if (split == 0 && int(threadIdx.x) < head) head_x = in[threadIdx.x];
    in += head;
    reduce -= head;
  }
  const int64_t vectors = reduce / kVec;
  const int64_t v_end = min(vectors, (split + 1) * chunk_vectors);
  int64_t v = split * chunk_vectors + threadIdx.x;
  for (; v + (kUnroll - 1) * kBlock < v_end; v += kUnroll * kBlock) {
    Pack<T, kVec> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x[u] = load_row_pack<T, kVec, kOnce>(in + (v + u * kBlock) * kVec);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc += pack_sum<T, kVec>(x[u]);
  }
  // The rest, fewer than kUnroll vectors a thread, loaded together rather than one after another:
  // 1.17-1.31x on an H200 where it is most of a row (fp32 4096x3000, bf16 4096x6000, fp32
  // 8192x2500; bench/NOTES.md section 65). Same order of adds, so the same bits.
  {
    Pack<T, kVec> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v + u * kBlock < v_end) x[u] = load_row_pack<T, kVec, kOnce>(in + (v + u * kBlock) * kVec);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v + u * kBlock < v_end) acc += pack_sum<T, kVec>(x[u]);
    }
  }
  if (split == p.plan.splits - 1) {
    for (int64_t e = vectors * kVec + threadIdx.x; e < reduce; e += kBlock) acc += float(in[e]);
  }
  if constexpr (kPeel) acc += float(head_x);
  if (p.plan.splits > 1) allow_dependent_launch();  // sum_partials may be scheduled
  acc = block_sum(acc, scratch);
  if (threadIdx.x != 0) return;
  if (p.plan.splits == 1) {
    static_cast<T*>(p.output)[row] = T(acc);
  } else {
    p.partials[row * p.plan.splits + split] = acc;
  }
}

template <class T, int kVec, int kGroup, bool kPeel>
void launch_rows_group(SumParams const& p, cudaStream_t stream) {
  // Enough warps to fill the GPU many times over; the grid-stride loop covers the rest. Unaligned
  // rows (kPeel) are summed one row a lane group: a block for each of their lane groups' rows, not
  // a quarter of those where aligned rows of the same shape take four rows a group (bf16 65536x20
  // 1.13x, 65536x100 1.07x, fp16 131072x36 1.08x on an H200; bench/NOTES.md section 66).
  constexpr int64_t kMaxBlocks = 65535;
  const bool batched = !kPeel && p.plan.row_batch == kRowBatch;
  const int64_t rows_per_block = int64_t(kThreads / kGroup) * (batched ? kRowBatch : 1);
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min(ceil_div(p.outer, rows_per_block), kMaxBlocks)));
  if constexpr (kGroup == 32 && kVec == vec_width<T>()) {
    if (deep_rows(p.reduce / kVec)) {
      if (p.plan.lane_rest == LaneRest::kBatch) {
        return void(sum_rows_deep_kernel<T, kVec, kPeel, kRestBatch><<<blocks, kThreads, 0, stream>>>(p));
      }
      return void(sum_rows_deep_kernel<T, kVec, kPeel, kRestSerial><<<blocks, kThreads, 0, stream>>>(p));
    }
  }
  if (batched) {
    return void(
        sum_rows_group_kernel<T, kVec, kGroup, kRowBatch, false, kRestSerial><<<blocks, kThreads, 0, stream>>>(p));
  }
  if constexpr (sizeof(T) == 2 && kVec == vec_width<T>()) {
    if (p.plan.lane_rest == LaneRest::kModFour) {
      return void(sum_rows_group_kernel<T, kVec, kGroup, 1, kPeel, kRestModFour><<<blocks, kThreads, 0, stream>>>(p));
    }
  }
  sum_rows_group_kernel<T, kVec, kGroup, 1, kPeel, kRestSerial><<<blocks, kThreads, 0, stream>>>(p);
}

// Short rows a lane group each, the group's lanes from the row's loads of kVec elements. Also
// unaligned 16-bit short rows as packs of 4 or 2 elements (SumPlan::row_pack): the plan batches
// their rows, so each lane group sums four rows at once.
template <class T, int kVec, bool kPeel>
void launch_row_groups(SumParams const& p, cudaStream_t stream) {
  switch (group_lanes(ceil_div(p.reduce, kVec))) {
    case 4: return launch_rows_group<T, kVec, 4, kPeel>(p, stream);
    case 8: return launch_rows_group<T, kVec, 8, kPeel>(p, stream);
    case 16: return launch_rows_group<T, kVec, 16, kPeel>(p, stream);
    default: return launch_rows_group<T, kVec, 32, kPeel>(p, stream);
  }
}

template <class T, int kVec, bool kPeel>
void launch_rows(SumParams const& p, cudaStream_t stream) {
  if (ceil_div(p.reduce, kVec) <= kMaxGroupVectors && p.plan.splits == 1) {
    return launch_row_groups<T, kVec, kPeel>(p, stream);
  }
  const int64_t chunk = ceil_div(p.reduce / kVec, p.plan.splits);
  const dim3 grid(unsigned(p.outer), unsigned(p.plan.splits));
  // The block size and the loads are plan_sum's (any block size sums any split correctly).
  auto launch = [&](auto once) {
    constexpr bool kOnce = decltype(once)::value;
    if (p.plan.row_threads == 4 * kThreads) {
      sum_rows_block_kernel<T, kVec, 4 * kThreads, kOnce, kPeel><<<grid, 4 * kThreads, 0, stream>>>(p, chunk);
    } else if (p.plan.row_threads == 2 * kThreads) {
      sum_rows_block_kernel<T, kVec, 2 * kThreads, kOnce, kPeel><<<grid, 2 * kThreads, 0, stream>>>(p, chunk);
    } else {
      sum_rows_block_kernel<T, kVec, kThreads, kOnce, kPeel><<<grid, kThreads, 0, stream>>>(p, chunk);
    }
  };
  if (p.plan.block_once) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

// ------------------------------------------------------------------------------------------------
// Column reductions (inner > 1): block (x = outer index * col_blocks + column block, y = split)
// sums rows [split * rows_per_split, ...) of its column chunk (blockDim.x threads of kVec adjacent
// elements each); thread rows add in a fixed order, then the block's rows in a fixed order.

template <class T, int kVec>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) sum_columns_kernel(SumParams p, int64_t col_blocks,
                                                                          int64_t rows_per_split) {
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t o = blockIdx.x / col_blocks;
  const int64_t col0 = (blockIdx.x % col_blocks) * tx * kVec;
  const int64_t col = col0 + threadIdx.x * kVec;
  const int64_t row0 = int64_t(blockIdx.y) * rows_per_split + threadIdx.y;
  const int64_t row_end = min(p.reduce, (int64_t(blockIdx.y) + 1) * rows_per_split);
  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
  if (col < p.inner && row0 < row_end) {
    // A pointer walk: 64-bit row arithmetic per load would cost registers that the launch bounds lack.
    const int64_t step = int64_t(ty) * p.reduce_stride;
    const T* in = static_cast<const T*>(p.input) + o * p.outer_stride + row0 * p.reduce_stride + col;
    int64_t n = (row_end - row0 + ty - 1) / ty;
    for (; n >= kColumnUnroll; n -= kColumnUnroll) {
      Pack<T, kVec> x[kColumnUnroll];
#pragma unroll
      for (int u = 0; u < kColumnUnroll; ++u) x[u] = load_pack_once<T, kVec>(in + u * step);
      in += kColumnUnroll * step;
#pragma unroll
      for (int u = 0; u < kColumnUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] += float(x[u].v[i]);
      }
    }
    // The last rows (fewer than kColumnUnroll) loaded together, predicated, then added in order:
    // loaded one after another's add they were a chain of round trips to memory.
    if (n > 0) {
      Pack<T, kVec> x[kColumnUnroll];
#pragma unroll
      for (int u = 0; u < kColumnUnroll; ++u) {
        if (u < n) x[u] = load_pack_once<T, kVec>(in + u * step);
      }
#pragma unroll
      for (int u = 0; u < kColumnUnroll; ++u) {
        if (u < n) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] += float(x[u].v[i]);
        }
      }
    }
  }
  if (p.plan.splits > 1) allow_dependent_launch();  // sum_partials may be scheduled
  const int width = tx * kVec;
  const float total = block_column_totals<kThreads, kVec>(acc);
  const int t = threadIdx.y * tx + threadIdx.x;
  if (t >= width || col0 + t >= p.inner) return;
  if (p.plan.splits == 1) {
    static_cast<T*>(p.output)[o * p.inner + col0 + t] = T(total);
  } else {
    p.partials[(o * p.plan.splits + blockIdx.y) * p.inner + col0 + t] = total;
  }
}

template <class T, int kVec>
void launch_columns(SumParams const& p, int col_threads, cudaStream_t stream) {
  const int64_t inner_vecs = ceil_div(p.inner, kVec);
  const int tx = column_threads(inner_vecs, col_threads);
  const dim3 block{unsigned(tx), unsigned(kThreads / tx)};
  const int64_t col_blocks = ceil_div(inner_vecs, tx);
  const int64_t rows_per_split = ceil_div(p.reduce, p.plan.splits);
  const dim3 grid{unsigned(col_blocks * p.outer), unsigned(p.plan.splits)};
  sum_columns_kernel<T, kVec><<<grid, block, 0, stream>>>(p, col_blocks, rows_per_split);
}

// The elements of the widest pack (up to 16 bytes) that every row's first element allows (inner == 1).
int row_pack_align(SumParams const& p, int elem_bytes) {
  return pack_elements(reinterpret_cast<uintptr_t>(p.input), p.outer_stride * elem_bytes, 0, 0, elem_bytes);
}

// The same for a column sum's loads: every row's first element and the row length.
int column_pack(SumParams const& p, int elem_bytes) {
  return pack_elements(reinterpret_cast<uintptr_t>(p.input), p.outer_stride * elem_bytes,
                       p.reduce_stride * elem_bytes, p.inner * elem_bytes, elem_bytes);
}

template <class T>
struct SumFn {
  void operator()(SumParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    if (p.inner == 1) {
      const int align = row_pack_align(p, int(sizeof(T)));
      // Rows off 16-byte boundaries read their heads an element at a time, then 16-byte vectors:
      // 1.04-2.86x over reading them an element at a time on an H200 (bf16 65536x500 2.86x,
      // 16384x3500 1.57x, 512x262140 1.25x; fp32 16384x1001 1.21x; bench/NOTES.md section 65).
      // Its slower short rows then (bf16 1024x1020 0.78x, fp32 65536x130 0.94x) were made up by the
      // lane-rest rule and the tail loaded ahead (section 66).
      if (align >= kVec) return launch_rows<T, kVec, false>(p, stream);
      if constexpr (sizeof(T) == 2) {
        // The plan's packs, where the rows still allow them (a plan made for another pointer does not).
        if (p.plan.row_pack == 4 && align >= 4) return launch_row_groups<T, 4, false>(p, stream);
        if (p.plan.row_pack == 2 && align >= 2) return launch_row_groups<T, 2, false>(p, stream);
      }
      return launch_rows<T, kVec, true>(p, stream);
    }
    // 16-byte loads, else 8-byte ones (bf16 16384x1500: rows 3000 bytes apart), else 4-byte ones
    // (16-bit types), else an element a thread, as the plan chose them (column_vec) and the pointer
    // still allows.
    const int vec = column_vec(column_pack(p, int(sizeof(T))), kVec);
    if (vec == kVec) return launch_columns<T, kVec>(p, p.plan.col_threads, stream);
    if (vec == kVec / 2) return launch_columns<T, kVec / 2>(p, p.plan.col_threads, stream);
    if constexpr (kVec / 4 > 1) {
      if (vec == kVec / 4) return launch_columns<T, kVec / 4>(p, p.plan.col_threads, stream);
    }
    launch_columns<T, 1>(p, kMaxColumnThreads, stream);  // one element a thread: keep warps' rows wide
  }
};

// ------------------------------------------------------------------------------------------------
// Second stage. Vector form (inner a multiple of 4): block (q float4 columns, kThreads / q split
// lanes); lane l adds splits l, l + lanes, ... in order, then the lanes are added in order.
// Scalar form otherwise: block (tx inner elements, ty split lanes), the same order. The lanes are
// as many as one round of loads needs (partials_lanes, common/sum_plan.h). Each is
// launched as a programmatic dependent of the kernel that wrote the partials (dependent_launch.h).

struct PartialsParams {
  const float* partials;
  int64_t outer, inner;
  int splits;
  DType dtype;
  void* out;
};

template <class T>
__global__ void __launch_bounds__(kThreads) sum_partials_vec_kernel(PartialsParams p, int64_t col_blocks) {
  const int q = blockDim.x, lanes = blockDim.y;
  const int64_t o = blockIdx.x / col_blocks;
  const int64_t col0 = (blockIdx.x % col_blocks) * q * 4;
  const int64_t col = col0 + threadIdx.x * 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  wait_for_prior_grid();
  if (col < p.inner) {
    const float* src = p.partials + o * p.splits * p.inner + col;
    // kPartialsLoads of the lane's splits loaded at once (those past the end not at all), then added
    // in order: one memory round trip for up to kPartialsLoads * lanes splits.
    for (int s = threadIdx.y; s < p.splits; s += kPartialsLoads * lanes) {
      float4 v[kPartialsLoads];
#pragma unroll
      for (int u = 0; u < kPartialsLoads; ++u) {
        if (s + u * lanes < p.splits) v[u] = *reinterpret_cast<const float4*>(src + int64_t(s + u * lanes) * p.inner);
      }
#pragma unroll
      for (int u = 0; u < kPartialsLoads; ++u) {
        if (s + u * lanes < p.splits) {
          acc[0] += v[u].x; acc[1] += v[u].y; acc[2] += v[u].z; acc[3] += v[u].w;
        }
      }
    }
  }
  const int width = q * 4;
  const float total = block_column_totals<kThreads, 4>(acc);
  const int t = threadIdx.y * q + threadIdx.x;
  if (t < width && col0 + t < p.inner) static_cast<T*>(p.out)[o * p.inner + col0 + t] = T(total);
}

template <class T>
__global__ void __launch_bounds__(kMaxPartialsThreads) sum_partials_kernel(PartialsParams p, int64_t col_blocks) {
  __shared__ float sums[kMaxPartialsThreads];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t o = blockIdx.x / col_blocks;
  const int64_t col = (blockIdx.x % col_blocks) * tx + threadIdx.x;
  float acc = 0.f;
  wait_for_prior_grid();
  if (col < p.inner) {
    const float* src = p.partials + o * p.splits * p.inner + col;
    // kPartialsLoads of the lane's splits loaded at once (those past the end not at all), then added
    // in order.
    for (int s = threadIdx.y; s < p.splits; s += kPartialsLoads * ty) {
      float v[kPartialsLoads];
#pragma unroll
      for (int u = 0; u < kPartialsLoads; ++u) {
        if (s + u * ty < p.splits) v[u] = src[int64_t(s + u * ty) * p.inner];
      }
#pragma unroll
      for (int u = 0; u < kPartialsLoads; ++u) {
        if (s + u * ty < p.splits) acc += v[u];
      }
    }
  }
  sums[threadIdx.y * tx + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= p.inner) return;
  float total = 0.f;
  for (int y = 0; y < ty; ++y) total += sums[y * tx + threadIdx.x];
  static_cast<T*>(p.out)[o * p.inner + col] = T(total);
}

// Few splits over many columns (a K-sliced GEMM's 2-16 partial products of a wide output): one
// thread a float4 column, adding the splits in order; the split lanes above would idle there.
template <class T>
__global__ void __launch_bounds__(kThreads) sum_partials_few_kernel(PartialsParams p) {
  const int64_t vecs = p.inner / 4;
  const int64_t o = blockIdx.y;
  wait_for_prior_grid();
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vecs; v += int64_t(gridDim.x) * kThreads) {
    const float* src = p.partials + o * p.splits * p.inner + v * 4;
    float4 acc = *reinterpret_cast<const float4*>(src);
#pragma unroll 4
    for (int s = 1; s < p.splits; ++s) {
      const float4 x = *reinterpret_cast<const float4*>(src + int64_t(s) * p.inner);
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    T* out = static_cast<T*>(p.out) + o * p.inner + v * 4;
    out[0] = T(acc.x); out[1] = T(acc.y); out[2] = T(acc.z); out[3] = T(acc.w);
  }
}
constexpr int kFewPartialsMaxSplits = 16;
constexpr int64_t kFewPartialsMinVecs = 64 * kThreads;

template <class T>
struct PartialsFn {
  void operator()(PartialsParams const& p, cudaStream_t stream) const {
    if (p.inner % 4 == 0 && aligned16(p.partials) && p.splits <= kFewPartialsMaxSplits &&
        p.inner / 4 >= kFewPartialsMinVecs && p.outer <= 65535) {
      const int64_t blocks = std::min<int64_t>(ceil_div(p.inner / 4, kThreads), 65535);
      launch_dependent(sum_partials_few_kernel<T>, dim3(unsigned(blocks), unsigned(p.outer)), dim3(kThreads), stream, p);
      return;
    }
    if (p.inner % 4 == 0 && aligned16(p.partials)) {
      // Up to 16 float4 columns (64 floats, 256 bytes of each split's row) a block, the rest of its
      // threads split lanes, as many as one round of loads needs.
      const int q0 = int(std::min<int64_t>(16, pow2_at_least(p.inner / 4)));
      const int q = kThreads / partials_lanes(p.splits, kThreads / q0, kThreads);
      const int64_t col_blocks = ceil_div(p.inner / 4, q);
      launch_dependent(sum_partials_vec_kernel<T>, dim3(unsigned(col_blocks * p.outer)),
                       dim3(unsigned(q), unsigned(kThreads / q)), stream, p, col_blocks);
      return;
    }
    const int tx = int(std::min<int64_t>(32, pow2_at_least(p.inner)));
    const int64_t col_blocks = ceil_div(p.inner, tx);
    const int lanes = partials_lanes(p.splits, kThreads / tx, kMaxPartialsThreads / tx);
    launch_dependent(sum_partials_kernel<T>, dim3(unsigned(col_blocks * p.outer)), dim3(unsigned(tx), unsigned(lanes)),
                     stream, p, col_blocks);
  }
};

}  // namespace

void plan_sum(SumParams& p, int sm_count, int64_t l2_bytes) {
  const int elem_bytes = p.dtype == DType::kF32 ? 4 : 2;
  const int full = 16 / elem_bytes;
  const int vec = p.inner == 1 ? full : column_vec(column_pack(p, elem_bytes), full);
  p.plan = plan_sum_shape(p.outer, p.reduce, p.inner, vec, full, sm_count, l2_bytes, row_pack_align(p, elem_bytes));
}

LaunchResult sum(SumParams const& p, cudaStream_t stream) {
  if (p.outer == 0 || p.inner == 0 || p.reduce == 0) return {};
  const LaunchResult r = dispatch_dtype<SumFn>(p, stream);
  if (!r.ok() || p.plan.splits == 1) return r;
  return sum_partials(p.partials, p.outer, p.plan.splits, p.inner, p.dtype, p.output, stream);
}

LaunchResult sum_partials(const float* partials, int64_t outer, int splits, int64_t inner, DType dtype, void* out,
                          cudaStream_t stream) {
  if (outer == 0 || inner == 0) return {};
  return dispatch_dtype<PartialsFn>(PartialsParams{partials, outer, inner, splits, dtype, out}, stream);
}

}  // namespace cutlass_ext
