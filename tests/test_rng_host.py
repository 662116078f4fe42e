"""The dropout keep flags of csrc/common/counter_rng.h, built with the host C++ compiler, against
the Python twin (cutlass_ext/ops/_rng.py) without a GPU: the vector form that the kernels use
(dropout_keep_run over pair hashes, with its whole-word compare for odd elements) and the
one-element form, at keep thresholds from 0 to 2**16 and counters on both sides of 2**32."""

from __future__ import annotations

import random
import subprocess

import pytest
import torch

from cutlass_ext.ops import _rng

from .helpers import ROOT, compile_host_program


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("rng"), "rng_driver",
                                [ROOT / "tests" / "cpp" / "rng_driver.cpp"], [])


def test_keep_flags_match_twin(driver):
    rnd = random.Random(5)
    # p = 0 keeps all, p = 1 keeps none; 2**-16 and 1 - 2**-16 are the thresholds 1 and 2**16 - 1.
    probabilities = [0.0, 2.0**-16, 0.1, 0.5, 0.9, 1.0 - 2.0**-16, 1.0]
    cases = []
    for p in probabilities:
        for _ in range(40):
            seed = rnd.randrange(-(2**63), 2**63)
            index = rnd.choice([rnd.randrange(0, 2**20), rnd.randrange(2**32 - 64, 2**32 + 64),
                                rnd.randrange(0, 2**40)]) // 8 * 8
            cases.append((seed, index, p))
    # A pair whose hash is at least 0xffff0001: its odd element's draw is 0xffff, the largest, and
    # the whole-word compare must still drop it at p = 1.
    seed = 2024
    counters = torch.arange(1 << 20, dtype=torch.int64)
    h = _rng.bits(torch.tensor([seed]), counters)
    n = int(counters[h >= 0xFFFF0001][0])
    cases += [(seed, 2 * n // 8 * 8, p) for p in (1.0, 1.0 - 2.0**-16, 0.5)]
    lines = "".join(f"{s} {i} {p!r}\n" for s, i, p in cases)
    out = subprocess.run([str(driver)], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
    assert len([line for line in out if line]) == len(cases)
    for (seed, index, p), line in zip(cases, out):
        run, one = line.split()
        idx = torch.arange(index, index + 8, dtype=torch.int64)
        expected = "".join("1" if k else "0" for k in _rng.dropout_keep(torch.tensor([seed]), idx, p).tolist())
        assert run == expected, (seed, index, p)
        assert one == expected, (seed, index, p)
    # Both ends and the middle were drawn: every flag kept at p = 0, none at p = 1.
    assert all(line.split()[0] == "11111111" for (_, _, p), line in zip(cases, out) if p == 0.0)
    assert all(line.split()[0] == "00000000" for (_, _, p), line in zip(cases, out) if p == 1.0)
