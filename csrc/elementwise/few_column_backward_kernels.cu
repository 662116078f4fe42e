#include "elementwise/few_column_backward_kernels.h"

#include <algorithm>
#include <cstdint>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/device_utils.cuh"
#include "elementwise/column_sums.cuh"

namespace cutlass_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxThreadsX = 32;  // threads across a column chunk (the rest across rows)
constexpr int kMinBlocksPerSm = 2;

// The compile-time width of n output columns: 1, 4 or 16 (columns past n are zero).
int padded_n(int n) { return n <= 1 ? 1 : n <= 4 ? 4 : 16; }

// Elements of X per access: 16 bytes, fewer where W and the dW sums would pass 32 registers each.
template <class T, int kN>
constexpr int vec_for() { return vec_width<T>() < 32 / kN ? vec_width<T>() : 32 / kN; }

// Rows a thread has in flight at once.
template <int kN>
constexpr int row_unroll() { return kN == 1 ? 8 : 4; }

// Most rows of one dZ tile (ty * row_unroll): every thread row's for kN <= 4, 64 for kN = 16,
// whose block then has at least 16 threads across columns (shared memory: 2 x 4 KB of dZ).
template <int kN>
constexpr int max_tile_rows() { return kN == 16 ? 64 : kThreads * row_unroll<kN>(); }

// Block (tx, ty): tx threads across a chunk of tx * kVec columns of X, ty thread rows. Block
// (x, y) owns column chunk x and rows [y * rows_per_split, (y + 1) * rows_per_split), which it
// walks in tiles of ty * kRows rows (thread row j takes rows j, j + ty, ... of a tile). For each
// tile a thread first issues the loads of its rows of X, then the block computes the tile's dZ
// into shared memory (thread t computes elements t, t + kThreads, ...: all in column t % kN,
// whose bias-gradient share it keeps), so that both loads are in flight together; after one
// barrier each thread forms its dX columns and adds to its dW sums. dZ is computed once per row
// and column chunk: computed by every thread of a row it cost 3.4x the GEMM path's time at
// 65536 x 1024 -> 4 (GELU). The dZ tiles alternate between two buffers, so one barrier a tile
// suffices.
template <class T, int kN, int kVec>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
few_column_backward_kernel(FewColumnBackwardParams p) {
  constexpr int kRows = row_unroll<kN>();
  static_assert(kThreads % kN == 0, "a thread's dZ elements must share a column");
  __shared__ float dz_tile[2][max_tile_rows<kN>() * kN];
  __shared__ float db_scratch[kThreads];
  const int tx = blockDim.x, ty = blockDim.y;
  const int t = threadIdx.y * tx + threadIdx.x;
  const int tile_rows = ty * kRows;
  const int64_t col0 = int64_t(blockIdx.x) * tx * kVec;
  const int64_t col = col0 + int64_t(threadIdx.x) * kVec;
  const bool col_ok = col < p.k;  // kVec > 1 only where k is a multiple of kVec
  const int64_t row_begin = int64_t(blockIdx.y) * p.rows_per_split;
  const int64_t row_end = min(p.rows, row_begin + p.rows_per_split);
  const T* grad = static_cast<const T*>(p.grad);
  const T* saved = static_cast<const T*>(p.saved);
  const T* x = static_cast<const T*>(p.x);
  T* grad_x = static_cast<T*>(p.grad_x);
  const bool want_x = grad_x != nullptr && col_ok;
  const bool want_w = p.grad_w != nullptr && col_ok;

  // This thread's columns of W (zero past n), read once.
  float w[kN][kVec];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      w[n][i] = want_x && n < p.n ? float(static_cast<const T*>(p.w)[n * p.w_stride_n + (col + i) * p.w_stride_k])
                                  : 0.f;
    }
  }
  float acc[kN][kVec];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[n][i] = 0.f;
  }
  float db = 0.f;

  int buf = 0;
  for (int64_t tile0 = row_begin; tile0 < row_end; tile0 += tile_rows, buf ^= 1) {
    float xs[kRows][kVec];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t r = tile0 + threadIdx.y + u * ty;
      if (want_w && r < row_end) {
        if constexpr (kVec > 1) {
          load_vec<T, kVec>(x + r * p.x_stride_r + col, xs[u]);
        } else {
          xs[u][0] = float(x[r * p.x_stride_r + col * p.x_stride_k]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) xs[u][i] = 0.f;
      }
    }
    float* dz_rows = dz_tile[buf];
    for (int e = t; e < tile_rows * kN; e += kThreads) {
      const int64_t r = tile0 + e / kN;
      const int n = e % kN;
      float dz = 0.f;
      if (n < p.n && r < row_end) {
        const float g = float(grad[r * p.grad_stride_r + n * p.grad_stride_n]);
        const float s = saved != nullptr ? float(saved[r * p.saved_stride_r + n * p.saved_stride_n]) : 0.f;
        dz = act::backward_for<T>(p.activation, g, s);
      }
      dz_rows[e] = dz;
      db += dz;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int lr = threadIdx.y + u * ty;
      const int64_t r = tile0 + lr;
      float dz[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) dz[n] = dz_rows[lr * kN + n];  // zero past row_end
      if (want_x && r < row_end) {
        float out[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float v = 0.f;
#pragma unroll
          for (int n = 0; n < kN; ++n) v += dz[n] * w[n][i];
          out[i] = v;
        }
        store_vec<T, kVec>(grad_x + r * p.k + col, out);
      }
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[n][i] += dz[n] * xs[u][i];
      }
    }
  }

  const int64_t stride = p.n * p.k + p.n;  // one split's row of partials
  float* partials = p.partials + int64_t(blockIdx.y) * stride;
  if (p.grad_w != nullptr) {
    const int width = tx * kVec;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (n >= p.n) break;  // uniform over the block
      const float total = block_column_totals<kThreads, kVec>(acc[n]);
      if (t < width && col0 + t < p.k) {
        const int64_t at = n * p.grad_w_stride_n + (col0 + t) * p.grad_w_stride_k;
        if (p.splits == 1) {
          static_cast<T*>(p.grad_w)[at] = T(total);
        } else {
          partials[at] = total;
        }
      }
      __syncthreads();  // the next column's totals rewrite the shared sums
    }
  }
  if (p.grad_bias != nullptr && blockIdx.x == 0) {
    db_scratch[t] = db;
    __syncthreads();
    if (t < p.n) {
      float total = 0.f;
      for (int j = t; j < kThreads; j += kN) total += db_scratch[j];
      if (p.splits == 1) {
        static_cast<T*>(p.grad_bias)[t] = T(total);
      } else {
        partials[p.n * p.k + t] = total;
      }
    }
  }
}

// Second stage: column j of the partials (dW at its storage offset j < n * k, then dbias) added
// over the splits in a fixed order. Block (tx columns, ty split lanes).
template <class T>
__global__ void __launch_bounds__(kThreads) few_column_backward_finish_kernel(FewColumnBackwardParams p,
                                                                             int64_t begin, int64_t end) {
  const int64_t stride = p.n * p.k + p.n;
  const int64_t j0 = begin + int64_t(blockIdx.x) * blockDim.x;
  const int64_t j = j0 + threadIdx.x;
  float acc[1] = {0.f};
  if (j < end) {
#pragma unroll 4
    for (int s = threadIdx.y; s < p.splits; s += blockDim.y) acc[0] += p.partials[int64_t(s) * stride + j];
  }
  const float total = block_column_totals<kThreads, 1>(acc);
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  if (t >= int(blockDim.x) || j0 + t >= end) return;
  const int64_t at = j0 + t, nk = p.n * p.k;
  if (at < nk) {
    static_cast<T*>(p.grad_w)[at] = T(total);
  } else {
    static_cast<T*>(p.grad_bias)[at - nk] = T(total);
  }
}

using KernelFn = void (*)(FewColumnBackwardParams);

// 16-byte (or kVec-element) accesses to X and dX where their rows and bases allow them.
template <class T, int kN>
bool vectorizable(FewColumnBackwardParams const& p) {
  constexpr int kVec = vec_for<T, kN>();
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * kVec) == 0; };
  return p.k % kVec == 0 &&
         (p.grad_w == nullptr || (p.x_stride_k == 1 && p.x_stride_r % kVec == 0 && aligned(p.x))) &&
         (p.grad_x == nullptr || aligned(p.grad_x));
}

// Resident blocks of a kernel per SM, asked once per instantiation.
template <class T, int kN, int kVec>
int resident_blocks() {
  static const int blocks =
      std::max(1, resident_blocks_per_sm(reinterpret_cast<const void*>(few_column_backward_kernel<T, kN, kVec>),
                                         kThreads, 0));
  return blocks;
}

struct Choice {
  KernelFn kernel;
  int vec;
  int rows;     // rows a thread has in flight
  int min_tx;   // threads across columns at least (max_tile_rows)
  int resident;
};

template <class T, int kN>
Choice choose_n(FewColumnBackwardParams const& p) {
  constexpr int kVec = vec_for<T, kN>();
  constexpr int kMinTx = kThreads * row_unroll<kN>() / max_tile_rows<kN>();
  if (vectorizable<T, kN>(p)) {
    return {few_column_backward_kernel<T, kN, kVec>, kVec, row_unroll<kN>(), kMinTx, resident_blocks<T, kN, kVec>()};
  }
  return {few_column_backward_kernel<T, kN, 1>, 1, row_unroll<kN>(), kMinTx, resident_blocks<T, kN, 1>()};
}

template <class T>
struct ChooseFn {
  Choice operator()(FewColumnBackwardParams const& p) const {
    switch (padded_n(p.n)) {
      case 1: return choose_n<T, 1>(p);
      case 4: return choose_n<T, 4>(p);
      default: return choose_n<T, 16>(p);
    }
  }
};

Choice choose_for(FewColumnBackwardParams const& p) { return call_for_dtype<ChooseFn>(p.dtype, p); }

dim3 block_of(FewColumnBackwardParams const& p, Choice const& c) {
  const int tx = int(std::clamp<int64_t>(pow2_at_least(ceil_div(p.k, c.vec)), c.min_tx, kMaxThreadsX));
  return dim3(unsigned(tx), unsigned(kThreads / tx));
}

template <class T>
struct FinishFn {
  void operator()(FewColumnBackwardParams const& p, cudaStream_t stream) const {
    const int64_t nk = p.n * p.k;
    const int64_t begin = p.grad_w != nullptr ? 0 : nk;
    const int64_t end = p.grad_bias != nullptr ? nk + p.n : nk;
    // Narrow column groups where the columns are few, so that more blocks share the splits.
    const int tx = end - begin >= 8192 ? 32 : 8;
    const int64_t blocks = ceil_div(end - begin, tx);
    few_column_backward_finish_kernel<T>
        <<<unsigned(blocks), dim3(unsigned(tx), unsigned(kThreads / tx)), 0, stream>>>(p, begin, end);
  }
};

}  // namespace

void plan_few_column_backward(FewColumnBackwardParams& p, int sm_count) {
  const Choice c = choose_for(p);
  const dim3 block = block_of(p, c);
  const int64_t tile_rows = int64_t(block.y) * c.rows;  // rows the block has in flight
  const int64_t col_blocks = ceil_div(p.k, int64_t(block.x) * c.vec);
  const int64_t tiles = ceil_div(std::max<int64_t>(p.rows, 1), tile_rows);
  const int64_t target = int64_t(c.resident) * std::max(sm_count, 1);
  const int64_t splits = std::clamp<int64_t>(std::min(ceil_div(target, col_blocks), tiles), 1, 65535);
  p.rows_per_split = ceil_div(tiles, splits) * tile_rows;
  p.splits = int(ceil_div(std::max<int64_t>(p.rows, 1), p.rows_per_split));
}

LaunchResult few_column_backward(FewColumnBackwardParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.k == 0 || p.n < 1 || p.n > kFewColumnBackwardMaxN) return {"launch", "unsupported shape"};
  const Choice c = choose_for(p);
  const dim3 block = block_of(p, c);
  const int64_t col_blocks = ceil_div(p.k, int64_t(block.x) * c.vec);
  c.kernel<<<dim3(unsigned(col_blocks), unsigned(p.splits)), block, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  if (p.splits == 1 || (p.grad_w == nullptr && p.grad_bias == nullptr)) return {};
  return dispatch_dtype<FinishFn>(p, stream);
}

}  // namespace cutlass_ext
