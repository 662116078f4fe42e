// Host side of torch.ops.cutlass_ext.bias_act, _bias_act_backward, sum and add (schemas:
// cutlass_ext/ops/pointwise.py). Checks tensors, views them as the kernels' row-major matrices
// (copying only what cannot be viewed), allocates outputs and split workspaces from the torch
// allocator, and launches on the current stream.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "elementwise/pointwise_kernels.h"
#include "elementwise/reduce_kernels.h"

namespace cutlass_ext {
namespace {

// ---------------------------------------------------------------------------------------------
// Layout helpers

// t [..., cols] as a [rows, cols] matrix with unit column stride: a view when the leading dims
// flatten into one row stride (slices and expanded rows included), else a contiguous copy.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  at::Tensor m = t.reshape({rows, cols});
  if (cols > 1 && m.stride(1) != 1) m = m.contiguous();
  return m;
}

// The row stride the kernels use; a single row gets a harmless stride that never blocks
// vectorization.
int64_t row_stride(const at::Tensor& m) { return m.size(0) <= 1 ? m.size(1) : m.stride(0); }

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name, const char* ref_name) {
  CE_CHECK(t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type() && t.device() == ref.device(), op, ": ",
           name, " must match ", ref_name, "'s shape, dtype and device");
}

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x, int64_t cols, const char* op) {
  if (!bias.has_value()) return;
  CE_CHECK(bias->dim() == 1 && bias->size(0) == cols && bias->scalar_type() == x.scalar_type() &&
               bias->device() == x.device(),
           op, ": bias must be [", cols, "] with x's dtype and device");
}

// ---------------------------------------------------------------------------------------------
// bias_act

// The forward's checks and views, shared by bias_act and _bias_relu_masked; fills `p` but y.
struct ForwardViews {
  at::Tensor x, bias, residual;  // alive for the launch
};

ForwardViews forward_params(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t code, double scale,
                            const c10::optional<at::Tensor>& residual, const char* op, BiasActParams& p) {
  CE_CHECK(x.is_cuda() && x.dim() >= 1, op, ": x must be a CUDA tensor with at least 1 dimension");
  const DType dt = dtype_of(x, op, "x");
  const int64_t cols = x.size(-1);
  check_bias(bias, x, cols, op);
  if (residual.has_value()) check_like(*residual, x, op, "residual", "x");
  p.cols = cols;
  p.rows = cols == 0 ? 0 : x.numel() / cols;
  p.dtype = dt;
  p.activation = int(code);
  p.scale = float(scale);
  p.sm_count = sm_count(x.device().index());
  ForwardViews v;
  if (x.numel() == 0) return v;
  v.x = as_rows(x, p.rows, cols);
  p.x = v.x.data_ptr();
  p.x_ld = row_stride(v.x);
  if (bias.has_value()) {
    v.bias = bias->contiguous();
    p.bias = v.bias.data_ptr();
  }
  if (residual.has_value()) {
    v.residual = as_rows(*residual, p.rows, cols);
    p.residual = v.residual.data_ptr();
    p.residual_ld = row_stride(v.residual);
  }
  return v;
}

at::Tensor bias_act_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view activation,
                         double scale, const c10::optional<at::Tensor>& residual) {
  const char* op = "bias_act";
  const int64_t code = activation_code(activation, op);
  BiasActParams p;
  const ForwardViews views = forward_params(x, bias, code, scale, residual, op, p);
  const c10::DeviceGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  p.y = y.data_ptr();
  check_launch(bias_act_forward(p, current_stream(x.device())), op, "bias_act_forward");
  return y;
}

// relu(scale * x + bias + residual) and its mask for the backward: int32 words, bit e % 32 of word
// e / 32 set where element e of y (row-major) has z > 0.
std::tuple<at::Tensor, at::Tensor> bias_relu_masked_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                                         double scale, const c10::optional<at::Tensor>& residual) {
  const char* op = "_bias_relu_masked";
  BiasActParams p;
  const ForwardViews views = forward_params(x, bias, int64_t(Activation::kRelu), scale, residual, op, p);
  CE_CHECK(p.cols <= kMaxMaskCols, op, ": rows longer than ", kMaxMaskCols,
           " elements have no masked kernel; call bias_act, which saves x for such rows");
  const c10::DeviceGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor mask = new_output({mask_words(x.numel())}, x.options().dtype(at::kInt));
  if (x.numel() == 0) return {y, mask};
  p.y = y.data_ptr();
  p.mask = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  check_launch(bias_act_forward(p, current_stream(x.device())), op, "bias_act_forward");
  return {y, mask};
}

// Allocates the backward's results, plans its row split and launches it. `p` comes with the
// activation, scale and what recomputes z (x, bias, residual) or relu's mask.
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_backward(BiasActBackwardParams p, const at::Tensor& grad,
                                                               bool need_x, bool need_bias, bool need_residual,
                                                               const char* op) {
  const int64_t cols = grad.size(-1);
  const c10::DeviceGuard guard(grad.device());
  const auto empty = [&] { return at::empty({0}, grad.options()); };
  at::Tensor dx = need_x ? new_output(grad.sizes(), grad.options()) : empty();
  at::Tensor dres = need_residual ? new_output(grad.sizes(), grad.options()) : empty();
  at::Tensor db = need_bias ? new_output({cols}, grad.options()) : empty();
  if (grad.numel() == 0) {
    if (need_bias) db.zero_();  // a sum over zero rows
    return {dx, db, dres};
  }
  if (!need_x && !need_bias && !need_residual) return {dx, db, dres};

  const at::Tensor gm = as_rows(grad, grad.numel() / cols, cols);
  p.rows = gm.size(0);
  p.cols = cols;
  p.grad = gm.data_ptr();
  p.grad_ld = row_stride(gm);
  if (need_x) p.grad_x = dx.data_ptr();
  if (need_residual) p.grad_residual = dres.data_ptr();
  const int device = grad.device().index();
  p.row_splits = bias_act_backward_row_splits(p.rows, cols, p.dtype, p.activation, p.residual != nullptr,
                                              p.mask != nullptr, sm_count(device), device);
  at::Tensor partials;
  if (need_bias) {
    p.grad_bias = db.data_ptr();
    if (p.row_splits > 1) {
      partials = at::empty({p.row_splits, cols}, grad.options().dtype(at::kFloat));
      p.partials = partials.data_ptr<float>();
    }
  }
  check_launch(bias_act_backward(p, current_stream(grad.device())), op, "bias_act_backward");
  return {dx, db, dres};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& residual, c10::string_view activation, double scale, bool need_x,
    bool need_bias, bool need_residual) {
  const char* op = "_bias_act_backward";
  const int64_t code = activation_code(activation, op);
  CE_CHECK(x.is_cuda() && x.dim() >= 1, op, ": x must be a CUDA tensor with at least 1 dimension");
  BiasActBackwardParams p;
  p.dtype = dtype_of(x, op, "x");
  check_like(grad, x, op, "grad", "x");
  const int64_t cols = x.size(-1);
  check_bias(bias, x, cols, op);
  if (residual.has_value()) check_like(*residual, x, op, "residual", "x");
  CE_CHECK(!need_bias || bias.has_value(), op, ": need_bias requires a bias");
  CE_CHECK(!need_residual || residual.has_value(), op, ": need_residual requires a residual");
  p.activation = int(code);
  p.scale = float(scale);
  at::Tensor xm, b, rm;  // read only to recompute z (not for activation "none")
  if (code != int64_t(Activation::kNone) && x.numel() != 0) {
    const int64_t rows = x.numel() / cols;
    xm = as_rows(x, rows, cols);
    p.x = xm.data_ptr();
    p.x_ld = row_stride(xm);
    if (bias.has_value()) {
      b = bias->contiguous();
      p.bias = b.data_ptr();
    }
    if (residual.has_value()) {
      rm = as_rows(*residual, rows, cols);
      p.residual = rm.data_ptr();
      p.residual_ld = row_stride(rm);
    }
  }
  return launch_backward(p, grad, need_x, need_bias, need_residual, op);
}

// The backward of _bias_relu_masked from grad and the mask alone (x, bias and residual not read).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_relu_mask_backward_cuda(const at::Tensor& grad,
                                                                            const at::Tensor& mask, double scale,
                                                                            bool need_x, bool need_bias,
                                                                            bool need_residual) {
  const char* op = "_bias_relu_mask_backward";
  CE_CHECK(grad.is_cuda() && grad.dim() >= 1, op, ": grad must be a CUDA tensor with at least 1 dimension");
  BiasActBackwardParams p;
  p.dtype = dtype_of(grad, op, "grad");
  CE_CHECK(mask.scalar_type() == at::kInt && mask.dim() == 1 && mask.is_contiguous() &&
               mask.device() == grad.device() && mask.numel() == mask_words(grad.numel()),
           op, ": mask must be the contiguous int32 [", mask_words(grad.numel()),
           "] tensor _bias_relu_masked returned for grad's shape, on grad's device");
  p.activation = int(Activation::kRelu);
  p.scale = float(scale);
  if (grad.numel() != 0) p.mask = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  return launch_backward(p, grad, need_x, need_bias, need_residual, op);
}

// ---------------------------------------------------------------------------------------------
// sum

struct Mode {
  int64_t size, stride;
  bool reduced;
};

// Views x as [outer, reduce, inner] in place (inner contiguous), or returns false when the
// reduced and kept dimensions interleave in memory or the kept ones are not in logical order
// (the output is written in memory order). Size-1 dimensions play no part.
bool as_reduction(const at::Tensor& x, const std::vector<bool>& reduced, SumParams& p) {
  std::vector<Mode> modes;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.size(d) == 1) continue;
    if (x.stride(d) <= 0) return false;
    modes.push_back({x.size(d), x.stride(d), reduced[d]});
  }
  std::vector<size_t> order(modes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return modes[a].stride > modes[b].stride; });
  size_t last_kept = 0;
  bool seen_kept = false;
  std::vector<Mode> groups;  // memory order, adjacent same-kind modes merged where strides allow
  for (size_t i : order) {
    const Mode& m = modes[i];
    if (!m.reduced) {
      if (seen_kept && i < last_kept) return false;
      last_kept = i;
      seen_kept = true;
    }
    if (!groups.empty() && groups.back().reduced == m.reduced && groups.back().stride == m.stride * m.size) {
      groups.back() = {groups.back().size * m.size, m.stride, m.reduced};
    } else {
      groups.push_back(m);
    }
  }
  if (!groups.empty() && groups.back().stride != 1) return false;
  p.outer = p.reduce = p.inner = 1;
  p.outer_stride = p.reduce_stride = 0;
  size_t g = 0;
  if (g < groups.size() && !groups[g].reduced) {
    p.outer = groups[g].size;
    p.outer_stride = groups[g].stride;
    ++g;
  }
  if (g < groups.size() && groups[g].reduced) {
    p.reduce = groups[g].size;
    p.reduce_stride = groups[g].stride;
    ++g;
  }
  if (g < groups.size() && !groups[g].reduced) {
    p.inner = groups[g].size;
    ++g;
  }
  // (With no reduced extent left, the kept elements are read as rows of length 1.)
  return g == groups.size();
}

at::Tensor sum_cuda(const at::Tensor& x, at::IntArrayRef dim, bool keepdim) {
  const char* op = "sum";
  CE_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  const DType dt = dtype_of(x, op, "x");
  const int64_t ndim = x.dim();
  CE_CHECK(!dim.empty(), op, ": dim must name at least one dimension");
  std::vector<bool> reduced(size_t(std::max<int64_t>(ndim, 1)), false);
  for (int64_t d : dim) {
    CE_CHECK(d >= -ndim && d < ndim, op, ": dim ", d, " is out of range for a ", ndim, "-D tensor");
    const int64_t n = d < 0 ? d + ndim : d;
    CE_CHECK(!reduced[n], op, ": dim ", d, " is repeated");
    reduced[n] = true;
  }
  std::vector<int64_t> out_shape;
  for (int64_t d = 0; d < ndim; ++d) {
    if (!reduced[d]) {
      out_shape.push_back(x.size(d));
    } else if (keepdim) {
      out_shape.push_back(1);
    }
  }
  const c10::DeviceGuard guard(x.device());
  at::Tensor out = new_output(out_shape, x.options());
  if (out.numel() == 0) return out;
  if (x.numel() == 0) return out.zero_();  // a sum over zero elements

  SumParams p;
  at::Tensor src = x;
  if (!as_reduction(x, reduced, p)) {
    // Kept dims first, reduced dims last, in one contiguous copy: then a plain row reduction.
    std::vector<int64_t> perm;
    for (int64_t d = 0; d < ndim; ++d) {
      if (!reduced[d]) perm.push_back(d);
    }
    for (int64_t d = 0; d < ndim; ++d) {
      if (reduced[d]) perm.push_back(d);
    }
    src = x.permute(perm).contiguous();
    std::vector<bool> moved_reduced(size_t(ndim), false);
    for (int64_t i = 0; i < ndim; ++i) moved_reduced[i] = reduced[perm[i]];
    CE_CHECK(as_reduction(src, moved_reduced, p), op, ": internal error: no reduction view of a contiguous copy");
  }
  p.dtype = dt;
  p.input = src.data_ptr();
  p.output = out.data_ptr();
  plan_sum(p, sm_count(x.device().index()), l2_cache_bytes(x.device().index()));
  at::Tensor partials;
  if (p.plan.splits > 1) {
    partials = at::empty({p.outer * p.plan.splits * p.inner}, x.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  check_launch(cutlass_ext::sum(p, current_stream(x.device())), op, "sum");
  return out;
}

// ---------------------------------------------------------------------------------------------
// add

at::Tensor add_cuda(const at::Tensor& a, const at::Tensor& b) {
  const char* op = "add";
  CE_CHECK(a.is_cuda(), op, ": a must be a CUDA tensor");
  const DType dt = dtype_of(a, op, "a");
  check_like(b, a, op, "b", "a");
  const c10::DeviceGuard guard(a.device());
  at::Tensor out = new_output(a.sizes(), a.options());
  if (a.numel() == 0) return out;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  AddParams p;
  p.numel = a.numel();
  p.dtype = dt;
  p.a = ac.data_ptr();
  p.b = bc.data_ptr();
  p.out = out.data_ptr();
  check_launch(cutlass_ext::add(p, current_stream(a.device())), op, "add");
  return out;
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, CUDA, m) {
  m.impl("bias_act", &cutlass_ext::bias_act_cuda);
  m.impl("_bias_act_backward", &cutlass_ext::bias_act_backward_cuda);
  m.impl("_bias_relu_masked", &cutlass_ext::bias_relu_masked_cuda);
  m.impl("_bias_relu_mask_backward", &cutlass_ext::bias_relu_mask_backward_cuda);
  m.impl("sum", &cutlass_ext::sum_cuda);
  m.impl("add", &cutlass_ext::add_cuda);
}
