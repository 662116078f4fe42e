// Weight gradients of narrow fp32 layers on the FMA units, hand-written:
//   D = alpha * A B with A M-major and B N-major (dW = dZ^T X of row-major dZ and X) and
//   min(M, N) <= 16, summed over a long K (the rows of a batch); exact fp32.
// Such a product is a reduction over rows: out[w, j] = sum_k X[k, w] Q[k, j], where X is the
// operand with the wide side (w < W) and Q the one with the narrow side (j < J <= 16), both
// read along their rows. TF32 tensor-core tiles need K-major operands, so CUTLASS transposes such
// operands in registers, and a 16-wide tile over K = 2048 (13 -> 512, dW) took 40 us on an H200
// where its bytes take 2. Here each thread owns one column w of X and all J sums of it: per row
// it reads one X element (a warp's reads are one contiguous row piece) and the row's J values of
// Q, which the block stages in shared memory for every thread. Blocks take a slice of the rows
// each; their fp32 partial sums are added in a fixed order by sum_partials (deterministic).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "elementwise/reduce_kernels.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext::wgrad {

constexpr int kMaxJ = 16;   // narrow side
constexpr int kRows = 32;   // rows a block stages at a time (X values in flight per thread)
constexpr int kMaxThreads = 256;

struct Args {
  const float* x;  // X[k, w] at x + k * ldx + w
  const float* q;  // Q[k, j] at q + k * ldq + j
  int64_t ldx, ldq;
  int K, W, J;
  int rows_per_slice;
  float alpha;
  float* out;  // slice s's out[w, j] at out + s * slice_stride + w * stride_w + j * stride_j
  int64_t slice_stride, stride_w, stride_j;
};

// A template (of the element type, fp32) like every kernel of the library: each generated unit that
// includes this header instantiates it, and the linker keeps one copy.
template <class T>
__global__ void __launch_bounds__(kMaxThreads) wgrad_gemm_kernel(Args a) {
  __shared__ __align__(16) float q_rows[kRows][kMaxJ];
  const int w = int(blockIdx.x) * blockDim.x + int(threadIdx.x);
  const int k_begin = int(blockIdx.y) * a.rows_per_slice;
  const int k_end = min(k_begin + a.rows_per_slice, a.K);
  const bool active = w < a.W;
  float acc[kMaxJ] = {};
  for (int k0 = k_begin; k0 < k_end; k0 += kRows) {
    const int rows = min(kRows, k_end - k0);
    float xv[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) xv[r] = (active && r < rows) ? a.x[int64_t(k0 + r) * a.ldx + w] : 0.f;
    __syncthreads();  // every thread is done with the previous chunk's rows of Q
    for (int i = threadIdx.x; i < kRows * kMaxJ; i += blockDim.x) {
      const int r = i / kMaxJ, j = i % kMaxJ;
      q_rows[r][j] = (r < rows && j < a.J) ? a.q[int64_t(k0 + r) * a.ldq + j] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4* qr = reinterpret_cast<const float4*>(q_rows[r]);
#pragma unroll
      for (int c = 0; c < kMaxJ / 4; ++c) {
        const float4 qv = qr[c];
        acc[4 * c + 0] = fmaf(xv[r], qv.x, acc[4 * c + 0]);
        acc[4 * c + 1] = fmaf(xv[r], qv.y, acc[4 * c + 1]);
        acc[4 * c + 2] = fmaf(xv[r], qv.z, acc[4 * c + 2]);
        acc[4 * c + 3] = fmaf(xv[r], qv.w, acc[4 * c + 3]);
      }
    }
  }
  if (!active) return;
  float* out = a.out + int64_t(blockIdx.y) * a.slice_stride + int64_t(w) * a.stride_w;
#pragma unroll
  for (int j = 0; j < kMaxJ; ++j) {
    if (j < a.J) out[j * a.stride_j] = a.alpha * acc[j];
  }
}

// Grid: blocks of up to 256 threads across W, and slices of whole kRows-row chunks so that about
// kBlocksPerSm blocks per SM run; each slice's partial sums are W * J floats.
struct Plan {
  int threads, tiles_w, slices, rows_per_slice;
};
constexpr int kBlocksPerSm = 4;

inline Plan plan_for(int64_t K, int64_t W, int sm_count) {
  Plan plan;
  plan.threads = int(std::min<int64_t>(kMaxThreads, (W + 31) / 32 * 32));
  plan.tiles_w = int((W + plan.threads - 1) / plan.threads);
  const int64_t chunks = (K + kRows - 1) / kRows;
  const int64_t wanted = std::max<int64_t>(1, int64_t(std::max(sm_count, 1)) * kBlocksPerSm / plan.tiles_w);
  const int64_t slices = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(chunks, 1));
  const int64_t chunks_per_slice = (chunks + slices - 1) / slices;
  plan.rows_per_slice = int(chunks_per_slice * kRows);
  plan.slices = int((K + plan.rows_per_slice - 1) / plan.rows_per_slice);
  return plan;
}

template <class Element>
struct GemmBundle {
  static_assert(sizeof(Element) == 4, "the narrow weight-gradient kernel multiplies fp32");

  // The narrow side: N (Q = B, out[w, j] = D[w, j]) when N <= 16, else M (Q = A^T, out = D^T).
  static bool narrow_n(GemmParams const& p) { return p.N <= kMaxJ; }

  static size_t workspace_size(GemmParams const& p) {
    const int64_t W = narrow_n(p) ? p.M : p.N;
    const Plan plan = plan_for(p.K, W, p.sm_count);
    return plan.slices > 1 ? size_t(plan.slices) * size_t(p.M) * size_t(p.N) * sizeof(float) : 0;
  }

  static LaunchResult run(GemmParams const& p, void* workspace, cudaStream_t stream) {
    if (p.C != nullptr || p.bias != nullptr || p.aux != nullptr || p.activation != 0 || p.L != 1) {
      return {"can_implement", "the narrow weight-gradient kernel computes plain products (no C, bias, activation, "
                               "aux output or batch)"};
    }
    if (p.a_stride_m != 1 && p.M > 1) return {"can_implement", "the narrow weight-gradient kernel needs an M-major A"};
    if (p.b_stride_n != 1 && p.N > 1) return {"can_implement", "the narrow weight-gradient kernel needs an N-major B"};
    if (std::min(p.M, p.N) > kMaxJ) return {"can_implement", "the narrow weight-gradient kernel takes M or N <= 16"};
    if (p.d_stride_m != p.N && p.M > 1) return {"can_implement", "the narrow weight-gradient kernel writes a contiguous D"};
    if (p.M == 0 || p.N == 0) return {};
    const bool n_narrow = narrow_n(p);
    Args a;
    a.x = static_cast<const float*>(n_narrow ? p.A : p.B);
    a.q = static_cast<const float*>(n_narrow ? p.B : p.A);
    a.ldx = n_narrow ? p.a_stride_k : p.b_stride_k;
    a.ldq = n_narrow ? p.b_stride_k : p.a_stride_k;
    a.K = p.K;
    a.W = n_narrow ? p.M : p.N;
    a.J = n_narrow ? p.N : p.M;
    a.alpha = p.alpha;
    a.stride_w = n_narrow ? p.N : 1;
    a.stride_j = n_narrow ? 1 : p.N;
    a.slice_stride = int64_t(p.M) * p.N;
    if (p.K == 0) return {"can_implement", "the narrow weight-gradient kernel needs K >= 1"};
    const Plan plan = plan_for(p.K, a.W, p.sm_count);
    a.rows_per_slice = plan.rows_per_slice;
    const bool partials = plan.slices > 1;
    if (partials && workspace == nullptr) return {"can_implement", "the narrow weight-gradient kernel needs its workspace"};
    a.out = partials ? static_cast<float*>(workspace) : static_cast<float*>(p.D);
    const dim3 grid(unsigned(plan.tiles_w), unsigned(plan.slices));
    wgrad_gemm_kernel<Element><<<grid, plan.threads, 0, stream>>>(a);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    if (partials) return sum_partials(static_cast<float*>(workspace), 1, plan.slices, int64_t(p.M) * p.N, DType::kF32, p.D, stream);
    return {};
  }
};

}  // namespace cutlass_ext::wgrad
