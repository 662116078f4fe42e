"""nn.Modules built on cutlass_ext ops."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .ops import _activation
from .ops.linear import linear
from .ops.lora import lora_linear, lora_merge


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


class FusedLoRALinear(nn.Module):
    """A frozen linear layer with a trainable LoRA adapter, run as one ``cutlass_ext.lora_linear`` op:

        y = act(x @ weight.T + bias + scaling * lora_B(lora_A(dropout(x))))

    ``weight`` ``[out_features, in_features]`` and ``bias`` ``[out_features]`` are frozen (requires_grad
    False) and initialised like ``nn.Linear``; ``lora_A.weight`` ``[r, in_features]`` (Kaiming-uniform,
    a=sqrt(5)) and ``lora_B.weight`` ``[out_features, r]`` (zeros, so a fresh layer equals its base) are
    trained. ``state_dict`` keys are ``weight``, ``bias``, ``lora_A.weight`` and ``lora_B.weight``: the base
    keys of ``nn.Linear`` and the adapter keys of a PEFT LoRA layer. ``scaling`` is ``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``. ``lora_dropout`` drops the adapter's input in training
    mode only. ``activation`` (None, "relu", "gelu", "gelu_tanh", "silu" or "sigmoid") is applied after
    the sum, fused into the same op.

    ``merge()`` folds the adapter into ``weight`` in place (the forward is then a plain fused linear);
    ``unmerge()`` takes it out again. While merged, ``state_dict()["weight"]`` holds the merged weight.
    """

    def __init__(self, in_features: int, out_features: int, r: int = 8, lora_alpha: float = 16,
                 lora_dropout: float = 0.0, bias: bool = True, activation: str | None = None,
                 use_rslora: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        bias_param = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None
        self._setup(weight, bias_param, r, lora_alpha, lora_dropout, activation, use_rslora, "FusedLoRALinear")
        self.reset_parameters()

    def _setup(self, weight, bias, r, lora_alpha, lora_dropout, activation, use_rslora, who, scaling=None):
        """Takes ``weight``/``bias`` as the frozen base and creates the adapter around them."""
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{who}: r (the adapter rank) must be a positive int, got {r!r}")
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, numbers.Real) or not 0 <= lora_dropout <= 1:
            raise ValueError(f"{who}: lora_dropout must be a probability in [0, 1], got {lora_dropout!r}")
        self.activation = _activation.resolve(False, activation, who)
        self.out_features, self.in_features = weight.shape
        self.r = r
        self.lora_alpha = lora_alpha
        self.use_rslora = bool(use_rslora)
        self.scaling = float(scaling) if scaling is not None else (
            lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r)
        self.lora_dropout = float(lora_dropout)
        weight.requires_grad_(False)
        if bias is not None:
            bias.requires_grad_(False)
        self.weight = weight
        self.register_parameter("bias", bias)
        factory = {"device": weight.device, "dtype": weight.dtype}
        # nn.Linear submodules (no bias), as PEFT holds them: state_dict keys lora_A.weight / lora_B.weight.
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **factory)
        self.merged = False
        self.reset_lora_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation for the base, and a fresh adapter (see reset_lora_parameters)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias, -bound, bound)
        self.merged = False
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """PEFT's default LoRA init: A Kaiming-uniform (a=sqrt(5)), B zeros, so the adapter starts at 0."""
        if self.merged:
            raise RuntimeError("FusedLoRALinear.reset_lora_parameters: the adapter is merged; call unmerge() first")
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return linear(x, self.weight.t(), self.bias, activation=self.activation)
        return lora_linear(x, self.weight, self.lora_A.weight, self.lora_B.weight, self.bias, scaling=self.scaling,
                           activation=self.activation, dropout_p=self.lora_dropout,
                           training=self.training and self.lora_dropout > 0)

    def merge(self) -> None:
        """``weight += scaling * lora_B.weight @ lora_A.weight`` in place (fp32 accumulation)."""
        if self.merged:
            raise RuntimeError("FusedLoRALinear.merge: the adapter is already merged; call unmerge() first")
        lora_merge(self.weight, self.lora_A.weight, self.lora_B.weight, self.scaling)
        self.merged = True

    def unmerge(self) -> None:
        """Undoes :meth:`merge` in place (exact up to one rounding of the weight's dtype per call)."""
        if not self.merged:
            raise RuntimeError("FusedLoRALinear.unmerge: the adapter is not merged; call merge() first")
        lora_merge(self.weight, self.lora_A.weight, self.lora_B.weight, self.scaling, sign=-1)
        self.merged = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, r: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0,
                    activation: str | None = None, use_rslora: bool = False) -> "FusedLoRALinear":
        """A FusedLoRALinear around ``linear``: its weight and bias are shared (no copy) and frozen
        (``requires_grad_(False)`` on the nn.Linear's own parameters); the adapter is new."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FusedLoRALinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(linear.weight, linear.bias, r, lora_alpha, lora_dropout, activation, use_rslora,
                     "FusedLoRALinear.from_linear")
        return layer

    @classmethod
    def from_peft(cls, peft_layer: nn.Module, activation: str | None = None) -> "FusedLoRALinear":
        """A FusedLoRALinear equal to a ``peft.tuners.lora.Linear`` layer's active adapter.

        The base weight and bias are shared; the adapter's ``lora_A``/``lora_B`` modules are shared too when
        their dtype and device match the base weight's (then training either trains both), else copied in the
        base's dtype (PEFT keeps adapters in float32 over 16-bit bases by default). Scaling, rank, alpha,
        dropout probability and the merged state come from the PEFT layer. Works by duck typing, so
        cutlass_ext does not import peft. Plain LoRA only: DoRA and other variants, ``lora_bias``,
        ``fan_in_fan_out`` (Conv1D) bases and several active adapters are rejected.
        """
        who = "FusedLoRALinear.from_peft"
        for attr in ("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling"):
            if not hasattr(peft_layer, attr):
                raise TypeError(f"{who}: expected a peft.tuners.lora.Linear layer (missing .{attr}), "
                                f"got {type(peft_layer).__name__}")
        adapters = getattr(peft_layer, "active_adapters", None) or getattr(peft_layer, "active_adapter", None)
        adapters = [adapters] if isinstance(adapters, str) else list(adapters or [])
        if len(adapters) != 1:
            raise ValueError(f"{who}: exactly one active adapter is supported, got {adapters}; "
                             "call set_adapter(name) on the PEFT model first")
        name = adapters[0]
        if name not in peft_layer.lora_A:
            raise ValueError(f"{who}: the active adapter {name!r} has no lora_A/lora_B in this layer")
        base = peft_layer.base_layer
        if not isinstance(base, nn.Linear):
            raise TypeError(f"{who}: the PEFT layer's base_layer must be an nn.Linear, got {type(base).__name__}")
        if getattr(peft_layer, "fan_in_fan_out", False):
            raise ValueError(f"{who}: fan_in_fan_out=True (Conv1D-style transposed weights) is not supported")
        if name in getattr(peft_layer, "lora_variant", {}) or getattr(peft_layer, "use_dora", {}).get(name, False):
            raise NotImplementedError(f"{who}: adapter {name!r} is a LoRA variant (DoRA, ...); only plain LoRA is "
                                      "supported")
        lora_A, lora_B = peft_layer.lora_A[name], peft_layer.lora_B[name]
        if getattr(lora_B, "bias", None) is not None:
            raise NotImplementedError(f"{who}: adapter {name!r} has lora_bias=True; only bias-free adapters are "
                                      "supported")
        merged_adapters = list(getattr(peft_layer, "merged_adapters", []))
        if merged_adapters not in ([], [name]):
            raise ValueError(f"{who}: adapters {merged_adapters} are merged into the base weight, which only "
                             f"the active adapter {name!r} may be; call unmerge() on the PEFT model first")
        dropout = peft_layer.lora_dropout[name]
        p = float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0
        r = int(lora_A.weight.shape[0])
        lora_alpha = getattr(peft_layer, "lora_alpha", {}).get(name, peft_layer.scaling[name] * r)
        use_rslora = getattr(peft_layer, "use_rslora", {}).get(name, False)

        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(base.weight, base.bias, r, lora_alpha, p, activation, use_rslora, who,
                     scaling=peft_layer.scaling[name])
        for attr, src in (("lora_A", lora_A), ("lora_B", lora_B)):
            if src.weight.dtype == base.weight.dtype and src.weight.device == base.weight.device:
                setattr(layer, attr, src)
            else:
                with torch.no_grad():
                    getattr(layer, attr).weight.copy_(src.weight)
                getattr(layer, attr).weight.requires_grad_(src.weight.requires_grad)
        layer.merged = bool(merged_adapters)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"lora_alpha={self.lora_alpha}, scaling={self.scaling:g}, lora_dropout={self.lora_dropout}, "
                f"bias={self.bias is not None}, activation={self.activation!r}, merged={self.merged}")
