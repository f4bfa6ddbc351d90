// What the trainer's stages share: the step's context they work on, the time each spends on its
// items (TrainerOptions::profile), and random delays that shake out ordering bugs in tests
// (TrainerOptions::jitter_us): the pipeline decides when things happen, never what is computed.
#pragma once

#include <chrono>
#include <cstddef>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "megatrain/train/train_item.hpp"

namespace megatrain::stages {

/// The spans of work an executor did for a stage, and the bytes it copied.
template <class X>
struct Timings {
  std::vector<std::pair<typename X::Mark, typename X::Mark>> spans;
  std::size_t bytes = 0;
  double seconds() const {
    double t = 0;
    for (const auto& [a, b] : spans) t += X::seconds(a, b);
    return t;
  }
  void reset(X& x) {
    spans.clear();
    bytes = 0;
    x.reset_marks();
  }
};

/// Marks the start of a stage's work for an item; its destruction marks the end.
template <class X>
struct Timed {
  X& x;
  Timings<X>* t;
  typename X::Mark start{};
  Timed(X& ex, Timings<X>* timings) : x(ex), t(timings) {
    if (t) start = x.mark();
  }
  ~Timed() {
    if (t) t->spans.emplace_back(start, x.mark());
  }
};

template <class Ctx>
struct StageBase {
  Ctx* ctx;
  void jitter(const TrainItem& it) const {
    if (ctx->opt.jitter_us <= 0) return;
    thread_local std::mt19937 rng(std::random_device{}());
    (void)it;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<unsigned>(ctx->opt.jitter_us + 1)));
  }
};

}  // namespace megatrain::stages
