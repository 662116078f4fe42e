// Arguments of a CUTLASS 2.x device::GemmUniversal from the plain params, shared by the
// exact-fp32 (SIMT) and Ampere tensor-core bundles. Their epilogue is
// LinearCombinationGeneric<RuntimeActivation>, and the bias is read as the C operand with a zero
// row stride (beta = 1 when there is a bias), so it costs no extra pass. Every such kernel can
// also accumulate into a full C (LoRA terms, in-place merges); the binding then adds the bias to
// C first.
#pragma once

#include <cute/util/type_traits.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/layout/matrix.h>

#include "gemm/gemm_params.h"

namespace cutlass_ext {

template <class Gemm, class LayoutA, class LayoutB>
typename Gemm::Arguments universal2x_arguments(GemmParams const& p) {
  // With a source (p.C), the caller has folded any bias into it: D = act(alpha * A B + beta * C).
  const bool source = p.C != nullptr;
  typename Gemm::EpilogueOutputOp::Params epilogue(p.alpha, source ? p.beta : p.bias ? 1.f : 0.f);
  epilogue.kind = p.activation;
  // Leading dimensions in CUTLASS 2.x terms: A is [M, K], B is [K, N].
  const int64_t lda = cute::is_same_v<LayoutA, cutlass::layout::RowMajor> ? p.a_stride_m : p.a_stride_k;
  const int64_t ldb = cute::is_same_v<LayoutB, cutlass::layout::RowMajor> ? p.b_stride_k : p.b_stride_n;
  const void* c = source ? p.C : p.bias ? p.bias : p.D;  // C is only read when beta != 0
  return typename Gemm::Arguments(
      p.L > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
      {p.M, p.N, p.K}, p.L, epilogue, p.A, p.B, c, p.D, p.a_stride_l, p.b_stride_l,
      /*batch_stride_C=*/source ? p.c_stride_l : 0, p.d_stride_l, lda, ldb, /*ldc=*/source ? p.c_stride_m : 0,
      p.d_stride_m);
}

}  // namespace cutlass_ext
