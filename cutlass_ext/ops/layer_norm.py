"""LayerNorm op family: dropout(LayerNorm(relu(x))) over the last dimension in one pass, and its
backward (dx, dweight, dbias in one call).

Schemas, fake kernels, autograd and the CPU reference live here; the CUDA kernels come from the
compiled extension (csrc/bindings/layer_norm.cpp). Dropout masks come from the counter-based RNG of
csrc/common/counter_rng.h (Python twin: ``_rng``): element (r, c) of the [rows, C] view is kept iff
its draw under ``seed`` passes, so the backward regenerates the mask instead of storing it.
"""

from __future__ import annotations

import math

import torch

from . import _rng
from ._checks import SUPPORTED_DTYPES, check_dtype, check_tensor, check_vector, vector_fits
from ._runtime import compute_dtype, register_cuda_loader

torch.library.define(
    "cutlass_ext::layer_norm",
    "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool relu, float dropout_p, Tensor? seed) "
    "-> (Tensor y, Tensor mean, Tensor rstd)",
)
torch.library.define(
    "cutlass_ext::_layer_norm_backward",
    "(Tensor grad, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool relu, float dropout_p, Tensor? seed, "
    "bool need_x, bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor)",
)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _dropout(v, seed, p):
    """Dropout of a [rows, C] matrix with the kernels' mask: kept values times 1/(1-p)."""
    keep = _rng.dropout_keep(seed, _rng.row_major_index(v.shape[0], v.shape[1], v.device), p)
    return torch.where(keep, v * _rng.keep_scale(p), torch.zeros((), dtype=v.dtype, device=v.device))


# ------------------------------------------------------------------------------------------------
# layer_norm: (y, mean, rstd); mean and rstd are fp32 [rows], saved for the backward.


def _layer_norm_reference(x, weight, bias, eps, relu, dropout_p, seed):
    ct = compute_dtype(x.dtype)
    h = x.reshape(-1, x.shape[-1]).to(ct, memory_format=torch.contiguous_format)
    if relu:
        h = torch.relu(h)
    mean = h.mean(-1, keepdim=True)
    rstd = torch.rsqrt((h - mean).square().mean(-1, keepdim=True) + eps)
    y = (h - mean) * rstd
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    if dropout_p > 0:
        y = _dropout(y, seed, dropout_p)
    return y.to(x.dtype).contiguous().reshape(x.shape), mean.reshape(-1).float(), rstd.reshape(-1).float()


@torch.library.register_fake("cutlass_ext::layer_norm")
def _layer_norm_fake(x, weight, bias, eps, relu, dropout_p, seed):
    rows = _rows(x)
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


@torch.library.impl("cutlass_ext::layer_norm", "cpu")
def _layer_norm_cpu(x, weight, bias, eps, relu, dropout_p, seed):
    return _layer_norm_reference(x, weight, bias, eps, relu, dropout_p, seed)


register_cuda_loader("layer_norm", _layer_norm_reference)


# CUDA tensors, once the extension is loaded, use the C++ twin in csrc/bindings/autograd.cpp.
def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, eps, relu, dropout_p, seed = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # mean and rstd never have a gradient: don't build zeros for them
    ctx.relu = relu
    ctx.dropout_p = dropout_p
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, mean, rstd, seed)


def _layer_norm_backward(ctx, grad_y, grad_mean, grad_rstd):
    if grad_y is None:
        return None, None, None, None, None, None, None
    x, weight, mean, rstd, seed = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    need_weight = ctx.needs_input_grad[1] and weight is not None
    need_bias = ctx.needs_input_grad[2] and ctx.has_bias
    dx, dweight, dbias = torch.ops.cutlass_ext._layer_norm_backward(
        grad_y, x, weight, mean, rstd, ctx.relu, ctx.dropout_p, seed, need_x, need_weight, need_bias
    )
    return (dx if need_x else None, dweight if need_weight else None, dbias if need_bias else None,
            None, None, None, None)


torch.library.register_autograd(
    "cutlass_ext::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup_context
)


# ------------------------------------------------------------------------------------------------
# _layer_norm_backward: with g = dropout'(grad), xhat = (relu(x) - mean) * rstd, dxhat = g * weight:
# dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) * (x > 0 if relu),
# dweight = sum over rows of g * xhat, dbias = sum over rows of g. Results not requested are empty.


def _layer_norm_backward_reference(grad, x, weight, mean, rstd, relu, dropout_p, seed, need_x, need_weight,
                                   need_bias):
    ct = compute_dtype(x.dtype)
    cols = x.shape[-1]
    x2 = x.reshape(-1, cols).to(ct, memory_format=torch.contiguous_format)
    g = grad.reshape(-1, cols).to(ct)
    if dropout_p > 0:
        g = _dropout(g, seed, dropout_p)
    h = torch.relu(x2) if relu else x2
    xhat = (h - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
    empty = x.new_empty(0)
    dx = empty
    if need_x:
        dxhat = g * weight.to(ct) if weight is not None else g
        a = dxhat.mean(-1, keepdim=True)
        b = (dxhat * xhat).mean(-1, keepdim=True)
        dx2 = rstd.to(ct)[:, None] * (dxhat - a - xhat * b)
        if relu:
            dx2 = torch.where(x2 > 0, dx2, torch.zeros((), dtype=ct, device=x.device))
        dx = dx2.to(x.dtype).contiguous().reshape(x.shape)
    dweight = (g * xhat).sum(0).to(x.dtype) if need_weight else empty.clone()
    dbias = g.sum(0).to(x.dtype) if need_bias else empty.clone()
    return dx, dweight, dbias


@torch.library.register_fake("cutlass_ext::_layer_norm_backward")
def _layer_norm_backward_fake(grad, x, weight, mean, rstd, relu, dropout_p, seed, need_x, need_weight, need_bias):
    cols = x.shape[-1]
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            x.new_empty((cols,)) if need_weight else x.new_empty(0),
            x.new_empty((cols,)) if need_bias else x.new_empty(0))


@torch.library.impl("cutlass_ext::_layer_norm_backward", "cpu")
def _layer_norm_backward_cpu(*args):
    return _layer_norm_backward_reference(*args)


register_cuda_loader("_layer_norm_backward", _layer_norm_backward_reference)


# ------------------------------------------------------------------------------------------------
# Public function


def _layer_norm_args_ok(x, weight, bias, eps, dropout_p) -> bool:
    """The common valid call in a few attribute reads; the checks below, which name what is wrong,
    run only when this is False."""
    try:
        dtype, device, cols = x.dtype, x.device, x.shape[-1]
        return (dtype in SUPPORTED_DTYPES and cols >= 1 and eps >= 0 and 0.0 <= dropout_p <= 1.0
                and (weight is None or vector_fits(weight, dtype, cols, device))
                and (bias is None or vector_fits(bias, dtype, cols, device)))
    except (AttributeError, IndexError, TypeError):  # not tensors, a 0-d x, a non-number eps
        return False


def check_layer_norm_args(x, weight, bias, eps, dropout_p, op: str = "layer_norm") -> None:
    if _layer_norm_args_ok(x, weight, bias, eps, dropout_p):
        return
    check_tensor(x, "x", op)
    check_dtype(x, "x", op)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"cutlass_ext.{op}: x must have shape [..., C] with C >= 1 (normalized over the last dimension), "
            f"got {tuple(x.shape)}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_vector(x, "x", t, name, x.shape[-1], "C (x's last dimension)", op)
    if not eps >= 0:
        raise ValueError(f"cutlass_ext.{op}: eps must be >= 0, got {eps}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"cutlass_ext.{op}: dropout_p must be in [0, 1], got {dropout_p}")


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, relu=False, dropout_p=0.0, training=True):
    """``dropout(LayerNorm(relu(x)) * weight + bias)`` over the last dimension, in one pass.

    x: ``[..., C]``, any strides; weight, bias: ``[C]`` in x's dtype, or None. dtypes float16,
    bfloat16, float32; statistics in fp32. ``relu`` applies ReLU before normalizing. Dropout (when
    ``training`` and ``dropout_p > 0``) zeroes each element with probability ``dropout_p`` and scales
    the rest by ``1 / (1 - dropout_p)``; its seed is drawn from torch's generator, so
    ``torch.manual_seed`` reproduces the mask and every CUDA-graph replay draws a new one. Returns a
    contiguous ``[..., C]`` tensor in x's dtype. Differentiable in x, weight and bias.
    """
    dropout_p = float(dropout_p)
    check_layer_norm_args(x, weight, bias, eps, dropout_p)
    p = dropout_p if training else 0.0
    seed = None
    if p > 0:
        seed = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=x.device)
    y, _, _ = torch.ops.cutlass_ext.layer_norm(x, weight, bias, float(eps), bool(relu), p, seed)
    return y
