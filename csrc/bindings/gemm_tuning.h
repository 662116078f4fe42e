// Persisted GEMM autotuning: the config that measured fastest for a shape bucket, keyed by
// device, dtype, math mode, operand layouts, epilogue and bucket. The table is loaded from and
// appended to one text file (a line "key<TAB>config" per entry; the last line for a key wins),
// whose path and the on/off switch come from Python (cutlass_ext.tune, CUTLASS_EXT_AUTOTUNE).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace cutlass_ext::tuning {

// The bucket of an extent: the next power of two (1, 2, 4, ...).
int64_t bucket(int64_t extent);

// "<device name>|<dtype>|<math>|<layouts>|<epilogue>|<M>x<N>x<K>|<batched>", with bucketed extents.
std::string make_key(int device, const char* dtype, const char* math, const char* layouts, const char* epilogue,
                     int64_t M, int64_t N, int64_t K, bool batched);

// Whether any entry exists or tuning is on (a cheap check before building a key).
bool active();
bool enabled();
// The tuned config name for `key`, or "" when none is recorded.
std::string lookup(const std::string& key);
// Records a measured winner in the table and appends it to the file (when one is set).
void record(const std::string& key, const std::string& config);

// Called from Python: sets the file and replaces the table with its entries ("" keeps the table
// in memory only)
// and turns tuning of unseen buckets on or off.
void configure(const std::string& path, bool enable);
void set_enabled(bool enable);
// How long each finalist of a bucket runs alone before its timing (gemm_tuning_rule.h), in ms;
// 0 settles a bucket by the quickest burst alone. From CUTLASS_EXT_AUTOTUNE_SUSTAIN_MS (Python
// parses it); 400 unless set.
void set_sustain_ms(int ms);
int sustain_ms();
std::vector<std::tuple<std::string, std::string>> entries();
void clear();

}  // namespace cutlass_ext::tuning
