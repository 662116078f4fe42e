"""How cutlass_ext.sum launches (csrc/common/sum_plan.h), built with the host C++ compiler: the
choices measured on an H200 (bench/NOTES.md sections 47, 63, 64 and 66) and the rule's bounds on a
sweep of shapes, without a GPU."""

from __future__ import annotations

import subprocess

import pytest

from .helpers import ROOT, compile_host_program

SMS = 132  # an H200's multiprocessors; the grid target is four blocks an SM
L2 = 50 << 20  # an H200's L2 cache bytes


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("sum_plan"), "sum_plan_driver",
                                [ROOT / "tests" / "cpp" / "sum_plan_driver.cpp"], [])


def full_plans(driver, cases):
    """(outer, reduce, inner, vec, sm_count, l2_bytes) -> (splits, col_threads, row_threads, row_batch,
    block_once, lane_rest)."""
    text = "".join(" ".join(map(str, c)) + "\n" for c in cases)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 6 * len(cases)
    return [tuple(int(v) for v in out[i:i + 6]) for i in range(0, len(out), 6)]


def plans(driver, cases):
    """The launch shape alone: (splits, col_threads, row_threads, row_batch)."""
    return [p[:4] for p in full_plans(driver, cases)]


def rows(n, cols, vec=8):
    """A row sum over the last dim of [n, cols]."""
    return (n, cols, 1, vec, SMS, L2)


def columns(n, cols, vec=8):
    """A column sum over the first dim of [n, cols]."""
    return (1, n, cols, vec, SMS, L2)


# case -> (splits, col_threads, row_threads, row_batch)
MEASURED = [
    # short rows of one 16-byte vector a lane, four rows a lane group (section 64: 1.07-1.15x)
    (rows(65536, 128), (1, 32, 256, 4)),
    (rows(262144, 64), (1, 32, 256, 4)),
    (rows(65536, 128, vec=4), (1, 32, 256, 4)),
    # too few rows to keep a block an SM after batching (64 blocks), or several vectors a lane
    (rows(4096, 128), (1, 32, 256, 1)),
    (rows(1024, 1024), (1, 32, 256, 1)),
    (rows(65536, 512), (1, 32, 256, 1)),
    # long rows, few: one block a row of 512 (from half the target) or 1024 threads, no split
    # (section 63: 1.02-1.07x at 200-512 rows); 100 rows keep the splits and a second stage
    (rows(512, 262144), (1, 32, 512, 1)),
    (rows(200, 262144), (1, 32, 1024, 1)),
    (rows(100, 40000), (6, 32, 256, 1)),
    # long rows, many: a 256-thread block a row
    (rows(32768, 4096, vec=4), (1, 32, 256, 1)),
    # column sums: narrow chunks whose blocks split the rows (section 47's launch-bound 4096x128),
    # and wide chunks that fill the GPU alone
    (columns(4096, 128), (16, 8, 256, 1)),
    (columns(32768, 4096), (8, 8, 256, 1)),
    ((512, 64, 4096, 8, SMS, L2), (1, 32, 256, 1)),
]


@pytest.mark.parametrize("case, expected", MEASURED)
def test_measured_shapes(driver, case, expected):
    assert plans(driver, [case]) == [expected]


# The long-row block kernel's evict-first loads up to four times the L2 (section 65):
# case -> block_once
LOADS = [
    (rows(4096, 3000, vec=4), 1),    # 49 MB: 1.13x
    (rows(8192, 2500, vec=4), 1),    # 82 MB: 1.17x
    (rows(4096, 20000), 1),          # 164 MB: 1.04x
    (rows(16384, 3500, vec=4), 0),   # 229 MB: plain 1.04x faster
    (rows(32768, 4096, vec=4), 0),   # 537 MB: plain 1.04x faster
    (rows(512, 262144), 0),          # 268 MB
    (columns(4096, 128), 0),         # not a row sum
]


@pytest.mark.parametrize("case, expected", LOADS)
def test_block_loads_by_size(driver, case, expected):
    assert full_plans(driver, [case])[0][4] == expected
    # the same rows on a GPU of twice the L2 (and no L2) move the limit with it
    bigger = case[:5] + (2 * case[5],)
    smaller = case[:5] + (0,)
    assert full_plans(driver, [bigger])[0][4] >= expected
    assert full_plans(driver, [smaller])[0][4] == 0


# How a one-row lane group reads its last vectors (section 66): 0 one after another's add, 1 the
# lane's count modulo four together then fours (16-bit, three or more vectors a lane), 2 the deep
# kernel's rest together (three or more left to some lane after its batches of eight).
SERIAL, MOD_FOUR, BATCH = 0, 1, 2
LANE_REST = [
    (rows(1024, 1020), MOD_FOUR),        # 128 vectors, 4 a lane: 1.21x
    (rows(2048, 2000), MOD_FOUR),        # 250 vectors, 7-8 a lane: 1.15x
    (rows(1024, 1000), MOD_FOUR),        # 125 vectors, 3-4 a lane: 1.20x
    (rows(65536, 512), SERIAL),          # 2 a lane: the batched form 1.14x slower
    (rows(65536, 130), SERIAL),          # 1 a lane
    (rows(65536, 200), SERIAL),          # 25 vectors, 1 a lane
    (rows(1024, 1020, vec=4), SERIAL),   # fp32 keeps its loop
    (rows(16384, 1500, vec=4), BATCH),   # 375 vectors: 11-12 a lane, a rest of 3-4: 1.18x
    (rows(512, 2000, vec=4), BATCH),     # 500 vectors: a rest of 7: 1.13x
    (rows(1024, 4000), BATCH),           # 500 vectors: 1.12x
    (rows(8192, 2500), SERIAL),          # 312 vectors: a rest of 1-2, the batch 1.06x slower
    (rows(32768, 4096), SERIAL),         # 512 vectors: no rest
    (rows(65536, 1024, vec=4), SERIAL),  # 256 vectors: no rest
    (rows(4096, 20000), SERIAL),         # a block a row
    (columns(4096, 128), SERIAL),        # not a row sum
]


@pytest.mark.parametrize("case, expected", LANE_REST)
def test_lane_rest(driver, case, expected):
    assert full_plans(driver, [case])[0][5] == expected


def test_bounds_on_a_sweep(driver):
    cases = [(o, r, i, vec, sms, L2) for o in (1, 3, 100, 131, 528, 4096, 65536) for r in (1, 7, 128, 4097, 262144)
             for i in (1, 5, 128, 4096) for vec in (4, 8) for sms in (1, 132)]
    for case, (splits, col_threads, row_threads, row_batch, once, rest) in zip(cases, full_plans(driver, cases)):
        o, r, i, vec, sms, _ = case
        assert 1 <= splits <= 65535, case
        assert col_threads in (1, 2, 4, 8, 16, 32), case
        assert row_threads in (256, 512, 1024), case
        assert row_batch in (1, 4), case
        assert once == int(i == 1 and o * r * (16 // vec) <= 4 * L2), case
        assert rest in (0, 1, 2) and (rest != 1 or vec == 8), case
        assert rest == 0 or (i == 1 and row_batch == 1), case
        if i == 1:
            # batches only for rows of one vector a lane; larger blocks only for unsplit rows
            assert row_batch == 1 or -(-r // vec) <= 32, case
            assert row_threads == 256 or splits == 1, case
            # a split row keeps at least two blocks' worth of vectors a piece
            assert splits == 1 or r // vec // splits >= 2 * 256, case
        else:
            assert row_batch == 1 and row_threads == 256, case
            # a split column chunk gives each thread at least 8 rows
            assert splits == 1 or r // splits >= (256 // col_threads) * 8, case
