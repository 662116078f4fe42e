// Runs csrc/bindings/gemm_tuning_rule.h on lines read from stdin (tests/test_tuning_rule_host.py):
// "finalists <heuristic> <n> <ms...>" prints the finalists' indices; "settle <heuristic> <n>
// <index...> <ms...>" prints the winner's index. A heuristic of -1 stands for none.
#include <cstddef>
#include <iostream>
#include <string>
#include <vector>

#include "bindings/gemm_tuning_rule.h"

int main() {
  namespace t = cutlass_ext::tuning;
  std::string what;
  while (std::cin >> what) {
    long heuristic;
    size_t n;
    std::cin >> heuristic >> n;
    const size_t h = heuristic < 0 ? t::kNoHeuristic : size_t(heuristic);
    if (what == "finalists") {
      std::vector<float> ms(n);
      for (float& v : ms) std::cin >> v;
      const std::vector<size_t> out = t::finalists(ms, h);
      for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? " " : "") << out[i];
      std::cout << "\n";
    } else {
      std::vector<size_t> finals(n);
      std::vector<float> ms(n);
      for (size_t& v : finals) std::cin >> v;
      for (float& v : ms) std::cin >> v;
      std::cout << t::settle(finals, ms, h) << "\n";
    }
  }
  return 0;
}
