// Plain parameter structs between the host binding and the GEMM kernel translation units.
// Torch-free and CUTLASS-free, so the binding never sees a CUTLASS template.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

// How an fp32 GEMM multiplies: on tensor cores in TF32, or exactly on the FMA units.
enum class MathMode : int { kTensorOp = 0, kExactF32 = 1 };

// D[l, m, n] = act(alpha * sum_k A[l, m, k] * B[l, k, n] + beta * C[l, m, n] + bias[n]);
// optionally Aux[l, m, n] = the pre-activation value. C is read only by kernels with a source
// epilogue and may be D itself. Extended-K kernels add sum_k2 A2[l, m, k2] * B2[l, k2, n] to
// the product (A2 and B2 with A's and B's majorness). All strides are in elements; the innermost
// stride of C, D and Aux is 1.
struct GemmParams {
  int M = 0, N = 0, K = 0, L = 1;
  const void* A = nullptr;
  int64_t a_stride_m = 0, a_stride_k = 0, a_stride_l = 0;
  const void* B = nullptr;
  int64_t b_stride_k = 0, b_stride_n = 0, b_stride_l = 0;
  int K2 = 0;  // depth of the second operand pair (extended-K kernels only)
  const void* A2 = nullptr;
  int64_t a2_stride_m = 0, a2_stride_k = 0, a2_stride_l = 0;
  const void* B2 = nullptr;
  int64_t b2_stride_k = 0, b2_stride_n = 0, b2_stride_l = 0;
  void* D = nullptr;
  // Stride between D's lines (rows; columns for kernels that compute the transposed product).
  int64_t d_stride_m = 0, d_stride_l = 0;
  const void* C = nullptr;  // read only by kernels with a source epilogue
  int64_t c_stride_m = 0, c_stride_l = 0;
  const void* bias = nullptr;  // [N], same dtype as D; nullptr for no bias
  void* aux = nullptr;         // written only by kernels with an aux epilogue
  int64_t aux_stride_m = 0, aux_stride_l = 0;
  int activation = 0;  // cutlass_ext::Activation
  float alpha = 1.f;
  float beta = 0.f;
  int device = 0;
  int sm_count = 0;
  // Stream-K configs (set by the binding): the split-K factor, 1 for data-parallel tiles, or 0
  // for CUTLASS's stream-K decomposition (the last partial wave's K loops spread over every SM).
  int splits = 1;
  int swizzle = 1;  // tile-rasterization swizzle (1, 2, 4 or 8): tiles that share operands run together
  // Tile order of the persistent scheduler: 0 CUTLASS's heuristic (along N unless the product has
  // more column tiles than row tiles), 1 along M, 2 along N.
  int raster = 0;
  // Clusters of the kernel that fit on the device at once (its entry's active_clusters), or 0
  // when it does not run in clusters of more than one CTA: the persistent grid is sized to them.
  int max_active_clusters = 0;
  // Launch as a programmatic dependent of the kernel before it on the stream, so that its launch
  // and set-up overlap that kernel's end. Honoured only by kernels that wait for the prior grid
  // before they read what it writes (CUTLASS's sm90 kernels at their start; the extended-K ones
  // before their second operand pair, so only where the kernel before writes just that pair);
  // others launch the usual way (gemm/launcher.cuh).
  bool dependent_launch = false;
};


// Operand layouts, named for the GEMM's reduction dimension K:
// A is K-major when A[m, k] is contiguous in k (a row-major [M, K] tensor), else M-major;
// B is K-major when B[k, n] is contiguous in k (the transpose of a row-major [N, K] weight),
// else N-major (a row-major [K, N] tensor).
enum class Major : int { kK = 0, kMN = 1 };

using GemmWorkspaceFn = size_t (*)(GemmParams const&);
using GemmRunFn = LaunchResult (*)(GemmParams const&, void* workspace, cudaStream_t);
// Clusters of a kernel that fit on the current device at once (cudaOccupancyMaxActiveClusters,
// cached per device), or 0 for a kernel that does not run in clusters of more than one CTA.
using GemmActiveClustersFn = int (*)();

struct GemmKernelEntry {
  const char* name;
  DType dtype;
  MathMode math;
  Major a_major;
  Major b_major;
  bool aux;            // epilogue also stores the pre-activation
  bool source;         // epilogue adds beta * C
  int arch;            // GEMM path: 90 (CUTLASS 3.x, Hopper), 80 (CUTLASS 2.x: Ampere, and exact fp32) or 0 (both)
  const char* family;  // "sm90", "sm80", "simt", or hand-written: "lowk" (short K), "gemv" (few columns),
                       // "fewrows" (few rows, TF32), "ffma" (short K, fp32 on the FMA units) or "wgrad"
                       // (narrow fp32 weight gradients)
  const char* config;  // tile/cluster/schedule name, e.g. "128x256x64_2x1_coop"
  int tile_m, tile_n;
  int cluster_size;  // CTAs per cluster (1 for kernels without clusters)
  bool stream_k;
  bool transposed;  // computes D^T = B^T A^T: kernel M/N are the caller's N/M, D column-major
  bool ext_k;       // adds a second operand pair A2 @ B2 to the product
  // Writes fp32 partial products: batch entry l of D is the product over the l-th K slice (the
  // binding views A and B as L slices of K; no bias, no activation), which sum_partials adds.
  bool k_slices;
  // The epilogue is alpha * A B alone: for products without bias and activation, which take it
  // in place of the bias-and-activation kernel of the same config.
  bool plain;
  GemmWorkspaceFn workspace_size;
  GemmRunFn run;
  GemmActiveClustersFn active_clusters;
};

// The few-column kernel (gemm/gemv_gemm.cuh) stages B in shared memory as fp32, one 16-byte
// chunk of A's K (`vec` elements) at a time: a chunk holds vec rows of n_pow2 values (N rounded up
// to a power of two), padded so that its stride in 16-byte units is odd (the chunks that eight
// lanes read at once start in eight distinct bank groups). Both the kernel and the binding's
// choice use these.
constexpr int kGemvMaxN = 16;
constexpr int64_t kGemvMaxSharedBytes = 72 * 1024;
constexpr int gemv_chunk_stride(int vec, int n_pow2) {
  return (vec * n_pow2 / 4) % 2 == 0 ? vec * n_pow2 + 4 : vec * n_pow2;
}
constexpr int gemv_n_pow2(int64_t N) { return N <= 1 ? 1 : N <= 2 ? 2 : N <= 4 ? 4 : N <= 8 ? 8 : 16; }
constexpr int64_t gemv_shared_bytes(int64_t K, int64_t N, int element_bytes) {
  return (K + 16 / element_bytes - 1) / (16 / element_bytes) * gemv_chunk_stride(16 / element_bytes, gemv_n_pow2(N)) *
         int64_t(sizeof(float));
}

// The few-row kernel (gemm/fewrows_gemm.cuh) multiplies up to this many rows of A.
constexpr int kFewRowsMaxM = 16;

// Entry points of a hand-written kernel; `Bundle` provides workspace_size(p) and run(p, workspace,
// stream) (the CUTLASS instantiations use CUTLASS_EXT_DEFINE_GEMM of gemm/launcher.cuh).
#define CUTLASS_EXT_DEFINE_DIRECT_GEMM(NAME, BUNDLE)                                          \
  size_t NAME##_workspace_size(::cutlass_ext::GemmParams const& p) { return BUNDLE::workspace_size(p); } \
  ::cutlass_ext::LaunchResult NAME##_run(::cutlass_ext::GemmParams const& p, void* workspace,  \
                                         cudaStream_t stream) {                                \
    return BUNDLE::run(p, workspace, stream);                                                  \
  }                                                                                            \
  int NAME##_active_clusters() { return 0; }

// Defined in the generated registry translation unit.
extern const GemmKernelEntry kGemmKernels[];
extern const int kNumGemmKernels;

}  // namespace cutlass_ext
