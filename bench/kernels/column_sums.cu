// bf16 column sums, or fp32 ones with --fp32 (x.sum(0) of a row-major [rows, cols] tensor, fp32
// accumulation) through the package's own reduction (csrc/elementwise/reduce_kernels.cu, linked
// in), under the split plan that plan_sum() picks ("plan") and under forced plans: threads across a
// column chunk (8, 16 or 32, each 16 bytes of a row) and a grid target of 1-8 blocks an SM, from
// which the rows are split as plan_sum() splits them. A split plan's time includes its second
// stage (sum_partials). A device copy of the input is timed alongside. Every plan's output is
// checked first. L2 is emptied before each call by zeroing a 512 MB buffer, as the package's
// benches do by default, or with --read-flush by reading it (no dirty lines left to be written
// back during the timed call).
//
//   bench/kernels/build/column_sums [--read-flush] [--fp32] 32768x1024 65536x128        # rows x cols
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "elementwise/reduce_kernels.h"

namespace kernel_bench {
namespace {

constexpr int kThreads = 256;          // reduce_kernels.cu's block size
constexpr int kMinRowsPerThread = 8;   // and its smallest share of a split column per thread

struct Plan {
  std::string name;
  int col_threads = 0;  // 0: plan_sum's choice
  int blocks_per_sm = 0;
};

// fp32 copies of bf16 values: the fp32 runs sum the same numbers as the bf16 ones.
__global__ void widen(const __nv_bfloat16* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

void run(int64_t rows, int64_t cols, int sms, int64_t l2_bytes, bool read_flush, bool fp32) {
  const int64_t n = rows * cols;
  const int esize = fp32 ? 4 : 2, vec = 16 / esize;
  __nv_bfloat16* xb;
  void *x, *out, *copy;
  float* partials;
  const int64_t max_splits = int64_t(8) * sms;
  KB_CHECK_CUDA(cudaMalloc(&xb, n * 2));
  KB_CHECK_CUDA(cudaMalloc(&copy, n * esize));
  KB_CHECK_CUDA(cudaMalloc(&out, cols * esize));
  KB_CHECK_CUDA(cudaMalloc(&partials, max_splits * cols * 4));
  fill_uniform<<<1024, 256>>>(xb, size_t(n), 7u, -1.f, 1.f);
  x = xb;
  if (fp32) {
    KB_CHECK_CUDA(cudaMalloc(&x, n * 4));
    widen<<<1024, 256>>>(xb, static_cast<float*>(x), size_t(n));
  }
  std::vector<uint16_t> hx(n);
  KB_CHECK_CUDA(cudaMemcpy(hx.data(), xb, n * 2, cudaMemcpyDeviceToHost));

  std::vector<Plan> plans = {{"plan"}};
  for (int ct : {8, 16, 32}) {
    for (int bps : {1, 2, 4, 8}) plans.push_back({"ct" + std::to_string(ct) + " bps" + std::to_string(bps), ct, bps});
  }
  std::vector<cutlass_ext::SumParams> params;
  for (const Plan& plan : plans) {
    cutlass_ext::SumParams p;
    p.outer = 1;
    p.reduce = rows;
    p.inner = cols;
    p.outer_stride = n;
    p.reduce_stride = cols;
    p.dtype = fp32 ? cutlass_ext::DType::kF32 : cutlass_ext::DType::kBF16;
    p.input = x;
    p.output = out;
    p.partials = partials;
    cutlass_ext::plan_sum(p, sms, l2_bytes);
    if (plan.col_threads > 0) {
      const int64_t vecs = (cols + vec - 1) / vec;
      int ct = 1;
      while (ct < plan.col_threads && ct < vecs) ct *= 2;
      const int64_t blocks = (vecs + ct - 1) / ct;
      const int64_t thread_rows = kThreads / ct;
      const int64_t target = int64_t(plan.blocks_per_sm) * sms;
      p.plan.col_threads = ct;
      p.plan.splits = int(std::max<int64_t>(1, std::min(target / blocks, rows / (thread_rows * kMinRowsPerThread))));
    }
    if (p.plan.splits > max_splits) p.plan.splits = int(max_splits);
    params.push_back(p);
  }
  // Check each plan at sampled columns against a float64 sum of the inputs.
  std::vector<uint16_t> hout(cols);
  std::vector<float> hout32(cols);
  for (size_t v = 0; v < plans.size(); ++v) {
    KB_CHECK_CUDA(cudaMemset(out, 0xff, cols * esize));
    const cutlass_ext::LaunchResult r = cutlass_ext::sum(params[v], nullptr);
    if (!r.ok()) {
      std::printf("%s: launch failed\n", plans[v].name.c_str());
      std::exit(1);
    }
    if (fp32) {
      KB_CHECK_CUDA(cudaMemcpy(hout32.data(), out, cols * 4, cudaMemcpyDeviceToHost));
    } else {
      KB_CHECK_CUDA(cudaMemcpy(hout.data(), out, cols * 2, cudaMemcpyDeviceToHost));
    }
    for (int64_t c = 0; c < cols; c += std::max<int64_t>(1, cols / 61)) {
      double want = 0, scale = 0;
      for (int64_t r = 0; r < rows; ++r) {
        want += bf16_value(hx[r * cols + c]);
        scale += std::fabs(bf16_value(hx[r * cols + c]));
      }
      const double got = fp32 ? double(hout32[c]) : double(bf16_value(hout[c]));
      if (std::fabs(got - want) > 1e-2 * std::fabs(want) + 1e-5 * scale + 1e-3) {
        std::printf("%s: column %lld is %g, want %g\n", plans[v].name.c_str(), (long long)c, got, want);
        std::exit(1);
      }
    }
  }
  Timer timer(read_flush);
  std::vector<std::vector<float>> times(plans.size() + 1);
  for (int round = 0; round < 30; ++round) {
    times[0].push_back(timer.time_us([&] { cudaMemcpyAsync(copy, x, n * esize, cudaMemcpyDeviceToDevice); }, round));
    for (size_t v = 0; v < plans.size(); ++v) {
      times[v + 1].push_back(timer.time_us([&] { cutlass_ext::sum(params[v], nullptr); }, round));
    }
  }
  const float copy_us = median_min(times[0]).first;
  std::printf("%lld x %lld %s (%s flush): copy %.1f us (%.0f GB/s read+write)\n", (long long)rows, (long long)cols,
              fp32 ? "fp32" : "bf16", read_flush ? "read" : "zero", copy_us, 2.0 * n * esize / copy_us / 1e3);
  for (size_t v = 0; v < plans.size(); ++v) {
    const auto [med, mn] = median_min(times[v + 1]);
    std::printf("  %-12s threads %2d splits %4d: %7.1f us (min %7.1f)  %5.0f GB/s read  %.2fx copy time\n",
                plans[v].name.c_str(), params[v].plan.col_threads, params[v].plan.splits, med, mn,
                double(n) * esize / med / 1e3, copy_us / med);
  }
}

}  // namespace
}  // namespace kernel_bench

int main(int argc, char** argv) {
  int device = 0, sms = 0;
  KB_CHECK_CUDA(cudaGetDevice(&device));
  KB_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int l2_bytes = 0;
  KB_CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  bool read_flush = false, fp32 = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--read-flush") {
      read_flush = true;
      continue;
    }
    if (std::string(argv[i]) == "--fp32") {
      fp32 = true;
      continue;
    }
    long long rows = 0, cols = 0;
    if (std::sscanf(argv[i], "%lldx%lld", &rows, &cols) != 2 || rows <= 0 || cols <= 0) {
      std::printf("usage: column_sums [--read-flush] [--fp32] ROWSxCOLS ...\n");
      return 2;
    }
    kernel_bench::run(rows, cols, sms, l2_bytes, read_flush, fp32);
  }
  return 0;
}
