// Device-side building blocks shared by the hand-written kernels: element types per DType,
// 16-byte vector packs, warp and block reductions, and the dtype dispatch of a launcher.
// Torch-free, CUDA only.
#pragma once

#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "common/activation.h"
#include "common/device_attribute.h"
#include "common/int_math.h"
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

// The same load for data read once (ld.global.cs): its lines are evicted from L2 first, so that
// streaming them through does not push out (and write back) the dirty lines other kernels left.
// A column sum of 64 MB timed after a 512 MB memset took 27.6-28.2 us this way against
// 30.2-30.7 with plain loads on an H200 (bench/kernels/column_sums, bench/NOTES.md section 34);
// after a read of that buffer (no dirty lines), 24.2 us either way.
template <class T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack_once(const T* src) {
  constexpr int kBytes = int(sizeof(Pack<T, kVec>));
  Pack<T, kVec> out;
  if constexpr (kBytes == 16) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(src));
    memcpy(&out, &v, kBytes);
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(src));
    memcpy(&out, &v, kBytes);
  } else if constexpr (kBytes == 4) {
    const unsigned int v = __ldcs(reinterpret_cast<const unsigned int*>(src));
    memcpy(&out, &v, kBytes);
  } else if constexpr (kBytes == 2) {
    const unsigned short v = __ldcs(reinterpret_cast<const unsigned short*>(src));
    memcpy(&out, &v, kBytes);
  } else {
    out = load_pack<T, kVec>(src);
  }
  return out;
}

template <class T, int kVec>
__device__ __forceinline__ void store_pack(T* dst, Pack<T, kVec> const& v) {
  *reinterpret_cast<Pack<T, kVec>*>(dst) = v;
}

// The same store for results no later access of the kernel wants in L2 (st.global.cs, evict
// first): 16-byte packs.
template <class T, int kVec>
__device__ __forceinline__ void store_pack_once(T* dst, Pack<T, kVec> const& v) {
  static_assert(sizeof(Pack<T, kVec>) == 16, "store_pack_once stores 16-byte packs");
  uint4 u;
  memcpy(&u, &v, 16);
  __stcs(reinterpret_cast<uint4*>(dst), u);
}

// kVec adjacent elements as one load (store), converted to (from) fp32.
template <class T, int kVec>
__device__ __forceinline__ void load_vec(const T* src, float (&out)[kVec]) {
  const Pack<T, kVec> pk = load_pack<T, kVec>(src);
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = float(pk.v[i]);
}

// kOnce: stored with store_pack_once.
template <class T, int kVec, bool kOnce = false>
__device__ __forceinline__ void store_vec(T* dst, const float (&in)[kVec]) {
  Pack<T, kVec> pk;
#pragma unroll
  for (int i = 0; i < kVec; ++i) pk.v[i] = T(in[i]);
  if constexpr (kOnce) {
    store_pack_once<T, kVec>(dst, pk);
  } else {
    store_pack<T, kVec>(dst, pk);
  }
}

// CUTLASS's two 16-bit types, the ones pack_pair and unpack_pair take.
template <class T>
inline constexpr bool kIsCutlass16 = std::is_same_v<T, cutlass::bfloat16_t> || std::is_same_v<T, cutlass::half_t>;

// Two fp32 values as one 32-bit word of T (the first in the low half), rounded to nearest: one
// cvt.rn.bf16x2 or cvt.rn.f16x2.
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  static_assert(kIsCutlass16<T>, "pack_pair packs cutlass::bfloat16_t or cutlass::half_t");
  uint32_t w;
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  }
  return w;
}

// The inverse: the two values of a word of T (the low half first) as fp32, exactly.
template <class T>
__device__ __forceinline__ float2 unpack_pair(uint32_t w) {
  static_assert(kIsCutlass16<T>, "unpack_pair unpacks cutlass::bfloat16_t or cutlass::half_t");
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    float lo, hi;
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
    return make_float2(lo, hi);
  }
}

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

// ---------------------------------------------------------------------------------------------
// Rows resident in shared memory: too long for registers, short enough for one block's dynamic
// shared memory (up to ~113K 16-bit elements on Hopper). The block copies its row in with
// cp.async, which holds no registers while in flight, so the whole row is requested at once and
// read from memory once. Each thread copies, and later reads back, only its own 16-byte pieces
// (pieces t, t + blockDim.x, t + 2 * blockDim.x, ...), so no barrier is needed between the copy and
// the thread's reads: waiting for its own copies is enough.
//
// The row is copied in kRowGroups groups, so that a first pass can start on group 0 while the
// rest are still in flight. A thread's pieces are the 16-byte pieces at columns
// threadIdx.x * kVec + k * blockDim.x * kVec (its rounds k = 0, 1, ...), and group g holds
// consecutive rounds: [g * per_group, (g + 1) * per_group), per_group = ceil(rounds / kRowGroups).
// Later passes walk all of a thread's pieces in one loop. A row that fits in shared memory has far
// fewer than 2^31 columns, so the walks count in 32 bits (64-bit induction variables cost two
// instructions per add and compare).

constexpr int kRowGroups = 4;

// Calls fn(col) for the first column of each 16-byte piece of group g that this thread owns: the
// copy and the first pass walk the row through this function, later passes through
// for_all_own_pieces, so a thread reads back exactly the pieces it copied.
template <class T, class Fn>
__device__ __forceinline__ void for_own_pieces(int64_t cols, int g, Fn&& fn) {
  constexpr int kVec = vec_width<T>();
  const int n = int(cols), stride = int(blockDim.x) * kVec;
  const int per_group = ((n + stride - 1) / stride + kRowGroups - 1) / kRowGroups;
  const int begin = int(threadIdx.x) * kVec + g * per_group * stride;
  const int end = min(n, begin + per_group * stride);
  for (int col = begin; col < end; col += stride) fn(col);
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem));
}

// The first `bytes` (0-16) of the 16 copied, the rest of the piece zero-filled (`gmem` 16-byte
// aligned and a valid address; no byte past gmem + bytes is read).
__device__ __forceinline__ void cp_async_16_first(void* smem, const void* gmem, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem), "r"(bytes));
}

// The same, or 16 zero bytes when !valid (`gmem` must still be a valid address).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem, const void* gmem, bool valid) {
  cp_async_16_first(smem, gmem, valid ? 16 : 0);
}

// One float copied (through L1), or a zero where !valid (`gmem` must still be a valid address).
__device__ __forceinline__ void cp_async_4_or_zero(float* smem, const float* gmem, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(gmem), "r"(valid ? 4 : 0));
}

// Closes this thread's current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until all of this thread's cp.async copies have landed.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Waits until at most kPending of this thread's most recent commit groups are still in flight
// (the older ones have landed): a pipeline's "stage s landed".
template <int kPending>
__device__ __forceinline__ void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Issues the copies of every group of a row (in order, one commit group each).
template <class T>
__device__ __forceinline__ void copy_row_async(T* dst, const T* src, int64_t cols) {
#pragma unroll
  for (int g = 0; g < kRowGroups; ++g) {
    for_own_pieces<T>(cols, g, [&](int64_t col) { cp_async_16(dst + col, src + col); });
    cp_async_commit();
  }
}

// The same for two rows of equal length (x and dy, say), both in each group's commit.
template <class T>
__device__ __forceinline__ void copy_row_pair_async(T* dst0, const T* src0, T* dst1, const T* src1, int64_t cols) {
#pragma unroll
  for (int g = 0; g < kRowGroups; ++g) {
    for_own_pieces<T>(cols, g, [&](int64_t col) {
      cp_async_16(dst0 + col, src0 + col);
      cp_async_16(dst1 + col, src1 + col);
    });
    cp_async_commit();
  }
}

// Waits until this thread's copies of groups 0..g have landed (g a compile-time-unrolled index).
__device__ __forceinline__ void wait_row_group(int g) {
  static_assert(kRowGroups == 4, "one case per group below");
  switch (g) {
    case 0: cp_async_wait_pending<3>(); break;
    case 1: cp_async_wait_pending<2>(); break;
    case 2: cp_async_wait_pending<1>(); break;
    default: cp_async_wait_pending<0>(); break;
  }
}

// Calls fn(col) for each of this thread's pieces, group after group, each group as soon as this
// thread's copies of it have landed (the first pass over a row copied by copy_row_async or
// copy_row_pair_async).
template <class T, class Fn>
__device__ __forceinline__ void for_own_pieces_landing(int64_t cols, Fn&& fn) {
#pragma unroll
  for (int g = 0; g < kRowGroups; ++g) {
    wait_row_group(g);
    for_own_pieces<T>(cols, g, fn);
  }
}

// Calls fn(col) for each of this thread's pieces of every group (later passes, once all landed).
template <class T, class Fn>
__device__ __forceinline__ void for_all_own_pieces(int64_t cols, Fn&& fn) {
  constexpr int kVec = vec_width<T>();
  const int n = int(cols), stride = int(blockDim.x) * kVec;
  for (int col = int(threadIdx.x) * kVec; col < n; col += stride) fn(col);
}

// Static shared memory of the row kernels besides the row (reduction scratch), with margin.
constexpr int64_t kSharedRowReserve = 1024;

// The most dynamic shared memory one block may use on `device` (0 if unknown), read once per
// device: the row kernels' launchers ask on every launch.
inline int max_dynamic_shared_bytes(int device) {
  return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
}

// Lets `kernel` use up to max_dynamic_shared_bytes(device) - kSharedRowReserve of dynamic shared
// memory (over the 48 KB default); asks the driver once per kernel and device.
inline cudaError_t allow_large_dynamic_shared(const void* kernel, int device) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               max_dynamic_shared_bytes(device) - int(kSharedRowReserve));
  if (err == cudaSuccess) {
    done.insert({kernel, device});
  } else {
    (void)cudaGetLastError();  // not sticky: clear it, the caller falls back to another kernel
  }
  return err;
}

// How many rows of `cols` elements of T fit one block's shared memory on the current device
// (next to kSharedRowReserve bytes of static shared memory; 0: not even one), and that device
// (for allow_large_dynamic_shared).
template <class T>
int64_t shared_rows_that_fit(int64_t cols, int* device) {
  if (cudaGetDevice(device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const int64_t budget = int64_t(max_dynamic_shared_bytes(*device)) - kSharedRowReserve;
  return budget > 0 ? budget / (cols * int64_t(sizeof(T))) : 0;
}

// Blocks of `threads` threads and `smem` bytes of dynamic shared memory of `kernel` that fit one
// SM of the current device (0 if none does or the query fails): a grid of sm_count times this is
// one wave.
inline int resident_blocks_per_sm(const void* kernel, int threads, size_t smem) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return blocks;
}

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

// Returns Fn<T>{}(args...) for the element type T of `dtype` (one of the three DType values; the
// bindings admit no other).
template <template <class> class Fn, class... Args>
decltype(auto) call_for_dtype(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::kF16: return Fn<ElementOf<DType::kF16>::type>{}(std::forward<Args>(args)...);
    case DType::kBF16: return Fn<ElementOf<DType::kBF16>::type>{}(std::forward<Args>(args)...);
    case DType::kF32:
    default: return Fn<ElementOf<DType::kF32>::type>{}(std::forward<Args>(args)...);
  }
}

// Runs Fn<T>{}(params, stream) for the params' dtype and reports a launch error.
template <template <class> class Fn, class P>
LaunchResult dispatch_dtype(P const& p, cudaStream_t stream) {
  call_for_dtype<Fn>(p.dtype, p, stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  return {};
}

}  // namespace cutlass_ext
