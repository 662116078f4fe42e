// Column sums over a block's thread rows, shared by the column reductions (reduce_kernels.cu) and
// act_grad's bias gradient (activation_kernels.cu): a block of (tx, ty) threads, tx across columns
// (kVec adjacent columns each), ty across rows, each thread holding the sums of its rows.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/device_utils.cuh"
#include "common/sum_plan.h"  // column_threads

namespace cutlass_ext {

// Adds the block's thread rows: sums[y * width + c] for y = 0 .. ty-1 and columns c < width, in a
// fixed order using all kThreads threads: lane l adds rows l, l + lanes, ... (lanes = kThreads /
// width), then the lanes are added pairwise (l and l + half for half = lanes / 2, ..., 1). Thread
// c < width returns its column's total; `scratch` holds kThreads floats. width is a power of two
// <= kThreads. Every thread of the block must call it.
template <int kThreads>
__device__ __forceinline__ float add_thread_rows(const float* sums, float* scratch, int width, int ty) {
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int lanes = kThreads / width;
  const int c = t % width, l = t / width;
  float s = 0.f;
  for (int y = l; y < ty; y += lanes) s += sums[y * width + c];
  if (lanes == 1) return s;
  scratch[l * width + c] = s;
  for (int half = lanes / 2; half > 0; half /= 2) {
    __syncthreads();
    if (l < half) scratch[l * width + c] += scratch[(l + half) * width + c];
  }
  __syncthreads();
  return t < width ? scratch[t] : 0.f;
}

// The block's column totals: each thread's kVec column sums (threadIdx.x * kVec + i, its rows
// threadIdx.y) go to shared memory, then add_thread_rows adds the blockDim.y thread rows. Thread
// t < blockDim.x * kVec returns column t's total. Every thread of the block must call it.
template <int kThreads, int kVec>
__device__ __forceinline__ float block_column_totals(const float (&acc)[kVec]) {
  __shared__ float sums[kThreads * kVec];
  __shared__ float scratch[kThreads];
  const int width = blockDim.x * kVec;
#pragma unroll
  for (int i = 0; i < kVec; ++i) sums[threadIdx.y * width + threadIdx.x * kVec + i] = acc[i];
  __syncthreads();
  return add_thread_rows<kThreads>(sums, scratch, width, blockDim.y);
}

}  // namespace cutlass_ext
