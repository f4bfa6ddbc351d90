// Preference objectives (see include/megatrain/train/preference.hpp).
#include "megatrain/train/preference.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain {

namespace {

/// log sigmoid(z), without overflow.
double log_sigmoid(double z) { return z >= 0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }
double sigmoid(double z) { return z >= 0 ? 1 / (1 + std::exp(-z)) : std::exp(z) / (1 + std::exp(z)); }

}  // namespace

PreferenceLoss preference_loss(std::string_view name) {
  if (name == "sigmoid") return PreferenceLoss::sigmoid;
  if (name == "hinge") return PreferenceLoss::hinge;
  if (name == "ipo") return PreferenceLoss::ipo;
  MT_FAIL("'{}' is not a preference loss: sigmoid (DPO), hinge or ipo", name);
}

std::string_view preference_loss_name(PreferenceLoss l) {
  switch (l) {
    case PreferenceLoss::sigmoid: return "sigmoid";
    case PreferenceLoss::hinge: return "hinge";
    case PreferenceLoss::ipo: return "ipo";
  }
  return "?";
}

void PreferenceOptions::check() const {
  MT_CHECK(std::isfinite(beta) && beta > 0, "preference: beta must be > 0, not {}", beta);
  MT_CHECK(label_smoothing >= 0 && label_smoothing < 0.5, "preference: label_smoothing must be in [0, 0.5), not {}",
           label_smoothing);
  MT_CHECK(label_smoothing == 0 || loss == PreferenceLoss::sigmoid,
           "preference: label_smoothing applies to the sigmoid loss, not {}", preference_loss_name(loss));
}

PreferenceStats& PreferenceStats::operator+=(const PreferenceStats& o) {
  pairs += o.pairs;
  rewards_chosen += o.rewards_chosen;
  rewards_rejected += o.rewards_rejected;
  accuracies += o.accuracies;
  margins += o.margins;
  logps_chosen += o.logps_chosen;
  logps_rejected += o.logps_rejected;
  return *this;
}

Dpo::Dpo(const PreferenceOptions& options, std::vector<double> reference, std::int64_t batch_pairs,
         std::vector<std::int64_t> row_first)
    : o_(options), ref_(std::move(reference)), batch_pairs_(batch_pairs), row_first_(std::move(row_first)) {
  o_.check();
  MT_CHECK(batch_pairs > 0, "preference: a step of {} pairs", batch_pairs);
}

std::string Dpo::name() const { return fmt::format("dpo ({}, beta {})", preference_loss_name(o_.loss), o_.beta); }

std::vector<Dpo::Answer> Dpo::answers(const ObjectiveRows& r) const {
  MT_CHECK(r.log_probs.empty() || r.log_probs.size() == r.labels.size(), "preference: {} log-probabilities for {} labels",
           r.log_probs.size(), r.labels.size());
  const auto S = static_cast<std::size_t>(r.seq_len);
  std::vector<Answer> out;
  if (r.positions.empty()) {  // (an answer a row)
    MT_CHECK(r.rows % 2 == 0 && r.first_row % 2 == 0, "preference: a micro-batch of rows {} to {} splits a pair (rows "
             "2i and 2i + 1: a chosen and a rejected answer); give micro-batches of whole pairs", r.first_row,
             r.first_row + r.rows - 1);
    for (std::int64_t row = 0; row < r.rows; ++row) {
      const auto b = static_cast<std::size_t>(row) * S;
      out.push_back({b, b + S, static_cast<std::size_t>(r.first_row + row)});
    }
    return out;
  }
  MT_CHECK(r.positions.size() == r.labels.size(), "preference: {} positions for {} labels", r.positions.size(),
           r.labels.size());
  for (std::int64_t row = 0; row < r.rows; ++row) {  // (each row's sequences with a label)
    const auto at = static_cast<std::size_t>(r.first_row + row);
    MT_CHECK(at < row_first_.size(), "preference: packed rows need where each row's answers' references start; row {} has "
             "none", at);
    const std::size_t before = out.size();
    for (std::size_t b = static_cast<std::size_t>(row) * S, e = b; b < static_cast<std::size_t>(row + 1) * S; b = e) {
      for (e = b + 1; e < static_cast<std::size_t>(row + 1) * S && r.positions[e] != 0; ++e) {
      }
      if (std::any_of(r.labels.begin() + static_cast<std::ptrdiff_t>(b), r.labels.begin() + static_cast<std::ptrdiff_t>(e),
                      [](std::int32_t l) { return l != kIgnoreIndex; }))
        out.push_back({b, e, static_cast<std::size_t>(row_first_[at]) + (out.size() - before)});
    }
    MT_CHECK((out.size() - before) % 2 == 0, "preference: packed row {} holds {} answers: a row must hold whole pairs (a "
             "chosen then a rejected answer)", at, out.size() - before);
  }
  return out;
}

Dpo::Pair Dpo::pair(const ObjectiveRows& r, const Answer& chosen, const Answer& rejected) const {
  MT_CHECK(r.log_probs.size() == r.labels.size(), "preference: {} log-probabilities for {} labels (the loss reads them)",
           r.log_probs.size(), r.labels.size());
  double sum[2] = {0, 0}, count[2] = {0, 0};
  const Answer* a[2] = {&chosen, &rejected};
  for (int k = 0; k < 2; ++k) {
    for (std::size_t t = a[k]->begin; t < a[k]->end; ++t)
      if (r.labels[t] != kIgnoreIndex) {
        sum[k] += r.log_probs[t];
        ++count[k];
      }
    MT_CHECK(count[k] > 0, "preference: pair {}'s {} answer (row {}) has no labelled token", chosen.ref / 2,
             k == 0 ? "chosen" : "rejected", r.first_row + static_cast<std::int64_t>(a[k]->begin) / r.seq_len);
    MT_CHECK(a[k]->ref < ref_.size(), "preference: the reference's log-probabilities cover {} answers; answer {} has none",
             ref_.size(), a[k]->ref);
  }
  Pair p{0, 1, 1, sum[0], sum[1], ref_[chosen.ref], ref_[rejected.ref]};
  if (o_.loss == PreferenceLoss::ipo) {  // (per-token means, the reference's too)
    p.scale_chosen = 1 / count[0];
    p.scale_rejected = 1 / count[1];
    p.pi_chosen *= p.scale_chosen;
    p.ref_chosen *= p.scale_chosen;
    p.pi_rejected *= p.scale_rejected;
    p.ref_rejected *= p.scale_rejected;
  }
  p.h = (p.pi_chosen - p.ref_chosen) - (p.pi_rejected - p.ref_rejected);
  return p;
}

double Dpo::loss(double h, double* dloss_dh) const {
  const double b = o_.beta, z = b * h, e = o_.label_smoothing;
  switch (o_.loss) {
    case PreferenceLoss::sigmoid:
      *dloss_dh = b * (-(1 - e) * sigmoid(-z) + e * sigmoid(z));
      return -(1 - e) * log_sigmoid(z) - e * log_sigmoid(-z);
    case PreferenceLoss::hinge:
      *dloss_dh = z < 1 ? -b : 0.0;
      return std::max(0.0, 1 - z);
    case PreferenceLoss::ipo: {
      const double d = h - 1 / (2 * b);
      *dloss_dh = 2 * d;
      return d * d;
    }
  }
  return 0;
}

void Dpo::weights(const ObjectiveRows& r, std::span<float> w) const {
  const double n = static_cast<double>(batch_pairs_);
  std::fill(w.begin(), w.end(), 0.0f);
  const std::vector<Answer> as = answers(r);
  for (std::size_t i = 0; i + 1 < as.size(); i += 2) {
    const Pair p = pair(r, as[i], as[i + 1]);
    double d = 0;
    (void)loss(p.h, &d);
    // w_t = -dL/d(log p_t): dh/d(log p_t) is scale_chosen on the chosen answer, -scale_rejected on the other
    const double wc = -d * p.scale_chosen / n, wr = d * p.scale_rejected / n;
    for (int k = 0; k < 2; ++k)
      for (std::size_t t = as[i + k].begin; t < as[i + k].end; ++t)
        w[t] = r.labels[t] == kIgnoreIndex ? 0.0f : static_cast<float>(k == 0 ? wc : wr);
  }
}

double Dpo::value(const ObjectiveRows& r) const {
  double total = 0, unused = 0;
  const std::vector<Answer> as = answers(r);
  for (std::size_t i = 0; i + 1 < as.size(); i += 2) total += loss(pair(r, as[i], as[i + 1]).h, &unused);
  return total / static_cast<double>(batch_pairs_);
}

PreferenceStats Dpo::stats(const ObjectiveRows& r) const {
  PreferenceStats s;
  const std::vector<Answer> as = answers(r);
  for (std::size_t i = 0; i + 1 < as.size(); i += 2) {
    const Pair p = pair(r, as[i], as[i + 1]);
    const double rc = o_.beta * (p.pi_chosen - p.ref_chosen), rr = o_.beta * (p.pi_rejected - p.ref_rejected);
    ++s.pairs;
    s.rewards_chosen += rc;
    s.rewards_rejected += rr;
    s.accuracies += rc > rr ? 1.0 : 0.0;
    s.margins += rc - rr;
    s.logps_chosen += p.pi_chosen;
    s.logps_rejected += p.pi_rejected;
  }
  return s;
}

}  // namespace megatrain
