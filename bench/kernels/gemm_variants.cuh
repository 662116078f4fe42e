// Variants of the library's sm90 GEMM bundle for kernel-level A/B timing (bench/kernels/README.md).
// bf16 operands, A [M, K] row-major and W [N, K] row-major (an nn.Linear weight), D [M, N]:
// D = act(A W^T + bias) with one of the epilogues below. `Variant` takes the tile, cluster,
// schedule, epilogue kind, stage count (0: as many as fit beside the epilogue) and epilogue tile.
#pragma once

#include <cstdio>

#include "gemm/sm90_gemm.cuh"

namespace cutlass_ext::kernel_bench {

using Element = cutlass::bfloat16_t;

enum EpilogueKind {
  kRuntimeActivation = 0,  // bias, activation chosen at run time, every kind inline (RuntimeActivation:
                           // the library's sm90 epilogue before CompactRuntimeActivation; the library_*
                           // variants build the library's own bundle)
  kPlain = 1,              // alpha * acc only (no bias, no activation)
  kReluFixed = 2,          // bias, ReLU fixed at compile time
  kGeluFixed = 3,          // bias, GELU (erf) fixed at compile time
};

template <int Kind>
struct Epilogue;
template <>
struct Epilogue<kRuntimeActivation> {
  using Op = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<ActivationStoring<Element>::Runtime, Element, float, Element,
                                                                  Element>;
};
template <>
struct Epilogue<kPlain> {
  using Op = cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>;
};
template <>
struct Epilogue<kReluFixed> {
  using Op = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<cutlass::epilogue::thread::ReLu, Element, float,
                                                                  Element, Element>;
};
template <>
struct Epilogue<kGeluFixed> {
  using Op = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<cutlass::epilogue::thread::GELU, Element, float,
                                                                  Element, Element>;
};

// A schedule's mainloop with the epilogue that stores from registers (no shared-memory staging,
// no TMA store); CUTLASS builds it for the plain epilogue only.
template <class Schedule>
struct NoSmem {
  using Kernel = typename Schedule::Kernel;
  using Epilogue = cutlass::epilogue::NoSmemWarpSpecialized;
};

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, int Kind, int Stages = 0,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct Variant {
  static constexpr int kKind = Kind;
  static constexpr int kAlignment = 8;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;  // W [N, K] row-major is B [K, N] column-major
  using LayoutD = cutlass::layout::RowMajor;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
      LayoutD, kAlignment, Element, LayoutD, kAlignment, typename Schedule::Epilogue,
      typename Epilogue<Kind>::Op>::CollectiveOp;
  using StageCount = cute::conditional_t<
      (Stages > 0), cutlass::gemm::collective::StageCount<(Stages > 0 ? Stages : 1)>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignment, Element, LayoutB,
      kAlignment, float, TileShape, ClusterShape, StageCount, typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, sm90::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments make_arguments(GemmParams const& p) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {p.M, p.N, p.K, 1};
    args.mainloop.ptr_A = static_cast<Element const*>(p.A);
    args.mainloop.dA = sm90::make_stride3<typename Kernel::StrideA>(p.a_stride_m, p.a_stride_k, 0);
    args.mainloop.ptr_B = static_cast<Element const*>(p.B);
    args.mainloop.dB = sm90::make_stride3<typename Kernel::StrideB>(p.b_stride_n, p.b_stride_k, 0);
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = sm90::make_stride3<typename Kernel::StrideC>(p.d_stride_m, 1, 0);
    args.epilogue.ptr_D = static_cast<Element*>(p.D);
    args.epilogue.dD = sm90::make_stride3<typename Kernel::StrideD>(p.d_stride_m, 1, 0);
    auto& fusion = args.epilogue.thread;
    fusion.alpha = p.alpha;
    fusion.beta = 0.f;
    if constexpr (Kind != kPlain) fusion.bias_ptr = static_cast<Element const*>(p.bias);
    if constexpr (Kind == kRuntimeActivation) fusion.activation.kind = p.activation;
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    args.hw_info.max_active_clusters = p.max_active_clusters;
    args.scheduler.max_swizzle_size = p.swizzle;
    args.scheduler.raster_order = sm90::raster_order(p.raster);
    return args;
  }
};

// The epilogue kind of a bundle: the library's own bundles use the runtime activation.
template <class B, class = void>
struct KindOf {
  static constexpr int value = kRuntimeActivation;
};
template <class B>
struct KindOf<B, std::void_t<decltype(B::kKind)>> {
  static constexpr int value = B::kKind;
};

// The epilogue tile of a collective epilogue, 0x0 for one without (the register-store epilogue).
template <class E, class = void>
struct EpilogueTileOf {
  static constexpr int m = 0, n = 0;
};
template <class E>
struct EpilogueTileOf<E, std::void_t<typename E::EpilogueTile>> {
  static constexpr int m = int(cute::size<0>(typename E::EpilogueTile{}));
  static constexpr int n = int(cute::size<1>(typename E::EpilogueTile{}));
};

template <class B>
void describe(const char* name) {
  using Tile = EpilogueTileOf<typename B::CollectiveEpilogue>;
  std::printf("variant %-22s stages %d, shared memory %d B, epilogue tile %dx%d\n", name,
              int(B::CollectiveMainloop::DispatchPolicy::Stages), int(B::Kernel::SharedStorageSize), Tile::m,
              Tile::n);
}

}  // namespace cutlass_ext::kernel_bench

// Entry points of one variant (one translation unit each): NAME_run, NAME_workspace_size,
// NAME_active_clusters, NAME_describe and NAME_kind.
#define KERNEL_BENCH_VARIANT(NAME, ...)                                                          \
  using NAME##_bundle = __VA_ARGS__;                                                             \
  CUTLASS_EXT_DEFINE_GEMM(NAME, NAME##_bundle)                                                   \
  void NAME##_describe() { ::cutlass_ext::kernel_bench::describe<NAME##_bundle>(#NAME); }       \
  int NAME##_kind() { return ::cutlass_ext::kernel_bench::KindOf<NAME##_bundle>::value; }
