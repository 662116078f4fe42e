// CUTLASS 2.x tensor-core GEMMs for Ampere (sm_80 and later 8.x parts): multistage cp.async
// mainloop and mma.sync, fp32 accumulation (TF32 mma for fp32 operands).
//   D = act(alpha * A B + bias)
// As in the exact-fp32 path, the bias is read as the C operand with a zero row stride, or a full
// C source is read instead, into which the binding has folded the bias (gemm/universal2x.cuh).
// There is no aux output: the binding asks for Z and runs the activation separately when the
// backward needs the pre-activation. On Hopper these kernels are built too (as sm_90 code from
// the same source) so that CUTLASS_EXT_GEMM_ARCH=sm80 can test them there.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination_generic.h>
#include <cutlass/gemm/device/gemm_universal.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>

#include "gemm/epilogue_activation.cuh"
#include "gemm/gemm_params.h"
#include "gemm/launcher.cuh"
#include "gemm/universal2x.cuh"

namespace cutlass_ext::sm80 {

template <class Element_, class LayoutA, class LayoutB, int TileM, int TileN, int TileK, int WarpM, int WarpN,
          int Stages>
struct GemmBundle {
  using Element = Element_;  // A, B, C (the bias) and D share one element type
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  // mma.sync shapes: m16n8k16 for 16-bit types, m16n8k8 for TF32.
  static constexpr int kInstructionK = cutlass::sizeof_bits<Element>::value == 16 ? 16 : 8;
  using EpilogueOp =
      cutlass::epilogue::thread::LinearCombinationGeneric<ActivationStoring<Element>::Runtime, Element, kAlignment,
                                                      float, float>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      Element, LayoutA, Element, LayoutB, Element, cutlass::layout::RowMajor, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<TileM, TileN, TileK>,
      cutlass::gemm::GemmShape<WarpM, WarpN, TileK>, cutlass::gemm::GemmShape<16, 8, kInstructionK>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Stages, kAlignment, kAlignment>;

  static typename Gemm::Arguments make_arguments(GemmParams const& p) {
    return universal2x_arguments<Gemm, LayoutA, LayoutB>(p);
  }
};

}  // namespace cutlass_ext::sm80
