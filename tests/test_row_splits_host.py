"""The row split of the split-row passes (bias_act's backward, act_grad: csrc/common/row_splits.h),
built with the host C++ compiler: the splits measured on an H200 (bench/NOTES.md section 42) and
the rule's bounds on a sweep of shapes, without a GPU."""

from __future__ import annotations

import math
import subprocess

import pytest

from .helpers import ROOT, compile_host_program


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("row_splits"), "row_splits_driver",
                                [ROOT / "tests" / "cpp" / "row_splits_driver.cpp"], [])


def splits(driver, cases):
    text = "".join(f"{c} {w} {m}\n" for c, w, m in cases)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == len(cases)
    return [int(v) for v in out]


def used(col_blocks, wave, s):
    blocks = col_blocks * s
    return blocks / (math.ceil(blocks / wave) * wave)


# (column blocks, wave, max splits) -> splits, for an H200's 132 SMs at three blocks an SM (the
# 16-bit bias_act backward with two rows in flight) or four (one row).
MEASURED = [
    ((256, 396, 64), 3),     # 2048x65536: one split by floor(396 / 256) left a third of the slots idle
    ((1024, 396, 16), 3),    # 512x262144: 3072 blocks, 97% of eight waves
    ((1, 396, 128), 128),    # 4096x128: all splits fit one wave, so all (121 cost a round trip)
    ((4, 396, 32), 32),      # 1024x1024: likewise (not 31)
    ((64, 396, 256), 6),     # 8192x16384: 384 blocks, one wave
    ((256, 528, 64), 2),     # 2048x65536 at four blocks an SM: 512 of 528 slots
]


@pytest.mark.parametrize("case, expected", MEASURED)
def test_measured_shapes(driver, case, expected):
    assert splits(driver, [case]) == [expected]


def test_bounds_on_a_sweep(driver):
    cases = [(c, w, m) for c in (1, 2, 3, 7, 16, 63, 64, 100, 255, 256, 1000, 4096)
             for w in (132, 396, 528, 792) for m in (1, 2, 5, 32, 128, 2048, 100000)]
    got = splits(driver, cases)
    for (c, w, m), s in zip(cases, got):
        assert 1 <= s <= max(1, min(m, 65535)), (c, w, m, s)
        if m * c <= w:
            assert s == m, (c, w, m, s)  # every split fits one wave: all of them
            continue
        limit = max(1, min(m, 65535, 4 * math.ceil(w / c)))
        assert s <= limit, (c, w, m, s)
        best = max(used(c, w, t) for t in range(1, limit + 1))
        assert used(c, w, s) >= best - 0.02 - 1e-12, (c, w, m, s)
        # the smallest such: every smaller split leaves more than 2% of the slots idle
        assert all(used(c, w, t) < best - 0.02 for t in range(1, s)), (c, w, m, s)


def test_degenerate_inputs(driver):
    # Zero column blocks count as one, a zero wave as one block; no rows to split still give one
    # split, never zero.
    assert splits(driver, [(0, 396, 10), (5, 0, 10), (5, 396, 0), (5, 396, -3)]) == [10, 1, 1, 1]
