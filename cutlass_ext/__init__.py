"""cutlass_ext: fused GEMM ops on CUTLASS 3.x, and hand-written CUDA normalization and
elementwise ops, for PyTorch.

GEMM functions: :func:`linear` (act(A @ B + bias) in one kernel), :func:`matmul`.
Other functions: :func:`softmax`, :func:`layer_norm` (fused ReLU + LayerNorm + dropout),
:func:`bias_act` (act(scale * x + bias + residual)), :func:`sum`, :func:`add`.
Modules: :class:`FusedLinear`.
"""

from . import ops  # noqa: F401  (registers torch.ops.cutlass_ext.*)
from ._build import BuildError
from .modules import FusedLinear
from .ops.layer_norm import layer_norm
from .ops.linear import linear, matmul
from .ops.pointwise import add, bias_act, sum  # noqa: A004
from .ops.softmax import softmax

__version__ = "0.1.0"
__all__ = [
    "linear", "matmul", "softmax", "layer_norm", "bias_act", "sum", "add",
    "FusedLinear", "BuildError", "build",
]


def build():
    """Builds (or loads from the cache) the CUDA extension now rather than on first use, and
    returns it. Raises BuildError with what to install or set when this machine cannot build it."""
    from . import _build

    return _build.load()
