// The persisted autotuning table (see gemm_tuning.h). Torch-free: plain C++ and the CUDA runtime.
#include "bindings/gemm_tuning.h"

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>

#include <cuda_runtime_api.h>

namespace cutlass_ext::tuning {
namespace {

struct Table {
  std::mutex mu;
  std::map<std::string, std::string> entries;
  std::string path;
};

Table& table() {
  static Table t;
  return t;
}

std::atomic<bool> g_enabled{false};
std::atomic<bool> g_nonempty{false};
std::atomic<int> g_sustain_ms{400};

std::string device_name(int device) {
  static std::mutex mu;
  static std::map<int, std::string> names;
  std::lock_guard<std::mutex> lock(mu);
  auto it = names.find(device);
  if (it != names.end()) return it->second;
  cudaDeviceProp prop{};
  std::string name = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "unknown device";
  for (char& c : name) {
    if (c == '|' || c == '\t' || c == '\n') c = ' ';
  }
  names[device] = name;
  return name;
}

}  // namespace

int64_t bucket(int64_t extent) {
  int64_t b = 1;
  while (b < extent) b <<= 1;
  return b;
}

std::string make_key(int device, const char* dtype, const char* math, const char* layouts, const char* epilogue,
                     int64_t M, int64_t N, int64_t K, bool batched) {
  return device_name(device) + "|" + dtype + "|" + math + "|" + layouts + "|" + epilogue + "|" +
         std::to_string(bucket(M)) + "x" + std::to_string(bucket(N)) + "x" + std::to_string(bucket(K)) + "|" +
         (batched ? "batched" : "single");
}

bool active() { return g_enabled.load(std::memory_order_relaxed) || g_nonempty.load(std::memory_order_relaxed); }

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

std::string lookup(const std::string& key) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.entries.find(key);
  return it == t.entries.end() ? std::string() : it->second;
}

void record(const std::string& key, const std::string& config) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.entries[key] = config;
  g_nonempty.store(true, std::memory_order_relaxed);
  if (!t.path.empty()) {
    std::ofstream out(t.path, std::ios::app);
    if (out) out << key << '\t' << config << '\n';
  }
}

void configure(const std::string& path, bool enable) {
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.path = path;
    t.entries.clear();
    if (!path.empty()) {
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) {
        const size_t tab = line.find('\t');
        if (tab == std::string::npos || tab == 0 || tab + 1 >= line.size()) continue;  // malformed: skipped
        t.entries[line.substr(0, tab)] = line.substr(tab + 1);
      }
    }
    g_nonempty.store(!t.entries.empty(), std::memory_order_relaxed);
  }
  g_enabled.store(enable, std::memory_order_relaxed);
}

void set_enabled(bool enable) { g_enabled.store(enable, std::memory_order_relaxed); }

void set_sustain_ms(int ms) { g_sustain_ms.store(ms < 0 ? 0 : ms, std::memory_order_relaxed); }

int sustain_ms() { return g_sustain_ms.load(std::memory_order_relaxed); }

std::vector<std::tuple<std::string, std::string>> entries() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& [key, config] : t.entries) out.emplace_back(key, config);
  return out;
}

void clear() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.entries.clear();
  g_nonempty.store(false, std::memory_order_relaxed);
}

}  // namespace cutlass_ext::tuning
