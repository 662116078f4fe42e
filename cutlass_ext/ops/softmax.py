"""Softmax op family: ``softmax(scale * x)`` along a dim, and its fused backward.

Schemas, fake kernels, autograd and the CPU reference live here; the CUDA kernels come from the
compiled extension (csrc/bindings/softmax.cpp, kernels in csrc/elementwise/softmax_kernels.cu).

Semantics shared by every kernel (math in fp32 for 16-bit inputs): ``z = scale * x`` as IEEE
arithmetic; an entry with ``z = -inf`` gets probability 0; a row whose entries are all ``-inf``
gives a row of zeros (torch.softmax gives NaN there); a NaN anywhere in a row (including one made
by ``z = +inf`` or by ``0 * inf``) makes that whole row NaN. The row max is subtracted first, so
large inputs do not overflow. Outputs are contiguous tensors of the input's shape.
"""

from __future__ import annotations

import torch

from ._checks import check_dtype, check_tensor
from ._runtime import compute_dtype, register_cuda_loader

torch.library.define("cutlass_ext::softmax", "(Tensor x, int dim, float scale) -> Tensor")
torch.library.define("cutlass_ext::_softmax_backward", "(Tensor grad, Tensor y, int dim, float scale) -> Tensor")


# ------------------------------------------------------------------------------------------------
# softmax


def _softmax_reference(x, dim, scale):
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    z = x.to(compute_dtype(x.dtype)) * scale
    row_max = z.amax(dim, keepdim=True)  # NaN if the row has one
    # An all -inf row: exponentials against 0 are all 0, their sum is 0, and the row is zeros.
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(z - shift)
    total = e.sum(dim, keepdim=True)
    y = torch.where(total == 0, torch.zeros_like(e), e / total)
    return y.to(x.dtype).contiguous()


@torch.library.register_fake("cutlass_ext::softmax")
def _softmax_fake(x, dim, scale):
    return x.new_empty(x.shape)


@torch.library.impl("cutlass_ext::softmax", "cpu")
def _softmax_cpu(x, dim, scale):
    return _softmax_reference(x, dim, scale)


register_cuda_loader("softmax", _softmax_reference)


# The backward needs only the output: dx = scale * y * (dy - sum(dy * y)). x is not saved.
# CUDA tensors, once the extension is loaded, use the C++ twin in csrc/bindings/autograd.cpp.
def _softmax_setup_context(ctx, inputs, output):
    _, dim, scale = inputs
    ctx.dim = dim
    ctx.scale = scale
    ctx.save_for_backward(output)


def _softmax_autograd_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return torch.ops.cutlass_ext._softmax_backward(grad, y, ctx.dim, ctx.scale), None, None


torch.library.register_autograd(
    "cutlass_ext::softmax", _softmax_autograd_backward, setup_context=_softmax_setup_context
)


# ------------------------------------------------------------------------------------------------
# _softmax_backward: dx = scale * y * (dy - sum(dy * y) along dim), one fused pass per row.


def _softmax_backward_reference(grad, y, dim, scale):
    ct = compute_dtype(y.dtype)
    g, o = grad.to(ct), y.to(ct)
    dot = (g * o).sum(dim, keepdim=True)
    return (scale * o * (g - dot)).to(y.dtype).contiguous()


@torch.library.register_fake("cutlass_ext::_softmax_backward")
def _softmax_backward_fake(grad, y, dim, scale):
    return y.new_empty(y.shape)


@torch.library.impl("cutlass_ext::_softmax_backward", "cpu")
def _softmax_backward_cpu(grad, y, dim, scale):
    return _softmax_backward_reference(grad, y, dim, scale)


register_cuda_loader("_softmax_backward", _softmax_backward_reference)


# ------------------------------------------------------------------------------------------------
# Public function


def _check_softmax_args(x, dim, scale) -> None:
    op = "softmax"
    check_tensor(x, "x", op)
    check_dtype(x, "x", op)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"cutlass_ext.{op}: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"cutlass_ext.{op}: dim={dim} is out of range for x with {x.dim()} dimensions; "
            f"use a value in [{-ndim}, {ndim - 1}] (-1 is the last dimension)"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"cutlass_ext.{op}: scale must be a Python float, got {type(scale).__name__}; "
            "pass float(value) for a 0-d tensor"
        )


def softmax(x, dim=-1, *, scale=1.0):
    """``softmax(scale * x)`` along ``dim``: ``y = exp(z - max z) / sum(exp(z - max z))``, ``z = scale * x``.

    x: any shape, float16/bfloat16/float32, any strides; math in fp32. Returns a contiguous tensor
    of x's shape and dtype. ``scale`` may be negative or zero. ``-inf`` entries get 0, a row that
    is all ``-inf`` gives zeros (torch.softmax gives NaN), a NaN makes its row NaN. Differentiable
    in x (the backward uses the output only).
    """
    _check_softmax_args(x, dim, scale)
    return torch.ops.cutlass_ext.softmax(x, dim, float(scale))
