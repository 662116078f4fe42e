#include "gemm/rank_pass.h"

#include <algorithm>

#include "common/dependent_launch.h"
#include "common/device_utils.cuh"
#include "gemm/mma_sync.cuh"

namespace cutlass_ext {
namespace {

// A block owns a 512-column slab of X and a range of its rows, which it walks in 128-row blocks,
// each as four 128 x 128 tiles (one pipeline stage each, so a tile's stage is its column index
// in the slab). Warp w multiplies rows 16w.. of every tile by P's rows for the tile's columns
// (mma.sync, X as the A operand, K along the columns), so that after a row block's four tiles it
// holds its 16 rows' sums over the slab; and columns 16w.. of every tile, transposed (ldmatrix
// .trans), by Q's rows for the block's rows, accumulating its 16 columns' sums over the block's
// whole row range. No sum crosses warps, and the only barrier is the pipeline's, once a tile.
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRb = 128, kCt = 128, kTilesPerSlab = 4, kNt = kCt * kTilesPerSlab, kStages = kTilesPerSlab;
static_assert(kRb == 16 * kWarps && kCt == 16 * kWarps, "a warp owns 16 rows and 16 columns of a tile");
// Shared rows padded by one 16-byte piece, so that the eight rows an ldmatrix phase reads start
// on distinct banks.
constexpr int kXRow = kCt + 8, kQRow = kRb + 8, kPRow = kNt + 8;
constexpr int kXStage = kRb * kXRow;

// P's slab in shared memory: K-major as [j][column] (kPRow a row), or N-major as [column][j]
// (p_row_n a row), whichever P's unit stride allows to be copied in 16-byte pieces.
template <int kRPad>
constexpr int p_row_n() { return kRPad + 8; }

template <int kRPad>
constexpr int shared_bytes() {
  constexpr int p_elems = kRPad * kPRow > kNt * p_row_n<kRPad>() ? kRPad * kPRow : kNt * p_row_n<kRPad>();
  return (kStages * kXStage + kStages * kRPad * kQRow + p_elems) * 2;
}

// How P reaches shared memory: element by element into the K-major layout (any strides), or in
// 16-byte pieces along its unit stride (columns: K-major; the rank: N-major).
enum PCopy : int { kPElementwise = 0, kPAlongColumns = 1, kPAlongRank = 2 };

struct PassArgs {
  int64_t M, N, ldx, p_stride_n, p_stride_r, rows_per_group;
  int r, p_copy;
  const void* x;
  const void* p;
  const void* q;
  float* part_rows;  // [gridDim.x][M][r_pad]
  float* part_cols;  // [gridDim.y][N][r_pad]
};

// kNT: n8 tiles of the rank (r padded to 8 kNT with zero rows of P and Q).
template <class T, int kNT, bool kRows, bool kCols, bool kPNMajor>
__global__ void __launch_bounds__(kThreads, 1) rank_pass_kernel(PassArgs a) {
  constexpr int kRPad = 8 * kNT, kPRowN = p_row_n<kRPad>();
  static_assert(kNT % 2 == 0, "B fragments come in pairs of n8 tiles");
  extern __shared__ __align__(16) unsigned char shared[];
  T* const xs = reinterpret_cast<T*>(shared);
  T* const qs = xs + kStages * kXStage;
  T* const ps = qs + kStages * kRPad * kQRow;

  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t col0 = int64_t(blockIdx.x) * kNt;
  const int64_t row_begin = int64_t(blockIdx.y) * a.rows_per_group;
  const int64_t row_end = min(a.M, row_begin + a.rows_per_group);
  const int row_blocks = row_end > row_begin ? int((row_end - row_begin + kRb - 1) / kRb) : 0;
  const int units = row_blocks * kTilesPerSlab;
  const T* const x = static_cast<const T*>(a.x);
  const T* const q = static_cast<const T*>(a.q);

  // Unit u (row block u / 4, column tile u % 4 = its stage): X's 128 x 128 tile and, for `cols`,
  // Q's [r_pad][128] piece of the block's rows. N and (with Q) M and the row ranges are
  // multiples of 8, so every 16-byte piece is wholly inside or wholly outside; outside pieces are
  // zero (a slab past N multiplies zero tiles).
  auto load_unit = [&](int u) {
    const int stage = u % kTilesPerSlab;
    const int64_t m0 = row_begin + int64_t(u / kTilesPerSlab) * kRb, c0 = col0 + stage * kCt;
    T* const xd = xs + stage * kXStage;
    constexpr int kPiecesPerRow = kCt / 8;
#pragma unroll
    for (int k = 0; k < kRb * kPiecesPerRow / kThreads; ++k) {
      const int i = tid + k * kThreads;
      const int row = i / kPiecesPerRow, c = (i % kPiecesPerRow) * 8;
      const bool valid = m0 + row < row_end && c0 + c < a.N;
      cp_async_16_or_zero(xd + row * kXRow + c, valid ? x + (m0 + row) * a.ldx + c0 + c : x, valid);
    }
    if constexpr (kCols) {
      constexpr int kQPiecesPerRow = kRb / 8;
#pragma unroll
      for (int k = 0; k < kRPad * kQPiecesPerRow / kThreads; ++k) {
        const int i = tid + k * kThreads;
        const int j = i / kQPiecesPerRow, mm = (i % kQPiecesPerRow) * 8;
        const bool valid = j < a.r && m0 + mm < row_end;
        cp_async_16_or_zero(qs + stage * kRPad * kQRow + j * kQRow + mm, valid ? q + int64_t(j) * a.M + m0 + mm : q,
                            valid);
      }
    }
  };

  if constexpr (kRows) {
    // P's slab in 16-byte pieces, with the first tile's copies (one commit group): lines are P's
    // rows j (K-major) or its columns (N-major), pieces run along the line; zero past N, and
    // past r in the K-major layout (in the N-major one r is a multiple of 8).
    const T* const p = static_cast<const T*>(a.p);
    if (kPNMajor || a.p_copy == kPAlongColumns) {
      constexpr int kPiecesPerLine = (kPNMajor ? kRPad : kNt) / 8, kRow = kPNMajor ? kPRowN : kPRow;
#pragma unroll
      for (int k = 0; k < kRPad * kNt / 8 / kThreads; ++k) {
        const int i = tid + k * kThreads;
        const int line = i / kPiecesPerLine, along = (i % kPiecesPerLine) * 8;
        const int c = kPNMajor ? line : along, j = kPNMajor ? along : line;
        const bool valid = j < a.r && col0 + c < a.N;
        cp_async_16_or_zero(ps + line * kRow + along,
                            valid ? p + (col0 + c) * a.p_stride_n + int64_t(j) * a.p_stride_r : p, valid);
      }
    }
  }

#pragma unroll
  for (int u = 0; u < kStages - 1; ++u) {
    if (u < units) load_unit(u);
    cp_async_commit();
  }

  if (kRows && !kPNMajor && a.p_copy == kPElementwise) {
    // P's slab as [j][column] (K-major for the B operand), zero past r and N, while the first
    // tiles are on their way; made visible by the first tile's barrier. Each thread issues a
    // batch of loads before it stores any (one memory latency a batch, not one an element),
    // walking P along its unit stride so that a warp's loads are contiguous.
    const T* const p = static_cast<const T*>(a.p);
    const bool along_r = a.p_stride_r == 1;
    constexpr int kPerThread = kRPad * kNt / kThreads, kBatch = 16;
#pragma unroll 1
    for (int b0 = 0; b0 < kPerThread; b0 += kBatch) {
      T v[kBatch];
      int at[kBatch];
#pragma unroll
      for (int e = 0; e < kBatch; ++e) {
        const int i = tid + (b0 + e) * kThreads;
        const int j = along_r ? i % kRPad : i / kNt, c = along_r ? i / kRPad : i % kNt;
        at[e] = j * kPRow + c;
        v[e] = (j < a.r && col0 + c < a.N) ? p[(col0 + c) * a.p_stride_n + int64_t(j) * a.p_stride_r] : T(0.f);
      }
#pragma unroll
      for (int e = 0; e < kBatch; ++e) ps[at[e]] = v[e];
    }
  }

  // ldmatrix: lane l addresses row l % 8 of matrix l / 8. Accumulator fragments: rows (or
  // columns) g and g + 8 of the warp's 16, rank columns 2 tq and 2 tq + 1 of each n8 tile.
  const int q_lo = (lane >> 3) & 1, q_hi = lane >> 4, row8 = lane & 7, g = lane >> 2, tq = lane & 3;
  const int w16 = warp * 16;
  float acc_c[kTilesPerSlab][kNT][4] = {};
  for (int rb = 0; rb < row_blocks; ++rb) {
    float acc_r[kNT][4] = {};
#pragma unroll
    for (int ct = 0; ct < kTilesPerSlab; ++ct) {
      const int u = rb * kTilesPerSlab + ct;
      // Unit u has landed and every thread is done with unit u - 1, whose stage is refilled next.
      cp_async_wait_pending<kStages - 2>();
      __syncthreads();
      if (u + kStages - 1 < units) load_unit(u + kStages - 1);
      cp_async_commit();
      const T* const xt = xs + ct * kXStage;
      if constexpr (kRows) {
#pragma unroll
        for (int kb = 0; kb < kCt / 16; ++kb) {
          uint32_t af[4];
          ldmatrix_x4(af, xt + (w16 + row8 + 8 * q_lo) * kXRow + kb * 16 + 8 * q_hi, false);
#pragma unroll
          for (int jp = 0; jp < kNT / 2; ++jp) {
            uint32_t bf[4];
            if constexpr (kPNMajor) {
              ldmatrix_x4(bf, ps + (ct * kCt + kb * 16 + row8 + 8 * q_lo) * kPRowN + jp * 16 + 8 * q_hi, true);
            } else {
              ldmatrix_x4(bf, ps + (jp * 16 + row8 + 8 * q_hi) * kPRow + ct * kCt + kb * 16 + 8 * q_lo, false);
            }
            const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
            mma_16816<T>(acc_r[2 * jp], af, b0);
            mma_16816<T>(acc_r[2 * jp + 1], af, b1);
          }
        }
      }
      if constexpr (kCols) {
        const T* const qt = qs + ct * kRPad * kQRow;
#pragma unroll
        for (int kb = 0; kb < kRb / 16; ++kb) {
          uint32_t af[4];
          ldmatrix_x4(af, xt + (kb * 16 + row8 + 8 * q_hi) * kXRow + w16 + 8 * q_lo, true);
#pragma unroll
          for (int jp = 0; jp < kNT / 2; ++jp) {
            uint32_t bf[4];
            ldmatrix_x4(bf, qt + (jp * 16 + row8 + 8 * q_hi) * kQRow + kb * 16 + 8 * q_lo, false);
            const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
            mma_16816<T>(acc_c[ct][2 * jp], af, b0);
            mma_16816<T>(acc_c[ct][2 * jp + 1], af, b1);
          }
        }
      }
    }
    if constexpr (kRows) {
      // The warp's 16 rows summed over the slab: this block's partial for them.
      const int64_t m = row_begin + int64_t(rb) * kRb + w16 + g;
      float* const out = a.part_rows + (int64_t(blockIdx.x) * a.M + m) * kRPad;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const int j = n * 8 + 2 * tq;
        if (m < row_end) *reinterpret_cast<float2*>(&out[j]) = make_float2(acc_r[n][0], acc_r[n][1]);
        if (m + 8 < row_end) *reinterpret_cast<float2*>(&out[8 * kRPad + j]) = make_float2(acc_r[n][2], acc_r[n][3]);
      }
    }
  }

  allow_dependent_launch();  // the finish may be scheduled (it waits for this grid's end)
  if constexpr (kCols) {
    // The warp's 16 columns of each tile summed over the block's rows (zero without rows).
    float* const out = a.part_cols + int64_t(blockIdx.y) * a.N * kRPad;
#pragma unroll
    for (int ct = 0; ct < kTilesPerSlab; ++ct) {
      const int64_t c = col0 + ct * kCt + w16 + g;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const int j = n * 8 + 2 * tq;
        if (c < a.N) *reinterpret_cast<float2*>(&out[c * kRPad + j]) = make_float2(acc_c[ct][n][0], acc_c[ct][n][1]);
        if (c + 8 < a.N) {
          *reinterpret_cast<float2*>(&out[(c + 8) * kRPad + j]) = make_float2(acc_c[ct][n][2], acc_c[ct][n][3]);
        }
      }
    }
  }
}

struct FinishArgs {
  int64_t M, N;
  int r, r_pad, parts_rows, parts_cols;
  const float* part_rows;
  const float* part_cols;
  void* rows_t;
  void* rows_s;
  void* cols;
  int64_t cols_stride_n, cols_stride_r;
  float rows_t_scale, rows_s_scale, cols_scale;
};

// Adds the partials in block order, scales and writes: one thread per value of `rows` (the first
// M * r threads), then per value of `cols`. Launched as a programmatic dependent of the pass; it
// lets the next kernel launch at once (LoRA's extended-K GEMM, whose CTAs wait for this grid
// before they load, takes the SMs as this kernel's blocks leave them).
template <class T>
__global__ void __launch_bounds__(256) rank_pass_finish(FinishArgs f) {
  allow_dependent_launch();
  wait_for_prior_grid();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row_items = f.parts_rows > 0 ? f.M * f.r : 0;
  const bool is_row = idx < row_items;
  const int64_t item = is_row ? idx : idx - row_items;
  const int64_t lines = is_row ? f.M : (f.parts_cols > 0 ? f.N : 0);
  if (item >= lines * f.r) return;
  const int64_t line = item / f.r;
  const int j = int(item % f.r);
  const int parts = is_row ? f.parts_rows : f.parts_cols;
  const float* src = (is_row ? f.part_rows : f.part_cols) + line * f.r_pad + j;
  const int64_t step = lines * f.r_pad;
  float sum = 0.f;
  for (int b = 0; b < parts; ++b, src += step) sum += *src;
  if (is_row) {
    if (f.rows_t != nullptr) static_cast<T*>(f.rows_t)[int64_t(j) * f.M + line] = T(sum * f.rows_t_scale);
    if (f.rows_s != nullptr) static_cast<T*>(f.rows_s)[line * f.r + j] = T(sum * f.rows_s_scale);
  } else {
    static_cast<T*>(f.cols)[line * f.cols_stride_n + int64_t(j) * f.cols_stride_r] = T(sum * f.cols_scale);
  }
}

struct Plan {
  int r_pad, gx, gy;
  int64_t rows_per_group;
};

// One block per SM: the columns in 512-wide slabs, the rows in as many equal ranges (whole
// 128-row blocks) as leave every SM a block.
Plan plan_for(RankPassParams const& p) {
  Plan plan;
  plan.r_pad = p.r <= 16 ? 16 : 32;
  plan.gx = int((p.N + kNt - 1) / kNt);
  const int64_t row_tiles = (p.M + kRb - 1) / kRb;
  const int64_t groups = std::clamp<int64_t>(std::max(p.sm_count, 1) / plan.gx, 1, std::max<int64_t>(row_tiles, 1));
  plan.rows_per_group = (row_tiles + groups - 1) / groups * kRb;
  plan.gy = int((p.M + plan.rows_per_group - 1) / plan.rows_per_group);
  return plan;
}

template <class T>
struct RankPassFn {
  LaunchResult operator()(RankPassParams const& p, cudaStream_t stream) const {
    const Plan plan = plan_for(p);
    const bool rows = p.p != nullptr, cols = p.q != nullptr;
    int p_copy = kPElementwise;
    if (rows && aligned16(p.p)) {
      if (p.p_stride_n == 1 && p.p_stride_r % 8 == 0) {
        p_copy = kPAlongColumns;
      } else if (p.p_stride_r == 1 && p.p_stride_n % 8 == 0 && p.r % 8 == 0) {
        p_copy = kPAlongRank;
      }
    }
    PassArgs a{p.M, p.N, p.ldx, p.p_stride_n, p.p_stride_r, plan.rows_per_group, p.r, p_copy, p.x, p.p, p.q,
               p.workspace, p.workspace + (rows ? int64_t(plan.gx) * p.M * plan.r_pad : 0)};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return {"launch", "no current CUDA device"};
    LaunchResult result;
    auto launch = [&](auto n_tiles, auto with_rows, auto with_cols) {
      constexpr int kNT = decltype(n_tiles)::value;
      constexpr bool kRows = decltype(with_rows)::value, kCols = decltype(with_cols)::value;
      auto kernel_fn = p_copy == kPAlongRank ? rank_pass_kernel<T, kNT, kRows, kCols, true>
                                             : rank_pass_kernel<T, kNT, kRows, kCols, false>;
      const void* kernel = reinterpret_cast<const void*>(kernel_fn);
      if (allow_large_dynamic_shared(kernel, device) != cudaSuccess) {
        result = {"initialize", "the rank-r pass needs more shared memory than the device allows"};
        return;
      }
      kernel_fn<<<dim3(unsigned(plan.gx), unsigned(plan.gy)), kThreads, shared_bytes<8 * kNT>(), stream>>>(a);
    };
    auto by_mode = [&](auto n_tiles) {
      if (rows && cols) {
        launch(n_tiles, std::true_type{}, std::true_type{});
      } else if (rows) {
        launch(n_tiles, std::true_type{}, std::false_type{});
      } else {
        launch(n_tiles, std::false_type{}, std::true_type{});
      }
    };
    if (plan.r_pad == 16) {
      by_mode(std::integral_constant<int, 2>{});
    } else {
      by_mode(std::integral_constant<int, 4>{});
    }
    if (!result.ok()) return result;

    FinishArgs f{p.M, p.N, p.r, plan.r_pad, rows ? plan.gx : 0, cols ? plan.gy : 0, a.part_rows, a.part_cols,
                 p.rows_t, p.rows_s, p.cols, p.cols_stride_n, p.cols_stride_r, p.rows_t_scale, p.rows_s_scale,
                 p.cols_scale};
    const int64_t items = ((rows ? p.M : 0) + (cols ? p.N : 0)) * p.r;
    launch_dependent(rank_pass_finish<T>, dim3(unsigned((items + 255) / 256)), dim3(256), stream, f);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
    return {};
  }
};

}  // namespace

bool rank_pass_supported(RankPassParams const& p) {
  if (p.dtype == DType::kF32 || p.r < 1 || p.r > 32 || p.M < 1 || p.N < 1) return false;
  if (p.N % 8 != 0 || p.ldx % 8 != 0 || !aligned16(p.x)) return false;
  if (p.M > INT32_MAX / 2 || p.N > INT32_MAX / 2) return false;
  if (p.q != nullptr && (p.M % 8 != 0 || !aligned16(p.q))) return false;
  if (p.p == nullptr && p.q == nullptr) return false;
  if (p.p != nullptr && p.rows_t == nullptr && p.rows_s == nullptr) return false;
  return p.q == nullptr || p.cols != nullptr;
}

int64_t rank_pass_workspace_floats(RankPassParams const& p) {
  const Plan plan = plan_for(p);
  return ((p.p != nullptr ? int64_t(plan.gx) * p.M : 0) + (p.q != nullptr ? int64_t(plan.gy) * p.N : 0)) * plan.r_pad;
}

LaunchResult rank_pass(RankPassParams const& p, cudaStream_t stream) {
  if (!rank_pass_supported(p)) return {"can_implement", "the rank-r pass does not take these operands"};
  if (p.workspace == nullptr || !aligned16(p.workspace)) return {"can_implement", "the rank-r pass needs its workspace"};
  if (p.dtype == DType::kF16) return RankPassFn<cutlass::half_t>{}(p, stream);
  return RankPassFn<cutlass::bfloat16_t>{}(p, stream);
}

}  // namespace cutlass_ext
