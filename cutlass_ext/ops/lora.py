"""LoRA op family: a linear layer with a low-rank adapter (frozen base GEMM, adapter GEMMs, bias,
activation and input dropout in one op), its backward, and the in-place adapter merge.

    t = drop(x) @ A^T            z = x @ W^T + bias + scaling * t @ B^T            y = act(z)

The op's second output is t transposed, a contiguous [r, rows] tensor (rows = x.numel() // in): the
adapter products that make and read it have r rows, which the GEMM's small-M kernels serve best.

Schemas, fake kernels, autograd and the CPU reference live here; the CUDA kernels come from the
compiled extension (csrc/bindings/lora.cpp), which registers them when it loads on first CUDA use.

Dropout is keyed by the counter-based RNG of ops/_rng.py: element i of x (flat row-major index over
x's logical shape [..., in]) is kept under the int64 ``seed`` iff ``_rng.dropout_keep`` says so, and
kept elements are scaled by 1 / (1 - p). The backward regenerates the same mask from the seed instead
of saving it.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _activation, _rng
from ._checks import check_dtype, check_pair, check_tensor, check_vector
from ._runtime import compute_dtype, register_cuda_loader

torch.library.define(
    "cutlass_ext::lora_linear",
    "(Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, Tensor? bias, float scaling, str activation, "
    "float dropout_p, Tensor? seed, bool save_preact) -> (Tensor y, Tensor t, Tensor preact)",
)
torch.library.define(
    "cutlass_ext::_lora_linear_backward",
    "(Tensor grad, Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, Tensor t, Tensor? saved, "
    "str activation, float scaling, float dropout_p, Tensor? seed, bool need_x, bool need_weight, bool need_A, "
    "bool need_B, bool need_bias) -> (Tensor dx, Tensor dweight, Tensor dA, Tensor dB, Tensor dbias)",
)
torch.library.define(
    "cutlass_ext::lora_merge",
    "(Tensor(a!) weight, Tensor lora_A, Tensor lora_B, float scaling) -> ()",
)


# ------------------------------------------------------------------------------------------------
# Argument checks (messages name the argument and the fix)


def _check_factors(weight, lora_A, lora_B, op: str) -> None:
    """weight [out, in], lora_A [r, in], lora_B [out, r], one dtype and device."""
    for t, name in ((weight, "weight"), (lora_A, "lora_A"), (lora_B, "lora_B")):
        check_tensor(t, name, op)
    check_dtype(weight, "weight", op)
    check_pair(weight, "weight", lora_A, "lora_A", op)
    check_pair(weight, "weight", lora_B, "lora_B", op)
    if weight.dim() != 2:
        raise ValueError(
            f"cutlass_ext.{op}: weight must be 2-D [out_features, in_features] (an nn.Linear weight), "
            f"got shape {tuple(weight.shape)}"
        )
    out_f, in_f = weight.shape
    if lora_A.dim() != 2 or lora_A.shape[1] != in_f or lora_A.shape[0] < 1:
        raise ValueError(
            f"cutlass_ext.{op}: lora_A must be [r, in_features] = [r, {in_f}] with r >= 1 (weight is "
            f"[{out_f}, {in_f}]), got shape {tuple(lora_A.shape)}; pass the adapter's lora_A.weight, not its transpose"
        )
    r = lora_A.shape[0]
    if lora_B.dim() != 2 or tuple(lora_B.shape) != (out_f, r):
        raise ValueError(
            f"cutlass_ext.{op}: lora_B must be [out_features, r] = [{out_f}, {r}] (weight is [{out_f}, {in_f}], "
            f"lora_A is [{r}, {in_f}]), got shape {tuple(lora_B.shape)}; pass the adapter's lora_B.weight"
        )


def _check_scaling(scaling, op: str) -> None:
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(
            f"cutlass_ext.{op}: scaling must be a Python number (lora_alpha / r), got {type(scaling).__name__}"
        )


def check_lora_linear_args(x, weight, lora_A, lora_B, bias, scaling, dropout_p, op: str = "lora_linear") -> None:
    check_tensor(x, "x", op)
    check_dtype(x, "x", op)
    check_tensor(weight, "weight", op)
    check_pair(x, "x", weight, "weight", op)
    _check_factors(weight, lora_A, lora_B, op)
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"cutlass_ext.{op}: x must be [..., in_features] with in_features = {weight.shape[1]} "
            f"(weight is [{weight.shape[0]}, {weight.shape[1]}]), got shape {tuple(x.shape)}"
        )
    if bias is not None:
        check_vector(x, "x", bias, "bias", weight.shape[0], "out_features", op)
    _check_scaling(scaling, op)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"cutlass_ext.{op}: dropout_p must be a number in [0, 1], got {dropout_p!r}")


# ------------------------------------------------------------------------------------------------
# Dropout on x, keyed by flat row-major element index


def _drop(v: torch.Tensor, dropout_p: float, seed) -> torch.Tensor:
    """drop(v) for a tensor of x's logical shape (or any [rows, in] view of it): the mask of flat
    row-major element i under ``seed``, kept elements scaled by 1 / (1 - p)."""
    if dropout_p <= 0.0:
        return v
    if seed is None:
        raise ValueError(
            f"cutlass_ext.lora_linear: dropout_p={dropout_p} needs a seed (a [1] int64 tensor on x's device); "
            "cutlass_ext.lora_linear draws one when training=True"
        )
    index = torch.arange(v.numel(), device=v.device, dtype=torch.int64).view(v.shape)
    keep = _rng.dropout_keep(seed, index, dropout_p)
    return torch.where(keep, v * _rng.keep_scale(dropout_p), torch.zeros((), dtype=v.dtype, device=v.device))


# ------------------------------------------------------------------------------------------------
# lora_linear


def _lora_linear_reference(x, weight, lora_A, lora_B, bias, scaling, activation, dropout_p, seed, save_preact):
    ct = compute_dtype(x.dtype)
    xc = x.to(ct)
    t = torch.matmul(_drop(xc, dropout_p, seed), lora_A.to(ct).t())
    z = torch.matmul(xc, weight.to(ct).t()) + scaling * torch.matmul(t, lora_B.to(ct).t())
    if bias is not None:
        z = z + bias.to(ct)
    y = _activation.apply(z, activation).to(x.dtype).contiguous()
    preact = z.to(x.dtype).contiguous() if _activation.stores_preactivation(activation, save_preact) else x.new_empty(0)
    return y, t.reshape(-1, lora_A.shape[0]).t().to(x.dtype).contiguous(), preact


@torch.library.register_fake("cutlass_ext::lora_linear")
def _lora_linear_fake(x, weight, lora_A, lora_B, bias, scaling, activation, dropout_p, seed, save_preact):
    lead = x.shape[:-1]
    y_shape = (*lead, weight.shape[0])
    preact = x.new_empty(y_shape) if _activation.stores_preactivation(activation, save_preact) else x.new_empty(0)
    return x.new_empty(y_shape), x.new_empty((lora_A.shape[0], math.prod(lead))), preact


@torch.library.impl("cutlass_ext::lora_linear", "cpu")
def _lora_linear_cpu(*args):
    return _lora_linear_reference(*args)


register_cuda_loader("lora_linear", _lora_linear_reference)


# Autograd of lora_linear for CPU tensors and for CUDA calls made before the extension is loaded (once
# it is, CUDA tensors use LoraLinearAutograd in csrc/bindings/autograd.cpp, which mirrors these two
# functions in C++): the backward is one call of _lora_linear_backward.
def _lora_linear_setup_context(ctx, inputs, output):
    x, weight, lora_A, lora_B, bias, scaling, activation, dropout_p, seed, save_preact = inputs
    y, t, preact = output
    ctx.mark_non_differentiable(t, preact)
    ctx.set_materialize_grads(False)  # t and preact never have a gradient: don't build zeros for them
    saved = _activation.saved_for_backward(activation, y, preact, save_preact)
    ctx.activation = activation
    ctx.scaling = scaling
    ctx.dropout_p = dropout_p
    ctx.save_for_backward(x, weight, lora_A, lora_B, t, saved, seed)


def _lora_linear_autograd_backward(ctx, grad_y, grad_t, grad_preact):
    if grad_y is None:
        return (None,) * 10
    x, weight, lora_A, lora_B, t, saved, seed = ctx.saved_tensors
    activation = ctx.activation
    _activation.check_saved(activation, saved, "lora_linear")
    need_x, need_weight, need_A, need_B, need_bias = ctx.needs_input_grad[:5]
    grads = torch.ops.cutlass_ext._lora_linear_backward(
        grad_y, x, weight, lora_A, lora_B, t, saved, activation, ctx.scaling, ctx.dropout_p, seed,
        need_x, need_weight, need_A, need_B, need_bias,
    )
    needs = (need_x, need_weight, need_A, need_B, need_bias)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None)


torch.library.register_autograd(
    "cutlass_ext::lora_linear", _lora_linear_autograd_backward, setup_context=_lora_linear_setup_context
)


# _lora_linear_backward: dz = dy * act'(saved) (saved = y for relu, z for NEEDS_PREACTIVATION, None
# for none), t = lora_linear's second output ([r, rows]) and U = dz @ B; then
#   dx = dz @ W + drop'(scaling * U @ A)   dA = scaling * U^T @ drop(x)   dB = scaling * dz^T @ t
#   dweight = dz^T @ x                     dbias = sum of dz over rows
# each only when requested; results not requested are empty tensors.


def _lora_linear_backward_shapes(x, weight, lora_A, need_x, need_weight, need_A, need_B, need_bias):
    out_f, in_f = weight.shape
    r = lora_A.shape[0]
    return (
        x.shape if need_x else (0,),
        (out_f, in_f) if need_weight else (0,),
        (r, in_f) if need_A else (0,),
        (out_f, r) if need_B else (0,),
        (out_f,) if need_bias else (0,),
    )


def _lora_linear_backward_reference(grad, x, weight, lora_A, lora_B, t, saved, activation, scaling, dropout_p,
                                    seed, need_x, need_weight, need_A, need_B, need_bias):
    out_f, in_f = weight.shape
    r = lora_A.shape[0]
    ct = compute_dtype(x.dtype)
    dtype = x.dtype
    saved2 = saved.reshape(-1, out_f).to(ct) if saved is not None else None
    dz = _activation.backward(grad.reshape(-1, out_f).to(ct), saved2, activation)
    x2 = x.reshape(-1, in_f).to(ct)  # rows of x in flat row-major order, so the dropout index is unchanged
    if tuple(t.shape) != (r, x2.shape[0]):
        raise ValueError(f"_lora_linear_backward: t must be lora_linear's [{r}, {x2.shape[0]}] second output, "
                         f"got shape {tuple(t.shape)}")
    A, B = lora_A.to(ct), lora_B.to(ct)
    dx, dweight, dA, dB, dbias = (x.new_empty(0) for _ in range(5))
    if need_x or need_A:
        u = torch.matmul(dz, B)  # [rows, r]
    if need_x:
        d_lora = _drop(scaling * torch.matmul(u, A), dropout_p, seed)
        dx = (torch.matmul(dz, weight.to(ct)) + d_lora).to(dtype).reshape(x.shape).contiguous()
    if need_weight:
        dweight = torch.matmul(dz.t(), x2).to(dtype).contiguous()
    if need_A:
        dA = (scaling * torch.matmul(u.t(), _drop(x2, dropout_p, seed))).to(dtype).contiguous()
    if need_B:
        dB = (scaling * torch.matmul(dz.t(), t.t().to(ct))).to(dtype).contiguous()
    if need_bias:
        dbias = dz.sum(0).to(dtype).contiguous()
    return dx, dweight, dA, dB, dbias


@torch.library.register_fake("cutlass_ext::_lora_linear_backward")
def _lora_linear_backward_fake(grad, x, weight, lora_A, lora_B, t, saved, activation, scaling, dropout_p, seed,
                               need_x, need_weight, need_A, need_B, need_bias):
    shapes = _lora_linear_backward_shapes(x, weight, lora_A, need_x, need_weight, need_A, need_B, need_bias)
    return tuple(x.new_empty(s) for s in shapes)


@torch.library.impl("cutlass_ext::_lora_linear_backward", "cpu")
def _lora_linear_backward_cpu(*args):
    return _lora_linear_backward_reference(*args)


register_cuda_loader("_lora_linear_backward", _lora_linear_backward_reference)


def lora_linear(x, weight, lora_A, lora_B, bias=None, *, scaling, activation=None, dropout_p=0.0, training=True):
    """``act(x @ weight.T + bias + scaling * (drop(x) @ lora_A.T) @ lora_B.T)``: a frozen-or-not base
    linear with a LoRA adapter, in one op.

    x: ``[..., in]``; weight: ``[out, in]`` (an nn.Linear weight); lora_A: ``[r, in]``; lora_B:
    ``[out, r]``; bias: ``[out]`` or None; all one dtype (float16, bfloat16 or float32) and device.
    ``activation`` is None, "relu", "gelu", "gelu_tanh", "silu" or "sigmoid". ``drop`` is dropout with
    probability ``dropout_p`` on the adapter's input only, applied when ``training`` (a fresh seed per
    call; the backward regenerates the same mask). Returns ``[..., out]`` in x's dtype. Differentiable
    in x, weight, lora_A, lora_B and bias; only the gradients that are needed are computed.
    """
    act = _activation.resolve(False, activation, "lora_linear")
    check_lora_linear_args(x, weight, lora_A, lora_B, bias, scaling, dropout_p)
    p = float(dropout_p) if training else 0.0
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device) if p > 0.0 else None
    save_preact = _activation.wants_preactivation(act, x, weight, lora_A, lora_B, bias)
    y, _, _ = torch.ops.cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, float(scaling), act, p, seed,
                                                save_preact)
    return y


# ------------------------------------------------------------------------------------------------
# lora_merge: weight += scaling * lora_B @ lora_A in place, accumulated in fp32.


def _lora_merge_reference(weight, lora_A, lora_B, scaling):
    ct = compute_dtype(weight.dtype)
    delta = torch.matmul(lora_B.to(ct), lora_A.to(ct))
    weight.copy_((weight.to(ct) + scaling * delta).to(weight.dtype))


@torch.library.register_fake("cutlass_ext::lora_merge")
def _lora_merge_fake(weight, lora_A, lora_B, scaling):
    return None


@torch.library.impl("cutlass_ext::lora_merge", "cpu")
def _lora_merge_cpu(weight, lora_A, lora_B, scaling):
    _lora_merge_reference(weight, lora_A, lora_B, scaling)


register_cuda_loader("lora_merge", _lora_merge_reference)

_lib = torch.library.Library("cutlass_ext", "IMPL")


# The dispatcher does not bump the version counter of a Tensor(a!) argument by itself (a CUDA kernel
# writes through a raw pointer), so autograd could not tell a merged weight from the one it saved.
# This ADInplaceOrView kernel bumps it for every backend, as torch.library.custom_op does for its ops.
def _lora_merge_bump_version(keyset, weight, lora_A, lora_B, scaling):
    torch.autograd.graph.increment_version(weight)
    torch.ops.cutlass_ext.lora_merge.default.redispatch(
        keyset & torch._C._after_ADInplaceOrView_keyset, weight, lora_A, lora_B, scaling
    )


_lib.impl("lora_merge", _lora_merge_bump_version, "ADInplaceOrView", with_keyset=True)


def lora_merge(weight, lora_A, lora_B, scaling, *, sign=+1):
    """``weight += sign * scaling * lora_B @ lora_A`` in place (fp32 accumulation, one rounding to
    weight's dtype); returns ``weight``. ``sign=-1`` unmerges.

    weight: ``[out, in]``; lora_A: ``[r, in]``; lora_B: ``[out, r]``; one dtype (float16, bfloat16 or
    float32) and device. Not differentiable: it runs under ``torch.no_grad()``.
    """
    op = "lora_merge"
    _check_factors(weight, lora_A, lora_B, op)
    _check_scaling(scaling, op)
    if sign not in (1, -1):
        raise ValueError(f"cutlass_ext.{op}: sign must be +1 (merge) or -1 (unmerge), got {sign!r}")
    alpha = float(sign * scaling)
    if weight.is_cuda and _BELOW_AD_INPLACE is not None and not torch.compiler.is_compiling():
        _merge_below_autograd(weight, lora_A, lora_B, alpha)
    else:
        with torch.no_grad():
            torch.ops.cutlass_ext.lora_merge(weight, lora_A, lora_B, alpha)
    return weight


# The dispatcher's guard that skips the autograd and ADInplaceOrView keys (a private torch API: where
# a torch lacks it, every call takes the dispatcher's full path).
_BELOW_AD_INPLACE = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


def _merge_below_autograd(weight, lora_A, lora_B, alpha: float) -> None:
    """lora_merge's eager path: bumps the weight's version counter here, as the ADInplaceOrView
    kernel above would from a Python callback, and dispatches below that key and autograd's (no
    no_grad needed: nothing is recorded). 16.3 -> 11.9 us of host time a CUDA call on an H200's
    host (bench/NOTES.md section 60)."""
    torch.autograd.graph.increment_version(weight)
    with _BELOW_AD_INPLACE():
        torch.ops.cutlass_ext.lora_merge.default(weight, lora_A, lora_B, alpha)
