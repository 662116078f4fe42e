// cuBLAS as one more entry of gemm_variants (--cublas=PATH): the bf16 product D = A W^T through
// cublasGemmEx, timed in the same process as the variants, taking turns with them round by round,
// so a drift of the GPU's clock over a run reaches both sides alike. The library is opened at run
// time (the toolkit here has no cuBLAS headers or libraries to link against): PATH names
// libcublas.so, e.g. the one that ships with torch. The few declarations below follow cuBLAS's
// documented C API; the enum values are cuBLAS's own (cublas_api.h, library_types.h).
#pragma once

#include <dlfcn.h>

#include <cstdio>

#include "gemm/gemm_params.h"

namespace kernel_bench {

struct CublasPeer {
  using Create = int (*)(void**);
  using GemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                         int, const void*, void*, int, int, int, int);
  static constexpr int kOpN = 0, kOpT = 1;            // cublasOperation_t
  static constexpr int kBf16 = 14;                    // cudaDataType CUDA_R_16BF
  static constexpr int kCompute32F = 68;              // cublasComputeType_t CUBLAS_COMPUTE_32F
  static constexpr int kAlgoDefault = -1;             // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT

  void* handle = nullptr;
  GemmEx gemm = nullptr;

  // Opens PATH and creates a handle; prints why and returns false when it cannot.
  bool open(const char* path) {
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::printf("--cublas: cannot open %s: %s\n", path, dlerror());
      return false;
    }
    auto create = reinterpret_cast<Create>(dlsym(lib, "cublasCreate_v2"));
    gemm = reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx"));
    if (create == nullptr || gemm == nullptr || create(&handle) != 0) {
      std::printf("--cublas: %s lacks cublasCreate_v2/cublasGemmEx or made no handle\n", path);
      return false;
    }
    return true;
  }

  // Row-major D [M, N] = A [M, K] W^T (W [N, K]) is, column-major, D^T = W A^T: cuBLAS's "TN".
  // Only the plain product (the bias and activation modes are cuBLASLt's, in peers.py).
  // The handle's stream is the default one, as the variants' launches in gemm_main.cu.
  int run(cutlass_ext::GemmParams const& p) const {
    const float alpha = 1.f, beta = 0.f;
    return gemm(handle, kOpT, kOpN, int(p.N), int(p.M), int(p.K), &alpha, p.B, kBf16, int(p.b_stride_n), p.A, kBf16,
                int(p.a_stride_m), &beta, p.D, kBf16, int(p.d_stride_m), kCompute32F, kAlgoDefault);
  }
};

}  // namespace kernel_bench
