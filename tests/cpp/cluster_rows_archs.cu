// Compiled for every target arch by tests/test_build.py: the row-cluster helpers call Hopper-only
// cluster intrinsics behind arch guards, and the units that include them must still build for
// sm_80 (CUTLASS_EXT_ARCH=80), where the cluster kernels are never launched.
#include "common/cluster_rows.cuh"

namespace {

__global__ void cluster_rows_kernel(float* out, int64_t cols, int slice) {
  const cutlass_ext::RowSlice part = cutlass_ext::cluster_slice(cols, slice);
  __shared__ float slot;
  const float total = cutlass_ext::cluster_butterfly(cutlass_ext::cluster_gather(float(part.n), &slot, 0.f),
                                                     [](float a, float b) { return a + b; });
  if (threadIdx.x == 0) out[cutlass_ext::cluster_row()] = total;
  cutlass_ext::cluster_release();
}

}  // namespace

bool launch_cluster_rows_kernel(float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const int ranks = cutlass_ext::row_cluster_ranks(cols * 4, cutlass_ext::shared_budget_bytes(device), device);
  return ranks > 1 && cutlass_ext::launch_row_clusters(cluster_rows_kernel, rows, ranks, 128, 0, stream, out, cols,
                                                       cutlass_ext::row_cluster_slice(cols, ranks, 4));
}
