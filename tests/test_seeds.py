"""The per-test seeds of conftest.py: fixed by the test's id (so a failure reproduces in another
process, which Python's salted string hash would not give), different between tests, and shifted
as a whole by CUTLASS_EXT_TEST_SEED."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import seed_of
from .helpers import ROOT

IDS = ["tests/ops/test_linear.py::test_few_column_backward[bf16-65536-256-1]",
       "tests/ops/test_linear.py::test_few_column_backward[fp16-65536-256-1]"]


def test_seeds_are_the_same_in_another_process():
    code = "from tests.conftest import seed_of; import sys; print(*(seed_of(i) for i in sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, *IDS], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONHASHSEED="random"))
    assert out.stdout.split() == [str(seed_of(i)) for i in IDS]


def test_seeds_differ_between_tests_and_shift_with_the_setting(monkeypatch):
    first = [seed_of(i) for i in IDS]
    assert first[0] != first[1]
    monkeypatch.setenv("CUTLASS_EXT_TEST_SEED", "5")
    assert [seed_of(i) for i in IDS] == [(s + 5) % 2**31 for s in first]
