"""What the CUDA kernels of every op family share: the extension handle (or the reason the
reference path runs instead), the fp32 precision policy and the GEMM config override."""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from .. import _build

_warned = False


def extension() -> ModuleType | None:
    """The compiled extension, built on first use; None when this machine cannot build or run it,
    in which case the op runs its PyTorch reference on the GPU (after one warning).
    ``CUTLASS_EXT_STRICT=1`` turns that fallback into the error; ``CUTLASS_EXT_FORCE_REFERENCE=1``
    always takes the reference path."""
    global _warned
    if os.environ.get("CUTLASS_EXT_FORCE_REFERENCE") == "1":
        return None
    try:
        return _build.load()
    except _build.BuildError as exc:
        if os.environ.get("CUTLASS_EXT_STRICT") == "1":
            raise
        if not _warned:
            _warned = True
            warnings.warn(
                f"cutlass_ext: CUDA kernels unavailable, running the PyTorch reference path: {exc}. "
                "Set CUTLASS_EXT_STRICT=1 to raise instead.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def exact_fp32() -> bool:
    """fp32 GEMMs use TF32 tensor cores unless torch asks for full fp32 precision."""
    return torch.get_float32_matmul_precision() == "highest"


def gemm_config() -> str:
    """A GEMM config name forced by ``CUTLASS_EXT_GEMM_CONFIG`` (benchmarks); empty means the
    built-in heuristic chooses."""
    return os.environ.get("CUTLASS_EXT_GEMM_CONFIG", "")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reference kernels accumulate 16-bit inputs in fp32, as the tensor-core kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
