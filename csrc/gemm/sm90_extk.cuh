// A CUTLASS 3.x sm90 mainloop whose K loop runs over two operand pairs:
//   accumulator = A @ B + A2 @ B2,   A [M, K], B [K, N], A2 [M, K2], B2 [K2, N]
// which is the GEMM of the concatenations [A | A2] @ [B ; B2] without building them. LoRA uses
// it to fold its rank-r term into the frozen weight's GEMM: y = x W^T + (s t) B^T is
// [x | s t] @ [W | B]^T, and dx = dz W + (s U) A likewise, so the [rows, out] low-rank term is
// never written to memory and read back.
//
// The K loop first walks A/B's ceil(K / TileK) stages, then A2/B2's ceil(K2 / TileK). Each pair
// has its own TMA descriptors; both fill the same shared-memory stages (the two pairs must share
// majorness, which the descriptors' box layouts follow), and TMA zero-fills the part of a stage
// past K or K2, so a partial last stage of either pair adds nothing. The consumer warpgroups run
// CUTLASS's MMA loop over the first pair's stages, then their own over the second pair's, where
// a stage holding no more of K2 than one MMA's depth multiplies that k block alone (LoRA's
// r <= 16 fills one 16-deep block of a 64-deep stage: the rank-r stage costs a quarter of a full
// one).
//
// The producer waits for the grid before it on the stream (griddepcontrol.wait) before its first
// load, so the kernel may be launched as a programmatic dependent of the kernel before it (LoRA's
// rank-r pass finish, which writes A2): its launch, block placement and set-up then overlap that
// kernel instead of following its end. Nothing before the wait touches global memory (the
// consumers and the epilogue act on what the producer loaded), and launched the usual way the
// wait returns at once.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_mma.hpp>
#include <cutlass/gemm/gemm.h>

#include "common/dependent_launch.h"

namespace cutlass_ext::sm90 {

template <class Base>
struct ExtKMainloop : Base {
  using typename Base::DispatchPolicy;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using TmaA = typename Base::Params::TMA_A;
  using TmaB = typename Base::Params::TMA_B;
  static constexpr int kTileK = cute::size<2>(TileShape{});
  // The launcher may launch the kernel as a programmatic dependent (see above).
  static constexpr bool kWaitsForPriorGrid = true;

  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B;
    StrideB dB;
    ElementA const* ptr_A2;  // [M, K2] with A's majorness
    StrideA dA2;
    ElementB const* ptr_B2;  // [K2, N] with B's majorness
    StrideB dB2;
    int K = 0;   // depth of A @ B (the problem shape's K is the padded total, see problem_k)
    int K2 = 0;  // depth of A2 @ B2
  };

  struct Params : Base::Params {
    TmaA tma_load_a2;
    TmaB tma_load_b2;
    int k_tiles_main = 0;
    int k2 = 0;
  };

  // The K the kernel's problem shape must carry: both pairs' stages.
  static int problem_k(int K, int K2) { return (ceil_tiles(K) + ceil_tiles(K2)) * kTileK; }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    auto [M, N, Ktotal, L] = cute::append<4>(problem_shape, 1);
    (void)Ktotal;
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        cute::make_shape(M, N, args.K, L), typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB},
        workspace);
    // The second pair's descriptors: same element types, box shapes and multicast as the first.
    auto second = Base::to_underlying_arguments(
        cute::make_shape(M, N, args.K2, L), typename Base::Arguments{args.ptr_A2, args.dA2, args.ptr_B2, args.dB2},
        workspace);
    params.tma_load_a2 = second.tma_load_a;
    params.tma_load_b2 = second.tma_load_b;
    params.k_tiles_main = ceil_tiles(args.K);
    params.k2 = args.K2;
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, Ktotal, L] = cute::append<4>(problem_shape, 1);
    return args.K > 0 && args.K2 > 0 && Ktotal == problem_k(args.K, args.K2) &&
           Base::can_implement(cute::make_shape(M, N, args.K, L),
                               typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB}) &&
           Base::can_implement(cute::make_shape(M, N, args.K2, L),
                               typename Base::Arguments{args.ptr_A2, args.dA2, args.ptr_B2, args.dB2});
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_a2.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b2.get_tma_descriptor());
  }

  // The first two tensors span the padded total K (the kernel takes its stage count from the
  // first); the second pair's tiles follow.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using cute::_;
    using cute::_1;
    using X = cute::Underscore;
    const int M = cute::get<0>(problem_shape_MNKL), N = cute::get<1>(problem_shape_MNKL);
    const int Ktotal = cute::get<2>(problem_shape_MNKL), L = cute::get<3>(problem_shape_MNKL);
    const int K2 = Ktotal - params.k_tiles_main * kTileK;
    auto tiles_a = [&](auto const& tma, int K) {
      return cute::local_tile(tma.get_tma_tensor(cute::make_shape(M, K, L)), TileShape{}, cute::make_coord(_, _, _),
                              cute::Step<_1, X, _1>{});
    };
    auto tiles_b = [&](auto const& tma, int K) {
      return cute::local_tile(tma.get_tma_tensor(cute::make_shape(N, K, L)), TileShape{}, cute::make_coord(_, _, _),
                              cute::Step<X, _1, _1>{});
    };
    return cute::make_tuple(tiles_a(params.tma_load_a, Ktotal), tiles_b(params.tma_load_b, Ktotal),
                            tiles_a(params.tma_load_a2, K2), tiles_b(params.tma_load_b2, K2));
  }

  // Producer warp: one stage per k tile, from the first pair while k < k_tiles_main, then from
  // the second.
  template <class LoadInputs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           LoadInputs const& load_inputs, BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using cute::_;
    (void)thread_idx;
    if (!cute::elect_one_sync()) return;
    auto sA = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    auto sB = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});

    constexpr uint32_t cluster_x = cute::size<0>(typename DispatchPolicy::ClusterShape{});
    const uint32_t block_x = block_rank_in_cluster % cluster_x;
    const uint32_t block_y = block_rank_in_cluster / cluster_x;
    // A tile is shared by the blocks of a cluster row, a B tile by those of a cluster column.
    uint16_t mcast_a = 0, mcast_b = 0;
    auto block_layout = cute::Layout<typename DispatchPolicy::ClusterShape>{};
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, cute::SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < cute::size<1>(block_layout); ++n) {
        mcast_a |= uint16_t(1) << block_layout(block_x, n, cute::Int<0>{});
      }
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, cute::SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < cute::size<0>(block_layout); ++m) {
        mcast_b |= uint16_t(1) << block_layout(m, block_y, cute::Int<0>{});
      }
    }

    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto tma_a = params.tma_load_a.get_slice(block_y);
    auto tma_b = params.tma_load_b.get_slice(block_x);
    auto tma_a2 = params.tma_load_a2.get_slice(block_y);
    auto tma_b2 = params.tma_load_b2.get_slice(block_x);
    auto gA = tma_a.partition_S(cute::get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    auto gB = tma_b.partition_S(cute::get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    auto gA2 = tma_a2.partition_S(cute::get<2>(load_inputs)(_, _, m_coord, _, l_coord));
    auto gB2 = tma_b2.partition_S(cute::get<3>(load_inputs)(_, _, n_coord, _, l_coord));
    auto sA_stages = tma_a.partition_D(sA);
    auto sB_stages = tma_b.partition_D(sB);

    wait_for_prior_grid();

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k = *k_tile_iter;
      if (k < params.k_tiles_main) {
        cute::copy(params.tma_load_a.with(*barrier, mcast_a), gA(_, _, _, k), sA_stages(_, _, _, stage));
        cute::copy(params.tma_load_b.with(*barrier, mcast_b), gB(_, _, _, k), sB_stages(_, _, _, stage));
      } else {
        const int k2 = k - params.k_tiles_main;
        cute::copy(params.tma_load_a2.with(*barrier, mcast_a), gA2(_, _, _, k2), sA_stages(_, _, _, stage));
        cute::copy(params.tma_load_b2.with(*barrier, mcast_b), gB2(_, _, _, k2), sB_stages(_, _, _, stage));
      }
    }
  }

  // Consumer warpgroups: the first pair's stages through the base collective's loop (which leaves
  // its last stage unreleased and one batch of MMAs in flight), then the second pair's stages the
  // same way, a stage that holds at most one k block of K2 with that block's MMA alone. The
  // kernel's mma_tail then releases the last stage.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using cute::_;
    static_assert(Base::K_PIPE_MMAS == 1, "the second pair's loop keeps one batch of MMAs in flight");
    const int main_tiles = cute::min(params.k_tiles_main, k_tile_count);
    Base::mma(pipeline, smem_pipe_read, accum, main_tiles, thread_idx, shared_tensors, params);
    if (main_tiles == k_tile_count) return;

    auto sA = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    auto sB = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    typename Base::TiledMma tiled_mma;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thread_mma = tiled_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    auto tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    auto tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    constexpr int kBlocks = cute::size<2>(decltype(tCrA){});
    constexpr int kBlockK = kTileK / kBlocks;
    tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;

    PipelineState read = smem_pipe_read;
    read.advance(main_tiles);
    PipelineState release = smem_pipe_read;
    release.advance(main_tiles - 1);
    int depth_left = params.k2;  // of the second pair, from this stage on
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = main_tiles; t < k_tile_count; ++t, depth_left -= kTileK) {
      auto token = pipeline.consumer_try_wait(read);
      pipeline.consumer_wait(read, token);
      const int stage = read.index();
      cute::warpgroup_fence_operand(accum);
      cute::warpgroup_arrive();
      if (depth_left <= kBlockK) {
        cute::gemm(tiled_mma, tCrA(_, _, 0, stage), tCrB(_, _, 0, stage), accum);
      } else {
        cute::gemm(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), accum);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
      cute::warpgroup_fence_operand(accum);
      pipeline.consumer_release(release);
      ++read;
      ++release;
    }
    cute::warpgroup_fence_operand(accum);
  }

 private:
  static constexpr int ceil_tiles(int k) { return (k + kTileK - 1) / kTileK; }
};

}  // namespace cutlass_ext::sm90
