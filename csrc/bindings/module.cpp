// The Python module of the extension. Its import registers every op's CUDA kernels with the
// dispatcher (the TORCH_LIBRARY_IMPL blocks of the other binding files); until then, and where
// it cannot be built, cutlass_ext/ops/_runtime.py routes CUDA calls to a loader or the reference.
// Python itself only asks it what was built.
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/gemm_tuning.h"
#include "common/activation.h"
#include "common/dependent_launch.h"
#include "gemm/gemm_params.h"

namespace cutlass_ext {
namespace {

std::vector<std::string> activation_names() {
  return std::vector<std::string>(kActivationNames, kActivationNames + kNumActivations);
}

std::vector<std::tuple<std::string, std::string>> kernels() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (int i = 0; i < kNumGemmKernels; ++i) out.emplace_back(kGemmKernels[i].name, kGemmKernels[i].config);
  return out;
}

// Clusters of a GEMM kernel that fit on the current device at once (0: not a cluster kernel).
int gemm_active_clusters(const std::string& name) {
  for (int i = 0; i < kNumGemmKernels; ++i) {
    if (name == kGemmKernels[i].name) return kGemmKernels[i].active_clusters();
  }
  throw std::invalid_argument("cutlass_ext: no GEMM kernel named '" + name + "' in this build");
}

// Turns programmatic dependent launch (of the split reductions' second kernels, the rank pass's
// finish and LoRA's extended-K GEMMs) on or off; returns the previous setting.
bool set_dependent_launch(bool enabled) { return dependent_launch_enabled().exchange(enabled); }

// The same for the GEMMs that wait for the prior grid at their start (CUTLASS's sm90 kernels).
bool set_gemm_dependent_launch(bool enabled) { return gemm_dependent_launch_enabled().exchange(enabled); }

}  // namespace
}  // namespace cutlass_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cutlass_ext CUDA kernels (loaded by cutlass_ext on first CUDA use)";
  m.def("activation_names", &cutlass_ext::activation_names);
  m.def("kernels", &cutlass_ext::kernels);
  m.def("_gemm_active_clusters", &cutlass_ext::gemm_active_clusters);
  m.def("_configure_tuning", &cutlass_ext::tuning::configure);
  m.def("_set_tuning_enabled", &cutlass_ext::tuning::set_enabled);
  m.def("_tuning_enabled", &cutlass_ext::tuning::enabled);
  m.def("_set_tuning_sustain_ms", &cutlass_ext::tuning::set_sustain_ms);
  m.def("_tuning_sustain_ms", &cutlass_ext::tuning::sustain_ms);
  m.def("_tuning_entries", &cutlass_ext::tuning::entries);
  m.def("_clear_tuning", &cutlass_ext::tuning::clear);
  m.def("_set_dependent_launch", &cutlass_ext::set_dependent_launch);
  m.def("_set_gemm_dependent_launch", &cutlass_ext::set_gemm_dependent_launch);
}
