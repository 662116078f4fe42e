"""cutlass_ext: fused GEMM ops on CUTLASS 3.x for PyTorch.

Functions: :func:`linear` (act(A @ B + bias) in one kernel), :func:`matmul`.
Modules: :class:`FusedLinear`.
"""

from . import ops  # noqa: F401  (registers torch.ops.cutlass_ext.*)
from ._build import BuildError
from .modules import FusedLinear
from .ops.linear import linear, matmul

__version__ = "0.1.0"
__all__ = ["linear", "matmul", "FusedLinear", "BuildError", "build"]


def build():
    """Builds (or loads from the cache) the CUDA extension now rather than on first use, and
    returns it. Raises BuildError with what to install or set when this machine cannot build it."""
    from . import _build

    return _build.load()
