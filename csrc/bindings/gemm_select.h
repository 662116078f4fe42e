// GEMM kernel selection: the shape heuristic that picks one of the built kernels able to run a
// product (the binding, csrc/bindings/gemm.cpp, gathers those candidates from the kernel table and
// handles a forced config). Torch-free, so that tests compile and run it without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "gemm/gemm_params.h"

namespace cutlass_ext {

// Output tiles of a kernel on the caller's M x N product, L batches (a transposed kernel tiles N
// by tile_m).
int64_t output_tiles(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t L);

// Whether a kernel is the hand-written short-K kernel (gemm/lowk_gemm.cuh).
bool is_lowk(const GemmKernelEntry& e);

// Whether the short-K kernel is the heuristic's choice for a product of depth K over M x L rows.
bool lowk_takes(int64_t K, int64_t M, int64_t L);

// Whether a kernel can run a product of depth K.
bool runs_depth(const GemmKernelEntry& e, int64_t K);

// Clusters of a kernel that fit on the current device at once; 0 when it does not run in
// clusters or the count is unknown.
int co_resident_clusters(const GemmKernelEntry& e);

// The heuristic's kernel among `candidates` (not empty; in the kernel table's order of preference,
// the transposed kernels last) for an M x N product of depth K, L batches, on `sms` SMs.
// `with_extk_twin`: the product carries LoRA's rank-r pair (A2, B2), which only the preferred
// data-parallel config folds into its K loop (gemm/sm90_extk.cuh); the mid-M choice is then
// skipped so that the pair stays in the main GEMM.
const GemmKernelEntry* select_kernel(const std::vector<const GemmKernelEntry*>& candidates, int64_t M, int64_t N,
                                     int64_t K, int64_t L, int sms, bool with_extk_twin);

// Split count for a stream-K kernel (GemmParams::splits): below one wave of output tiles, as many
// splits as fit in one wave; from one wave on, 1 when the waves are full, else 0 (CUTLASS's
// stream-K decomposition).
int split_k_factor(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int64_t L, int sms,
                   int64_t element_size);

// Slices of K for a K-slices kernel (GemmKernelEntry::k_slices) on an M x N product of depth K:
// the largest count that cuts K into equal slices (none reading past K) whose depth is a multiple
// of kSliceAlignK (16 bytes of a 16-bit operand: a K-major operand's slices start aligned for
// TMA), keeps the slices' tiles within one round on `sms` SMs and each slice at least kMinSliceK
// deep; 0 when fewer than two such slices exist.
constexpr int64_t kMinSliceK = 256;
constexpr int64_t kSliceAlignK = 8;
int k_slices(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int sms);

}  // namespace cutlass_ext
