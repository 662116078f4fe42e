// A device attribute asked of the CUDA runtime once per device, for launchers that need it on
// every launch. One atomic slot per device (autograd runs backwards on per-device threads); a
// failed query is not cached. Host code only: included by the binding's module as well.
#pragma once

#include <array>
#include <atomic>

#include <cuda_runtime_api.h>

namespace cutlass_ext {

// Attr's value on `device`, or 0 where it cannot be asked (also for device numbers past 63).
template <cudaDeviceAttr Attr>
int cached_device_attribute(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= int(cache.size())) return 0;
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    if (cudaDeviceGetAttribute(&value, Attr, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

}  // namespace cutlass_ext
