"""GEMM op family: fused linear (bias + activation epilogue), plain matmul, and the fused
activation-backward/bias-gradient op their backward passes use.

Schemas, fake kernels, autograd and the CPU reference live here; the CUDA kernels come from the
compiled extension (csrc/bindings/gemm.cpp), which registers them when it loads on first CUDA use.
"""

from __future__ import annotations

import torch

from . import _activation
from ._checks import SUPPORTED_DTYPES, check_config, check_dtype, check_pair, check_tensor, check_vector, vector_fits
from ._runtime import compute_dtype, register_cuda_loader

torch.library.define(
    "cutlass_ext::linear",
    "(Tensor a, Tensor b, Tensor? bias, str activation, bool save_preact, str? config=None) -> (Tensor, Tensor)",
)
torch.library.define(
    "cutlass_ext::_linear_backward",
    "(Tensor grad, Tensor a, Tensor b, Tensor? saved, str activation, bool need_grad_a, bool need_grad_b, "
    "bool need_grad_bias, bool grad_b_transposed) -> (Tensor, Tensor, Tensor)",
)
torch.library.define("cutlass_ext::matmul", "(Tensor a, Tensor b, str? config=None) -> Tensor")
torch.library.define(
    "cutlass_ext::_act_grad",
    "(Tensor grad, Tensor? saved, str activation, bool need_grad_input, bool need_grad_bias) -> (Tensor, Tensor)",
)


# ------------------------------------------------------------------------------------------------
# Argument checks (messages name the argument and the fix)


def _linear_args_ok(A, B, bias) -> bool:
    """The common valid call in a few attribute reads; the checks below, which name what is wrong,
    run only when this is False (5.9 -> 3.8 us a call with a bias, measured on a slow host CPU)."""
    try:
        dtype = A.dtype
        return (
            B.dtype is dtype and dtype in SUPPORTED_DTYPES and B.ndim == 2 and A.ndim >= 1
            and A.shape[-1] == B.shape[0] and A.device == B.device
            and (bias is None or vector_fits(bias, dtype, B.shape[1], A.device))
        )
    except AttributeError:  # not tensors: the checks say which argument
        return False


def check_linear_args(A, B, bias, op: str = "linear") -> None:
    if _linear_args_ok(A, B, bias):
        return
    check_tensor(A, "A", op)
    check_tensor(B, "B", op)
    check_dtype(A, "A", op)
    check_pair(A, "A", B, "B", op)
    if A.dim() < 1:
        raise ValueError(f"cutlass_ext.{op}: A must have at least 1 dimension [..., K], got a 0-d tensor")
    if B.dim() != 2:
        raise ValueError(
            f"cutlass_ext.{op}: B must be 2-D [K, N], got shape {tuple(B.shape)}; "
            "for an nn.Linear weight of shape [N, K] pass weight.t()"
        )
    if A.shape[-1] != B.shape[0]:
        raise ValueError(
            f"cutlass_ext.{op}: A's last dimension is K={A.shape[-1]} but B has {B.shape[0]} rows; "
            "B must be [K, N] (for an nn.Linear weight of shape [N, K] pass weight.t())"
        )
    if bias is not None:
        check_vector(A, "A", bias, "bias", B.shape[1], "N (B's columns)", op)


def check_matmul_args(A, B) -> None:
    op = "matmul"
    check_tensor(A, "A", op)
    check_tensor(B, "B", op)
    check_dtype(A, "A", op)
    check_pair(A, "A", B, "B", op)
    if A.dim() < 2 or B.dim() < 2:
        raise ValueError(
            f"cutlass_ext.{op}: A and B must have at least 2 dimensions ([..., M, K] and [..., K, N]), "
            f"got shapes {tuple(A.shape)} and {tuple(B.shape)}; unsqueeze vectors first"
        )
    if A.shape[-1] != B.shape[-2]:
        raise ValueError(
            f"cutlass_ext.{op}: A is [..., M, K] with K={A.shape[-1]} but B is [..., K, N] with "
            f"K={B.shape[-2]}"
        )
    batch_a, batch_b = A.shape[:-2], B.shape[:-2]
    if batch_a == batch_b or not batch_a or not batch_b:
        return  # the common cases, without torch.broadcast_shapes (~6 us of host time a call)
    try:
        torch.broadcast_shapes(batch_a, batch_b)
    except RuntimeError as exc:
        raise ValueError(
            f"cutlass_ext.{op}: batch dimensions {tuple(batch_a)} of A and {tuple(batch_b)} "
            "of B do not broadcast"
        ) from exc


# ------------------------------------------------------------------------------------------------
# linear


def _linear_reference(a, b, bias, activation, save_preact, config=None):
    ct = compute_dtype(a.dtype)
    z = torch.matmul(a.to(ct), b.to(ct))
    if bias is not None:
        z = z + bias.to(ct)
    y = _activation.apply(z, activation).to(a.dtype).contiguous()
    aux = z.to(a.dtype).contiguous() if _activation.stores_preactivation(activation, save_preact) else a.new_empty(0)
    return y, aux


@torch.library.register_fake("cutlass_ext::linear")
def _linear_fake(a, b, bias, activation, save_preact, config=None):
    shape = (*a.shape[:-1], b.shape[1])
    aux = a.new_empty(shape) if _activation.stores_preactivation(activation, save_preact) else a.new_empty(0)
    return a.new_empty(shape), aux


@torch.library.impl("cutlass_ext::linear", "cpu")
def _linear_cpu(a, b, bias, activation, save_preact, config=None):
    return _linear_reference(a, b, bias, activation, save_preact)


register_cuda_loader("linear", _linear_reference)


# Autograd of linear for CPU tensors and for CUDA calls made before the extension is loaded; once it
# is, CUDA tensors use LinearAutograd in csrc/bindings/autograd.cpp, which mirrors these two functions in C++.
def _linear_setup_context(ctx, inputs, output):
    a, b, bias, activation, save_preact, *_ = inputs
    y, aux = output
    ctx.mark_non_differentiable(aux)
    ctx.set_materialize_grads(False)  # aux never has a gradient: don't build zeros for it
    ctx.activation = activation
    ctx.save_for_backward(a, b, _activation.saved_for_backward(activation, y, aux, save_preact))


def _linear_backward(ctx, grad_y, grad_aux):
    if grad_y is None:
        return None, None, None, None, None, None
    a, b, saved = ctx.saved_tensors
    activation = ctx.activation
    _activation.check_saved(activation, saved, "linear")
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    # dB comes back in B's layout: transposed when B is the transpose of a row-major [N, K] weight.
    b_is_weight_t = b.stride(0) == 1 and b.stride(1) != 1
    grad_a, grad_b, grad_bias = torch.ops.cutlass_ext._linear_backward(
        grad_y, a, b, saved, activation, need_a, need_b, need_bias, b_is_weight_t
    )
    return grad_a if need_a else None, grad_b if need_b else None, grad_bias if need_bias else None, None, None, None


torch.library.register_autograd("cutlass_ext::linear", _linear_backward, setup_context=_linear_setup_context)


# _linear_backward: dZ = dY * act'(saved) and dbias = sum of dZ over rows (one fused pass), then
# dA = dZ B^T and dB = A^T dZ (two GEMMs), each only when requested; not-requested results are
# empty tensors. One op, so the whole backward is a single call into the extension.


def _linear_backward_reference(grad, a, b, saved, activation, need_grad_a, need_grad_b, need_grad_bias,
                               grad_b_transposed):
    k, n = b.shape
    grad2 = grad.reshape(-1, n)
    grad_z, grad_bias = grad2, grad.new_empty(0)
    if activation != "none" or need_grad_bias:
        saved2 = saved.reshape(-1, n) if saved is not None else None
        dz, db = _act_grad_reference(grad2, saved2, activation, need_grad_a or need_grad_b, need_grad_bias)
        grad_z = dz if activation != "none" else grad2
        grad_bias = db
    grad_a = _matmul_reference(grad_z, b.t()).view(a.shape) if need_grad_a else grad.new_empty(0)
    grad_b = grad.new_empty(0)
    if need_grad_b:
        a2 = a.reshape(-1, k)
        grad_b = _matmul_reference(grad_z.t(), a2).t() if grad_b_transposed else _matmul_reference(a2.t(), grad_z)
    return grad_a, grad_b, grad_bias


@torch.library.register_fake("cutlass_ext::_linear_backward")
def _linear_backward_fake(grad, a, b, saved, activation, need_grad_a, need_grad_b, need_grad_bias,
                          grad_b_transposed):
    k, n = b.shape
    grad_a = a.new_empty(a.shape) if need_grad_a else a.new_empty(0)
    grad_b = b.new_empty(0)
    if need_grad_b:
        grad_b = b.new_empty((n, k)).t() if grad_b_transposed else b.new_empty((k, n))
    grad_bias = grad.new_empty((n,)) if need_grad_bias else grad.new_empty(0)
    return grad_a, grad_b, grad_bias


@torch.library.impl("cutlass_ext::_linear_backward", "cpu")
def _linear_backward_cpu(*args):
    return _linear_backward_reference(*args)


register_cuda_loader("_linear_backward", _linear_backward_reference)


def linear(A, B, bias=None, relu=False, *, activation=None, config=None):
    """``act(A @ B + bias)`` in one GEMM with a fused epilogue.

    A: ``[..., K]``; B: ``[K, N]`` with any strides (a row-major ``[K, N]`` tensor or ``w.t()`` of an
    ``[N, K]`` weight, neither copied); bias: ``[N]`` or None. dtypes float16/bfloat16 (tensor cores,
    fp32 accumulation) or float32 (TF32 unless ``torch.get_float32_matmul_precision() ==
    "highest"``). ``activation`` is None, "relu", "gelu", "gelu_tanh", "silu" or "sigmoid"; ``relu=True`` is
    shorthand for "relu". Returns ``[..., N]`` in A's dtype. Differentiable in A, B and bias.

    ``config`` forces one GEMM config of the forward product by name (see
    ``python -m cutlass_ext.info``); None picks by the shape heuristic or the autotuned table
    (:func:`cutlass_ext.tune`). A config that is not built for the call's dtype and layouts raises.
    CPU tensors ignore it.
    """
    act = _activation.resolve(relu, activation, "linear")
    check_linear_args(A, B, bias)
    check_config(config, "linear")
    save_preact = _activation.wants_preactivation(act, A, B, bias)
    y, _ = torch.ops.cutlass_ext.linear(A, B, bias, act, save_preact, config)
    return y


# ------------------------------------------------------------------------------------------------
# matmul


def _matmul_reference(a, b, config=None):
    ct = compute_dtype(a.dtype)
    return torch.matmul(a.to(ct), b.to(ct)).to(a.dtype).contiguous()


@torch.library.register_fake("cutlass_ext::matmul")
def _matmul_fake(a, b, config=None):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]))


@torch.library.impl("cutlass_ext::matmul", "cpu")
def _matmul_cpu(a, b, config=None):
    return _matmul_reference(a, b)


register_cuda_loader("matmul", _matmul_reference)


def _matmul_setup_context(ctx, inputs, output):
    a, b = inputs[:2]
    ctx.save_for_backward(a, b)


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    mm = torch.ops.cutlass_ext.matmul
    grad_a = grad_b = None
    if need_a:
        grad_a = mm(grad, b.transpose(-1, -2)).sum_to_size(a.shape)
    if need_b:
        if b.dim() == 2:
            k, n = b.shape
            grad_b = mm(a.reshape(-1, k).t(), grad.reshape(-1, n))
        else:
            grad_b = mm(a.transpose(-1, -2), grad).sum_to_size(b.shape)
    return grad_a, grad_b, None


torch.library.register_autograd("cutlass_ext::matmul", _matmul_backward, setup_context=_matmul_setup_context)


def matmul(A, B, *, config=None):
    """``A @ B`` on tensor cores with the same dtype policy as :func:`linear`.

    A: ``[..., M, K]``; B: ``[K, N]`` or ``[..., K, N]`` with batch dimensions that broadcast.
    Any strides. Returns ``[..., M, N]`` in A's dtype. Differentiable in A and B.
    ``config`` forces a GEMM config of the forward product by name, as in :func:`linear`.
    """
    check_matmul_args(A, B)
    check_config(config, "matmul")
    return torch.ops.cutlass_ext.matmul(A, B, config)


# ------------------------------------------------------------------------------------------------
# _act_grad: dZ = dY * act'(saved) and dbias = sum over rows of dZ, in one pass.
# grad and saved are [M, N]. grad_input is returned only for activations other than "none"
# (for "none" it would equal grad, and an op output may not alias its input).


def _act_grad_shapes(grad, activation, need_grad_input, need_grad_bias):
    dz_shape = grad.shape if need_grad_input and activation != "none" else (0,)
    db_shape = (grad.shape[1],) if need_grad_bias else (0,)
    return dz_shape, db_shape


def _act_grad_reference(grad, saved, activation, need_grad_input, need_grad_bias):
    dz_shape, db_shape = _act_grad_shapes(grad, activation, need_grad_input, need_grad_bias)
    ct = compute_dtype(grad.dtype)
    dz = _activation.backward(grad.to(ct), saved.to(ct) if saved is not None else None, activation)
    grad_input = dz.to(grad.dtype).contiguous() if dz_shape != (0,) else grad.new_empty(0)
    grad_bias = dz.sum(0).to(grad.dtype) if db_shape != (0,) else grad.new_empty(0)
    return grad_input, grad_bias


@torch.library.register_fake("cutlass_ext::_act_grad")
def _act_grad_fake(grad, saved, activation, need_grad_input, need_grad_bias):
    dz_shape, db_shape = _act_grad_shapes(grad, activation, need_grad_input, need_grad_bias)
    return grad.new_empty(dz_shape), grad.new_empty(db_shape)


@torch.library.impl("cutlass_ext::_act_grad", "cpu")
def _act_grad_cpu(grad, saved, activation, need_grad_input, need_grad_bias):
    return _act_grad_reference(grad, saved, activation, need_grad_input, need_grad_bias)


register_cuda_loader("_act_grad", _act_grad_reference)
