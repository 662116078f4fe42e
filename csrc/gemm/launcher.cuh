// The one launcher every CUTLASS GEMM goes through: can_implement -> initialize -> run.
// Works for CUTLASS 3.x GemmUniversalAdapter and CUTLASS 2.x device::GemmUniversal alike.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>

#include "gemm/gemm_params.h"

namespace cutlass_ext {

namespace detail {

template <class T, class = void>
struct IsCutlass3 : std::false_type {};
template <class T>
struct IsCutlass3<T, std::void_t<typename T::GemmKernel::ProblemShape>> : std::true_type {};

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

}  // namespace detail

template <class Gemm>
LaunchResult launch_gemm(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream) {
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess) return {"can_implement", cutlass::cutlassGetStatusString(status)};
  if constexpr (detail::IsCutlass3<Gemm>::value) {
    using Kernel = typename Gemm::GemmKernel;
    status = Kernel::initialize_workspace(args, workspace, stream, nullptr);
    if (status != cutlass::Status::kSuccess) return {"initialize", cutlass::cutlassGetStatusString(status)};
    typename Gemm::Params params = Kernel::to_underlying_arguments(args, workspace);
    const cudaError_t err = detail::raise_smem_limit_once<Kernel>();
    if (err != cudaSuccess) return {"initialize", cudaGetErrorString(err)};
    status = Gemm::run(params, stream);
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
    return ::cutlass_ext::launch_gemm<BUNDLE::Gemm>(BUNDLE::make_arguments(p), workspace, stream); \
  }

}  // namespace cutlass_ext
