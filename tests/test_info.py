import os
import subprocess
import sys


def test_info_runs_and_lists_ops():
    out = subprocess.run([sys.executable, "-m", "cutlass_ext.info", "--kernels"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("cutlass_ext::linear", "cutlass_ext::matmul", "cutlass_ext::_act_grad", "CUTLASS:", "nvcc:",
                   "cache dir:", "GEMM configs:", "128x256_2x1_coop", "sm90_tf32_kk_bias_act_128x256_2x1_coop",
                   "t64x16k128_pp", "sm80_128x128", "sm80_bf16_mn_bias_act_sm80_128x128", "GEMM tuning table:",
                   "GEMM launch (CUTLASS_EXT_GEMM_DEPENDENT): on Hopper,",
                   "sm90_bf16_kk_bias_act_128x128_1x2_pp  (waits for the kernel before it at its start)"):
        assert needle in text, text
    # Stream-K and extended-K kernels do not wait at their start.
    assert "sm90_bf16_kk_bias_act_128x128_1x1_coop_sk\n" in text
    assert "sm90_bf16_kk_extk_bias_act_128x128_1x2_pp\n" in text


def test_info_reports_the_dependent_launch_switched_off():
    env = dict(os.environ, CUTLASS_EXT_GEMM_DEPENDENT="0")
    out = subprocess.run([sys.executable, "-m", "cutlass_ext.info"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "GEMM launch (CUTLASS_EXT_GEMM_DEPENDENT): off, every GEMM launches the usual way" in out.stdout
