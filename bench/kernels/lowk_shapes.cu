// The short-K GEMM (csrc/gemm/lowk_gemm.cuh) on its two epilogues: the warps' own 16-bit staging
// of the kernels without C on the vector path ("warp", over contiguous ranges of tiles and
// striped: TileCursor) and the fp32 staging tile of the kernels with C, run without C ("block",
// ranges), with a memset of the output (the write floor) and, with --cublas=PATH, cuBLAS's plain
// product (cublas_peer.h), all taking turns round by round after an L2 flush (bench_common.cuh).
// Every variant is first checked to write the same bits as the block epilogue.
//
//   bench/kernels/build/lowk_shapes [--cublas=PATH] [--rounds=N]
//
// A shape is M x N x K, the majorness of A and B (k: K-major; m / n: M- or N-major) and the
// epilogue: the weight gradient of a 16-row step is 11008 x 4096 x 16 "mn" (dW = dZ^T X).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "cublas_peer.h"
#include "gemm/lowk_gemm.cuh"

namespace kernel_bench {
namespace {

struct Shape {
  int M, N, K;
  bool a_k_major, b_k_major;
  bool bias;
  int activation;  // cutlass_ext::Activation
  bool aux;
};

// cuBLAS's plain product of any operand majorness: D [M, N] row-major is, column-major,
// D^T = B^T A^T.
int cublas_product(CublasPeer const& cublas, cutlass_ext::GemmParams const& p) {
  const float alpha = 1.f, beta = 0.f;
  const bool b_n_unit = p.b_stride_n == 1, a_k_unit = p.a_stride_k == 1;
  const int op_b = b_n_unit ? CublasPeer::kOpN : CublasPeer::kOpT;
  const int ld_b = int(b_n_unit ? p.b_stride_k : p.b_stride_n);
  const int op_a = a_k_unit ? CublasPeer::kOpN : CublasPeer::kOpT;
  const int ld_a = int(a_k_unit ? p.a_stride_m : p.a_stride_k);
  return cublas.gemm(cublas.handle, op_b, op_a, p.N, p.M, p.K, &alpha, p.B, CublasPeer::kBf16, ld_b, p.A,
                     CublasPeer::kBf16, ld_a, &beta, p.D, CublasPeer::kBf16, int(p.d_stride_m),
                     CublasPeer::kCompute32F, CublasPeer::kAlgoDefault);
}

template <bool kWithC>
void run_lowk(cutlass_ext::GemmParams const& p) {
  const cutlass_ext::LaunchResult r = cutlass_ext::lowk::GemmBundle<cutlass::bfloat16_t, kWithC>::run(p, nullptr, 0);
  if (!r.ok()) {
    std::printf("launch failed (%s): %s\n", r.stage, r.detail);
    std::exit(1);
  }
}

std::vector<uint16_t> to_host(const void* d, size_t n) {
  std::vector<uint16_t> h(n);
  KB_CHECK_CUDA(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace
}  // namespace kernel_bench

int main(int argc, char** argv) {
  using namespace kernel_bench;
  std::string cublas_path;
  int rounds = 25;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--cublas=", 9) == 0) cublas_path = argv[i] + 9;
    if (std::strncmp(argv[i], "--rounds=", 9) == 0) rounds = std::atoi(argv[i] + 9);
  }
  CublasPeer cublas;
  const bool with_cublas = !cublas_path.empty() && cublas.open(cublas_path.c_str());
  Timer timer;
  int sms = 0;
  KB_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int kRelu = int(cutlass_ext::Activation::kRelu), kNone = int(cutlass_ext::Activation::kNone);
  const Shape shapes[] = {
      // Weight gradients of 16-row steps (M-major A, N-major B), plain.
      {11008, 4096, 16, false, false, false, kNone, false},
      {4096, 11008, 16, false, false, false, kNone, false},
      {4096, 4096, 16, false, false, false, kNone, false},
      {4096, 11008, 64, false, false, false, kNone, false},
      // LoRA-like rank-r products over many rows (K-major A, N-major B: x A^T B^T's second step).
      {8192, 4096, 16, true, false, false, kNone, false},
      {32768, 4096, 16, true, false, false, kNone, false},
      {2048, 11008, 64, true, false, false, kNone, false},
      // Forward layers with bias + ReLU (K-major A and B), with and without the pre-activation.
      {8192, 4096, 32, true, true, true, kRelu, false},
      {8192, 4096, 32, true, true, true, kRelu, true},
      {65536, 512, 64, true, true, true, kRelu, false},
  };
  // Entries: the warp epilogue over contiguous ranges of tiles (raster 1) and striped (raster 2),
  // the block epilogue, cuBLAS (plain products) and the memset.
  const char* names[] = {"warp+ranges", "warp+striped", "block", "cublas", "memset"};
  std::printf("%-34s", "shape (us)");
  for (const char* n : names) std::printf(" %13s", n);
  std::printf("   block/warp  ranges/striped  cublas/best\n");
  for (const Shape& s : shapes) {
    const size_t a_n = size_t(s.M) * s.K, b_n = size_t(s.K) * s.N, d_n = size_t(s.M) * s.N;
    __nv_bfloat16 *A, *B, *bias, *D0, *D1, *Z0, *Z1;
    KB_CHECK_CUDA(cudaMalloc(&A, a_n * 2));
    KB_CHECK_CUDA(cudaMalloc(&B, b_n * 2));
    KB_CHECK_CUDA(cudaMalloc(&bias, size_t(s.N) * 2));
    KB_CHECK_CUDA(cudaMalloc(&D0, d_n * 2));
    KB_CHECK_CUDA(cudaMalloc(&D1, d_n * 2));
    KB_CHECK_CUDA(cudaMalloc(&Z0, d_n * 2));
    KB_CHECK_CUDA(cudaMalloc(&Z1, d_n * 2));
    fill_uniform<<<1024, 256>>>(A, a_n, 11, -1.5f, 2.5f);
    fill_uniform<<<1024, 256>>>(B, b_n, 12, -1.5f, 2.5f);
    fill_uniform<<<64, 256>>>(bias, s.N, 13, -1.5f, 2.5f);
    cutlass_ext::GemmParams p;
    p.M = s.M, p.N = s.N, p.K = s.K, p.L = 1;
    p.A = A;
    p.a_stride_m = s.a_k_major ? s.K : 1;
    p.a_stride_k = s.a_k_major ? 1 : s.M;
    p.B = B;
    p.b_stride_k = s.b_k_major ? 1 : s.N;
    p.b_stride_n = s.b_k_major ? s.K : 1;
    p.d_stride_m = s.N;
    p.bias = s.bias ? bias : nullptr;
    p.activation = s.activation;
    p.aux_stride_m = s.N;
    p.sm_count = sms;
    char name[96];
    std::snprintf(name, sizeof(name), "%dx%dx%d %c%c%s%s%s", s.M, s.N, s.K, s.a_k_major ? 'k' : 'm',
                  s.b_k_major ? 'k' : 'n', s.bias ? " bias" : "", s.activation == kRelu ? "+relu" : "",
                  s.aux ? "+aux" : "");
    // Every variant writes the block epilogue's bits.
    cutlass_ext::GemmParams ref = p;
    ref.D = D0, ref.raster = 1;
    if (s.aux) ref.aux = Z0;
    run_lowk<true>(ref);
    const std::vector<uint16_t> want_d = to_host(D0, d_n), want_z = s.aux ? to_host(Z0, d_n) : std::vector<uint16_t>();
    auto variant = [&](int raster) {
      cutlass_ext::GemmParams q = p;
      q.D = D1, q.raster = raster;
      if (s.aux) q.aux = Z1;
      return q;
    };
    for (int v = 0; v < 3; ++v) {
      const cutlass_ext::GemmParams q = variant(v % 2 + 1);
      KB_CHECK_CUDA(cudaMemset(D1, 0x7f, d_n * 2));
      KB_CHECK_CUDA(cudaMemset(Z1, 0x7f, d_n * 2));
      v < 2 ? run_lowk<false>(q) : run_lowk<true>(q);
      KB_CHECK_CUDA(cudaDeviceSynchronize());
      if (to_host(D1, d_n) != want_d || (s.aux && to_host(Z1, d_n) != want_z)) {
        std::printf("%-34s %s wrote other bits than block\n", name, names[v]);
        return 1;
      }
    }
    const bool plain = !s.bias && s.activation == kNone && !s.aux;
    std::vector<float> t[5];
    for (int round = 0; round < rounds + 5; ++round) {
      float us[5] = {};
      for (int v = 0; v < 3; ++v) {
        const cutlass_ext::GemmParams q = variant(v % 2 + 1);
        us[v] = timer.time_us([&] { v < 2 ? run_lowk<false>(q) : run_lowk<true>(q); }, round);
      }
      if (with_cublas && plain) {
        us[3] = timer.time_us([&] {
          if (cublas_product(cublas, ref) != 0) {
            std::printf("cublasGemmEx failed\n");
            std::exit(1);
          }
        }, round);
      }
      us[4] = timer.time_us([&] { KB_CHECK_CUDA(cudaMemsetAsync(D1, round & 0xff, d_n * 2)); }, round);
      if (round >= 5) {
        for (int v = 0; v < 5; ++v) t[v].push_back(us[v]);
      }
    }
    float med[5];
    for (int v = 0; v < 5; ++v) med[v] = median_min(t[v]).first;
    std::printf("%-34s", name);
    for (float m : med) std::printf(" %13.2f", m);
    const float best = std::min(std::min(med[0], med[1]), med[2]);
    std::printf("   %10.3f  %14.3f  %11.3f\n", med[2] / std::min(med[0], med[1]), med[0] / med[1],
                med[3] > 0 ? med[3] / best : 0.f);
    for (void* ptr : {static_cast<void*>(A), static_cast<void*>(B), static_cast<void*>(bias), static_cast<void*>(D0),
                      static_cast<void*>(D1), static_cast<void*>(Z0), static_cast<void*>(Z1)}) {
      KB_CHECK_CUDA(cudaFree(ptr));
    }
  }
  return 0;
}
