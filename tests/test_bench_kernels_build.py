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
