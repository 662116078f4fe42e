// Host binding of the softmax op family: the CUDA kernels of torch.ops.cutlass_ext.softmax and
// _softmax_backward (schemas: cutlass_ext/ops/softmax.py). Each operand is read as rows along
// `dim`: in place when `dim` is last with unit stride and the other dims fold into one row stride,
// otherwise through a copy with `dim` moved last. Outputs are contiguous in the input's shape.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>

#include "bindings/common.h"
#include "elementwise/softmax_kernels.h"

namespace cutlass_ext {
namespace {

// An operand as rows of `cols` unit-stride elements, one row every `ld` elements from `t`'s data.
struct Rows {
  at::Tensor t;  // keeps a copy alive when one was needed
  int64_t rows = 0, cols = 0, ld = 0;
};

// The row stride of `t` (dim last) when its leading dims fold into one, else -1.
int64_t folded_row_stride(const at::Tensor& t) {
  const int64_t last = t.dim() - 1;
  const int64_t cols = t.size(last);
  if (cols != 1 && t.stride(last) != 1) return -1;
  int64_t ld = -1, next = 0;  // next: the stride the next outer dim must have
  for (int64_t d = last - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (ld < 0) {
      ld = t.stride(d);
    } else if (t.stride(d) != next) {
      return -1;
    }
    next = t.stride(d) * t.size(d);
  }
  return ld < 0 ? cols : ld;  // a single row: any stride works
}

Rows as_rows(const at::Tensor& t, int64_t dim) {
  Rows r;
  r.t = dim == t.dim() - 1 ? t : t.movedim(dim, -1);
  r.ld = folded_row_stride(r.t);
  if (r.ld < 0) {
    r.t = r.t.contiguous();
    r.ld = r.t.size(-1);
  }
  r.cols = r.t.size(-1);
  r.rows = r.t.numel() / r.cols;
  return r;
}

// A 0-d tensor is one row of one element.
at::Tensor at_least_1d(const at::Tensor& t) { return t.dim() == 0 ? t.reshape({1}) : t; }

// The [rows, cols] buffer the kernel writes: `out` itself when `dim` is last, else a scratch
// tensor in the moved layout that finish_output copies back.
at::Tensor row_output(const at::Tensor& out, const Rows& r, bool dim_is_last) {
  return dim_is_last ? out.view({r.rows, r.cols}) : new_output({r.rows, r.cols}, out.options());
}

void finish_output(const at::Tensor& out, const at::Tensor& rows_out, const Rows& r, int64_t dim, bool dim_is_last) {
  if (!dim_is_last) out.copy_(rows_out.view(r.t.sizes()).movedim(-1, dim));
}

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim, double scale) {
  const char* op = "softmax";
  CE_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  const DType dt = dtype_of(x, op, "x");
  const c10::DeviceGuard guard(x.device());
  at::Tensor out = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const at::Tensor x1 = at_least_1d(x);
  const int64_t d = at::maybe_wrap_dim(dim, x1.dim());
  const bool dim_is_last = d == x1.dim() - 1;
  const Rows in = as_rows(x1, d);
  at::Tensor y = row_output(out, in, dim_is_last);

  SoftmaxParams p;
  p.rows = in.rows;
  p.cols = in.cols;
  p.dtype = dt;
  p.scale = float(scale);
  p.x = in.t.data_ptr();
  p.x_ld = in.ld;
  p.y = y.data_ptr();
  p.y_ld = in.cols;
  p.sm_count = sm_count(x.device().index());
  p.row_splits = softmax_row_splits(in.rows, in.cols, false, p.sm_count);
  at::Tensor partials;
  if (p.row_splits > 1) {
    partials = at::empty({softmax_partials_floats(in.rows, p.row_splits, false)}, x.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  check_launch(softmax_forward(p, current_stream(x.device())), op, "softmax_forward");
  finish_output(out, y, in, d, dim_is_last);
  return out;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& y, int64_t dim, double scale) {
  const char* op = "_softmax_backward";
  CE_CHECK(y.is_cuda(), op, ": y must be a CUDA tensor");
  CE_CHECK(grad.device() == y.device(), op, ": grad is on ", grad.device(), " but y is on ", y.device());
  CE_CHECK(grad.scalar_type() == y.scalar_type(), op, ": grad has dtype ", grad.scalar_type(), " but y has ",
           y.scalar_type());
  CE_CHECK(grad.sizes() == y.sizes(), op, ": grad has shape ", shape_str(grad), " but y has ", shape_str(y));
  const DType dt = dtype_of(y, op, "y");
  const c10::DeviceGuard guard(y.device());
  at::Tensor out = new_output(y.sizes(), y.options());
  if (y.numel() == 0) return out;
  const at::Tensor y1 = at_least_1d(y);
  const int64_t d = at::maybe_wrap_dim(dim, y1.dim());
  const bool dim_is_last = d == y1.dim() - 1;
  const Rows g = as_rows(at_least_1d(grad), d);
  const Rows o = as_rows(y1, d);
  at::Tensor dx = row_output(out, o, dim_is_last);

  SoftmaxBackwardParams p;
  p.rows = o.rows;
  p.cols = o.cols;
  p.dtype = dt;
  p.scale = float(scale);
  p.grad = g.t.data_ptr();
  p.grad_ld = g.ld;
  p.y = o.t.data_ptr();
  p.y_ld = o.ld;
  p.grad_input = dx.data_ptr();
  p.grad_input_ld = o.cols;
  p.row_splits = softmax_row_splits(o.rows, o.cols, true, sm_count(y.device().index()));
  at::Tensor partials;
  if (p.row_splits > 1) {
    partials = at::empty({softmax_partials_floats(o.rows, p.row_splits, true)}, y.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  check_launch(softmax_backward(p, current_stream(y.device())), op, "softmax_backward");
  finish_output(out, dx, o, d, dim_is_last);
  return out;
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, CUDA, m) {
  m.impl("softmax", &cutlass_ext::softmax_cuda);
  m.impl("_softmax_backward", &cutlass_ext::softmax_backward_cuda);
}
