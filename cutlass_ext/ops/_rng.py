"""Bit-exact PyTorch twin of csrc/common/counter_rng.h, the counter-based RNG of the dropout kernels.

Every draw is a pure function of (seed, element index), so the reference kernels (and tests) build
exactly the keep-mask the CUDA kernels generate. Arithmetic is int64 tensor math on 32-bit lanes:
values stay in [0, 2**32) and multipliers below 2**31, so no product reaches 2**63.

    mix(x)  = x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15  (mod 2**32)
    k0 = mix(lo(seed) ^ 0x9e3779b9),  k1 = mix(hi(seed) ^ k0 ^ 0x7f4a7c15)
    bits(i) = mix(mix(lo(i) ^ k0) + mix(hi(i) ^ k1))
    keep(i) = bits(i) >= ceil(p * 2**32)      (uniform = bits * 2**-32 >= p; kept values scale by 1/(1-p))

The interface is generic (any op can key a mask by its own element numbering): ``bits``,
``uniform``, ``keep_threshold`` and ``dropout_keep``.
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seed = seed.reshape(-1)[:1].to(torch.int64)  # two's complement: the same 64 bits as the kernel's uint64
    k0 = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    k1 = _mix32(((seed >> 32) & _MASK32) ^ k0 ^ 0x7F4A7C15)
    return k0, k1


def bits(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit draws (as int64 in [0, 2**32)) of elements ``index`` (int64, >= 0) under ``seed``
    (a one-element int64 tensor on index's device)."""
    k0, k1 = _keys(seed.to(index.device))
    lo = index & _MASK32
    hi = (index >> 32) & _MASK32
    return _mix32(((_mix32(lo ^ k0) + _mix32(hi ^ k1)) & _MASK32))


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """bits * 2**-32: uniform in [0, 1), float64 (exact)."""
    return bits(seed, index).to(torch.float64) * 2.0**-32


def keep_threshold(p: float) -> int:
    """ceil(p * 2**32): an element is kept iff its bits are >= this (p = 1 keeps nothing)."""
    if not p > 0.0:
        return 0
    if p >= 1.0:
        return 1 << 32
    return int(math.ceil(p * 4294967296.0))


def keep_scale(p: float) -> float:
    """What multiplies a kept element: 1 / (1 - p), and 0 for p = 1."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_keep(seed: torch.Tensor, index: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean keep-mask of elements ``index`` for dropout probability ``p`` under ``seed``."""
    return bits(seed, index) >= keep_threshold(p)


def row_major_index(rows: int, cols: int, device) -> torch.Tensor:
    """Element indices row * cols + col of a [rows, cols] matrix: how the row-wise kernels number
    their elements."""
    return torch.arange(rows * cols, device=device, dtype=torch.int64).view(rows, cols)
