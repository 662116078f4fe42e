"""The GEMM kernel heuristic (csrc/bindings/gemm_select.cpp) without a GPU: a small driver
(tests/cpp/select_driver.cpp) compiled with the host C++ compiler runs it on the kernel table's
candidates for a forward (bf16 with a weight's transpose as B, and TF32 with either B layout), as
the binding gathers them, and the rules' expectations are recomputed here from tile counts. The GPU tests
(tests/ops/test_linear.py) check the same rules on the kernels that actually run."""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from cutlass_ext import _build, _kernel_table

from .helpers import (ROOT, aux_cooperative, compile_host_program, few_rows_tile, narrow_kernel_takes,
                      narrow_n_tile, one_round_tile_n, one_wave_tiles_take, wide_tile)

SMS = 132  # an H100 SXM / H200
# Co-resident clusters per kernel cluster size on such a GPU (a cluster stays within one GPC, so
# fewer 4-CTA clusters fit than 2-CTA ones); the binding asks the driver for these.
CLUSTERS = {1: 0, 2: 66, 4: 30}
TRANSPOSED = {16: "t64x16k128_pp", 32: "t64x32k128_pp", 64: "t64x64_pp", 128: "t64x128_pp"}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    try:
        cuda_include = _build.find_cuda_home() / "include"
    except _build.BuildError as exc:
        pytest.skip(f"no CUDA toolkit headers: {exc}")
    return compile_host_program(tmp_path_factory.mktemp("select"), "select_driver",
                                [ROOT / "tests" / "cpp" / "select_driver.cpp",
                                 ROOT / "csrc" / "bindings" / "gemm_select.cpp"], [cuda_include])


def candidate_lines(k: int, aux: bool = False, dtype: str = "bf16", a_major: str = "k",
                    b_major: str = "k", plain: bool = False) -> list[str]:
    """The binding's candidates (gemm_op: kernels_for the caller's layout, those that run depth k,
    then the transposed kernels, which read B as their first operand and A as their second) on
    the Hopper path, as driver lines, in the kernel table's order. a_major: "k" or "m" (A row-major
    or not); b_major: "k" (a weight's transpose) or "n" (a row-major [K, N] B). plain: a product
    without bias or activation, which takes a config's plain kernel where one is built."""
    def line(kernel):
        cfg = kernel.config
        if isinstance(cfg, _kernel_table.GemmConfig):
            tile_m, tile_n, cluster = cfg.tile_m, cfg.tile_n, cfg.cluster_m * cfg.cluster_n
            stream_k, transposed = cfg.stream_k, cfg.transposed
        else:
            (tile_m, tile_n), cluster, stream_k, transposed = cfg.tile, 1, False, False
        return (f"kernel {cfg.name} {kernel.family} {tile_m} {tile_n} {cluster} {int(stream_k)} {int(transposed)} "
                f"{CLUSTERS[cluster]} {int(kernel.aux)} {kernel.dtype} {int(kernel.plain)} {kernel.a_major} {kernel.b_major}")

    def on_path(kernel, a, b, transposed):  # the few-column kernel is chosen apart, before these
        return (kernel.dtype == dtype and kernel.family in ("sm90", "lowk")
                and (kernel.a_major, kernel.b_major) == (a, b) and kernel.aux == aux
                and not kernel.with_c and not kernel.ext_k and not kernel.k_slices and (plain or not kernel.plain)
                and (kernel.family == "sm90" and kernel.config.transposed) == transposed)

    def with_plain_twins(found):  # a plain product: a config's plain kernel replaces its other one
        plain_configs = {kern.config.name for kern in found if kern.plain}
        return [kern for kern in found if kern.plain or kern.config.name not in plain_configs]

    kernels = _kernel_table.all_kernels()
    direct = with_plain_twins([kern for kern in kernels
                               if on_path(kern, a_major, b_major, False) and (kern.family != "lowk" or k <= 64)])
    swapped = ("k" if b_major == "k" else "m", "k" if a_major == "k" else "n")
    transposed = with_plain_twins([kern for kern in kernels if on_path(kern, *swapped, True)])
    return [line(kern) for kern in direct + transposed]


def pick(driver, m, k, n, *, aux=False, extk=False, dtype="bf16", b_major="k", a_major="k", batch=1,
         plain=False) -> tuple[str, int]:
    """(config, split count) the heuristic picks for an m x k -> n forward (``batch`` of them) on
    SMS SMs, with N and K padded to 16 bytes as the binding passes them."""
    align = 4 if dtype == "tf32" else 8
    n_p, k_p = math.ceil(n / align) * align, math.ceil(k / align) * align
    element_size = 4 if dtype == "tf32" else 2
    query = f"query {m} {n_p} {k_p} {batch} {SMS} {int(extk)} {element_size}"
    candidates = candidate_lines(k_p, aux, dtype, a_major, b_major, plain)
    return run_query(driver, candidates + extk_lines(aux, dtype, a_major, b_major), query)


def extk_lines(aux: bool = False, dtype: str = "bf16", a_major: str = "k", b_major: str = "k") -> list[str]:
    """The extended-K kernels the binding would pass as a LoRA product's twins, as driver lines."""
    return [f"extk {kern.config.name}" for kern in _kernel_table.all_kernels()
            if kern.ext_k and kern.dtype == dtype and kern.aux == aux and (kern.a_major, kern.b_major) == (a_major, b_major)]


def ask(driver, *lines: str) -> str:
    """What the driver prints for these request lines (the last one's answer: the lines before it
    only add kernels)."""
    return subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          check=True).stdout.strip()


def run_query(driver, lines: list[str], query: str) -> tuple[str, int]:
    """(config, split count) the driver prints for ``query`` over the kernel ``lines``."""
    config, splits = ask(driver, *lines, query).split()
    return config, int(splits)


def tiles(m, n, tile_m, tile_n):
    return math.ceil(m / tile_m) * math.ceil(n / tile_n)


@pytest.mark.parametrize("m,k,n", [(512, 512, 512), (1024, 1024, 1024), (1024, 4096, 1024), (600, 1000, 700),
                                   (300, 2048, 1000), (1024, 8192, 1024)])
def test_below_half_a_wave_takes_the_narrowest_one_round_transposed_tile(driver, m, k, n):
    assert 2 * tiles(m, n, 128, 128) < SMS
    config, splits = pick(driver, m, k, n)
    one_round = [t for t in TRANSPOSED if SMS <= 2 * tiles(n, m, 64, t) <= 2 * SMS]
    if k > 4096 or not one_round:
        assert config == "128x128_1x1_coop_sk" and splits > 1, (config, splits)
    else:
        assert config == TRANSPOSED[min(one_round)], (config, one_round)


@pytest.mark.parametrize("m,k,n", [(2048, 256, 64), (8192, 256, 64), (65536, 64, 16), (4100, 200, 250),
                                   (20000, 512, 17), (3000, 2048, 64), (65536, 4096, 8), (2048, 4096, 16),
                                   (65536, 256, 64), (65536, 512, 64), (65536, 256, 72), (16384, 512, 256),
                                   (24000, 512, 256), (25344, 512, 256), (32768, 512, 256), (65536, 1024, 256),
                                   (65536, 256, 256), (65536, 512, 250)])
def test_few_columns_take_the_widest_transposed_tile_that_fills_the_sms(driver, m, k, n):
    config, _ = pick(driver, m, k, n)
    expected = narrow_n_tile(m, k, n, SMS)
    if expected is None:  # a long K keeps the other rules
        assert config not in TRANSPOSED.values(), config
    else:
        assert config == TRANSPOSED[expected], config


@pytest.mark.parametrize("m", [1, 16, 17, 24, 32, 33, 48, 64, 100, 128, 200, 256])
@pytest.mark.parametrize("k,n", [(4096, 4096), (11008, 4096), (4096, 11008)])
def test_few_rows_take_the_narrowest_transposed_tile_that_holds_them(driver, m, k, n):
    config, _ = pick(driver, m, k, n)
    expected = few_rows_tile(m, k, n, SMS)
    if expected is not None:
        assert config == TRANSPOSED[expected], config
    elif m <= 128:  # 65-256 rows past two rounds of transposed tiles: below a round of 128x128 tiles
        assert config == "128x128_1x1_coop_sk", config
    else:  # between one round of 128x128 tiles and two: one round of 128x192 tiles (116 of them)
        assert config == "128x192_2x1_coop", config


def test_few_rows_rules_for_a_forward_against_a_weight_only(driver):
    """The one-column-tile and two-round rules are the forward's (K-major A and B): another layout,
    the training forward's GELU output and LoRA's products keep the earlier rules."""
    assert pick(driver, 32, 4096, 4096)[0] == TRANSPOSED[32]
    assert pick(driver, 32, 4096, 4096, extk=True)[0] == TRANSPOSED[16]
    assert pick(driver, 64, 4096, 4096)[0] == TRANSPOSED[64]
    assert pick(driver, 64, 4096, 4096, aux=True)[0] == TRANSPOSED[32]
    assert pick(driver, 128, 4096, 11008)[0] == "128x128_1x1_coop_sk"
    assert pick(driver, 128, 4096, 11008, aux=True)[0] == TRANSPOSED[64]
    assert pick(driver, 128, 4096, 11008, extk=True)[0] == TRANSPOSED[64]
    assert pick(driver, 8192, 256, 64)[0] == TRANSPOSED[64]
    assert pick(driver, 8192, 256, 64, aux=True)[0] == TRANSPOSED[32]
    assert pick(driver, 65536, 256, 64)[0] == TRANSPOSED[128]
    assert pick(driver, 65536, 256, 64, aux=True)[0] == TRANSPOSED[64]  # the 64-wide cap holds


@pytest.mark.parametrize("m,k,n,expected", [
    (2048, 256, 64, 32),    # 64 tiles (a quarter of the SMs under the 64-wide cap) against 128 of 64x16
    (8192, 256, 64, 64),    # 128 tiles against 256 of 64x32
    (16384, 256, 64, 64),   # the 64-wide cap: 128 tiles of 64x128 would not fill the SMs
    (32768, 256, 64, 128),  # a forward against a weight passes the cap where they do (256 tiles)
    (65536, 256, 64, 128),
    (2048, 512, 256, 64),   # 128 tiles (three quarters of the SMs) against 256 of 64x32 and 64 of 64x128
    (8192, 512, 256, 128),  # 256 tiles: one round of the widest
    (2048, 1024, 256, 32),  # K > 512: the grid must fill the SMs (256 tiles of 64x32)
])
def test_narrow_layers_count_part_of_the_sms_as_filled(driver, m, k, n, expected):
    assert pick(driver, m, k, n)[0] == TRANSPOSED[expected]


def test_full_width_narrow_layers_over_three_rounds_take_the_ping_pong_tile(driver):
    # 256 columns over K >= 512 from three rounds of 128x128 tiles (25344 rows on 132 SMs): the
    # 128x128 ping-pong tile (bench/NOTES.md section 73); one row fewer keeps the transposed tile.
    assert pick(driver, 25344, 512, 256)[0] == "128x128_1x2_pp"
    assert pick(driver, 65536, 512, 256)[0] == "128x128_1x2_pp"
    assert pick(driver, 25216, 512, 256)[0] == "t64x128_pp"
    assert pick(driver, 65536, 256, 256)[0] == "t64x128_pp"  # a shorter K keeps the rule
    # The GELU training forward keeps its cooperative tile, TF32 the transposed one.
    assert pick(driver, 65536, 512, 256, aux=True)[0] == "128x128_2x1_coop"
    assert pick(driver, 65536, 512, 256, dtype="tf32")[0] == "t64x128_pp"


def test_short_k_takes_the_hand_written_kernel(driver):
    assert pick(driver, 32768, 16, 4096)[0] == "lowk_64x128"
    assert pick(driver, 8192, 64, 4096)[0] == "lowk_64x128"
    assert pick(driver, 32768, 64, 4096)[0] != "lowk_64x128"  # many rows at K = 64: CUTLASS
    # Plain products (weight gradients, LoRA's rank-r terms) over K > 32 take CUTLASS's plain
    # kernels (built for an N-major B); up to K = 32 the short-K kernel still.
    for a_major in "km":
        assert pick(driver, 4096, 64, 4096, a_major=a_major, b_major="n", plain=True)[0] != "lowk_64x128"
        assert pick(driver, 4096, 40, 11008, a_major=a_major, b_major="n", plain=True)[0] != "lowk_64x128"
        assert pick(driver, 11008, 32, 4096, a_major=a_major, b_major="n", plain=True)[0] == "lowk_64x128"
        assert pick(driver, 11008, 16, 4096, a_major=a_major, b_major="n", plain=True)[0] == "lowk_64x128"
    assert pick(driver, 4096, 64, 4096, b_major="n")[0] == "lowk_64x128"  # with bias and activation


@pytest.mark.parametrize("k", [264, 2048, 3072, 4096])
@pytest.mark.parametrize("m,n", [(512, 4096), (768, 4096), (1024, 4096), (640, 3000), (1536, 1536), (1024, 2304),
                                 (2048, 2048), (1024, 3072), (1536, 2048)])
def test_between_half_a_wave_and_two_the_fuller_last_wave_wins(driver, m, k, n):
    config, _ = pick(driver, m, k, n)
    square = tiles(m, n, 128, 128)
    assert 2 * square >= SMS and square < 2 * SMS
    fill = lambda count: count / (math.ceil(count / SMS) * SMS)  # noqa: E731
    # From K = 1024 one round of 128x144 or 128x192 tiles (from K = 4096 also 128x256 ones) over at
    # least 70% of the SMs (the one of more tiles); else the cooperative 128x128 tile from
    # K = 4096, the ping-pong one (in 1x2 clusters) below, unless the 64x128 transposed tiles or the
    # 144- or 192-wide ones (the one of fuller last wave) fill their last wave better by more than a
    # tenth.
    width = one_round_tile_n(m, k, n, SMS)
    if width is not None:
        assert 10 * tiles(m, n, 128, width) >= 7 * SMS and config == f"128x{width}_2x1_coop", config
        assert wide_tile(m, k, n, SMS) == (width == 256)
        return
    expected, best = "128x128_2x1_coop" if k >= 4096 else "128x128_1x2_pp", fill(square)
    between = max((("128x144_2x1_coop", tiles(m, n, 128, 144)), ("128x192_2x1_coop", tiles(m, n, 128, 192))),
                  key=lambda named: fill(named[1]))
    for name, count in (("t64x128_pp", tiles(n, m, 64, 128)), between):
        if fill(count) > best + 0.1:
            expected, best = name, fill(count)
    assert config == expected, config


def test_one_round_of_192_wide_tiles_where_256_wide_ones_leave_a_quarter_idle(driver):
    for m, n in ((1024, 3072), (768, 4096), (1536, 2048)):
        assert tiles(m, n, 128, 256) == 96 and tiles(m, n, 128, 192) in (128, SMS)
        assert pick(driver, m, 4096, n)[0] == "128x192_2x1_coop"
    assert pick(driver, 1024, 4096, 4096)[0] == WIDE  # 128 wide tiles; 176 of 192-wide ones
    # Below K = 4096 the 192-wide tiles still, but not the 256-wide ones; below K = 1024 neither.
    for m, k, n in ((2048, 2048, 1536), (1536, 1024, 2048), (1536, 3072, 2048)):
        assert pick(driver, m, k, n)[0] == "128x192_2x1_coop"
    assert pick(driver, 1024, 2048, 4096)[0] != WIDE
    assert pick(driver, 2048, 512, 1536)[0] != "128x192_2x1_coop"
    assert pick(driver, 1024, 4096, 3072, extk=True)[0] == "128x128_1x2_pp"  # LoRA's pair: the preferred tile


def test_one_wave_tiles_only_by_their_waves(driver):
    """The 128x144 tiles make one wave of 1536^3 (12 x 11 on 132 SMs); the wide-tile rule, which
    takes the first larger tile after the preferred one, passes over them."""
    assert tiles(1536, 1536, 128, 144) == SMS
    assert pick(driver, 1536, 1536, 1536)[0] == "128x144_2x1_coop"
    assert pick(driver, 1536, 1536, 1536, aux=True)[0] != "128x144_2x1_coop"  # not built with the aux output
    assert pick(driver, 4096, 4096, 4096)[0] == "128x256_2x1_coop"
    assert pick(driver, 8192, 8192, 8192)[0] == "128x256_2x1_coop"


@pytest.mark.parametrize("m,k,n", [(3072, 3072, 1536), (4608, 4096, 1536), (3072, 3072, 3072), (6144, 4096, 1536),
                                   (4096, 2048, 3072), (8192, 4096, 1536), (2048, 4096, 11008), (4096, 4096, 4096)])
def test_from_two_waves_one_wave_tiles_where_their_rounds_cost_less(driver, m, k, n):
    """Past two waves of 128x128 tiles the 128x144 tiles are taken where their rounds times their
    area are at most 85% of the 128x128 tiles': 3072 x 3072 -> 1536 is 264 tiles (2 rounds)
    against 288 (3 rounds). Never the 128x192 tiles."""
    assert tiles(m, n, 128, 128) >= 2 * SMS
    takes = one_wave_tiles_take(m, n, SMS)
    assert takes == ((m, k, n) in [(3072, 3072, 1536), (4608, 4096, 1536)])
    config, _ = pick(driver, m, k, n)
    assert (config == "128x144_2x1_coop") == takes, config
    assert config != "128x192_2x1_coop"
    assert pick(driver, m, k, n, aux=True)[0] != "128x144_2x1_coop"


@pytest.mark.parametrize("k", [4096, 8192])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_partial_second_wave_with_a_long_k_takes_stream_k(driver, k, b_major):
    # A last wave under half full over K >= 8192: the stream-K config, unless one round of wider
    # tiles covers the product (built for a K-major B, the weight of a linear layer).
    n = 128 * math.ceil(1.3 * SMS / 6)
    assert SMS < tiles(768, n, 128, 128) < 1.5 * SMS
    config, splits = pick(driver, 768, k, n, b_major=b_major)
    width = one_round_tile_n(768, k, n, SMS) if b_major == "k" else None
    if width is not None:
        assert (config, splits) == (f"128x{width}_2x1_coop", 1), (config, splits)
    elif k >= 8192:  # CUTLASS's stream-K decomposition (split count 0)
        assert (config, splits) == ("128x128_1x1_coop_sk", 0), (config, splits)
    else:
        assert config != "128x128_1x1_coop_sk" and splits == 1, (config, splits)
    if b_major == "k":
        assert width is not None


@pytest.mark.parametrize("k", [4096, 8192])
def test_stream_k_over_one_round_of_256_wide_tiles(driver, k):
    # 768 x k -> 4096: 192 tiles of 128x128, a second round under half full; 96 tiles of 256 (73%
    # of the SMs). Where no 144- or 192-wide tiles are built (a row-major B with the plain
    # epilogue), K >= 8192 takes the stream-K split (the 256-wide round ran 1.07x its time),
    # K = 4096 the 256-wide round. With 192-wide tiles (the bias+act forward, with or without the
    # aux output), those.
    config, splits = pick(driver, 768, k, 4096, b_major="n", plain=True)
    assert (config, splits) == (("128x128_1x1_coop_sk", 0) if k >= 8192 else (WIDE, 1)), (config, splits)
    assert pick(driver, 768, k, 4096)[0] == "128x192_2x1_coop"
    assert pick(driver, 768, k, 4096, aux=True)[0] == "128x192_2x1_coop"
    assert one_round_tile_n(768, k, 4096, SMS) == 192


def test_two_waves_take_the_2x2_cluster_where_it_needs_no_more_rounds(driver):
    wide_ctas, dp_ctas = min(SMS, 4 * CLUSTERS[4]), min(SMS, 2 * CLUSTERS[2])
    for n_tiles in (math.ceil((2 * SMS + 8) / 8), 40, math.ceil(4 * SMS / 8)):
        count = 8 * n_tiles
        takes_wide = math.ceil(count / wide_ctas) <= math.ceil(count / dp_ctas)
        config, _ = pick(driver, 1024, 512, 128 * n_tiles)
        if one_wave_tiles_take(1024, 128 * n_tiles, SMS):  # fewer rounds of 128x144 tiles (below)
            assert config == "128x144_2x1_coop", (count, config)
        else:
            assert config == ("128x128_2x2_pp" if takes_wide else "128x128_1x2_pp"), (count, config)
    assert not one_wave_tiles_take(1024, 128 * 40, SMS) and pick(driver, 1024, 512, 128 * 40)[0] == "128x128_2x2_pp"


WIDE = "128x256_2x1_coop"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("m,k,n", [(4096, 4096, 4096), (6144, 6144, 6144), (8192, 4096, 4096), (4096, 11008, 4096),
                                   (2048, 4096, 11008), (2048, 4096, 4096), (16384, 4096, 4096),
                                   (4096, 4096, 11008), (4096, 2048, 4096), (65536, 4096, 256), (1024, 8192, 8192),
                                   (8192, 8192, 8192), (16384, 4096, 11008), (2048, 11008, 4096),
                                   (3200, 4096, 4096), (2048, 4096, 2048), (1536, 4096, 4096)])
def test_several_rounds_over_a_long_k_take_the_wide_cooperative_tile(driver, m, k, n, dtype, aux):
    # 16-bit products over K >= 4096 with M, N >= 2048 and at least 1.5 rounds of 128x256 tiles
    # over the SMs whose rounds, worth twice as many 128x128 ones, are at most 1.07x those of
    # 128x128 tiles: the cooperative 128x256 tile (bench/NOTES.md sections 45-46); elsewhere the
    # 128x128 tiles. 2048 x 4096 -> 11008 needs 6 rounds of wide tiles against 11 of 128x128 ones;
    # 3200 rows 4 against 7 (stays); 2048 x 4096 -> 4096 2 against 4 (takes it); 2048 x 4096 -> 2048
    # is one round of wide tiles over 97% of the SMs (takes it by the mid-M rule, but not with
    # LoRA's second operand pair).
    wide = wide_tile(m, k, n, SMS)
    assert wide == ((m, k, n) not in [(2048, 4096, 11008), (4096, 2048, 4096), (65536, 4096, 256),
                                      (1024, 8192, 8192), (3200, 4096, 4096), (1536, 4096, 4096)])
    config, _ = pick(driver, m, k, n, aux=aux, dtype=dtype)
    assert (config == WIDE) == wide, (config, tiles(m, n, 128, 256) / SMS)
    if not wide:
        assert config.startswith("128x128_"), config
    # LoRA's extended-K products take the wide tile by the same rule (it has extended-K twins),
    # else the preferred data-parallel tile, never the other rules' configs.
    extk_wide = wide_tile(m, k, n, SMS, extk=True)
    assert pick(driver, m, k, n, extk=True, aux=aux, dtype=dtype)[0] == (WIDE if extk_wide else "128x128_1x2_pp")


def test_hopper_config_names_carry_their_cluster_shape():
    # The heuristic reads a Hopper config's cluster shape from its name ("t" first for a transposed
    # one); a transposed config in 1x1 clusters may leave it out, but never names another.
    for cfg in _kernel_table.all_configs():
        if not isinstance(cfg, _kernel_table.GemmConfig):
            continue
        prefix = "t" if cfg.transposed else ""
        shape = f"{prefix}{cfg.tile_m}x{cfg.tile_n}_{cfg.cluster_m}x{cfg.cluster_n}_"
        if not cfg.transposed or cfg.cluster_m * cfg.cluster_n > 1:
            assert cfg.name.startswith(shape), cfg.name
        else:
            named = re.match(r"t(\d+)x(\d+)_(\d+)x(\d+)_", cfg.name)
            assert named is None or cfg.name.startswith(shape), cfg.name


@pytest.mark.parametrize("batch,m,k,n,b_major", [(32, 2048, 2048, 128, "n"), (8, 4096, 4096, 128, "n"),
                                                 (32, 2048, 2048, 64, "n"), (1, 65536, 4096, 128, "k"),
                                                 (4, 16384, 2048, 100, "k")])
def test_one_column_tile_takes_no_cluster_along_n(driver, batch, m, k, n, b_major):
    # One 128-wide column tile where the pick would be the ping-pong 1x2 cluster (half its CTAs
    # would compute zero-filled columns): the widest transposed 64-row tile whose grid fills the SMs,
    # or, for a layout without transposed kernels, the 1x1 stream-K config.
    assert tiles(m, n, 128, 128) * batch >= SMS
    config, _ = pick(driver, m, k, n, b_major=b_major, batch=batch)
    fits = [t for t in TRANSPOSED if tiles(n, m, 64, t) * batch >= SMS]
    assert config == TRANSPOSED[max(fits)], (config, fits)
    config, _ = pick(driver, m, k, n, b_major="n", a_major="m", batch=batch)
    assert config == "128x128_1x1_coop_sk", config
    # Two column tiles keep the cluster.
    assert pick(driver, m, k, 256, b_major=b_major, batch=batch)[0] in ("128x128_1x2_pp", "128x128_2x2_pp")


def test_lora_products_keep_the_extended_k_config(driver):
    # Mid-M and sub-wave rules are skipped when the product carries LoRA's rank-r pair.
    assert pick(driver, 768, 4096, 4096, extk=True)[0] == "128x128_1x2_pp"
    assert pick(driver, 768, 4096, 4096)[0] != "128x128_1x2_pp"
    # The wide tile's rule applies only where the wide tile has an extended-K twin.
    assert pick(driver, 8192, 4096, 4096, extk=True)[0] == WIDE
    query = f"query 8192 4096 4096 1 {SMS} 1 2"
    assert run_query(driver, candidate_lines(4096) + ["extk 128x128_1x2_pp"], query)[0] == "128x128_1x2_pp"
    assert run_query(driver, candidate_lines(4096), query)[0] == "128x128_1x2_pp"
    # dx = [dz | s U] @ [W ; A] (an N-major B, no bias or activation) likewise.
    assert pick(driver, 8192, 4096, 4096, extk=True, b_major="n", plain=True)[0] == WIDE
    assert pick(driver, 2048, 4096, 11008, extk=True, b_major="n", plain=True)[0] == "128x128_1x2_pp"


@pytest.mark.parametrize("m,k,n", [(4096, 128, 4096), (16384, 128, 1024), (16384, 512, 1024), (16384, 1024, 1024),
                                   (65536, 512, 256), (8192, 512, 256), (2048, 512, 256), (65536, 256, 64),
                                   (16384, 2048, 1024), (4096, 1032, 4096), (300, 512, 4096), (8192, 500, 250)])
def test_short_k_training_forward_takes_the_cooperative_tile(driver, m, k, n):
    config, _ = pick(driver, m, k, n, aux=True)
    assert (config == "128x128_2x1_coop") == aux_cooperative(m, k, n, SMS), config
    # Without the aux output (a ReLU layer) the rule does not apply (beyond two waves, where no
    # other rule picks the cooperative tile).
    if aux_cooperative(m, k, n, SMS) and tiles(m, n, 128, 128) >= 2 * SMS:
        assert pick(driver, m, k, n)[0] != "128x128_2x1_coop"


def test_the_aux_forward_has_the_32_64_and_128_wide_transposed_tiles(driver):
    # The GELU training forward: three transposed tiles are built for it, which the sub-wave rule
    # takes where their grids run in one round, and the few-row rule by the rows they hold.
    assert pick(driver, 512, 512, 512, aux=True)[0] == "t64x32k128_pp"
    assert pick(driver, 1024, 1024, 1024, aux=True)[0] == "t64x128_pp"
    assert pick(driver, 256, 4096, 4096, aux=True)[0] == "t64x128_pp"
    assert pick(driver, 128, 4096, 4096, aux=True)[0] == "t64x64_pp"
    assert pick(driver, 64, 4096, 4096, aux=True)[0] == "t64x32k128_pp"


def slices(driver, m, k, n):
    """k_slices for the 128x128 K-slices kernel on an m x n product of depth k on SMS SMs."""
    return int(ask(driver, f"slices 128 128 {m} {n} {k} {SMS}"))


@pytest.mark.parametrize("m,k,n,expected", [
    (16, 65536, 64, 128),   # one tile: as many slices as SMs allow, 512 deep
    (64, 32768, 256, 64),   # two tiles
    (256, 65536, 512, 16),  # eight tiles
    (1, 2048, 256, 8),      # slices at least 256 deep
    (512, 8192, 16, 32),
    (16, 8200, 64, 25),     # 8200 = 8 x 1025: the largest count of 8-aligned slices that divides it
    (16, 8248, 64, 0),      # 8248 = 8 x 1031 (prime): no equal 8-aligned slices of at least 256
    (16, 384, 64, 0),       # too short for two slices of 256
    (1024, 8192, 1024, 2),  # 64 tiles: two slices fill 128 SMs
    (2048, 65536, 2048, 0),  # 256 tiles: more than a round already
])
def test_k_slices_cut_k_into_equal_aligned_slices_within_one_round(driver, m, k, n, expected):
    count = slices(driver, m, k, n)
    assert count == expected, count
    if count:
        assert k % (8 * count) == 0 and k // count >= 256 and tiles(m, n, 128, 128) * count <= SMS


PINGPONG_TF32 = "t64x128_pp"


@pytest.mark.parametrize("m,k,n,expected", [
    # The 64-row ping-pong tile: one round of tiles, K <= 4096; up to 64 rows only for a small B.
    (128, 4096, 4096, PINGPONG_TF32), (256, 4096, 4096, PINGPONG_TF32), (96, 4096, 4096, PINGPONG_TF32),
    (1024, 1024, 1024, PINGPONG_TF32), (512, 2048, 2048, PINGPONG_TF32),
    # Up to 512 rows of a small B over a short K: the tile of fewest rounds x width.
    (32, 1024, 1024, "t64x32k128_pp"), (96, 2048, 2048, "t64x32k128_pp"), (192, 2048, 2048, "t64x64_pp"),
    (256, 1024, 1024, "t64x32k128_pp"),
    # Split over K: the 32-wide tile where its re-reads of B stay in L2, else the narrowest at
    # least M wide, up to 128 rows.
    (1, 4096, 4096, "t128x32_coop_sk"), (32, 4096, 4096, "t128x32_coop_sk"), (64, 4096, 4096, "t128x64_coop_sk"),
    (64, 4096, 11008, "t128x64_coop_sk"), (128, 4096, 11008, "t128x128_coop_sk"),
    (128, 11008, 4096, "t128x128_coop_sk"),
    # A few 64-row tiles over a long K: split-K (the 128x32 tile's re-reads of B stay in L2).
    (32, 4096, 1024, "t128x32_coop_sk"), (128, 4096, 1024, "t128x32_coop_sk"),
    # From 129 rows: 128x128 tiles below half a wave of 128x256 tiles, else the 128x256 tiles.
    (256, 11008, 4096, "t128x128_coop_sk"), (256, 4096, 11008, "t128x256_2x1_coop_tf32"),
    (512, 4096, 4096, "t128x128_coop_sk"), (512, 4096, 11008, "t128x256_2x1_coop_tf32"),
    (1024, 2048, 2048, "t128x128_coop_sk"), (2048, 2048, 2048, "t128x256_2x1_coop_tf32"),
    (4096, 4096, 4096, "t128x256_2x1_coop_tf32"),
])
def test_tf32_with_a_row_major_b_reads_it_through_the_transposed_product(driver, m, k, n, expected):
    # The non-transposed TF32 kernels cannot read an N-major B: the transposed ones read it as their
    # M-major first operand.
    config, splits = pick(driver, m, k, n, dtype="tf32", b_major="n")
    assert config == expected, config
    if config.endswith("_sk"):
        tile_m, tile_n = map(int, re.match(r"t(\d+)x(\d+)_", config).groups())
        count = tiles(n, m, tile_m, tile_n)
        # Below a wave: as many splits over K as fit one wave (at most 16); from one wave on:
        # data-parallel when the waves are full, else CUTLASS's stream-K (0).
        assert splits == (min(SMS // count, 16) if count < SMS else int(count % SMS == 0)), (count, splits)
    else:
        assert splits == 1, splits


def test_tf32_rules_stay_with_tf32(driver):
    # A selective 16-bit build left with transposed kernels only keeps the general few-row rule
    # (the narrowest tile at least half as wide as M), not the TF32 N-major one (64x128 tiles).
    lines = [line for line in candidate_lines(4096) if line.split()[7] == "1"]
    assert run_query(driver, lines, f"query 128 4096 4096 1 {SMS} 0 2")[0] == "t64x64_pp"
    assert pick(driver, 128, 4096, 4096, dtype="tf32", b_major="n")[0] == PINGPONG_TF32


@pytest.mark.parametrize("batch,m,k,n", [(32, 2048, 2048, 128), (16, 4096, 4096, 64)])
def test_tf32_one_column_tile_takes_no_cluster_along_n(driver, batch, m, k, n):
    # The 128x256 transposed tiles' 2x1 cluster spans the caller's columns: with one tile of them,
    # half its CTAs would run on zero-filled rows.
    assert tiles(n, m, 128, 256) * batch >= SMS
    assert pick(driver, m, k, n, dtype="tf32", b_major="n", batch=batch)[0] == "t128x128_coop_sk"
    assert pick(driver, m, k, 256, dtype="tf32", b_major="n", batch=batch)[0] == "t128x256_2x1_coop_tf32"


def test_tf32_with_a_weight_takes_the_cooperative_tiles(driver):
    assert pick(driver, 4096, 4096, 4096, dtype="tf32")[0] == "128x256_2x1_coop"
    assert pick(driver, 2048, 4096, 4096, dtype="tf32")[0] == "128x256_2x1_coop"  # two rounds, the last 94% full


@pytest.mark.parametrize("m,k,n,expected", [
    # Up to 64 rows: the 32-wide ping-pong tile, not the stream-K tile of the same width.
    (16, 1024, 1024, "t64x32k128_pp"), (64, 4096, 4096, "t64x32k128_pp"), (16, 11008, 4096, "t64x32k128_pp"),
    # ... unless its tiles take more than a round, or are too few over a long K: the stream-K one.
    (16, 4096, 11008, "t128x32_coop_sk"), (64, 4096, 11008, "t128x32_coop_sk"), (32, 16384, 1024, "t128x32_coop_sk"),
    # 65-256 rows over a short K and a small B: the rounds rule, as for 16-bit types.
    (96, 2048, 2048, "t64x32k128_pp"), (256, 1024, 1024, "t64x32k128_pp"),
    # Past it: whole column tiles in one round, K <= 4096 ...
    (128, 4096, 4096, "t64x64_pp"), (256, 4096, 4096, "t64x128_pp"),
    # ... else (a partial column tile, more than a round, a longer K) the split-K 128x128 tile.
    (96, 4096, 4096, "128x128_1x1_coop_sk"), (192, 4096, 4096, "128x128_1x1_coop_sk"),
    (128, 4096, 11008, "128x128_1x1_coop_sk"), (256, 11008, 4096, "128x128_1x1_coop_sk"),
    # More rows: a nearly full round of 128x256 tiles runs data-parallel ...
    (2048, 2048, 2048, "128x256_2x1_coop"), (1024, 1024, 4096, "128x256_2x1_coop"),
    # ... a last round under half full after one or two full ones takes stream-K ...
    (512, 4096, 11008, "128x128_1x1_coop_sk"), (3072, 3072, 3072, "128x128_1x1_coop_sk"),
    # ... and so does half a round (the 64x128 tiles of the 16-bit mid-M rule are not taken).
    (1536, 1536, 1536, "128x128_1x1_coop_sk"), (512, 4096, 4096, "128x128_1x1_coop_sk"),
    # Below half a round: the 64-row transposed tiles, as for 16-bit types.
    (512, 4096, 512, "t64x32k128_pp"), (1024, 1024, 1024, "t64x128_pp"),
    # Few columns over many rows (a DLRM MLP): the narrow-N rule's 64-row tiles.
    (2048, 512, 256, "t64x32k128_pp"), (65536, 512, 256, "t64x128_pp"), (65536, 64, 16, "t64x64_pp"),
])
def test_tf32_with_a_weight(driver, m, k, n, expected):
    # Each case was measured on an H200 (bench/NOTES.md section 35).
    assert pick(driver, m, k, n, dtype="tf32")[0] == expected


@pytest.mark.parametrize("m,k,n,expected", [
    (16, 4096, 4096, "t64x32k128_pp"), (128, 4096, 4096, "t64x64_pp"), (65536, 64, 16, "t64x64_pp"),
    (2048, 256, 64, "t64x32k128_pp"), (4096, 4096, 4096, "128x256_2x1_coop"),
])
def test_tf32_training_forward_takes_the_same_tiles(driver, m, k, n, expected):
    # The aux (pre-activation) kernels of a GELU/SiLU layer include the 32-128 wide 64-row tiles.
    assert pick(driver, m, k, n, dtype="tf32", aux=True)[0] == expected


@pytest.mark.parametrize("m,k,n,expected", [
    (128, 1024, 1024, "t64x32k128_pp"),  # 64 tiles of 32: one round, against 32 of 64
    (96, 2048, 2048, "t64x32k128_pp"),   # the 64-wide tile holds the rows but costs twice the columns
    (160, 1024, 2048, "t64x64_pp"),      # 32-wide: two rounds (160 tiles); 64-wide: one (96)
    (160, 1024, 4096, "t64x32k128_pp"),  # three rounds of 32 columns beat one round of 128
    (256, 2048, 2048, "t64x64_pp"),      # a tie of 2 x 32 and 1 x 64 columns: the wider tile
    (256, 1024, 4096, "t64x128_pp"),     # 4 x 32, 2 x 64 and 1 x 128: the widest
])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_few_rows_over_a_short_k_take_the_tile_of_fewest_round_columns(driver, m, k, n, expected, b_major):
    assert pick(driver, m, k, n, b_major=b_major) == (expected, 1)


def test_rounds_rule_keeps_to_its_measured_range(driver):
    assert pick(driver, 64, 2048, 1024) == ("t64x32k128_pp", 1)  # up to 64 rows: the narrowest holding them
    assert pick(driver, 160, 4096, 4096)[0] == "t64x128_pp"  # K > 2048
    # B over 8M elements: not the rounds rule's 32-wide tile; 344 tiles of 64x128 (2.6 rounds) leave
    # the transposed rule for one round of 128x192 tiles
    assert pick(driver, 160, 2048, 11008)[0] == "128x192_2x1_coop"
    assert pick(driver, 128, 1024, 1024, aux=True)[0] == "t64x32k128_pp"  # the aux tiles follow it too


@pytest.mark.parametrize("exact,k,outputs,in_place,expected", [
    (True, 32, 2**30, True, True),      # without TF32 every K <= 32, however many outputs
    (True, 33, 1, False, False),        # past the kernel's depth
    (False, 13, 2**24, False, True),    # copied operands: up to 2^24 outputs
    (False, 13, 2**24 + 1, False, False),
    (False, 32, 2**20, False, True),
    (False, 16, 2**21, True, True),     # operands in place: K <= 16 and up to 2^21 outputs
    (False, 16, 2**21 + 1, True, False),
    (False, 20, 1024, True, False),
])
def test_short_k_fp32_kernel_takes_few_outputs_under_tf32(driver, exact, k, outputs, in_place, expected):
    assert ask(driver, f"ffma {int(exact)} {k} {outputs} {int(in_place)}") == str(int(expected))


@pytest.mark.parametrize("fp32,exact,rows,n,expected", [
    (True, True, 2**30, 16, True),    # exact fp32: always up to 16 columns
    (True, True, 2**30, 17, False),
    (True, False, 16384, 16, True),   # TF32: up to 16 columns over up to 16384 rows,
    (True, False, 16385, 16, False),  # then the transposed 64-row tiles where N is a multiple of 4
    (True, False, 16385, 8, False),
    (True, False, 2**30, 13, True),   # (the tiles would copy B and D otherwise)
    (True, False, 2**30, 4, True),
    (True, False, 1, 16, True),
    (False, False, 1, 4, True),       # 16-bit types: up to 4
    (False, False, 1, 5, False),
    (False, False, 2**30, 1, True),
])
def test_few_column_kernel_takes_up_to_16_columns_in_fp32_over_few_rows(driver, fp32, exact, rows, n, expected):
    assert ask(driver, f"gemv {int(fp32)} {int(exact)} {rows} {n}") == str(int(expected))


@pytest.mark.parametrize("rows,n,k,expected", [
    (512, 16, 64, True), (511, 16, 64, False), (2**30, 16, 64, True),  # from 512 rows
    (65536, 4, 64, False), (65536, 5, 64, True),                       # past the few-column kernel's 4 columns
    (65536, 32, 64, True), (65536, 33, 64, False),                     # N K <= 2048
    (65536, 64, 32, True), (65536, 64, 16, True), (65536, 72, 8, False),  # N <= 64
    (65536, 16, 72, False), (65536, 16, 128, False),                   # K <= 64
])
def test_narrow_kernel_takes_narrow_short_products(driver, rows, n, k, expected):
    assert ask(driver, f"narrow {rows} {n} {k}") == str(int(expected))
    assert narrow_kernel_takes(rows, k, n) == expected  # the GPU tests' model of the rule


@pytest.mark.parametrize("tile_n, transposed, m, k, expected", [
    (64, 1, 128, 4096, False),    # 128 x 4096 -> 4096 on the 64x64 transposed tile: two column tiles
    (128, 1, 256, 11008, False),  # 256 rows on the 64x128 transposed tile over K = 11008
    (32, 1, 33, 4096, False),     # the rows just past one 32-wide column tile
    (128, 1, 128, 4096, True),    # one column tile (the 64x128 tile at 128 rows)
    (16, 1, 16, 4096, True),      # decode rows on the 64x16 tile
    (32, 1, 1024, 1024, True),    # 1024^3 on the 64x32 tile: K below kPlainLaunchMinK
    (64, 1, 128, 4095, True),
    (128, 0, 512, 4096, True),    # non-transposed tiles always
])
def test_dependent_launch_pays(driver, tile_n, transposed, m, k, expected):
    """Transposed tiles whose column tiles split the caller's rows over K >= 4096 launch the usual
    way (csrc/bindings/gemm_select.h: dependent_launch_pays); every other kernel that waits for the
    prior grid at its start launches as its programmatic dependent."""
    assert ask(driver, f"dependent {tile_n} {transposed} {m} {k}") == str(int(expected))
