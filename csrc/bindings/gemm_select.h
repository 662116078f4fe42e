// GEMM kernel selection: the shape heuristic that picks one of the built kernels able to run a
// product (the binding, csrc/bindings/gemm.cpp, gathers those candidates from the kernel table and
// handles a forced config). Torch-free, so that tests compile and run it without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "gemm/gemm_params.h"
#include "gemm/narrow_limits.h"

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

// Whether the hand-written few-column kernel (gemm/gemv_gemm.cuh) is the heuristic's choice for a
// product with N columns over `rows` = M L rows: N <= 4 for 16-bit types (few_column_kernel in
// bindings/gemm.cpp gives the measurements); for fp32 N <= kGemvMaxN (16), but with TF32 over more
// than kGemvF32MaxRows rows only N <= 4 or N not a multiple of 4 (where the tiles would copy).
// Without TF32 only CUTLASS's SIMT kernel is besides. With TF32 the few-column kernel ran dX = dZ W
// of a 13-feature layer (2048 x 512 -> 13) in 5.8 us against 39 for a stream-K tile on N padded
// to 16, and 8192 x 64 -> 16 and 8192 x 512 -> 13 in 10.0 and 18.1 us against 10.2 and 21.1 for
// the best transposed tile (CUDA graphs, H200); from 32768 rows the transposed 64-row tiles were
// ahead: 65536 x 64 -> 16 16.0 against 19.6 us, 65536 x 256 -> 16 29.9 against 47.0 (bench/NOTES.md
// section 38).
bool gemv_chosen(bool fp32, bool exact, int64_t rows, int64_t N);

// Whether the hand-written narrow kernel (gemm/narrow_gemm.cuh) is the heuristic's choice for a
// 16-bit product with N columns of depth K over `rows` = M L rows: past the few-column kernel's
// N (4), K <= 64 and N K <= 2048, from 512 rows (narrow_kernel in bindings/gemm.cpp checks the
// layout). Measured on an H200 (bf16, CUDA-graph replays, L2 zeroed before each; bench/NOTES.md
// section 55), against the best CUTLASS tile: 65536 x 64 -> 16 12.4 us against 13.7 (the GELU
// training forward 12.9 against 19.4), 65536 x 64 -> 32 12.9 against 13.7, dX = dZ W of that
// 64 -> 16 layer (65536 x 16 -> 64) 11.8 against 13.7, 512-8192 rows 0.8-0.9x the tiles' time.
// The kernel re-reads B for every 64 rows and runs each block's loads, products and stores one
// after another: with more work a row it lost, 65536 x 128 -> 16 16.9 against 16.6, 65536 x 64
// -> 64 16.4 against 13.9, 65536 x 256 -> 64 33.7 against 20.2.
bool narrow_chosen(int64_t rows, int64_t N, int64_t K);

// The short-K fp32 kernel on the FMA units (gemm/ffma_gemm.cuh) runs K <= kFfmaMaxK. Whether it
// is the heuristic's choice for a product of depth K with `outputs` = M N L outputs:
// - without TF32 (`exact`) always: the exact path's CUTLASS SIMT kernel took 40 us at
//   2048 x 13 -> 512 on an H200 (bench/NOTES.md section 35);
// - with TF32 it competes with tensor-core tiles that write D at the copy rate, where it is bound by
//   its issue rate (ncu at 65536 x 16 -> 4096: 0.69 instructions a cycle per scheduler, 45% of DRAM
//   bandwidth), so only for few outputs: up to kFfmaMaxOutputsCopied where the tiles would first
//   copy the operands (`tiles_read_in_place` false: K or a row stride not a multiple of 16 bytes,
//   unaligned data), up to kFfmaMaxOutputsAligned with K <= kFfmaAlignedMaxK where they read them
//   in place. Measured (13 -> N, padded copies and the 128x256 TF32 tile against this kernel, NOTES
//   section 37): this kernel ahead up to 8M outputs and within 5% near 2^24 for N = 512, 1024 and
//   4096; with K = 16 in place the tile was ahead from 8192 x 512 (4M outputs).
constexpr int64_t kFfmaMaxK = 32;
constexpr int64_t kFfmaAlignedMaxK = 16;
constexpr int64_t kFfmaMaxOutputsCopied = int64_t(1) << 24;
constexpr int64_t kFfmaMaxOutputsAligned = int64_t(1) << 21;
bool ffma_takes(bool exact, int64_t K, int64_t outputs, bool tiles_read_in_place);

// Clusters of a kernel that fit on the current device at once; 0 when it does not run in
// clusters or the count is unknown.
int co_resident_clusters(const GemmKernelEntry& e);

// The heuristic's kernel among `candidates` (not empty; in the kernel table's order of preference,
// the transposed kernels last) for an M x N product of depth K, L batches, on `sms` SMs.
// `extk_twins`: null, or, for a product that carries LoRA's rank-r pair (A2, B2), the extended-K
// kernels built for its layout (gemm/sm90_extk.cuh), which fold the pair into their K loop. Such
// a product keeps to the configs that have one: the preferred data-parallel config, or the wide
// tile's rule where the wide tile has one; the other rules (mid-M, stream-K, clusters) are skipped
// so that the pair stays in the main GEMM.
const GemmKernelEntry* select_kernel(const std::vector<const GemmKernelEntry*>& candidates, int64_t M, int64_t N,
                                     int64_t K, int64_t L, int sms,
                                     const std::vector<const GemmKernelEntry*>* extk_twins);

// Split count for a stream-K kernel (GemmParams::splits): below one wave of output tiles, as many
// splits as fit in one wave; from one wave on, 1 when the waves are full, else 0 (CUTLASS's
// stream-K decomposition).
int split_k_factor(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int64_t L, int sms,
                   int64_t element_size);

// Whether `kernel`, where it waits for the prior grid at its start (CUTLASS's Hopper kernels but
// the stream-K and extended-K ones), is launched as a programmatic dependent of the kernel before
// it (GemmParams::dependent_launch) for a product of M rows (the caller's) over depth K. Not for a
// transposed tile whose column tiles split the rows (M > tile_n, so that several CTAs stream each
// weight tile) over K >= kPlainLaunchMinK: back to back on an H200 (bench/NOTES.md section 69)
// those ran 0.83-0.98x the plain launch's speed (128 and 256 x 4096 -> 4096 and -> 11008 on the
// 64x32, 64x64 and 64x128 tiles), where one column tile gained 1.09-1.14x (16 rows, 128 rows on the
// 64x128 tile) and K = 1024 gained 1.09-1.16x on every tile (1024^3).
constexpr int64_t kPlainLaunchMinK = 4096;
bool dependent_launch_pays(const GemmKernelEntry& kernel, int64_t M, int64_t K);

// Slices of K for a K-slices kernel (GemmKernelEntry::k_slices) on an M x N product of depth K:
// the largest count that cuts K into equal slices (none reading past K) whose depth is a multiple
// of kSliceAlignK (16 bytes of a 16-bit operand: a K-major operand's slices start aligned for
// TMA), keeps the slices' tiles within one round on `sms` SMs and each slice at least kMinSliceK
// deep; 0 when fewer than two such slices exist.
constexpr int64_t kMinSliceK = 256;
constexpr int64_t kSliceAlignK = 8;
int k_slices(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int sms);

}  // namespace cutlass_ext
