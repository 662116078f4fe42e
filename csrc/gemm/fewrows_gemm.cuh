// Few-row GEMM (M <= 16 with a K-major A: decode steps and small batches through an fp32 linear
// layer, D = x W^T, or a product with a row-major [K, N] matrix), hand-written:
//   D = act(alpha * A B + bias), optionally Aux = the pre-activation; fp32 as TF32 on mma.sync
//   m16n8k8 (fp32 accumulation).
// With a few rows the product is a stream over the weight (B: K-major, the rows of a [N, K]
// weight, or N-major, a row-major [K, N] matrix). CUTLASS's TF32 tiles are 128 rows deep, so a
// 4096-row weight gives 32 of them, and the split-K config pays a fix-up; an N-major B reaches
// them only through the transposed product, which transposes its operand in registers. Here each
// block owns 32 weight rows (output columns, B's columns) and all of K, and streams them with
// cp.async through kStages stages of 512 bytes of K per row, one or more blocks per SM; the rows of
// A ride along in each stage (zero-filled past M, as B's rows are past N and both past K). The
// transposed product runs on the tensor cores: a warp multiplies 16 weight rows (the MMA's M) by
// the rows of A (its N, one or two 8-wide tiles) over a quarter of each stage's K (8 warps: two
// 16-row tiles by four parts of K); the parts are added in a fixed order through shared memory
// at the end, so results do not depend on timing. 16-bit types were measured and are not built:
// cuBLAS and the 64-row transposed CUTLASS tiles streamed their weights as fast or faster
// (bench/NOTES.md section 32).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/activation_16bit.h"
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
  // An N-major B stage holds kStageBytes / 4 rows of K, each kBlockN values padded by 8 (a pitch
  // of 8 or 24 banks mod 32 puts the fragment loads on distinct banks).
  static constexpr int kNPitch = kBlockN + 8;
  template <bool kBKMajor>
  static constexpr int b_stage_floats() { return kBKMajor ? kBlockN * (kLineBytes / 4) : kStageBytes / 4 * kNPitch; }
  template <int kRows, bool kBKMajor>
  static constexpr int shared_bytes() { return kStages * (b_stage_floats<kBKMajor>() * 4 + kRows * kLineBytes); }
};

template <class T, int kRows, class S, bool kBKMajor>
__global__ void __launch_bounds__(kThreads) fewrows_gemm_kernel(GemmParams p) {
  constexpr int kBlockN = S::kBlockN, kStageBytes = S::kStageBytes, kStages = S::kStages, kKParts = S::kKParts;
  static_assert(sizeof(T) == 4, "the few-row GEMM multiplies fp32 as TF32");
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kStageK = kStageBytes / int(sizeof(T));  // K per stage
  constexpr int kLine = S::kLineBytes / int(sizeof(T));  // elements of a row in shared memory
  constexpr int kWarpK = kStageK / kKParts;              // K per warp and stage
  constexpr int kMmaK = 8;
  constexpr int kTilesN = kRows / 8;                     // 8-wide MMA tiles over the rows of A
  constexpr int kBElems = S::template b_stage_floats<kBKMajor>();  // B's part of a stage, then A's rows
  constexpr int kStageElems = kBElems + kRows * kLine;
  constexpr int kPerLine = kStageBytes / 16;             // 16-byte pieces of K per row of A (or K-major B)
  constexpr int kPerKRow = kBlockN / kVec;               // 16-byte pieces per row of an N-major B
  constexpr int kBPieces = kBlockN * kPerLine;           // either layout
  constexpr int kPieces = kBPieces + kRows * kPerLine;   // 16-byte copies per stage
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

  // A thread copies the same pieces of every stage. Piece c = threadIdx.x + i * kThreads: below
  // kBPieces, B's (K-major: the 16 bytes at K offset (c % kPerLine) * kVec of weight row
  // c / kPerLine; N-major: columns (c % kPerKRow) * kVec.. of K row c / kPerKRow), then A's rows
  // (as K-major B's). Along K a piece moves by `step` elements a unit of K.
  const T* src[kCopies];
  bool line_ok[kCopies];
  int piece_k[kCopies], offset[kCopies];
  int64_t step[kCopies];
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int c = int(threadIdx.x) + i * kThreads;
    if (c < kBPieces && !kBKMajor) {
      const int k = c / kPerKRow, n = (c % kPerKRow) * kVec;
      line_ok[i] = n0 + n < p.N;  // N is a multiple of kVec
      src[i] = B + (line_ok[i] ? n0 + n : 0) + int64_t(k) * p.b_stride_k;
      step[i] = p.b_stride_k;
      piece_k[i] = k;
      offset[i] = k * S::kNPitch + n;
    } else {
      const int line = c < kBPieces ? c / kPerLine : (c - kBPieces) / kPerLine, k = (c % kPerLine) * kVec;
      if (c < kBPieces) {
        line_ok[i] = n0 + line < p.N;
        src[i] = B + (line_ok[i] ? int64_t(n0 + line) * p.b_stride_n : 0) + k;
        offset[i] = line * kLine + k;
      } else {
        line_ok[i] = line < p.M;
        src[i] = A + (line_ok[i] ? int64_t(line) * p.a_stride_m : 0) + k;
        offset[i] = kBElems + line * kLine + k;
      }
      step[i] = 1;
      piece_k[i] = k;
    }
  }
  auto issue = [&](int s) {
    T* const stage = shared + (s % kStages) * kStageElems;
    const int k0 = s * kStageK;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool ok = line_ok[i] && k0 + piece_k[i] < K;  // K is a multiple of kVec
      cp_async_16_or_zero(stage + offset[i], ok ? src[i] + k0 * step[i] : static_cast<const T*>(p.B), ok);
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
    cp_async_wait_pending<kStages - 2>();  // stage s landed
    __syncthreads();  // ... for every thread; and every warp is done with the buffer refilled next
    if (s + kStages - 1 < stages) issue(s + kStages - 1);
    cp_async_commit();
    const T* const stage = shared + (s % kStages) * kStageElems;
    // The warp's 16 weight rows (B's columns) and its part of K; then the rows of A.
    const T* const w = kBKMajor ? stage + tile * 16 * kLine + part * kWarpK
                                : stage + part * kWarpK * S::kNPitch + tile * 16;
    const T* const x = stage + kBElems + part * kWarpK;
    // Element (row r, K k) of the warp's 16 x kWarpK weight tile.
    auto weight = [&](int r, int k) { return kBKMajor ? w[r * kLine + k] : w[k * S::kNPitch + r]; };
#pragma unroll
    for (int kk = 0; kk < kWarpK; kk += kMmaK) {
      uint32_t a[4];
      a[0] = to_tf32(weight(g, kk + t));
      a[1] = to_tf32(weight(g + 8, kk + t));
      a[2] = to_tf32(weight(g, kk + t + 4));
      a[3] = to_tf32(weight(g + 8, kk + t + 4));
#pragma unroll
      for (int nt = 0; nt < kTilesN; ++nt) {
        const T* const xr = x + (nt * 8 + g) * kLine + kk;
        const uint32_t b[2] = {to_tf32(xr[t]), to_tf32(xr[t + 4])};
        mma_1688_tf32(acc[nt], a, b);
      }
    }
  }
  cp_async_wait_pending<0>();
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
    static_cast<T*>(p.D)[l * p.d_stride_l + m * p.d_stride_m + n] = T(act::forward_for<T>(p.activation, z));
  }
}

// The shape a GemmBundle launches. Of the shapes measured (16-64 weight rows a block, 512-1024
// bytes of K a stage, 4-6 stages; TF32 on an H200, bench/kernels/fewrows_shapes.cu --read-flush,
// bench/NOTES.md section 33), the best or within 2% of it up to 8 rows of A with either layout of
// B. 16 rows a block were as fast up to 4 rows against a K-major B but up to 1.23x slower at 8
// rows, and against an N-major B they read 64-byte pieces of each row of K where 32 rows read 128.
using DefaultShape = Shape<32, 512, 6>;

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
    // Operands are copied in 16-byte pieces along their unit stride: A's along K, B's along K or N.
    const bool b_k_major = p.b_stride_k == 1;
    const bool b_ok = b_k_major ? ok(p.b_stride_n) : p.b_stride_n == 1 && p.N % kVec == 0 && ok(p.b_stride_k);
    const bool operands_ok = (p.a_stride_k == 1 || p.K == 1) && b_ok && p.K % kVec == 0 && aligned16(p.A) &&
                             aligned16(p.B) && (p.M == 1 || ok(p.a_stride_m)) &&
                             (p.L == 1 || (ok(p.a_stride_l) && ok(p.b_stride_l)));
    if (!operands_ok) {
      return {"can_implement",
              "the few-row GEMM needs a K-major A, a K- or N-major B (N a multiple of 16 bytes), K a multiple of 16 "
              "bytes and 16-byte aligned rows"};
    }
    if (p.M == 0 || p.N == 0 || p.L == 0) return {};
    LaunchResult result;
    auto launch = [&](auto rows, auto b_layout) {
      constexpr int kRows = decltype(rows)::value;
      constexpr bool kBKMajor = decltype(b_layout)::value;
      const void* kernel = reinterpret_cast<const void*>(fewrows_gemm_kernel<T, kRows, S, kBKMajor>);
      const cudaError_t err = allow_large_dynamic_shared(kernel, p.device);
      if (err != cudaSuccess) {
        result = {"initialize", cudaGetErrorString(err)};
        return;
      }
      const dim3 grid(unsigned(ceil_div(p.N, S::kBlockN)), unsigned(p.L));
      fewrows_gemm_kernel<T, kRows, S, kBKMajor>
          <<<grid, kThreads, S::template shared_bytes<kRows, kBKMajor>(), stream>>>(p);
    };
    auto with_rows = [&](auto b_layout) {
      if (p.M <= 8) {
        launch(std::integral_constant<int, 8>{}, b_layout);
      } else {
        launch(std::integral_constant<int, 16>{}, b_layout);
      }
    };
    if (b_k_major) {
      with_rows(std::true_type{});
    } else {
      with_rows(std::false_type{});
    }
    if (!result.ok()) return result;
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace cutlass_ext::fewrows
