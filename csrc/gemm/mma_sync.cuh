// Warp-level tensor-core building blocks (mma.sync, ldmatrix, stmatrix) for the hand-written GEMM kernels
// (gemm/lowk_gemm.cuh, gemm/fewrows_gemm.cuh). Compiled from each target's own virtual arch (compute_90 on Hopper: stmatrix); CUDA only.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/numeric_types.h>

namespace cutlass_ext {

// d += a b for one 16x8x16 tile of 16-bit operands (fp32 accumulation): a row-major (16 x 16),
// b column-major (16 x 8), in the fragment layout of the PTX ISA.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<T, cutlass::half_t>, "mma_16816 takes bf16 or fp16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// The same for a 16x8x8 tile of TF32 operands (fp32 values rounded by to_tf32).
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// An fp32 value rounded to TF32 (to nearest, ties away from zero), as an mma operand.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Four 8x8 16-bit matrices from shared memory (lane l gives row l % 8 of matrix l / 8); with
// `trans` each is delivered transposed.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
}

// The inverse of ldmatrix_x4 (untransposed): four 8x8 16-bit matrices into shared memory, lane l
// giving the address of row l % 8 of matrix l / 8 and holding, in r[i], elements (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1) of matrix i: the layout of an mma accumulator's 16-bit pairs. Before
// sm_90 (no stmatrix) each lane stores its own words, the rows' addresses taken from their lanes.
__device__ __forceinline__ void stmatrix_x4(void* row, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  const int lane = int(threadIdx.x) & 31;
  const unsigned long long own = reinterpret_cast<unsigned long long>(row);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned long long base = __shfl_sync(0xffffffffu, own, 8 * i + lane / 4);
    *reinterpret_cast<uint32_t*>(base + 4 * (lane % 4)) = r[i];
  }
#endif
}

}  // namespace cutlass_ext
