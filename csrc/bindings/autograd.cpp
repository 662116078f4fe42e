// Autograd of linear, lora_linear, softmax, layer_norm, bias_act (and its masked relu), sum and add
// for CUDA tensors, in C++. The Python autograd of these ops (register_autograd in
// cutlass_ext/ops/) costs ~40 us of host time per call, and its backward takes the GIL on
// autograd's device thread, which cost more than the kernels on small layers; these nodes do the
// same work without the interpreter. Each mirrors the setup_context/backward pair of its Python
// twin, which still serves CPU tensors and the CUDA calls made before this library is loaded; both
// call the same ops through the dispatcher.
//
// The nodes are plain autograd nodes, as torch's generated code makes them, rather than
// torch::autograd::Function: its context and output bookkeeping cost ~8 us of host time per
// forward and ~12 per backward on an H200 machine's host (measured on sum), more than the kernels
// of small layers. Saved tensors are SavedVariables, so an in-place change of one between the
// forward and the backward still raises autograd's error. Every input tensor has an edge (an
// absent optional one an invalid edge), and only the first output is differentiable.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "common/activation.h"

namespace cutlass_ext {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The typed dispatcher handle of an op.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

OptTensor optional_of(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

at::Tensor tensor_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// The node handle type of this torch (a shared or an intrusive pointer, by version).
using NodePtr = decltype(torch::autograd::Edge().function);

// A new node of type N whose edges lead to `inputs` (undefined ones: invalid edges), or null
// when no input needs a gradient (grad mode off, inference mode, frozen inputs).
template <class N, class... Inputs>
NodePtr make_node(const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return nullptr;
  NodePtr node;
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    node = std::make_shared<N>();
  } else {
    node = c10::make_intrusive<N>();
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// A saved tensor: a detached alias (it shares the version counter, so an in-place change is
// caught at unpack; it holds no reference to the node, so saving an output makes no cycle).
SavedVariable save(const at::Tensor& t) { return SavedVariable(t.defined() ? t.detach() : t, false); }

// ---------------------------------------------------------------------------------------------
// linear: the pre-activation output has no gradient; dB comes back in B's layout.

struct LinearBackward final : Node {
  SavedVariable a, b, saved;
  std::string activation;
  bool b_is_weight_t = false;

  variable_list apply(variable_list&& grads) override {
    static const auto op = op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const OptTensor&, c10::string_view, bool, bool, bool, bool)>(
        "cutlass_ext::_linear_backward");
    variable_list out(3);
    if (!grads[0].defined()) return out;
    const at::Tensor s = saved.unpack();
    check_activation_saved(int(activation_code(activation, "linear")), s, activation, "linear");
    const bool need[3] = {should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    auto [grad_a, grad_b, grad_bias] = op.call(grads[0], a.unpack(), b.unpack(), optional_of(s), activation, need[0],
                                               need[1], need[2], b_is_weight_t);
    if (need[0]) out[0] = grad_a;
    if (need[1]) out[1] = grad_b;
    if (need[2]) out[2] = grad_bias;
    return out;
  }
  void release_variables() override {
    a.reset_data();
    b.reset_data();
    saved.reset_data();
  }
  std::string name() const override { return "cutlass_ext::LinearBackward"; }
};

std::tuple<at::Tensor, at::Tensor> linear_autograd(const at::Tensor& a, const at::Tensor& b, const OptTensor& bias,
                                                   c10::string_view activation, bool save_preact,
                                                   c10::optional<c10::string_view> config) {
  static const auto op =
      op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                   c10::string_view, bool, c10::optional<c10::string_view>)>(
          "cutlass_ext::linear");
  at::Tensor y, z;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, z) = op.call(a, b, bias, activation, save_preact, config);
  }
  if (NodePtr node = make_node<LinearBackward>(a, b, tensor_or_undefined(bias))) {
    auto& n = static_cast<LinearBackward&>(*node);
    n.activation = std::string(activation);
    n.a = save(a);
    n.b = save(b);
    n.saved = save(activation_saved_tensor(int(activation_code(n.activation, "linear")), y, z, save_preact));
    // dB comes back in B's layout: transposed when B is the transpose of a row-major [N, K] weight.
    n.b_is_weight_t = b.sym_stride(0) == 1 && b.sym_stride(1) != 1;
    torch::autograd::set_history(y, node);
  }
  return {y, z};
}

// ---------------------------------------------------------------------------------------------
// softmax: the backward reads only the output.

struct SoftmaxBackward final : Node {
  SavedVariable y;
  int64_t dim = -1;
  double scale = 1.0;

  variable_list apply(variable_list&& grads) override {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>(
        "cutlass_ext::_softmax_backward");
    if (!grads[0].defined()) return {at::Tensor()};
    return {op.call(grads[0], y.unpack(), dim, scale)};
  }
  void release_variables() override { y.reset_data(); }
  std::string name() const override { return "cutlass_ext::SoftmaxBackward"; }
};

at::Tensor softmax_autograd(const at::Tensor& x, int64_t dim, double scale) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, int64_t, double)>("cutlass_ext::softmax");
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = op.call(x, dim, scale);
  }
  if (NodePtr node = make_node<SoftmaxBackward>(x)) {
    auto& n = static_cast<SoftmaxBackward&>(*node);
    n.y = save(y);
    n.dim = dim;
    n.scale = scale;
    torch::autograd::set_history(y, node);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// layer_norm: mean and rstd are outputs without a gradient.

struct LayerNormBackward final : Node {
  SavedVariable x, weight, mean, rstd, seed;
  bool relu = false;
  double dropout_p = 0.0;

  variable_list apply(variable_list&& grads) override {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&,
                          const at::Tensor&, bool, double, const OptTensor&, bool, bool, bool)>(
            "cutlass_ext::_layer_norm_backward");
    variable_list out(3);
    if (!grads[0].defined()) return out;
    const bool need[3] = {should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    auto [dx, dweight, dbias] = op.call(grads[0], x.unpack(), optional_of(weight.unpack()), mean.unpack(),
                                        rstd.unpack(), relu, dropout_p, optional_of(seed.unpack()), need[0], need[1],
                                        need[2]);
    if (need[0]) out[0] = dx;
    if (need[1]) out[1] = dweight;
    if (need[2]) out[2] = dbias;
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&x, &weight, &mean, &rstd, &seed}) v->reset_data();
  }
  std::string name() const override { return "cutlass_ext::LayerNormBackward"; }
};

Tensor3 layer_norm_autograd(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps, bool relu,
                            double dropout_p, const OptTensor& seed) {
  static const auto op = op_handle<Tensor3(const at::Tensor&, const OptTensor&, const OptTensor&, double, bool,
                                           double, const OptTensor&)>("cutlass_ext::layer_norm");
  at::Tensor y, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, mean, rstd) = op.call(x, weight, bias, eps, relu, dropout_p, seed);
  }
  if (NodePtr node = make_node<LayerNormBackward>(x, tensor_or_undefined(weight), tensor_or_undefined(bias))) {
    auto& n = static_cast<LayerNormBackward&>(*node);
    n.x = save(x);
    n.weight = save(tensor_or_undefined(weight));  // the bias is not needed
    n.mean = save(mean);
    n.rstd = save(rstd);
    n.seed = save(tensor_or_undefined(seed));
    n.relu = relu;
    n.dropout_p = dropout_p;
    torch::autograd::set_history(y, node);
  }
  return {y, mean, rstd};
}

// ---------------------------------------------------------------------------------------------
// bias_act: act(scale * x + bias + residual).

struct BiasActBackward final : Node {
  SavedVariable x, bias, residual;
  std::string activation;
  double scale = 1.0;

  variable_list apply(variable_list&& grads) override {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, c10::string_view,
                          double, bool, bool, bool)>("cutlass_ext::_bias_act_backward");
    variable_list out(3);
    const bool need[3] = {should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    if (!grads[0].defined() || !(need[0] || need[1] || need[2])) return out;
    auto [dx, dbias, dresidual] = op.call(grads[0], x.unpack(), optional_of(bias.unpack()),
                                          optional_of(residual.unpack()), activation, scale, need[0], need[1], need[2]);
    if (need[0]) out[0] = dx;
    if (need[1]) out[1] = dbias;
    if (need[2]) out[2] = dresidual;
    return out;
  }
  void release_variables() override {
    x.reset_data();
    bias.reset_data();
    residual.reset_data();
  }
  std::string name() const override { return "cutlass_ext::BiasActBackward"; }
};

at::Tensor bias_act_autograd(const at::Tensor& x, const OptTensor& bias, c10::string_view activation, double scale,
                             const OptTensor& residual) {
  static const auto op =
      op_handle<at::Tensor(const at::Tensor&, const OptTensor&, c10::string_view, double, const OptTensor&)>(
          "cutlass_ext::bias_act");
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = op.call(x, bias, activation, scale, residual);
  }
  const at::Tensor b = tensor_or_undefined(bias), r = tensor_or_undefined(residual);
  if (NodePtr node = make_node<BiasActBackward>(x, b, r)) {
    auto& n = static_cast<BiasActBackward&>(*node);
    n.x = save(x);
    n.bias = save(b);
    n.residual = save(r);
    n.activation = std::string(activation);
    n.scale = scale;
    torch::autograd::set_history(y, node);
  }
  return y;
}

// _bias_relu_masked: relu(scale * x + bias + residual) and its mask; the backward reads grad and
// the mask only.

struct BiasReluMaskedBackward final : Node {
  SavedVariable mask;
  double scale = 1.0;

  variable_list apply(variable_list&& grads) override {
    static const auto op =
        op_handle<Tensor3(const at::Tensor&, const at::Tensor&, double, bool, bool, bool)>(
            "cutlass_ext::_bias_relu_mask_backward");
    variable_list out(3);
    const bool need[3] = {should_compute_output(0), should_compute_output(1), should_compute_output(2)};
    if (!grads[0].defined() || !(need[0] || need[1] || need[2])) return out;
    auto [dx, dbias, dresidual] = op.call(grads[0], mask.unpack(), scale, need[0], need[1], need[2]);
    if (need[0]) out[0] = dx;
    if (need[1]) out[1] = dbias;
    if (need[2]) out[2] = dresidual;
    return out;
  }
  void release_variables() override { mask.reset_data(); }
  std::string name() const override { return "cutlass_ext::BiasReluMaskedBackward"; }
};

std::tuple<at::Tensor, at::Tensor> bias_relu_masked_autograd(const at::Tensor& x, const OptTensor& bias, double scale,
                                                             const OptTensor& residual) {
  static const auto op =
      op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, double, const OptTensor&)>(
          "cutlass_ext::_bias_relu_masked");
  at::Tensor y, mask;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, mask) = op.call(x, bias, scale, residual);
  }
  const at::Tensor b = tensor_or_undefined(bias), r = tensor_or_undefined(residual);
  if (NodePtr node = make_node<BiasReluMaskedBackward>(x, b, r)) {
    auto& n = static_cast<BiasReluMaskedBackward&>(*node);
    n.mask = save(mask);
    n.scale = scale;
    torch::autograd::set_history(y, node);
  }
  return {y, mask};
}

// ---------------------------------------------------------------------------------------------
// sum: the gradient is grad broadcast back over the reduced dimensions (a view, no kernel).

struct SumBackward final : Node {
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
  if (NodePtr node = make_node<SumBackward>(x)) {
    auto& n = static_cast<SumBackward&>(*node);
    n.shape = x.sizes().vec();
    for (int64_t d : dim) n.dims.push_back(d < 0 ? d + x.dim() : d);
    std::sort(n.dims.begin(), n.dims.end());
    n.keepdim = keepdim;
    torch::autograd::set_history(y, node);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// add: both gradients are grad itself.

struct AddBackward final : Node {
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
  if (NodePtr node = make_node<AddBackward>(a, b)) torch::autograd::set_history(y, node);
  return y;
}

// ---------------------------------------------------------------------------------------------
// lora_linear: t (the low-rank activations) and the pre-activation are outputs without a gradient.

struct LoraLinearBackward final : Node {
  SavedVariable x, weight, lora_A, lora_B, t, saved, seed;
  std::string activation;
  double scaling = 1.0, dropout_p = 0.0;

  variable_list apply(variable_list&& grads) override {
    using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
    static const auto op =
        op_handle<Tensor5(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view, double, double,
                          const OptTensor&, bool, bool, bool, bool, bool)>("cutlass_ext::_lora_linear_backward");
    variable_list out(5);
    if (!grads[0].defined()) return out;
    const at::Tensor s = saved.unpack();
    check_activation_saved(int(activation_code(activation, "lora_linear")), s, activation, "lora_linear");
    bool need[5];
    for (int i = 0; i < 5; ++i) need[i] = should_compute_output(i);
    auto grads5 = op.call(grads[0], x.unpack(), weight.unpack(), lora_A.unpack(), lora_B.unpack(), t.unpack(),
                          optional_of(s), activation, scaling, dropout_p, optional_of(seed.unpack()), need[0],
                          need[1], need[2], need[3], need[4]);
    const at::Tensor results[5] = {std::get<0>(grads5), std::get<1>(grads5), std::get<2>(grads5),
                                   std::get<3>(grads5), std::get<4>(grads5)};
    for (int i = 0; i < 5; ++i) {
      if (need[i]) out[i] = results[i];
    }
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&x, &weight, &lora_A, &lora_B, &t, &saved, &seed}) v->reset_data();
  }
  std::string name() const override { return "cutlass_ext::LoraLinearBackward"; }
};

Tensor3 lora_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
                             const at::Tensor& lora_B, const OptTensor& bias, double scaling,
                             c10::string_view activation, double dropout_p, const OptTensor& seed, bool save_preact) {
  static const auto op =
      op_handle<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                        double, c10::string_view, double, const OptTensor&, bool)>("cutlass_ext::lora_linear");
  at::Tensor y, t, preact;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, t, preact) = op.call(x, weight, lora_A, lora_B, bias, scaling, activation, dropout_p, seed,
                                     save_preact);
  }
  if (NodePtr node = make_node<LoraLinearBackward>(x, weight, lora_A, lora_B, tensor_or_undefined(bias))) {
    auto& n = static_cast<LoraLinearBackward&>(*node);
    n.activation = std::string(activation);
    n.x = save(x);
    n.weight = save(weight);
    n.lora_A = save(lora_A);
    n.lora_B = save(lora_B);
    n.t = save(t);
    n.saved = save(activation_saved_tensor(int(activation_code(n.activation, "lora_linear")), y, preact, save_preact));
    n.seed = save(tensor_or_undefined(seed));
    n.scaling = scaling;
    n.dropout_p = dropout_p;
    torch::autograd::set_history(y, node);
  }
  return {y, t, preact};
}

void register_nodes(torch::Library& m) {
  m.impl("linear", &linear_autograd);
  m.impl("lora_linear", &lora_linear_autograd);
  m.impl("softmax", &softmax_autograd);
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("bias_act", &bias_act_autograd);
  m.impl("_bias_relu_masked", &bias_relu_masked_autograd);
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
