#include "elementwise/reduce_kernels.h"

#include <algorithm>
#include <cstdint>

#include "common/device_utils.cuh"

namespace cutlass_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;           // grid target of the split decisions
constexpr int kUnroll = 4;                // loads per thread in flight together
constexpr int kMaxGroupVectors = 256;     // rows up to this many vectors: a group of lanes per row
constexpr int kMinChunkVectors = 2 * kThreads;  // smallest piece of a split row
constexpr int kMinRowsPerThread = 8;      // smallest share of a split column reduction per thread



template <class T, int kVec>
__device__ __forceinline__ float pack_sum(Pack<T, kVec> const& v) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) s += float(v.v[i]);
  return s;
}

// Threads across inner elements (each owns kVec of them) and across reduce rows, for 256 threads.
dim3 column_block(int64_t inner_vecs) {
  int tx = 1;
  while (tx < 32 && tx < inner_vecs) tx *= 2;
  return dim3(unsigned(tx), unsigned(kThreads / tx));
}

// ------------------------------------------------------------------------------------------------
// Row reductions (inner == 1): row `o` is input[o * outer_stride + (0 .. reduce-1)].

// Short rows: kGroup adjacent lanes per row, kThreads / kGroup rows per block, grid-stride over
// rows in whole warps (so every lane of a warp reaches the shuffles).
template <class T, int kVec, int kGroup>
__global__ void __launch_bounds__(kThreads) sum_rows_group_kernel(SumParams p) {
  constexpr int kRowsPerWarp = 32 / kGroup;
  const int lane = threadIdx.x % kGroup;
  const int64_t warp = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int64_t warp_step = int64_t(gridDim.x) * (kThreads / 32) * kRowsPerWarp;
  const int64_t vectors = p.reduce / kVec;
  const T* input = static_cast<const T*>(p.input);
  for (int64_t base = warp * kRowsPerWarp; base < p.outer; base += warp_step) {
    const int64_t row = base + (threadIdx.x % 32) / kGroup;
    float acc = 0.f;
    if (row < p.outer) {
      const T* in = input + row * p.outer_stride;
#pragma unroll 4
      for (int64_t v = lane; v < vectors; v += kGroup) acc += pack_sum<T, kVec>(load_pack<T, kVec>(in + v * kVec));
      for (int64_t e = vectors * kVec + lane; e < p.reduce; e += kGroup) acc += float(in[e]);
    }
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (row < p.outer && lane == 0) static_cast<T*>(p.output)[row] = T(acc);
  }
}

// Long rows: block (row, split) sums the split-th chunk of chunk_vectors vectors of its row; the
// tail elements (reduce % kVec) belong to the last split.
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads) sum_rows_block_kernel(SumParams p, int64_t chunk_vectors) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y;
  const T* in = static_cast<const T*>(p.input) + row * p.outer_stride;
  const int64_t vectors = p.reduce / kVec;
  const int64_t v_end = min(vectors, (split + 1) * chunk_vectors);
  float acc = 0.f;
  int64_t v = split * chunk_vectors + threadIdx.x;
  for (; v + (kUnroll - 1) * kThreads < v_end; v += kUnroll * kThreads) {
    Pack<T, kVec> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x[u] = load_pack<T, kVec>(in + (v + u * kThreads) * kVec);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc += pack_sum<T, kVec>(x[u]);
  }
  for (; v < v_end; v += kThreads) acc += pack_sum<T, kVec>(load_pack<T, kVec>(in + v * kVec));
  if (split == p.splits - 1) {
    for (int64_t e = vectors * kVec + threadIdx.x; e < p.reduce; e += kThreads) acc += float(in[e]);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x != 0) return;
  if (p.splits == 1) {
    static_cast<T*>(p.output)[row] = T(acc);
  } else {
    p.partials[row * p.splits + split] = acc;
  }
}

template <class T, int kVec, int kGroup>
void launch_rows_group(SumParams const& p, int sm_count_blocks, cudaStream_t stream) {
  const int64_t rows_per_block = kThreads / kGroup;
  const int64_t blocks = std::min<int64_t>(ceil_div(p.outer, rows_per_block), sm_count_blocks);
  sum_rows_group_kernel<T, kVec, kGroup><<<unsigned(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(p);
}

template <class T, int kVec>
void launch_rows(SumParams const& p, cudaStream_t stream) {
  const int64_t vectors = ceil_div(p.reduce, kVec);
  if (vectors <= kMaxGroupVectors && p.splits == 1) {
    // Enough warps to fill the GPU many times over; the grid-stride loop covers the rest.
    const int blocks = 65535;
    if (vectors <= 4) return launch_rows_group<T, kVec, 4>(p, blocks, stream);
    if (vectors <= 8) return launch_rows_group<T, kVec, 8>(p, blocks, stream);
    if (vectors <= 16) return launch_rows_group<T, kVec, 16>(p, blocks, stream);
    return launch_rows_group<T, kVec, 32>(p, blocks, stream);
  }
  const int64_t chunk = ceil_div(p.reduce / kVec, p.splits);
  sum_rows_block_kernel<T, kVec><<<dim3(unsigned(p.outer), unsigned(p.splits)), kThreads, 0, stream>>>(p, chunk);
}

// ------------------------------------------------------------------------------------------------
// Column reductions (inner > 1): block (x = outer index * col_blocks + column block, y = split)
// sums rows [split * rows_per_split, ...) of its column chunk; thread rows add in a fixed order.

template <class T, int kVec>
__global__ void __launch_bounds__(kThreads) sum_columns_kernel(SumParams p, int64_t col_blocks, int64_t rows_per_split) {
  __shared__ float sums[kThreads * kVec];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t o = blockIdx.x / col_blocks;
  const int64_t col = ((blockIdx.x % col_blocks) * tx + threadIdx.x) * kVec;
  const int64_t row_end = min(p.reduce, (int64_t(blockIdx.y) + 1) * rows_per_split);
  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
  if (col < p.inner) {
    const T* in = static_cast<const T*>(p.input) + o * p.outer_stride + col;
    int64_t r = int64_t(blockIdx.y) * rows_per_split + threadIdx.y;
    for (; r + (kUnroll - 1) * ty < row_end; r += kUnroll * ty) {
      Pack<T, kVec> x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = load_pack<T, kVec>(in + (r + u * ty) * p.reduce_stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] += float(x[u].v[i]);
      }
    }
    for (; r < row_end; r += ty) {
      const Pack<T, kVec> x = load_pack<T, kVec>(in + r * p.reduce_stride);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += float(x.v[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) sums[(threadIdx.y * kVec + i) * tx + threadIdx.x] = acc[i];
  __syncthreads();
  if (threadIdx.y != 0 || col >= p.inner) return;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    float total = 0.f;
    for (int y = 0; y < ty; ++y) total += sums[(y * kVec + i) * tx + threadIdx.x];
    if (p.splits == 1) {
      static_cast<T*>(p.output)[o * p.inner + col + i] = T(total);
    } else {
      p.partials[(o * p.splits + blockIdx.y) * p.inner + col + i] = total;
    }
  }
}

template <class T, int kVec>
void launch_columns(SumParams const& p, cudaStream_t stream) {
  const dim3 block = column_block(p.inner / kVec);
  const int64_t col_blocks = ceil_div(p.inner / kVec, block.x);
  const int64_t rows_per_split = ceil_div(p.reduce, p.splits);
  const dim3 grid{unsigned(col_blocks * p.outer), unsigned(p.splits)};
  sum_columns_kernel<T, kVec><<<grid, block, 0, stream>>>(p, col_blocks, rows_per_split);
}

template <class T>
struct SumFn {
  void operator()(SumParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    const bool aligned = aligned16(p.input) && p.outer_stride % kVec == 0;
    if (p.inner == 1) {
      if (aligned) return launch_rows<T, kVec>(p, stream);
      return launch_rows<T, 1>(p, stream);
    }
    if (aligned && p.inner % kVec == 0 && p.reduce_stride % kVec == 0) return launch_columns<T, kVec>(p, stream);
    launch_columns<T, 1>(p, stream);
  }
};

// ------------------------------------------------------------------------------------------------
// Second stage: block (tx inner elements, ty split lanes); lane y adds splits y, y + ty, ... in
// order, then thread row 0 adds the lanes in order.

struct PartialsParams {
  const float* partials;
  int64_t outer, inner;
  int splits;
  DType dtype;
  void* out;
};

template <class T>
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(PartialsParams p, int64_t col_blocks) {
  __shared__ float sums[kThreads];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t o = blockIdx.x / col_blocks;
  const int64_t col = (blockIdx.x % col_blocks) * tx + threadIdx.x;
  float acc = 0.f;
  if (col < p.inner) {
    const float* src = p.partials + o * p.splits * p.inner + col;
#pragma unroll 4
    for (int s = threadIdx.y; s < p.splits; s += ty) acc += src[int64_t(s) * p.inner];
  }
  sums[threadIdx.y * tx + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= p.inner) return;
  float total = 0.f;
  for (int y = 0; y < ty; ++y) total += sums[y * tx + threadIdx.x];
  static_cast<T*>(p.out)[o * p.inner + col] = T(total);
}

template <class T>
struct PartialsFn {
  void operator()(PartialsParams const& p, cudaStream_t stream) const {
    const dim3 block = column_block(p.inner);
    const int64_t col_blocks = ceil_div(p.inner, block.x);
    sum_partials_kernel<T><<<unsigned(col_blocks * p.outer), block, 0, stream>>>(p, col_blocks);
  }
};

}  // namespace

int sum_splits(int64_t outer, int64_t reduce, int64_t inner, DType dtype, int sm_count) {
  const int64_t vec = dtype == DType::kF32 ? 4 : 8;
  const int64_t target = int64_t(kBlocksPerSm) * std::max(sm_count, 1);
  int64_t splits = 1;
  if (inner == 1) {
    const int64_t vectors = reduce / vec;
    if (vectors > kMaxGroupVectors && outer < target) {
      splits = std::min(ceil_div(target, outer), vectors / kMinChunkVectors);
    }
  } else {
    const dim3 block = column_block(ceil_div(inner, vec));
    const int64_t blocks = ceil_div(ceil_div(inner, vec), block.x) * outer;
    if (blocks < target) {
      splits = std::min(ceil_div(target, blocks), reduce / (int64_t(block.y) * kMinRowsPerThread));
    }
  }
  return int(std::max<int64_t>(1, std::min<int64_t>(splits, 65535)));
}

LaunchResult sum(SumParams const& p, cudaStream_t stream) {
  if (p.outer == 0 || p.inner == 0 || p.reduce == 0) return {};
  const LaunchResult r = dispatch_dtype<SumFn>(p, stream);
  if (!r.ok() || p.splits == 1) return r;
  return sum_partials(p.partials, p.outer, p.splits, p.inner, p.dtype, p.output, stream);
}

LaunchResult sum_partials(const float* partials, int64_t outer, int splits, int64_t inner, DType dtype, void* out,
                          cudaStream_t stream) {
  if (outer == 0 || inner == 0) return {};
  return dispatch_dtype<PartialsFn>(PartialsParams{partials, outer, inner, splits, dtype, out}, stream);
}

}  // namespace cutlass_ext
