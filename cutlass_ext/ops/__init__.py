"""Op registration: importing this package defines every ``torch.ops.cutlass_ext`` op."""

from . import linear  # noqa: F401
