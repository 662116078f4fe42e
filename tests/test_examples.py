"""The examples run as a user runs them (a separate Python process) and pass their own checks:
examples/lora_finetune.py exits non-zero where FusedLoRALinear's loss curve leaves PEFT's (or the
plain-PyTorch LoRA layer's, without peft) or either fails to fall. On a CUDA machine it trains in
bf16 on the GPU, else in fp32 on the CPU reference path."""

from __future__ import annotations

import os
import subprocess
import sys

from .helpers import ROOT


def run_example(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # The suite's environment goes with it: outputs NaN-filled before their kernels, and a CUDA
    # build problem an error rather than a fallback to the reference (tests/conftest.py).
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def test_lora_finetune_example_matches_its_peer():
    done = run_example("lora_finetune.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK: loss curves agree" in done.stdout, done.stdout[-3000:]
    assert "FusedLoRALinear" in done.stdout
