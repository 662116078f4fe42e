// How the autotuner settles a shape bucket from its measurements (gemm.cpp measures). Plain C++,
// no CUDA or torch, so that tests/test_tuning_rule_host.py runs it without a GPU.
//
// A burst of a few back-to-back calls runs at the GPU's boost clock, but a long run of large
// products (training) runs at the power cap, where the tiles' clocks differ by 10-15%
// (bench/NOTES.md section 72). So the burst only ranks the candidates: those within
// kFinalistSlack of the quickest, and the heuristic's pick, are the finalists, each timed again
// after running alone long enough to reach the clock the cap leaves it; the heuristic's pick stays
// unless a finalist beats it there by more than kKeepMargin, the spread of such timings.
#pragma once

#include <cstddef>
#include <limits>
#include <vector>

namespace cutlass_ext::tuning {

constexpr double kFinalistSlack = 0.10;
constexpr double kKeepMargin = 0.02;
constexpr size_t kNoHeuristic = std::numeric_limits<size_t>::max();

// The index of the quickest of `ms` (the first of equals); ms is not empty.
inline size_t quickest(const std::vector<float>& ms) {
  size_t best = 0;
  for (size_t i = 1; i < ms.size(); ++i) {
    if (ms[i] < ms[best]) best = i;
  }
  return best;
}

// The finalists among candidates timed `burst_ms`: the heuristic's pick (its index, or
// kNoHeuristic) first, then those within kFinalistSlack of the quickest, in the candidates' order.
inline std::vector<size_t> finalists(const std::vector<float>& burst_ms, size_t heuristic) {
  std::vector<size_t> out;
  if (heuristic < burst_ms.size()) out.push_back(heuristic);
  const float limit = float(burst_ms[quickest(burst_ms)] * (1.0 + kFinalistSlack));
  for (size_t i = 0; i < burst_ms.size(); ++i) {
    if (i != heuristic && burst_ms[i] <= limit) out.push_back(i);
  }
  return out;
}

// The winner among `finalists` (as finalists() returns them) from their times after running
// alone, `sustained_ms[j]` for finalists[j]: the heuristic's pick unless the quickest finalist
// beats it by more than kKeepMargin.
inline size_t settle(const std::vector<size_t>& finalists, const std::vector<float>& sustained_ms, size_t heuristic) {
  const size_t fastest = quickest(sustained_ms);
  if (heuristic == kNoHeuristic || finalists.front() != heuristic) return finalists[fastest];
  return sustained_ms[0] <= float(sustained_ms[fastest] * (1.0 + kKeepMargin)) ? heuristic : finalists[fastest];
}

}  // namespace cutlass_ext::tuning
