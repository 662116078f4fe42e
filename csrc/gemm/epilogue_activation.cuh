// A CUTLASS activation functor whose kind is chosen at run time.
//
// Both CUTLASS 3.x EVT compute nodes (Sm90Compute) and CUTLASS 2.x LinearCombinationGeneric
// pass a functor's nested `Arguments` to its call operator, so one kernel instantiation serves
// every activation: the kind is a kernel parameter, uniform across the grid, and the branch
// sits outside the per-element loop.
//
// CUTLASS instantiates the functor with its compute type (fp32); `Out`, the type the epilogue
// stores, picks the activation's form (common/activation_16bit.h: GELU, SiLU and sigmoid take
// cheaper forms for 16-bit results). ActivationStoring<Out> gives the one-parameter templates
// that CUTLASS's fusion operations take.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "common/activation.h"
#include "common/activation_16bit.h"

namespace cutlass_ext {

template <class T, class Out>
struct RuntimeActivation {
  struct Arguments {
    int kind = 0;  // cutlass_ext::Activation
  };

  CUTLASS_HOST_DEVICE T operator()(T const& x, Arguments const& args) const {
    return T(act::forward_for<Out>(args.kind, float(x)));
  }
};

template <class T, int N, class Out>
struct RuntimeActivation<cutlass::Array<T, N>, Out> {
  using Arguments = typename RuntimeActivation<T, Out>::Arguments;

  template <int Kind>
  CUTLASS_HOST_DEVICE static cutlass::Array<T, N> apply(cutlass::Array<T, N> const& v) {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(act::forward_for<Out>(Kind, float(v[i])));
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

// The same contract, laid out for epilogues that run once per output subtile: none and ReLU (the
// kinds of most forward products) inline as one select against a floor, each smooth activation in
// an out-of-line function of its own (the branch to it is on the kernel parameter, uniform).
// CUTLASS unrolls the epilogue's subtile loop, and with every kind's code inline in each copy the
// ping-pong 128x128 kernel held ~15K instructions against ~2K with ReLU fixed at compile time; at a
// short K its epilogue warps then stalled on instruction fetch (bench/NOTES.md sections 19, 23).
// Laid out this way it holds 6.1K with the four functions; on an H200 at 4096 x 4096 x 128 bias+ReLU
// took 24.8 us where the all-inline form took 29.6, bias+GELU 46.5 where it took 77.7 (section 24).
// One shared function taking the kind as an argument made GELU twice as slow instead.
template <int Kind, class Out, class T, int N>
__noinline__ __device__ cutlass::Array<T, N> smooth_activation(cutlass::Array<T, N> v) {
  cutlass::Array<T, N> out;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) out[i] = T(act::forward_for<Out>(Kind, float(v[i])));
  return out;
}

template <class T, class Out>
struct CompactRuntimeActivation : RuntimeActivation<T, Out> {};

template <class T, int N, class Out>
struct CompactRuntimeActivation<cutlass::Array<T, N>, Out> {
  using Arguments = typename RuntimeActivation<T, Out>::Arguments;

  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v, Arguments const& args) const {
    switch (args.kind) {
      case int(Activation::kGelu): return smooth_activation<int(Activation::kGelu), Out>(v);
      case int(Activation::kGeluTanh): return smooth_activation<int(Activation::kGeluTanh), Out>(v);
      case int(Activation::kSilu): return smooth_activation<int(Activation::kSilu), Out>(v);
      case int(Activation::kSigmoid): return smooth_activation<int(Activation::kSigmoid), Out>(v);
      default: break;
    }
    // x < floor is false for NaN, which ReLU keeps (as torch.relu does); nothing is below -inf.
    const T floor = args.kind == int(Activation::kRelu) ? T(0.f) : T(-INFINITY);
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = v[i] < floor ? floor : v[i];
    return out;
  }
};

// The functors of an epilogue that stores Out, as one-parameter templates.
template <class Out>
struct ActivationStoring {
  template <class T>
  using Runtime = RuntimeActivation<T, Out>;
  template <class T>
  using Compact = CompactRuntimeActivation<T, Out>;
};

}  // namespace cutlass_ext
