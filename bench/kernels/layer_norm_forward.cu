// Times the package's layer_norm forward (layer_norm_forward: whichever kernel the library picks)
// with and without dropout, bf16 with weight and bias and relu, at the elementwise bench's large
// shapes or the ones given; every kernel-level change to the forward (the seed, the hash, the long
// rows) can be timed this way without building the package. Usage:
//   layer_norm_forward [--rounds=N] [--p=P] [ROWSxCOLS ...]
// This file includes the library's kernel translation unit; build.py compiles it (a minute).
#include "elementwise/layer_norm_kernels.cu"

#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.cuh"

int main(int argc, char** argv) {
  using namespace cutlass_ext;
  int rounds = 40;
  double p_drop = 0.1;
  std::vector<std::pair<int, int>> shapes;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    int rows, cols;
    if (arg.rfind("--rounds=", 0) == 0) {
      rounds = std::atoi(arg.c_str() + 9);
    } else if (arg.rfind("--p=", 0) == 0) {
      p_drop = std::atof(arg.c_str() + 4);
    } else if (std::sscanf(arg.c_str(), "%dx%d", &rows, &cols) == 2 && rows > 0 && cols > 0) {
      shapes.push_back({rows, cols});
    } else {
      std::printf("argument %s: expected --rounds=N, --p=P or ROWSxCOLS\n", arg.c_str());
      return 2;
    }
  }
  if (shapes.empty()) {
    shapes = {{65536, 512}, {32768, 1024}, {32768, 4096}, {8192, 16384}, {2048, 65536}, {512, 262144}};
  }
  kernel_bench::Timer timer;
  int64_t* seed;
  KB_CHECK_CUDA(cudaMalloc(&seed, sizeof(int64_t)));
  const int64_t seed_value = 0x1234567890abcdefll;
  KB_CHECK_CUDA(cudaMemcpy(seed, &seed_value, sizeof(int64_t), cudaMemcpyHostToDevice));
  for (const auto& [rows, cols] : shapes) {
    const kernel_bench::LayerNormBuffers buf(rows, cols);
    LayerNormParams plain;
    buf.set(plain);
    plain.dtype = DType::kBF16;
    plain.relu = true;
    LayerNormParams dropped = plain;
    dropped.dropout.seed = seed;
    dropped.dropout.keep_threshold = dropout_keep_threshold(p_drop);
    dropped.dropout.keep_scale = dropout_keep_scale(p_drop);
    std::vector<float> t_plain, t_dropped;
    for (int r = 0; r < rounds; ++r) {
      t_plain.push_back(timer.time_us([&] { layer_norm_forward(plain, nullptr); }, r));
      t_dropped.push_back(timer.time_us([&] { layer_norm_forward(dropped, nullptr); }, r));
    }
    KB_CHECK_CUDA(cudaGetLastError());
    const auto [med_plain, min_plain] = kernel_bench::median_min(t_plain);
    const auto [med_dropped, min_dropped] = kernel_bench::median_min(t_dropped);
    const double bytes = 4.0 * double(buf.n);  // read x, write y (bf16)
    std::printf("%dx%d relu          %8.2f us %6.0f GB/s (min %.2f)\n", rows, cols, med_plain,
                bytes / med_plain * 1e-3, min_plain);
    std::printf("%dx%d relu dropout  %8.2f us %6.0f GB/s (min %.2f)\n", rows, cols, med_dropped,
                bytes / med_dropped * 1e-3, min_dropped);
  }
  KB_CHECK_CUDA(cudaFree(seed));
  return 0;
}
