// Bounds of the hand-written narrow GEMM (gemm/narrow_gemm.cuh), which holds all of N and K in one
// block's shared memory; the kernel and the binding's choice (bindings/gemm_select.h) use them.
#pragma once

namespace cutlass_ext {

constexpr int kNarrowMaxN = 64;
constexpr int kNarrowMaxK = 256;

}  // namespace cutlass_ext
