// bf16 out = a + b in several launch shapes, to choose how the package's add (and the other
// streaming kernels) cover a tensor: a grid of resident blocks that strides with N vectors in
// flight per thread ("stride uN", the package's add before bench/NOTES.md section 27), one
// covering grid with N vectors per thread ("cover uN"), and the same with streaming cache hints
// (__ldcs/__stcs). A device copy is timed alongside. Each variant's output is checked first.
//
//   bench/kernels/build/streaming_add 33554432 134217728      # element counts
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.cuh"

namespace kernel_bench {
namespace {

template <bool kStream>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (kStream) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

template <bool kStream>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if constexpr (kStream) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

__device__ __forceinline__ uint32_t add_pair(uint32_t a, uint32_t b) {
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a));
  const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b));
  const __nv_bfloat162 r = __floats2bfloat162_rn(x.x + y.x, x.y + y.y);
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint4 add_vector(uint4 a, uint4 b) {
  return make_uint4(add_pair(a.x, b.x), add_pair(a.y, b.y), add_pair(a.z, b.z), add_pair(a.w, b.w));
}

// Resident blocks striding over the vectors, kN vectors' loads in flight per thread.
template <int kN, bool kStream>
__global__ void __launch_bounds__(256) add_stride(const uint4* a, const uint4* b, uint4* out, int64_t vectors) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; v + (kN - 1) * step < vectors; v += kN * step) {
    uint4 x[kN], y[kN];
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      x[u] = load16<kStream>(a + v + u * step);
      y[u] = load16<kStream>(b + v + u * step);
    }
#pragma unroll
    for (int u = 0; u < kN; ++u) store16<kStream>(out + v + u * step, add_vector(x[u], y[u]));
  }
  for (; v < vectors; v += step) {
    store16<kStream>(out + v, add_vector(load16<kStream>(a + v), load16<kStream>(b + v)));
  }
}

// A grid that covers the vectors, kN per thread (blockDim apart).
template <int kN, bool kStream>
__global__ void add_cover(const uint4* a, const uint4* b, uint4* out, int64_t vectors) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x * kN + threadIdx.x;
  uint4 x[kN], y[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const int64_t v = first + u * blockDim.x;
    if (v < vectors) {
      x[u] = load16<kStream>(a + v);
      y[u] = load16<kStream>(b + v);
    }
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    const int64_t v = first + u * blockDim.x;
    if (v < vectors) store16<kStream>(out + v, add_vector(x[u], y[u]));
  }
}

__global__ void copy_cover(const uint4* a, uint4* out, int64_t vectors) {
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v < vectors) out[v] = a[v];
}

struct Variant {
  std::string name;
  bool is_copy;
  std::function<void(const uint4*, const uint4*, uint4*, int64_t)> launch;
};

unsigned blocks_for(int64_t vectors, int64_t per_block) { return unsigned((vectors + per_block - 1) / per_block); }

void run(int64_t n, int sms) {
  const int64_t vectors = n / 8;  // n: a multiple of 8
  __nv_bfloat16 *a, *b, *out;
  KB_CHECK_CUDA(cudaMalloc(&a, n * 2));
  KB_CHECK_CUDA(cudaMalloc(&b, n * 2));
  KB_CHECK_CUDA(cudaMalloc(&out, n * 2));
  fill_uniform<<<1024, 256>>>(a, size_t(n), 1u, -2.f, 2.f);
  fill_uniform<<<1024, 256>>>(b, size_t(n), 2u, -2.f, 2.f);
  int per_sm = 0;
  KB_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, add_stride<4, false>, 256, 0));
  const unsigned resident = unsigned(std::min<int64_t>(int64_t(per_sm) * sms, (vectors + 255) / 256));
  using In = const uint4*;
  const std::vector<Variant> variants = {
      {"copy", true, [&](In x, In, uint4* o, int64_t nv) { copy_cover<<<blocks_for(nv, 256), 256>>>(x, o, nv); }},
      {"stride u4", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_stride<4, false><<<resident, 256>>>(x, y, o, nv); }},
      {"stride u2", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_stride<2, false><<<resident, 256>>>(x, y, o, nv); }},
      {"stride u4 streaming", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_stride<4, true><<<resident, 256>>>(x, y, o, nv); }},
      {"cover u1 x256", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_cover<1, false><<<blocks_for(nv, 256), 256>>>(x, y, o, nv); }},
      {"cover u1 x128", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_cover<1, false><<<blocks_for(nv, 128), 128>>>(x, y, o, nv); }},
      {"cover u2 x256", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_cover<2, false><<<blocks_for(nv, 512), 256>>>(x, y, o, nv); }},
      {"cover u4 x128", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_cover<4, false><<<blocks_for(nv, 512), 128>>>(x, y, o, nv); }},
      {"cover u1 x256 streaming", false,
       [&](In x, In y, uint4* o, int64_t nv) { add_cover<1, true><<<blocks_for(nv, 256), 256>>>(x, y, o, nv); }},
  };
  const uint4* av = reinterpret_cast<const uint4*>(a);
  const uint4* bv = reinterpret_cast<const uint4*>(b);
  uint4* ov = reinterpret_cast<uint4*>(out);
  // Check: each add variant's output at sampled elements against a host sum of the inputs.
  std::vector<uint16_t> ha(n), hb(n), ho(n);
  KB_CHECK_CUDA(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  KB_CHECK_CUDA(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  for (const Variant& var : variants) {
    if (var.is_copy) continue;
    KB_CHECK_CUDA(cudaMemset(out, 0xff, n * 2));
    var.launch(av, bv, ov, vectors);
    KB_CHECK_CUDA(cudaMemcpy(ho.data(), out, n * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i += 997) {
      const float want = bf16_value(ha[i]) + bf16_value(hb[i]), got = bf16_value(ho[i]);
      if (std::fabs(got - want) > 1e-2f * (1.f + std::fabs(want))) {
        std::printf("%s: wrong at %lld (%g, want %g)\n", var.name.c_str(), (long long)i, got, want);
        std::exit(1);
      }
    }
  }
  Timer timer;
  std::vector<std::vector<float>> times(variants.size());
  for (int round = 0; round < 33; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const float us = timer.time_us([&] { variants[k].launch(av, bv, ov, vectors); }, round);
      if (round >= 3) times[k].push_back(us);
    }
  }
  for (size_t k = 0; k < variants.size(); ++k) {
    const auto [median, best] = median_min(times[k]);
    const double bytes = (variants[k].is_copy ? 4.0 : 6.0) * double(n);
    std::printf("n=%lld %-24s %8.1f us (min %7.1f) %6.0f GB/s\n", (long long)n, variants[k].name.c_str(), median,
                best, bytes / median * 1e-3);
  }
  KB_CHECK_CUDA(cudaGetLastError());
  KB_CHECK_CUDA(cudaFree(a));
  KB_CHECK_CUDA(cudaFree(b));
  KB_CHECK_CUDA(cudaFree(out));
}

}  // namespace
}  // namespace kernel_bench

int main(int argc, char** argv) {
  int sms = 0;
  KB_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  KB_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s\n", prop.name);
  for (int i = 1; i < argc; ++i) {
    const int64_t n = std::atoll(argv[i]) / 8 * 8;
    kernel_bench::run(n, sms);
  }
  return 0;
}
