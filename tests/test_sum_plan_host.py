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
    """(outer, reduce, inner, vec, full, sm_count, l2_bytes, row_align) -> (splits, col_threads,
    row_threads, row_batch, block_once, lane_rest, row_pack)."""
    text = "".join("plan " + " ".join(map(str, c)) + "\n" for c in cases)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 7 * len(cases)
    return [tuple(int(v) for v in out[i:i + 7]) for i in range(0, len(out), 7)]


def plans(driver, cases):
    """The launch shape alone: (splits, col_threads, row_threads, row_batch)."""
    return [p[:4] for p in full_plans(driver, cases)]


def rows(n, cols, vec=8, align=None):
    """A row sum over the last dim of [n, cols] whose base and pitch are aligned to `align` elements
    (default: 16 bytes)."""
    return (n, cols, 1, vec, vec, SMS, L2, vec if align is None else align)


def columns(n, cols, vec=8, full=None):
    """A column sum over the first dim of [n, cols], `vec` elements a load (`full` in 16 bytes: the
    same by default)."""
    return (1, n, cols, vec, vec if full is None else full, SMS, L2, vec)


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
    # wide chunks that fill the GPU alone, and wide chunks split to two blocks an SM over rows of
    # 128 vectors or more (section 67: fp32 8192x3000 1.16x, 32768x4096 1.02x; bf16 4096x3000 1.11x)
    (columns(4096, 128), (16, 8, 256, 1)),
    ((512, 64, 4096, 8, 8, SMS, L2, 8), (1, 32, 256, 1)),
    (columns(8192, 3000, vec=4), (11, 32, 256, 1)),
    (columns(32768, 4096, vec=4), (8, 32, 256, 1)),
    (columns(4096, 3000), (22, 32, 256, 1)),
    # bf16 rows 3000 bytes apart: 8-byte loads (vec 4), 375 of them a row
    (columns(16384, 1500, vec=4, full=8), (22, 32, 256, 1)),
    # short rows of narrower loads keep 128-byte narrow chunks: bf16 rows 260 bytes apart (4-byte
    # loads) take 32 threads, fp32 ones (8-byte loads) 16
    (columns(65536, 130, vec=2, full=8), (176, 32, 256, 1)),
    (columns(65536, 130, vec=2, full=4), (105, 16, 256, 1)),
    # one element a thread keeps 32-thread chunks, split to the grid target for that chunk count
    (columns(4096, 100, vec=1, full=8), (64, 32, 256, 1)),
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
    bigger = case[:6] + (2 * case[6],) + case[7:]
    smaller = case[:6] + (0,) + case[7:]
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


# Unaligned 16-bit short rows as 8- or 4-byte packs, four rows a lane group (section 67):
# case -> row_pack (0: a head of single elements, then 16-byte vectors, one row a group)
ROW_PACK = [
    (rows(65536, 130, align=2), 2),     # 65 packs, 3 a lane: 1.34x
    (rows(65536, 100, align=4), 4),     # 25 packs: 1.10x
    (rows(40003, 100, align=4), 4),     # 1.07x
    (rows(65536, 20, align=4), 4),      # 1.05x
    (rows(131072, 36, align=4), 4),     # fp16: 1.06x
    (rows(65536, 130, align=1), 0),     # an odd base or pitch: no pack wider than an element
    (rows(4096, 130, align=2), 0),      # too few rows to batch: 0.95x
    (rows(16384, 250, align=2), 0),     # 125 packs, 4 a lane: 0.93x
    (rows(65536, 500, align=4), 0),     # 4 a lane, and not batched: 0.92x
    (rows(65536, 130), 0),              # 16-byte aligned rows read 16-byte vectors
    (rows(65536, 130, vec=4, align=2), 0),  # fp32 rows keep the head-vectors-tail form
    (columns(65536, 130), 0),           # not a row sum
]


@pytest.mark.parametrize("case, expected", ROW_PACK)
def test_row_pack(driver, case, expected):
    assert full_plans(driver, [case])[0][6] == expected


def ask(driver, line):
    return subprocess.run([str(driver)], input=line + "\n", capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("base, a, b, c, elem, expected", [
    (0, 256, 0, 0, 2, 8), (4096, 260, 0, 0, 2, 2), (8, 200, 0, 0, 2, 4), (2, 256, 0, 0, 2, 1),
    (4096, 520, 0, 0, 4, 2), (16, 36, 0, 0, 4, 1), (0, 0, 0, 0, 2, 8), (6, 12, 0, 0, 2, 1), (32, 48, 0, 0, 2, 8),
    (12, 48, 0, 0, 4, 1),
    # a column sum: every row's start (pitch b) and the row length c count as well
    (0, 0, 3000, 3000, 2, 4), (0, 1 << 20, 4096, 4096, 2, 8), (0, 0, 4096, 4098, 2, 1), (0, 0, 6008, 6008, 4, 2),
])
def test_pack_elements(driver, base, a, b, c, elem, expected):
    # the elements a pack may hold when the address and every byte count are multiples of its size
    assert ask(driver, f"pack {base} {a} {b} {c} {elem}") == [str(expected)]


@pytest.mark.parametrize("pack, full, expected", [(8, 8, 8), (4, 8, 4), (2, 8, 2), (1, 8, 1), (4, 4, 4), (2, 4, 2),
                                                  (1, 4, 1)])
def test_column_vec(driver, pack, full, expected):
    # 16-byte loads, else 8-byte ones, else 4-byte ones, else one element
    assert ask(driver, f"colvec {pack} {full}") == [str(expected)]


@pytest.mark.parametrize("splits, lo, hi, expected", [
    # the vector form (256 threads): 16 float4 columns keep 16 lanes up to 128 splits (one round)
    (132, 16, 256, 32), (128, 16, 256, 16), (2, 16, 256, 16), (528, 16, 256, 128), (5000, 16, 256, 256),
    # the scalar form (32 columns a block, 256 to 1024 threads): 8 lanes up to 64 splits
    (64, 8, 32, 8), (65, 8, 32, 16), (176, 8, 32, 32), (264, 8, 32, 32), (1, 8, 32, 8),
    # narrow columns: every lane of a 256-thread block
    (3, 256, 1024, 256), (4096, 256, 1024, 512), (100000, 256, 1024, 1024),
])
def test_partials_lanes(driver, splits, lo, hi, expected):
    # lanes for one round of eight loads a lane, a power of two within the block's bounds
    assert ask(driver, f"lanes {splits} {lo} {hi}") == [str(expected)]


def group_lanes(vectors):
    return 4 if vectors <= 4 else 8 if vectors <= 8 else 16 if vectors <= 16 else 32


def test_bounds_on_a_sweep(driver):
    cases = [(o, r, i, vec, full, sms, L2, align) for o in (1, 3, 100, 131, 528, 4096, 65536)
             for r in (1, 7, 36, 128, 130, 4097, 262144) for i in (1, 5, 128, 130, 4096) for full in (4, 8)
             for vec in (1, 2, 4, 8) if vec <= full and (i > 1 or vec == full) for sms in (1, 132)
             for align in (1, 2, 4, vec)]
    for case, (splits, col_threads, row_threads, row_batch, once, rest, pack) in zip(cases, full_plans(driver, cases)):
        o, r, i, vec, full, sms, _, align = case
        assert 1 <= splits <= 65535, case
        assert col_threads in (1, 2, 4, 8, 16, 32), case
        assert row_threads in (256, 512, 1024), case
        assert row_batch in (1, 4), case
        assert once == int(i == 1 and o * r * (16 // vec) <= 4 * L2), case
        assert rest in (0, 1, 2) and (rest != 1 or vec == 8), case
        assert rest == 0 or (i == 1 and row_batch == 1), case
        # packs only for unaligned 16-bit rows, as wide as the rows allow, where rows are batched
        assert pack in (0, 2, 4), case
        assert pack == 0 or (i == 1 and vec == 8 and pack <= align < 8 and row_batch == 4), case
        packs = -(-r // pack) if pack else 0
        assert pack == 0 or -(-packs // group_lanes(packs)) <= 3, case
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
