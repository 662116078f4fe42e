"""Op registration: importing this package defines every ``torch.ops.cutlass_ext`` op."""

from . import layer_norm, linear, lora, pointwise, softmax  # noqa: F401
