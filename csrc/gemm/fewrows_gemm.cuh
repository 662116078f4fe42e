// Few-row GEMM (M <= 16 with K-major operands: decode steps and small batches through an fp32
// linear layer, D = x W^T), hand-written:
//   D = act(alpha * A B + bias), optionally Aux = the pre-activation; fp32 as TF32 on mma.sync
//   m16n8k8 (fp32 accumulation).
// With a few rows the product is a stream over the weight (B, K-major: the rows of a [N, K]
// weight). CUTLASS's TF32 tiles are 128 rows deep, so a 4096-row weight gives 32 of them, and the
// split-K config pays a fix-up. Here each block owns 16 weight rows (output columns) and all of K,
// and streams them with cp.async through kStages stages of 512 bytes of K per row, several blocks
// per SM; the rows of A ride along in each stage (zero-filled past M, as B's rows are past N and
// both past K). The transposed product runs on the tensor cores: a warp multiplies the 16 weight
// rows (the MMA's M) by the rows of A (its N, one or two 8-wide tiles) over an eighth of each
// stage's K; the eighths are added in a fixed order through shared memory at the end, so results
// do not depend on timing. 16-bit types were measured and are not built: cuBLAS and the 64-row
// transposed CUTLASS tiles streamed their weights as fast or faster (bench/NOTES.md section 32).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/device_utils.cuh"
#include "gemm/gemm_params.h"
#include "gemm/mma_sync.cuh"

namespace cutlass_ext::fewrows {

constexpr int kThreads = 256;  // 8 warps: the 16-row weight tiles of a block times parts of K

// A block's work: kBlockN weight rows (output columns) over all of K, streamed kStageBytes of K
// per row and stage through kStages stages.
template <int kBlockN_, int kStageBytes_, int kStages_>
struct Shape {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStageBytes = kStageBytes_;
  static constexpr int kStages = kStages_;
  static constexpr int kTilesM = kBlockN / 16;         // 16-row MMA tiles of weight rows
  static constexpr int kKParts = 8 / kTilesM;          // warps along K per tile
  // A row in shared memory: 16 bytes of padding put the 32 lanes of a fragment load (8 rows by
  // 4 columns) on distinct banks.
  static constexpr int kLineBytes = kStageBytes + 16;
  template <int kRows>
  static constexpr int shared_bytes() { return kStages * (kBlockN + kRows) * kLineBytes; }
};

template <class T, int kRows, class S>
__global__ void __launch_bounds__(kThreads) fewrows_gemm_kernel(GemmParams p) {
  constexpr int kBlockN = S::kBlockN, kStageBytes = S::kStageBytes, kStages = S::kStages, kKParts = S::kKParts;
  static_assert(sizeof(T) == 4, "the few-row GEMM multiplies fp32 as TF32");
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kStageK = kStageBytes / int(sizeof(T));  // K per stage
  constexpr int kLine = S::kLineBytes / int(sizeof(T));  // elements of a row in shared memory
  constexpr int kWarpK = kStageK / kKParts;              // K per warp and stage
  constexpr int kMmaK = 8;
  constexpr int kTilesN = kRows / 8;                     // 8-wide MMA tiles over the rows of A
  constexpr int kLines = kBlockN + kRows;                // rows of a stage: B's, then A's
  constexpr int kPieces = kLines * (kStageBytes / 16);   // 16-byte copies per stage
  static_assert(kPieces % kThreads == 0, "every thread copies the same number of pieces");
  constexpr int kCopies = kPieces / kThreads;
  extern __shared__ float4 shared4[];
  T* const shared = reinterpret_cast<T*>(shared4);

  const int64_t l = blockIdx.y;
  const int n0 = int(blockIdx.x) * kBlockN;
  const int K = p.K;
  const int stages = (K + kStageK - 1) / kStageK;
  const T* const A = static_cast<const T*>(p.A) + l * p.a_stride_l;
  const T* const B = static_cast<const T*>(p.B) + l * p.b_stride_l;

  // A thread copies the same pieces of every stage: piece c = threadIdx.x + i * kThreads is the
  // 16 bytes at K offset (c % P) * kVec of row c / P, P = kStageBytes / 16 (B's rows first).
  const T* src[kCopies];
  bool line_ok[kCopies];
  int piece_k[kCopies], offset[kCopies];
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int c = int(threadIdx.x) + i * kThreads;
    const int line = c / (kStageBytes / 16), k = (c % (kStageBytes / 16)) * kVec;
    if (line < kBlockN) {
      line_ok[i] = n0 + line < p.N;
      src[i] = B + (line_ok[i] ? int64_t(n0 + line) * p.b_stride_n : 0) + k;
    } else {
      line_ok[i] = line - kBlockN < p.M;
      src[i] = A + (line_ok[i] ? int64_t(line - kBlockN) * p.a_stride_m : 0) + k;
    }
    piece_k[i] = k;
    offset[i] = line * kLine + k;
  }
  auto issue = [&](int s) {
    T* const stage = shared + (s % kStages) * (kLines * kLine);
    const int k0 = s * kStageK;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool ok = line_ok[i] && k0 + piece_k[i] < K;  // K is a multiple of kVec
      cp_async_16_or_zero(stage + offset[i], ok ? src[i] + k0 : static_cast<const T*>(p.B), ok);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages) issue(s);
    cp_async_commit();
  }

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int tile = warp % S::kTilesM, part = warp / S::kTilesM;
  const int g = lane / 4, t = lane % 4;  // the fragment coordinates of the PTX ISA
  float acc[kTilesN][4] = {};
  for (int s = 0; s < stages; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");  // stage s landed
    __syncthreads();  // ... for every thread; and every warp is done with the buffer refilled next
    if (s + kStages - 1 < stages) issue(s + kStages - 1);
    cp_async_commit();
    const T* const stage = shared + (s % kStages) * (kLines * kLine);
    const T* const w = stage + tile * 16 * kLine + part * kWarpK;   // 16 weight rows
    const T* const x = stage + kBlockN * kLine + part * kWarpK;     // the rows of A
#pragma unroll
    for (int kk = 0; kk < kWarpK; kk += kMmaK) {
      uint32_t a[4];
      a[0] = to_tf32(w[g * kLine + kk + t]);
      a[1] = to_tf32(w[(g + 8) * kLine + kk + t]);
      a[2] = to_tf32(w[g * kLine + kk + t + 4]);
      a[3] = to_tf32(w[(g + 8) * kLine + kk + t + 4]);
#pragma unroll
      for (int nt = 0; nt < kTilesN; ++nt) {
        const T* const xr = x + (nt * 8 + g) * kLine + kk;
        const uint32_t b[2] = {to_tf32(xr[t]), to_tf32(xr[t + 4])};
        mma_1688_tf32(acc[nt], a, b);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();  // the stages are free: they hold the K parts' sums now

  // sums[part][weight row][row of A]
  float* const sums = reinterpret_cast<float*>(shared4);
#pragma unroll
  for (int nt = 0; nt < kTilesN; ++nt) {
    float* const s0 = sums + (part * kBlockN + tile * 16 + g) * kRows + nt * 8 + 2 * t;
    s0[0] = acc[nt][0];
    s0[1] = acc[nt][1];
    s0[8 * kRows] = acc[nt][2];
    s0[8 * kRows + 1] = acc[nt][3];
  }
  __syncthreads();
  const T* const bias = static_cast<const T*>(p.bias);
  // Adjacent threads, adjacent output columns.
  for (int idx = int(threadIdx.x); idx < kBlockN * kRows; idx += kThreads) {
    const int c = idx % kBlockN, m = idx / kBlockN, n = n0 + c;
    if (m >= p.M || n >= p.N) continue;
    float z = 0.f;
#pragma unroll
    for (int q = 0; q < kKParts; ++q) z += sums[(q * kBlockN + c) * kRows + m];
    z *= p.alpha;
    if (bias != nullptr) z += float(bias[n]);
    if (p.aux != nullptr) static_cast<T*>(p.aux)[l * p.aux_stride_l + m * p.aux_stride_m + n] = T(z);
    static_cast<T*>(p.D)[l * p.d_stride_l + m * p.d_stride_m + n] = T(act::forward(p.activation, z));
  }
}

// The shape a GemmBundle launches.
// Of the shapes measured (16-64 weight rows a block, 512-1024 bytes of K a stage, 4-6 stages; TF32
// on an H200, bench/kernels/fewrows_shapes.cu), the best or within 3% of it up to 4 rows of A.
using DefaultShape = Shape<16, 512, 6>;

template <class Element, class S = DefaultShape>
struct GemmBundle {
  using T = Element;

  static size_t workspace_size(GemmParams const&) { return 0; }

  static LaunchResult run(GemmParams const& p, void*, cudaStream_t stream) {
    constexpr int kVec = 16 / int(sizeof(T));
    auto ok = [](int64_t s) { return s % kVec == 0; };
    if (p.M > kFewRowsMaxM) return {"can_implement", "the few-row GEMM takes M <= 16"};
    if (p.C != nullptr) return {"can_implement", "the few-row GEMM has no C source"};
    if (p.L > 65535) return {"can_implement", "the few-row GEMM takes at most 65535 batches"};
    // Operands are copied in 16-byte pieces along K.
    const bool operands_ok = (p.a_stride_k == 1 || p.K == 1) && p.b_stride_k == 1 && p.K % kVec == 0 &&
                             aligned16(p.A) && aligned16(p.B) && (p.M == 1 || ok(p.a_stride_m)) && ok(p.b_stride_n) &&
                             (p.L == 1 || (ok(p.a_stride_l) && ok(p.b_stride_l)));
    if (!operands_ok) {
      return {"can_implement",
              "the few-row GEMM needs K-major A and B, K a multiple of 16 bytes and 16-byte aligned rows"};
    }
    if (p.M == 0 || p.N == 0 || p.L == 0) return {};
    LaunchResult result;
    auto launch = [&](auto rows) {
      constexpr int kRows = decltype(rows)::value;
      const void* kernel = reinterpret_cast<const void*>(fewrows_gemm_kernel<T, kRows, S>);
      const cudaError_t err = allow_large_dynamic_shared(kernel, p.device);
      if (err != cudaSuccess) {
        result = {"initialize", cudaGetErrorString(err)};
        return;
      }
      const dim3 grid(unsigned(ceil_div(p.N, S::kBlockN)), unsigned(p.L));
      fewrows_gemm_kernel<T, kRows, S><<<grid, kThreads, S::template shared_bytes<kRows>(), stream>>>(p);
    };
    if (p.M <= 8) {
      launch(std::integral_constant<int, 8>{});
    } else {
      launch(std::integral_constant<int, 16>{});
    }
    if (!result.ok()) return result;
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::fewrows
