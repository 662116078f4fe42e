import subprocess
import sys


def test_info_runs_and_lists_ops():
    out = subprocess.run([sys.executable, "-m", "cutlass_ext.info", "--kernels"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("cutlass_ext::linear", "cutlass_ext::matmul", "cutlass_ext::_act_grad", "CUTLASS:", "nvcc:",
                   "cache dir:", "GEMM configs:", "128x256_2x1_coop", "sm90_tf32_kk_bias_act_128x256_2x1_coop",
                   "t64x16k128_pp", "sm80_128x128", "sm80_bf16_mn_bias_act_sm80_128x128", "GEMM tuning table:"):
        assert needle in text, text
