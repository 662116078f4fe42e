// CUTLASS 3.x warp-specialized TMA + WGMMA GEMMs for sm90 with a fused epilogue:
//   D = act(alpha * A B + bias)                  (plain epilogue)
//   D = act(Z), Z = alpha * A B + bias           (aux epilogue: Z is stored too, for the backward)
//   D = act(alpha * A B + beta * C + bias)       (source epilogue: accumulate into C, e.g. a LoRA
//                                                 term or an in-place weight update, C may be D)
// The activation is a run-time parameter (CompactRuntimeActivation: none and ReLU inline, each smooth
// activation out of line); bias may be null.
// An extended-K bundle adds a second operand pair to the product, D = act(alpha * (A B + A2 B2)
// + bias) (gemm/sm90_extk.cuh), for LoRA's rank-r term.
// A K-slices bundle writes fp32 partial products, D[l] = alpha * A[l] B[l] with the batch index l
// running over slices of one product's K (the binding's strides), for a deterministic split-K.
// A plain bundle (and every K-slices bundle) has the epilogue D = alpha * A B alone, without the
// bias and run-time activation nodes: where the epilogue is exposed (K = 128: a weight gradient
// over 128 rows) the kernel with those nodes took 1.6-1.7x the time (bench/NOTES.md section 23).
// A transposed bundle computes the product with A and B exchanged (D^T = B^T A^T) for problems
// with few rows: D is column-major and the bias runs along the kernel's M (the caller's N).
//
// One "bundle" type per instantiation: element type, operand layouts, epilogue kind, tile,
// cluster, schedule and tile scheduler. Generated translation units instantiate exactly one bundle each.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "gemm/epilogue_activation.cuh"
#include "gemm/sm90_extk.cuh"
#include "gemm/gemm_params.h"
#include "gemm/launcher.cuh"

namespace cutlass_ext::sm90 {

// Warp-specialized schedules: the mainloop kernel schedule and its matching epilogue schedule.
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

using PersistentScheduler = cutlass::gemm::PersistentScheduler;
using StreamKScheduler = cutlass::gemm::StreamKScheduler;

// The persistent scheduler's tile order for GemmParams::raster (0 heuristic, 1 along M, 2 along N).
inline cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions raster_order(int raster) {
  using Options = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;
  return raster == 1 ? Options::AlongM : raster == 2 ? Options::AlongN : Options::Heuristic;
}

// Sets the run-time modes of a CuTe stride (static modes such as _1 or _0 are left alone).
template <class Stride>
Stride make_stride3(int64_t s0, int64_t s1, int64_t s2) {
  Stride s{};
  if constexpr (!cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) cute::get<0>(s) = s0;
  if constexpr (!cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<1>(s))>>) cute::get<1>(s) = s1;
  if constexpr (!cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<2>(s))>>) cute::get<2>(s) = s2;
  return s;
}

template <class Element_, class LayoutA, class LayoutB, bool kAux, bool kSource, bool kTransposed, int TileM, int TileN,
          int TileK, int ClusterM, int ClusterN, class Schedule, class Scheduler, bool kExtK = false,
          bool kKSlices = false, bool kPlain = false>
struct GemmBundle {
  using Element = Element_;  // A, B, C, D, bias and aux share one element type (but K-slices' D)
  using ElementD = cute::conditional_t<kKSlices, float, Element>;
  using ElementC = cute::conditional_t<kSource, Element, void>;  // void: no C load at all
  static_assert(!(kAux && kSource), "no instantiation needs both an aux output and a source");
  static_assert(!(kTransposed && kSource), "transposed kernels serve plain products only");
  static_assert(!(kKSlices && (kAux || kSource || kTransposed || kExtK)),
                "K-slices kernels write plain fp32 partial products");
  static_assert(!(kPlain && (kAux || kSource || kTransposed || kExtK)),
                "plain bundles serve products without C, aux output or a transposed tile");
  static constexpr bool kPlainEpilogue = kPlain || kKSlices;
  static_assert(!(kExtK && (kSource || kTransposed || cute::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>)),
                "extended-K kernels are data-parallel, without a source or a transposed product");
  using Accumulator = float;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr bool kStreamK = cute::is_same_v<Scheduler, StreamKScheduler>;

  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using LayoutD = cute::conditional_t<kTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

  // The activation in the form for the stored type (ElementD: Element, or fp32 for K slices).
  template <class T>
  using Activation = typename ActivationStoring<ElementD>::template Compact<T>;
  // The bias follows the caller's N: the kernel's columns, or its rows when transposed.
  using BiasActOp = cute::conditional_t<
      kTransposed,
      cute::conditional_t<
          kAux,
          cutlass::epilogue::fusion::LinCombPerRowBiasEltActAux<LayoutD, Activation, Element, float,
                                                                 Element, Element, Element>,
          cutlass::epilogue::fusion::LinCombPerRowBiasEltAct<Activation, Element, float, Element,
                                                              Element>>,
      cute::conditional_t<
          kAux,
          cutlass::epilogue::fusion::LinCombPerColBiasEltActAux<LayoutD, Activation, Element, float,
                                                                 Element, Element, Element>,
          cutlass::epilogue::fusion::LinCombPerColBiasEltAct<Activation, ElementD, float, Element,
                                                              ElementD>>>;
  using FusionOp = cute::conditional_t<kPlainEpilogue,
                                       cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>,
                                       BiasActOp>;
  // Wider epilogue subtiles than CUTLASS's automatic ones (64x32 ping-pong, 128x32 cooperative) for
  // the 128-row tiles without C, aux output or K slices: half the subtiles, so half the unrolled
  // copies of the epilogue's code (the run-time activation's cases made it ~15K instructions, and
  // its warps stalled on instruction fetch: 1.68 cycles per issued instruction against 0.38 with
  // ReLU fixed at compile time, ncu at 4096 x 4096 x 128). On an H200 (bench/kernels, L2 flushed;
  // bias+ReLU / plain): ping-pong 64x64 4096 x 4096 x 128 37.7 -> 30.1 / 17.6 -> 16.5 us,
  // 65536 x 128 x 64 33.9 -> 28.3, 1024^3 20.0 -> 17.5, 4096^3 189.6 -> 188.0; cooperative 128x64
  // 4096 x 4096 x 128 32.8 -> 29.7, 1024^3 15.1 -> 14.2, 4096^3 200.4 -> 198.0 (bench/NOTES.md
  // section 23); LoRA's extended-K forward over the plain GEMM's time at 4096 -> 4096, 2048 and
  // 8192 rows, +2.5 -> +1.3 us and +6.5 -> +2.4 us (section 49).
  static constexpr bool kWideEpilogueTile = TileM == 128 && !kTransposed && !kAux && !kSource && !kKSlices;
  // Tiles 144 wide (ONE_WAVE_CONFIGS: an H200's 132 SMs as 12 x 11 tiles of a 1536^3 product):
  // 48-wide subtiles, which divide the tile (64 does not, and CUTLASS's automatic 32 does not).
  static constexpr bool kTile144 = TileN == 144;
  using EpilogueTile = cute::conditional_t<
      kTile144, cute::Shape<cute::Int<cute::is_same_v<Schedule, Cooperative> ? 128 : 64>, cute::_48>,
      cute::conditional_t<
          kWideEpilogueTile && cute::is_same_v<Schedule, Pingpong>, cute::Shape<cute::_64, cute::_64>,
          cute::conditional_t<kWideEpilogueTile && cute::is_same_v<Schedule, Cooperative>,
                              cute::Shape<cute::_128, cute::_64>, cutlass::epilogue::collective::EpilogueTileAuto>>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, Accumulator, float,
      ElementC, LayoutD, kAlignment,
      ElementD, LayoutD, kAlignmentD, typename Schedule::Epilogue, FusionOp>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignment, Element,
      LayoutB, kAlignment, Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using CollectiveMainloop = cute::conditional_t<kExtK, ExtKMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments make_arguments(GemmParams const& p) {
    using StrideA = typename Kernel::StrideA;  // modes (M, K, L)
    using StrideB = typename Kernel::StrideB;  // modes (N, K, L)
    using StrideD = typename Kernel::StrideD;  // modes (M, N, L)
    // p.d_stride_m (c_, aux_) is the stride between D's lines: rows, or columns when transposed.
    auto epilogue_stride = [](auto tag, int64_t ld, int64_t l) {
      using Stride = decltype(tag);
      return kTransposed ? make_stride3<Stride>(1, ld, l) : make_stride3<Stride>(ld, 1, l);
    };
    typename Gemm::Arguments args{};
    args.mode = p.L > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {p.M, p.N, p.K, p.L};
    args.mainloop.ptr_A = static_cast<Element const*>(p.A);
    args.mainloop.dA = make_stride3<StrideA>(p.a_stride_m, p.a_stride_k, p.a_stride_l);
    args.mainloop.ptr_B = static_cast<Element const*>(p.B);
    args.mainloop.dB = make_stride3<StrideB>(p.b_stride_n, p.b_stride_k, p.b_stride_l);
    if constexpr (kExtK) {
      args.problem_shape = {p.M, p.N, CollectiveMainloop::problem_k(p.K, p.K2), p.L};
      args.mainloop.ptr_A2 = static_cast<Element const*>(p.A2);
      args.mainloop.dA2 = make_stride3<StrideA>(p.a2_stride_m, p.a2_stride_k, p.a2_stride_l);
      args.mainloop.ptr_B2 = static_cast<Element const*>(p.B2);
      args.mainloop.dB2 = make_stride3<StrideB>(p.b2_stride_n, p.b2_stride_k, p.b2_stride_l);
      args.mainloop.K = p.K;
      args.mainloop.K2 = p.K2;
    }
    if constexpr (kSource) {
      args.epilogue.ptr_C = static_cast<Element const*>(p.C);
      args.epilogue.dC = epilogue_stride(typename Kernel::StrideC{}, p.c_stride_m, p.c_stride_l);
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = epilogue_stride(typename Kernel::StrideC{}, p.d_stride_m, p.d_stride_l);
    }
    args.epilogue.ptr_D = static_cast<ElementD*>(p.D);
    args.epilogue.dD = epilogue_stride(StrideD{}, p.d_stride_m, p.d_stride_l);
    auto& fusion = args.epilogue.thread;
    fusion.alpha = p.alpha;
    fusion.beta = kSource ? p.beta : 0.f;
    if constexpr (!kPlainEpilogue) {
      fusion.bias_ptr = static_cast<Element const*>(p.bias);
      fusion.activation.kind = p.activation;
    }
    if constexpr (kAux) {
      fusion.aux_ptr = static_cast<Element*>(p.aux);
      fusion.dAux = epilogue_stride(decltype(fusion.dAux){}, p.aux_stride_m, p.aux_stride_l);
    }
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    args.hw_info.max_active_clusters = p.max_active_clusters;
    args.scheduler.max_swizzle_size = p.swizzle;
    args.scheduler.raster_order = raster_order(p.raster);
    if constexpr (kStreamK) {
      // The binding picks the split count (split_k_factor); CUTLASS's own stream-K heuristic can
      // cut a few long-K tiles into ~one piece per SM, whose deterministic fix-up is a serial chain.
      using Decomposition = cutlass::gemm::kernel::detail::DecompositionMode;
      args.scheduler.decomposition_mode = p.splits == 0  ? Decomposition::StreamK
                                          : p.splits > 1 ? Decomposition::SplitK
                                                         : Decomposition::DataParallel;
      args.scheduler.splits = p.splits > 1 ? p.splits : 1;
      args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
    }
    return args;
  }
};

}  // namespace cutlass_ext::sm90
