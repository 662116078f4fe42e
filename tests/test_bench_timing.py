"""The benchmarks' sustained timing order (bench/_common.py), checked without a GPU."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _common import Timer, add_timer_arguments, block_order, timer_settings  # noqa: E402


@pytest.mark.parametrize("iters", [1, 2, 5, 30])
@pytest.mark.parametrize("names", [["ours"], ["ours", "cublas"], ["ours", "eager", "compile", "cublaslt"]])
def test_block_order_samples_and_drift(names, iters):
    blocks = block_order(names, iters)
    for name in names:
        assert sum(n for b, n in blocks if b == name) == iters
    if iters % 2 == 0:
        # Samples at positions 0, 1, ... in time: a drift linear in time adds the same mean to
        # every provider when each provider's mean position is the same.
        t, mean = 0, {}
        for name, n in blocks:
            mean.setdefault(name, []).extend(range(t, t + n))
            t += n
        means = {name: sum(p) / len(p) for name, p in mean.items()}
        assert max(means.values()) - min(means.values()) < 1e-9, means
    assert all(n > 0 for _, n in blocks)


def test_sustain_is_checked():
    with pytest.raises(ValueError, match="sustain"):
        Timer.__init__(object.__new__(Timer), sustain=-1.0)


def test_precede_is_checked():
    with pytest.raises(ValueError, match="precede"):
        Timer.__init__(object.__new__(Timer), precede="cublas")


def test_precede_option():
    parser = argparse.ArgumentParser()
    add_timer_arguments(parser, iters=10)
    assert parser.parse_args([]).precede == "none"
    assert parser.parse_args(["--precede", "gemm"]).precede == "gemm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--precede", "copy"])


@pytest.mark.parametrize("flush", [True, False])
def test_timer_settings_record_the_options(flush):
    parser = argparse.ArgumentParser()
    add_timer_arguments(parser, iters=10, flush=flush)
    args = parser.parse_args(["--sustain", "0.5", "--precede", "gemm"] + (["--flush", "read"] if flush else []))
    expected = {"sustain_s": 0.5, "precede": "gemm"}
    assert timer_settings(args) == ({"flush": "read", **expected} if flush else expected)
