// Helpers shared by the kernel-level benchmarks: error checks, bf16 inputs, timing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define KB_CHECK_CUDA(x)                                                                  \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace kernel_bench {

// Deterministic values in [lo, hi) from a hash of the index.
__global__ void fill_uniform(__nv_bfloat16* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(lo + (hi - lo) * float(h & 0xffff) / 65536.f);
  }
}

inline float bf16_value(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reads n 16-byte vectors (an L2 flush that leaves no dirty lines behind).
__global__ void read_vectors(const int4* p, size_t n, int* sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    acc ^= p[i].x;
  }
  if (acc == 0x7fffffff) *sink = acc;  // keeps the loads
}

// Times calls with the L2 flushed before each: a 512 MB memset (as the Python benches' zero_()),
// or with read_flush a read of that buffer, which leaves no dirty lines in L2 to be written back
// during the timed call; then events around the call.
class Timer {
 public:
  explicit Timer(bool read_flush = false) : read_flush_(read_flush) {
    KB_CHECK_CUDA(cudaMalloc(&flush_, kFlushBytes));
    KB_CHECK_CUDA(cudaMemset(flush_, 0, kFlushBytes));
    KB_CHECK_CUDA(cudaEventCreate(&start_));
    KB_CHECK_CUDA(cudaEventCreate(&stop_));
  }
  template <class Fn>
  float time_us(Fn&& fn, int round) {
    if (read_flush_) {
      read_vectors<<<1056, 512>>>(static_cast<const int4*>(flush_), kFlushBytes / 16, static_cast<int*>(flush_));
    } else {
      KB_CHECK_CUDA(cudaMemsetAsync(flush_, round & 0xff, kFlushBytes));
    }
    KB_CHECK_CUDA(cudaEventRecord(start_));
    fn();
    KB_CHECK_CUDA(cudaEventRecord(stop_));
    KB_CHECK_CUDA(cudaEventSynchronize(stop_));
    float ms;
    KB_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms * 1000.f;
  }

 private:
  static constexpr size_t kFlushBytes = size_t(512) << 20;
  bool read_flush_;
  void* flush_ = nullptr;
  cudaEvent_t start_, stop_;
};

// The buffers of the layer_norm harnesses: bf16 x and y [rows, cols], weight and bias [cols]
// (deterministic values in [-1.5, 2.5)), fp32 mean and rstd [rows]. set() points a LayerNormParams
// at them (bf16, relu off, no dropout).
struct LayerNormBuffers {
  int rows, cols;
  size_t n;
  __nv_bfloat16 *x = nullptr, *y = nullptr, *w = nullptr, *b = nullptr;
  float *mean = nullptr, *rstd = nullptr;

  LayerNormBuffers(int rows_, int cols_) : rows(rows_), cols(cols_), n(size_t(rows_) * cols_) {
    KB_CHECK_CUDA(cudaMalloc(&x, n * 2));
    KB_CHECK_CUDA(cudaMalloc(&y, n * 2));
    KB_CHECK_CUDA(cudaMalloc(&w, size_t(cols) * 2));
    KB_CHECK_CUDA(cudaMalloc(&b, size_t(cols) * 2));
    KB_CHECK_CUDA(cudaMalloc(&mean, size_t(rows) * 4));
    KB_CHECK_CUDA(cudaMalloc(&rstd, size_t(rows) * 4));
    fill_uniform<<<1024, 256>>>(x, n, 1, -1.5f, 2.5f);
    fill_uniform<<<8, 256>>>(w, cols, 2, -1.5f, 2.5f);
    fill_uniform<<<8, 256>>>(b, cols, 3, -1.5f, 2.5f);
  }
  ~LayerNormBuffers() {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(w), static_cast<void*>(b),
                    static_cast<void*>(mean), static_cast<void*>(rstd)}) {
      KB_CHECK_CUDA(cudaFree(p));
    }
  }
  LayerNormBuffers(const LayerNormBuffers&) = delete;
  LayerNormBuffers& operator=(const LayerNormBuffers&) = delete;

  template <class Params>
  void set(Params& p) const {
    p.rows = rows, p.cols = cols, p.x = x, p.x_ld = cols, p.weight = w, p.bias = b, p.y = y, p.y_ld = cols;
    p.mean = mean, p.rstd = rstd;
  }
};

// (median, min) of a list of times.
inline std::pair<float, float> median_min(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

}  // namespace kernel_bench
