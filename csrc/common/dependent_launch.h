// Programmatic dependent launch (compute capability 9.0 and up) for a kernel that only finishes
// what the kernel before it on the stream wrote: a split reduction's second stage (sum_partials,
// the rank pass's finish). Launched with launch_dependent(), it may be scheduled while the kernel
// before it is still running, so that its launch does not wait for that kernel's end; it calls
// wait_for_prior_grid() before it reads anything, which returns once the prior grid has completed
// and its writes are visible (at once where the kernel was launched without the attribute). The
// kernel before calls allow_dependent_launch() once its blocks have issued their loads: from then
// the dependent's blocks may take SM slots. Captured into CUDA graphs as programmatic edges.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <cuda_runtime_api.h>

#include "common/device_attribute.h"

namespace cutlass_ext {

#if defined(__CUDACC__)
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
#endif

// Off, the dependents launch the usual way (the benchmarks time both).
inline std::atomic<bool>& dependent_launch_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

// Off, the GEMMs that wait for the prior grid at their start (CUTLASS's sm90 kernels compiled with
// CUTLASS_ENABLE_GDC_FOR_SM90: gemm/launcher.cuh) launch the usual way while the other dependents
// stay dependents (dependent_launch_enabled() off turns all of them off). On unless
// CUTLASS_EXT_GEMM_DEPENDENT=0 (comparison runs; the benchmarks' plain_launch provider turns it
// off per call).
inline std::atomic<bool>& gemm_dependent_launch_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* v = std::getenv("CUTLASS_EXT_GEMM_DEPENDENT");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return enabled;
}

// Whether the current device takes the launch attribute (compute capability 9.0 and up), asked
// once per device.
inline bool dependent_launch_supported() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9;
}

// Whether a launch that may be a programmatic dependent is launched as one: the switch is on and
// the current device takes the attribute.
inline bool dependent_launch_active() { return dependent_launch_enabled().load() && dependent_launch_supported(); }

// The launch attribute that makes a kernel a programmatic dependent of the kernel before it.
inline cudaLaunchAttribute programmatic_serialization_attribute() {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

#if defined(__CUDACC__)
// kernel<<<grid, block, 0, stream>>>(args...), as a programmatic dependent of the kernel before it
// where dependent_launch_active(). A launch error is left for cudaGetLastError().
template <class... KernelArgs, class... Args>
void launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  if (!dependent_launch_active()) {
    kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attribute = programmatic_serialization_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
#endif

}  // namespace cutlass_ext
