// The one launcher every CUTLASS GEMM goes through: can_implement -> initialize -> run.
// Works for CUTLASS 3.x GemmUniversalAdapter and CUTLASS 2.x device::GemmUniversal alike.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>

#include "common/dependent_launch.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext {

namespace detail {

template <class T, class = void>
struct IsCutlass3 : std::false_type {};
template <class T>
struct IsCutlass3<T, std::void_t<typename T::GemmKernel::ProblemShape>> : std::true_type {};

// Whether a kernel's mainloop waits for the grid before it before its first global load (the
// extended-K mainloop, gemm/sm90_extk.cuh, which waits only before its second operand pair), so
// that it may be launched as a programmatic dependent of the kernel that writes that pair.
template <class T, class = void>
struct WaitsForPriorGrid : std::false_type {};
template <class T>
struct WaitsForPriorGrid<T, std::void_t<decltype(T::kWaitsForPriorGrid)>>
    : std::bool_constant<T::kWaitsForPriorGrid> {};

// Whether CUTLASS's own sm90 kernels in this unit wait for the prior grid at their start: units
// that define CUTLASS_ENABLE_GDC_FOR_SM90 (every Hopper unit but the extended-K ones, whose mainloop
// waits later, and the stream-K ones: GemmKernel.waits_at_start in cutlass_ext/_kernel_table.py).
// Their producer warps execute griddepcontrol.wait before their first global load, and their math
// warpgroups touch global memory (bias, D) only after the loaded stages arrive, so such a kernel
// may follow any kernel as its programmatic dependent: its launch and set-up (barriers, descriptor
// prefetch, cluster sync) overlap that kernel's end. They also allow the next grid's launch as they
// start their last tile.
// Internal linkage: the value is the unit's.
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
constexpr bool kCutlassWaitsAtStart = true;
#else
constexpr bool kCutlassWaitsAtStart = false;
#endif

// A kernel needs its dynamic shared-memory limit raised once per device, not on every launch
// (GemmUniversalAdapter::initialize would call cudaFuncSetAttribute each time).
template <class Kernel>
cudaError_t raise_smem_limit_once() {
  constexpr int smem = Kernel::SharedStorageSize;
  if constexpr (smem < (48 << 10)) {
    return cudaSuccess;
  } else {
    static std::atomic<uint64_t> done_devices{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = uint64_t(1) << (device & 63);
    if (done_devices.load(std::memory_order_acquire) & bit) return cudaSuccess;
    err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess) done_devices.fetch_or(bit, std::memory_order_release);
    return err;
  }
}

// The launch configuration of Kernel on `grid`: in its clusters (where they have more than one
// CTA) and, for a programmatic dependent, with the stream-serialization attribute. `attributes`,
// which the returned configuration points to, receives them.
template <class Kernel>
cudaLaunchConfig_t launch_config(dim3 grid, cudaStream_t stream, cudaLaunchAttribute (&attributes)[2],
                                 bool dependent = false) {
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = 0;
  if constexpr (cute::size(Cluster{}) > 1) {
    cudaLaunchAttribute& cluster = attributes[config.numAttrs++];
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = cute::size<0>(Cluster{});
    cluster.val.clusterDim.y = cute::size<1>(Cluster{});
    cluster.val.clusterDim.z = cute::size<2>(Cluster{});
  }
  if (dependent) attributes[config.numAttrs++] = programmatic_serialization_attribute();
  return config;
}

}  // namespace detail

// Clusters of the kernel that fit on the current device at once, or 0 for a kernel that does not
// run in clusters of more than one CTA (or a CUTLASS 2.x kernel). A cluster stays within one GPC,
// so on a 132-SM H200 fewer 4-CTA clusters than 2-CTA clusters fit. Queried once per device.
template <class Gemm>
int max_active_clusters() {
  if constexpr (detail::IsCutlass3<Gemm>::value) {
    using Kernel = typename Gemm::GemmKernel;
    using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
    if constexpr (cute::size(Cluster{}) > 1) {
      static std::atomic<int> cached[64] = {};
      int device = 0;
      if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
      int clusters = cached[device].load(std::memory_order_relaxed);
      if (clusters > 0) return clusters;
      if (detail::raise_smem_limit_once<Kernel>() != cudaSuccess) return 0;
      cudaLaunchAttribute attributes[2];
      const dim3 one_cluster(cute::size<0>(Cluster{}), cute::size<1>(Cluster{}), cute::size<2>(Cluster{}));
      const cudaLaunchConfig_t config = detail::launch_config<Kernel>(one_cluster, nullptr, attributes);
      if (cudaOccupancyMaxActiveClusters(&clusters, reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>),
                                         &config) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
      }
      cached[device].store(clusters, std::memory_order_relaxed);
      return clusters;
    }
  }
  return 0;
}

// `dependent`: launch as a programmatic dependent of the kernel before it on the stream. Honoured
// only for kernels that wait for that grid before they read what it writes (detail::WaitsForPriorGrid,
// detail::kCutlassWaitsAtStart), where the device and the switches allow (common/dependent_launch.h).
template <class Gemm>
LaunchResult launch_gemm(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream,
                         bool dependent = false) {
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess) return {"can_implement", cutlass::cutlassGetStatusString(status)};
  if constexpr (detail::IsCutlass3<Gemm>::value) {
    using Kernel = typename Gemm::GemmKernel;
    status = Kernel::initialize_workspace(args, workspace, stream, nullptr);
    if (status != cutlass::Status::kSuccess) return {"initialize", cutlass::cutlassGetStatusString(status)};
    typename Gemm::Params params = Kernel::to_underlying_arguments(args, workspace);
    const cudaError_t err = detail::raise_smem_limit_once<Kernel>();
    if (err != cudaSuccess) return {"initialize", cudaGetErrorString(err)};
    using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
    if constexpr (detail::WaitsForPriorGrid<typename Kernel::CollectiveMainloop>::value) {
      dependent = dependent && dependent_launch_active();
    } else if constexpr (detail::kCutlassWaitsAtStart) {
      dependent = dependent && dependent_launch_active() && gemm_dependent_launch_enabled().load();
    } else {
      dependent = false;
    }
    if (cute::size(Cluster{}) == 1 && !dependent) {
      status = Gemm::run(params, stream);
    } else {
      // The cluster launch GemmUniversalAdapter::run makes, without the cudaFuncSetAttribute
      // (non-portable cluster sizes) its ClusterLauncher issues on every launch: our clusters
      // are portable (at most 8 CTAs), and that call cost ~2.3 us of the ~8.5 us a launch took
      // on the host (measured on an H200 machine; the launch itself ~5.7 us).
      static_assert(cute::size(Cluster{}) <= 8, "clusters of more than 8 CTAs need the non-portable attribute");
      const dim3 grid = Kernel::get_grid_shape(params);
      if (grid.x % cute::size<0>(Cluster{}) != 0 || grid.y % cute::size<1>(Cluster{}) != 0 ||
          grid.z % cute::size<2>(Cluster{}) != 0) {
        return {"run", "grid is not a multiple of the cluster shape"};
      }
      cudaLaunchAttribute attributes[2];
      const cudaLaunchConfig_t config = detail::launch_config<Kernel>(grid, stream, attributes, dependent);
      void* kernel_params[] = {&params};
      const cudaError_t launched =
          cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>), kernel_params);
      if (launched != cudaSuccess) return {"launch", cudaGetErrorString(launched)};
    }
  } else {
    Gemm gemm;
    status = gemm.initialize(args, workspace, stream);
    if (status != cutlass::Status::kSuccess) return {"initialize", cutlass::cutlassGetStatusString(status)};
    status = gemm.run(stream);
  }
  if (status != cutlass::Status::kSuccess) return {"run", cutlass::cutlassGetStatusString(status)};
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {"launch", cudaGetErrorString(err)};
  return {};
}

// Each generated kernel file defines its entry points with this macro; `Bundle` provides
// make_arguments(GemmParams) and the device-level Gemm type.
#define CUTLASS_EXT_DEFINE_GEMM(NAME, BUNDLE)                                                   \
  size_t NAME##_workspace_size(::cutlass_ext::GemmParams const& p) {                            \
    return BUNDLE::Gemm::get_workspace_size(BUNDLE::make_arguments(p));                          \
  }                                                                                              \
  ::cutlass_ext::LaunchResult NAME##_run(::cutlass_ext::GemmParams const& p, void* workspace,   \
                                         cudaStream_t stream) {                                 \
    return ::cutlass_ext::launch_gemm<BUNDLE::Gemm>(BUNDLE::make_arguments(p), workspace, stream,  \
                                                    p.dependent_launch);                        \
  }                                                                                              \
  int NAME##_active_clusters() { return ::cutlass_ext::max_active_clusters<BUNDLE::Gemm>(); }

}  // namespace cutlass_ext
