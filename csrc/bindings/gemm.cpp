// Host binding of the GEMM ops: the CUDA kernels of torch.ops.cutlass_ext.linear, matmul, _act_grad
// and _linear_backward, registered with the dispatcher when this library loads (linear's autograd
// node is in autograd.cpp). It checks tensors, picks layouts
// from strides (copying only what TMA cannot read), allocates outputs and workspace from the torch
// allocator, fills the plain params structs and launches on the current stream. Only torch's
// device-generic headers are used (no ATen/cuda), so this file builds against any torch wheel.
#include <torch/extension.h>

#include <ATen/Context.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>

#include "bindings/common.h"
#include "bindings/gemm_op.h"
#include "bindings/gemm_select.h"
#include "bindings/gemm_tuning.h"
#include "bindings/gemm_tuning_rule.h"
#include "common/activation.h"
#include "elementwise/reduce_kernels.h"
#include "elementwise/activation_kernels.h"
#include "elementwise/few_column_backward_kernels.h"
#include "gemm/gemm_params.h"
#include "gemm/hold_stream.h"

namespace cutlass_ext {
namespace {

// ---------------------------------------------------------------------------------------------
// Operand layouts

// A [L, X, Y] matrix as the kernels see it: one unit stride, the other strides multiples of
// `align` elements, a 16-byte aligned base (what TMA needs).
struct MatrixView {
  bool y_contiguous = true;
  int64_t stride_x = 0, stride_y = 0, stride_l = 0;
};

// Returns false when the kernels cannot read `t` in place. Strides of extent-1 modes are never
// used to form an address, so they are replaced by harmless aligned values.
bool as_matrix(const at::Tensor& t, int64_t align, MatrixView& v) {
  const int64_t L = t.size(0), X = t.size(1), Y = t.size(2);
  if (align > 1 && !aligned16(t.data_ptr())) return false;
  auto ok = [&](int64_t s) { return s > 0 && s % align == 0; };
  const int64_t sl = L == 1 ? round_up(X, align) * round_up(Y, align) : t.stride(0);
  if (!ok(sl)) return false;
  if ((t.stride(2) == 1 || Y == 1) && Y % align == 0) {
    const int64_t sx = X == 1 ? round_up(Y, align) : t.stride(1);
    if (ok(sx)) {
      v = {true, sx, 1, sl};
      return true;
    }
  }
  if ((t.stride(1) == 1 || X == 1) && X % align == 0) {
    const int64_t sy = Y == 1 ? round_up(X, align) : t.stride(2);
    if (ok(sy)) {
      v = {false, 1, sy, sl};
      return true;
    }
  }
  return false;
}

// The majorness of an operand of depth K whose stride along K is stride_k, for the kernels that
// read operands where they are (few-column, short-K): a depth-1 operand counts as K-major.
Major major_along_k(int64_t stride_k, int64_t K) { return (stride_k == 1 || K == 1) ? Major::kK : Major::kMN; }

// Copies t [L, X, Y] into a fresh row-major [L, Xp, Yp] tensor, zero-filling the padding.
at::Tensor padded_copy(const at::Tensor& t, int64_t Xp, int64_t Yp) {
  const int64_t X = t.size(1), Y = t.size(2);
  at::Tensor out = (Xp != X || Yp != Y) ? at::zeros({t.size(0), Xp, Yp}, t.options())
                                        : at::empty({t.size(0), Xp, Yp}, t.options());
  out.narrow(1, 0, X).narrow(2, 0, Y).copy_(t);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Kernel selection

bool is_gemv(const GemmKernelEntry& e) { return std::strcmp(e.family, "gemv") == 0; }
bool is_fewrows(const GemmKernelEntry& e) { return std::strcmp(e.family, "fewrows") == 0; }
bool is_ffma(const GemmKernelEntry& e) { return std::strcmp(e.family, "ffma") == 0; }
bool is_wgrad(const GemmKernelEntry& e) { return std::strcmp(e.family, "wgrad") == 0; }
bool is_narrow(const GemmKernelEntry& e) { return std::strcmp(e.family, "narrow") == 0; }
// The hand-written kernels chosen before the others, on unpadded operands (few_column_kernel,
// few_row_kernel, short_k_f32_kernel, narrow_gradient_kernel, narrow_kernel).
bool is_direct(const GemmKernelEntry& e) {
  return is_gemv(e) || is_fewrows(e) || is_ffma(e) || is_wgrad(e) || is_narrow(e);
}

// The kind of kernel a product needs (kernels_for): each flag but `plain` must match the entry's.
struct KernelForm {
  bool aux = false;         // the epilogue also stores the pre-activation
  bool with_c = false;      // the epilogue adds beta * C
  bool transposed = false;  // computes D^T = B^T A^T
  bool ext_k = false;       // adds a second operand pair A2 @ B2 to the product
  bool k_slices = false;    // writes the fp32 partial products of K slices
  bool plain = false;       // the product has no C, aux output, bias or activation
};

// Kernels built for this dtype, math mode, layout and form (empty when the combination has no
// instantiation, or a selective build left it out). Majors are those of the kernel's own
// operands: for transposed kernels A' = B^T and B' = A^T. A `plain` product (no C, aux output,
// bias or activation) takes a config's plain-epilogue kernel where one is built, in place of its
// bias-and-activation kernel; other products never take plain kernels.
std::vector<const GemmKernelEntry*> kernels_for(int arch, DType dtype, MathMode math, Major a, Major b,
                                                KernelForm const& form) {
  std::vector<const GemmKernelEntry*> out;
  for (int i = 0; i < kNumGemmKernels; ++i) {
    const GemmKernelEntry& e = kGemmKernels[i];
    // Exact fp32 has one (CUTLASS 2.x SIMT) path on every arch, and every CUTLASS 2.x kernel
    // (arch 80) can read a C source.
    const bool arch_ok = math == MathMode::kExactF32 || e.arch == arch || e.arch == 0;
    const bool source_ok = e.source == form.with_c || (form.with_c && e.arch == 80);
    const bool form_ok = e.aux == form.aux && e.transposed == form.transposed && e.ext_k == form.ext_k &&
                         e.k_slices == form.k_slices && (form.plain || !e.plain);
    if (arch_ok && source_ok && form_ok && e.dtype == dtype && e.math == math && e.a_major == a && e.b_major == b &&
        !is_direct(e)) {
      out.push_back(&e);
    }
  }
  if (form.plain) {
    auto has_plain_twin = [&](const GemmKernelEntry* e) {
      return !e->plain && std::any_of(out.begin(), out.end(), [&](const GemmKernelEntry* o) {
               return o->plain && std::strcmp(o->config, e->config) == 0;
             });
    };
    out.erase(std::remove_if(out.begin(), out.end(), has_plain_twin), out.end());
  }
  return out;
}

// The GEMM path of a call: the forced config's, else CUTLASS_EXT_GEMM_ARCH's, else the GPU's
// (CUTLASS 3.x kernels on Hopper, CUTLASS 2.x kernels on 8.x GPUs).
int gemm_arch_for(const GemmOptions& opts, int device) {
  const int major = compute_capability_major(device);
  int arch = opts.gemm_arch != 0 ? opts.gemm_arch : major >= 9 ? 90 : 80;
  if (!opts.config.empty()) {
    for (int i = 0; i < kNumGemmKernels; ++i) {
      const GemmKernelEntry& e = kGemmKernels[i];
      if (opts.config == e.config && e.math == MathMode::kTensorOp && e.arch != 0) {
        arch = e.arch;
        break;
      }
    }
  }
  CE_CHECK(arch == 80 || major >= 9, "the sm90 GEMM path (config '", opts.config,
           "' or CUTLASS_EXT_GEMM_ARCH=sm90) needs a Hopper GPU; cuda:", device, " is sm_", major, "x");
  return arch;
}

constexpr int64_t kLowKUnalignedMaxRows = 32768;  // see gemm_op

// The kernel of a forced config (GemmOptions::config) among the candidates.
const GemmKernelEntry* forced_kernel(const std::vector<const GemmKernelEntry*>& candidates,
                                     const std::string& config) {
  std::string names;
  for (const GemmKernelEntry* e : candidates) {
    if (config == e->config) return e;
    names += std::string(" ") + e->config;
  }
  CE_CHECK(false, "config '", config, "' is not built for this dtype, layout and epilogue and shape; built:", names);
  return nullptr;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

// Median time of `reps` runs of `fn` on `stream` (after one warm-up run), in milliseconds.
// The runs are queued behind hold_stream(), so that they run back to back on the GPU: timed as
// they are issued, a kernel shorter than its launch cost reads as the host's launch rate, and the
// pick among such kernels is noise (timed so, the autotuner took 1.27x and 1.80x slower configs
// for the 4.5 and 3.9 us products 2048 x 512 -> 256 and 8192 x 256 -> 64, bench/NOTES.md section
// 74). Where the hold ended before the last run was queued, the runs are timed again behind a
// hold four times as long. Synchronizes: only the opt-in autotuner calls it.
template <class Fn>
float time_median_ms(cudaStream_t stream, int reps, Fn&& fn) {
  fn();
  std::vector<cudaEvent_t> events(2 * reps + 1);
  for (cudaEvent_t& e : events) CE_CHECK(cudaEventCreate(&e) == cudaSuccess, "autotune: cudaEventCreate failed");
  cudaEvent_t held = events.back();
  std::vector<float> ms(reps, std::numeric_limits<float>::infinity());
  cudaError_t err = cudaSuccess;
  for (unsigned hold_us = 100u + 50u * unsigned(reps), tries = 0; tries < 3; hold_us *= 4, ++tries) {
    err = hold_stream(stream, hold_us);
    if (err != cudaSuccess) break;
    cudaEventRecord(held, stream);
    for (int i = 0; i < reps; ++i) {
      cudaEventRecord(events[2 * i], stream);
      fn();
      cudaEventRecord(events[2 * i + 1], stream);
    }
    // Done already: the GPU reached the runs before the last was queued. cudaErrorNotReady (still
    // holding) is also left as the last error, which the next launch check would read: cleared.
    const cudaError_t query = cudaEventQuery(held);
    if (query == cudaErrorNotReady) (void)cudaGetLastError();
    const bool starved = query == cudaSuccess;
    err = cudaEventSynchronize(events[2 * reps - 1]);
    if (err != cudaSuccess || !starved) break;
  }
  for (int i = 0; i < reps && err == cudaSuccess; ++i) cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]);
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  CE_CHECK(err == cudaSuccess, "autotune: ", cudaGetErrorString(err));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// Runs `fn` back to back on `stream` for `ms` milliseconds of wall time (four calls between
// synchronizations), so that the GPU reaches the clock it holds for `fn` alone: under the power
// cap that takes 100-200 ms of a large product (bench/NOTES.md section 72). Only the opt-in
// autotuner calls it.
template <class Fn>
void run_alone_ms(cudaStream_t stream, int ms, Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(ms)) {
    for (int i = 0; i < 4; ++i) fn();
    const cudaError_t err = cudaStreamSynchronize(stream);
    CE_CHECK(err == cudaSuccess, "autotune: ", cudaGetErrorString(err));
  }
}

void run_activation(const at::Tensor& input, const at::Tensor& output, int64_t activation, cudaStream_t stream) {
  ActForwardParams p;
  p.numel = input.numel();
  p.dtype = dtype_of(input, "gemm", "input");
  p.activation = int(activation);
  p.input = input.data_ptr();
  p.output = output.data_ptr();
  check_launch(activation_forward(p, stream), "gemm", "activation_forward");
}

// Whether `t` [L, M, N] can be a kernel's C or D as is: unit column stride, aligned rows.
bool epilogue_readable(const at::Tensor& t, int64_t align) {
  const int64_t M = t.size(1), N = t.size(2);
  if (N % align != 0 || !aligned16(t.data_ptr())) return false;
  if (N > 1 && t.stride(2) != 1) return false;
  if (M > 1 && t.stride(1) % align != 0) return false;
  return t.size(0) == 1 || t.stride(0) % align == 0;
}

}  // namespace

GemmOptions gemm_options() {
  GemmOptions o;
  o.exact_f32 = !at::globalContext().allowTF32CuBLAS();
  if (const char* v = std::getenv("CUTLASS_EXT_GEMM_CONFIG")) o.config = v;
  if (const char* v = std::getenv("CUTLASS_EXT_GEMM_ARCH")) {
    const std::string s(v);
    CE_CHECK(s.empty() || s == "sm90" || s == "sm80", "CUTLASS_EXT_GEMM_ARCH=", s,
             " must be sm90 or sm80 (or unset for the GPU's own)");
    o.gemm_arch = s == "sm90" ? 90 : s == "sm80" ? 80 : 0;
  }
  if (const char* v = std::getenv("CUTLASS_EXT_GEMM_SWIZZLE")) {
    const std::string s(v);
    CE_CHECK(s == "0" || s == "1" || s == "2" || s == "4" || s == "8",
             "CUTLASS_EXT_GEMM_SWIZZLE=", s, " must be 1, 2, 4 or 8 (or 0 for the heuristic)");
    o.swizzle = std::stoi(s);
  }
  if (const char* v = std::getenv("CUTLASS_EXT_GEMM_RASTER")) {
    const std::string s(v);
    CE_CHECK(s.empty() || s == "along_m" || s == "along_n", "CUTLASS_EXT_GEMM_RASTER=", s,
             " must be along_m or along_n (or unset for CUTLASS's heuristic)");
    o.raster = s == "along_m" ? 1 : s == "along_n" ? 2 : 0;
  }
  return o;
}

// The hand-written kernel of `family` for this dtype, math mode, epilogue and B layout, when it is
// built and the config override (`config`, empty for none) does not name another kernel; `forced`
// when the override names it.
struct DirectEntry {
  const GemmKernelEntry* entry = nullptr;
  bool forced = false;
};

DirectEntry direct_entry(bool (*family)(const GemmKernelEntry&), DType dt, MathMode math, bool aux, Major b_major,
                         const std::string& config) {
  for (int i = 0; i < kNumGemmKernels; ++i) {
    const GemmKernelEntry& e = kGemmKernels[i];
    if (e.dtype == dt && e.math == math && e.aux == aux && e.b_major == b_major && family(e)) {
      const bool forced = config == e.config;
      if (!config.empty() && !forced) return {};
      return {&e, forced};
    }
  }
  return {};
}

// Few output columns: the hand-written dot-product kernel (gemm/gemv_gemm.cuh), which reads A, B
// and the bias where they are (any alignment, any strides of B) and writes D unpadded, or nullptr
// for the other kernels. It needs a K-major A (a unit stride along K), no C source and no second
// product, and B must fit its shared memory (N <= 16). Unforced it takes N <= 4, measured on an
// H200 (bf16, bench/gemm_configs.py --set fewcols, bench/results/gemm_configs-fewcols-bf16.json):
// 1.04-1.39x cuBLASLt at 65536 rows and at 2048 rows with K = 256-1024 (0.91x at 2048 x 64 -> 4,
// launch-bound; 0.76-0.97x at 2048 x 4096, half the SMs without a tile), ahead of every CUTLASS
// tile but at 2048 x 4096 -> 4 (31.6 us against 30.2 for the 64x64 transposed tile); at N = 8 and
// 16 the transposed tensor-core tiles were faster (it reads 8-16 bytes of B from shared memory per
// element of A there); fp32 takes it up to N = 16, with TF32 over more than 16384 rows only where N
// is not a multiple of 4 (gemv_chosen in gemm_select.h). The config override forces it (an error
// where it cannot run) or excludes it.

const GemmKernelEntry* few_column_kernel(DType dt, MathMode math, bool aux, const at::Tensor& a3, const at::Tensor& b3,
                                         bool with_c_or_a2, const std::string& config) {
  const int64_t K = a3.size(2), N = b3.size(2);
  if (config.empty() && !gemv_chosen(dt == DType::kF32, math == MathMode::kExactF32, a3.size(0) * a3.size(1), N)) {
    return nullptr;  // most calls: no table walk
  }
  const auto [entry, forced] = direct_entry(is_gemv, dt, math, aux, major_along_k(b3.stride(1), K), config);
  if (entry == nullptr) return nullptr;
  const bool runs = N <= kGemvMaxN && (a3.stride(2) == 1 || K == 1) && !with_c_or_a2 &&
                    gemv_shared_bytes(K, N, int(a3.element_size())) <= kGemvMaxSharedBytes;
  CE_CHECK(runs || !forced, "config '", config, "' takes N <= ", kGemvMaxN,
           ", a K-major A (unit stride along K), no C source and B small enough for ", kGemvMaxSharedBytes / 1024,
           " KB of shared memory as fp32; this product is ", a3.size(1), " x ", K, " -> ", N, " with A strides ",
           a3.strides());
  return runs ? entry : nullptr;  // forced, or unforced with N within the rule above
}

// Whether a kernel can read operand t [L, X, Y] in 16-byte pieces along rows `stride` elements
// apart: 16-byte aligned data, the row and batch strides multiples of 16 bytes.
bool in_16_byte_pieces(const at::Tensor& t, int64_t stride) {
  const int64_t vec = 16 / int64_t(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && stride % vec == 0 &&
         (t.size(0) == 1 || t.stride(0) % vec == 0);
}

// The same for A [L, M, K] along K: K-major rows, K a multiple of 16 bytes too.
bool a_in_16_byte_pieces(const at::Tensor& a3) {
  const int64_t M = a3.size(1), K = a3.size(2), vec = 16 / int64_t(a3.element_size());
  return K % vec == 0 && a3.stride(2) == 1 && in_16_byte_pieces(a3, M == 1 ? 0 : a3.stride(1));
}

// The same for B [L, K, N] along its unit stride: K-major rows of a weight, or N-major rows (N a
// multiple of 16 bytes too).
bool b_in_16_byte_pieces(const at::Tensor& b3, Major b_major) {
  const int64_t N = b3.size(2), vec = 16 / int64_t(b3.element_size());
  return b_major == Major::kK ? in_16_byte_pieces(b3, N == 1 ? 0 : b3.stride(2))
                              : b3.stride(2) == 1 && N % vec == 0 && in_16_byte_pieces(b3, b3.stride(1));
}

// Whether the short-K kernel copies `t` ([L, lines, K]: A, or B transposed) as one run of 16-byte
// pieces a tile (its packed path, gemm/lowk_gemm.cuh): contiguous K-major lines, 16-byte aligned,
// batches a multiple of 16 bytes apart.
bool lowk_packs(const at::Tensor& t) {
  const int64_t lines = t.size(1), K = t.size(2);
  return (K == 1 || t.stride(2) == 1) && (lines == 1 || t.stride(1) == K) && in_16_byte_pieces(t, 0);
}

// Few rows of fp32 against a weight (decode steps, small batches) with TF32 allowed: the
// hand-written stream over the weight (gemm/fewrows_gemm.cuh), or nullptr for the other kernels.
// It reads A, B and the bias where they are and writes D unpadded, but needs a K-major A, a K- or
// N-major B, K (and N for an N-major B) and the row strides multiples of 16 bytes, 16-byte
// aligned data, no C source and no second product. Unforced it takes N and K from
// kFewRowsMinWidth on and, measured on an H200 (bench/NOTES.md sections 32 and 33):
// - a K-major B up to 4 rows: 1 x 4096 -> 4096 29.6 us against 34.5 for the 128x32 split-K TF32
//   tile and 35.5 for cuBLAS; from 12 rows the split-K tile was faster;
// - an N-major B up to 8 rows (the transposed tiles it would otherwise take transpose their
//   operand in registers): 1 and 8 x 4096 -> 4096 27.3 and 29.1 us against 37.8 and 38.3 for
//   the transposed 128x32 split-K tile (cuBLAS 24.0 and 31.6); up to 16 rows where B has at most
//   4096 x 4096 elements: 16 x 1024 -> 1024 11.2 us against 19.6, 16 x 2048 -> 2048 18.0 against
//   24.3, 16 x 4096 -> 1024 28.8 against 32.9; at 12-16 rows the split-K tile was faster on
//   11008-wide products.
// The config override forces it (an error where it cannot run) or excludes it.
constexpr int64_t kFewRowsChosenMaxM = 4;
constexpr int64_t kFewRowsChosenMaxMNMajor = 8;
constexpr int64_t kFewRowsChosenMaxMSmallNMajor = 16;
constexpr int64_t kFewRowsSmallWeight = int64_t(4096) * 4096;
constexpr int64_t kFewRowsMinWidth = 256;

const GemmKernelEntry* few_row_kernel(DType dt, MathMode math, bool aux, const at::Tensor& a3, const at::Tensor& b3,
                                      bool with_c_or_a2, const std::string& config) {
  const int64_t M = a3.size(1), K = a3.size(2), N = b3.size(2);
  const Major b_major = major_along_k(b3.stride(1), K);
  const bool b_k_major = b_major == Major::kK;
  const int64_t chosen_max_m = b_k_major                      ? kFewRowsChosenMaxM
                               : N * K <= kFewRowsSmallWeight ? kFewRowsChosenMaxMSmallNMajor
                                                              : kFewRowsChosenMaxMNMajor;
  if (config.empty() && (M > chosen_max_m || K < kFewRowsMinWidth || N < kFewRowsMinWidth)) return nullptr;
  const auto [entry, forced] = direct_entry(is_fewrows, dt, math, aux, b_major, config);
  if (entry == nullptr) return nullptr;
  const bool runs =
      M <= kFewRowsMaxM && !with_c_or_a2 && a_in_16_byte_pieces(a3) && b_in_16_byte_pieces(b3, b_major);
  CE_CHECK(runs || !forced, "config '", config, "' takes M <= ", kFewRowsMaxM,
           ", a K-major A and a K- or N-major B (a unit stride along K or N), K (and N for an N-major B) and their "
           "row strides multiples of 16 bytes, 16-byte aligned data and no C source; this product is ", M, " x ", K,
           " -> ", N, " with A strides ", a3.strides(), " and B strides ", b3.strides());
  return runs ? entry : nullptr;
}

// fp32 with a short K: the hand-written kernel that multiplies exactly on the FMA units
// (gemm/ffma_gemm.cuh), reading A, B and the bias where they are and writing D unpadded, or
// nullptr for the other kernels. It takes K <= kFfmaMaxK, no C source and no second product;
// unforced, the products ffma_takes gives it (gemm_select.h).
const GemmKernelEntry* short_k_f32_kernel(DType dt, MathMode math, bool aux, const at::Tensor& a3,
                                          const at::Tensor& b3, bool with_c_or_a2, const std::string& config) {
  const int64_t K = a3.size(2);
  if (dt != DType::kF32 || (config.empty() && K > kFfmaMaxK)) return nullptr;
  const auto [entry, forced] = direct_entry(is_ffma, dt, math, aux, major_along_k(b3.stride(1), K), config);
  if (entry == nullptr) return nullptr;
  const bool runs = K <= kFfmaMaxK && !with_c_or_a2;
  CE_CHECK(runs || !forced, "config '", config, "' takes K <= ", kFfmaMaxK,
           " and no C source; this product is ", a3.size(1), " x ", K, " -> ", b3.size(2),
           with_c_or_a2 ? " with a C source" : "");
  if (!runs || forced) return runs ? entry : nullptr;
  MatrixView va, vb;
  const bool tiles_read_in_place = K % 4 == 0 && as_matrix(a3, 4, va) && as_matrix(b3, 4, vb);
  return ffma_takes(math == MathMode::kExactF32, K, a3.size(0) * a3.size(1) * b3.size(2), tiles_read_in_place)
             ? entry
             : nullptr;
}

// The weight gradient of a narrow fp32 layer (dW = dZ^T X of row-major dZ and X: an M-major A,
// an N-major B, M or N at most kWgradMaxNarrow): the hand-written reduction over rows on the FMA
// units (gemm/wgrad_gemm.cuh), or nullptr for the other kernels. Plain products only (no bias,
// activation, aux output, C source or batch). Unforced it takes every such product under either
// policy: TF32 tiles transpose both operands in registers there (a 512 x 2048 -> 16 product,
// the weight gradient of a 13 -> 512 layer over 2048 rows, took 40 us on an H200) and exact fp32
// has only CUTLASS's SIMT kernel (195 us).
constexpr int64_t kWgradMaxNarrow = 16;

const GemmKernelEntry* narrow_gradient_kernel(DType dt, MathMode math, bool plain, const at::Tensor& a3,
                                              const at::Tensor& b3, bool with_c_or_a2, const std::string& config) {
  if (dt != DType::kF32) return nullptr;
  const int64_t L = a3.size(0), M = a3.size(1), N = b3.size(2);
  if (config.empty() && std::min(M, N) > kWgradMaxNarrow) return nullptr;
  const auto [entry, forced] = direct_entry(is_wgrad, dt, math, false, Major::kMN, config);
  if (entry == nullptr) return nullptr;
  const bool runs = plain && !with_c_or_a2 && L == 1 && std::min(M, N) <= kWgradMaxNarrow &&
                    (M == 1 || a3.stride(1) == 1) && (N == 1 || b3.stride(2) == 1) && a3.size(2) >= 1;
  CE_CHECK(runs || !forced, "config '", config, "' takes plain products (no bias, activation or C) of an M-major A ",
           "and an N-major B with M or N <= ", kWgradMaxNarrow, " and no batch; this product is ", M, " x ",
           a3.size(2), " -> ", N, " with A strides ", a3.strides(), " and B strides ", b3.strides());
  return runs ? entry : nullptr;
}

// Narrow outputs of 16-bit products over many rows: the hand-written kernel that holds all of N
// and K in one block (gemm/narrow_gemm.cuh), or nullptr for the other kernels. It reads A, B and
// the bias where they are and writes D unpadded, but needs a K-major A, a K- or N-major B, K (and
// N for an N-major B) and the row strides multiples of 16 bytes, 16-byte aligned data, no C source
// and no second product. Unforced, the products narrow_chosen gives it (gemm_select.h). The
// config override forces it (an error where it cannot run) or excludes it.
const GemmKernelEntry* narrow_kernel(DType dt, MathMode math, bool aux, const at::Tensor& a3, const at::Tensor& b3,
                                     bool with_c_or_a2, const std::string& config) {
  if (dt == DType::kF32) return nullptr;
  const int64_t L = a3.size(0), M = a3.size(1), K = a3.size(2), N = b3.size(2);
  if (config.empty() && !narrow_chosen(M * L, N, K)) return nullptr;
  const Major b_major = major_along_k(b3.stride(1), K);
  const auto [entry, forced] = direct_entry(is_narrow, dt, math, aux, b_major, config);
  if (entry == nullptr) return nullptr;
  const bool runs = N <= kNarrowMaxN && K <= kNarrowMaxK && L <= 65535 && !with_c_or_a2 &&
                    a_in_16_byte_pieces(a3) && b_in_16_byte_pieces(b3, b_major);
  CE_CHECK(runs || !forced, "config '", config, "' takes N <= ", kNarrowMaxN, " and K <= ", kNarrowMaxK,
           ", a K-major A and a K- or N-major B (a unit stride along K or N), K (and N for an N-major B) and their "
           "row strides multiples of 16 bytes, 16-byte aligned data and no C source; this product is ", M, " x ", K,
           " -> ", N, " with A strides ", a3.strides(), " and B strides ", b3.strides());
  return runs ? entry : nullptr;
}

// ---------------------------------------------------------------------------------------------
// gemm: D = act(alpha * A @ B + C + bias), optionally also Aux = the pre-activation.
// a: [M, K] or [L, M, K]; b: [K, N] or [L, K, N] (any strides); bias: [N] or None;
// extra.c (added with beta = 1) and extra.out (where D goes; it may be c itself): like D.
// Returns (D, Aux) with D contiguous [.., M, N] (or extra.out); Aux is an empty tensor unless
// requested and the activation's backward needs it.

std::tuple<at::Tensor, at::Tensor> gemm_op(const at::Tensor& a, const at::Tensor& b,
                                           const c10::optional<at::Tensor>& bias, int64_t activation,
                                           bool want_aux, const GemmOptions& opts, const GemmExtra& extra) {
  const char* op = "gemm";
  CE_CHECK(a.is_cuda() && b.is_cuda(), op, ": A and B must be CUDA tensors");
  CE_CHECK(a.device() == b.device(), op, ": A is on ", a.device(), " but B is on ", b.device());
  CE_CHECK((a.dim() == 2 || a.dim() == 3) && b.dim() == a.dim(), op,
           ": A and B must both be 2-D or both 3-D, got ", a.dim(), "-D and ", b.dim(), "-D");
  CE_CHECK(activation >= 0 && activation < kNumActivations, op, ": unknown activation code ", activation);
  const DType dt = dtype_of(a, op, "A");
  CE_CHECK(b.scalar_type() == a.scalar_type(), op, ": B has dtype ", b.scalar_type(), " but A has ",
           a.scalar_type());
  const c10::DeviceGuard guard(a.device());
  const bool batched = a.dim() == 3;
  at::Tensor a3 = batched ? a : a.unsqueeze(0);
  at::Tensor b3 = batched ? b : b.unsqueeze(0);
  const int64_t L = a3.size(0), M = a3.size(1), K = a3.size(2), N = b3.size(2);
  CE_CHECK(b3.size(0) == L && b3.size(1) == K, op, ": shapes ", shape_str(a), " and ", shape_str(b),
           " cannot be multiplied");
  CE_CHECK(M <= std::numeric_limits<int>::max() && N <= std::numeric_limits<int>::max() &&
               K <= std::numeric_limits<int>::max() && L <= std::numeric_limits<int>::max(),
           op, ": dimensions must fit in 32 bits");
  if (bias.has_value()) {
    CE_CHECK(bias->device() == a.device() && bias->scalar_type() == a.scalar_type() && bias->dim() == 1 &&
                 bias->size(0) == N,
             op, ": bias must be a [", N, "] ", a.scalar_type(), " tensor on ", a.device());
  }
  auto as_lmn = [&](const at::Tensor& t, const char* name) {
    CE_CHECK(t.device() == a.device() && t.scalar_type() == a.scalar_type() && t.dim() == a.dim(), op, ": ",
             name, " must be a ", a.scalar_type(), " tensor on ", a.device(), " shaped like the product");
    at::Tensor t3 = batched ? t : t.unsqueeze(0);
    CE_CHECK(t3.size(0) == L && t3.size(1) == M && t3.size(2) == N, op, ": ", name, " has shape ", shape_str(t),
             " but the product is [", L, ", ", M, ", ", N, "]");
    return t3;
  };
  at::Tensor c3 = extra.c.defined() ? as_lmn(extra.c, "C") : at::Tensor();
  // The second product: its operands and, where no extended-K kernel serves the call, the
  // fallback that computes it first and accumulates it as C.
  const bool has_a2 = extra.a2.defined();
  at::Tensor a2_3, b2_3;
  if (has_a2) {
    CE_CHECK(extra.b2.defined() && !extra.c.defined(), op, ": A2 needs B2 and excludes C");
    CE_CHECK(extra.a2.device() == a.device() && extra.b2.device() == a.device() &&
                 extra.a2.scalar_type() == a.scalar_type() && extra.b2.scalar_type() == a.scalar_type() &&
                 extra.a2.dim() == a.dim() && extra.b2.dim() == a.dim(),
             op, ": A2 and B2 must be ", a.scalar_type(), " tensors on ", a.device(), " with A's rank");
    a2_3 = batched ? extra.a2 : extra.a2.unsqueeze(0);
    b2_3 = batched ? extra.b2 : extra.b2.unsqueeze(0);
    CE_CHECK(a2_3.size(0) == L && a2_3.size(1) == M && b2_3.size(0) == L && b2_3.size(2) == N &&
                 a2_3.size(2) == b2_3.size(1),
             op, ": A2 ", shape_str(extra.a2), " and B2 ", shape_str(extra.b2), " do not make a [", M, ", ", N,
             "] product");
  }
  auto without_a2 = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    at::Tensor low = std::get<0>(gemm_op(extra.a2, extra.b2, c10::nullopt, 0, false, opts, GemmExtra{extra.alpha}));
    GemmExtra rest{extra.alpha, low, extra.out.defined() ? extra.out : low};
    return gemm_op(a, b, bias, activation, want_aux, opts, rest);
  };
  at::Tensor out3 = extra.out.defined() ? as_lmn(extra.out, "out") : at::Tensor();
  const bool aux = want_aux && act::needs_preactivation(int(activation));
  const at::TensorOptions options = a.options();
  auto shape_out = [&](const at::Tensor& t) { return batched ? t : t.squeeze(0); };
  // D goes to extra.out when given: copied there unless the kernel wrote it in place.
  auto deliver = [&](at::Tensor d, at::Tensor z) -> std::tuple<at::Tensor, at::Tensor> {
    if (out3.defined()) {
      if (!d.is_same(out3)) out3.copy_(d);
      d = out3;
    }
    return {shape_out(d), aux ? shape_out(z) : at::Tensor()};
  };

  if (has_a2 && (K == 0 || a2_3.size(2) == 0)) return without_a2();
  if (M == 0 || N == 0 || K == 0) {
    // Nothing to multiply: D = act(C + bias) broadcast (or act(0)).
    at::Tensor z = bias.has_value() ? bias->expand({L, M, N}).contiguous() : at::zeros({L, M, N}, options);
    if (c3.defined()) z.add_(c3);
    at::Tensor d = new_output({L, M, N}, options);
    run_activation(z, d, activation, current_stream(a.device()));
    return deliver(d, z);
  }

  // Parameters of a launch on the operands where they are (the few-column and the short-K kernels
  // read any strides): D and Aux [L, M, N] with adjacent columns, the bias with a unit stride. A
  // depth-1 operand counts as K-major, whatever its stride along K.
  auto unpadded_params = [&](const at::Tensor& d, const at::Tensor& z, const at::Tensor& bias_1) {
    GemmParams p;
    p.M = int(M);
    p.N = int(N);
    p.K = int(K);
    p.L = int(L);
    p.A = a3.data_ptr();
    p.a_stride_m = a3.stride(1);
    p.a_stride_k = K == 1 ? 1 : a3.stride(2);
    p.a_stride_l = a3.stride(0);
    p.B = b3.data_ptr();
    p.b_stride_k = K == 1 ? 1 : b3.stride(1);
    p.b_stride_n = b3.stride(2);
    p.b_stride_l = L > 1 ? b3.stride(0) : 0;
    p.D = d.data_ptr();
    p.d_stride_m = M > 1 ? d.stride(1) : N;
    p.d_stride_l = L > 1 ? d.stride(0) : M * N;
    p.bias = bias_1.defined() ? bias_1.data_ptr() : nullptr;
    p.aux = z.defined() ? z.data_ptr() : nullptr;
    p.aux_stride_m = z.defined() ? z.stride(1) : 0;
    p.aux_stride_l = z.defined() ? z.stride(0) : 0;
    p.activation = int(activation);
    p.alpha = extra.alpha;
    p.device = a.device().index();
    p.sm_count = sm_count(p.device);
    p.raster = opts.raster;  // the short-K kernel's walk (gemm/lowk_gemm.cuh)
    return p;
  };

  const MathMode math = (dt == DType::kF32 && opts.exact_f32) ? MathMode::kExactF32 : MathMode::kTensorOp;
  const GemmKernelEntry* direct = few_column_kernel(dt, math, aux, a3, b3, has_a2 || c3.defined(), opts.config);
  if (direct == nullptr) direct = few_row_kernel(dt, math, aux, a3, b3, has_a2 || c3.defined(), opts.config);
  if (direct == nullptr) direct = narrow_kernel(dt, math, aux, a3, b3, has_a2 || c3.defined(), opts.config);
  if (direct == nullptr) direct = short_k_f32_kernel(dt, math, aux, a3, b3, has_a2 || c3.defined(), opts.config);
  if (direct == nullptr) {
    const bool plain = !aux && !bias.has_value() && activation == int64_t(Activation::kNone);
    direct = narrow_gradient_kernel(dt, math, plain, a3, b3, has_a2 || c3.defined(), opts.config);
  }
  if (direct != nullptr) {
    // D straight into extra.out when its columns are adjacent (the kernels' only requirement; the
    // weight-gradient kernel's sums go to a contiguous D).
    const bool out_ok = out3.defined() && (N == 1 || out3.stride(2) == 1) && (!is_wgrad(*direct) || out3.is_contiguous());
    at::Tensor d = out_ok ? out3 : new_output({L, M, N}, options);
    at::Tensor z = aux ? new_output({L, M, N}, options) : at::Tensor();
    // The kernel reads the bias with a unit stride.
    const at::Tensor bias_1 =
        !bias.has_value() ? at::Tensor() : (N == 1 || bias->stride(0) == 1) ? *bias : bias->contiguous();
    const GemmParams p = unpadded_params(d, z, bias_1);
    const size_t workspace_bytes = direct->workspace_size(p);
    const at::Tensor workspace =
        workspace_bytes > 0 ? at::empty({int64_t(workspace_bytes)}, options.dtype(at::kByte)) : at::Tensor();
    check_launch(direct->run(p, workspace_bytes > 0 ? workspace.data_ptr() : nullptr, current_stream(a.device())), op,
                 direct->name);
    return deliver(d, z);
  }
  const int64_t align = math == MathMode::kExactF32 ? 1 : 16 / int64_t(a.element_size());
  const int64_t Kp = round_up(K, align), Np = round_up(N, align);
  // No extended-K kernel writes a padded D: decide before any operand is copied, so that the
  // fallback's own call is the only one that pads.
  if (has_a2 && Np != N) return without_a2();

  // A short K with operands that would be copied (K or a row stride not a multiple of 16 bytes:
  // a 13-feature input layer, the K = 1 product of a one-column layer's backward): the short-K
  // kernel reads them where they are (gemm/lowk_gemm.cuh), so the call is one launch. Its
  // epilogue still needs 16-byte pieces: N a multiple of 8, aligned C and output. A contiguous
  // operand (lowk_packs) is copied as 16-byte pieces, asynchronously like an aligned one, and
  // that beats the padded copy at every size measured (H200, bf16 x @ W^T + bias, relu, 13 ->
  // 512: 65536 rows 49.4-50.0 us against 59.1). Any other is read element by element, whose
  // loads wait before each tile's product, so past kLowKUnalignedMaxRows rows the padded copy and
  // the vector kernel take it (when the element-wise path was written, 65536 x 13 -> 512 took
  // 55.7 us that way against 53.0 with the copy).
  MatrixView va, vb;
  const bool a_readable = as_matrix(a3, align, va), b_readable = as_matrix(b3, align, vb);
  const bool unaligned_operands = Kp != K || !a_readable || !b_readable;
  const bool lowk_in_pieces =
      (a_readable || lowk_packs(a3)) && (b_readable || lowk_packs(b3.transpose(1, 2)));
  if (unaligned_operands && math == MathMode::kTensorOp && a.element_size() == 2 && !has_a2 && Np == N &&
      (M * L <= kLowKUnalignedMaxRows || lowk_in_pieces) && lowk_takes(K, M, L) &&
      (!c3.defined() || epilogue_readable(c3, align))) {
    const int arch = gemm_arch_for(opts, a.device().index());
    const GemmKernelEntry* lowk = nullptr;
    KernelForm form;
    form.aux = aux;
    form.with_c = c3.defined();
    for (const GemmKernelEntry* e :
         kernels_for(arch, dt, math, major_along_k(a3.stride(2), K), major_along_k(b3.stride(1), K), form)) {
      if (is_lowk(*e) && (opts.config.empty() || opts.config == e->config)) lowk = e;
    }
    if (lowk != nullptr) {
      const bool direct = out3.defined() && epilogue_readable(out3, align);
      at::Tensor d = direct ? out3 : new_output({L, M, N}, options);
      at::Tensor z = aux ? new_output({L, M, N}, options) : at::Tensor();
      at::Tensor bias_k;
      if (bias.has_value()) bias_k = (bias->stride(0) == 1 && aligned16(bias->data_ptr())) ? *bias : bias->clone();
      GemmParams p = unpadded_params(d, z, bias_k);
      if (c3.defined()) {
        p.C = c3.data_ptr();
        p.c_stride_m = M > 1 ? c3.stride(1) : N;
        p.c_stride_l = L > 1 ? c3.stride(0) : M * N;
        p.beta = 1.f;
      }
      check_launch(lowk->run(p, nullptr, current_stream(a.device())), op, lowk->name);
      return deliver(d, z);
    }
  }

  // Copies of an operand, K-major and padded to (Kp, Np), which every build can read.
  auto copy_a_k_major = [&] {
    a3 = padded_copy(a3, M, Kp);
    CE_CHECK(as_matrix(a3, align, va), op, ": internal error: K-major copy of A is not readable");
  };
  auto copy_b_k_major = [&] {
    b3 = padded_copy(b3.transpose(1, 2), Np, Kp).transpose(1, 2);
    CE_CHECK(as_matrix(b3, align, vb), op, ": internal error: K-major copy of B is not readable");
  };
  // A 16-bit B with adjacent columns (the row-major input X [rows, width] of a weight gradient
  // dZ^T X) keeps its majorness, padded to (Kp, Np): a row copy rather than a transpose, and the
  // product keeps the layouts of the K-slices kernels (N-major B only). With a 13-wide X the
  // K-major copy left dW = dZ^T X to CUTLASS's split-K: 42 us at 8192 x 13 -> 512 on an H200
  // (bench/NOTES.md section 22). Every 16-bit build reads an N-major B; TF32 copies K-major.
  auto copy_b = [&] {
    if (a.element_size() == 2 && N > 1 && K > 1 && b3.stride(2) == 1) {
      b3 = padded_copy(b3, Kp, Np);
      CE_CHECK(as_matrix(b3, align, vb), op, ": internal error: N-major copy of B is not readable");
    } else {
      copy_b_k_major();
    }
  };
  if (!(Kp == K && a_readable)) copy_a_k_major();
  if (!(Kp == K && Np == N && b_readable)) copy_b();
  at::Tensor bias_k;
  if (bias.has_value()) {
    bias_k = *bias;
    if (Np != N || !aligned16(bias_k.data_ptr())) {
      at::Tensor padded = at::zeros({Np}, options);
      padded.narrow(0, 0, N).copy_(bias_k);
      bias_k = padded;
    }
  }

  const bool with_c = c3.defined();
  const int arch = gemm_arch_for(opts, a.device().index());
  // No kernel has both a C source and an aux output, and only the Hopper path has aux outputs;
  // such calls store Z and activate after.
  const bool kernel_aux = aux && math == MathMode::kTensorOp && !with_c && arch == 90;
  // The kernel adds no C, bias or activation (an aux call without an aux kernel activates after).
  const bool plain = !kernel_aux && !with_c && !bias_k.defined() && (aux || activation == int64_t(Activation::kNone));
  auto major_a = [&] { return va.y_contiguous ? Major::kK : Major::kMN; };
  auto major_b = [&] { return vb.y_contiguous ? Major::kMN : Major::kK; };
  // The short-K kernel takes part only when K fits it.
  auto usable = [&](std::vector<const GemmKernelEntry*> v) {
    v.erase(std::remove_if(v.begin(), v.end(), [&](const GemmKernelEntry* e) { return !runs_depth(*e, Kp); }),
            v.end());
    return v;
  };
  KernelForm form;
  form.aux = kernel_aux;
  form.with_c = with_c;
  form.plain = plain;
  std::vector<const GemmKernelEntry*> candidates = usable(kernels_for(arch, dt, math, major_a(), major_b(), form));
  // The extended-K kernels that could fold LoRA's pair into the chosen kernel's K loop.
  std::vector<const GemmKernelEntry*> extk_twins;
  if (has_a2) {
    KernelForm twin_form;
    twin_form.aux = kernel_aux;
    twin_form.ext_k = true;
    extk_twins = kernels_for(arch, dt, math, major_a(), major_b(), twin_form);
  }
  // The transposed product D^T = B^T A^T reads B as its first operand and A as its second.
  std::vector<const GemmKernelEntry*> transposed;
  if (!with_c) {
    KernelForm transposed_form = form;
    transposed_form.transposed = true;
    transposed = kernels_for(arch, dt, math, major_b(), major_a(), transposed_form);
  }
  if (candidates.empty() && transposed.empty()) {
    // No kernel reads this layout (TF32 with an N-major B and no transposed kernel, or a
    // selective build): copy the MN-major operands to K-major, which every build has.
    if (major_a() != Major::kK) copy_a_k_major();
    if (major_b() != Major::kK) copy_b_k_major();
    candidates = usable(kernels_for(arch, dt, math, major_a(), major_b(), form));
  }
  if (candidates.empty() && with_c) {
    // No C-source kernel in this (selective) build: the product, then the sum.
    at::Tensor z = std::get<0>(gemm_op(a, b, c10::nullopt, 0, false, opts, GemmExtra{extra.alpha}));
    if (!batched) z = z.unsqueeze(0);
    z.add_(c3);
    if (bias.has_value()) z.add_(*bias);
    at::Tensor d = (out3.defined() && out3.is_contiguous()) ? out3 : new_output({L, M, N}, options);
    run_activation(z, d, activation, current_stream(a.device()));
    return deliver(d, z);
  }
  candidates.insert(candidates.end(), transposed.begin(), transposed.end());
  CE_CHECK(!candidates.empty(), op, ": no GEMM kernel was built for ", dtype_name(dt),
           math == MathMode::kExactF32 ? " (exact fp32)" : "", kernel_aux ? " with an aux output" : "",
           " on the sm", arch, " path; rebuild without a CUTLASS_EXT_KERNELS filter that excludes it",
           arch == 90 ? " (or for arch 90a)" : "");

  const bool split_activation = aux && !kernel_aux;
  if (with_c && bias_k.defined() && candidates.front()->arch == 80) {
    // CUTLASS 2.x kernels read either the bias or a C source: fold the bias into C.
    c3 = c3 + *bias;
    bias_k = at::Tensor();
  }
  if (with_c && !(Np == N && epilogue_readable(c3, align))) {
    at::Tensor padded = at::empty({L, M, Np}, options);
    padded.narrow(2, 0, N).copy_(c3);
    c3 = padded;
  }
  // The kernel writes straight into extra.out when it can (that is how in-place updates run).
  const bool direct_out = out3.defined() && !split_activation && Np == N && epilogue_readable(out3, align);
  at::Tensor d = direct_out ? out3 : new_output({L, M, Np}, options);
  at::Tensor z = aux ? new_output({L, M, Np}, options) : at::Tensor();

  const int device = a.device().index();
  GemmParams p;
  p.K = int(Kp);
  p.L = int(L);
  // Kernels without an aux epilogue write Z, and the activation runs afterwards.
  at::Tensor target = split_activation ? z : d;
  p.D = target.data_ptr();
  p.d_stride_m = M > 1 ? target.stride(1) : Np;
  p.d_stride_l = L > 1 ? target.stride(0) : M * Np;
  if (with_c) {
    p.C = c3.data_ptr();
    p.c_stride_m = M > 1 ? c3.stride(1) : Np;
    p.c_stride_l = L > 1 ? c3.stride(0) : M * Np;
    p.beta = 1.f;
  }
  p.bias = bias_k.defined() ? bias_k.data_ptr() : nullptr;
  p.aux = kernel_aux ? z.data_ptr() : nullptr;
  p.aux_stride_m = Np;
  p.aux_stride_l = M * Np;
  p.activation = split_activation ? int(Activation::kNone) : int(activation);
  p.alpha = extra.alpha;
  p.device = device;
  p.sm_count = sm_count(device);
  p.swizzle = opts.swizzle > 0 ? opts.swizzle : 1;
  p.raster = opts.raster;
  const cudaStream_t stream = current_stream(a.device());
  // The operands and split count for one kernel (a transposed kernel computes D^T = B^T A^T:
  // D, C and Aux keep their row-major storage and are read column-major).
  struct Operand {
    const at::Tensor& t;
    int64_t stride_mn, stride_k, stride_l;  // along the kernel's M (or N), K and batch
  };
  const Operand op_a{a3, va.stride_x, va.stride_y, va.stride_l};  // A [M, K]
  const Operand op_bt{b3, vb.stride_y, vb.stride_x, vb.stride_l};  // B^T [N, K]
  auto configure = [&](const GemmKernelEntry& e) {
    GemmParams q = p;
    const Operand& first = e.transposed ? op_bt : op_a;
    const Operand& second = e.transposed ? op_a : op_bt;
    q.M = int(e.transposed ? Np : M);
    q.N = int(e.transposed ? M : Np);
    q.A = first.t.data_ptr();
    q.a_stride_m = first.stride_mn;
    q.a_stride_k = first.stride_k;
    q.a_stride_l = first.stride_l;
    q.B = second.t.data_ptr();
    q.b_stride_n = second.stride_mn;
    q.b_stride_k = second.stride_k;
    q.b_stride_l = second.stride_l;
    if (e.stream_k) q.splits = split_k_factor(e, M, Np, Kp, L, q.sm_count, a.element_size());
    q.max_active_clusters = co_resident_clusters(e);
    // Kernels that wait for the prior grid at their start may follow any kernel, where that pays
    // (the extended-K twin below waits later and is a dependent only where the caller says).
    q.dependent_launch = dependent_launch_pays(e, M, Kp);
    return q;
  };
  auto launch = [&](const GemmKernelEntry& e, const GemmParams& q) {
    const size_t workspace_bytes = e.workspace_size(q);
    at::Tensor workspace;
    if (workspace_bytes > 0) workspace = at::empty({int64_t(workspace_bytes)}, options.dtype(at::kByte));
    check_launch(e.run(q, workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream), op, e.name);
  };

  // A product that would split K (few output tiles over a long K: a weight gradient over many
  // rows) runs as equal K slices into fp32 partial products, which a second kernel adds in a fixed
  // order (K_SLICES_CONFIG in cutlass_ext/_kernel_table.py); CUTLASS's split-K adds a tile's
  // splits one after another. Plain products only (no C, bias or activation), without an aux
  // output, batch or second operand pair. The K-slices kernel for the layout is looked up only by
  // the calls that could take it (not on every GEMM).
  auto slices_kernel = [&]() -> const GemmKernelEntry* {
    if (!plain || aux || L != 1 || has_a2 || !target.is_contiguous()) {
      return nullptr;
    }
    KernelForm sliced_form;
    sliced_form.k_slices = true;
    const std::vector<const GemmKernelEntry*> sliced = kernels_for(arch, dt, math, major_a(), major_b(), sliced_form);
    return sliced.empty() ? nullptr : sliced.front();
  };
  auto run_k_slices = [&](const GemmKernelEntry& e, int slices) {
    const int64_t depth = Kp / slices;
    GemmParams q = configure(e);
    q.K = int(depth);
    q.L = slices;
    q.a_stride_l = depth * op_a.stride_k;
    q.b_stride_l = depth * op_bt.stride_k;
    at::Tensor partials = at::empty({slices, M, Np}, options.dtype(at::kFloat));
    q.D = partials.data_ptr();
    q.d_stride_m = Np;
    q.d_stride_l = M * Np;
    launch(e, q);
    check_launch(sum_partials(partials.data_ptr<float>(), 1, slices, M * Np, dt, target.data_ptr(), stream), op,
                 "sum_partials");
  };
  // K slices run when forced by name, or in place of a split-K pick (below).
  const GemmKernelEntry* slicer = nullptr;
  int slices = 0;
  if (!opts.config.empty()) {
    const GemmKernelEntry* named = slices_kernel();
    if (named != nullptr && opts.config == named->config) {
      slicer = named;
      slices = k_slices(*slicer, M, Np, Kp, p.sm_count);
      CE_CHECK(slices >= 2, op, ": config '", opts.config, "' cuts K = ", Kp, " into equal slices of at least ",
               kMinSliceK, " (a multiple of ", kSliceAlignK, "), at most one tile per SM; this ", M, " x ", Np,
               " product has none: use another config");
    }
  }

  const GemmKernelEntry* kernel = nullptr;
  if (slicer == nullptr && opts.config.empty() && candidates.size() > 1 && tuning::active()) {
    // A tuned choice for this bucket, or (tuning on, not capturing a graph) a measurement now.
    const std::string layouts = std::string(major_a() == Major::kK ? "k" : "m") + (major_b() == Major::kK ? "k" : "n");
    const std::string key = tuning::make_key(device, dtype_name(dt), math == MathMode::kExactF32 ? "exact" : "tensorop",
                                             layouts.c_str(), with_c ? "source" : kernel_aux ? "aux" : "plain", M, Np,
                                             Kp, L > 1);
    const std::string tuned = tuning::lookup(key);
    for (const GemmKernelEntry* e : candidates) {
      if (tuned == e->config) kernel = e;
    }
    if (kernel == nullptr && tuning::enabled() && !stream_is_capturing(stream)) {
      // Each candidate runs into scratch outputs (D may be C itself). A burst (median of 5 runs)
      // ranks them; the finalists are then timed again, each after running alone for
      // tuning::sustain_ms(), and the heuristic's pick stays unless beaten there
      // (gemm_tuning_rule.h).
      at::Tensor scratch_d = at::empty_like(target);
      at::Tensor scratch_aux = kernel_aux ? at::empty_like(z) : at::Tensor();
      auto run = [&](const GemmKernelEntry& e) {
        GemmParams q = configure(e);
        q.D = scratch_d.data_ptr();
        if (kernel_aux) q.aux = scratch_aux.data_ptr();
        return [&e, q, &launch] { launch(e, q); };
      };
      const GemmKernelEntry* heuristic =
          select_kernel(candidates, M, Np, Kp, L, p.sm_count, has_a2 ? &extk_twins : nullptr);
      size_t heuristic_index = tuning::kNoHeuristic;
      std::vector<float> burst_ms;
      for (size_t i = 0; i < candidates.size(); ++i) {
        if (candidates[i] == heuristic) heuristic_index = i;
        burst_ms.push_back(time_median_ms(stream, 5, run(*candidates[i])));
      }
      size_t winner = tuning::quickest(burst_ms);
      if (const int sustain = tuning::sustain_ms(); sustain > 0) {
        const std::vector<size_t> finals = tuning::finalists(burst_ms, heuristic_index);
        std::vector<float> sustained_ms;
        for (size_t i : finals) {
          auto fn = run(*candidates[i]);
          run_alone_ms(stream, sustain, fn);
          sustained_ms.push_back(time_median_ms(stream, 5, fn));
        }
        winner = tuning::settle(finals, sustained_ms, heuristic_index);
      }
      kernel = candidates[winner];
      tuning::record(key, kernel->config);
    }
  }
  if (slicer == nullptr && kernel == nullptr) {
    kernel = opts.config.empty() ? select_kernel(candidates, M, Np, Kp, L, p.sm_count, has_a2 ? &extk_twins : nullptr)
                                 : forced_kernel(candidates, opts.config);
  }
  if (slicer == nullptr && opts.config.empty() && kernel->stream_k &&
      split_k_factor(*kernel, M, Np, Kp, L, p.sm_count, a.element_size()) > 1) {
    if (const GemmKernelEntry* sliced = slices_kernel()) {
      const int n = k_slices(*sliced, M, Np, Kp, p.sm_count);
      if (n >= 2) {
        slicer = sliced;
        slices = n;
      }
    }
  }
  if (slicer != nullptr) {
    run_k_slices(*slicer, slices);
  } else if (has_a2) {
    // The extended-K twin of the chosen kernel, when A2 and B2 are readable with A's and B's
    // majorness (N is unpadded here: see above); otherwise the second product runs first.
    const GemmKernelEntry* twin = nullptr;
    MatrixView va2, vb2;
    if (!kernel->transposed && !with_c && as_matrix(a2_3, align, va2) && as_matrix(b2_3, align, vb2) &&
        va2.y_contiguous == va.y_contiguous && vb2.y_contiguous == vb.y_contiguous) {
      for (const GemmKernelEntry* e : extk_twins) {
        if (std::strcmp(e->config, kernel->config) == 0) twin = e;
      }
    }
    if (twin == nullptr) return without_a2();
    GemmParams q = configure(*twin);
    q.K2 = int(a2_3.size(2));
    q.A2 = a2_3.data_ptr();
    q.a2_stride_m = va2.stride_x;
    q.a2_stride_k = va2.stride_y;
    q.a2_stride_l = va2.stride_l;
    q.B2 = b2_3.data_ptr();
    q.b2_stride_n = vb2.stride_y;
    q.b2_stride_k = vb2.stride_x;
    q.b2_stride_l = vb2.stride_l;
    q.dependent_launch = extra.dependent;
    launch(*twin, q);
  } else {
    launch(*kernel, configure(*kernel));
  }
  if (split_activation) run_activation(z, d, activation, stream);

  if (Np != N) {
    d = d.narrow(2, 0, N).contiguous();
    if (aux) z = z.narrow(2, 0, N).contiguous();
  }
  return deliver(d, z);
}

// ---------------------------------------------------------------------------------------------
// act_grad: (dZ, dbias) from dY and the saved tensor, in one pass. grad/saved are [rows, cols].

std::tuple<at::Tensor, at::Tensor> act_grad_cuda(const at::Tensor& grad, const c10::optional<at::Tensor>& saved,
                                              c10::string_view activation_name, bool need_input_grad,
                                              bool need_bias_grad) {
  const char* op = "_act_grad";
  const int64_t activation = activation_code(activation_name, op);
  CE_CHECK(grad.is_cuda() && grad.dim() == 2, op, ": grad must be a 2-D CUDA tensor");
  const DType dt = dtype_of(grad, op, "grad");
  const c10::DeviceGuard guard(grad.device());
  const int64_t rows = grad.size(0), cols = grad.size(1);
  const bool uses_saved = activation != int64_t(Activation::kNone);
  auto row_major = [](const at::Tensor& t) { return t.stride(1) == 1 || t.size(1) <= 1 ? t : t.contiguous(); };
  at::Tensor g = row_major(grad);
  at::Tensor s;
  if (uses_saved) {
    CE_CHECK(saved.has_value() && saved->sizes() == grad.sizes() && saved->scalar_type() == grad.scalar_type() &&
                 saved->device() == grad.device(),
             op, ": saved must match grad's shape, dtype and device");
    s = row_major(*saved);
  }
  const bool write_input = need_input_grad && uses_saved;
  at::Tensor dz = write_input ? new_output({rows, cols}, grad.options()) : at::empty({0}, grad.options());
  at::Tensor db = need_bias_grad ? new_output({cols}, grad.options()) : at::empty({0}, grad.options());
  if (!write_input && !need_bias_grad) return {dz, db};
  if (rows == 0) {
    if (need_bias_grad) db.zero_();
    return {dz, db};
  }

  const int device = grad.device().index();
  ActGradParams p;
  p.rows = rows;
  p.cols = cols;
  p.dtype = dt;
  p.activation = int(activation);
  p.grad = g.data_ptr();
  p.grad_ld = cols <= 1 ? 1 : g.stride(0);
  if (uses_saved) {
    p.saved = s.data_ptr();
    p.saved_ld = cols <= 1 ? 1 : s.stride(0);
  }
  if (write_input) {
    p.grad_input = dz.data_ptr();
    p.grad_input_ld = cols;
  }
  at::Tensor partials;
  p.row_splits = act_grad_row_splits(rows, cols, dt, p.activation, sm_count(device), device);
  if (need_bias_grad) {
    p.grad_bias = db.data_ptr();
    if (p.row_splits > 1) {
      partials = at::empty({p.row_splits, cols}, grad.options().dtype(at::kFloat));
      p.partials = partials.data_ptr<float>();
    }
  }
  check_launch(cutlass_ext::act_grad(p, current_stream(grad.device())), op, "act_grad");
  return {dz, db};
}

namespace {

// ---------------------------------------------------------------------------------------------
// The CUDA kernels of the torch.ops.cutlass_ext ops (schemas: cutlass_ext/ops/linear.py).

int64_t prod(at::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// The options of one forward call: torch's precision flag, then the op's config argument (which
// takes precedence over CUTLASS_EXT_GEMM_CONFIG).
GemmOptions call_options(const c10::optional<c10::string_view>& config) {
  GemmOptions opts = gemm_options();
  if (config.has_value()) opts.config = std::string(*config);
  return opts;
}

std::tuple<at::Tensor, at::Tensor> linear_cuda(const at::Tensor& a, const at::Tensor& b,
                                               const c10::optional<at::Tensor>& bias,
                                               c10::string_view activation_name, bool save_preact,
                                               c10::optional<c10::string_view> config) {
  const int64_t activation = activation_code(activation_name, "linear");
  CE_CHECK(a.dim() >= 1 && b.dim() == 2, "linear: A must be [..., K] and B [K, N]");
  if (a.dim() == 2) {
    // The common case takes no reshape and no view (each a dispatched op, ~1 us of host time).
    auto [y, z] = gemm_op(a, b, bias, activation, save_preact, call_options(config));
    return {y, or_empty(z, a.options())};
  }
  const at::IntArrayRef lead = a.sizes().slice(0, a.dim() - 1);
  const int64_t K = b.size(0), N = b.size(1);
  auto [y, z] = gemm_op(a.reshape({prod(lead), K}), b, bias, activation, save_preact, call_options(config));
  y = y.view(with_last(lead, {N}));
  z = z.defined() ? z.view(with_last(lead, {N})) : at::empty({0}, a.options());
  return {y, z};
}

// The backward of a layer with few output columns as one pass over A (few_column_backward_kernels.h):
// grad2 [rows, N], a2 [rows, K], b [K, N]; dB comes back in B's layout, dA as [rows, K].
std::tuple<at::Tensor, at::Tensor, at::Tensor> few_column_linear_backward(
    const at::Tensor& grad2, const at::Tensor& a2, const at::Tensor& b, const c10::optional<at::Tensor>& saved2,
    int64_t activation, bool need_grad_a, bool need_grad_b, bool need_grad_bias, bool grad_b_transposed) {
  const char* op = "_linear_backward";
  const int64_t rows = grad2.size(0), K = b.size(0), N = b.size(1);
  const DType dt = dtype_of(grad2, op, "grad");
  CE_CHECK(a2.scalar_type() == grad2.scalar_type() && b.scalar_type() == grad2.scalar_type(), op,
           ": grad, A and B must have one dtype");
  CE_CHECK(a2.device() == grad2.device() && b.device() == grad2.device(), op,
           ": grad, A and B must be on one device");
  CE_CHECK(a2.size(0) == rows, op, ": A has ", a2.size(0), " rows where grad has ", rows);
  const c10::DeviceGuard guard(grad2.device());
  const at::TensorOptions options = grad2.options();
  FewColumnBackwardParams p;
  p.rows = rows;
  p.k = K;
  p.n = int(N);
  p.dtype = dt;
  p.activation = int(activation);
  p.grad = grad2.data_ptr();
  p.grad_stride_r = grad2.stride(0);
  p.grad_stride_n = grad2.stride(1);
  if (activation != int64_t(Activation::kNone)) {
    CE_CHECK(saved2.has_value() && saved2->sizes() == grad2.sizes() && saved2->scalar_type() == grad2.scalar_type() &&
                 saved2->device() == grad2.device(),
             op, ": saved must match grad's shape, dtype and device");
    p.saved = saved2->data_ptr();
    p.saved_stride_r = saved2->stride(0);
    p.saved_stride_n = saved2->stride(1);
  }
  at::Tensor grad_a, grad_b, grad_bias;
  if (need_grad_a) {
    grad_a = new_output({rows, K}, options);
    p.grad_x = grad_a.data_ptr();
    p.w = b.data_ptr();
    p.w_stride_n = b.stride(1);
    p.w_stride_k = b.stride(0);
  }
  if (need_grad_b) {
    grad_b = grad_b_transposed ? new_output({N, K}, options).t() : new_output({K, N}, options);
    p.grad_w = grad_b.data_ptr();
    p.grad_w_stride_n = grad_b.stride(1);
    p.grad_w_stride_k = grad_b.stride(0);
    p.x = a2.data_ptr();
    p.x_stride_r = a2.stride(0);
    p.x_stride_k = a2.stride(1);
  }
  if (need_grad_bias) {
    grad_bias = new_output({N}, options);
    p.grad_bias = grad_bias.data_ptr();
  }
  plan_few_column_backward(p, sm_count(grad2.device().index()));
  at::Tensor partials;
  if (p.splits > 1 && (need_grad_b || need_grad_bias)) {
    partials = at::empty({int64_t(p.splits), N * K + N}, options.dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  check_launch(few_column_backward(p, current_stream(grad2.device())), op, "few_column_backward");
  return {grad_a, grad_b, grad_bias};
}

// The whole backward of linear in one call: the fused act'/bias-gradient pass, then dA = dZ B^T
// and dB = A^T dZ, each only when needed (empty tensors otherwise). A layer with few output
// columns takes one fused pass for all of them instead (unless a GEMM config is forced).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& saved,
    c10::string_view activation_name, bool need_grad_a, bool need_grad_b, bool need_grad_bias,
    bool grad_b_transposed) {
  const int64_t activation = activation_code(activation_name, "_linear_backward");
  const int64_t K = b.size(0), N = b.size(1);
  const at::Tensor grad2 = grad.reshape({-1, N});
  const GemmOptions opts = gemm_options();
  if (few_column_backward_serves(grad2.size(0), K, N) && K >= 1 && grad2.size(0) >= 1 &&
      (need_grad_a || need_grad_b) && opts.config.empty()) {
    c10::optional<at::Tensor> saved2;
    if (saved.has_value()) saved2 = saved->reshape({-1, N});
    auto [grad_a, grad_b, grad_bias] =
        few_column_linear_backward(grad2, a.reshape({-1, K}), b, saved2, activation, need_grad_a, need_grad_b,
                                   need_grad_bias, grad_b_transposed);
    if (grad_a.defined()) grad_a = grad_a.view(a.sizes());
    return {or_empty(grad_a, grad.options()), or_empty(grad_b, grad.options()), or_empty(grad_bias, grad.options())};
  }
  at::Tensor grad_z = grad2;
  at::Tensor grad_bias;
  if (activation != int64_t(Activation::kNone) || need_grad_bias) {
    c10::optional<at::Tensor> saved2;
    if (saved.has_value()) saved2 = saved->reshape({-1, N});
    auto [dz, db] = act_grad_cuda(grad2, saved2, activation_name, need_grad_a || need_grad_b, need_grad_bias);
    if (activation != int64_t(Activation::kNone)) grad_z = dz;
    grad_bias = db;
  }
  auto mm = [&](const at::Tensor& x, const at::Tensor& y) {
    return std::get<0>(gemm_op(x, y, c10::nullopt, 0, false, opts));
  };
  at::Tensor grad_a, grad_b;
  if (need_grad_a) grad_a = mm(grad_z, b.t()).view(a.sizes());
  if (need_grad_b) {
    const at::Tensor a2 = a.reshape({-1, K});
    grad_b = grad_b_transposed ? mm(grad_z.t(), a2).t() : mm(a2.t(), grad_z);
  }
  return {or_empty(grad_a, grad.options()), or_empty(grad_b, grad.options()), or_empty(grad_bias, grad.options())};
}

at::Tensor matmul_cuda(const at::Tensor& a, const at::Tensor& b, c10::optional<c10::string_view> config) {
  const GemmOptions opts = call_options(config);
  CE_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: A and B must have at least 2 dimensions");
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (b.dim() == 2) {  // [..., M, K] @ [K, N]: fold the batch into M
    const at::IntArrayRef lead = a.sizes().slice(0, a.dim() - 1);
    auto result = gemm_op(a.reshape({prod(lead), K}), b, c10::nullopt, 0, false, opts);
    return std::get<0>(result).view(with_last(lead, {N}));
  }
  const std::vector<int64_t> batch =
      at::infer_size(a.sizes().slice(0, a.dim() - 2), b.sizes().slice(0, b.dim() - 2));
  const int64_t count = prod(batch);
  at::Tensor a3 = a.expand(with_last(batch, {M, K})).reshape({count, M, K});
  at::Tensor b3 = b.expand(with_last(batch, {K, N})).reshape({count, K, N});
  auto result = gemm_op(a3, b3, c10::nullopt, 0, false, opts);
  return std::get<0>(result).view(with_last(batch, {M, N}));
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, CUDA, m) {
  m.impl("linear", &cutlass_ext::linear_cuda);
  m.impl("matmul", &cutlass_ext::matmul_cuda);
  m.impl("_act_grad", &cutlass_ext::act_grad_cuda);
  m.impl("_linear_backward", &cutlass_ext::linear_backward_cuda);
}
