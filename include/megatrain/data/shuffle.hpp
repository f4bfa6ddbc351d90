// The shuffled order of an epoch: the one random stream a training run's data order draws from
// (TokenDataset's windows, a GRPO run's prompts).
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace megatrain {

/// 0 .. n - 1 in the order of epoch `epoch` under `seed`: Fisher-Yates with a 64-bit engine whose
/// sequence the C++ standard fixes (unlike its distributions), so every platform draws the same.
inline std::vector<std::int64_t> shuffled_order(std::int64_t n, std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(epoch) + 1);
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i + 1));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  return order;
}

}  // namespace megatrain
