"""The kernel-level benchmark harnesses of bench/kernels that compile the package's own code (the
row and column sums' plan and kernels, the few-row and short-K GEMMs) and the streaming harness, built with
nvcc where the toolchain is present: a change to csrc/ that breaks a harness fails here rather than
on the next GPU run. The layer_norm and GEMM-variant harnesses take minutes and are left out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import ROOT, cuda_toolchain_available


@pytest.mark.skipif(not cuda_toolchain_available(), reason="needs nvcc and the CUTLASS headers")
@pytest.mark.parametrize("program, binary", [("column_sums", "column_sums"), ("fewrows", "fewrows_shapes"),
                                             ("lowk", "lowk_shapes"), ("streaming", "streaming_add")])
def test_harness_builds(tmp_path, program, binary):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels" / "build.py"), "--only", program,
                             "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / binary).is_file()


def _virtual_arch(flags) -> int:
    """The __CUDA_ARCH__ (major * 100 + minor * 10) of the one -gencode flag among ``flags``."""
    gencodes = [f for f in flags if f.startswith("-gencode=")]
    assert len(gencodes) == 1, gencodes
    digits = gencodes[0].split("compute_", 1)[1].split(",", 1)[0].rstrip("a")
    return int(digits) * 10


def test_harnesses_compile_the_hand_written_gemms_for_the_packages_arch():
    """The harnesses time csrc's hand-written GEMMs as the package runs them only where both are
    compiled with the same __CUDA_ARCH__ (its sm_90 code paths, such as stmatrix, depend on it):
    the short-K kernel once took its pre-sm90 epilogue in the package, compiled from compute_80,
    while the harness timed its stmatrix one."""
    import importlib.util

    from cutlass_ext import _kernel_table

    spec = importlib.util.spec_from_file_location("kernels_build", ROOT / "bench" / "kernels" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    harness = _virtual_arch(build.nvcc_command(ROOT, []))
    hand_written = [k for k in _kernel_table.select_kernels("", ("90a",)) if k.hand_written]
    assert {k.family for k in hand_written} >= {"lowk", "fewrows"}
    for kernel in hand_written:
        assert _virtual_arch(kernel.gencodes(("90a",))) == harness == 900, kernel.name
