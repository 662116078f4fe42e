// Autograd of linear, lora_linear, softmax, layer_norm, bias_act, sum and add for CUDA tensors, in C++. The
// Python autograd of these ops (register_autograd in cutlass_ext/ops/) costs ~40 us of host time
// per call, and its backward takes the GIL on autograd's device thread, which cost more than the
// kernels on small layers; these nodes do the same work without the interpreter. Each mirrors
// the setup_context/backward pair of its Python twin, which still serves CPU tensors and the
// CUDA calls made before this library is loaded; both call the same ops through the dispatcher.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bindings/common.h"
#include "common/activation.h"

namespace cutlass_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The typed dispatcher handle of an op.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

OptTensor optional_of(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

bool defined(const OptTensor& t) { return t.has_value() && t->defined(); }

// Whether the gradient of a forward input is needed. `present` lists, in forward order, whether
// each tensor input up to and including this one was given: an absent optional tensor has no
// autograd edge, so the edges of the inputs after it shift down by one.
bool needs_grad(AutogradContext* ctx, std::initializer_list<bool> present) {
  if (!*(present.end() - 1)) return false;
  size_t edge = 0;
  for (auto it = present.begin(); it + 1 != present.end(); ++it) edge += *it ? 1 : 0;
  return ctx->needs_input_grad(edge);
}

// ---------------------------------------------------------------------------------------------
// linear: the pre-activation output has no gradient; dB comes back in B's layout.

class LinearAutograd : public torch::autograd::Function<LinearAutograd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, const OptTensor& bias,
                               const std::string& activation, bool save_preact,
                               const c10::optional<std::string>& config) {
    static const auto op =
        op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                     c10::string_view, bool, c10::optional<c10::string_view>)>(
            "cutlass_ext::linear");
    at::Tensor y, z;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      c10::optional<c10::string_view> config_view;
      if (config.has_value()) config_view = c10::string_view(*config);
      std::tie(y, z) = op.call(a, b, bias, activation, save_preact, config_view);
    }
    ctx->mark_non_differentiable({z});
    ctx->set_materialize_grads(false);
    const at::Tensor saved = activation_saved_tensor(int(activation_code(activation, "linear")), y, z, save_preact);
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["has_bias"] = defined(bias);
    // dB comes back in B's layout: transposed when B is the transpose of a row-major [N, K] weight.
    ctx->saved_data["b_is_weight_t"] = b.sym_stride(0) == 1 && b.sym_stride(1) != 1;
    ctx->save_for_backward({a, b, saved});
    return {y, z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const OptTensor&, c10::string_view, bool, bool, bool, bool)>(
        "cutlass_ext::_linear_backward");
    variable_list out(6);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    check_activation_saved(int(activation_code(activation, "linear")), saved[2], activation, "linear");
    const bool need_a = ctx->needs_input_grad(0), need_b = ctx->needs_input_grad(1);
    const bool need_bias = needs_grad(ctx, {true, true, ctx->saved_data["has_bias"].toBool()});
    auto [grad_a, grad_b, grad_bias] = op.call(grads[0], saved[0], saved[1], optional_of(saved[2]), activation, need_a,
                                               need_b, need_bias, ctx->saved_data["b_is_weight_t"].toBool());
    if (need_a) out[0] = grad_a;
    if (need_b) out[1] = grad_b;
    if (need_bias) out[2] = grad_bias;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> linear_autograd(const at::Tensor& a, const at::Tensor& b, const OptTensor& bias,
                                                   c10::string_view activation, bool save_preact,
                                                   c10::optional<c10::string_view> config) {
  c10::optional<std::string> config_str;
  if (config.has_value()) config_str = std::string(*config);
  auto out = LinearAutograd::apply(a, b, bias, std::string(activation), save_preact, config_str);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------------------------------------
// softmax: the backward reads only the output.

class SoftmaxAutograd : public torch::autograd::Function<SoftmaxAutograd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, double scale) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, int64_t, double)>("cutlass_ext::softmax");
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      y = op.call(x, dim, scale);
    }
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({y});
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>(
        "cutlass_ext::_softmax_backward");
    const at::Tensor y = ctx->get_saved_variables()[0];
    return {op.call(grads[0], y, ctx->saved_data["dim"].toInt(), ctx->saved_data["scale"].toDouble()), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor softmax_autograd(const at::Tensor& x, int64_t dim, double scale) {
  return SoftmaxAutograd::apply(x, dim, scale)[0];
}

// ---------------------------------------------------------------------------------------------
// layer_norm: mean and rstd are outputs without a gradient.

class LayerNormAutograd : public torch::autograd::Function<LayerNormAutograd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               const OptTensor& bias, double eps, bool relu, double dropout_p, const OptTensor& seed) {
    static const auto op = op_handle<Tensor3(const at::Tensor&, const OptTensor&, const OptTensor&, double, bool,
                                             double, const OptTensor&)>("cutlass_ext::layer_norm");
    at::Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(y, mean, rstd) = op.call(x, weight, bias, eps, relu, dropout_p, seed);
    }
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    ctx->saved_data["relu"] = relu;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["has_bias"] = defined(bias);  // the weight is saved; the bias is not
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), mean, rstd, seed.value_or(at::Tensor())});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&,
                          const at::Tensor&, bool, double, const OptTensor&, bool, bool, bool)>(
            "cutlass_ext::_layer_norm_backward");
    variable_list out(7);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const bool has_weight = saved[1].defined(), has_bias = ctx->saved_data["has_bias"].toBool();
    const bool need_x = needs_grad(ctx, {true});
    const bool need_weight = needs_grad(ctx, {true, has_weight});
    const bool need_bias = needs_grad(ctx, {true, has_weight, has_bias});
    auto [dx, dweight, dbias] = op.call(grads[0], saved[0], optional_of(saved[1]), saved[2], saved[3],
                                        ctx->saved_data["relu"].toBool(), ctx->saved_data["dropout_p"].toDouble(),
                                        optional_of(saved[4]), need_x, need_weight, need_bias);
    if (need_x) out[0] = dx;
    if (need_weight) out[1] = dweight;
    if (need_bias) out[2] = dbias;
    return out;
  }
};

Tensor3 layer_norm_autograd(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps, bool relu,
                            double dropout_p, const OptTensor& seed) {
  auto out = LayerNormAutograd::apply(x, weight, bias, eps, relu, dropout_p, seed);
  return {out[0], out[1], out[2]};
}

// ---------------------------------------------------------------------------------------------
// bias_act: act(scale * x + bias + residual).

class BiasActAutograd : public torch::autograd::Function<BiasActAutograd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& bias,
                               const std::string& activation, double scale, const OptTensor& residual) {
    static const auto op =
        op_handle<at::Tensor(const at::Tensor&, const OptTensor&, c10::string_view, double, const OptTensor&)>(
            "cutlass_ext::bias_act");
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      y = op.call(x, bias, activation, scale, residual);
    }
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({x, bias.value_or(at::Tensor()), residual.value_or(at::Tensor())});
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, c10::string_view,
                          double, bool, bool, bool)>("cutlass_ext::_bias_act_backward");
    variable_list out(5);
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = saved[1].defined(), has_residual = saved[2].defined();
    const bool need_x = needs_grad(ctx, {true});
    const bool need_bias = needs_grad(ctx, {true, has_bias});
    const bool need_residual = needs_grad(ctx, {true, has_bias, has_residual});
    if (!grads[0].defined() || !(need_x || need_bias || need_residual)) return out;
    auto [dx, dbias, dresidual] =
        op.call(grads[0], saved[0], optional_of(saved[1]), optional_of(saved[2]),
                ctx->saved_data["activation"].toStringRef(), ctx->saved_data["scale"].toDouble(), need_x, need_bias,
                need_residual);
    if (need_x) out[0] = dx;
    if (need_bias) out[1] = dbias;
    if (need_residual) out[4] = dresidual;
    return out;
  }
};

at::Tensor bias_act_autograd(const at::Tensor& x, const OptTensor& bias, c10::string_view activation, double scale,
                             const OptTensor& residual) {
  return BiasActAutograd::apply(x, bias, std::string(activation), scale, residual)[0];
}

// ---------------------------------------------------------------------------------------------
// sum and add save no tensors, so their backward nodes are plain autograd nodes rather than
// torch::autograd::Function: its context and output bookkeeping cost ~8 us of host time per
// forward and ~12 per backward on an H200 machine's host, more than a small sum's kernels.

// The node handle type of this torch (a shared or an intrusive pointer, by version).
using NodePtr = decltype(torch::autograd::Edge().function);

template <class N>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>();
  } else {
    return c10::make_intrusive<N>();
  }
}

// sum: the gradient is grad broadcast back over the reduced dimensions (a view, no kernel).
struct SumBackward final : torch::autograd::Node {
  std::vector<int64_t> shape, dims;  // dims wrapped and ascending
  bool keepdim = false;

  variable_list apply(variable_list&& grads) override {
    at::Tensor g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    if (!keepdim) {
      for (int64_t d : dims) g = g.unsqueeze(d);  // ascending, so each lands at its original position
    }
    return {g.expand(shape)};
  }
  std::string name() const override { return "cutlass_ext::SumBackward"; }
};

at::Tensor sum_autograd(const at::Tensor& x, at::IntArrayRef dim, bool keepdim) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, at::IntArrayRef, bool)>("cutlass_ext::sum");
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = op.call(x, dim, keepdim);  // checks the dims
  }
  if (torch::autograd::compute_requires_grad(x)) {
    NodePtr node = make_node<SumBackward>();
    auto& sum_node = static_cast<SumBackward&>(*node);
    sum_node.set_next_edges(torch::autograd::collect_next_edges(x));
    sum_node.shape = x.sizes().vec();
    for (int64_t d : dim) sum_node.dims.push_back(d < 0 ? d + x.dim() : d);
    std::sort(sum_node.dims.begin(), sum_node.dims.end());
    sum_node.keepdim = keepdim;
    torch::autograd::set_history(y, node);
  }
  return y;
}

// add: both gradients are grad itself.
struct AddBackward final : torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    return {should_compute_output(0) ? grads[0] : at::Tensor(), should_compute_output(1) ? grads[0] : at::Tensor()};
  }
  std::string name() const override { return "cutlass_ext::AddBackward"; }
};

at::Tensor add_autograd(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("cutlass_ext::add");
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = op.call(a, b);
  }
  if (torch::autograd::compute_requires_grad(a, b)) {
    NodePtr node = make_node<AddBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(a, b));
    torch::autograd::set_history(y, node);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// lora_linear: t (the low-rank activations) and the pre-activation are outputs without a gradient.

class LoraLinearAutograd : public torch::autograd::Function<LoraLinearAutograd> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& lora_A, const at::Tensor& lora_B, const OptTensor& bias,
                               double scaling, const std::string& activation, double dropout_p, const OptTensor& seed,
                               bool save_preact) {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const OptTensor&, double, c10::string_view, double, const OptTensor&, bool)>(
            "cutlass_ext::lora_linear");
    at::Tensor y, t, preact;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(y, t, preact) = op.call(x, weight, lora_A, lora_B, bias, scaling, activation, dropout_p, seed,
                                       save_preact);
    }
    ctx->mark_non_differentiable({t, preact});
    ctx->set_materialize_grads(false);
    const at::Tensor saved =
        activation_saved_tensor(int(activation_code(activation, "lora_linear")), y, preact, save_preact);
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["has_bias"] = defined(bias);
    ctx->save_for_backward({x, weight, lora_A, lora_B, t, saved, seed.value_or(at::Tensor())});
    return {y, t, preact};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
    static const auto op =
        op_handle<Tensor5(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view, double, double,
                          const OptTensor&, bool, bool, bool, bool, bool)>("cutlass_ext::_lora_linear_backward");
    variable_list out(10);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    check_activation_saved(int(activation_code(activation, "lora_linear")), saved[5], activation, "lora_linear");
    // x, weight, lora_A and lora_B are edges 0-3; the bias, when given, edge 4.
    bool needs[5];
    for (int i = 0; i < 4; ++i) needs[i] = ctx->needs_input_grad(i);
    needs[4] = needs_grad(ctx, {true, true, true, true, ctx->saved_data["has_bias"].toBool()});
    auto grads5 = op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], optional_of(saved[5]),
                          activation, ctx->saved_data["scaling"].toDouble(), ctx->saved_data["dropout_p"].toDouble(),
                          optional_of(saved[6]), needs[0], needs[1], needs[2], needs[3], needs[4]);
    const at::Tensor results[5] = {std::get<0>(grads5), std::get<1>(grads5), std::get<2>(grads5),
                                   std::get<3>(grads5), std::get<4>(grads5)};
    for (int i = 0; i < 5; ++i) {
      if (needs[i]) out[i] = results[i];
    }
    return out;
  }
};

Tensor3 lora_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
                             const at::Tensor& lora_B, const OptTensor& bias, double scaling,
                             c10::string_view activation, double dropout_p, const OptTensor& seed, bool save_preact) {
  auto out = LoraLinearAutograd::apply(x, weight, lora_A, lora_B, bias, scaling, std::string(activation), dropout_p,
                                       seed, save_preact);
  return {out[0], out[1], out[2]};
}

}  // namespace
}  // namespace cutlass_ext

namespace cutlass_ext {
namespace {

void register_nodes(torch::Library& m) {
  m.impl("linear", &linear_autograd);
  m.impl("lora_linear", &lora_linear_autograd);
  m.impl("softmax", &softmax_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("bias_act", &bias_act_autograd);
  m.impl("sum", &sum_autograd);
  m.impl("add", &add_autograd);
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, AutogradCUDA, m) { cutlass_ext::register_nodes(m); }

#ifdef CUTLASS_EXT_AUTOGRAD_ON_CPU
// Test builds only (CUTLASS_EXT_CPU_AUTOGRAD=1): the same nodes for CPU tensors, where they run
// the reference kernels, so that a machine without a GPU tests them.
TORCH_LIBRARY_IMPL(cutlass_ext, AutogradCPU, m) { cutlass_ext::register_nodes(m); }
#endif
