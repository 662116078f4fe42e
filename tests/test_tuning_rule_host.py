"""How the autotuner settles a bucket (csrc/bindings/gemm_tuning_rule.h), built with the host C++
compiler: the finalists from the bursts, and the heuristic's pick kept unless beaten by more than
2% after running alone (bench/NOTES.md section 72). The GPU test in tests/ops/test_linear.py
runs the measurements themselves."""

from __future__ import annotations

import subprocess

import pytest

from .helpers import ROOT, compile_host_program


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("tuning_rule"), "tuning_rule_driver",
                                [ROOT / "tests" / "cpp" / "tuning_rule_driver.cpp"], [])


def ask(driver, line: str) -> list[int]:
    out = subprocess.run([str(driver)], input=line + "\n", capture_output=True, text=True, check=True).stdout
    return [int(v) for v in out.split()]


def finalists(driver, heuristic, burst_ms):
    return ask(driver, f"finalists {heuristic} {len(burst_ms)} " + " ".join(map(str, burst_ms)))


def settle(driver, heuristic, finals, sustained_ms):
    (winner,) = ask(driver, f"settle {heuristic} {len(finals)} " + " ".join(map(str, finals)) + " "
                    + " ".join(map(str, sustained_ms)))
    return winner


def test_finalists_are_the_heuristic_and_those_within_ten_percent(driver):
    # The measured case: the 128x128 ping-pong tile quickest in a burst, the heuristic's wide tile
    # 5% behind, two tiles 12% and 30% behind.
    burst = [2.00, 2.10, 2.24, 2.60]
    assert finalists(driver, 1, burst) == [1, 0]
    assert finalists(driver, 3, burst) == [3, 0, 1]  # the heuristic's pick always, first
    assert finalists(driver, -1, burst) == [0, 1]
    assert finalists(driver, 0, [1.0, 1.1, 1.1001, 5.0]) == [0, 1]  # 10% is the edge, inclusive


def test_one_candidate(driver):
    assert finalists(driver, 0, [3.0]) == [0]
    assert finalists(driver, -1, [3.0]) == [0]
    assert settle(driver, 0, [0], [3.0]) == 0


@pytest.mark.parametrize("heuristic_ms,expected", [(2.30, 1), (2.40, 1), (2.44, 1), (2.45, 0), (2.85, 0)])
def test_the_heuristic_stays_unless_beaten_by_more_than_two_percent(driver, heuristic_ms, expected):
    # Finalists [1 (the heuristic's pick), 0], times after running alone [heuristic_ms, 2.40]:
    # 2.40 * 1.02 = 2.448, so the heuristic's pick keeps the bucket up to 2.44 and loses from 2.45.
    assert settle(driver, 1, [1, 0], [heuristic_ms, 2.40]) == expected


def test_without_a_heuristic_the_fastest_finalist_wins(driver):
    assert settle(driver, -1, [0, 2, 3], [2.5, 2.4, 2.6]) == 2
    # A heuristic index that is not the first finalist is not favoured either.
    assert settle(driver, 2, [0, 2], [2.40, 2.44]) == 0
