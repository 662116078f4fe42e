"""Activation names, their integer codes for the CUDA kernels, and their PyTorch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Order defines the integer code passed to the kernels; csrc/common/activation.h lists the same
# names in the same order (a GPU test compares the two).
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid")
CODES = {name: code for code, name in enumerate(ACTIVATIONS)}

# Activations whose backward needs the pre-activation z (saved as an auxiliary GEMM output).
# relu's backward reads its output instead (y > 0 exactly where z > 0).
NEEDS_PREACTIVATION = frozenset({"gelu", "gelu_tanh", "silu", "sigmoid"})


def stores_preactivation(activation: str, save_preact: bool) -> bool:
    """Whether a GEMM op called with ``save_preact`` returns z as its auxiliary output."""
    return save_preact and activation in NEEDS_PREACTIVATION


def wants_preactivation(activation: str, *tensors) -> bool:
    """The ``save_preact`` a public function passes: z is kept only when a backward will need it."""
    if activation not in NEEDS_PREACTIVATION or not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any() over a generator: ~1 us less a call
        if t is not None and t.requires_grad:
            return True
    return False


def saved_for_backward(activation: str, y: torch.Tensor, preact: torch.Tensor, save_preact: bool):
    """What the backward of act reads (see :func:`backward`): y for relu, the stored z for the
    activations in NEEDS_PREACTIVATION (None when it was not stored), nothing otherwise."""
    if activation == "relu":
        return y
    if activation in NEEDS_PREACTIVATION and save_preact:
        return preact
    return None


def check_saved(activation: str, saved, op: str) -> None:
    """The backward of an op whose forward did not store the pre-activation it needs fails clearly."""
    if activation in NEEDS_PREACTIVATION and saved is None:
        raise RuntimeError(
            f"cutlass_ext.{op}: the backward of activation {activation!r} needs the pre-activation; "
            f"call the op with save_preact=True (cutlass_ext.{op} does this when grads are enabled)"
        )


def resolve(relu: bool, activation: str | None, op: str) -> str:
    """Maps the public (relu=..., activation=...) pair to one activation name."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(
            f"cutlass_ext.{op}: activation must be one of None, "
            + ", ".join(repr(a) for a in ACTIVATIONS[1:])
            + f"; got {activation!r}"
        )
    if relu:
        if activation not in (None, "relu"):
            raise ValueError(f"cutlass_ext.{op}: relu=True conflicts with activation={activation!r}; pass only one")
        return "relu"
    return activation or "none"


def apply(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    if activation == "sigmoid":
        return torch.sigmoid(z)
    return z


def backward(grad: torch.Tensor, saved: torch.Tensor | None, activation: str) -> torch.Tensor:
    """dL/dz from dL/dy; ``saved`` is y for relu and z for the others (as the kernels use it)."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, saved, 0)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, saved, approximate="none")
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, saved, approximate="tanh")
    if activation == "sigmoid":
        return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(saved))
    return torch.ops.aten.silu_backward(grad, saved)
