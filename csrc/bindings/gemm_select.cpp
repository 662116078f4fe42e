// GEMM kernel selection (gemm_select.h): the shape heuristic over the built kernels that can run
// a product. Torch-free: plain C++, so that tests compile and run it without a GPU.
#include "bindings/gemm_select.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

namespace cutlass_ext {
namespace {

// Rows up to which the transposed product is preferred (when such kernels are built).
constexpr int64_t kTransposedMaxM = 256;
// Each transposed tile runs all of K. Below a quarter of the SMs' worth of tiles the narrow
// transposed tiles (up to 64 rows) still beat splitting K for K up to 12288 from 8 tiles: measured
// on the H200 for LoRA's rank-r products (r = 8-64 rows x 512-2048 columns, K = 4096 and 11008),
// 12-24 us against 35-52 us for the split-K 128x128 tile. Longer K (a weight gradient over many
// rows) and wider row counts (not measured) still split.
constexpr int64_t kTransposedShortKMaxM = 64;
constexpr int64_t kTransposedShortK = 12288;
constexpr int64_t kTransposedMinTiles = 8;
// A 16-bit forward against a weight (K-major A and B, no aux output or LoRA pair), up to
// kTransposedShortKMaxM rows: the transposed tile that holds the rows in one column tile more than
// half full, where its grid covers at least a quarter of the SMs; two column tiles of half the
// width re-read each weight tile and ran slower. Measured on an H200 (bf16 bias+ReLU, each config's CUDA graph alone, every
// call's weight out of L2; bench/NOTES.md section 75): 32 x 4096 -> 4096 11.4 us on the 64x32 tile
// against 12.9 on the 64x16 one, 32 x 11008 -> 4096 24.3 against 26.2, 64 x 4096 -> 4096 11.8 on
// the 64x64 tile against 13.0 on the 64x32 one, 64 x 4096 -> 11008 and 64 x 11008 -> 4096 within
// 3% either way. At 128 rows two 64-wide column tiles stayed ahead of one 128-wide (128 x 11008 ->
// 4096: 32.3 against 36.9 us).
// Past that, 65-256 rows whose transposed grid takes more than kTransposedMaxRounds rounds over
// the SMs leave the transposed rule for the general ones (the stream-K 128x128 tile below one
// round of 128x128 tiles, the one-round 128x192 / 128x256 tiles between one and two): 128 x 4096
// -> 11008 (344 tiles of 64x64) 33.0 us on the stream-K tile against 35.0, 256 x 4096 -> 11008
// (344 of 64x128) 44.4 on the 128x192 tiles against 50.6.
constexpr int64_t kTransposedMaxRounds = 2;
// 65-256 rows with K <= kRoundsMaxK and B of at most kRoundsMaxElements (16 MB of 16-bit values):
// the non-split transposed tile whose rounds of tiles cost the fewest columns
// (fewest_round_columns). On the H200 (bf16 matmul and linear, 64-256 rows x K 512-2048 x
// N 1024-4096: bench/NOTES.md section 34) it was within 2.1% of the best transposed tile on each
// of 84 shapes, where taking the narrowest tile that holds the rows had been up to 1.23x slower.
// Longer K and larger B were not measured and keep the rules below.
constexpr int64_t kRoundsMaxK = 2048;
constexpr int64_t kRoundsMaxElements = int64_t(8) << 20;
constexpr int kRoundsMinTileN = 32;
// TF32 with an N-major B (transposed kernels only; tf32_n_major_kernel). The 64-row ping-pong
// tile up to this many rows, in one round of tiles, with K up to kTf32PingpongMaxK; past
// kTf32PingpongShortK only on a quarter of the SMs or more (a few CTAs over a long K stream too
// little), and at most 64 rows only where B has at most kTf32SmallBElements (16 MB of fp32).
constexpr int64_t kTf32PingpongMaxM = 1024;
constexpr int64_t kTf32PingpongMaxK = 4096;
constexpr int64_t kTf32PingpongShortK = 2048;
constexpr int64_t kTf32SmallBElements = int64_t(4) << 20;
constexpr int64_t kTf32RoundsMaxM = 512;  // the rounds rule's rows with an N-major B (tf32_n_major_kernel)
// TF32 with a K-major B, more than kTransposedMaxM rows: the data-parallel 128x256 tiles where
// they fill at least kTf32OneRoundFill of one round, and the stream-K config where the last of
// two or three rounds is less than half full (tf32_round_kernel).
constexpr double kTf32OneRoundFill = 0.75;
constexpr int64_t kTf32StreamKMaxRounds = 3;
// Else up to kTransposedMaxM rows: the narrowest stream-K tile re-reads B once per tile_n rows of
// A; while those reads total at most this many elements (64 MB of fp32, B held in L2) its CTAs
// beat the wider tiles.
constexpr int64_t kTransposedRereadMaxElements = int64_t(16) << 20;
// Few columns over many rows (a narrow MLP layer, N <= 256 after padding) with a short K: the
// transposed product puts the columns in one to four 64-row tiles (select_kernel).
constexpr int64_t kNarrowNMaxN = 256;
constexpr int64_t kNarrowNMaxK = 1024;
// Up to 16 columns the rule holds to K = 4096 (bench/gemm_configs.py --set fewcols, H200): at
// 65536 x 4096 -> 8 the 64x128 transposed tile took 153 us where the default 128-wide tiles took
// 294, at 2048 x 4096 -> 16 the 64x16 one 19.5 us against 36.4.
constexpr int64_t kNarrowNFewColumnsMaxN = 16;
constexpr int64_t kNarrowNFewColumnsMaxK = 4096;
// Up to 64 columns with K <= 256 (one to four k-steps a tile) no tile wider than 64 rows: the
// 128-wide tile ran 1.15-1.23x slower than the 64-wide one although both grids fill the SMs
// (CUDA-graph replays on an H200, bf16 bias+GELU, bench/NOTES.md section 22): 65536 x 64 -> 16
// 17.4 against 14.3 us (18.7 against 15.6 with the pre-activation output), 32768 x 64 -> 16 10.4
// against 8.8, 65536 x 256 -> 64 20.4 against 16.6.
// A 16-bit forward against a weight (no aux output) passes the cap where the wider tile's grid
// fills the SMs: there the 64x128 tile ran 1.04-1.07x faster than the 64x64 one with the operands
// in L2 (each config's CUDA graph alone, H200, bench/NOTES.md section 75: 32768 x 256 -> 64 6.2
// against 6.6 us with ReLU, 7.4 against 7.8 with GELU; 65536 rows 10.1 against 10.8, 12.6 against
// 13.2), which section 22's bias+GELU runs with the aux output did not show. Another machine
// (section 76) had the two within 3-5% in either order, in L2 and out of it.
constexpr int64_t kNarrowNCappedMaxN = 64;
constexpr int64_t kNarrowNCappedMaxK = 256;
constexpr int64_t kNarrowNCappedTile = 64;
// A 16-bit forward against a weight with K <= 512: a grid of a quarter of the SMs' worth of tiles
// counts as filling them where the tile is capped (above), three quarters elsewhere. One round of
// fewer, wider tiles ran faster than more rounds of narrower ones (H200, bf16 bias+ReLU, each
// config's CUDA graph alone, operands in L2 / out of it; bench/NOTES.md section 75): 2048 x 256 ->
// 64 2.5 / 2.8 us on 64 tiles of 64x32 against 3.1 / 3.2 on 128 of 64x16 (32 of 64x64: 2.7 / 3.0),
// 8192 x 256 -> 64 3.5 / 3.9 on 128 of 64x64 against 3.9 / 4.2 on 256 of 64x32, 2048 x 512 -> 256
// 4.1 / 4.3 on 128 of 64x64 against 4.5 / 4.6 on 256 of 64x32 (64 of 64x128: 4.1 / 4.5).
constexpr int64_t kNarrowNShortFillMaxK = 512;
// 16-bit layers of the rule's full 256 columns over K >= 512 leave it from three rounds of 128x128
// tiles on: there the 128x128 ping-pong tile ran bias+ReLU forwards 1.06-1.09x faster than the
// 64x128 transposed tile (bench/linear.py --graphs --sets dlrm against --config 128x128_1x2_pp,
// H200, bench/NOTES.md section 73: 32768 x 512 -> 256 23.9 against 25.4-25.7 us, 65536 rows
// 38.1 against 41.6-41.7); at 8192 rows (one round) it ran slower, 13.5 against 12.6-12.8.
constexpr int64_t kNarrowNWideMinK = 512;
constexpr int64_t kNarrowNWideMinRounds = 3;
// Training forwards of GELU/SiLU layers (an aux kernel: the epilogue evaluates the activation and
// also stores the pre-activation) over a short K are bound by that epilogue, which a ping-pong CTA
// runs on one math warpgroup at a time (one warp per scheduler, each dependent instruction waits)
// and a cooperative CTA on both. With 256 or more columns, K up to 1024 and at least half a wave
// of 128x128 tiles, the cooperative 128x128 tile. Measured on an H200 (bf16 bias+GELU with the
// pre-activation, CUDA-graph replays, bench/NOTES.md section 23): 4096 x 128 -> 4096 85.7 -> 47.5
// us, 16384 x 128 -> 1024 80.0 -> 46.3, 16384 x 512 -> 1024 80.5 -> 61.7, 65536 x 512 -> 256
// 70.2 -> 62.2, 8192 x 512 -> 256 (128 tiles) 12.6 -> 10.9; it lost with 32 tiles (2048 x 512 ->
// 256: 6.0 -> 9.9), with 64 columns (65536 x 256 -> 64: 19.9 -> 28.1) and at K = 2048 (16384 x
// 2048 -> 1024: 113.7 -> 132.0). Without the aux output (a ReLU layer) it gained nothing.
constexpr int64_t kAuxCooperativeMaxK = 1024;
constexpr int64_t kAuxCooperativeMinN = 256;
// Shortest K for which a stream-K decomposition of a partial second wave is chosen (select_kernel).
constexpr int64_t kStreamKMinK = 8192;
// Between half a wave and two waves of 128x128 tiles, the cooperative 128x128 tile is preferred
// over at least this K (or with the aux output); over a shorter K the ping-pong tile, whose
// second math warpgroup runs its tile while the first one's epilogue stores. Measured on an H200
// (bf16 bias+ReLU, CUDA-graph replays, bench/NOTES.md section 53), ping-pong over cooperative:
// K = 1024 1.07-1.08x (1024 x 1024 -> 4096, 2048 x 1024 -> 2048), K = 1536-2048 1.00-1.05x,
// K = 3072 0.98-1.03x; at K = 4096 cooperative 1.05-1.11x (512 and 1024 x 4096 -> 4096).
constexpr int64_t kMidCooperativeMinK = 4096;
// From two waves of the preferred tiles, the 128x144 tiles where their rounds over the SMs times
// their area are at most this percentage of the preferred tile's. Per round and area they ran
// 1.03-1.15x slower than the 128x128 ping-pong tiles on an H200 (section 53): at 85% they won
// (3072 x 3072 -> 1536 0.86x the time, 4608 x 4096 -> 1536 0.93x), at 90% they tied.
constexpr int64_t kOneWaveMaxAreaPct = 85;
// The one round of 128x144 or 128x192 tiles between one and two rounds of 128x128 tiles
// (select_kernel's mid_round) applies from this K, the shortest measured; the 128x256 tile joins
// it from kMidCooperativeMinK.
constexpr int64_t kOneRoundMinK = 1024;
// 16-bit products over at least this K, with M and N at least kWideMinMN and at least 1.5 rounds of
// 128x256 tiles over the SMs, take the cooperative 128x256 tile where its rounds, weighted by its
// tile area and discounted by kWideGainPct, do not exceed the preferred tile's (select_kernel).
constexpr int64_t kWideMinK = 4096;
constexpr int64_t kWideMinMN = 2048;
constexpr int64_t kWideGainPct = 7;
// Below half a wave of 128x128 tiles, products up to this K take the transposed 64-row tiles
// instead of splitting K (select_kernel); longer K (a weight gradient over many rows) still splits.
constexpr int64_t kSubWaveTransposedMaxK = 4096;
// The hand-written short-K kernel holds all of K in shared memory (K <= 64); it is preferred up to
// K = 32, and up to K = 64 for at most 8192 rows. Measured on an H200 (bench/gemm_configs.py --set
// shortk, persistent short-K kernel): at K = 16 it beat every CUTLASS config on every shape; at
// K = 64 it beat the CUTLASS default up to 8192 rows (2048 x 64 x 4096: 20.5 vs 25.7 us) and lost
// to it at 32768 rows (198.9 vs 187.7 us). Those were bias-and-activation products; a plain
// product over K > 32 takes CUTLASS's plain-epilogue kernels instead (select_kernel), which ran
// 1.4-1.8x faster than the short-K kernel at K = 64 (bf16, H200: 2048 x 64 x 11008 with an
// N-major B 18.6 against 33.3 us, a 4096 x 64 x 4096 weight gradient 15.4 against 25.6).
constexpr int64_t kLowKMaxK = 64;
constexpr int64_t kLowKPreferredMaxK = 32;
constexpr int64_t kLowKLongMaxRows = 8192;

// CTAs of a cluster along the caller's N for a Hopper config, from its name
// ("<tile_m>x<tile_n>_<cluster_m>x<cluster_n>_...", with a leading "t" for a transposed one, whose
// M is the caller's N: the kernel table's convention, which tests/test_select.py checks); 1 for a
// config named without a cluster and for every other kernel.
int cluster_along_n(const GemmKernelEntry& e) {
  int tm = 0, tn = 0, cm = 0, cn = 0;
  if (e.family == nullptr || std::strcmp(e.family, "sm90") != 0 ||
      std::sscanf(e.config + (e.transposed ? 1 : 0), "%dx%d_%dx%d_", &tm, &tn, &cm, &cn) != 4) {
    return 1;
  }
  return e.transposed ? cm : cn;
}

// Rounds of `tiles` output tiles over `sms` SMs (a persistent grid's busiest CTA runs this many).
int64_t rounds_over(int64_t tiles, int sms) { return (tiles + sms - 1) / sms; }

// Whether the caller's N columns fit one column tile of `e` (its tile_m for a transposed config)
// while its cluster spans more than one: the cluster's other CTAs then compute zero-filled
// columns, half or more of the grid's work.
bool one_column_tile_under_cluster(const GemmKernelEntry& e, int64_t N) {
  return N <= (e.transposed ? e.tile_m : e.tile_n) && cluster_along_n(e) > 1;
}

// The data-parallel tiles between 128 and 256 wide (128x144, 128x192): built for the products
// whose tiles they fit into whole rounds, and taken only by the rules that compare rounds.
bool is_one_wave_tile(const GemmKernelEntry& e) {
  return !e.transposed && !e.stream_k && e.tile_n > 128 && e.tile_n < 256;
}

// Of the tiles as tall as `dp` that are 144 or 192 wide (and, with `with_wide`, twice as wide as
// `dp`), the one whose M x N output makes one round over at least 70% of the SMs, the one of more
// tiles (on a tie the wider); nullptr if none does.
const GemmKernelEntry* one_round_tile(const std::vector<const GemmKernelEntry*>& cutlass, const GemmKernelEntry& dp,
                                      int64_t M, int64_t N, int64_t L, int sms, bool with_wide) {
  const GemmKernelEntry* round = nullptr;
  int64_t round_tiles = 0;
  for (const GemmKernelEntry* e : cutlass) {
    const bool wide = e->tile_n == 2 * dp.tile_n && with_wide;
    if (e->transposed || e->stream_k || e->tile_m != dp.tile_m || (!wide && !is_one_wave_tile(*e))) continue;
    const int64_t tiles = output_tiles(*e, M, N, L);
    if (tiles <= sms && 10 * tiles >= 7 * int64_t(sms) &&
        (tiles > round_tiles || (tiles == round_tiles && e->tile_n > round->tile_n))) {
      round = e;
      round_tiles = tiles;
    }
  }
  return round;
}

}  // namespace

int64_t output_tiles(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t L) {
  if (kernel.transposed) std::swap(M, N);
  return (M + kernel.tile_m - 1) / kernel.tile_m * ((N + kernel.tile_n - 1) / kernel.tile_n) * L;
}

bool is_lowk(const GemmKernelEntry& e) { return std::strcmp(e.family, "lowk") == 0; }

bool lowk_takes(int64_t K, int64_t M, int64_t L) {
  return K <= kLowKPreferredMaxK || (K <= kLowKMaxK && M * L <= kLowKLongMaxRows);
}

constexpr int64_t kGemv16BitChosenMaxN = 4;  // 16-bit types, and TF32 over many rows (gemm_select.h)
constexpr int64_t kGemvF32MaxRows = 16384;     // TF32 products with 8, 12 or 16 columns up to here (gemm_select.h)
constexpr int64_t kNarrowMinRows = 512;        // the narrow kernel from here,
constexpr int64_t kNarrowChosenMaxK = 64;       // up to this K
constexpr int64_t kNarrowChosenMaxNK = 2048;    // and N K (gemm_select.h)

bool gemv_chosen(bool fp32, bool exact, int64_t rows, int64_t N) {
  if (N <= kGemv16BitChosenMaxN) return true;
  if (!fp32 || N > kGemvMaxN) return false;
  return exact || rows <= kGemvF32MaxRows || N % 4 != 0;
}

bool narrow_chosen(int64_t rows, int64_t N, int64_t K) {
  return N > kGemv16BitChosenMaxN && N <= kNarrowMaxN && K <= kNarrowChosenMaxK && N * K <= kNarrowChosenMaxNK &&
         rows >= kNarrowMinRows;
}

bool ffma_takes(bool exact, int64_t K, int64_t outputs, bool tiles_read_in_place) {
  if (K > kFfmaMaxK) return false;
  if (exact) return true;
  return tiles_read_in_place ? K <= kFfmaAlignedMaxK && outputs <= kFfmaMaxOutputsAligned
                             : outputs <= kFfmaMaxOutputsCopied;
}

bool runs_depth(const GemmKernelEntry& e, int64_t K) { return !is_lowk(e) || K <= kLowKMaxK; }

int co_resident_clusters(const GemmKernelEntry& e) { return e.active_clusters != nullptr ? e.active_clusters() : 0; }

namespace {

// The data-parallel kernel `dp` (`tiles` output tiles), or its twin with the same tile in larger
// clusters where that twin's co-resident grid takes no more rounds of tiles. A 2x2 cluster shares
// both operand tiles between two CTAs where `dp`'s 1x2 cluster shares one; on an H200 it ran
// 1.06-1.11x faster at equal rounds, and up to 1.6x slower with one more round (bench/NOTES.md
// section 13). A twin whose co-resident cluster count is unknown is not taken: its grid would
// not be sized to what fits.
const GemmKernelEntry* wider_cluster_twin(const std::vector<const GemmKernelEntry*>& kernels,
                                          const GemmKernelEntry& dp, int64_t tiles, int sms) {
  // Rounds of tiles per CTA when `clusters` clusters of `e` run at once (at most one CTA per SM).
  auto rounds = [&](const GemmKernelEntry& e, int clusters) {
    const int64_t ctas = clusters > 0 ? std::min<int64_t>(sms, int64_t(clusters) * e.cluster_size) : sms;
    return (tiles + ctas - 1) / ctas;
  };
  for (const GemmKernelEntry* e : kernels) {
    if (e->cluster_size <= dp.cluster_size || e->transposed || e->stream_k || e->tile_m != dp.tile_m ||
        e->tile_n != dp.tile_n) {
      continue;
    }
    const int clusters = co_resident_clusters(*e);
    if (clusters > 0 && rounds(*e, clusters) <= rounds(dp, co_resident_clusters(dp))) return e;
  }
  return &dp;
}

// Among the non-split transposed tiles of `like`'s row count (tile_m) at least kRoundsMinTileN
// wide: the one whose grid needs the fewest rounds of tiles over the SMs times the tile's width
// (a tile's time grows with its width; the narrower tile pays the rounds), the wider one on a
// tie. At 160 x 1024 -> 4096 three rounds of 32-wide tiles (13.3 us) beat one round of 128-wide
// ones (14.5; 32 of each tile's 128 columns pad the 160 rows); at 256 x 2048 -> 2048 one round
// of 64-wide tiles (13.2) beat one of 128-wide ones (13.8). The 16-wide tile was slower than the
// 32-wide one on every measured shape of more than 64 rows.
const GemmKernelEntry* fewest_round_columns(const std::vector<const GemmKernelEntry*>& kernels,
                                            const GemmKernelEntry& like, int64_t M, int64_t N, int64_t L, int sms) {
  const GemmKernelEntry* pick = nullptr;
  int64_t pick_cost = 0;
  for (const GemmKernelEntry* e : kernels) {
    if (!e->transposed || e->stream_k || e->tile_m != like.tile_m || e->tile_n < kRoundsMinTileN) continue;
    const int64_t rounds = rounds_over(output_tiles(*e, M, N, L), sms);
    const int64_t cost = rounds * e->tile_n;
    if (pick == nullptr || cost < pick_cost || (cost == pick_cost && e->tile_n > pick->tile_n)) {
      pick = e;
      pick_cost = cost;
    }
  }
  return pick;
}

// TF32 with an N-major B, which only the transposed kernels read (as their M-major first operand,
// transposed in registers), up to a few hundred rows; nullptr for the general rules. Measured on
// an H200 (CUDA graphs, bench/NOTES.md sections 33 and 35,
// bench/results/matmul-tf32-nmajor-configs-h200.json):
// - up to kTf32RoundsMaxM rows of a small B (kTf32SmallBElements) over K <= kTf32PingpongShortK,
//   the 64-row tile of fewest rounds x width (fewest_round_columns, as for 16-bit types): 32-64
//   rows of 1024^2 12.5-12.6 us with the 32-wide tile against 15.3-15.4 with the 64x128 one
//   (cuBLAS 11.1-11.4), 96 x 2048^2 19.4 against 23.2, 192 x 2048^2 22.7 with the 64-wide tile;
// - the 64-row ping-pong tile in one round of tiles with K <= 4096 (kTf32PingpongMaxM and the
//   constants after it): 128 x 4096 -> 4096 40.9 us against 47.5 for the 128x128 stream-K tile
//   (cuBLAS 38.9), 1024^3 19.2 against 25.6 (17.5), 256 x 2048 -> 2048 23.8 against 31.6; with
//   more tiles or a longer K the 128-row tiles were faster (512 x 4096 -> 4096 99.3 against 85.2,
//   128 x 4096 -> 11008 92.7 against 77.4), as were the split-K tiles on few CTAs over a long K
//   (128 x 4096 -> 1024: 16 tiles, 37.3 against 29.2 for the 128x32 tile) and at 64 rows of a
//   large B the 128x64 tile (53.6 against 42.2 at 4096^2);
// - else up to kTransposedMaxM rows the narrowest stream-K tile where its re-reads of B stay in L2
//   (kTransposedRereadMaxElements), and otherwise up to 128 rows the narrowest one at least M
//   wide: 64 x 4096 -> 11008 76.2 us with the 128x64 tile against 103.0 with the 128x32 one
//   (cuBLAS 67.3). Past 128 rows the general rules below choose between the 128x128 and 128x256
//   tiles: 256 x 4096 -> 11008 91.8 us with the 128x256 tiles against 123.8.
const GemmKernelEntry* tf32_n_major_kernel(const std::vector<const GemmKernelEntry*>& kernels, int64_t M, int64_t N,
                                           int64_t K, int64_t L, int sms) {
  const GemmKernelEntry* pingpong = nullptr;
  const GemmKernelEntry* narrowest_sk = nullptr;
  const GemmKernelEntry* fitting_sk = nullptr;
  for (const GemmKernelEntry* e : kernels) {
    if (!e->stream_k && e->tile_m == 64 && e->tile_n == 128) pingpong = e;
    if (!e->stream_k) continue;
    if (narrowest_sk == nullptr || e->tile_n < narrowest_sk->tile_n) narrowest_sk = e;
    if (e->tile_n >= M && (fitting_sk == nullptr || e->tile_n < fitting_sk->tile_n)) fitting_sk = e;
  }
  if (pingpong != nullptr && M <= kTf32RoundsMaxM && K <= kTf32PingpongShortK && K * N <= kTf32SmallBElements) {
    if (const GemmKernelEntry* e = fewest_round_columns(kernels, *pingpong, M, N, L, sms)) return e;
  }
  const int64_t pingpong_tiles = pingpong != nullptr ? output_tiles(*pingpong, M, N, L) : 0;
  if (pingpong != nullptr && M <= kTf32PingpongMaxM && K <= kTf32PingpongMaxK && pingpong_tiles <= sms &&
      (K <= kTf32PingpongShortK || 4 * pingpong_tiles >= sms) && (M > 64 || K * N <= kTf32SmallBElements)) {
    return pingpong;
  }
  if (M > kTransposedMaxM) return nullptr;
  if (narrowest_sk != nullptr &&
      (M + narrowest_sk->tile_n - 1) / narrowest_sk->tile_n * K * N * L <= kTransposedRereadMaxElements) {
    return narrowest_sk;
  }
  return fitting_sk;  // nullptr past 128 rows: the rules after the transposed-product ones
}

// TF32 with a K-major B, 65-256 rows over a long K or a large B: the narrowest 64-row transposed
// tile that takes the rows in whole column tiles, in one round of tiles; nullptr if none. Measured
// on an H200 (CUDA graphs, bias+ReLU, bench/NOTES.md section 35): 128 x 4096 -> 4096 32.3 us with
// the 64x64 tile against 43.1 for the split-K 128x128 tile (cuBLASLt 39.1), 256 x 4096 -> 4096
// 40.2 with the 64x128 tile against 45.6. A column tile that the rows fill only in part ran
// 1.2-1.5x slower than a full one (192 x 4096 -> 4096 on 64x128 tiles: 58.9 us, against 40.2 at
// 256 rows on the same grid), and over a longer K (11008) the split-K tile won.
const GemmKernelEntry* tf32_full_column_tiles(const std::vector<const GemmKernelEntry*>& kernels, int64_t M,
                                              int64_t N, int64_t L, int sms) {
  const GemmKernelEntry* pick = nullptr;
  for (const GemmKernelEntry* e : kernels) {
    if (!e->transposed || e->stream_k || e->tile_m != 64 || M % e->tile_n != 0 || output_tiles(*e, M, N, L) > sms) {
      continue;
    }
    if (pick == nullptr || e->tile_n < pick->tile_n) pick = e;
  }
  return pick;
}

// TF32 with a K-major B and more than kTransposedMaxM rows, by the rounds of the data-parallel
// 128x256 tiles (`dp`, `tiles` of them): `dp` when they fill at least kTf32OneRoundFill of one
// round, the stream-K config `sk` (a 128x128 tile) when two or three rounds leave the last less
// than half full; else nullptr. Measured on an H200 (CUDA graphs, bias+ReLU, bench/NOTES.md
// section 35): 2048^3 55.0 us data-parallel against 67.1 for stream-K (cuBLASLt 50.6), 1024 x
// 1024 -> 4096 34.4 against 42.8; 512 x 4096 -> 11008 (1.3 rounds) 141.2 with stream-K against
// 181.3, 3072^3 (2.2 rounds) 187.1 against 201.9. At 0.55 of a round (1536^3) the stream-K
// config stayed ahead (37.2 against 41.3).
const GemmKernelEntry* tf32_round_kernel(const GemmKernelEntry& dp, const GemmKernelEntry* sk, int64_t tiles,
                                         int sms) {
  if (tiles <= sms && double(tiles) >= kTf32OneRoundFill * sms) return &dp;
  if (sk != nullptr && tiles > sms && tiles < kTf32StreamKMaxRounds * sms && 2 * (tiles % sms) < sms) return sk;
  return nullptr;
}

}  // namespace

const GemmKernelEntry* select_kernel(const std::vector<const GemmKernelEntry*>& candidates, int64_t M, int64_t N,
                                     int64_t K, int64_t L, int sms,
                                     const std::vector<const GemmKernelEntry*>* extk_twins) {
  const bool with_extk_twin = extk_twins != nullptr;
  auto has_extk_twin = [&](const GemmKernelEntry& e) {
    return extk_twins != nullptr && std::any_of(extk_twins->begin(), extk_twins->end(), [&](const GemmKernelEntry* t) {
             return std::strcmp(t->config, e.config) == 0;
           });
  };
  // A short K makes the product a stream over C and D: the hand-written kernel's case, except a
  // plain product (one with plain-epilogue candidates) over K > kLowKPreferredMaxK.
  const bool plain =
      std::any_of(candidates.begin(), candidates.end(), [](const GemmKernelEntry* e) { return e->plain; });
  for (const GemmKernelEntry* e : candidates) {
    if (is_lowk(*e) && lowk_takes(K, M, L) && !(plain && K > kLowKPreferredMaxK)) return e;
  }
  std::vector<const GemmKernelEntry*> cutlass;
  for (const GemmKernelEntry* e : candidates) {
    if (!is_lowk(*e)) cutlass.push_back(e);
  }
  if (cutlass.empty()) return candidates.front();
  // Transposed kernels alone read the layout: TF32 with an N-major B in a full build (the
  // 16-bit types have non-transposed kernels for every layout; a selective build may leave them
  // none, and then the general rules apply).
  const bool only_transposed =
      std::all_of(cutlass.begin(), cutlass.end(), [](const GemmKernelEntry* e) { return e->transposed; });
  const bool tf32 = cutlass.front()->dtype == DType::kF32;
  const bool tf32_n_major = only_transposed && tf32;
  // A 16-bit product of the forward's layout (x @ weight.t(): K-major A and B) without the aux
  // output, outside LoRA's extended-K products: what the rules for few rows and few columns were
  // last measured on.
  const GemmKernelEntry* direct = nullptr;
  for (const GemmKernelEntry* e : cutlass) {
    if (!e->transposed && direct == nullptr) direct = e;
  }
  const bool weight_forward = !tf32 && !with_extk_twin && direct != nullptr && !direct->aux &&
                              direct->a_major == Major::kK && direct->b_major == Major::kK;
  bool past_transposed = false;  // 65-256 rows sent to the general rules (kTransposedMaxRounds)
  if (tf32_n_major) {
    if (const GemmKernelEntry* e = tf32_n_major_kernel(cutlass, M, N, K, L, sms)) return e;
  }
  // Few rows: the transposed kernel with the narrowest tile that takes them in at most two
  // column tiles (measured best on the H200), provided its tiles occupy at least a quarter of
  // the SMs, or K is short enough for fewer tiles (above), or it splits K (a narrow N with a
  // long K, like a weight gradient, goes to split-K). For 65-256 rows over a short K and a small
  // B, the tile of fewest round columns instead (kRoundsMaxK). A 16-bit forward against a weight
  // takes up to 64 rows in one column tile, and leaves the rule for 65-256 rows whose grid takes
  // more than two rounds (kTransposedMaxRounds).
  // TF32 (whose transposed tiles for a K-major B include a stream-K one as narrow as the 32-wide
  // ping-pong tile) takes the ping-pong tile on a tie where its grid runs in one round: 1024^2
  // with 16-64 rows 10.8-10.9 us against 21.1-21.2, 64 x 4096 -> 4096 30.6 against 34.8 (H200,
  // bench/NOTES.md section 35). Past 64 rows outside the rounds rule's range it takes whole column
  // tiles in one round, or the general rules.
  if (M <= kTransposedMaxM && !tf32_n_major) {
    const GemmKernelEntry* best = nullptr;
    const GemmKernelEntry* best_split = nullptr;  // the narrowest stream-K one, where the ping-pong tile is not taken
    for (const GemmKernelEntry* e : cutlass) {
      if (!e->transposed || 2 * e->tile_n < M) continue;
      if (best == nullptr || e->tile_n < best->tile_n || (e->tile_n == best->tile_n && best->stream_k && !e->stream_k)) {
        best = e;
      }
      if (e->stream_k && (best_split == nullptr || e->tile_n < best_split->tile_n)) best_split = e;
    }
    if (best != nullptr) {
      if (best->stream_k) return best;
      if (M > kTransposedShortKMaxM && K <= kRoundsMaxK && K * N <= kRoundsMaxElements) {
        if (const GemmKernelEntry* e = fewest_round_columns(cutlass, *best, M, N, L, sms)) return e;
      }
      if (tf32 && M > kTransposedShortKMaxM) {
        if (K <= kTf32PingpongMaxK) {
          if (const GemmKernelEntry* e = tf32_full_column_tiles(cutlass, M, N, L, sms)) return e;
        }
        best = nullptr;  // the general rules
      }
    }
    if (best != nullptr && weight_forward) {
      if (M <= kTransposedShortKMaxM) {
        const GemmKernelEntry* one_tile = nullptr;  // the rows in one column tile, more than half full
        for (const GemmKernelEntry* e : cutlass) {
          if (e->transposed && !e->stream_k && e->tile_n >= M && e->tile_n < 2 * M &&
              (one_tile == nullptr || e->tile_n < one_tile->tile_n)) {
            one_tile = e;
          }
        }
        if (one_tile != nullptr && 4 * output_tiles(*one_tile, M, N, L) >= sms) return one_tile;
      } else if (output_tiles(*best, M, N, L) > kTransposedMaxRounds * sms) {
        best = nullptr;
        past_transposed = true;
      }
    }
    if (best != nullptr) {
      const int64_t tiles = output_tiles(*best, M, N, L);
      const bool short_k = M <= kTransposedShortKMaxM && K <= kTransposedShortK && tiles >= kTransposedMinTiles;
      // TF32's stream-K tile of the same width past one round of ping-pong tiles: 16 x 4096 ->
      // 11008 (172 tiles) 64.0 us against 66.0 on an H200 (bench/NOTES.md section 35).
      const bool split_instead = best_split != nullptr && best_split->tile_n == best->tile_n;
      if (split_instead && tiles > sms) return best_split;
      if (tiles * 4 >= sms || short_k) return best;
      if (split_instead) return best_split;
    }
  }
  // An epilogue-bound training forward: the cooperative tile (above).
  if (M > kTransposedMaxM && K <= kAuxCooperativeMaxK && N >= kAuxCooperativeMinN && !with_extk_twin) {
    for (const GemmKernelEntry* e : cutlass) {
      if (e->aux && !e->transposed && !e->stream_k && std::strstr(e->config, "coop") != nullptr &&
          2 * output_tiles(*e, M, N, L) >= int64_t(sms)) {
        return e;
      }
    }
  }
  // Few columns, many rows, short K: the transposed product, where the 128-wide tiles spent most
  // of each tile on columns that are not there. The widest transposed tile whose grid fills the
  // SMs at least once (at most 64 wide for up to 64 columns with K <= 256), else the narrowest (the
  // most tiles). Measured on an H200 (bf16,
  // bench/gemm_configs.py --set dlrm, bench/NOTES.md section 16): 65536 x 64 -> 16 34.6 -> 15.6 us,
  // 65536 x 256 -> 64 39.3 -> 22.0, 2048 x 256 -> 64 30.8 -> 10.4, 2048 x 512 -> 256 20.6 -> 9.2;
  // on the set's narrow shapes 1.03x the best built config (geomean), at most 1.11x. Longer K
  // (weight gradients over many rows) keeps the rules below, but up to 16 columns the rule holds
  // to K = 4096 (above).
  const int64_t narrow_max_k = N <= kNarrowNFewColumnsMaxN ? kNarrowNFewColumnsMaxK : kNarrowNMaxK;
  const bool full_width_rounds = !tf32 && N == kNarrowNMaxN && K >= kNarrowNWideMinK &&
                                 (M + 127) / 128 * ((N + 127) / 128) * L >= kNarrowNWideMinRounds * sms;
  if (M > kTransposedMaxM && N <= kNarrowNMaxN && K <= narrow_max_k && !with_extk_twin && !full_width_rounds) {
    const bool capped = N <= kNarrowNCappedMaxN && K <= kNarrowNCappedMaxK;
    const int64_t narrow_fill = !weight_forward || K > kNarrowNShortFillMaxK ? sms
                                : capped                                   ? (sms + 3) / 4
                                                                           : (3 * sms + 3) / 4;
    const GemmKernelEntry* widest = nullptr;
    const GemmKernelEntry* narrowest = nullptr;
    for (const GemmKernelEntry* e : cutlass) {
      if (!e->transposed || e->stream_k || e->tile_m != 64) continue;
      const int64_t tiles = output_tiles(*e, M, N, L);
      const bool over_cap = capped && e->tile_n > kNarrowNCappedTile && !(weight_forward && tiles >= sms);
      if (tiles >= narrow_fill && !over_cap && (widest == nullptr || e->tile_n > widest->tile_n)) {
        widest = e;
      }
      if (narrowest == nullptr || e->tile_n < narrowest->tile_n) narrowest = e;
    }
    if (widest != nullptr) return widest;
    if (narrowest != nullptr) return narrowest;
  }
  // Otherwise the first data-parallel config (the kernel table lists them in order of
  // preference) when its tiles fill the machine at least once, else the stream-K config, which
  // splits the K loop to occupy every SM. Transposed kernels take part only when nothing else
  // reads the layout (TF32 with an N-major B).
  const GemmKernelEntry* best_dp = nullptr;
  const GemmKernelEntry* best_sk = nullptr;
  for (const GemmKernelEntry* e : cutlass) {
    if (e->transposed != only_transposed) continue;
    const GemmKernelEntry*& slot = e->stream_k ? best_sk : best_dp;
    if (slot == nullptr) slot = e;
  }
  const int64_t dp_tiles = best_dp != nullptr ? output_tiles(*best_dp, M, N, L) : 0;
  const int64_t dp_rounds = best_dp != nullptr ? rounds_over(dp_tiles, sms) : 0;
  // Between one and two waves of the preferred tiles with the second wave under half full and a
  // long K, the stream-K config with the same tile spreads the last wave's K loops over every SM
  // (split_k_factor returns 0 there: CUTLASS's stream-K decomposition). Measured on an H200
  // (bf16, bench/NOTES.md section 12): 768 x 11008 -> 4096 108.7 us against 122.3 for the best
  // data-parallel config, 768 x 8192 -> 4096 87.0 against 94.6; at K = 4096 the fix-up of the
  // split tiles cost more than the balance gained (768 x 4096 x 4096: 55.4 against 49.4). One
  // round of 144- or 192-wide tiles (mid_round, below) comes first.
  const bool stream_k_round = best_dp != nullptr && best_sk != nullptr && !only_transposed && !with_extk_twin &&
                              K >= kStreamKMinK && best_sk->tile_m == best_dp->tile_m &&
                              best_sk->tile_n == best_dp->tile_n && dp_tiles > sms && dp_tiles < 2 * int64_t(sms) &&
                              2 * (dp_tiles - sms) < sms;
  // Between one round and two of the preferred 128x128 tiles, from kOneRoundMinK: one round of
  // 128x144 or 128x192 tiles (from kMidCooperativeMinK also 128x256 ones, unless the stream-K rule
  // applies) that covers at least 70% of the SMs, the one of more tiles (one_round_tile). Half the
  // tiles of 128x128 or nearly, each reading its A rows once for more columns, with no second
  // round. Measured on an H200 (bf16 bias+ReLU, CUDA-graph replays; bench/NOTES.md sections 53-54):
  //   - K >= 4096, over the 128x128 tiles: 128 tiles of 256, 1024 x 11008 -> 4096 and 1024 x 8192
  //     -> 4096 0.96x the cooperative tile's time, 2048 x 4096 -> 2048 0.94x, 1024 x 4096 -> 4096
  //     0.97x; 128-132 tiles of 192 where 256-wide ones make 96, 1024 x 4096 -> 3072 0.80x the
  //     64x128 tiles' time, 768 x 4096 -> 4096 and 1536 x 4096 -> 2048 0.86x and 0.84x the 128x256
  //     tiles'; 132 tiles of 144, 1536 x 4096 -> 1536 (192 wide would make 96).
  //   - K = 1024-3072 (the 128x256 tiles tied the ping-pong 128x128 ones at best there): one round
  //     of 192-wide tiles 0.73-0.87x the time where the rule took the transposed 64x128 or the
  //     ping-pong 128x128 tiles over 1536-2048 rows, 0.97-1.02x over 512-1024 rows.
  //   - Where the stream-K rule applies: 768 x 8192 and 11008 -> 4096, 1024 x 8192 and 11008 ->
  //     3072 0.87-0.91x the stream-K tile's time with 192-wide tiles, 2048 x 8192 -> 1536 0.81x;
  //     1536 x 8192 -> 1536 0.91x with 144-wide ones. The 96 tiles of 256 there ran 1.07x the
  //     stream-K tile's time (768 x 8192 and 11008 -> 4096), so where only those are built (a
  //     row-major B, the aux output) stream-K stays.
  // Only past one round of 128x128 tiles: one round of them is fuller than any wider one.
  const GemmKernelEntry* mid_round =
      best_dp != nullptr && !tf32 && !only_transposed && (M > kTransposedMaxM || past_transposed) && !with_extk_twin &&
              K >= kOneRoundMinK &&
              dp_tiles > sms && dp_tiles < 2 * int64_t(sms)
          ? one_round_tile(cutlass, *best_dp, M, N, L, sms, K >= kMidCooperativeMinK && !stream_k_round)
          : nullptr;
  if (mid_round != nullptr) return mid_round;
  if (stream_k_round) return best_sk;
  // Between half a wave and two waves of the preferred tiles (M = 512-1024 against 4096-wide
  // weights), the forward has two more kernels: the cooperative config, whose CTAs keep both math
  // warpgroups on each tile where a ping-pong CTA has one tile for one of them, and the transposed
  // 64x128 tiles. Whichever fills its last wave better by more than a tenth of a wave wins,
  // the cooperative tiles on a tie. Measured on an H200 (bench/gemm_configs.py --set mid): this
  // picks the best of the built configs within 2% on M = 512-2048 with K, N of 4096 and 11008;
  // at 768 x 4096 x 4096 a 128x128 grid leaves its second wave 45% full and the 64x128 tiles
  // ran 1.05-1.19x faster.
  //
  // A third: tiles of the same height between 128 and 256 wide (128x144, 128x192; the one of
  // fuller last wave), built to make one full wave where the others leave a second one mostly
  // empty (1536^3 on 132 SMs: 132 tiles of 144 against 144 of 128x128 and 288 of 64x128), taken on
  // the same test after the others. From kOneRoundMinK past one round, mid_round comes first.
  // The cooperative tile is the base only over a long K (kMidCooperativeMinK) or with the aux
  // output; otherwise the preferred ping-pong tile, not its 2x2-cluster twin (1.24x slower at
  // 1024 x 1024 -> 4096).
  if (best_dp != nullptr && !only_transposed && M > kTransposedMaxM && !with_extk_twin) {
    auto last_wave_fill = [&](const GemmKernelEntry& e) {
      const int64_t tiles = output_tiles(e, M, N, L);
      return double(tiles) / double(rounds_over(tiles, sms) * sms);
    };
    const GemmKernelEntry* coop = nullptr;
    const GemmKernelEntry* narrow = nullptr;
    const GemmKernelEntry* one_wave = nullptr;  // the one of fullest last wave
    for (const GemmKernelEntry* e : cutlass) {
      if (!e->transposed && !e->stream_k && e != best_dp && e->tile_m == best_dp->tile_m &&
          e->tile_n == best_dp->tile_n && coop == nullptr) {
        coop = e;
      }
      if (is_one_wave_tile(*e) && e->tile_m == best_dp->tile_m &&
          (one_wave == nullptr || last_wave_fill(*e) > last_wave_fill(*one_wave))) {
        one_wave = e;
      }
      // Not for TF32: its 64x128 tiles ran 1.2-1.5x slower than the 128x128 stream-K tiles there
      // (512 x 4096 -> 11008: 217.0 against 141.2 us; 1536^3: 41.8 against 37.2).
      if (e->transposed && !e->stream_k && e->tile_m == 64 && e->tile_n == 128 && !tf32) narrow = e;
    }
    if ((coop != nullptr || narrow != nullptr || one_wave != nullptr) && 2 * dp_tiles >= sms &&
        dp_tiles < 2 * int64_t(sms)) {
      const bool take_coop = coop != nullptr && (K >= kMidCooperativeMinK || best_dp->aux);
      const GemmKernelEntry* pick = take_coop ? coop : best_dp;
      if (narrow != nullptr && last_wave_fill(*narrow) > last_wave_fill(*pick) + 0.1) pick = narrow;
      if (one_wave != nullptr && last_wave_fill(*one_wave) > last_wave_fill(*pick) + 0.1) pick = one_wave;
      if (pick != best_dp || coop != nullptr) return pick;  // else the rule below (data-parallel from one wave)
    }
  }
  // From two waves on, the 128x144 tiles where their rounds, weighted by their area, undercut the
  // preferred tile's by kOneWaveMaxAreaPct: 3072 x 3072 -> 1536 takes 2 rounds of them (264 tiles)
  // against 3 of 128x128 ones (288). (Not the 128x192 tiles: at equal rounds times area they ran
  // 1.03-1.10x the ping-pong 128x128 tiles' time, bench/NOTES.md section 54.)
  if (best_dp != nullptr && !only_transposed && M > kTransposedMaxM && !with_extk_twin &&
      dp_tiles >= 2 * int64_t(sms)) {
    for (const GemmKernelEntry* e : cutlass) {
      if (!is_one_wave_tile(*e) || e->tile_m != best_dp->tile_m || e->tile_n != 144) continue;
      const int64_t rounds = rounds_over(output_tiles(*e, M, N, L), sms);
      if (rounds * e->tile_m * e->tile_n * 100 <= dp_rounds * best_dp->tile_m * best_dp->tile_n * kOneWaveMaxAreaPct) {
        return e;
      }
    }
  }
  if (tf32 && best_dp != nullptr && !only_transposed && M > kTransposedMaxM) {
    if (const GemmKernelEntry* e = tf32_round_kernel(*best_dp, best_sk, dp_tiles, sms)) return e;
  }
  // Below half a wave of 128x128 tiles (squares of 512-1024, a 1024 x 1024 output over K = 4096;
  // fewer columns follow the narrow-N rule above), those tiles leave most SMs idle and split-K pays
  // a reduction: the transposed 64-row tiles, the narrowest whose grid still runs in one round (a
  // tile per SM at most) over at least half the SMs. Measured on an H200 (bf16, bias+ReLU, kernel
  // time from the profiler; bench/NOTES.md section 20): 512^3 64x32 tiles 4.7 us against 10.3 + 1.0
  // (its workspace memset) for split-K and 8.5 for 128x128 ping-pong; 1024^3 64x128 tiles 7.8
  // against 12.9 + 1.1 and 11.5; 1024 x 4096 -> 1024 64x128 tiles 19.6 against 20.7 + 1.1 and 25.7.
  if (best_dp != nullptr && !only_transposed && M > kTransposedMaxM && N > kNarrowNMaxN && !with_extk_twin &&
      2 * dp_tiles < sms && K <= kSubWaveTransposedMaxK) {
    const GemmKernelEntry* pick = nullptr;
    int64_t pick_tiles = 0;
    for (const GemmKernelEntry* e : cutlass) {
      if (!e->transposed || e->stream_k || e->tile_m != 64) continue;
      const int64_t tiles = output_tiles(*e, M, N, L);
      if (tiles <= sms && 2 * tiles >= sms && tiles > pick_tiles) {
        pick = e;
        pick_tiles = tiles;
      }
    }
    if (pick != nullptr) return pick;
  }
  // One column tile under clusters that span N (the 1x2 and 2x2 ping-pong configs): every
  // cluster's second column of CTAs has no columns and runs its MMAs on zero-filled tiles, half
  // the grid's work. The transposed 64-row tiles put the columns in their rows, no cluster: the
  // widest whose grid fills the SMs; where the layout has none, the 1x1 stream-K config.
  // Measured on an H200 (bf16, CUDA graphs, bench/NOTES.md section 31): [32, 2048, 2048] @
  // [32, 2048, 128] 139.8 -> 89.1 us (cuBLAS 90.2), [8, 4096, 4096] @ [8, 4096, 128] 136.9 ->
  // 86.0 (83.7), [32, 2048, 2048] @ [32, 2048, 64] 138.2 -> 83.2 (86.6); the stream-K config
  // 96.3, 92.3 and 97.8.
  if (best_dp != nullptr && !only_transposed && !with_extk_twin && dp_tiles >= sms &&
      one_column_tile_under_cluster(*best_dp, N)) {
    const GemmKernelEntry* pick = nullptr;
    for (const GemmKernelEntry* e : cutlass) {
      if (e->transposed && !e->stream_k && e->tile_m == 64 && output_tiles(*e, M, N, L) >= sms &&
          (pick == nullptr || e->tile_n > pick->tile_n)) {
        pick = e;
      }
    }
    if (pick != nullptr) return pick;
    if (best_sk != nullptr) return best_sk;
  }
  // TF32 with an N-major B (transposed kernels only): below half a wave of the data-parallel
  // tiles, or where the caller's columns fit one row of tiles of a cluster that spans them (half
  // the CTAs on zero-filled rows, as above), the widest transposed stream-K tile, if it is at least
  // half as wide, split over K below a wave (split_k_factor). Measured on an H200 (CUDA graphs,
  // bench/NOTES.md section 32): 128 x 4096 -> 4096 92.2 us with 128x256 tiles (cuBLAS 39.2),
  // 1024^3 29.5 (16.8), [32, 2048, 2048] @ [32, 2048, 128] 254.7 (172.4).
  if (best_dp != nullptr && only_transposed && (2 * dp_tiles < sms || one_column_tile_under_cluster(*best_dp, N))) {
    const GemmKernelEntry* wide_sk = nullptr;
    for (const GemmKernelEntry* e : cutlass) {
      if (e->stream_k && (wide_sk == nullptr || e->tile_n > wide_sk->tile_n)) wide_sk = e;
    }
    if (wide_sk != nullptr && 2 * wide_sk->tile_n >= best_dp->tile_n) return wide_sk;
  }
  // 16-bit products of more than a round of tiles over a long K: the cooperative 128x256 tile,
  // where one is built for the layout, unless its last round idles more SMs than its speed makes up
  // for. Timed alone at the GPU's power cap (as a long training run keeps it), the 128x128
  // ping-pong tile ran at a 10-14% lower clock than the wide tile for as many cycles. Through the
  // package on an H200 (bench/NOTES.md sections 45-46, sustained graph replays), the wide tile was
  // 4-20% faster per unit of work (1-10% on 4 of them in a second run) on the 7 products where the
  // two tiles need rounds in proportion to their areas (4096^3 to 16384 x 4096 -> 11008). Where
  // they do not, the two ran as their rounds say: 2048 x 4096 -> 11008 (6 rounds of wide tiles,
  // worth 12 of 128x128 ones, against 11) 1.00 and 1.03x cuBLAS on the ping-pong tile, 0.97 and
  // 0.98x on the wide one, in two runs; 2048 x 4096 -> 4096 (2 rounds against 4) 0.96 against
  // 0.97-0.98x. A persistent grid's time follows its rounds (the busiest CTA's tiles), so the wide
  // tile is taken where its rounds, weighted by its area, stay within the preferred tile's plus
  // kWideGainPct (a middle value of the measured gain), from 1.5 rounds (the fewest measured).
  // A product with LoRA's pair takes the tile where it has an extended-K twin.
  if (!tf32 && best_dp != nullptr && !only_transposed && K >= kWideMinK && M >= kWideMinMN && N >= kWideMinMN) {
    for (const GemmKernelEntry* e : cutlass) {
      const int64_t area = e->tile_m * e->tile_n, dp_area = best_dp->tile_m * best_dp->tile_n;
      if (e->transposed || e->stream_k || area <= dp_area || is_one_wave_tile(*e)) continue;
      const int64_t tiles = output_tiles(*e, M, N, L);
      const int64_t rounds = rounds_over(tiles, sms);
      if (2 * tiles >= 3 * int64_t(sms) && rounds * area * 100 <= dp_rounds * dp_area * (100 + kWideGainPct) &&
          (!with_extk_twin || has_extk_twin(*e))) {
        return e;
      }
      break;
    }
  }
  // The narrow transposed split-K config is a small-M tile: larger TF32 products with an
  // N-major B stay data-parallel even below one wave (measured on the H200: 128x32 split-K
  // tiles ran 2048^2 x 2048 4.6x slower than cuBLAS).
  if (best_dp != nullptr && (dp_tiles >= sms || best_sk == nullptr || only_transposed)) {
    return with_extk_twin || only_transposed ? best_dp : wider_cluster_twin(cutlass, *best_dp, dp_tiles, sms);
  }
  return best_sk;
}

// Split count for a stream-K kernel. Below one wave of output tiles: as many splits as fit in one
// wave, at most 16 and at least 4 K-tiles (128-byte deep stages) per split; left to CUTLASS's
// stream-K decomposition instead, a handful of output tiles with a very long K (the weight
// gradient of a narrow layer over 65536 rows) was cut into ~132 pieces whose deterministic
// reduction then ran as one 132-step serial chain. From one wave on: 1 (data-parallel) when the
// waves are full, else 0, CUTLASS's stream-K decomposition, which shares the K loops of the last
// two waves' tiles among all SMs (at most a few pieces per tile).
int split_k_factor(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int64_t L, int sms,
                   int64_t element_size) {
  const int64_t tiles = output_tiles(kernel, M, N, L);
  if (tiles >= sms) return tiles % sms != 0 ? 0 : 1;
  const int64_t k_tiles = (K + 128 / element_size - 1) / (128 / element_size);
  const int64_t splits = std::min<int64_t>({sms / tiles, 16, k_tiles / 4});
  return int(std::max<int64_t>(splits, 1));
}

bool dependent_launch_pays(const GemmKernelEntry& kernel, int64_t M, int64_t K) {
  return !(kernel.transposed && M > kernel.tile_n && K >= kPlainLaunchMinK);
}

int k_slices(const GemmKernelEntry& kernel, int64_t M, int64_t N, int64_t K, int sms) {
  const int64_t tiles = output_tiles(kernel, M, N, 1);
  for (int64_t s = std::min<int64_t>(sms / std::max<int64_t>(tiles, 1), K / kMinSliceK); s >= 2; --s) {
    if (K % (s * kSliceAlignK) == 0) return int(s);
  }
  return 0;
}

}  // namespace cutlass_ext
