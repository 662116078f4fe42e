// A one-thread kernel that keeps a stream busy for a given time, so that launches queued behind
// it run back to back on the GPU however long the host takes to issue each of them: the
// autotuner queues its timed runs behind one, so that a kernel shorter than its own launch cost
// is timed as the kernel, not as the host's launch rate.
#pragma once

#include <cuda_runtime_api.h>

namespace cutlass_ext {

// Queues a kernel on `stream` that returns `microseconds` after it starts (by the GPU's global
// timer). Returns the launch's error.
cudaError_t hold_stream(cudaStream_t stream, unsigned microseconds);

}  // namespace cutlass_ext
