// Exact-fp32 GEMM on the FMA units (CUTLASS 2.x SIMT, multistage cp.async), used when
// torch.get_float32_matmul_precision() == "highest". Hopper's tensor cores have no full-fp32 mode.
//   D = act(alpha * A B + bias)
// The bias is read as the C operand with a zero row stride, so it costs no extra pass.
// There is no aux output: when the backward needs the pre-activation, the binding asks this
// kernel for Z (identity activation) and applies the activation in a separate elementwise pass.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination_generic.h>
#include <cutlass/gemm/device/gemm_universal.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>

#include "gemm/epilogue_activation.cuh"
#include "gemm/gemm_params.h"
#include "gemm/launcher.cuh"

namespace cutlass_ext::simt {

template <class LayoutA, class LayoutB, int TileM, int TileN, int TileK, int WarpM, int WarpN, int Stages>
struct GemmBundle {
  using Element = float;
  using EpilogueOp = cutlass::epilogue::thread::LinearCombinationGeneric<RuntimeActivation, float, 1, float, float>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      float, LayoutA, float, LayoutB, float, cutlass::layout::RowMajor, float, cutlass::arch::OpClassSimt,
      cutlass::arch::Sm80, cutlass::gemm::GemmShape<TileM, TileN, TileK>,
      cutlass::gemm::GemmShape<WarpM, WarpN, TileK>, cutlass::gemm::GemmShape<1, 1, 1>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Stages, 1, 1>;

  static constexpr bool kARowMajor = cute::is_same_v<LayoutA, cutlass::layout::RowMajor>;
  static constexpr bool kBRowMajor = cute::is_same_v<LayoutB, cutlass::layout::RowMajor>;

  static typename Gemm::Arguments make_arguments(GemmParams const& p) {
    typename EpilogueOp::Params epilogue(p.alpha, p.bias ? 1.f : 0.f);
    epilogue.kind = p.activation;
    // Leading dimensions in CUTLASS 2.x terms: A is [M, K], B is [K, N].
    const int64_t lda = kARowMajor ? p.a_stride_m : p.a_stride_k;
    const int64_t ldb = kBRowMajor ? p.b_stride_k : p.b_stride_n;
    const void* c = p.bias ? p.bias : p.D;  // C is only read when beta != 0
    return typename Gemm::Arguments(
        p.L > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
        {p.M, p.N, p.K}, p.L, epilogue, p.A, p.B, c, p.D, p.a_stride_l, p.b_stride_l,
        /*batch_stride_C=*/0, p.d_stride_l, lda, ldb, /*ldc=*/0, p.d_stride_m);
  }
};

}  // namespace cutlass_ext::simt
