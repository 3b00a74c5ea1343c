// Helpers of the storage tests: a temporary directory and random spilled sequences.
#ifndef KVSIDECAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
#define KVSIDECAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_

#include <stdlib.h>

#include <filesystem>
#include <random>
#include <string>

#include "cache/tier.h"

namespace kvs::storage::testing_util {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvs-storage-XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string RandomBytes(std::mt19937& gen, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(gen());
  return out;
}

// `layers` layers of random sizes up to `max_layer_bytes` (some empty) and random metadata.
inline SpilledSequence RandomSequence(std::mt19937& gen, int layers, size_t max_layer_bytes) {
  SpilledSequence out;
  out.meta = RandomBytes(gen, 1 + gen() % 300);
  for (int l = 0; l < layers; ++l) {
    out.layers.push_back(RandomBytes(gen, gen() % 5 == 0 ? 0 : gen() % (max_layer_bytes + 1)));
  }
  return out;
}

}  // namespace kvs::storage::testing_util

#endif  // KVSIDECAR_TESTS_STORAGE_STORAGE_TEST_UTIL_H_
