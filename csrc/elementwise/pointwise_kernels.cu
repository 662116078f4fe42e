#include "elementwise/pointwise_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/dependent_launch.h"
#include "common/device_utils.cuh"
#include "common/resident_blocks.h"
#include "common/row_splits.h"
#include "elementwise/reduce_kernels.h"

namespace cutlass_ext {
namespace {

constexpr int kThreads = 256;
// Resident 256-thread blocks per SM the forward asks of the compiler: 8 (full occupancy, at most
// 32 registers a thread) where the activation is a compare or nothing; the transcendental ones
// spilled at 32 registers and get 40 (6 blocks).
constexpr int forward_min_blocks(int act) {
  return act == int(Activation::kRelu) || act == int(Activation::kNone) ? 8 : 6;
}
constexpr int kMinRowsPerSplit = 32;

// Threads of a 256-thread block across columns (each owns kVec adjacent columns); the rest of the
// block spans rows. Narrow matrices get fewer column threads, so no warp idles on short rows.
dim3 column_block(int64_t col_vecs) {
  const int tx = int(std::min<int64_t>(32, pow2_at_least(col_vecs)));
  return dim3(unsigned(tx), unsigned(kThreads / tx));
}

// ------------------------------------------------------------------------------------------------
// bias_act forward

// kN rows r, r + step, ..., of one thread's column chunk: every load is issued before any math.
template <int kN, int kAct, bool kResidual, class T, int kVec>
__device__ __forceinline__ void bias_act_rows(BiasActParams const& p, const T* __restrict__ x,
                                              const T* __restrict__ res, T* __restrict__ y,
                                              Pack<T, kVec> const& bias, int64_t r, int64_t step) {
  Pack<T, kVec> xv[kN], rv[kResidual ? kN : 1];
#pragma unroll
  for (int u = 0; u < kN; ++u) xv[u] = load_pack<T, kVec>(x + (r + u * step) * p.x_ld);
  if constexpr (kResidual) {
#pragma unroll
    for (int u = 0; u < kN; ++u) rv[u] = load_pack<T, kVec>(res + (r + u * step) * p.residual_ld);
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    Pack<T, kVec> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float z = fmaf(p.scale, float(xv[u].v[i]), float(bias.v[i]));
      if constexpr (kResidual) z += float(rv[u].v[i]);
      out.v[i] = T(act::forward_for<T>(kAct, z));
    }
    store_pack<T, kVec>(y + (r + u * step) * p.cols, out);
  }
}

// The bias vector of columns [col, col + kVec), zeros where the op has no bias.
template <class T, int kVec>
__device__ __forceinline__ Pack<T, kVec> bias_pack(BiasActParams const& p, int64_t col) {
  Pack<T, kVec> bias;
  if (p.bias != nullptr) {
    bias = load_pack<T, kVec>(static_cast<const T*>(p.bias) + col);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) bias.v[i] = T(0.f);
  }
  return bias;
}

// Rows apart (a strided x or residual; rows one after another take the flat kernel below): one
// 16-byte vector (kVec columns of one row) per thread and a grid that covers the matrix, striding
// over rows only past 65535 row blocks. Measured on an H200 (bench/NOTES.md section 14):
// a persistent grid whose threads walked their column 4 rows at a time held 65-70 registers (37.5%
// occupancy) and streamed ~3.3 TB/s, where torch.compile's one-vector-per-thread kernel ran at full
// occupancy and 4.1 TB/s. (Written as the one-row case of bias_act_rows: the loop written out
// directly compiled to up to 10 more registers and spilled in the fp32 residual kernels.)
template <class T, int kVec, int kAct, bool kResidual>
__global__ void __launch_bounds__(kThreads, forward_min_blocks(kAct)) bias_act_forward_kernel(BiasActParams p) {
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (col >= p.cols) return;
  const T* x = static_cast<const T*>(p.x) + col;
  const T* res = kResidual ? static_cast<const T*>(p.residual) + col : nullptr;
  T* y = static_cast<T*>(p.y) + col;
  const Pack<T, kVec> bias = bias_pack<T, kVec>(p, col);
  const int64_t step = blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * step + threadIdx.y; r < p.rows; r += int64_t(gridDim.y) * step) {
    bias_act_rows<1, kAct, kResidual, T, kVec>(p, x, res, y, bias, r, step);
  }
}

// Rows stored one after another (x, residual and y all of pitch cols): one vector a thread over the
// flat matrix, as add_kernel reads, each thread's bias vector at its index modulo the row's
// vectors. The 2-D grid above gives each warp its own row, so a block reads rows apart. Measured
// on an H200, bf16, CUDA graphs (bench/NOTES.md section 77): 1.02-1.10x the 2-D grid from 2^19
// elements (bias+ReLU 512x262144 1.04x, 8192x3000 1.06x; bias+SiLU 1.04-1.10x; bias+GELU+residual
// 1.03-1.06x), a tie at 1024x1024.
template <class T, int kVec, int kAct, bool kResidual>
__global__ void __launch_bounds__(kThreads, forward_min_blocks(kAct))
    bias_act_flat_kernel(BiasActParams p, uint32_t row_vectors, uint32_t vectors) {
  const uint32_t v = blockIdx.x * kThreads + threadIdx.x;
  if (v >= vectors) return;
  const int64_t at = int64_t(v) * kVec;
  const Pack<T, kVec> bias = bias_pack<T, kVec>(p, int64_t(v % row_vectors) * kVec);
  bias_act_rows<1, kAct, kResidual, T, kVec>(p, static_cast<const T*>(p.x) + at,
                                             kResidual ? static_cast<const T*>(p.residual) + at : nullptr,
                                             static_cast<T*>(p.y) + at, bias, 0, 0);
}

// relu's forward when a backward follows: y as above and the backward's mask, one bit an element
// of y (z > 0, so NaN gives 0 as relu's derivative does). The backward then reads dy and 1/8 byte
// an element where it read dy and x (and the residual). A thread's kVec bits go to their place in
// the 32-bit word that 32 / kVec adjacent lanes share; shuffles OR them across those lanes (a
// ballot for kVec = 1) and the group's first lane stores the word. x and the residual may have a
// row stride: a thread's row and column come from its vector index. One launch covers `vectors`
// vectors of a chunk of rows whose first element starts a mask word.
template <class T, int kVec, bool kResidual>
__global__ void __launch_bounds__(kThreads, 8)
    bias_relu_mask_kernel(BiasActParams p, uint32_t row_vectors, uint32_t vectors) {
  constexpr int kGroup = 32 / kVec;  // lanes that share a mask word
  const uint32_t v = blockIdx.x * kThreads + threadIdx.x;
  uint32_t bits = 0;
  if (v < vectors) {
    const uint32_t r = v / row_vectors;
    const int64_t col = int64_t(v - r * row_vectors) * kVec;
    const Pack<T, kVec> bias = bias_pack<T, kVec>(p, col);
    const Pack<T, kVec> xv = load_pack<T, kVec>(static_cast<const T*>(p.x) + r * p.x_ld + col);
    Pack<T, kVec> rv;
    if constexpr (kResidual) rv = load_pack<T, kVec>(static_cast<const T*>(p.residual) + r * p.residual_ld + col);
    Pack<T, kVec> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float z = fmaf(p.scale, float(xv.v[i]), float(bias.v[i]));
      if constexpr (kResidual) z += float(rv.v[i]);
      out.v[i] = T(act::relu(z));
      bits |= uint32_t(z > 0.f) << i;
    }
    store_pack<T, kVec>(static_cast<T*>(p.y) + int64_t(v) * kVec, out);
  }
  const int lane = threadIdx.x % 32;
  uint32_t word;
  if constexpr (kVec == 1) {
    word = __ballot_sync(0xffffffffu, bits != 0);
  } else {
    word = bits << ((lane % kGroup) * kVec);
#pragma unroll
    for (int d = 1; d < kGroup; d *= 2) word |= __shfl_xor_sync(0xffffffffu, word, d);
  }
  // A group whose first vector is past the end starts past the last word (vectors start words).
  if (lane % kGroup == 0 && v < vectors) p.mask[(int64_t(v) * kVec) / 32] = word;
}

// Rows a launch of bias_relu_mask_kernel may take: all of them where their vectors fit 32-bit
// indices, else a multiple of 32 that fits (so each launch starts a mask word; with rows of at most
// kMaxMaskCols elements, at least 32 fit).
int64_t mask_chunk_rows(int64_t rows, int64_t row_vectors) {
  constexpr int64_t kMaxVectors = int64_t(1) << 31;
  if (rows * row_vectors <= kMaxVectors) return rows;
  return kMaxVectors / row_vectors / 32 * 32;
}

template <class T, int kVec>
void launch_bias_relu_mask(BiasActParams const& p, cudaStream_t stream) {
  const int64_t row_vectors = p.cols / kVec;
  const int64_t chunk = mask_chunk_rows(p.rows, row_vectors);
  auto* kernel = p.residual != nullptr ? bias_relu_mask_kernel<T, kVec, true> : bias_relu_mask_kernel<T, kVec, false>;
  for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
    BiasActParams q = p;
    q.rows = std::min(chunk, p.rows - r0);
    q.x = static_cast<const T*>(p.x) + r0 * p.x_ld;
    if (p.residual != nullptr) q.residual = static_cast<const T*>(p.residual) + r0 * p.residual_ld;
    q.y = static_cast<T*>(p.y) + r0 * p.cols;
    q.mask = p.mask + r0 * p.cols / 32;
    const int64_t vectors = q.rows * row_vectors;
    kernel<<<unsigned(ceil_div(vectors, int64_t(kThreads))), kThreads, 0, stream>>>(q, uint32_t(row_vectors),
                                                                                    uint32_t(vectors));
  }
}

template <class T, int kVec>
void launch_bias_act_forward_vec(BiasActParams const& p, cudaStream_t stream) {
  if (p.mask != nullptr) return launch_bias_relu_mask<T, kVec>(p, stream);
  const int64_t vectors = p.rows * p.cols / kVec;
  const bool flat = p.x_ld == p.cols && (p.residual == nullptr || p.residual_ld == p.cols) &&
                    vectors <= int64_t(UINT32_MAX) - kThreads;
  const bool residual = p.residual != nullptr;
  dispatch_activation(p.activation, [&](auto kind) {
    constexpr int kAct = decltype(kind)::value;
    if (flat) {
      auto* kernel = residual ? bias_act_flat_kernel<T, kVec, kAct, true> : bias_act_flat_kernel<T, kVec, kAct, false>;
      kernel<<<unsigned(ceil_div(vectors, int64_t(kThreads))), kThreads, 0, stream>>>(p, uint32_t(p.cols / kVec),
                                                                                      uint32_t(vectors));
    } else {
      const dim3 block = column_block(p.cols / kVec);
      const int64_t col_blocks = ceil_div(p.cols / kVec, block.x);
      const int64_t row_blocks = std::min<int64_t>(ceil_div(p.rows, block.y), 65535);
      const dim3 grid{unsigned(col_blocks), unsigned(std::max<int64_t>(row_blocks, 1))};
      auto* kernel = residual ? bias_act_forward_kernel<T, kVec, kAct, true> : bias_act_forward_kernel<T, kVec, kAct, false>;
      kernel<<<grid, block, 0, stream>>>(p);
    }
  });
}

template <class T>
struct BiasActForwardFn {
  void operator()(BiasActParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    const bool vectorizable = p.cols % kVec == 0 && aligned16(p.x) && p.x_ld % kVec == 0 && aligned16(p.y) &&
                              (p.bias == nullptr || aligned16(p.bias)) &&
                              (p.residual == nullptr || (aligned16(p.residual) && p.residual_ld % kVec == 0));
    if (vectorizable) {
      launch_bias_act_forward_vec<T, kVec>(p, stream);
    } else {
      launch_bias_act_forward_vec<T, 1>(p, stream);
    }
  }
};

// ------------------------------------------------------------------------------------------------
// bias_act backward

// kMask: relu from the forward's mask (bits col .. col + kVec - 1 of the row's flat index, which
// never straddle a word: the vector path has cols % kVec == 0) in place of z.
template <int kN, int kAct, bool kMask, class T, int kVec>
__device__ __forceinline__ void bias_act_backward_rows(BiasActBackwardParams const& p, int64_t col, const float* b,
                                                       int64_t r, int64_t step, float* acc) {
  constexpr bool kNeedZ = kAct != int(Activation::kNone) && !kMask;
  const T* __restrict__ grad = static_cast<const T*>(p.grad) + col;
  const T* __restrict__ x = static_cast<const T*>(p.x) + col;
  const T* __restrict__ res = p.residual != nullptr ? static_cast<const T*>(p.residual) + col : nullptr;
  Pack<T, kVec> gv[kN], xv[kN], rv[kN];
  uint32_t mv[kN];
#pragma unroll
  for (int u = 0; u < kN; ++u) gv[u] = load_pack<T, kVec>(grad + (r + u * step) * p.grad_ld);
  if constexpr (kMask) {
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      const int64_t e = (r + u * step) * p.cols + col;
      mv[u] = __ldg(p.mask + e / 32) >> (e % 32);
    }
  }
  if constexpr (kNeedZ) {
#pragma unroll
    for (int u = 0; u < kN; ++u) xv[u] = load_pack<T, kVec>(x + (r + u * step) * p.x_ld);
    if (res != nullptr) {
#pragma unroll
      for (int u = 0; u < kN; ++u) rv[u] = load_pack<T, kVec>(res + (r + u * step) * p.residual_ld);
    }
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    Pack<T, kVec> dx, dres;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float z = 0.f;
      if constexpr (kNeedZ) {
        z = fmaf(p.scale, float(xv[u].v[i]), b[i]);
        if (res != nullptr) z += float(rv[u].v[i]);
      }
      // relu's backward tests saved > 0, which holds for z exactly where it holds for y.
      float dz;
      if constexpr (kMask) {
        dz = (mv[u] >> i) & 1u ? float(gv[u].v[i]) : 0.f;
      } else {
        dz = act::backward_for<T>(kAct, float(gv[u].v[i]), z);
      }
      acc[i] += dz;
      dx.v[i] = T(p.scale * dz);
      dres.v[i] = T(dz);
    }
    const int64_t offset = (r + u * step) * p.cols + col;
    if (p.grad_x != nullptr) store_pack<T, kVec>(static_cast<T*>(p.grad_x) + offset, dx);
    if (p.grad_residual != nullptr) store_pack<T, kVec>(static_cast<T*>(p.grad_residual) + offset, dres);
  }
}

template <class T, int kVec, int kAct, int kUnroll, bool kMask = false>
__global__ void __launch_bounds__(kThreads) bias_act_backward_kernel(BiasActBackwardParams p, int64_t rows_per_split) {
  __shared__ float sums[kThreads * kVec];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t col = (int64_t(blockIdx.x) * tx + threadIdx.x) * kVec;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_split;
  const int64_t row_end = min(p.rows, row_begin + rows_per_split);

  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
  if (col < p.cols) {
    float b[kVec];
    if (kAct != int(Activation::kNone) && !kMask && p.bias != nullptr) {
      const Pack<T, kVec> bv = load_pack<T, kVec>(static_cast<const T*>(p.bias) + col);
#pragma unroll
      for (int i = 0; i < kVec; ++i) b[i] = float(bv.v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) b[i] = 0.f;
    }
    int64_t r = row_begin + threadIdx.y;
    for (; r + (kUnroll - 1) * ty < row_end; r += kUnroll * ty) {
      bias_act_backward_rows<kUnroll, kAct, kMask, T, kVec>(p, col, b, r, ty, acc);
    }
    for (; r < row_end; r += ty) bias_act_backward_rows<1, kAct, kMask, T, kVec>(p, col, b, r, ty, acc);
  }
  if (p.grad_bias == nullptr) return;
  if (p.row_splits > 1) allow_dependent_launch();  // sum_partials may be scheduled

  // Column sums of the block: thread row 0 adds the ty partial sums in a fixed order.
#pragma unroll
  for (int i = 0; i < kVec; ++i) sums[(threadIdx.y * kVec + i) * tx + threadIdx.x] = acc[i];
  __syncthreads();
  if (threadIdx.y != 0 || col >= p.cols) return;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    float total = 0.f;
    for (int y = 0; y < ty; ++y) total += sums[(y * kVec + i) * tx + threadIdx.x];
    if (p.row_splits == 1) {
      static_cast<T*>(p.grad_bias)[col + i] = T(total);
    } else {
      p.partials[int64_t(blockIdx.y) * p.cols + col + i] = total;
    }
  }
}

using BackwardKernel = void (*)(BiasActBackwardParams, int64_t);

// The kernel for an activation. Each thread loads two rows before their math, except for a
// transcendental activation of 16-bit data in 16-byte vectors without a residual, which loads
// one: there the math limits the kernel, and one row holds 58-64 registers (4 blocks an SM) where
// two hold 65-80 (3). On an H200 (bench/NOTES.md section 42) bias+SiLU forward+backward ran
// 1.10-1.15x faster with one; bias+GELU+residual (a third stream to load) ran 1-2% slower, so it
// keeps two, as do the scalar kernels (30-42 registers, not measured with one). relu from its
// mask keeps two rows for fp32 (40 registers, six blocks an SM) and one for 16-bit vectors (40
// registers and six blocks, where two held 58 and four): on an H200 (bench/NOTES.md section 80)
// bf16 forward+backward ran 1.6-3.5% faster with one and fp32 0-1% slower.
template <class T, int kVec>
BackwardKernel backward_kernel(int activation, bool residual, bool mask) {
  if (mask) {
    constexpr int kMaskRows = sizeof(T) == 2 && kVec > 1 ? 1 : 2;
    return bias_act_backward_kernel<T, kVec, int(Activation::kRelu), kMaskRows, true>;
  }
  BackwardKernel kernel = nullptr;
  dispatch_activation(activation, [&](auto kind) {
    constexpr int kAct = decltype(kind)::value;
    constexpr bool kTranscendental = kAct != int(Activation::kRelu) && kAct != int(Activation::kNone);
    if constexpr (kTranscendental && sizeof(T) == 2 && kVec > 1) {
      kernel = residual ? bias_act_backward_kernel<T, kVec, kAct, 2> : bias_act_backward_kernel<T, kVec, kAct, 1>;
    } else {
      kernel = bias_act_backward_kernel<T, kVec, kAct, 2>;
    }
  });
  return kernel;
}

template <class T, int kVec>
void launch_bias_act_backward_vec(BiasActBackwardParams const& p, cudaStream_t stream) {
  const dim3 block = column_block(p.cols / kVec);
  const int64_t col_blocks = ceil_div(p.cols / kVec, block.x);
  const int64_t rows_per_split = ceil_div(p.rows, p.row_splits);
  const dim3 grid{unsigned(col_blocks), unsigned(p.row_splits)};
  backward_kernel<T, kVec>(p.activation, p.residual != nullptr, p.mask != nullptr)<<<grid, block, 0, stream>>>(
      p, rows_per_split);
}

template <class T>
struct BiasActBackwardFn {
  void operator()(BiasActBackwardParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    const bool reads_z = p.activation != int(Activation::kNone) && p.mask == nullptr;
    const bool vectorizable =
        p.cols % kVec == 0 && aligned16(p.grad) && p.grad_ld % kVec == 0 &&
        (!reads_z || (aligned16(p.x) && p.x_ld % kVec == 0 && (p.bias == nullptr || aligned16(p.bias)) &&
                      (p.residual == nullptr || (aligned16(p.residual) && p.residual_ld % kVec == 0)))) &&
        (p.grad_x == nullptr || aligned16(p.grad_x)) && (p.grad_residual == nullptr || aligned16(p.grad_residual));
    if (vectorizable) {
      launch_bias_act_backward_vec<T, kVec>(p, stream);
    } else {
      launch_bias_act_backward_vec<T, 1>(p, stream);
    }
  }
};

// Blocks of the vectorized backward kernel that fit one SM of `device` (3 or 4 for 16-bit data).
template <class T>
struct BackwardResidentFn {
  int operator()(int activation, bool residual, bool mask, int device) const {
    return cached_resident_blocks(
        reinterpret_cast<const void*>(backward_kernel<T, vec_width<T>()>(activation, residual, mask)), kThreads, 0,
        device);
  }
};

// ------------------------------------------------------------------------------------------------
// add

template <class T, int kVec>
__device__ __forceinline__ void add_vector(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                           int64_t v) {
  const Pack<T, kVec> av = load_pack<T, kVec>(a + v * kVec), bv = load_pack<T, kVec>(b + v * kVec);
  Pack<T, kVec> o;
#pragma unroll
  for (int i = 0; i < kVec; ++i) o.v[i] = T(float(av.v[i]) + float(bv.v[i]));
  store_pack<T, kVec>(out + v * kVec, o);
}

// One kVec-element vector per thread, a grid that covers the tensor; the numel % kVec tail goes
// to the first threads. A grid of resident blocks striding with four vectors in flight per thread
// measured 4% slower on an H200 (2^27 bf16 elements: 196 against 188 us; bench/NOTES.md section 27).
template <class T, int kVec>
__global__ void __launch_bounds__(kThreads) add_kernel(const T* a, const T* b, T* out, int64_t n) {
  const int64_t vectors = n / kVec;
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v < vectors) add_vector<T, kVec>(a, b, out, v);
  const int64_t tail = vectors * kVec + v;
  if (kVec > 1 && tail < n) out[tail] = T(float(a[tail]) + float(b[tail]));
}

template <class T>
struct AddFn {
  void operator()(AddParams const& p, cudaStream_t stream) const {
    constexpr int kVec = vec_width<T>();
    const T* a = static_cast<const T*>(p.a);
    const T* b = static_cast<const T*>(p.b);
    T* out = static_cast<T*>(p.out);
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
      launch<kVec>(a, b, out, p, stream);
    } else {
      launch<1>(a, b, out, p, stream);
    }
  }

  template <int kVec>
  static void launch(const T* a, const T* b, T* out, AddParams const& p, cudaStream_t stream) {
    const int64_t blocks = std::max<int64_t>(1, ceil_div(p.numel / kVec, kThreads));
    add_kernel<T, kVec><<<unsigned(blocks), kThreads, 0, stream>>>(a, b, out, p.numel);
  }
};

}  // namespace

LaunchResult bias_act_forward(BiasActParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  if (p.mask != nullptr) {
    if (p.activation != int(Activation::kRelu)) return {"launch", "the mask is relu's only"};
    if (p.cols > kMaxMaskCols) return {"launch", "rows longer than 2^26 elements have no masked kernel"};
  }
  return dispatch_dtype<BiasActForwardFn>(p, stream);
}

int bias_act_backward_row_splits(int64_t rows, int64_t cols, DType dtype, int activation, bool residual, bool mask,
                                 int sm_count, int device) {
  const int vec = dtype == DType::kF32 ? 4 : 8;
  const int64_t col_vecs = ceil_div(cols, int64_t(vec));
  const int64_t col_blocks = ceil_div(col_vecs, int64_t(column_block(col_vecs).x));
  const int resident = call_for_dtype<BackwardResidentFn>(dtype, activation, residual, mask, device);
  const int64_t wave = int64_t(resident) * std::max(sm_count, 1);
  return wave_row_splits(col_blocks, wave, std::max<int64_t>(1, rows / kMinRowsPerSplit));
}

LaunchResult bias_act_backward(BiasActBackwardParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  const LaunchResult r = dispatch_dtype<BiasActBackwardFn>(p, stream);
  if (!r.ok() || p.grad_bias == nullptr || p.row_splits == 1) return r;
  return sum_partials(p.partials, 1, p.row_splits, p.cols, p.dtype, p.grad_bias, stream);
}

LaunchResult add(AddParams const& p, cudaStream_t stream) {
  if (p.numel == 0) return {};
  return dispatch_dtype<AddFn>(p, stream);
}

}  // namespace cutlass_ext
