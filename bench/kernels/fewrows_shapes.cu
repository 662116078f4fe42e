// The few-row TF32 GEMM (csrc/gemm/fewrows_gemm.cuh) in several block shapes (weight rows a block,
// bytes of K a stage, stages), at 1-16 rows against decode-sized weights, with a device copy of
// the weight alongside. Each launch is timed alone after an L2 flush (bench_common.cuh: a 512 MB
// memset); with --read-flush the flush reads the buffer instead, which leaves no dirty lines in
// L2 to be written back during the timed launch.
//
// With --n-major the weight is a row-major [K, N] matrix (an N-major B) instead of [N, K].
//
//   bench/kernels/build/fewrows_shapes [--read-flush] [--n-major]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_common.cuh"
#include "gemm/fewrows_gemm.cuh"

namespace kernel_bench {
namespace {

// Median of 20 timed launches after 5 untimed ones.
template <class Fn>
float median_us(Timer& timer, Fn&& fn) {
  std::vector<float> t;
  for (int round = 0; round < 25; ++round) {
    const float us = timer.time_us(fn, round);
    if (round >= 5) t.push_back(us);
  }
  return median_min(t).first;
}

template <class S>
float run_shape(Timer& timer, cutlass_ext::GemmParams const& p) {
  return median_us(timer, [&] {
    const cutlass_ext::LaunchResult r = cutlass_ext::fewrows::GemmBundle<float, S>::run(p, nullptr, 0);
    if (!r.ok()) {
      std::printf("launch failed (%s): %s\n", r.stage, r.detail);
      std::exit(1);
    }
  });
}

}  // namespace
}  // namespace kernel_bench

int main(int argc, char** argv) {
  using namespace kernel_bench;
  using cutlass_ext::fewrows::Shape;
  bool read_flush = false, n_major = false;
  for (int i = 1; i < argc; ++i) {
    read_flush = read_flush || std::strcmp(argv[i], "--read-flush") == 0;
    n_major = n_major || std::strcmp(argv[i], "--n-major") == 0;
  }
  Timer timer(read_flush);
  int sms = 0;
  KB_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}};  // N, K
  for (const auto& nk : shapes) {
    const int N = nk[0], K = nk[1];
    const size_t weight = size_t(N) * K * sizeof(float);
    float *W = nullptr, *W2 = nullptr, *X = nullptr, *D = nullptr;
    KB_CHECK_CUDA(cudaMalloc(&W, weight));
    KB_CHECK_CUDA(cudaMalloc(&W2, weight));
    KB_CHECK_CUDA(cudaMalloc(&X, 16 * size_t(K) * sizeof(float)));
    KB_CHECK_CUDA(cudaMalloc(&D, 16 * size_t(N) * sizeof(float)));
    KB_CHECK_CUDA(cudaMemset(W, 0x3c, weight));
    KB_CHECK_CUDA(cudaMemset(X, 0x3c, 16 * size_t(K) * sizeof(float)));
    const float copy = median_us(timer, [&] { KB_CHECK_CUDA(cudaMemcpyAsync(W2, W, weight, cudaMemcpyDeviceToDevice)); });
    std::printf("N=%d K=%d copy of the weight %.1f us (%.0f GB/s read+written)\n", N, K, copy, 2e-3 * weight / copy);
    for (int M : {1, 2, 4, 8, 12, 16}) {
      cutlass_ext::GemmParams p;
      p.M = M, p.N = N, p.K = K, p.L = 1;
      p.A = X, p.a_stride_m = K, p.a_stride_k = 1;
      p.B = W, p.b_stride_k = n_major ? N : 1, p.b_stride_n = n_major ? 1 : K;
      p.D = D, p.d_stride_m = N, p.sm_count = sms;
      auto report = [&](const char* name, float us) {
        std::printf("  M=%2d %-10s %7.1f us  %5.0f GB/s of weight\n", M, name, us, 1e-3 * weight / us);
      };
      report("32x512x4", run_shape<Shape<32, 512, 4>>(timer, p));
      report("32x512x6", run_shape<Shape<32, 512, 6>>(timer, p));
      report("64x512x4", run_shape<Shape<64, 512, 4>>(timer, p));
      report("16x512x6", run_shape<Shape<16, 512, 6>>(timer, p));
      report("16x1024x4", run_shape<Shape<16, 1024, 4>>(timer, p));
    }
    KB_CHECK_CUDA(cudaFree(W));
    KB_CHECK_CUDA(cudaFree(W2));
    KB_CHECK_CUDA(cudaFree(X));
    KB_CHECK_CUDA(cudaFree(D));
  }
  return 0;
}
