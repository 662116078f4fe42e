// Host side of torch.ops.cutlass_ext.layer_norm and _layer_norm_backward (schemas:
// cutlass_ext/ops/layer_norm.py): checks tensors, views [..., C] inputs as [rows, C] without a copy
// where the strides allow, allocates outputs and workspace from the torch allocator and launches the
// kernels of elementwise/layer_norm_kernels.h on the current stream. The dropout seed stays in
// device memory (no host synchronization).
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "bindings/common.h"
#include "common/counter_rng.h"
#include "elementwise/layer_norm_kernels.h"

namespace cutlass_ext {
namespace {

// x [..., C] as a [rows, C] matrix with unit column stride: a view when the leading dimensions
// collapse to one row stride (slices such as x[:, 1:] included), else a contiguous copy.
struct RowMatrix {
  at::Tensor t;
  int64_t ld = 0;
};

RowMatrix as_rows(const at::Tensor& x) {
  const int64_t cols = x.size(-1);
  const int64_t rows = x.numel() / cols;
  bool ok = x.stride(-1) == 1 || cols == 1;
  int64_t ld = -1, next = 0;  // next: the stride the next outer dimension must have
  for (int64_t d = x.dim() - 2; d >= 0 && ok; --d) {
    if (x.size(d) == 1) continue;
    if (ld < 0) {
      ld = x.stride(d);
    } else if (x.stride(d) != next) {
      ok = false;
    }
    next = x.stride(d) * x.size(d);
  }
  if (ld < 0) ld = cols;  // at most one row
  if (!ok) return {x.contiguous().view({rows, cols}), cols};
  return {x.as_strided({rows, cols}, {ld, 1}), ld};
}

// weight or bias: [C], x's dtype and device, contiguous.
at::Tensor affine_param(const c10::optional<at::Tensor>& t, const at::Tensor& x, const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  CE_CHECK(t->dim() == 1 && t->size(0) == x.size(-1), op, ": ", name, " must have shape [C] = [", x.size(-1),
           "], got ", shape_str(*t));
  CE_CHECK(t->scalar_type() == x.scalar_type() && t->device() == x.device(), op, ": ", name,
           " must have x's dtype and device");
  return t->contiguous();
}

DropoutParams dropout_params(double p, const c10::optional<at::Tensor>& seed, const at::Tensor& x, const char* op) {
  CE_CHECK(p >= 0.0 && p <= 1.0, op, ": dropout_p must be in [0, 1], got ", p);
  DropoutParams d;
  if (p == 0.0) return d;
  CE_CHECK(seed.has_value() && seed->defined(), op, ": dropout_p > 0 needs a seed tensor");
  CE_CHECK(seed->scalar_type() == at::kLong && seed->numel() >= 1 && seed->device() == x.device(), op,
           ": seed must be an int64 tensor with one element on x's device");
  CE_CHECK(seed->is_contiguous(), op, ": seed must be contiguous");
  d.seed = seed->data_ptr<int64_t>();
  d.keep_threshold = dropout_keep_threshold(p);
  d.keep_scale = dropout_keep_scale(p);
  return d;
}

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_cuda(const at::Tensor& x,
                                                               const c10::optional<at::Tensor>& weight,
                                                               const c10::optional<at::Tensor>& bias, double eps,
                                                               bool relu, double dropout_p,
                                                               const c10::optional<at::Tensor>& seed) {
  const char* op = "layer_norm";
  CE_CHECK(x.is_cuda() && x.dim() >= 1, op, ": x must be a CUDA tensor of shape [..., C]");
  const DType dt = dtype_of(x, op, "x");
  const int64_t cols = x.size(-1);
  CE_CHECK(cols >= 1, op, ": x's last dimension C must be at least 1");
  const c10::DeviceGuard guard(x.device());
  const at::Tensor w = affine_param(weight, x, op, "weight");
  const at::Tensor b = affine_param(bias, x, op, "bias");
  const DropoutParams drop = dropout_params(dropout_p, seed, x, op);
  const int64_t rows = x.numel() / cols;
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor mean = new_output({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, rstd};

  const RowMatrix xr = as_rows(x);
  LayerNormParams p;
  p.rows = rows;
  p.cols = cols;
  p.dtype = dt;
  p.x = xr.t.data_ptr();
  p.x_ld = xr.ld;
  p.weight = data_or_null(w);
  p.bias = data_or_null(b);
  p.y = y.data_ptr();
  p.y_ld = cols;
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.eps = float(eps);
  p.relu = relu;
  p.dropout = drop;
  check_launch(layer_norm_forward(p, current_stream(x.device())), op, "layer_norm_forward");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool relu, double dropout_p, const c10::optional<at::Tensor>& seed, bool need_x,
    bool need_weight, bool need_bias) {
  const char* op = "_layer_norm_backward";
  CE_CHECK(x.is_cuda() && x.dim() >= 1, op, ": x must be a CUDA tensor of shape [..., C]");
  const DType dt = dtype_of(x, op, "x");
  CE_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type() && grad.device() == x.device(), op,
           ": grad must match x's shape, dtype and device");
  const int64_t cols = x.size(-1);
  CE_CHECK(cols >= 1, op, ": x's last dimension C must be at least 1");
  const int64_t rows = x.numel() / cols;
  for (const at::Tensor* t : {&mean, &rstd}) {
    CE_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows && t->device() == x.device(), op,
             ": mean and rstd must be float32 [rows] tensors on x's device (the forward's outputs)");
  }
  const c10::DeviceGuard guard(x.device());
  const at::Tensor w = affine_param(weight, x, op, "weight");
  CE_CHECK(!need_weight || w.defined(), op, ": need_weight without a weight");
  const DropoutParams drop = dropout_params(dropout_p, seed, x, op);
  at::Tensor dx = need_x ? new_output(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor dw = need_weight ? new_output({cols}, x.options()) : at::empty({0}, x.options());
  at::Tensor db = need_bias ? new_output({cols}, x.options()) : at::empty({0}, x.options());
  if (rows == 0) {
    if (need_weight) dw.zero_();
    if (need_bias) db.zero_();
    return {dx, dw, db};
  }
  if (!need_x && !need_weight && !need_bias) return {dx, dw, db};

  const RowMatrix gr = as_rows(grad);
  const RowMatrix xr = as_rows(x);
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  LayerNormBackwardParams p;
  p.rows = rows;
  p.cols = cols;
  p.dtype = dt;
  p.grad = gr.t.data_ptr();
  p.grad_ld = gr.ld;
  p.x = xr.t.data_ptr();
  p.x_ld = xr.ld;
  p.weight = data_or_null(w);
  p.mean = mean_c.data_ptr<float>();
  p.rstd = rstd_c.data_ptr<float>();
  p.relu = relu;
  p.dropout = drop;
  if (need_x) {
    p.grad_x = dx.data_ptr();
    p.grad_x_ld = cols;
  }
  if (need_weight) p.grad_weight = dw.data_ptr();
  if (need_bias) p.grad_bias = db.data_ptr();
  p.sm_count = sm_count(x.device().index());
  at::Tensor workspace;
  const int64_t workspace_floats = layer_norm_backward_workspace(p);
  if (workspace_floats > 0) {
    workspace = at::empty({workspace_floats}, x.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  check_launch(layer_norm_backward(p, current_stream(x.device())), op, "layer_norm_backward");
  return {dx, dw, db};
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, CUDA, m) {
  m.impl("layer_norm", &cutlass_ext::layer_norm_cuda);
  m.impl("_layer_norm_backward", &cutlass_ext::layer_norm_backward_cuda);
}
