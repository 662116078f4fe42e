// A CUTLASS activation functor whose kind is chosen at run time.
//
// Both CUTLASS 3.x EVT compute nodes (Sm90Compute) and CUTLASS 2.x LinearCombinationGeneric
// pass a functor's nested `Arguments` to its call operator, so one kernel instantiation serves
// every activation: the kind is a kernel parameter, uniform across the grid, and the branch
// sits outside the per-element loop.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "common/activation.h"

namespace cutlass_ext {

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
    for (int i = 0; i < N; ++i) out[i] = T(act::forward(Kind, float(v[i])));
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
