"""cutlass_ext: fused GEMM ops on CUTLASS 3.x, and hand-written CUDA normalization and
elementwise ops, for PyTorch.

GEMM functions: :func:`linear` (act(A @ B + bias) in one kernel), :func:`matmul`,
:func:`lora_linear` (a linear layer with a LoRA adapter in one op), :func:`lora_merge`.
Other functions: :func:`softmax`, :func:`layer_norm` (fused ReLU + LayerNorm + dropout),
:func:`bias_act` (act(scale * x + bias + residual)), :func:`sum`, :func:`add`.
Modules: :class:`FusedLinear`, :class:`FusedLoRALinear`. GEMM autotuning: :func:`tune`.
"""

from . import ops  # noqa: F401  (registers torch.ops.cutlass_ext.*)
from ._build import BuildError
from .modules import FusedLinear, FusedLoRALinear
from .ops.layer_norm import layer_norm
from .ops.linear import linear, matmul
from .ops.lora import lora_linear, lora_merge
from .ops.pointwise import add, bias_act, sum  # noqa: A004
from .ops.softmax import softmax
from .tuning import tune

__version__ = "0.1.0"
__all__ = [
    "linear", "matmul", "lora_linear", "lora_merge", "softmax", "layer_norm", "bias_act", "sum", "add",
    "FusedLinear", "FusedLoRALinear", "BuildError", "build", "tune",
]


def build():
    """Builds (or loads from the cache) the CUDA extension now rather than on first use, and
    returns it. Raises BuildError with what to install or set when this machine cannot build it."""
    from . import _build

    return _build.load()
