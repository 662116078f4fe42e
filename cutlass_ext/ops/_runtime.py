"""What every op family shares: the extension handle (or the reason the reference path runs
instead), the loader that routes first CUDA calls to it, and the reference kernels' compute dtype.

The fp32 precision policy (TF32 unless torch.get_float32_matmul_precision() == "highest") and the
GEMM config overrides (CUTLASS_EXT_GEMM_CONFIG, CUTLASS_EXT_GEMM_SWIZZLE, CUTLASS_EXT_GEMM_RASTER) are read by the CUDA
kernels themselves, at call time."""

from __future__ import annotations

import contextlib
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


_loader_lib = torch.library.Library("cutlass_ext", "IMPL")


def register_cuda_loader(name: str, reference) -> None:
    """Routes calls of ``cutlass_ext::<name>`` on devices without a kernel of their own.

    The compiled extension registers each op's CUDA kernel with the dispatcher when it loads, so
    after the first call CUDA tensors go straight to C++. This CompositeExplicitAutograd kernel
    only serves the calls before that: on CUDA it loads (building if needed) the extension and
    calls the op again, or runs ``reference`` where the extension cannot be built here.
    """
    qualname = f"cutlass_ext::{name}"

    def load_then_call(*args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type != "cuda":
            raise NotImplementedError(f"{qualname} has no kernel for {device.type} tensors; use CPU or CUDA tensors")
        if extension() is not None and torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"):
            return getattr(torch.ops.cutlass_ext, name).default(*args)
        return reference(*args)

    _loader_lib.impl(name, load_then_call, "CompositeExplicitAutograd")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reference kernels accumulate 16-bit inputs in fp32, as the tensor-core kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@contextlib.contextmanager
def _switch(setter: str, enabled: bool):
    ext = extension()
    previous = getattr(ext, setter)(enabled) if ext is not None else None
    try:
        yield
    finally:
        if ext is not None:
            getattr(ext, setter)(previous)


def gemm_dependent_launch(enabled: bool):
    """Within the block, the GEMMs that wait for the kernel before them at their start (CUTLASS's
    Hopper kernels but the stream-K and extended-K ones) are launched as programmatic dependents of
    that kernel (``True``, the default unless CUTLASS_EXT_GEMM_DEPENDENT=0), so that their launch
    and set-up overlap its end, or the usual way (``False``). For tests and benchmarks of both
    paths; without the extension it changes nothing."""
    return _switch("_set_gemm_dependent_launch", enabled)


def dependent_launch(enabled: bool):
    """Within the block, the second kernels of split reductions (sum_partials, the rank pass's
    finish), LoRA's extended-K GEMMs (after the rank pass's finish) and the GEMMs that
    gemm_dependent_launch governs are launched as programmatic dependents of the kernel before
    them (``True``, the default) or the usual way (``False``); read as each kernel is launched or
    captured into a CUDA graph. For tests and benchmarks of both paths; without the extension it
    changes nothing."""
    return _switch("_set_dependent_launch", enabled)
