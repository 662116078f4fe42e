// W += alpha B A in place for a rank-r pair (16-bit types, 1 <= r <= 64): LoRA's merge.
//   W [M, N]: unit column stride, row stride ldw (a multiple of 8), 16-byte aligned, N a multiple of 8
//   B [M, r]: B[m, k] at b + m * b_stride_m + k * b_stride_r
//   A [r, N]: A[k, n] at a + k * a_stride_r + n * a_stride_n
// W is read and written once in 16-byte pieces and the product costs r multiply-adds an element on
// the tensor cores, so the update is bound by memory traffic: W's bytes, plus A's and B's re-read
// from L2 by every block tile (on 128 x 64 tiles 0.19x W's bytes at r = 8, 1.5x at r = 64;
// 256 x 256 tiles read a third of that; bench/NOTES.md sections 59 and 60).
// alpha B A is accumulated in fp32 and added to W's fp32 value, one rounding to W's type. Where
// rank_update_supported is false the caller runs the update as a GEMM with W as its C operand.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/types.h"

namespace cutlass_ext {

// The block tile: 128 x 64 (16x the blocks) or 256 x 256 (a third the L2 bytes of A and B);
// kAuto picks by rank_update_tile's rule.
enum class RankUpdateTile { kAuto, k128x64, k256x256 };

struct RankUpdateParams {
  DType dtype = DType::kBF16;
  int64_t M = 0, N = 0;
  int r = 0;
  void* w = nullptr;
  int64_t ldw = 0;
  const void* a = nullptr;
  int64_t a_stride_r = 0, a_stride_n = 0;
  const void* b = nullptr;
  int64_t b_stride_m = 0, b_stride_r = 0;
  float alpha = 1.f;
  int sm_count = 0;  // of W's device (the tile rule's rounds of blocks)
  RankUpdateTile tile = RankUpdateTile::kAuto;
};

// The tile an update runs on: p.tile, or by rule where that is kAuto.
RankUpdateTile rank_update_tile(RankUpdateParams const& p);

bool rank_update_supported(RankUpdateParams const& p);

LaunchResult rank_update(RankUpdateParams const& p, cudaStream_t stream);

}  // namespace cutlass_ext
