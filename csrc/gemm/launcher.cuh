// The one launcher every CUTLASS GEMM goes through: can_implement -> initialize -> run.
// Works for CUTLASS 3.x GemmUniversalAdapter and CUTLASS 2.x device::GemmUniversal alike.
#pragma once

#include <cuda_runtime_api.h>

#include <cutlass/cutlass.h>

#include "gemm/gemm_params.h"

namespace cutlass_ext {

template <class Gemm>
LaunchResult launch_gemm(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return {"can_implement", cutlass::cutlassGetStatusString(status)};
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return {"initialize", cutlass::cutlassGetStatusString(status)};
  status = gemm.run(stream);
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
