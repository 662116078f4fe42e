"""Comparison helpers: error relative to a float64 reference, bounded by torch's own error."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# Floors for the relative error (||out - ref|| / ||ref||) by dtype name. The bound used is
# max(FACTOR * torch's own error in the same dtype, floor).
FLOOR = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5, "tf32": 4e-3}
FACTOR = 2.0
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}


def rel_error(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||out - ref|| / ||ref||, or / max(||ref||, ||scale||) where the result can be much smaller
    than its rounding errors' scale (a sum of values of both signs that cancels to near zero)."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    if scale is not None:
        denom = max(denom, scale.double().norm().item())
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close_to_reference(out, ref64, peer, dtype_name: str, what: str = "output", scale=None) -> None:
    """``out`` (ours) and ``peer`` (torch's own computation in the same dtype) against ``ref64``;
    errors relative to the larger of ``ref64`` and ``scale`` where ``scale`` is given (see rel_error)."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    err = rel_error(out, ref64, scale)
    peer_err = rel_error(peer, ref64, scale) if peer is not None else 0.0
    bound = max(FACTOR * peer_err, FLOOR[dtype_name])
    assert err <= bound, f"{what}: relative error {err:.3e} > bound {bound:.3e} (torch's own: {peer_err:.3e})"


def unit_in_last_place(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values (fp16 or bf16) at each float64 value of ``ref``
    (subnormals included)."""
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    min_exponent = int(math.log2(torch.finfo(dtype).tiny))
    _, e = torch.frexp(ref.abs())  # |ref| = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(ref), torch.clamp(e - 1, min=min_exponent) - mantissa_bits)


def every_value(dtype: torch.dtype, lo: float, hi: float) -> torch.Tensor:
    """Every finite value of the 16-bit ``dtype`` in [lo, hi], on the CPU."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return every[torch.isfinite(every) & (every >= lo) & (every <= hi)]


def activation64(act: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu, silu or sigmoid of float64 ``x`` and its derivative, computed without the
    cancellations of 1 + erf(x) and 1 - sigmoid(x)."""
    if act == "gelu":
        cdf = 0.5 * torch.erfc(-x / math.sqrt(2.0))
        return x * cdf, cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    s, one_minus = torch.sigmoid(x), torch.sigmoid(-x)
    if act == "silu":
        return x * s, s * (1.0 + x * one_minus)
    assert act == "sigmoid", act
    return s, s * one_minus


@contextlib.contextmanager
def fp32_precision(dtype_name: str):
    """tf32 runs fp32 GEMMs on TF32 tensor cores; fp32 asks for exact fp32."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype_name == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def capture_cuda_graph(fn):
    """Runs ``fn`` once on a side stream (the one-time build, allocations), then captures a second
    call in a CUDA graph. Returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# Kernels the test harness adds around an op: CUTLASS_EXT_POISON_OUTPUTS NaN-fills every output
# before its kernel (FillFunctor), and split-K kernels zero their workspace flags (Memset).
SUPPORT_KERNELS = ("FillFunctor", "Memset")


def cuda_kernels_run(fn, keep_support=False):
    """(fn(), names of the CUDA kernels it launched, in launch order, from the profiler), without
    the SUPPORT_KERNELS unless keep_support."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not keep_support:
        names = [n for n in names if not any(k in n for k in SUPPORT_KERNELS)]
    return out, names


def gemm_kernels_run(fn):
    """(fn(), names of the GEMM kernels it launched on the GPU, from the profiler)."""
    out, names = cuda_kernels_run(fn)
    return out, [n for n in names if "Gemm" in n or "gemm" in n]


def narrow_kernel_takes(rows: int, k: int, n: int, b_major: str = "k") -> bool:
    """Whether the GEMM heuristic (narrow_chosen in csrc/bindings/gemm_select.cpp) gives a 16-bit
    product of depth k with n columns over ``rows`` rows, with a row-major A and a K- or N-major B
    of adjacent rows, to the hand-written narrow kernel: past the few-column kernel's 4 columns,
    n <= 64, k <= 64 and n k <= 2048, from 512 rows, where the kernel can read the operands in
    place (k, and n for an N-major B, multiples of 8)."""
    readable = k % 8 == 0 and (b_major == "k" or n % 8 == 0)
    return 4 < n <= 64 and k <= 64 and n * k <= 2048 and rows >= 512 and readable


TRANSPOSED_WIDTHS = (16, 32, 64, 128)  # the transposed 64-row tiles' widths (cutlass_ext/_kernel_table.py)


def narrow_n_tile(m: int, k: int, n: int, sms: int) -> int | None:
    """The transposed 64-row tile width (16, 32, 64 or 128) the few-column rule of the GEMM heuristic
    (csrc/bindings/gemm_select.cpp) picks for a bf16 m x k -> n product on ``sms`` SMs, or None
    where K is too long for the rule and the others apply: the widest tile whose grid fills the SMs
    at least once (at most 64 wide for up to 64 columns with K <= 256 unless the wider tile's grid
    fills the SMs, as for a forward against a weight), else the narrowest, where for
    K <= 512 a grid of a quarter of the SMs' worth of tiles counts as filling them under that cap
    and three quarters elsewhere; None also for 256 columns over K >= 512 where 128x128 tiles make
    three rounds over the SMs."""
    n_padded = math.ceil(n / 8) * 8
    if k > (4096 if n_padded <= 16 else 1024):
        return None
    if n_padded == 256 and k >= 512 and math.ceil(m / 128) * 2 >= 3 * sms:  # three rounds of 128x128 tiles
        return None
    capped = n_padded <= 64 and k <= 256
    fill = sms if k > 512 else math.ceil(sms / 4) if capped else math.ceil(3 * sms / 4)

    def grid(t):
        return math.ceil(n_padded / 64) * math.ceil(m / t)

    filling = [t for t in TRANSPOSED_WIDTHS if grid(t) >= fill and not (capped and t > 64 and grid(t) < sms)]
    return max(filling) if filling else min(TRANSPOSED_WIDTHS)


def few_rows_tile(m: int, k: int, n: int, sms: int) -> int | None:
    """The transposed 64-row tile width the few-rows rule of the GEMM heuristic picks for a bf16
    m x k -> n forward (M <= 256) over K > 2048, or None where it leaves that rule for the general
    ones: up to 64 rows the tile that holds them in one column tile more than half full where its
    grid covers a quarter of the SMs; else the narrowest that takes them in two column tiles,
    unless that grid needs more than two rounds over the SMs past 64 rows."""
    n_padded = math.ceil(n / 8) * 8
    one = [t for t in TRANSPOSED_WIDTHS if m <= t < 2 * m]
    if m <= 64 and one and 4 * math.ceil(n_padded / 64) * math.ceil(m / one[0]) >= sms:
        return one[0]
    two = min(t for t in TRANSPOSED_WIDTHS if 2 * t >= m)
    if m > 64 and math.ceil(n_padded / 64) * math.ceil(m / two) > 2 * sms:
        return None
    return two


def wide_tile(m: int, k: int, n: int, sms: int, extk: bool = False) -> bool:
    """Whether the GEMM heuristic (csrc/bindings/gemm_select.cpp) runs a 16-bit m x k -> n product
    (no batch) on the cooperative 128x256 tile: K >= 4096, and either M, N >= 2048, at least 1.5
    rounds of its tiles over ``sms`` SMs, and its rounds, worth twice as many of 128x128 tiles, at
    most 1.07x the 128x128 tiles' rounds; or, more than 256 rows and between half a wave and two
    of 128x128 tiles, one round of wide tiles over at least 70% of the SMs (not for LoRA's
    extended-K products, ``extk``, which keep to the first rule)."""
    n_padded = math.ceil(n / 8) * 8
    wide, narrow = math.ceil(m / 128) * math.ceil(n_padded / 256), math.ceil(m / 128) * math.ceil(n_padded / 128)
    if not extk and one_round_tile_n(m, k, n, sms) == 256:
        return True
    return (k >= 4096 and min(m, n) >= 2048 and 2 * wide >= 3 * sms
            and 2 * math.ceil(wide / sms) * 100 <= 107 * math.ceil(narrow / sms))


def one_wave_tiles_take(m: int, n: int, sms: int) -> bool:
    """Whether the GEMM heuristic (csrc/bindings/gemm_select.cpp) takes the 128x144 tiles for an
    m x k -> n product from two waves of 128x128 tiles on ``sms`` SMs: their rounds times their
    area at most 85% of the 128x128 tiles'."""
    rounds = lambda tiles: math.ceil(tiles / sms)  # noqa: E731
    square = math.ceil(m / 128) * math.ceil(n / 128)
    return rounds(math.ceil(m / 128) * math.ceil(n / 144)) * 144 * 100 <= rounds(square) * 128 * 85


def one_round_tile_n(m: int, k: int, n: int, sms: int) -> int | None:
    """The width of the 128-row tile that the GEMM heuristic's mid-M rule takes for one round of
    a 16-bit m x k -> n product (no batch, no LoRA pair): from K = 1024, with more than 256 rows and
    between one wave and two of 128x128 tiles, of the 128x144 and 128x192 tiles (and from K = 4096
    the 128x256 ones) that make one round over at least 70% of ``sms`` SMs the one with more tiles
    (on a tie the wider); else None. Ahead of the stream-K split of a long K's last wave (K >= 8192,
    a second round of 128x128 tiles under half full), which the 128x256 tiles do not take part in."""
    n_padded = math.ceil(n / 8) * 8
    square = math.ceil(m / 128) * math.ceil(n_padded / 128)
    if k < 1024 or m <= 256 or not sms < square < 2 * sms:
        return None
    stream_k = k >= 8192 and 2 * (square - sms) < sms
    best, best_tiles = None, 0
    for width in (256, 192, 144) if k >= 4096 and not stream_k else (192, 144):
        count = math.ceil(m / 128) * math.ceil(n_padded / width)
        if count <= sms and 10 * count >= 7 * sms and count > best_tiles:
            best, best_tiles = width, count
    return best


def aux_cooperative(m: int, k: int, n: int, sms: int) -> bool:
    """Whether the GEMM heuristic (csrc/bindings/gemm_select.cpp) runs a bf16 m x k -> n training
    forward of a GELU/SiLU layer (the aux epilogue) on the cooperative 128x128 tile: more than 256
    rows, K <= 1024, N >= 256 and at least half a wave of 128x128 tiles."""
    n_padded, k_padded = math.ceil(n / 8) * 8, math.ceil(k / 8) * 8
    tiles = math.ceil(m / 128) * math.ceil(n_padded / 128)
    return m > 256 and k_padded <= 1024 and n_padded >= 256 and 2 * tiles >= sms


def cuda_toolchain_available() -> bool:
    """Whether nvcc and the CUTLASS headers are found the way the package's build finds them."""
    from cutlass_ext import _build

    try:
        _build.find_cuda_home()
        _build.find_cutlass()
    except _build.BuildError:
        return False
    return True


def compile_host_program(out_dir: Path, name: str, sources: list[Path], include_dirs: list[Path]) -> Path:
    """Builds a torch-free driver of csrc/ code (tests/cpp) with the host C++ compiler, csrc/ on
    the include path; skips the test where there is no compiler."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = out_dir / name
    includes = [f"-I{d}" for d in [ROOT / "csrc", *include_dirs]]
    subprocess.run([cxx, "-std=c++17", "-O1", *includes, *map(str, sources), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe
