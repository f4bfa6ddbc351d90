// Checks of a step's compute timeline (StepStats::Profile::compute_items, TrainerOptions::profile),
// shared by the CPU and GPU trainer tests.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "megatrain/train/cpu_trainer.hpp"

namespace megatrain::test {

/// Every unit's forward and backward once, the head once, in submission order, each span inside
/// the step, and the spans adding up to compute_s.
inline void check_timeline(const StepStats& st, std::size_t blocks) {
  REQUIRE(st.profile.has_value());
  const auto& p = *st.profile;
  using K = TrainItem::Kind;
  std::vector<int> fwd(blocks + 2), bwd(blocks + 2);
  int heads = 0;
  double sum = 0, last_start = 0;
  REQUIRE(!p.compute_items.empty());
  CHECK(p.compute_items.front().start_s == 0);
  for (const auto& it : p.compute_items) {
    REQUIRE(it.unit < blocks + 2);
    fwd[it.unit] += static_cast<K>(it.kind) == K::forward;
    bwd[it.unit] += static_cast<K>(it.kind) == K::backward;
    heads += static_cast<K>(it.kind) == K::head;
    CHECK(it.start_s >= last_start);
    CHECK(it.seconds >= 0);
    CHECK(it.host_s > 0);
    last_start = it.start_s;
    sum += it.seconds;
  }
  CHECK(heads == 1);
  for (std::size_t u = 0; u <= blocks; ++u) {
    CAPTURE(u);
    CHECK(fwd[u] == 1);
    CHECK(bwd[u] == 1);
  }
  CHECK(sum == doctest::Approx(p.compute_s).epsilon(1e-9));
  CHECK(last_start < st.seconds);
}

}  // namespace megatrain::test
