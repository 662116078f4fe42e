"""nn.Modules built on cutlass_ext ops."""

from __future__ import annotations

import math

import torch
from torch import nn

from .ops import _activation
from .ops.linear import linear


class FusedLinear(nn.Module):
    """``act(x @ weight.T + bias)`` with the bias and activation fused into the GEMM epilogue.

    Parameters and ``state_dict`` keys match ``nn.Linear`` (``weight`` is ``[out_features,
    in_features]``), so checkpoints load either way. ``activation`` is None, "relu", "gelu",
    "gelu_tanh", "silu" or "sigmoid".
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = "relu",
                 device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.activation = _activation.resolve(False, activation, "FusedLinear")
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so a FusedLinear trains like the layer it replaces.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight.t(), self.bias, activation=self.activation)

    @classmethod
    def from_linear(cls, layer: nn.Linear, activation: str | None = "relu") -> "FusedLinear":
        """A FusedLinear sharing ``layer``'s parameters (no copy): ``act(layer(x))`` in one kernel."""
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"FusedLinear.from_linear: expected an nn.Linear, got {type(layer).__name__}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features = layer.in_features
        fused.out_features = layer.out_features
        fused.activation = _activation.resolve(False, activation, "FusedLinear.from_linear")
        fused.weight = layer.weight
        fused.register_parameter("bias", layer.bias)
        return fused

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation!r}")
