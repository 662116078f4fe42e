// Times the GEMM variants listed in the generated variants.inc (bench/kernels/README.md).
// Usage: gemm_variants [--rounds=N] [--only=a,b] [--chain=N] [--swizzle=S] [--raster=h,m,n] [--cublas=PATH]
//                     [--sustain=MS] [--matmul-only] MxNxK ...
// Each call follows a 512 MB memset (L2 flushed), events bracket the call alone, and the
// variants take turns round by round; the median is printed. Every variant is first checked
// against a float64 reference at 512 sampled outputs.
// --chain=N times N calls back to back after each flush instead (the time printed is a call's
// share), each call on the next of several copies of A and W that together hold at least twice
// L2, so no call finds its operands in L2: a training step's GEMMs run so, with the GPU busy and
// its clock held down by power, where one call after an idle flush runs at a higher clock
// (bench/NOTES.md section 43). --swizzle and --raster set the persistent scheduler's tile order
// (GemmParams::swizzle and ::raster; default 1 and CUTLASS's heuristic). --raster takes a list of
// h (heuristic), m (along M) and n (along N): each variant then runs once per order, as separate
// entries (name/order) that take turns with the others, so the orders are compared in one run.
// --cublas=PATH adds cuBLAS's product (cublas_peer.h) as one more entry, matmul mode only.
// Taking turns, each entry's samples run right after another entry's: where power holds the
// clock down, an entry that draws less is timed in the heat of the others. --sustain=MS times
// each entry in a block of its own instead: MS milliseconds of untimed samples, then its
// rounds; the entries in order and then in reverse. --matmul-only skips the bias modes.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.cuh"
#include "cublas_peer.h"
#include "gemm/gemm_params.h"

using cutlass_ext::GemmParams;
using cutlass_ext::LaunchResult;
using kernel_bench::bf16_value;

#define KERNEL_BENCH(N)                                                \
  size_t N##_workspace_size(GemmParams const&);                        \
  LaunchResult N##_run(GemmParams const&, void*, cudaStream_t);        \
  int N##_active_clusters();                                           \
  void N##_describe();                                                 \
  int N##_kind();
#include "variants.inc"
#undef KERNEL_BENCH

struct Entry {
  const char* name;
  size_t (*workspace)(GemmParams const&);
  LaunchResult (*run)(GemmParams const&, void*, cudaStream_t);
  int (*clusters)();
  void (*describe)();
  int (*kind)();
};
#define KERNEL_BENCH(N) {#N, N##_workspace_size, N##_run, N##_active_clusters, N##_describe, N##_kind},
static const Entry kEntries[] = {
#include "variants.inc"
};
#undef KERNEL_BENCH

static kernel_bench::CublasPeer g_cublas;
static const Entry kCublasEntry{
    "cublas",
    [](GemmParams const&) -> size_t { return 0; },
    [](GemmParams const& p, void*, cudaStream_t) -> LaunchResult {
      const int status = g_cublas.run(p);
      return status == 0 ? LaunchResult{} : LaunchResult{"cublasGemmEx", "returned an error status"};
    },
    [] { return 0; },
    [] { std::printf("cublas: cublasGemmEx, bf16, fp32 accumulation, its default algorithm\n"); },
    [] { return 1; }};

static double seconds_since_start() {
  static const auto start = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Modes: 0 = matmul (no bias, no activation), 1 = bias + ReLU, 2 = bias + GELU. A variant with a
// fixed epilogue runs its own mode only (kind 1: plain, 2: ReLU, 3: GELU; 0: runtime, all).
static bool runs_mode(int kind, int mode) { return kind == 0 || (kind == 1 && mode == 0) || kind - 1 == mode; }
static const char* kModeNames[] = {"matmul", "bias+relu", "bias+gelu"};

int main(int argc, char** argv) {
  int rounds = 30;
  int chain = 0;  // 0: one call a sample; N: N calls back to back a sample, over rotating operand sets
  int swizzle = 1;
  int sustain_ms = 0;  // 0: entries take turns round by round; > 0: blocks of one entry (see below)
  bool matmul_only = false;
  std::vector<int> rasters{0};  // GemmParams::raster values, one entry each per variant
  std::vector<std::string> only;
  std::string cublas_path;
  std::vector<std::array<int, 3>> shapes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rounds=", 0) == 0) {
      rounds = std::atoi(a.c_str() + 9);
    } else if (a.rfind("--chain=", 0) == 0) {
      chain = std::atoi(a.c_str() + 8);
    } else if (a.rfind("--swizzle=", 0) == 0) {
      swizzle = std::atoi(a.c_str() + 10);
    } else if (a.rfind("--raster=", 0) == 0) {
      rasters.clear();
      for (const char c : a.substr(9)) {
        if (c == ',') continue;
        if (c != 'h' && c != 'm' && c != 'n') {
          std::printf("--raster: expected a list of h, m and n, got %s\n", a.c_str());
          return 2;
        }
        rasters.push_back(c == 'h' ? 0 : c == 'm' ? 1 : 2);
      }
    } else if (a.rfind("--sustain=", 0) == 0) {
      sustain_ms = std::atoi(a.c_str() + 10);
    } else if (a == "--matmul-only") {
      matmul_only = true;
    } else if (a.rfind("--cublas=", 0) == 0) {
      cublas_path = a.substr(9);
    } else if (a.rfind("--only=", 0) == 0) {
      std::string s = a.substr(7) + ",";
      for (size_t p; (p = s.find(',')) != std::string::npos; s = s.substr(p + 1)) only.push_back(s.substr(0, p));
    } else {
      int m, n, k;
      if (std::sscanf(a.c_str(), "%dx%dx%d", &m, &n, &k) != 3) {
        std::printf("shape %s: expected MxNxK\n", a.c_str());
        return 2;
      }
      shapes.push_back({m, n, k});
    }
  }
  std::vector<Entry> entries;
  std::vector<int> entry_raster;
  std::vector<std::string> labels;
  for (const Entry& e : kEntries) {
    if (only.empty() || std::find(only.begin(), only.end(), e.name) != only.end()) {
      e.describe();
      for (const int r : rasters) {
        entries.push_back(e);
        entry_raster.push_back(r);
        labels.push_back(rasters.size() == 1 ? std::string(e.name) : std::string(e.name) + "/" + "hmn"[r]);
      }
    }
  }
  if (!cublas_path.empty()) {
    if (!g_cublas.open(cublas_path.c_str())) return 2;
    kCublasEntry.describe();
    entries.push_back(kCublasEntry);
    entry_raster.push_back(0);
    labels.push_back("cublas");
  }
  cudaDeviceProp prop;
  KB_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  kernel_bench::Timer timer;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  for (auto [M, N, K] : shapes) {
    __nv_bfloat16 *A, *W, *D, *bias;
    KB_CHECK_CUDA(cudaMalloc(&A, size_t(M) * K * 2));
    KB_CHECK_CUDA(cudaMalloc(&W, size_t(N) * K * 2));
    KB_CHECK_CUDA(cudaMalloc(&D, size_t(M) * N * 2));
    KB_CHECK_CUDA(cudaMalloc(&bias, size_t(N) * 2));
    kernel_bench::fill_uniform<<<1024, 256>>>(A, size_t(M) * K, 1, -1.f, 1.f);
    kernel_bench::fill_uniform<<<1024, 256>>>(W, size_t(N) * K, 2, -1.f, 1.f);
    kernel_bench::fill_uniform<<<64, 256>>>(bias, N, 3, -1.f, 1.f);
    std::vector<uint16_t> hA(size_t(M) * K), hW(size_t(N) * K), hbias(N), hD(size_t(M) * N);
    KB_CHECK_CUDA(cudaMemcpy(hA.data(), A, hA.size() * 2, cudaMemcpyDeviceToHost));
    KB_CHECK_CUDA(cudaMemcpy(hW.data(), W, hW.size() * 2, cudaMemcpyDeviceToHost));
    KB_CHECK_CUDA(cudaMemcpy(hbias.data(), bias, hbias.size() * 2, cudaMemcpyDeviceToHost));
    // Copies of A and W for --chain: enough that a call's operands left L2 several calls ago.
    std::vector<std::pair<__nv_bfloat16*, __nv_bfloat16*>> sets{{A, W}};
    if (chain > 0) {
      const size_t operand_bytes = (size_t(M) + N) * K * 2;
      const size_t wanted = std::max<size_t>(2, (2 * size_t(prop.l2CacheSize) + operand_bytes - 1) / operand_bytes);
      while (sets.size() < wanted) {
        __nv_bfloat16 *a2, *w2;
        KB_CHECK_CUDA(cudaMalloc(&a2, size_t(M) * K * 2));
        KB_CHECK_CUDA(cudaMalloc(&w2, size_t(N) * K * 2));
        KB_CHECK_CUDA(cudaMemcpy(a2, A, size_t(M) * K * 2, cudaMemcpyDeviceToDevice));
        KB_CHECK_CUDA(cudaMemcpy(w2, W, size_t(N) * K * 2, cudaMemcpyDeviceToDevice));
        sets.push_back({a2, w2});
      }
    }
    std::mt19937 rng(7);
    std::vector<std::pair<int, int>> samples;
    for (int s = 0; s < 512; ++s) samples.push_back({int(rng() % M), int(rng() % N)});
    for (int mode = 0; mode < (matmul_only ? 1 : 3); ++mode) {
      std::vector<GemmParams> params(entries.size());
      std::vector<std::vector<float>> times(entries.size());
      for (size_t v = 0; v < entries.size(); ++v) {
        if (!runs_mode(entries[v].kind(), mode)) continue;
        GemmParams& p = params[v];
        p.M = M, p.N = N, p.K = K;
        p.A = A, p.a_stride_m = K, p.a_stride_k = 1;
        p.B = W, p.b_stride_n = K, p.b_stride_k = 1;
        p.D = D, p.d_stride_m = N;
        p.bias = mode > 0 ? bias : nullptr;
        p.activation = mode;  // cutlass_ext::Activation: 0 none, 1 relu, 2 gelu
        p.device = 0, p.sm_count = prop.multiProcessorCount, p.swizzle = swizzle;
        p.raster = entry_raster[v];
        p.max_active_clusters = entries[v].clusters();
        const size_t need = entries[v].workspace(p);
        if (need > workspace_bytes) {
          if (workspace != nullptr) KB_CHECK_CUDA(cudaFree(workspace));
          KB_CHECK_CUDA(cudaMalloc(&workspace, need));
          workspace_bytes = need;
        }
        KB_CHECK_CUDA(cudaMemset(D, 0xff, size_t(M) * N * 2));  // NaN: an unwritten output fails the check
        const LaunchResult r = entries[v].run(p, workspace, nullptr);
        if (!r.ok()) {
          std::printf("%s: %s failed: %s\n", labels[v].c_str(), r.stage, r.detail);
          return 1;
        }
        KB_CHECK_CUDA(cudaDeviceSynchronize());
        KB_CHECK_CUDA(cudaMemcpy(hD.data(), D, hD.size() * 2, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (auto [m, n] : samples) {
          double ref = 0;
          for (int k = 0; k < K; ++k) ref += bf16_value(hA[size_t(m) * K + k]) * bf16_value(hW[size_t(n) * K + k]);
          if (mode > 0) ref += bf16_value(hbias[n]);
          if (mode == 1) ref = std::max(ref, 0.0);
          if (mode == 2) ref = 0.5 * ref * (1 + std::erf(ref / std::sqrt(2.0)));
          // Relative to the output's size and to sqrt(K), the spread of a sum of K products.
          const double got = bf16_value(hD[size_t(m) * N + n]);
          const double err = std::fabs(got - ref) / (std::fabs(ref) + 0.05 * std::sqrt(double(K)));
          worst = std::isnan(err) ? 1e9 : std::max(worst, err);
        }
        if (worst > 0.02) {
          std::printf("%s (%s): wrong result, worst relative error %.4f\n", labels[v].c_str(), kModeNames[mode], worst);
          return 1;
        }
      }
      // One sample of entry v: a flush, then one call or a chain of calls.
      auto sample = [&](size_t v, int r) {
        if (chain == 0) return timer.time_us([&] { entries[v].run(params[v], workspace, nullptr); }, r);
        GemmParams p = params[v];
        const float total = timer.time_us([&] {
          for (int c = 0; c < chain; ++c) {
            p.A = sets[c % sets.size()].first;
            p.B = sets[c % sets.size()].second;
            entries[v].run(p, workspace, nullptr);
          }
        }, r);
        return total / chain;
      };
      if (sustain_ms == 0) {
        for (int r = 0; r < rounds; ++r) {
          for (size_t v = 0; v < entries.size(); ++v) {
            if (runs_mode(entries[v].kind(), mode)) times[v].push_back(sample(v, r));
          }
        }
      } else {
        // Blocks: each entry alone for sustain_ms untimed and then its rounds, the entries in order
        // and then again in reverse; each block's median is printed with the time it started.
        for (int pass = 0; pass < 2; ++pass) {
          for (size_t i = 0; i < entries.size(); ++i) {
            const size_t v = pass == 0 ? i : entries.size() - 1 - i;
            if (!runs_mode(entries[v].kind(), mode)) continue;
            const double t0 = seconds_since_start();
            while (seconds_since_start() - t0 < sustain_ms * 1e-3) sample(v, 0);
            std::vector<float> block;
            for (int r = 0; r < rounds; ++r) block.push_back(sample(v, r));
            times[v].insert(times[v].end(), block.begin(), block.end());
            std::printf("  block at %.2f s: %dx%dx%d %s %s %.1f us\n", t0, M, N, K, kModeNames[mode],
                        labels[v].c_str(), kernel_bench::median_min(block).first);
          }
        }
      }
      for (size_t v = 0; v < entries.size(); ++v) {
        if (times[v].empty()) continue;
        const auto [median, fastest] = kernel_bench::median_min(times[v]);
        std::printf("%dx%dx%d %-9s %-16s %8.1f us %6.0f TFLOP/s (min %.1f)%s\n", M, N, K, kModeNames[mode],
                    labels[v].c_str(), median, 2.0 * M * N * K / median * 1e-6, fastest,
                    chain > 0 ? " a call, chained" : "");
      }
    }
    for (size_t i = 1; i < sets.size(); ++i) {
      KB_CHECK_CUDA(cudaFree(sets[i].first));
      KB_CHECK_CUDA(cudaFree(sets[i].second));
    }
    KB_CHECK_CUDA(cudaFree(A));
    KB_CHECK_CUDA(cudaFree(W));
    KB_CHECK_CUDA(cudaFree(D));
    KB_CHECK_CUDA(cudaFree(bias));
  }
  return 0;
}
