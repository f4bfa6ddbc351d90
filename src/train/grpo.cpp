// Group relative policy optimisation (see include/megatrain/train/grpo.hpp).
#include "megatrain/train/grpo.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain {

GrpoLoss grpo_loss(std::string_view name) {
  if (name == "grpo") return GrpoLoss::grpo;
  if (name == "dapo") return GrpoLoss::dapo;
  if (name == "dr_grpo") return GrpoLoss::dr_grpo;
  MT_FAIL("'{}' is not a GRPO loss: grpo, dapo or dr_grpo", name);
}

std::string_view grpo_loss_name(GrpoLoss l) {
  switch (l) {
    case GrpoLoss::grpo: return "grpo";
    case GrpoLoss::dapo: return "dapo";
    case GrpoLoss::dr_grpo: return "dr_grpo";
  }
  return "?";
}

RewardScale reward_scale(std::string_view name) {
  if (name == "group") return RewardScale::group;
  if (name == "batch") return RewardScale::batch;
  if (name == "none") return RewardScale::none;
  MT_FAIL("'{}' is not a reward scaling: group, batch or none", name);
}

std::string_view reward_scale_name(RewardScale s) {
  switch (s) {
    case RewardScale::group: return "group";
    case RewardScale::batch: return "batch";
    case RewardScale::none: return "none";
  }
  return "?";
}

void GrpoOptions::check() const {
  MT_CHECK(std::isfinite(epsilon) && epsilon > 0 && epsilon < 1, "grpo: epsilon must be in (0, 1), not {}", epsilon);
  MT_CHECK(std::isfinite(epsilon_high) && epsilon_high > 0, "grpo: epsilon_high must be > 0, not {}", epsilon_high);
  MT_CHECK(std::isfinite(beta) && beta >= 0, "grpo: beta must be >= 0, not {}", beta);
  MT_CHECK(loss != GrpoLoss::dr_grpo || max_completion_length > 0,
           "grpo: the dr_grpo loss divides by max_completion_length, which must be > 0 (got {})", max_completion_length);
}

GrpoStats& GrpoStats::operator+=(const GrpoStats& o) {
  tokens += o.tokens;
  low_clipped += o.low_clipped;
  high_clipped += o.high_clipped;
  kl += o.kl;
  return *this;
}

std::pair<double, double> mean_std(std::span<const double> v) {
  double mean = 0;
  for (const double x : v) mean += x;
  mean /= static_cast<double>(v.size());
  if (v.size() < 2) return {mean, 0.0};
  double ss = 0;
  for (const double x : v) ss += (x - mean) * (x - mean);
  return {mean, std::sqrt(ss / static_cast<double>(v.size() - 1))};
}

Advantages group_advantages(std::span<const double> rewards, std::int64_t group, RewardScale scale) {
  MT_CHECK(group >= 1, "grpo: groups of {} completions", group);
  const auto G = static_cast<std::size_t>(group);
  MT_CHECK(!rewards.empty() && rewards.size() % G == 0, "grpo: {} rewards are not whole groups of {}", rewards.size(), G);
  for (std::size_t i = 0; i < rewards.size(); ++i)
    MT_CHECK(std::isfinite(rewards[i]), "grpo: completion {}'s reward is {}: every reward must be a finite number", i,
             rewards[i]);
  Advantages a;
  a.groups = static_cast<std::int64_t>(rewards.size() / G);
  a.values.resize(rewards.size());
  const double batch_std = mean_std(rewards).second;
  for (std::size_t g = 0; g < rewards.size(); g += G) {
    const auto mine = rewards.subspan(g, G);
    const auto [mean, std] = mean_std(mine);
    const bool equal = std::all_of(mine.begin(), mine.end(), [&](double r) { return r == mine[0]; });
    a.equal_groups += equal ? 1 : 0;
    a.equal.push_back(equal ? 1 : 0);
    a.group_std.push_back(std);
    const double div = scale == RewardScale::none ? 1.0 : (scale == RewardScale::group ? std : batch_std) + 1e-4;
    for (std::size_t i = 0; i < G; ++i) a.values[g + i] = (mine[i] - mean) / div;
  }
  return a;
}

Grpo::Grpo(const GrpoOptions& options, std::vector<double> advantages, std::vector<double> old_log_probs,
           std::vector<double> reference, std::int64_t batch_rows)
    : o_(options), adv_(std::move(advantages)), old_(std::move(old_log_probs)), ref_(std::move(reference)),
      batch_rows_(batch_rows) {
  o_.check();
  MT_CHECK(batch_rows > 0, "grpo: a step of {} completions", batch_rows);
  MT_CHECK(o_.beta == 0 || !ref_.empty(), "grpo: beta {} weighs the KL to the reference: give the reference's "
           "log-probabilities", o_.beta);
  for (const double a : adv_) MT_CHECK(std::isfinite(a), "grpo: an advantage is {}", a);
}

std::string Grpo::name() const { return fmt::format("grpo ({}, epsilon {} / {})", grpo_loss_name(o_.loss), o_.epsilon,
                                                    o_.epsilon_high); }

Grpo::Token Grpo::token(std::size_t t, double lp, double a) const {
  Token k;
  MT_CHECK(old_.empty() || t < old_.size(), "grpo: the old log-probabilities cover {} tokens; token {} has none",
           old_.size(), t);
  const double r = old_.empty() ? 1.0 : std::exp(lp - old_[t]);
  const double c = std::clamp(r, 1 - o_.epsilon, 1 + o_.epsilon_high);
  // -min(r A, c A): the unclipped term where it is the smaller (or they tie), d/d(log p) = -A r;
  // else the clipped one, whose ratio is held at the bound: no gradient.
  const bool unclipped = r * a <= c * a;
  k.loss = -std::min(r * a, c * a);
  k.grad = unclipped ? -a * r : 0.0;
  k.low = r < 1 - o_.epsilon && a < 0;
  k.high = r > 1 + o_.epsilon_high && a > 0;
  if (o_.beta > 0) {
    MT_CHECK(t < ref_.size(), "grpo: the reference's log-probabilities cover {} tokens; token {} has none", ref_.size(), t);
    const double d = ref_[t] - lp;
    k.kl = std::exp(d) - d - 1;
    k.loss += o_.beta * k.kl;
    k.grad += o_.beta * (1 - std::exp(d));
  }
  return k;
}

double Grpo::scale(const ObjectiveRows& r, std::int64_t row_tokens) const {
  switch (o_.loss) {
    case GrpoLoss::grpo: return 1.0 / (static_cast<double>(std::max<std::int64_t>(row_tokens, 1)) * static_cast<double>(batch_rows_));
    case GrpoLoss::dapo: return 1.0 / static_cast<double>(std::max<std::int64_t>(r.batch_labelled, 1));
    case GrpoLoss::dr_grpo: return 1.0 / (static_cast<double>(batch_rows_) * static_cast<double>(o_.max_completion_length));
  }
  return 0;
}

template <class F>
void Grpo::each_token(const ObjectiveRows& r, F&& f) const {
  MT_CHECK(r.log_probs.size() == r.labels.size(), "grpo: {} log-probabilities for {} labels", r.log_probs.size(),
           r.labels.size());
  const auto S = static_cast<std::size_t>(r.seq_len);
  for (std::int64_t row = 0; row < r.rows; ++row) {
    const auto at = static_cast<std::size_t>(r.first_row + row);
    MT_CHECK(at < adv_.size(), "grpo: the advantages cover {} rows; row {} has none", adv_.size(), at);
    const auto first = static_cast<std::size_t>(row) * S;
    std::int64_t n = 0;
    for (std::size_t t = first; t < first + S; ++t) n += r.labels[t] != kIgnoreIndex;
    const double s = scale(r, n);
    for (std::size_t t = first; t < first + S; ++t)
      if (r.labels[t] != kIgnoreIndex) f(adv_[at], static_cast<std::size_t>(r.first_row) * S + t, t, s);
  }
}

void Grpo::weights(const ObjectiveRows& r, std::span<float> w) const {
  std::fill(w.begin(), w.end(), 0.0f);
  each_token(r, [&](double a, std::size_t step_t, std::size_t t, double s) {
    w[t] = static_cast<float>(-s * token(step_t, r.log_probs[t], a).grad);  // (w_t = -dL/d(log p_t))
  });
}

double Grpo::value(const ObjectiveRows& r) const {
  double total = 0;
  each_token(r, [&](double a, std::size_t step_t, std::size_t t, double s) { total += s * token(step_t, r.log_probs[t], a).loss; });
  return total;
}

GrpoStats Grpo::stats(const ObjectiveRows& r) const {
  GrpoStats st;
  each_token(r, [&](double a, std::size_t step_t, std::size_t t, double) {
    const Token k = token(step_t, r.log_probs[t], a);
    ++st.tokens;
    st.low_clipped += k.low ? 1.0 : 0.0;
    st.high_clipped += k.high ? 1.0 : 0.0;
    st.kl += k.kl;
  });
  return st;
}

}  // namespace megatrain
