// Exact-fp32 GEMM on the FMA units (CUTLASS 2.x SIMT, multistage cp.async), used when
// torch.get_float32_matmul_precision() == "highest". Hopper's tensor cores have no full-fp32 mode.
//   D = act(alpha * A B + bias)
// The bias is read as the C operand with a zero row stride (gemm/universal2x.cuh).
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
#include "gemm/universal2x.cuh"

namespace cutlass_ext::simt {

template <class LayoutA, class LayoutB, int TileM, int TileN, int TileK, int WarpM, int WarpN, int Stages>
struct GemmBundle {
  using Element = float;
  using EpilogueOp = cutlass::epilogue::thread::LinearCombinationGeneric<ActivationStoring<float>::Runtime, float, 1,
                                                                        float, float>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      float, LayoutA, float, LayoutB, float, cutlass::layout::RowMajor, float, cutlass::arch::OpClassSimt,
      cutlass::arch::Sm80, cutlass::gemm::GemmShape<TileM, TileN, TileK>,
      cutlass::gemm::GemmShape<WarpM, WarpN, TileK>, cutlass::gemm::GemmShape<1, 1, 1>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Stages, 1, 1>;

  static typename Gemm::Arguments make_arguments(GemmParams const& p) {
    return universal2x_arguments<Gemm, LayoutA, LayoutB>(p);
  }
};

}  // namespace cutlass_ext::simt
