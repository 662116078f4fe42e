#include "elementwise/dropout_kernels.h"

#include <algorithm>

#include "common/counter_rng.h"
#include "common/device_utils.cuh"

namespace cutlass_ext {
namespace {

constexpr int kThreads = 256;

// Each thread handles kVec adjacent elements per step (one 16-byte access when kVec > 1). Vector
// steps start at multiples of kVec, so each pair of elements shares one hash.
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads)
dropout_kernel(const T* __restrict__ in, T* out, int64_t numel, const int64_t* seed_ptr, uint32_t cmp, float scale) {
  const CounterRng rng{uint64_t(*seed_ptr)};
  const int64_t stride = int64_t(gridDim.x) * kThreads * kVec;
  for (int64_t base = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kVec; base < numel; base += stride) {
    if constexpr (kVec > 1) {
      if (base + kVec <= numel) {
        Pack<T, kVec> v = *reinterpret_cast<const Pack<T, kVec>*>(in + base);
        bool keep[kVec];
        dropout_keep_run<kVec>(rng, uint64_t(base), cmp, keep);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v.v[j] = T(keep[j] ? float(v.v[j]) * scale : 0.f);
        *reinterpret_cast<Pack<T, kVec>*>(out + base) = v;
        continue;
      }
    }
    for (int64_t i = base; i < min(base + kVec, numel); ++i) {
      bool keep[1];
      dropout_keep_run<1>(rng, uint64_t(i), cmp, keep);
      out[i] = T(keep[0] ? float(in[i]) * scale : 0.f);
    }
  }
}

template <class T>
struct DropoutFn {
  void operator()(DropoutTensorParams const& p, cudaStream_t stream) const {
    const uint32_t cmp = dropout_compare_threshold(dropout_keep_threshold(p.p));
    const float scale = dropout_keep_scale(p.p);
    constexpr int kVec = vec_width<T>();
    const bool vector = aligned16(p.input) && aligned16(p.output);
    const int vec = vector ? kVec : 1;
    const int64_t needed = (p.numel + int64_t(kThreads) * vec - 1) / (int64_t(kThreads) * vec);
    const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(p.sm_count) * 8)));
    const T* in = static_cast<const T*>(p.input);
    T* out = static_cast<T*>(p.output);
    if (vector) {
      dropout_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(in, out, p.numel, p.seed, cmp, scale);
    } else {
      dropout_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(in, out, p.numel, p.seed, cmp, scale);
    }
  }
};

}  // namespace

LaunchResult dropout_forward(DropoutTensorParams const& p, cudaStream_t stream) {
  if (p.numel == 0) return {};
  return dispatch_dtype<DropoutFn>(p, stream);
}

}  // namespace cutlass_ext
