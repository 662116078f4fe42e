// A CUTLASS activation functor whose kind is chosen at run time.
//
// Both CUTLASS 3.x EVT compute nodes (Sm90Compute) and CUTLASS 2.x LinearCombinationGeneric
// pass a functor's nested `Arguments` to its call operator, so one kernel instantiation serves
// every activation: the kind is a kernel parameter, uniform across the grid.
//
// The functor's code sits in every unrolled step of the epilogue, where a GEMM with one tile per
// CTA waits for it: with the four smooth activations in full libm form (tanhf, expf, IEEE
// division) behind a per-fragment switch, the 128x128 ping-pong kernel held ~15K instructions
// against ~2K with a compile-time ReLU, and ran 512x4096x4096 with bias+ReLU 1.19x and with
// bias+GELU 1.39x slower than compile-time twins (H200, bench/NOTES.md section 19). So:
// none and relu are one compare-and-select against a floor (-inf or 0) with no branch, which
// schedules with the rest of the epilogue; the smooth activations sit behind one uniform branch
// and, in device code, use a fast exponential and an approximate division (relative error ~1e-6,
// far below the rounding of a bf16, fp16 or TF32 GEMM's output).
#pragma once

#include <cmath>

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "common/activation.h"

namespace cutlass_ext {

namespace epilogue_act {

// relu for floor 0, the identity for floor -inf; NaN stays NaN (NaN < floor is false).
CUTLASS_HOST_DEVICE float floor_at(float x, float floor) { return x < floor ? floor : x; }

CUTLASS_HOST_DEVICE float floor_of(int kind) { return kind == int(Activation::kRelu) ? 0.f : -INFINITY; }

CUTLASS_HOST_DEVICE bool is_smooth(int kind) { return act::needs_preactivation(kind); }

// gelu, gelu_tanh, silu or sigmoid of x. gelu_tanh uses 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)).
template <int Kind>
CUTLASS_HOST_DEVICE float smooth(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (Kind == int(Activation::kGelu)) {
    return act::gelu(x);
  } else if constexpr (Kind == int(Activation::kGeluTanh)) {
    const float u = act::kTanhBeta * x * (1.f + act::kTanhKappa * x * x);
    return __fdividef(x, 1.f + __expf(-2.f * u));
  } else if constexpr (Kind == int(Activation::kSilu)) {
    return __fdividef(x, 1.f + __expf(-x));
  } else {
    return __fdividef(1.f, 1.f + __expf(-x));
  }
#else
  return act::forward(Kind, x);
#endif
}

}  // namespace epilogue_act

template <class T>
struct RuntimeActivation {
  struct Arguments {
    int kind = 0;  // cutlass_ext::Activation
  };

  CUTLASS_HOST_DEVICE T operator()(T const& x, Arguments const& args) const {
    return T(act::forward(args.kind, float(x)));
  }
};

template <class T, int N>
struct RuntimeActivation<cutlass::Array<T, N>> {
  using Arguments = typename RuntimeActivation<T>::Arguments;

  template <int Kind>
  CUTLASS_HOST_DEVICE static cutlass::Array<T, N> apply_smooth(cutlass::Array<T, N> const& v) {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(epilogue_act::smooth<Kind>(float(v[i])));
    return out;
  }

  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v,
                                                      Arguments const& args) const {
    if (epilogue_act::is_smooth(args.kind)) {
      switch (args.kind) {
        case int(Activation::kGelu): return apply_smooth<int(Activation::kGelu)>(v);
        case int(Activation::kGeluTanh): return apply_smooth<int(Activation::kGeluTanh)>(v);
        case int(Activation::kSilu): return apply_smooth<int(Activation::kSilu)>(v);
        default: return apply_smooth<int(Activation::kSigmoid)>(v);
      }
    }
    const float floor = epilogue_act::floor_of(args.kind);
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(epilogue_act::floor_at(float(v[i]), floor));
    return out;
  }
};

}  // namespace cutlass_ext
