// What every host binding shares: the error macro, the device-property cache, the current
// stream, output allocation (NaN-poisoned under CUTLASS_EXT_POISON_OUTPUTS=1), dtype mapping
// and launch-result checks. Uses only torch's device-generic headers, so it builds against any
// torch wheel.
#pragma once

#include <torch/extension.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/activation.h"
#include "common/types.h"

namespace cutlass_ext::detail {

// Error messages are built from text only: numbers go through std::to_string and shapes through
// their own formatter, never through an std::ostream number inserter instantiated in this
// library. Against the torch 2.11 wheels on an H200 machine such an inserter (any integer in a
// message) crashed the process inside libstdc++'s locale code instead of raising the error.
inline std::string message_piece(const char* s) { return s; }
inline std::string message_piece(const std::string& s) { return s; }
inline std::string message_piece(c10::string_view s) { return std::string(s); }
inline std::string message_piece(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t d = 0; d < sizes.size(); ++d) out += (d ? ", " : "") + std::to_string(sizes[d]);
  return out + "]";
}
template <class T>
std::string message_piece(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_arithmetic_v<T>) {
    return std::to_string(v);
  } else {
    return c10::str(v);  // torch's types (dtypes, devices) print through torch's own code
  }
}

template <class... Args>
std::string message(const Args&... args) {
  std::string out;
  ((out += message_piece(args)), ...);
  return out;
}

}  // namespace cutlass_ext::detail

#define CE_CHECK(cond, ...) TORCH_CHECK(cond, ::cutlass_ext::detail::message("cutlass_ext: ", __VA_ARGS__))

namespace cutlass_ext {

// ---------------------------------------------------------------------------------------------
// Device and stream helpers (the one device-property cache)

// A device attribute, read once per device. Read concurrently by autograd's per-device threads:
// one atomic slot per device (0 = not read yet; the attributes cached here are never 0).
template <cudaDeviceAttr kAttr>
int device_attribute(int device, const char* what) {
  static std::array<std::atomic<int>, 64> cache{};
  CE_CHECK(device >= 0 && device < int(cache.size()), "device index ", device, " out of range");
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    const cudaError_t err = cudaDeviceGetAttribute(&value, kAttr, device);
    CE_CHECK(err == cudaSuccess, "cannot query the ", what, " of cuda:", device, ": ", cudaGetErrorString(err));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int sm_count(int device) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(device, "multiprocessor count");
}

inline int64_t l2_cache_bytes(int device) {
  return device_attribute<cudaDevAttrL2CacheSize>(device, "L2 cache size");
}

inline int compute_capability_major(int device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, "compute capability");
}

inline cudaStream_t current_stream(const at::Device& device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  return static_cast<cudaStream_t>(stream.native_handle());
}

// Debug aid for tests: CUTLASS_EXT_POISON_OUTPUTS=1 fills every output with NaN (integer ones with
// all bits set) before the kernel writes it, so an element a kernel forgets to write cannot pass a
// comparison.
inline bool poison_outputs() {
  static const bool enabled = [] {
    const char* v = std::getenv("CUTLASS_EXT_POISON_OUTPUTS");
    return v != nullptr && std::string(v) == "1";
  }();
  return enabled;
}

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_outputs()) {
    if (c10::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
      t.fill_(-1);
    } else {
      t.fill_(std::numeric_limits<float>::quiet_NaN());
    }
  }
  return t;
}

// An op's output for a result that was not computed: a tensor of no elements (an op output must
// be a tensor). Internal callers pass undefined tensors instead and allocate only at the op boundary.
inline at::Tensor or_empty(const at::Tensor& t, const at::TensorOptions& options) {
  return t.defined() ? t : at::empty({0}, options);
}

inline void check_launch(const LaunchResult& r, const char* op, const char* kernel) {
  CE_CHECK(r.ok(), op, ": kernel ", kernel, " failed at ", r.stage, ": ", r.detail);
}

inline DType dtype_of(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kFloat: return DType::kF32;
    default:
      CE_CHECK(false, op, ": ", arg, " has dtype ", t.scalar_type(),
               "; supported are float16, bfloat16 and float32");
  }
  return DType::kF32;
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF32: return "f32";
  }
  return "?";
}

inline int64_t activation_code(c10::string_view name, const char* op) {
  for (int i = 0; i < kNumActivations; ++i) {
    if (name == kActivationNames[i]) return i;
  }
  CE_CHECK(false, op, ": unknown activation '", std::string(name), "'");
  return 0;
}

// What the backward of act reads (autograd of linear and lora_linear, as ops/_activation.py's
// saved_for_backward): y for relu, the stored pre-activation for the activations that need it
// (undefined when it was not stored), nothing otherwise.
inline at::Tensor activation_saved_tensor(int code, const at::Tensor& y, const at::Tensor& preact, bool save_preact) {
  if (code == int(Activation::kRelu)) return y;
  if (act::needs_preactivation(code) && save_preact) return preact;
  return at::Tensor();
}

// The backward of an op whose forward did not store the pre-activation it needs fails clearly.
inline void check_activation_saved(int code, const at::Tensor& saved, const std::string& activation, const char* op) {
  CE_CHECK(!act::needs_preactivation(code) || saved.defined(), op, ": the backward of activation '", activation,
           "' needs the pre-activation; call the op with save_preact=True (cutlass_ext.", op,
           " does this when grads are enabled)");
}

// "[8, 16]": a tensor's shape for error messages.
inline std::string shape_str(const at::Tensor& t) { return detail::message_piece(t.sizes()); }

inline int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// `lead` with `last` appended: the output shape of an op over the last dimension.
inline std::vector<int64_t> with_last(at::IntArrayRef lead, std::initializer_list<int64_t> last) {
  std::vector<int64_t> out(lead.begin(), lead.end());
  out.insert(out.end(), last);
  return out;
}

}  // namespace cutlass_ext
