// Device-side building blocks shared by the hand-written kernels: element types per DType,
// 16-byte vector packs, warp and block reductions, and the dtype dispatch of a launcher.
// Torch-free, CUDA only.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "common/activation.h"
#include "common/types.h"

namespace cutlass_ext {

template <DType D> struct ElementOf;
template <> struct ElementOf<DType::kF16> { using type = cutlass::half_t; };
template <> struct ElementOf<DType::kBF16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<DType::kF32> { using type = float; };

// kVec adjacent elements loaded or stored as one access (16 bytes when kVec = vec_width<T>()).
template <class T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <class T>
constexpr int vec_width() { return 16 / int(sizeof(T)); }

template <class T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* src) {
  return *reinterpret_cast<const Pack<T, kVec>*>(src);
}

template <class T, int kVec>
__device__ __forceinline__ void store_pack(T* dst, Pack<T, kVec> const& v) {
  *reinterpret_cast<Pack<T, kVec>*>(dst) = v;
}

// kVec adjacent elements as one load (store), converted to (from) fp32.
template <class T, int kVec>
__device__ __forceinline__ void load_vec(const T* src, float (&out)[kVec]) {
  const Pack<T, kVec> pk = load_pack<T, kVec>(src);
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = float(pk.v[i]);
}

template <class T, int kVec>
__device__ __forceinline__ void store_vec(T* dst, const float (&in)[kVec]) {
  Pack<T, kVec> pk;
#pragma unroll
  for (int i = 0; i < kVec; ++i) pk.v[i] = T(in[i]);
  store_pack<T, kVec>(dst, pk);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (or max) over the whole block, returned to every thread. `scratch` holds one float per
// warp; the block size must be a multiple of 32. Contains __syncthreads, so every thread of the
// block must call it.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.f);
  return kMax ? warp_max(v) : warp_sum(v);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }

// Calls f(std::integral_constant<int, code>{}) for an activation code, so that each activation
// gets its own kernel instantiation while the code stays a run-time parameter of the launcher.
template <class F>
void dispatch_activation(int code, F&& f) {
  switch (code) {
    case int(Activation::kRelu): return f(std::integral_constant<int, int(Activation::kRelu)>{});
    case int(Activation::kGelu): return f(std::integral_constant<int, int(Activation::kGelu)>{});
    case int(Activation::kGeluTanh): return f(std::integral_constant<int, int(Activation::kGeluTanh)>{});
    case int(Activation::kSilu): return f(std::integral_constant<int, int(Activation::kSilu)>{});
    case int(Activation::kSigmoid): return f(std::integral_constant<int, int(Activation::kSigmoid)>{});
    default: return f(std::integral_constant<int, int(Activation::kNone)>{});
  }
}

// Runs Fn<T>{}(params, stream) for the params' dtype and reports a launch error.
template <template <class> class Fn, class P>
LaunchResult dispatch_dtype(P const& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kF16: Fn<ElementOf<DType::kF16>::type>{}(p, stream); break;
    case DType::kBF16: Fn<ElementOf<DType::kBF16>::type>{}(p, stream); break;
    case DType::kF32: Fn<ElementOf<DType::kF32>::type>{}(p, stream); break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  return {};
}

}  // namespace cutlass_ext
