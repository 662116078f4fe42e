"""Bit-exact PyTorch twin of csrc/common/counter_rng.h, the counter-based RNG of the dropout kernels.

Every draw is a pure function of (seed, element index), so the reference kernels (and tests) build
exactly the keep-mask the CUDA kernels generate. Arithmetic is int64 tensor math on 32-bit lanes:
values stay in [0, 2**32) and every product has a factor below 2**31 (mix's multipliers) or 2**16
(the 32x32-bit products are taken in 16-bit halves), so none reaches 2**63.

    mix(x)  = x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15  (mod 2**32)
    k0 = mix(lo(seed) ^ 0x9e3779b9),  k1 = mix(hi(seed) ^ k0 ^ 0x7f4a7c15),  m = mix(k1 ^ 0x85ebca6b) | 1
    bits(n) = mix(m * lo(n) + k1 * hi(n) + k0)                (n: a 64-bit counter; mod 2**32)
    draw(i) = (bits(i >> 1) >> (16 * (i & 1))) & 0xffff       (two neighbouring elements share a hash)
    keep(i) = draw(i) >= ceil(p * 2**16)      (uniform = draw * 2**-16 >= p; kept values scale by 1/(1-p))

The keep probability is 1 - ceil(p * 2**16) / 2**16, i.e. p rounded up to a multiple of 2**-16.

The interface is generic (any op can key a mask by its own element numbering): ``bits``, ``draw``,
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


def _mul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b mod 2**32 for a, b in [0, 2**32), from two products below 2**48."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _MASK32


def _keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = seed.reshape(-1)[:1].to(torch.int64)  # two's complement: the same 64 bits as the kernel's uint64
    k0 = _mix32((seed & _MASK32) ^ 0x9E3779B9)
    k1 = _mix32(((seed >> 32) & _MASK32) ^ k0 ^ 0x7F4A7C15)
    m = _mix32(k1 ^ 0x85EBCA6B) | 1
    return k0, k1, m


def bits(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The 32-bit hashes (as int64 in [0, 2**32)) of ``counter`` (int64, >= 0) under ``seed`` (a
    one-element int64 tensor on counter's device)."""
    k0, k1, m = _keys(seed.to(counter.device))
    lo = counter & _MASK32
    hi = (counter >> 32) & _MASK32
    return _mix32((_mul32(lo, m) + _mul32(hi, k1) + k0) & _MASK32)


def draw(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 16-bit draws (int64 in [0, 2**16)) of elements ``index`` (int64, >= 0): a half of the
    hash of index >> 1, the low half for even indices."""
    return (bits(seed, index >> 1) >> ((index & 1) * 16)) & 0xFFFF


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """draw * 2**-16: uniform on the multiples of 2**-16 in [0, 1), float64 (exact)."""
    return draw(seed, index).to(torch.float64) * 2.0**-16


def keep_threshold(p: float) -> int:
    """ceil(p * 2**16): an element is kept iff its draw is >= this (p = 1 keeps nothing)."""
    if not p > 0.0:
        return 0
    if p >= 1.0:
        return 1 << 16
    return int(math.ceil(p * 65536.0))


def keep_scale(p: float) -> float:
    """What multiplies a kept element: 1 / (1 - p), and 0 for p = 1."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_keep(seed: torch.Tensor, index: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean keep-mask of elements ``index`` for dropout probability ``p`` under ``seed``."""
    return draw(seed, index) >= keep_threshold(p)


def row_major_index(rows: int, cols: int, device) -> torch.Tensor:
    """Element indices row * cols + col of a [rows, cols] matrix: how the row-wise kernels number
    their elements."""
    return torch.arange(rows * cols, device=device, dtype=torch.int64).view(rows, cols)
