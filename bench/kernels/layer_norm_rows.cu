// Times the layer_norm forward's row-in-registers kernel in alternative configurations against
// the library's own choice (bench/kernels/README.md). bf16 rows with weight and bias, relu off and
// on. Usage: layer_norm_rows [--rounds=N] ROWSxCOLS ...   (COLS / 8 in 16..1024, a power of two)
// This file includes the library's kernel translation unit to reach its internal templates.
#include "elementwise/layer_norm_kernels.cu"

#include <cmath>
#include <functional>
#include <string>

#include "bench_common.cuh"

namespace cutlass_ext {
namespace {

using T = __nv_bfloat16;
constexpr int kVec = 8;  // 16 bytes of bf16

template <int kVecs, int kTpr, int kThreads, int kRows, bool kRelu>
void launch_rows(LayerNormParams const& p) {
  constexpr int64_t per_block = kThreads / kTpr * kRows;
  const unsigned blocks = unsigned((p.rows + per_block - 1) / per_block);
  layer_norm_fwd_rows_kernel<T, kVec, kVecs, kTpr, kThreads, kRelu, /*kDropout=*/false, kRows><<<blocks, kThreads>>>(p);
}

struct Config {
  std::string name;
  std::function<void(LayerNormParams const&)> launch;
};

template <int kVecs, int kTpr, int kThreads, bool kRelu>
void add_block(std::vector<Config>& out) {
  if constexpr (kThreads >= kTpr) {
    const std::string name = std::to_string(kVecs) + "x" + std::to_string(kTpr) + "x" + std::to_string(kThreads);
    out.push_back({name + "r1", launch_rows<kVecs, kTpr, kThreads, 1, kRelu>});
    out.push_back({name + "r2", launch_rows<kVecs, kTpr, kThreads, 2, kRelu>});
  }
}

// kVecs vectors a thread, kTpr threads a row, in blocks of 64-512 threads, one or two rows a group.
template <int kVecs, int kTpr, bool kRelu>
void add_family(std::vector<Config>& out) {
  add_block<kVecs, kTpr, 64, kRelu>(out);
  add_block<kVecs, kTpr, 128, kRelu>(out);
  add_block<kVecs, kTpr, 256, kRelu>(out);
  if constexpr (kTpr >= 128) add_block<kVecs, kTpr, 512, kRelu>(out);
}

template <bool kRelu>
std::vector<Config> configs(int64_t nv) {
  std::vector<Config> out{{"library", [](LayerNormParams const& p) { launch_forward_vec<T, kVec>(p, nullptr); }}};
  switch (nv) {
    case 16: add_family<1, 16, kRelu>(out), add_family<2, 8, kRelu>(out); break;
    case 32: add_family<1, 32, kRelu>(out), add_family<2, 16, kRelu>(out), add_family<4, 8, kRelu>(out); break;
    case 64: add_family<2, 32, kRelu>(out), add_family<4, 16, kRelu>(out); break;
    case 128: add_family<2, 64, kRelu>(out), add_family<4, 32, kRelu>(out); break;
    case 256: add_family<2, 128, kRelu>(out), add_family<4, 64, kRelu>(out); break;
    case 512: add_family<2, 256, kRelu>(out), add_family<4, 128, kRelu>(out); break;
    case 1024: add_family<2, 512, kRelu>(out), add_family<4, 256, kRelu>(out); break;
    default: break;
  }
  return out;
}

}  // namespace
}  // namespace cutlass_ext

int main(int argc, char** argv) {
  using namespace cutlass_ext;
  int rounds = 40;
  kernel_bench::Timer timer;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg.rfind("--rounds=", 0) == 0) {
      rounds = std::atoi(arg.c_str() + 9);
      continue;
    }
    int rows, cols;
    if (std::sscanf(arg.c_str(), "%dx%d", &rows, &cols) != 2 || cols % kVec != 0) {
      std::printf("shape %s: expected ROWSxCOLS with COLS a multiple of %d\n", arg.c_str(), kVec);
      return 2;
    }
    const kernel_bench::LayerNormBuffers buf(rows, cols);
    const size_t n = buf.n;
    for (int relu = 0; relu < 2; ++relu) {
      LayerNormParams p;
      buf.set(p);
      p.relu = relu != 0;
      const std::vector<Config> all = relu ? configs<true>(cols / kVec) : configs<false>(cols / kVec);
      // Every configuration must reproduce the library's output (to bf16 rounding).
      std::vector<uint16_t> ref(n), got(n);
      for (size_t c = 0; c < all.size(); ++c) {
        KB_CHECK_CUDA(cudaMemset(buf.y, 0xff, n * 2));
        all[c].launch(p);
        KB_CHECK_CUDA(cudaDeviceSynchronize());
        KB_CHECK_CUDA(cudaMemcpy(c == 0 ? ref.data() : got.data(), buf.y, n * 2, cudaMemcpyDeviceToHost));
        if (c == 0) continue;
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) {
          const float r = kernel_bench::bf16_value(ref[i]), g = kernel_bench::bf16_value(got[i]);
          if (!(std::fabs(r - g) <= 0.02f + 0.01f * std::fabs(r))) ++bad;
        }
        if (bad != 0) {
          std::printf("%s: %zu outputs differ from the library's\n", all[c].name.c_str(), bad);
          return 1;
        }
      }
      std::vector<std::vector<float>> times(all.size());
      for (int r = 0; r < rounds; ++r) {
        for (size_t c = 0; c < all.size(); ++c) {
          times[c].push_back(timer.time_us([&] { all[c].launch(p); }, r));
        }
      }
      for (size_t c = 0; c < all.size(); ++c) {
        const auto [median, fastest] = kernel_bench::median_min(times[c]);
        std::printf("%dx%d relu=%d %-14s %8.2f us %6.0f GB/s (min %.2f)\n", rows, cols, relu, all[c].name.c_str(),
                    median, 4.0 * double(n) / median * 1e-3, fastest);
      }
    }
  }
  return 0;
}
