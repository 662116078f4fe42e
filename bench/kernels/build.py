"""Builds the kernel-level benchmarks of bench/kernels (README.md there) with nvcc, no torch needed:

    python bench/kernels/build.py [--jobs N] [--only gemm|layer_norm|layer_norm_forward|streaming|fewrows|lowk|column_sums]
                                  [--variants a,...] [--out DIR]

writes gemm_variants (one translation unit per GEMM variant, compiled in parallel),
layer_norm_rows, layer_norm_forward, streaming_add, fewrows_shapes, lowk_shapes and column_sums, for sm_90a,
to --out (default bench/kernels/build).
CUTLASS and nvcc are found the way the package's own build finds them (CUTLASS_PATH, the
nvidia-cutlass wheel; CUDA_HOME, PATH).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
from cutlass_ext._build import find_cuda_home, find_cutlass  # noqa: E402

PINGPONG = "::cutlass_ext::sm90::Pingpong"
COOPERATIVE = "::cutlass_ext::sm90::Cooperative"
KB = "::cutlass_ext::kernel_bench"

def _library(tile_m: int, tile_n: int, cluster_m: int, cluster_n: int, schedule: str) -> str:
    """The package's own bf16 forward bundle (bias, run-time activation; K-major A, a weight as B)."""
    return ("::cutlass_ext::sm90::GemmBundle<cutlass::bfloat16_t, cutlass::layout::RowMajor, "
            f"cutlass::layout::ColumnMajor, false, false, false, {tile_m}, {tile_n}, 64, {cluster_m}, {cluster_n}, "
            f"{schedule}, ::cutlass_ext::sm90::PersistentScheduler>")


# name -> bundle. "library_pp128" is the library's own forward config (128x128_1x2_pp) as built
# into the package; the others vary one thing at a time. Epilogue kinds: gemm_variants.cuh.
VARIANTS = {
    "library_pp128": _library(128, 128, 1, 2, PINGPONG),
    "pp128_plain": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kPlain>",
    "pp128_relu": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kReluFixed>",
    "pp128_gelu": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kGeluFixed>",
    "coop128_2x1": f"{KB}::Variant<128, 128, 64, 2, 1, {COOPERATIVE}, {KB}::kRuntimeActivation>",
    "library_coop128_2x1": _library(128, 128, 2, 1, COOPERATIVE),
    "coop128_2x1_relu": f"{KB}::Variant<128, 128, 64, 2, 1, {COOPERATIVE}, {KB}::kReluFixed>",
    "coop256x128_1x2": f"{KB}::Variant<256, 128, 64, 1, 2, {COOPERATIVE}, {KB}::kRuntimeActivation>",
    # Epilogue tiles for output-bound products (a short K: dW at K = 128): the automatic tile of
    # the ping-pong schedule is 64x32 (bench/NOTES.md section 22).
    "pp128_ep64x64": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kRuntimeActivation, 0, "
                     "cute::Shape<cute::_64, cute::_64>>",
    "pp128_ep64x128": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kRuntimeActivation, 0, "
                      "cute::Shape<cute::_64, cute::_128>>",
    "coop128_2x1_ep128x64": f"{KB}::Variant<128, 128, 64, 2, 1, {COOPERATIVE}, {KB}::kRuntimeActivation, 0, "
                            "cute::Shape<cute::_128, cute::_64>>",
    "coop128x256_2x1": f"{KB}::Variant<128, 256, 64, 2, 1, {COOPERATIVE}, {KB}::kRuntimeActivation>",
    "coop128x256_2x1_ep128x64": f"{KB}::Variant<128, 256, 64, 2, 1, {COOPERATIVE}, {KB}::kRuntimeActivation, 0, "
                                "cute::Shape<cute::_128, cute::_64>>",
    "pp128_ep64x64_plain": f"{KB}::Variant<128, 128, 64, 1, 2, {PINGPONG}, {KB}::kPlain, 0, "
                           "cute::Shape<cute::_64, cute::_64>>",
    # The library's bundle (bias, run-time activation) on the cooperative 128x256 and 256x128 tiles.
    "library_coop128x256_2x1": _library(128, 256, 2, 1, COOPERATIVE),
    "library_coop128x256_1x2": _library(128, 256, 1, 2, COOPERATIVE),
    "library_coop256x128_1x2": _library(256, 128, 1, 2, COOPERATIVE),
    "library_pp128_2x1": _library(128, 128, 2, 1, PINGPONG),
    # The mainloop alone (plain epilogue) in other tile depths, clusters and warpgroup tilings.
    "pp128_k128_plain": f"{KB}::Variant<128, 128, 128, 1, 2, {PINGPONG}, {KB}::kPlain>",
    "pp128_2x1_plain": f"{KB}::Variant<128, 128, 64, 2, 1, {PINGPONG}, {KB}::kPlain>",
    "pp128_1x1_plain": f"{KB}::Variant<128, 128, 64, 1, 1, {PINGPONG}, {KB}::kPlain>",
    "pp64x256_1x2_plain": f"{KB}::Variant<64, 256, 64, 1, 2, {PINGPONG}, {KB}::kPlain>",
    "pp64x256_2x1_plain": f"{KB}::Variant<64, 256, 64, 2, 1, {PINGPONG}, {KB}::kPlain>",
    "coop256x128_1x2_plain": f"{KB}::Variant<256, 128, 64, 1, 2, {COOPERATIVE}, {KB}::kPlain>",
    "coop256x128_2x1_plain": f"{KB}::Variant<256, 128, 64, 2, 1, {COOPERATIVE}, {KB}::kPlain>",
    "coop128x256_1x2_plain": f"{KB}::Variant<128, 256, 64, 1, 2, {COOPERATIVE}, {KB}::kPlain>",
    "coop128x256_2x1_plain": f"{KB}::Variant<128, 256, 64, 2, 1, {COOPERATIVE}, {KB}::kPlain>",
    # Stores straight from the accumulator registers (matmul only).
    "pp128_nosmem_plain": f"{KB}::Variant<128, 128, 64, 1, 2, {KB}::NoSmem<{PINGPONG}>, {KB}::kPlain>",
    "coop128_2x1_nosmem_plain": f"{KB}::Variant<128, 128, 64, 2, 1, {KB}::NoSmem<{COOPERATIVE}>, {KB}::kPlain>",
}


def nvcc_command(cuda_home: Path, include_dirs: list[str]) -> list[str]:
    return [str(cuda_home / "bin" / "nvcc"), "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a", f"-I{REPO / 'csrc'}", f"-I{HERE}",
            *[f"-I{d}" for d in include_dirs]]


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stderr[-4000:]}")


def build_gemm(nvcc: list[str], out: Path, jobs: int, only: list[str] | None = None) -> Path:
    gen = out / "gemm"
    gen.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(only or ()) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    variants = {name: bundle for name, bundle in VARIANTS.items() if not only or name in only}
    units = []
    for name, bundle in variants.items():
        unit = gen / f"{name}.cu"
        text = (f'// Generated by bench/kernels/build.py.\n#include "gemm_variants.cuh"\n'
                f"KERNEL_BENCH_VARIANT({name}, {bundle})\n")
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        units.append(unit)
    (gen / "variants.inc").write_text("".join(f"KERNEL_BENCH({name})\n" for name in variants))
    # A variant's object is rebuilt when it is older than its unit or than any header it may use.
    headers = [HERE / "gemm_variants.cuh", *(REPO / "csrc").rglob("*.h"), *(REPO / "csrc").rglob("*.cuh")]
    newest_header = max(h.stat().st_mtime for h in headers)
    stale = [u for u in units if not u.with_suffix(".o").exists()
             or u.with_suffix(".o").stat().st_mtime < max(u.stat().st_mtime, newest_header)]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, [[*nvcc, "-c", str(u), "-o", str(u.with_suffix(".o"))] for u in stale]))
    binary = out / "gemm_variants"
    main_obj = gen / "gemm_main.o"
    run([*nvcc, f"-I{gen}", "-c", str(HERE / "gemm_main.cu"), "-o", str(main_obj)])
    run([nvcc[0], "-gencode=arch=compute_90a,code=sm_90a", "-cudart", "static", str(main_obj),
         *[str(u.with_suffix(".o")) for u in units], "-ldl", "-o", str(binary)])
    return binary


# The single-program harnesses: --only name -> (binary, the sources compiled into it).
PROGRAMS = {
    "layer_norm": ("layer_norm_rows", [HERE / "layer_norm_rows.cu"]),
    "layer_norm_forward": ("layer_norm_forward", [HERE / "layer_norm_forward.cu"]),
    "streaming": ("streaming_add", [HERE / "streaming_add.cu"]),
    "fewrows": ("fewrows_shapes", [HERE / "fewrows_shapes.cu"]),
    "lowk": ("lowk_shapes", [HERE / "lowk_shapes.cu"]),
    # The harness with the package's reduction kernels linked in.
    "column_sums": ("column_sums", [HERE / "column_sums.cu", REPO / "csrc" / "elementwise" / "reduce_kernels.cu"]),
}


def build_program(nvcc: list[str], out: Path, name: str, sources: list[Path]) -> Path:
    binary = out / name
    run([*nvcc, "-cudart", "static", *[str(s) for s in sources], "-ldl", "-o", str(binary)])
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", choices=["gemm", *PROGRAMS], default=None)
    parser.add_argument("--variants", default="", help="comma-separated GEMM variants to build (default: all)")
    parser.add_argument("--out", type=Path, default=HERE / "build", help="output folder (default: bench/kernels/build)")
    args = parser.parse_args()
    nvcc = nvcc_command(find_cuda_home(), list(find_cutlass().include_dirs))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "gemm"):
        print("built", build_gemm(nvcc, out, args.jobs, [v for v in args.variants.split(",") if v]))
    for only, (name, sources) in PROGRAMS.items():
        if args.only in (None, only):
            print("built", build_program(nvcc, out, name, sources))


if __name__ == "__main__":
    main()
