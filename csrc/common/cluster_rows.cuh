// Rows split over the CTAs of a thread-block cluster (Hopper, sm_90). A row longer than one CTA's
// shared memory (or long enough that one CTA per SM would leave no row in flight while it writes)
// is cut into `ranks` slices, one per CTA of a cluster; each CTA copies its slice into its own
// shared memory, so the row is read from memory once, and the CTAs exchange their partial
// statistics through distributed shared memory. Torch-free, CUDA only.
//
// Device side: cluster_slice() says which columns this CTA holds; cluster_gather() hands every
// rank's partial to the lanes of every warp and cluster_butterfly() combines them, so all CTAs of
// a cluster get the same bits; cluster_release() must follow before the CTA exits (a CTA's shared
// memory has to outlive the other ranks' reads of it). Host side: row_cluster_ranks() picks the
// cluster size, launch_row_clusters() launches one cluster per row.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/device_utils.cuh"

namespace cutlass_ext {

// The largest cluster: the portable limit. Hopper allows 16 CTAs where a kernel opts in, but 16
// slices of 32 KB measured slower than 8 of 64 KB (bench/NOTES.md section 28), and 16 slices of
// 64 KB 1.03-1.16x slower than 8 spilled ones for layer_norm's 1-4 MB rows (section 63).
constexpr int kMaxRowClusterRanks = 8;
static_assert((kMaxRowClusterRanks & (kMaxRowClusterRanks - 1)) == 0 && kMaxRowClusterRanks <= 32,
              "cluster_gather hands the ranks to the lanes of a warp");
// A CTA's slice of a row is kept to this many bytes: three CTAs fit an SM's 227 KB, so one can
// copy its next row in while the others compute and write. With one 128 KB row per CTA, one CTA
// per SM, the SM's loads stop while it writes. 32 KB slices measured slower.
constexpr int64_t kRowClusterSliceBytes = 64 * 1024;

struct RowSlice {
  int begin, n;  // columns [begin, begin + n) of the row
};

// This CTA's slice: `slice` columns per rank (a multiple of the vector width), the last rank's
// shorter (possibly empty).
__device__ __forceinline__ RowSlice cluster_slice(int64_t cols, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int begin = int(cooperative_groups::this_cluster().block_rank()) * slice;
  return {begin, max(0, min(slice, int(cols) - begin))};
#else
  __trap();
  return {0, 0};
#endif
}

// The row this CTA works on: clusters are consecutive blocks along x, one cluster per row.
__device__ __forceinline__ int64_t cluster_row() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int64_t(blockIdx.x) / cooperative_groups::this_cluster().num_blocks();
#else
  __trap();
  return 0;
#endif
}

// Every rank's `mine` (as passed by that rank's thread 0) to every warp: lane l gets rank
// (l mod kMaxRowClusterRanks)'s value, or `none` where the cluster has fewer ranks, so that
// cluster_butterfly() can combine them in registers. One remote load a lane, all in flight at
// once: a rank-order fold in every thread (a dependent remote load and a merge a rank) took 13%
// of the layer_norm forward's instructions at eight ranks, and its latency sat before the
// normalize pass (bench/NOTES.md section 52). `slot` is a __shared__ V of the kernel. Every thread of the
// CTA must call it, once per kernel, and call cluster_release() later.
template <class V>
__device__ __forceinline__ V cluster_gather(V mine, V* slot, V none) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) *slot = mine;
  cluster.sync();  // release/acquire: every rank's slot is written and visible
  const int rank = int(threadIdx.x) & (kMaxRowClusterRanks - 1);
  const V v = rank < int(cluster.num_blocks()) ? *cluster.map_shared_rank(slot, rank) : none;
  cluster.barrier_arrive();  // this CTA is done reading the others' slots
  return v;
#else
  __trap();
  return none;
#endif
}

__device__ __forceinline__ float shuffle_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ float2 shuffle_xor(float2 v, int mask) {
  return make_float2(shuffle_xor(v.x, mask), shuffle_xor(v.y, mask));
}

// cluster_gather's values combined over each group of kMaxRowClusterRanks lanes, pairs of lanes
// then pairs of pairs (a butterfly). With a commutative `combine` (combine(a, b) and
// combine(b, a) the same bits, as float addition and fmaxf are), every lane of every warp of every
// rank ends with the same bits.
template <class V, class Combine>
__device__ __forceinline__ V cluster_butterfly(V v, Combine combine) {
#pragma unroll
  for (int mask = kMaxRowClusterRanks / 2; mask > 0; mask >>= 1) v = combine(v, shuffle_xor(v, mask));
  return v;
}

// Waits until every rank has read this CTA's slot (see cluster_gather).
__device__ __forceinline__ void cluster_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().barrier_wait();
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side

// The dynamic shared memory one CTA of the row kernels may take on `device`.
inline int64_t shared_budget_bytes(int device) {
  return int64_t(max_dynamic_shared_bytes(device)) - kSharedRowReserve;
}

// Whether `device` launches clusters (sm_90 and later), read once per device.
inline bool device_has_clusters(int device) {
  static std::array<std::atomic<int>, 64> cache{};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= int(cache.size())) return false;
  int state = cache[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int yes = 0;
    if (cudaDeviceGetAttribute(&yes, cudaDevAttrClusterLaunch, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    state = yes ? 2 : 1;
    cache[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

// The largest cluster a row may take: CUTLASS_EXT_ROW_CLUSTER (1, 2, 4 or 8; 1 keeps every row in
// one CTA), default (and for any other value) 8. Read on every call, so that a process can
// compare the paths.
inline int max_row_cluster_ranks() {
  const char* v = std::getenv("CUTLASS_EXT_ROW_CLUSTER");
  if (v == nullptr || *v == '\0') return kMaxRowClusterRanks;
  if (std::strcmp(v, "1") == 0) return 1;
  if (std::strcmp(v, "2") == 0) return 2;
  if (std::strcmp(v, "4") == 0) return 4;
  return kMaxRowClusterRanks;
}

// The most CTAs a row may take on `device` (1 where it has no clusters).
inline int row_cluster_limit(int device) { return device_has_clusters(device) ? max_row_cluster_ranks() : 1; }

// How many CTAs share a row of `row_bytes` (for every buffer a CTA holds per column): 1 (no
// cluster) for rows of at most kRowClusterSliceBytes, else the fewest ranks whose slices stay
// within it, or the most ranks if their slices still fit `budget` bytes of shared memory; 0 when
// not even those fit.
inline int row_cluster_ranks(int64_t row_bytes, int64_t budget, int device) {
  if (row_bytes <= kRowClusterSliceBytes) return 1;
  const int most = row_cluster_limit(device);
  for (int r = 2; r <= most; r *= 2) {
    if (ceil_div(row_bytes, r) <= kRowClusterSliceBytes) return r;
  }
  if (ceil_div(row_bytes, most) + 16 * most <= budget) return most;  // + each slice's rounding
  return 0;
}

// Columns per rank: cols split `ranks` ways, rounded up to a multiple of `vec`.
inline int row_cluster_slice(int64_t cols, int ranks, int vec) {
  return int(ceil_div(ceil_div(cols, ranks), vec) * vec);
}

// Launches `kernel` with one cluster of `ranks` CTAs per row (grid rows * ranks); false, with the
// error cleared, where the launch is refused.
template <class... Params, class... Args>
bool launch_row_clusters(void (*kernel)(Params...), int64_t rows, int ranks, int threads, size_t smem,
                         cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(rows * ranks));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(ranks);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  if (cudaLaunchKernelEx(&config, kernel, Params(args)...) == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

}  // namespace cutlass_ext
