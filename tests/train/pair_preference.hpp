// A test objective that reads the step's log-probabilities (train/objective.hpp): a preference
// between the rows of each pair, shared by the CPU and GPU trainer tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "megatrain/backend/backend.hpp"
#include "megatrain/train/objective.hpp"

namespace megatrain::test {

// A preference between the rows of each pair (2i preferred to 2i + 1): with S_r the sum of row
// r's log-probabilities, L = sum over pairs of softplus(-(S_2i - S_2i+1)) / pairs (DPO's form,
// without a reference model). Its weights need the step's own log-probabilities.
class PairPreference final : public Objective {
 public:
  /// `batch_rows`: the step's rows (this process's), two a pair.
  explicit PairPreference(std::int64_t batch_rows) : batch_rows_(batch_rows) {}
  std::string name() const override { return "pair preference (test)"; }
  bool needs_log_probs() const override { return true; }
  void weights(const ObjectiveRows& r, std::span<float> w) const override {
    for (std::int64_t p = 0; p < r.rows / 2; ++p) {
      const double s = sigmoid(-margin(r, p)) / pairs(r);
      fill(r, 2 * p, s, w);
      fill(r, 2 * p + 1, -s, w);
    }
  }
  double value(const ObjectiveRows& r) const override {
    double v = 0;
    for (std::int64_t p = 0; p < r.rows / 2; ++p) v += std::log1p(std::exp(-margin(r, p))) / pairs(r);
    return v;
  }

 private:
  static double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
  double pairs(const ObjectiveRows&) const { return static_cast<double>(batch_rows_ / 2); }  // (the step's)
  static double row_sum(const ObjectiveRows& r, std::int64_t row) {
    double s = 0;
    for (std::int64_t t = row * r.seq_len; t < (row + 1) * r.seq_len; ++t) s += r.log_probs[static_cast<std::size_t>(t)];
    return s;
  }
  static double margin(const ObjectiveRows& r, std::int64_t p) { return row_sum(r, 2 * p) - row_sum(r, 2 * p + 1); }
  static void fill(const ObjectiveRows& r, std::int64_t row, double v, std::span<float> w) {
    for (std::int64_t t = row * r.seq_len; t < (row + 1) * r.seq_len; ++t)
      w[static_cast<std::size_t>(t)] = r.labels[static_cast<std::size_t>(t)] == kIgnoreIndex ? 0.0f : static_cast<float>(v);
  }
  std::int64_t batch_rows_;
};

}  // namespace megatrain::test
