// Runs the GEMM kernel heuristic (csrc/bindings/gemm_select.h) on kernel entries and shapes read
// from stdin, without a GPU (tests/test_select.py). Lines:
//   kernel <config> <family> <tile_m> <tile_n> <cluster_size> <stream_k> <transposed> <active_clusters> <aux>
//          <dtype: bf16, fp16 or tf32> <plain: 1 for a plain-epilogue kernel> [<a_major: k or m> <b_major: k or n>]
//     appends a candidate (kernel table order; the transposed kernels last, as the binding does);
//   extk <config>
//     adds an extended-K kernel of that config (the twins a product with LoRA's pair can use);
//   query <M> <N> <K> <L> <sms> <with_extk> <element_size>
//     prints "<config> <splits>" (splits: split_k_factor for a stream-K pick, else 1); with_extk 1:
//     the product carries LoRA's pair, and the extk lines so far are its twins;
//   slices <tile_m> <tile_n> <M> <N> <K> <sms>
//     prints k_slices for a K-slices kernel of that tile;
//   ffma <exact> <K> <outputs> <tiles_read_in_place>
//     prints 1 where the short-K fp32 kernel is the heuristic's choice (ffma_takes), else 0;
//   gemv <fp32> <exact> <rows> <N>
//     prints 1 where the few-column kernel is the heuristic's choice (gemv_chosen), else 0;
//   narrow <rows> <N> <K>
//     prints 1 where the narrow kernel is the heuristic's choice (narrow_chosen), else 0;
//   dependent <tile_n> <transposed> <M> <K>
//     prints 1 where a kernel of that tile launches as a programmatic dependent (dependent_launch_pays);
//   reset
//     clears the candidates and the extended-K kernels.
#include <array>
#include <cstdio>
#include <deque>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bindings/gemm_select.h"

namespace {

constexpr int kMaxKernels = 64;
std::array<int, kMaxKernels> g_clusters{};

// One function per slot: GemmKernelEntry holds a plain function pointer for the cluster count.
template <int I>
int clusters_of() {
  return g_clusters[I];
}
template <int... I>
constexpr std::array<cutlass_ext::GemmActiveClustersFn, sizeof...(I)> cluster_fns(std::integer_sequence<int, I...>) {
  return {&clusters_of<I>...};
}
constexpr auto kClusterFns = cluster_fns(std::make_integer_sequence<int, kMaxKernels>{});

}  // namespace

int main() {
  std::deque<std::string> strings;  // stable storage for the entries' names
  std::deque<cutlass_ext::GemmKernelEntry> entries;
  std::vector<const cutlass_ext::GemmKernelEntry*> candidates;
  std::vector<const cutlass_ext::GemmKernelEntry*> extk;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string what;
    in >> what;
    // Whether a line's fields did not parse (or its other checks failed): says so, naming the line.
    auto bad = [&](bool ok, const char* kind) {
      if (!ok) std::printf("error: bad %s: %s\n", kind, line.c_str());
      return !ok;
    };
    if (what == "kernel") {
      std::string config, family, dtype;
      int tile_m, tile_n, cluster_size, stream_k, transposed, clusters, aux, plain;
      in >> config >> family >> tile_m >> tile_n >> cluster_size >> stream_k >> transposed >> clusters >> aux >> dtype >>
          plain;
      if (bad(in && candidates.size() < size_t(kMaxKernels) && (dtype == "bf16" || dtype == "fp16" || dtype == "tf32"),
              "kernel line")) {
        return 1;
      }
      std::string a_major = "k", b_major = "k";  // optional: K-major operands where left out
      if (in >> a_major && bad(in >> b_major && (a_major == "k" || a_major == "m") && (b_major == "k" || b_major == "n"),
                               "kernel line's majors")) {
        return 1;
      }
      const int slot = int(candidates.size());
      g_clusters[slot] = clusters;
      strings.push_back(config);
      const char* config_name = strings.back().c_str();
      strings.push_back(family);
      cutlass_ext::GemmKernelEntry e{};
      e.name = config_name;
      e.family = strings.back().c_str();
      e.config = config_name;
      e.arch = 90;
      e.dtype = dtype == "tf32" ? cutlass_ext::DType::kF32 : dtype == "bf16" ? cutlass_ext::DType::kBF16
                                                                               : cutlass_ext::DType::kF16;
      e.tile_m = tile_m;
      e.tile_n = tile_n;
      e.cluster_size = cluster_size;
      e.stream_k = stream_k != 0;
      e.transposed = transposed != 0;
      e.aux = aux != 0;
      e.plain = plain != 0;
      e.a_major = a_major == "k" ? cutlass_ext::Major::kK : cutlass_ext::Major::kMN;
      e.b_major = b_major == "k" ? cutlass_ext::Major::kK : cutlass_ext::Major::kMN;
      e.active_clusters = kClusterFns[slot];
      entries.push_back(e);
      candidates.push_back(&entries.back());
    } else if (what == "extk") {
      std::string config;
      in >> config;
      if (bad(bool(in), "extk line")) return 1;
      strings.push_back(config);
      cutlass_ext::GemmKernelEntry e{};
      e.name = strings.back().c_str();
      e.config = e.name;
      e.arch = 90;
      e.ext_k = true;
      entries.push_back(e);
      extk.push_back(&entries.back());
    } else if (what == "query") {
      long long M, N, K, L, element_size;
      int sms, with_extk;
      in >> M >> N >> K >> L >> sms >> with_extk >> element_size;
      if (bad(in && !candidates.empty(), "query line (or no kernels)")) return 1;
      const cutlass_ext::GemmKernelEntry* e = cutlass_ext::select_kernel(candidates, M, N, K, L, sms, with_extk != 0 ? &extk : nullptr);
      const int splits = e->stream_k ? cutlass_ext::split_k_factor(*e, M, N, K, L, sms, element_size) : 1;
      std::printf("%s %d\n", e->config, splits);
    } else if (what == "slices") {
      int tile_m, tile_n, sms;
      long long M, N, K;
      in >> tile_m >> tile_n >> M >> N >> K >> sms;
      if (bad(bool(in), "slices line")) return 1;
      cutlass_ext::GemmKernelEntry e{};
      e.tile_m = tile_m;
      e.tile_n = tile_n;
      e.k_slices = true;
      std::printf("%d\n", cutlass_ext::k_slices(e, M, N, K, sms));
    } else if (what == "dependent") {
      int tile_n, transposed;
      long long M, K;
      in >> tile_n >> transposed >> M >> K;
      if (bad(bool(in), "dependent line")) return 1;
      cutlass_ext::GemmKernelEntry e{};
      e.tile_n = tile_n;
      e.transposed = transposed != 0;
      std::printf("%d\n", int(cutlass_ext::dependent_launch_pays(e, M, K)));
    } else if (what == "ffma") {
      int exact, in_place;
      long long K, outputs;
      in >> exact >> K >> outputs >> in_place;
      if (bad(bool(in), "ffma line")) return 1;
      std::printf("%d\n", int(cutlass_ext::ffma_takes(exact != 0, K, outputs, in_place != 0)));
    } else if (what == "gemv") {
      int fp32, exact;
      long long rows, N;
      in >> fp32 >> exact >> rows >> N;
      if (bad(bool(in), "gemv line")) return 1;
      std::printf("%d\n", int(cutlass_ext::gemv_chosen(fp32 != 0, exact != 0, rows, N)));
    } else if (what == "narrow") {
      long long rows, N, K;
      in >> rows >> N >> K;
      if (bad(bool(in), "narrow line")) return 1;
      std::printf("%d\n", int(cutlass_ext::narrow_chosen(rows, N, K)));
    } else if (what == "reset") {
      candidates.clear();
      extk.clear();
      g_clusters.fill(0);
    } else if (!what.empty()) {
      std::printf("error: unknown line: %s\n", line.c_str());
      return 1;
    }
    std::fflush(stdout);
  }
  return 0;
}
