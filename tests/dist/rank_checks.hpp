// What the multi-process tests share (tests/dist, tests/cuda): a checksum of a replica's bits, and
// the failures a rank counts and reports.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace megatrain::test {

/// An FNV-1a checksum of the bits (the same on every rank iff the replicas agree, but for collisions).
inline std::int64_t checksum(const std::vector<float>& v) {
  std::uint32_t h = 2166136261u;
  for (const float x : v) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    h = (h ^ b) * 16777619u;
  }
  return static_cast<std::int64_t>(h);
}

/// A rank's failed checks (programs without a test framework: each rank exits 1 if any failed).
inline std::atomic<int>& rank_failures() {  // (atomic: the ranks may be threads of one process)
  static std::atomic<int> n{0};
  return n;
}
inline void rank_check(bool ok, const std::string& what, int rank) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  ++rank_failures();
}

/// A test of N ranks on a host with fewer GPUs skips: exit status 77 (CTest's SKIP_RETURN_CODE).
inline constexpr int kSkipped = 77;

}  // namespace megatrain::test
