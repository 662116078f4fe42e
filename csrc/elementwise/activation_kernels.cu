#include "elementwise/activation_kernels.h"

#include <algorithm>
#include <cstdint>

#include "common/activation.h"
#include "common/activation_16bit.h"
#include "common/dependent_launch.h"
#include "common/device_utils.cuh"
#include "common/resident_blocks.h"
#include "common/row_splits.h"
#include "elementwise/column_sums.cuh"
#include "elementwise/reduce_kernels.h"

namespace cutlass_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxThreadsX = 32;     // threads across columns (each owns kVec adjacent columns)
constexpr int kMinRowsPerThread = 2;  // rows each thread walks at least, in a split

// Threads across columns for `cols` columns of `vec`-wide vectors: up to a warp, no more than
// the row has vectors (a 16-column row has two), the rest of the block across rows.
int threads_x(int64_t cols, int vec) { return column_threads(ceil_div(cols, vec), kMaxThreadsX); }

// Block (tx, ty) with tx * ty = kThreads: tx threads across columns, ty across rows. Each thread
// adds its rows' dZ into fp32 sums; the block adds its ty rows of sums in a fixed order
// (block_column_totals).
template <class T, int kVec, int kKind>
__global__ void __launch_bounds__(kThreads)
act_grad_kernel(ActGradParams p, int64_t rows_per_split) {
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t col0 = (int64_t(blockIdx.x) * tx + threadIdx.x) * kVec;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_split;
  const int64_t row_end = min(p.rows, row_begin + rows_per_split);
  const T* grad = static_cast<const T*>(p.grad);
  const T* saved = static_cast<const T*>(p.saved);
  T* grad_input = static_cast<T*>(p.grad_input);

  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;

  if (col0 < p.cols) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += ty) {
      Pack<T, kVec> g = *reinterpret_cast<const Pack<T, kVec>*>(grad + r * p.grad_ld + col0);
      Pack<T, kVec> s;
      if constexpr (kKind != int(Activation::kNone)) {
        s = *reinterpret_cast<const Pack<T, kVec>*>(saved + r * p.saved_ld + col0);
      }
      Pack<T, kVec> out;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        float s_i = 0.f;
        if constexpr (kKind != int(Activation::kNone)) s_i = float(s.v[i]);
        const float dz = act::backward_for<T>(kKind, float(g.v[i]), s_i);
        out.v[i] = T(dz);
        acc[i] += dz;
      }
      if (grad_input != nullptr) {
        *reinterpret_cast<Pack<T, kVec>*>(grad_input + r * p.grad_input_ld + col0) = out;
      }
    }
  }
  if (p.grad_bias == nullptr) return;
  if (p.row_splits > 1) allow_dependent_launch();  // sum_partials may be scheduled

  const int width = tx * kVec;
  const float total = block_column_totals<kThreads, kVec>(acc);
  const int t = threadIdx.y * tx + threadIdx.x;
  const int64_t col = int64_t(blockIdx.x) * width + t;
  if (t >= width || col >= p.cols) return;
  if (p.row_splits == 1) {
    static_cast<T*>(p.grad_bias)[col] = T(total);
  } else {
    p.partials[int64_t(blockIdx.y) * p.cols + col] = total;
  }
}

template <class T, int kVec, int kKind>
void launch_act_grad_kind(ActGradParams const& p, cudaStream_t stream) {
  const int tx = threads_x(p.cols, kVec);
  const int64_t col_blocks = ceil_div(p.cols, int64_t(tx) * kVec);
  const int64_t rows_per_split = ceil_div(p.rows, p.row_splits);
  const dim3 grid(unsigned(col_blocks), unsigned(p.row_splits));
  act_grad_kernel<T, kVec, kKind><<<grid, dim3(tx, kThreads / tx), 0, stream>>>(p, rows_per_split);
}

template <class T, int kVec>
void launch_act_grad_vec(ActGradParams const& p, cudaStream_t stream) {
  dispatch_activation(p.activation,
                      [&](auto kind) { launch_act_grad_kind<T, kVec, decltype(kind)::value>(p, stream); });
}

// 16-byte loads and stores where every matrix's rows and base allow them.
template <class T>
bool act_grad_vectorizable(ActGradParams const& p) {
  constexpr int kVec = vec_width<T>();
  const bool saved_used = p.activation != int(Activation::kNone);
  return p.cols % kVec == 0 && p.grad_ld % kVec == 0 && aligned16(p.grad) &&
         (!saved_used || (p.saved_ld % kVec == 0 && aligned16(p.saved))) &&
         (p.grad_input == nullptr || (p.grad_input_ld % kVec == 0 && aligned16(p.grad_input)));
}

template <class T>
void launch_act_grad(ActGradParams const& p, cudaStream_t stream) {
  constexpr int kVec = vec_width<T>();
  if (act_grad_vectorizable<T>(p)) {
    launch_act_grad_vec<T, kVec>(p, stream);
  } else {
    launch_act_grad_vec<T, 1>(p, stream);
  }
}

template <class T, int kKind>
__global__ void activation_forward_kernel(const T* in, T* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = T(act::forward_for<T>(kKind, float(in[i])));
  }
}

template <class T, int kKind>
void launch_activation_forward_kind(ActForwardParams const& p, cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((p.numel + threads - 1) / threads, 65535);
  activation_forward_kernel<T, kKind><<<unsigned(blocks), threads, 0, stream>>>(
      static_cast<const T*>(p.input), static_cast<T*>(p.output), p.numel);
}

template <class T>
void launch_activation_forward(ActForwardParams const& p, cudaStream_t stream) {
  dispatch_activation(p.activation,
                      [&](auto kind) { launch_activation_forward_kind<T, decltype(kind)::value>(p, stream); });
}

// Blocks of the vectorized kernel for an activation that fit one SM of `device` (5 or 6: 38-48
// registers).
template <class T>
struct ActGradResidentFn {
  int operator()(int activation, int device) const {
    int blocks = 1;
    dispatch_activation(activation, [&](auto kind) {
      blocks = cached_resident_blocks(
          reinterpret_cast<const void*>(act_grad_kernel<T, vec_width<T>(), decltype(kind)::value>), kThreads, 0,
          device);
    });
    return blocks;
  }
};

template <class T>
struct ActGradFn {
  void operator()(ActGradParams const& p, cudaStream_t s) const { launch_act_grad<T>(p, s); }
};
template <class T>
struct ActForwardFn {
  void operator()(ActForwardParams const& p, cudaStream_t s) const { launch_activation_forward<T>(p, s); }
};

}  // namespace

int act_grad_row_splits(int64_t rows, int64_t cols, DType dtype, int activation, int sm_count, int device) {
  const int vec = dtype == DType::kF32 ? 4 : 8;
  const int tx = threads_x(cols, vec);
  const int64_t col_blocks = ceil_div(cols, int64_t(tx) * vec);
  const int64_t wave = int64_t(call_for_dtype<ActGradResidentFn>(dtype, activation, device)) * std::max(sm_count, 1);
  const int64_t max_splits = std::max<int64_t>(1, rows / (int64_t(kThreads / tx) * kMinRowsPerThread));
  return wave_row_splits(col_blocks, wave, max_splits);
}

LaunchResult act_grad(ActGradParams const& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return {};
  const LaunchResult r = dispatch_dtype<ActGradFn>(p, stream);
  if (!r.ok() || p.grad_bias == nullptr || p.row_splits == 1) return r;
  // The splits' column partials, added in a fixed order.
  return sum_partials(p.partials, 1, p.row_splits, p.cols, p.dtype, p.grad_bias, stream);
}

LaunchResult activation_forward(ActForwardParams const& p, cudaStream_t stream) {
  if (p.numel == 0) return {};
  return dispatch_dtype<ActForwardFn>(p, stream);
}

}  // namespace cutlass_ext
