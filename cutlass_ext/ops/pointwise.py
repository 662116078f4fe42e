"""Pointwise and reduction op family: fused bias + scale + residual + activation, sum over
dimensions, and elementwise add.

Schemas, fake kernels, autograd and the CPU reference live here; the CUDA kernels come from the
compiled extension (csrc/bindings/pointwise.cpp), which registers them when it loads on first CUDA use.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _activation
from ._checks import check_dtype, check_pair, check_tensor, check_vector
from ._runtime import compute_dtype, register_cuda_loader

torch.library.define(
    "cutlass_ext::bias_act",
    "(Tensor x, Tensor? bias, str activation, float scale, Tensor? residual) -> Tensor",
)
torch.library.define(
    "cutlass_ext::_bias_act_backward",
    "(Tensor grad, Tensor x, Tensor? bias, Tensor? residual, str activation, float scale, bool need_x, "
    "bool need_bias, bool need_residual) -> (Tensor, Tensor, Tensor)",
)
torch.library.define(
    "cutlass_ext::_bias_relu_masked",
    "(Tensor x, Tensor? bias, float scale, Tensor? residual) -> (Tensor, Tensor)",
)
torch.library.define(
    "cutlass_ext::_bias_relu_mask_backward",
    "(Tensor grad, Tensor mask, float scale, bool need_x, bool need_bias, bool need_residual) -> (Tensor, Tensor, Tensor)",
)
torch.library.define("cutlass_ext::sum", "(Tensor x, int[] dim, bool keepdim) -> Tensor")
torch.library.define("cutlass_ext::add", "(Tensor a, Tensor b) -> Tensor")


def _new(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous copy of ``t`` in ``dtype`` (an op's output may not alias its inputs)."""
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    return out.copy_(t)


# ------------------------------------------------------------------------------------------------
# bias_act: y = act(scale * x + bias + residual)


def _preactivation(x, bias, residual, scale):
    ct = compute_dtype(x.dtype)
    z = x.to(ct) * scale
    if bias is not None:
        z = z + bias.to(ct)
    if residual is not None:
        z = z + residual.to(ct)
    return z


def _bias_act_reference(x, bias, activation, scale, residual):
    return _new(_activation.apply(_preactivation(x, bias, residual, scale), activation), x.dtype)


@torch.library.register_fake("cutlass_ext::bias_act")
def _bias_act_fake(x, bias, activation, scale, residual):
    return x.new_empty(x.shape)


@torch.library.impl("cutlass_ext::bias_act", "cpu")
def _bias_act_cpu(x, bias, activation, scale, residual):
    return _bias_act_reference(x, bias, activation, scale, residual)


register_cuda_loader("bias_act", _bias_act_reference)


# _bias_act_backward: one pass recomputes z, dz = dy * act'(z), writes dx = scale * dz and/or
# dresidual = dz and reduces dbias = sum of dz over rows. Results not requested are empty tensors.


def _bias_act_backward_shapes(x, need_x, need_bias, need_residual):
    return (x.shape if need_x else (0,), (x.shape[-1],) if need_bias else (0,), x.shape if need_residual else (0,))


def _bias_act_backward_reference(grad, x, bias, residual, activation, scale, need_x, need_bias, need_residual):
    ct = compute_dtype(x.dtype)
    z = _preactivation(x, bias, residual, scale) if activation != "none" else None
    dz = _activation.backward(grad.to(ct), z, activation)
    grad_x = _new(dz * scale, x.dtype) if need_x else x.new_empty(0)
    grad_bias = _new(dz.reshape(-1, x.shape[-1]).sum(0), x.dtype) if need_bias else x.new_empty(0)
    grad_residual = _new(dz, x.dtype) if need_residual else x.new_empty(0)
    return grad_x, grad_bias, grad_residual


@torch.library.register_fake("cutlass_ext::_bias_act_backward")
def _bias_act_backward_fake(grad, x, bias, residual, activation, scale, need_x, need_bias, need_residual):
    return tuple(x.new_empty(s) for s in _bias_act_backward_shapes(x, need_x, need_bias, need_residual))


@torch.library.impl("cutlass_ext::_bias_act_backward", "cpu")
def _bias_act_backward_cpu(*args):
    return _bias_act_backward_reference(*args)


register_cuda_loader("_bias_act_backward", _bias_act_backward_reference)


# CUDA tensors, once the extension is loaded, use the C++ twin in csrc/bindings/autograd.cpp.
def _bias_act_setup_context(ctx, inputs, output):
    x, bias, activation, scale, residual = inputs
    ctx.activation = activation
    ctx.scale = scale
    ctx.save_for_backward(x, bias, residual)


def _bias_act_backward(ctx, grad):
    x, bias, residual = ctx.saved_tensors
    need_x, need_bias, _, _, need_residual = ctx.needs_input_grad
    need_bias = need_bias and bias is not None
    need_residual = need_residual and residual is not None
    if not (need_x or need_bias or need_residual):
        return None, None, None, None, None
    grad_x, grad_bias, grad_residual = torch.ops.cutlass_ext._bias_act_backward(
        grad, x, bias, residual, ctx.activation, ctx.scale, need_x, need_bias, need_residual
    )
    return (
        grad_x if need_x else None,
        grad_bias if need_bias else None,
        None,
        None,
        grad_residual if need_residual else None,
    )


torch.library.register_autograd("cutlass_ext::bias_act", _bias_act_backward, setup_context=_bias_act_setup_context)


# _bias_relu_masked: relu's forward when a backward will follow. Beside y it returns the backward's
# mask, one bit an element (z > 0), so that the backward reads dy and 1/8 byte an element instead
# of x (and the residual): an fp32 forward+backward moves 16.25 bytes an element, not 20, and a
# 16-bit one 8.25, not 10. The mask is int32 words over y's elements in row-major order: bit
# e % 32 of word e // 32 (the unused bits of the last word are 0). bias_act takes this op for relu
# when x, bias or residual requires grad and rows are at most MAX_MASK_COLS long.

MAX_MASK_COLS = 1 << 26  # csrc/elementwise/pointwise_kernels.h: kMaxMaskCols


def mask_words(numel):
    return (numel + 31) // 32


def _pack_mask(positive: torch.Tensor) -> torch.Tensor:
    flat = positive.reshape(-1)
    words = mask_words(flat.numel())
    bits = torch.zeros(words * 32, dtype=torch.int64, device=flat.device)
    bits[: flat.numel()] = flat.to(torch.int64)
    w = (bits.view(words, 32) << torch.arange(32, device=flat.device)).sum(1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _unpack_mask(mask: torch.Tensor, shape) -> torch.Tensor:
    bits = (mask.to(torch.int64).unsqueeze(1) >> torch.arange(32, device=mask.device)) & 1
    return bits.reshape(-1)[: math.prod(shape)].reshape(shape).bool()


def _bias_relu_masked_reference(x, bias, scale, residual):
    z = _preactivation(x, bias, residual, scale)
    return _new(_activation.apply(z, "relu"), x.dtype), _pack_mask(z > 0)


@torch.library.register_fake("cutlass_ext::_bias_relu_masked")
def _bias_relu_masked_fake(x, bias, scale, residual):
    return x.new_empty(x.shape), x.new_empty((mask_words(x.numel()),), dtype=torch.int32)


@torch.library.impl("cutlass_ext::_bias_relu_masked", "cpu")
def _bias_relu_masked_cpu(x, bias, scale, residual):
    return _bias_relu_masked_reference(x, bias, scale, residual)


register_cuda_loader("_bias_relu_masked", _bias_relu_masked_reference)


def _check_mask(grad, mask):
    if mask.dtype != torch.int32 or mask.shape != (mask_words(grad.numel()),) or mask.device != grad.device:
        raise ValueError(
            f"cutlass_ext._bias_relu_mask_backward: mask must be the int32 [{mask_words(grad.numel())}] tensor "
            f"_bias_relu_masked returned for grad's shape, on grad's device; got {mask.dtype} {tuple(mask.shape)}"
        )


def _bias_relu_mask_backward_reference(grad, mask, scale, need_x, need_bias, need_residual):
    _check_mask(grad, mask)
    dz = torch.where(_unpack_mask(mask, grad.shape), grad.to(compute_dtype(grad.dtype)), 0)
    grad_x = _new(dz * scale, grad.dtype) if need_x else grad.new_empty(0)
    grad_bias = _new(dz.reshape(-1, grad.shape[-1]).sum(0), grad.dtype) if need_bias else grad.new_empty(0)
    grad_residual = _new(dz, grad.dtype) if need_residual else grad.new_empty(0)
    return grad_x, grad_bias, grad_residual


@torch.library.register_fake("cutlass_ext::_bias_relu_mask_backward")
def _bias_relu_mask_backward_fake(grad, mask, scale, need_x, need_bias, need_residual):
    return tuple(grad.new_empty(s) for s in _bias_act_backward_shapes(grad, need_x, need_bias, need_residual))


@torch.library.impl("cutlass_ext::_bias_relu_mask_backward", "cpu")
def _bias_relu_mask_backward_cpu(*args):
    return _bias_relu_mask_backward_reference(*args)


register_cuda_loader("_bias_relu_mask_backward", _bias_relu_mask_backward_reference)


# CUDA tensors, once the extension is loaded, use the C++ twin in csrc/bindings/autograd.cpp.
def _bias_relu_masked_setup_context(ctx, inputs, output):
    _, bias, scale, residual = inputs
    _, mask = output
    ctx.mark_non_differentiable(mask)
    ctx.set_materialize_grads(False)
    ctx.scale = scale
    ctx.has_bias = bias is not None
    ctx.has_residual = residual is not None
    ctx.save_for_backward(mask)


def _bias_relu_masked_backward(ctx, grad, grad_mask):
    need_x, need_bias, _, need_residual = ctx.needs_input_grad
    need_bias = need_bias and ctx.has_bias
    need_residual = need_residual and ctx.has_residual
    if grad is None or not (need_x or need_bias or need_residual):
        return None, None, None, None
    (mask,) = ctx.saved_tensors
    grad_x, grad_bias, grad_residual = torch.ops.cutlass_ext._bias_relu_mask_backward(
        grad, mask, ctx.scale, need_x, need_bias, need_residual
    )
    return (
        grad_x if need_x else None,
        grad_bias if need_bias else None,
        None,
        grad_residual if need_residual else None,
    )


torch.library.register_autograd(
    "cutlass_ext::_bias_relu_masked", _bias_relu_masked_backward, setup_context=_bias_relu_masked_setup_context
)


def _takes_mask(x, bias, residual) -> bool:
    """Whether relu's forward saves its mask: grad mode is on, an input requires grad, and rows
    are short enough for the masked kernel."""
    if not torch.is_grad_enabled() or x.shape[-1] > MAX_MASK_COLS:
        return False
    return any(t is not None and t.requires_grad for t in (x, bias, residual))


def check_bias_act_args(x, bias, scale, residual) -> None:
    op = "bias_act"
    check_tensor(x, "x", op)
    check_dtype(x, "x", op)
    if x.dim() < 1:
        raise ValueError(f"cutlass_ext.{op}: x must have at least 1 dimension [..., C], got a 0-d tensor")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"cutlass_ext.{op}: scale must be a Python number, got {type(scale).__name__}")
    if bias is not None:
        check_vector(x, "x", bias, "bias", x.shape[-1], "C (x's last dimension)", op)
    if residual is not None:
        check_tensor(residual, "residual", op)
        check_pair(x, "x", residual, "residual", op)
        if residual.shape != x.shape:
            raise ValueError(
                f"cutlass_ext.{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )


def bias_act(x, bias=None, activation="relu", *, scale=1.0, residual=None):
    """``act(scale * x + bias + residual)`` in one pass over the data.

    x: ``[..., C]``; bias: ``[C]`` (broadcast over rows) or None; residual: x's shape or None.
    dtypes float16/bfloat16/float32 (all three tensors alike), fp32 math. ``activation`` is None,
    "none", "relu", "gelu", "gelu_tanh", "silu" or "sigmoid". Returns a contiguous tensor of x's
    shape and dtype. Differentiable in x, bias and residual. When a gradient will be needed, relu
    saves one bit an element for its backward in place of x, bias and residual.
    """
    act = _activation.resolve(False, activation, "bias_act")
    check_bias_act_args(x, bias, scale, residual)
    if act == "relu" and _takes_mask(x, bias, residual):
        return torch.ops.cutlass_ext._bias_relu_masked(x, bias, float(scale), residual)[0]
    return torch.ops.cutlass_ext.bias_act(x, bias, act, float(scale), residual)


# ------------------------------------------------------------------------------------------------
# sum


def _normalize_dims(dims, ndim: int, op: str = "sum") -> list[int]:
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise IndexError(f"cutlass_ext.{op}: dim {d} is out of range for a {ndim}-D tensor")
        d = d % ndim
        if d in out:
            raise ValueError(f"cutlass_ext.{op}: dim lists dimension {d} twice; name each dimension once")
        out.append(d)
    if not out:
        raise ValueError(f"cutlass_ext.{op}: dim must name at least one dimension")
    return sorted(out)


def _sum_shape(shape, dims, keepdim):
    return [1 if d in dims else s for d, s in enumerate(shape)] if keepdim else [
        s for d, s in enumerate(shape) if d not in dims
    ]


def _sum_reference(x, dim, keepdim):
    dims = _normalize_dims(dim, x.dim())
    return _new(x.to(compute_dtype(x.dtype)).sum(dims, keepdim=keepdim), x.dtype)


@torch.library.register_fake("cutlass_ext::sum")
def _sum_fake(x, dim, keepdim):
    return x.new_empty(_sum_shape(x.shape, _normalize_dims(dim, x.dim()), keepdim))


@torch.library.impl("cutlass_ext::sum", "cpu")
def _sum_cpu(x, dim, keepdim):
    return _sum_reference(x, dim, keepdim)


register_cuda_loader("sum", _sum_reference)


def _sum_setup_context(ctx, inputs, output):
    x, dim, keepdim = inputs
    ctx.shape = x.shape
    ctx.dims = _normalize_dims(dim, x.dim())
    ctx.keepdim = keepdim


def _sum_backward(ctx, grad):
    if not ctx.keepdim:
        for d in ctx.dims:  # ascending, so each lands at its original position
            grad = grad.unsqueeze(d)
    return grad.expand(ctx.shape), None, None


torch.library.register_autograd("cutlass_ext::sum", _sum_backward, setup_context=_sum_setup_context)


def sum(x, dim, keepdim=False):  # noqa: A001  (mirrors torch.sum)
    """Sum of ``x`` over ``dim`` (an int or a list/tuple of distinct ints, negative allowed).

    x: any shape with at least 1 dimension, float16/bfloat16/float32; fp32 accumulation, result
    in x's dtype with the reduced dimensions removed (or kept as size 1 with ``keepdim=True``).
    Deterministic. Differentiable in x.
    """
    op = "sum"
    check_tensor(x, "x", op)
    check_dtype(x, "x", op)
    if x.dim() < 1:
        raise ValueError(f"cutlass_ext.{op}: x must have at least 1 dimension, got a 0-d tensor")
    dims = [dim] if isinstance(dim, int) else dim
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"cutlass_ext.{op}: dim must be an int or a list/tuple of ints, got {dim!r}")
    return torch.ops.cutlass_ext.sum(x, _normalize_dims(dims, x.dim()), bool(keepdim))


# ------------------------------------------------------------------------------------------------
# add


def _add_reference(a, b):
    ct = compute_dtype(a.dtype)
    return _new(a.to(ct) + b.to(ct), a.dtype)


@torch.library.register_fake("cutlass_ext::add")
def _add_fake(a, b):
    return a.new_empty(a.shape)


@torch.library.impl("cutlass_ext::add", "cpu")
def _add_cpu(a, b):
    return _add_reference(a, b)


register_cuda_loader("add", _add_reference)


def _add_backward(ctx, grad):
    need_a, need_b = ctx.needs_input_grad
    return grad if need_a else None, grad if need_b else None


def _add_setup_context(ctx, inputs, output):
    pass  # the backward needs nothing saved


torch.library.register_autograd("cutlass_ext::add", _add_backward, setup_context=_add_setup_context)


def add(a, b):
    """``a + b`` elementwise (fp32 math), vectorized where the inputs allow it.

    a, b: the same shape and dtype (float16/bfloat16/float32; no broadcasting). Returns a
    contiguous tensor of that shape and dtype. Differentiable in a and b.
    """
    op = "add"
    check_tensor(a, "a", op)
    check_tensor(b, "b", op)
    check_dtype(a, "a", op)
    check_pair(a, "a", b, "b", op)
    if a.shape != b.shape:
        raise ValueError(
            f"cutlass_ext.{op}: b has shape {tuple(b.shape)} but a has {tuple(a.shape)}; "
            "the shapes must match (expand b explicitly to broadcast)"
        )
    return torch.ops.cutlass_ext.add(a, b)


