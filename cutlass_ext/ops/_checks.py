"""Argument checks shared by the public functions: each error names the argument and the fix."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(x, name: str, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"cutlass_ext.{op}: {name} must be a torch.Tensor, got {type(x).__name__}")


def check_pair(ref: torch.Tensor, ref_name: str, x: torch.Tensor, name: str, op: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(
            f"cutlass_ext.{op}: {name} has dtype {x.dtype} but {ref_name} has {ref.dtype}; "
            f"cast it with {name}.to({ref_name}.dtype)"
        )
    if x.device != ref.device:
        raise ValueError(
            f"cutlass_ext.{op}: {name} is on {x.device} but {ref_name} is on {ref.device}; "
            f"move it with {name}.to({ref_name}.device)"
        )


def check_dtype(x: torch.Tensor, name: str, op: str) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"cutlass_ext.{op}: {name} has dtype {x.dtype}; supported are float16, bfloat16 and float32 "
            f"(cast with {name}.to(torch.bfloat16), for example)"
        )


def vector_fits(t, dtype: torch.dtype, length: int, device: torch.device) -> bool:
    """Whether ``t`` (a tensor) is 1-D of ``length`` elements with this dtype and device: the fast
    test of a valid call's bias or weight, before check_vector names what is wrong."""
    return t.dtype is dtype and t.ndim == 1 and t.shape[0] == length and t.device == device


def check_vector(ref: torch.Tensor, ref_name: str, t, name: str, length: int, dim: str, op: str) -> None:
    """``t`` is a 1-D tensor of ``length`` elements with ``ref``'s dtype and device. ``dim`` names
    the length in the error, e.g. "N (B's columns)" gives "[N] = [4096] (B's columns)"; the message
    is formatted only on failure (an eager f-string cost ~1 us a call)."""
    check_tensor(t, name, op)
    check_pair(ref, ref_name, t, name, op)
    if t.dim() != 1 or t.shape[0] != length:
        letter, _, what = dim.partition(" ")
        expected = f"[{letter}] = [{length}]" + (f" {what}" if what else "")
        raise ValueError(f"cutlass_ext.{op}: {name} must have shape {expected}, got {tuple(t.shape)}")


def check_config(config, op: str) -> None:
    """``config`` is None or the name of a GEMM config of the kernel table."""
    if config is None:
        return
    from .._kernel_table import config_names

    names = config_names()
    if not isinstance(config, str) or config not in names:
        raise ValueError(
            f"cutlass_ext.{op}: config must be None or one of {', '.join(names)}; got {config!r} "
            "(python -m cutlass_ext.info lists them with what each is for)"
        )
