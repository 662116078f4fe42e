// A CUTLASS activation functor whose kind is chosen at run time.
//
// Both CUTLASS 3.x EVT compute nodes (Sm90Compute) and CUTLASS 2.x LinearCombinationGeneric
// pass a functor's nested `Arguments` to its call operator, so one kernel instantiation serves
// every activation: the kind is a kernel parameter, uniform across the grid, and the branch
// sits outside the per-element loop.
//
// Every unrolled step of the epilogue holds the code of all five activations, and a GEMM with one
// or two tiles per CTA waits for its epilogue: in full libm form (tanhf, expf, an IEEE division
// with its slow-path call) the ping-pong 128x128 kernel held ~15K instructions against ~2K with a
// compile-time ReLU. In device code gelu_tanh, silu and sigmoid therefore use a fast exponential
// and an approximate division (relative error ~1e-6, far below the rounding of a bf16, fp16 or
// TF32 GEMM output); gelu keeps erff. Measured on an H200 (bench/NOTES.md section 19): the
// cooperative 128x128 kernel with bias+GELU, 512x4096x4096 39.7 -> 35.9 us, 1024x4096x4096
// 62.5 -> 57.5; ReLU and larger products unchanged.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "common/activation.h"

namespace cutlass_ext {

// act::forward of kind Kind, with the smooth activations in the compact device forms above.
template <int Kind>
CUTLASS_HOST_DEVICE float epilogue_forward(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (Kind == int(Activation::kGeluTanh)) {
    // 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u))
    const float u = act::kTanhBeta * x * (1.f + act::kTanhKappa * x * x);
    return __fdividef(x, 1.f + __expf(-2.f * u));
  } else if constexpr (Kind == int(Activation::kSilu)) {
    return __fdividef(x, 1.f + __expf(-x));
  } else if constexpr (Kind == int(Activation::kSigmoid)) {
    return __fdividef(1.f, 1.f + __expf(-x));
  } else {
    return act::forward(Kind, x);
  }
#else
  return act::forward(Kind, x);
#endif
}

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
  CUTLASS_HOST_DEVICE static cutlass::Array<T, N> apply(cutlass::Array<T, N> const& v) {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(epilogue_forward<Kind>(float(v[i])));
    return out;
  }

  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v,
                                                      Arguments const& args) const {
    switch (args.kind) {
      case int(Activation::kRelu): return apply<int(Activation::kRelu)>(v);
      case int(Activation::kGelu): return apply<int(Activation::kGelu)>(v);
      case int(Activation::kGeluTanh): return apply<int(Activation::kGeluTanh)>(v);
      case int(Activation::kSilu): return apply<int(Activation::kSilu)>(v);
      case int(Activation::kSigmoid): return apply<int(Activation::kSigmoid)>(v);
      default: return v;
    }
  }
};

}  // namespace cutlass_ext
