// Weight gradients of narrow fp32 layers on the FMA units, hand-written:
//   D = alpha * A B with A M-major and B N-major (dW = dZ^T X of row-major dZ and X) and
//   min(M, N) <= 16, summed over a long K (the rows of a batch); exact fp32.
// Such a product is a reduction over rows: out[w, j] = sum_k X[k, w] Q[k, j], where X is the
// operand with the wide side (w < W) and Q the one with the narrow side (j < J <= 16), both
// read along their rows. TF32 tensor-core tiles need K-major operands, so CUTLASS transposes such
// operands in registers, and a 16-wide tile over K = 2048 (13 -> 512, dW) took 40 us on an H200
// where its bytes take 2.
//
// Here a block owns 128 columns of X, four adjacent ones a lane, and a slice of the rows; each of
// its warps takes every nw-th 4-row chunk of the slice and keeps the J sums of its lane's four
// columns (64 registers). A warp copies its chunks of X (a warp's copy of a row is one contiguous
// 512-byte piece) and of Q into its own ring of shared-memory stages with cp.async, kStages - 1
// chunks ahead of the one it multiplies. Per row a lane reads its four X values and the row's J
// values of Q (the same for every lane) from shared memory for 4 J multiply-adds. With one column
// a lane (one 16-byte read of Q per 4 multiply-adds) the kernel ran 3-5x slower than its bytes
// allow, which a count of those reads at four shared-memory cycles each explains (bench/NOTES.md
// section 38); four columns a lane ran the 65536-row dW of a 13 -> 512 layer at 3.4 TB/s. At the
// end the warps' sums are added in the block in warp order, and each slice writes a partial
// product that sum_partials adds in slice order (the result does not depend on timing).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "common/device_utils.cuh"
#include "elementwise/reduce_kernels.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext::wgrad {

constexpr int kMaxJ = 16;      // narrow side
constexpr int kColsPerLane = 4;
constexpr int kCols = 32 * kColsPerLane;  // columns of X a block owns
constexpr int kRows = 4;       // rows of a chunk
constexpr int kStages = 4;     // chunks of a warp's ring: kStages - 1 in flight while one is multiplied
constexpr int kMaxWarps = 16;  // warps of a block where shared memory allows (each on its own chunks)

struct Args {
  const float* x;  // X[k, w] at x + k * ldx + w
  const float* q;  // Q[k, j] at q + k * ldq + j
  int64_t ldx, ldq;
  int K, W, J;
  int chunks_per_slice;  // kRows-row chunks of one block
  bool x_vec;            // X's rows start on 16 bytes: a lane copies its four columns as one piece
  float alpha;
  float* out;  // slice s's out[w, j] at out + s * slice_stride + w * stride_w + j * stride_j
  int64_t slice_stride, stride_w, stride_j;
};

// Floats of one stage of a warp's ring: a chunk of X, then the chunk's rows of Q padded to kJ.
template <int kJ>
constexpr int stage_floats() {
  return kRows * kCols + kRows * kJ;
}
template <int kJ>
constexpr size_t ring_bytes() {
  return size_t(kStages) * stage_floats<kJ>() * sizeof(float);
}
// The sums' exchange at the end (four of the J sums of every warp at a time, then the block's),
// inside the rings of the warps that a block of `warps` has.
template <int kJ>
constexpr bool sums_fit(int warps) {
  return (warps * 4 + kJ) * kCols * sizeof(float) <= warps * ring_bytes<kJ>();
}
constexpr int kMinWarps = 2;
static_assert(sums_fit<4>(kMinWarps) && sums_fit<8>(kMinWarps) && sums_fit<kMaxJ>(kMinWarps), "the sums reuse the rings");

// A template (of the element type, fp32) like every kernel of the library: each generated unit that
// includes this header instantiates it, and the linker keeps one copy. kJ: the narrow side rounded
// up to 4, 8 or 16 (the sums a lane keeps per column). The block has blockDim.x / 32 warps, at
// least kMinWarps.
template <class T, int kJ>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) wgrad_gemm_kernel(Args a) {
  static_assert(kJ % 4 == 0 && kJ <= kMaxJ, "kJ: 4, 8 or 16");
  extern __shared__ __align__(16) float smem[];
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5, warps = int(blockDim.x) >> 5;
  const int w0 = int(blockIdx.x) * kCols;
  const int wl = w0 + kColsPerLane * lane;  // this lane's first column
  const int chunks = (a.K + kRows - 1) / kRows;
  const int c_first = int(blockIdx.y) * a.chunks_per_slice + warp;
  const int c_end = min(int(blockIdx.y) * a.chunks_per_slice + a.chunks_per_slice, chunks);
  const int mine = c_first < c_end ? (c_end - c_first + warps - 1) / warps : 0;  // this warp's chunks
  float* ring = smem + warp * (kStages * stage_floats<kJ>());

  // This warp's i-th chunk into stage i % kStages; every call commits a group (empty past the end),
  // so that "all but the newest kStages - 2 groups" always means "chunk i".
  auto load = [&](int i) {
    if (i < mine) {
      const int k0 = (c_first + i * warps) * kRows;
      float* xs = ring + (i % kStages) * stage_floats<kJ>();
      float* qs = xs + kRows * kCols;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const bool row = k0 + r < a.K;
        const float* src = a.x + int64_t(k0 + r) * a.ldx + wl;
        float* dst = xs + r * kCols + kColsPerLane * lane;
        if (a.x_vec && wl + kColsPerLane <= a.W) {
          cp_async_16_or_zero(dst, row ? src : a.x, row);
        } else {
#pragma unroll
          for (int c = 0; c < kColsPerLane; ++c) {
            const bool ok = row && wl + c < a.W;
            cp_async_4_or_zero(dst + c, ok ? src + c : a.x, ok);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < (kRows * kJ + 31) / 32; ++t) {
        const int e = t * 32 + lane, r = e / kJ, j = e % kJ;
        if (e < kRows * kJ) {
          const bool ok = j < a.J && k0 + r < a.K;
          cp_async_4_or_zero(qs + e, ok ? a.q + int64_t(k0 + r) * a.ldq + j : a.q, ok);
        }
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load(s);
  float acc[kColsPerLane][kJ];
#pragma unroll
  for (int c = 0; c < kColsPerLane; ++c) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) acc[c][j] = 0.f;
  }
  for (int i = 0; i < mine; ++i) {
    cp_async_wait_pending<kStages - 2>();  // chunk i landed (this lane's part)
    __syncwarp();  // every lane's part landed; every lane is done with chunk i - 1, whose stage is refilled next
    load(i + kStages - 1);
    const float* xs = ring + (i % kStages) * stage_floats<kJ>();
    const float* qs = xs + kRows * kCols;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 x4 = *reinterpret_cast<const float4*>(xs + r * kCols + kColsPerLane * lane);
      const float xv[kColsPerLane] = {x4.x, x4.y, x4.z, x4.w};
      const float4* qr = reinterpret_cast<const float4*>(qs + r * kJ);
#pragma unroll
      for (int g = 0; g < kJ / 4; ++g) {
        const float4 q4 = qr[g];
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
          acc[c][4 * g + 0] = fmaf(xv[c], q4.x, acc[c][4 * g + 0]);
          acc[c][4 * g + 1] = fmaf(xv[c], q4.y, acc[c][4 * g + 1]);
          acc[c][4 * g + 2] = fmaf(xv[c], q4.z, acc[c][4 * g + 2]);
          acc[c][4 * g + 3] = fmaf(xv[c], q4.w, acc[c][4 * g + 3]);
        }
      }
    }
  }
  cp_async_wait_all();  // only empty groups remain; the rings are reused below
  __syncthreads();

  // The block's sums, warps added in order, four j at a time: exchange[v][jj][col] holds warp v's
  // sums of j = j0 + jj, block_sums[j][col] the block's.
  float* exchange = smem;
  float* block_sums = smem + warps * 4 * kCols;
#pragma unroll
  for (int j0 = 0; j0 < kJ; j0 += 4) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      *reinterpret_cast<float4*>(exchange + (warp * 4 + jj) * kCols + kColsPerLane * lane) =
          make_float4(acc[0][j0 + jj], acc[1][j0 + jj], acc[2][j0 + jj], acc[3][j0 + jj]);
    }
    __syncthreads();
    for (int f = int(threadIdx.x); f < 4 * kCols; f += int(blockDim.x)) {
      float s = 0.f;
      for (int v = 0; v < warps; ++v) s += exchange[v * 4 * kCols + f];
      block_sums[j0 * kCols + f] = s;
    }
    __syncthreads();
  }

  // This slice's partial product (D itself where there is one slice), written along its
  // contiguous side.
  float* out = a.out + int64_t(blockIdx.y) * a.slice_stride;
  if (a.stride_w == 1) {
    for (int f = int(threadIdx.x); f < a.J * kCols; f += int(blockDim.x)) {
      const int j = f / kCols, c = f % kCols;
      if (w0 + c < a.W) out[int64_t(w0 + c) + int64_t(j) * a.stride_j] = a.alpha * block_sums[f];
    }
  } else {
    for (int f = int(threadIdx.x); f < a.J * kCols; f += int(blockDim.x)) {
      const int c = f / a.J, j = f % a.J;
      if (w0 + c < a.W) out[int64_t(w0 + c) * a.stride_w + int64_t(j) * a.stride_j] = a.alpha * block_sums[j * kCols + c];
    }
  }
}

// The instantiation for a narrow side of J, and its ring per warp.
template <class T>
auto kernel_for(int J) {
  return J <= 4 ? wgrad_gemm_kernel<T, 4> : J <= 8 ? wgrad_gemm_kernel<T, 8> : wgrad_gemm_kernel<T, kMaxJ>;
}
inline size_t ring_bytes_for(int J) { return J <= 4 ? ring_bytes<4>() : J <= 8 ? ring_bytes<8>() : ring_bytes<kMaxJ>(); }

// Grid: blocks of 128 columns across W, and slices of the rows so that about one block per SM
// runs; each slice's partial sums are W * J floats. Warps: as many rings as the device's shared
// memory holds, up to kMaxWarps (16 on Ampere's A100 and Hopper: 147 KB at J > 8).
struct Plan {
  int warps, tiles_w, slices, chunks_per_slice;
};

inline Plan plan_for(int64_t K, int64_t W, int J, int sm_count, int64_t shared_budget) {
  Plan plan;
  plan.warps = int(std::min<int64_t>(kMaxWarps, shared_budget / int64_t(ring_bytes_for(J))));
  plan.tiles_w = int((W + kCols - 1) / kCols);
  const int64_t chunks = std::max<int64_t>(1, (K + kRows - 1) / kRows);
  // No more slices than give each warp a chunk.
  const int64_t most = std::max<int64_t>(1, (chunks + plan.warps - 1) / std::max(plan.warps, 1));
  const int64_t wanted = std::clamp<int64_t>(std::max(sm_count, 1) / plan.tiles_w, 1, most);
  plan.chunks_per_slice = int((chunks + wanted - 1) / wanted);
  plan.slices = int((chunks + plan.chunks_per_slice - 1) / plan.chunks_per_slice);
  return plan;
}

template <class Element>
struct GemmBundle {
  static_assert(sizeof(Element) == 4, "the narrow weight-gradient kernel multiplies fp32");

  // The narrow side: N (Q = B, out[w, j] = D[w, j]) when N <= 16, else M (Q = A^T, out = D^T).
  static bool narrow_n(GemmParams const& p) { return p.N <= kMaxJ; }

  static Plan plan(GemmParams const& p) {
    const bool n_narrow = narrow_n(p);
    return plan_for(p.K, n_narrow ? p.M : p.N, n_narrow ? p.N : p.M, p.sm_count,
                    int64_t(max_dynamic_shared_bytes(p.device)) - kSharedRowReserve);
  }

  static size_t workspace_size(GemmParams const& p) {
    const Plan pl = plan(p);
    return pl.slices > 1 ? size_t(pl.slices) * size_t(p.M) * size_t(p.N) * sizeof(float) : 0;
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
    if (p.K == 0) return {"can_implement", "the narrow weight-gradient kernel needs K >= 1"};
    const bool n_narrow = narrow_n(p);
    Args a;
    a.x = static_cast<const float*>(n_narrow ? p.A : p.B);
    a.q = static_cast<const float*>(n_narrow ? p.B : p.A);
    a.ldx = n_narrow ? p.a_stride_k : p.b_stride_k;
    a.ldq = n_narrow ? p.b_stride_k : p.a_stride_k;
    a.K = p.K;
    a.W = n_narrow ? p.M : p.N;
    a.J = n_narrow ? p.N : p.M;
    a.x_vec = aligned16(a.x) && a.ldx % 4 == 0;
    a.alpha = p.alpha;
    a.stride_w = n_narrow ? p.N : 1;
    a.stride_j = n_narrow ? 1 : p.N;
    a.slice_stride = int64_t(p.M) * p.N;
    const Plan pl = plan(p);
    if (pl.warps < kMinWarps) {
      return {"can_implement", "the narrow weight-gradient kernel needs more shared memory than the device has"};
    }
    if (pl.tiles_w > INT32_MAX / 2 || pl.slices > 65535) {
      return {"can_implement", "the narrow weight-gradient kernel takes fewer columns and rows"};
    }
    a.chunks_per_slice = pl.chunks_per_slice;
    const bool partials = pl.slices > 1;
    if (partials && workspace == nullptr) return {"can_implement", "the narrow weight-gradient kernel needs its workspace"};
    a.out = partials ? static_cast<float*>(workspace) : static_cast<float*>(p.D);

    auto kernel = kernel_for<Element>(a.J);
    cudaError_t err = allow_large_dynamic_shared(reinterpret_cast<const void*>(kernel), p.device);
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    const dim3 grid(unsigned(pl.tiles_w), unsigned(pl.slices));
    kernel<<<grid, unsigned(pl.warps * 32), size_t(pl.warps) * ring_bytes_for(a.J), stream>>>(a);
    err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    if (partials) return sum_partials(static_cast<float*>(workspace), 1, pl.slices, int64_t(p.M) * p.N, DType::kF32, p.D, stream);
    return {};
  }
};

}  // namespace cutlass_ext::wgrad
