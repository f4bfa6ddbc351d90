// The shipped objectives (train/objective.hpp).
#include "megatrain/train/objective.hpp"

#include "megatrain/core/error.hpp"
#include "megatrain/backend/backend.hpp"

#include <algorithm>

namespace megatrain {

ObjectiveRows ObjectiveRows::whole(std::span<const std::int32_t> labels, std::span<const double> log_probs, std::int64_t rows,
                                   std::span<const std::int32_t> positions) {
  MT_CHECK(rows > 0 && labels.size() % static_cast<std::size_t>(rows) == 0, "ObjectiveRows::whole: {} labels in {} rows",
           labels.size(), rows);
  ObjectiveRows r;
  r.rows = rows;
  r.seq_len = static_cast<std::int64_t>(labels.size()) / rows;
  r.labels = labels;
  r.log_probs = log_probs;
  r.positions = positions;
  r.batch_labelled = std::count_if(labels.begin(), labels.end(), [](std::int32_t l) { return l != kIgnoreIndex; });
  return r;
}

namespace {

// -log p summed over the rows' labelled tokens, each times weight(t).
template <class F>
double weighted_nll(const ObjectiveRows& r, F&& weight) {
  MT_CHECK(r.log_probs.size() == r.labels.size(), "an objective's value needs the rows' log-probabilities ({} for {} labels)",
           r.log_probs.size(), r.labels.size());
  double s = 0;
  for (std::size_t t = 0; t < r.labels.size(); ++t)
    if (r.labels[t] != kIgnoreIndex) s += weight(t) * -r.log_probs[t];
  return s;
}

}  // namespace

void CrossEntropy::weights(const ObjectiveRows& r, std::span<float> w) const {
  const double u = 1.0 / static_cast<double>(r.batch_labelled);
  for (std::size_t t = 0; t < r.labels.size(); ++t) w[t] = r.labels[t] == kIgnoreIndex ? 0.0f : static_cast<float>(u);
}

double CrossEntropy::value(const ObjectiveRows& r) const {
  return weighted_nll(r, [](std::size_t) { return 1.0; }) / static_cast<double>(r.batch_labelled);
}

void TokenWeighted::weights(const ObjectiveRows& r, std::span<float> w) const {
  const auto first = static_cast<std::size_t>(r.first_row * r.seq_len);
  MT_CHECK(first + r.labels.size() <= w_.size(),
           "token-weighted objective: {} weights were given, but the batch has at least {} tokens (one weight a token, "
           "row by row)", w_.size(), first + r.labels.size());
  for (std::size_t t = 0; t < r.labels.size(); ++t) w[t] = r.labels[t] == kIgnoreIndex ? 0.0f : w_[first + t];
}

double TokenWeighted::value(const ObjectiveRows& r) const {
  const auto first = static_cast<std::size_t>(r.first_row * r.seq_len);
  return weighted_nll(r, [&](std::size_t t) { return static_cast<double>(w_[first + t]); });
}

}  // namespace megatrain
