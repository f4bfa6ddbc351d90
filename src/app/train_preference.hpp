// megatrain-train --objective dpo: preference training over pairs (docs/preference.md).
//
// The reference is the model as the run starts: before the first step, one forward pass over
// every training and validation window gives each row's summed log-probability of its labels
// (Trainer::score). It is kept in every checkpoint (dpo_reference.f64, its digest in the
// checkpoint's record), so a resumed run takes the same numbers. Each step then
// minimises megatrain::Dpo over its pairs (windows 2k and 2k + 1 of the order: TokenDataset's
// pairs; packed, each row's whole pairs), and the metrics carry TRL's rewards and
// log-probabilities. The reference holds a number an answer: a window's, or packed, each of its
// row's in order. With several ranks each scores its share of the reference's rows (the sums
// gathered: every rank holds all of them) and trains its share of each batch (whole pairs); the
// metrics are summed over the ranks.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/train/preference.hpp"
#include "megatrain/train/train_item.hpp"  // StepStats
#include "ranks.hpp"
#include "settings.hpp"
#include "train_load.hpp"  // StartState

namespace megatrain::app {

/// The reference's file in each checkpoint: little-endian float64, the training windows' then the
/// validation windows'.
inline constexpr const char* kDpoReferenceFile = "dpo_reference.f64";

/// What a checkpoint records of the reference (beside the file): where it can be told apart from
/// another run's.
inline nlohmann::json dpo_reference_record(const std::string& bytes, const nlohmann::json& data, const TokenDataset& d,
                                           std::int64_t seq, std::uint64_t seed) {
  nlohmann::json r{{"file", kDpoReferenceFile},
                   {"digest", digest_of(std::as_bytes(std::span(bytes.data(), bytes.size()))).hex()},
                   {"train_digest", data.value("train_digest", "")},  // (the data's, whatever its path)
                   {"train_windows", d.train_windows()},
                   {"val_windows", d.val_windows()},
                   {"seq", seq}};
  if (d.packed()) r["packed_seed"] = seed;  // (packed: the rows the seed drew, an answer a number)
  return r;
}

inline PreferenceOptions preference_options(const Settings& s) {
  PreferenceOptions o;
  o.loss = preference_loss(s.dpo_loss);
  o.beta = s.dpo_beta;
  o.label_smoothing = s.dpo_label_smoothing;
  return o;
}

template <class T>
class PreferenceRun {
 public:
  /// The reference: the resumed checkpoint's (`resumed`, where it carries one), else computed now
  /// with `trainer`'s weights. `data_identity`: what the run's checkpoints record of its data.
  PreferenceRun(const Settings& s, T& trainer, const TokenDataset& data, const Ranks& ranks,
                const std::optional<StartState::DpoReference>& resumed, const nlohmann::json& data_identity, FILE* out)
      : opt_(preference_options(s)), trainer_(trainer), data_(data), ranks_(ranks), seq_(s.seq), seed_(s.seed) {
    opt_.check();
    const std::int64_t tw = data.train_windows(), vw = data.val_windows();
    first_answer_.push_back(0);  // (each window's first answer in the reference: the training windows', then validation's)
    for (std::int64_t w = 0; w < tw + vw; ++w)
      first_answer_.push_back(first_answer_.back() + data.window_examples(w < tw ? w : w - tw, w >= tw));
    if (resumed) {
      const nlohmann::json& rec = resumed->record;
      const nlohmann::json now = dpo_reference_record(resumed->bytes, data_identity, data, seq_, seed_);
      MT_CHECK(now == rec, "--resume '{}': its DPO reference was computed for other data, another --seq or other packed rows "
               "({} training and {} validation rows of {} tokens then, {} and {} of {} now): resume with the run's --data, "
               "--seq, --pack and --seed", resumed->checkpoint, rec.value("train_windows", -1), rec.value("val_windows", -1),
               rec.value("seq", -1), tw, vw, seq_);
      bytes_ = resumed->bytes;
      std::fprintf(out, "dpo: the reference log-probabilities of %lld pairs taken from the checkpoint\n",
                   static_cast<long long>(first_answer_[static_cast<std::size_t>(tw)] / 2));
    } else {
      std::fprintf(out, "dpo: the reference: the log-probabilities of %lld training and %lld validation pairs under the "
                   "model as the run starts (one forward pass each)\n",
                   static_cast<long long>(first_answer_[static_cast<std::size_t>(tw)] / 2),
                   static_cast<long long>((first_answer_.back() - first_answer_[static_cast<std::size_t>(tw)]) / 2));
      std::fflush(out);
      std::vector<double> ref = sums(tw, false);
      const std::vector<double> val = sums(vw, true);
      ref.insert(ref.end(), val.begin(), val.end());
      bytes_.resize(ref.size() * sizeof(double));
      std::memcpy(bytes_.data(), ref.data(), bytes_.size());  // (little-endian hosts: megatrain's targets)
    }
    record_ = dpo_reference_record(bytes_, data_identity, data, seq_, seed_);
    const auto n = static_cast<std::size_t>(first_answer_.back());
    MT_CHECK(bytes_.size() == n * sizeof(double), "the DPO reference holds {} bytes for {} answers", bytes_.size(), n);
    ref_.resize(n);
    std::memcpy(ref_.data(), bytes_.data(), bytes_.size());
  }

  const std::string& file_bytes() const { return bytes_; }
  const nlohmann::json& record() const { return record_; }

  /// This rank's step of the batch that starts at slot `first_slot` of the training order: its
  /// rows (`labels`: rows 2i and 2i + 1 are a pair; packed, with `positions`, each row whole
  /// pairs) are the batch's from `first_slot + first_row`; `batch_rows`, the whole batch's. The
  /// pairs' statistics are kept for metrics().
  StepStats step(std::int64_t first_slot, std::int64_t first_row, std::int64_t batch_rows, std::span<const std::int32_t> ids,
                 std::span<const std::int32_t> labels, std::span<const std::int32_t> positions,
                 std::span<const std::uint8_t> mask) {
    const std::int64_t rows = static_cast<std::int64_t>(labels.size()) / seq_;
    std::vector<std::int64_t> windows;
    for (std::int64_t r = 0; r < rows; ++r) windows.push_back(data_.train_window(first_slot + first_row + r));
    std::int64_t answers = 0;  // (the whole batch's: every rank's rows)
    for (std::int64_t r = 0; r < batch_rows; ++r) answers += data_.window_examples(data_.train_window(first_slot + r));
    const Dpo dpo = objective(windows, 0, answers / 2);
    StepStats st = trainer_.step(dpo, ids, labels, positions, mask);
    const std::vector<double> lp = trainer_.last_log_probs();
    train_ = summed(dpo.stats(rows_of(labels, positions, lp, rows)));
    return st;
  }

  /// The mean DPO loss over the validation pairs of `rows` windows from the first, each rank
  /// scoring its share (the statistics kept for metrics()).
  double validation(std::int64_t rows) {
    const std::int64_t mine = rows / ranks_.world(), first = ranks_.rank() * mine;
    const auto n = static_cast<std::size_t>(mine * seq_);
    std::vector<std::int32_t> ids(n), labels(n), positions(data_.packed() ? n : 0);
    data_.val_batch(first, mine, ids, labels, positions);
    const std::vector<double> lp = trainer_.score(ids, labels, mine, positions);
    const std::int64_t tw = data_.train_windows(), vw = data_.val_windows();
    std::vector<std::int64_t> windows;
    std::int64_t answers = 0;
    for (std::int64_t r = 0; r < rows; ++r) answers += data_.window_examples(r % vw, true);
    for (std::int64_t r = 0; r < mine; ++r) windows.push_back((first + r) % vw);
    const Dpo dpo = objective(windows, tw, answers / 2);
    const ObjectiveRows all = rows_of(labels, positions, lp, mine);
    double value = dpo.value(all);
    if (ranks_.several()) ranks_.comm()->all_reduce_sum(std::span<double>(&value, 1));
    val_ = summed(dpo.stats(all));
    return value;
  }

  /// TRL's metrics of the last step (and of the last validation, when `val`): means over the pairs.
  void metrics(nlohmann::json& m, bool val) const {
    const auto put = [&](const std::string& prefix, const PreferenceStats& p) {
      const double n = static_cast<double>(std::max<std::int64_t>(p.pairs, 1));
      m[prefix + "rewards/chosen"] = p.rewards_chosen / n;
      m[prefix + "rewards/rejected"] = p.rewards_rejected / n;
      m[prefix + "rewards/accuracies"] = p.accuracies / n;
      m[prefix + "rewards/margins"] = p.margins / n;
      m[prefix + "logps/chosen"] = p.logps_chosen / n;
      m[prefix + "logps/rejected"] = p.logps_rejected / n;
    };
    put("", train_);
    if (val) put("val_", val_);
  }

 private:
  // The objective of rows of windows `windows` (+ `base`: the validation windows' place in the
  // reference): their answers' reference numbers in order and, packed, where each row's start.
  Dpo objective(const std::vector<std::int64_t>& windows, std::int64_t base, std::int64_t batch_pairs) const {
    std::vector<double> ref;
    std::vector<std::int64_t> row_first;
    for (const std::int64_t w : windows) {
      row_first.push_back(static_cast<std::int64_t>(ref.size()));
      const auto a = static_cast<std::size_t>(first_answer_[static_cast<std::size_t>(base + w)]);
      const auto b = static_cast<std::size_t>(first_answer_[static_cast<std::size_t>(base + w) + 1]);
      ref.insert(ref.end(), ref_.begin() + static_cast<std::ptrdiff_t>(a), ref_.begin() + static_cast<std::ptrdiff_t>(b));
    }
    if (!data_.packed()) row_first.clear();  // (an answer a row)
    return Dpo(opt_, std::move(ref), batch_pairs, std::move(row_first));
  }

  ObjectiveRows rows_of(std::span<const std::int32_t> labels, std::span<const std::int32_t> positions,
                        const std::vector<double>& lp, std::int64_t rows) const {
    return ObjectiveRows::whole(labels, lp, rows, data_.packed() ? positions : std::span<const std::int32_t>{});
  }

  // The statistics of every rank's pairs, summed.
  PreferenceStats summed(PreferenceStats p) const {
    if (!ranks_.several()) return p;
    double v[7] = {static_cast<double>(p.pairs), p.rewards_chosen, p.rewards_rejected, p.accuracies, p.margins,
                   p.logps_chosen, p.logps_rejected};
    ranks_.comm()->all_reduce_sum(std::span<double>(v));
    return {static_cast<std::int64_t>(v[0]), v[1], v[2], v[3], v[4], v[5], v[6]};
  }

  // Each answer's summed log-probability of its labels under the current weights, window after
  // window in file order (a window's answer, or packed, its row's sequences with a label): a
  // rank's rows at a time, the ranks taking turns (each as many calls; a call past the end wraps
  // around and its rows are not kept), then gathered (a sum: the others' answers are 0).
  std::vector<double> sums(std::int64_t windows, bool val) {
    const std::int64_t rows = trainer_.options().batch_rows, world = ranks_.world();
    const std::int64_t base = val ? data_.train_windows() : 0;
    const auto n = static_cast<std::size_t>(rows * seq_);
    std::vector<std::int32_t> ids(n), labels(n), positions(data_.packed() ? n : 0);
    const auto at = [&](std::int64_t w) { return static_cast<std::size_t>(first_answer_[static_cast<std::size_t>(base + w)]); };
    std::vector<double> out(at(windows) - at(0), 0.0);
    const std::int64_t calls = (windows + rows * world - 1) / (rows * world);
    for (std::int64_t c = 0; c < calls; ++c) {
      const std::int64_t first = (c * world + ranks_.rank()) * rows;
      if (val) data_.val_batch(first % windows, rows, ids, labels, positions);
      else data_.train_rows(first % windows, rows, ids, labels, positions);
      const std::vector<double> lp = trainer_.score(ids, labels, rows, positions);
      for (std::int64_t r = 0; r < rows && first + r < windows; ++r) {
        std::size_t k = at(first + r) - at(0);  // (this window's answers, in order)
        bool labelled = false;
        for (std::int64_t t = 0; t < seq_; ++t) {
          const auto i = static_cast<std::size_t>(r * seq_ + t);
          if (data_.packed() && t > 0 && positions[i] == 0 && labelled) ++k, labelled = false;  // (the next sequence)
          labelled = labelled || labels[i] != kIgnoreIndex;
          if (labels[i] != kIgnoreIndex) out[k] += lp[i];
        }
      }
    }
    if (ranks_.several()) ranks_.comm()->all_reduce_sum(std::span<double>(out));
    return out;
  }

  PreferenceOptions opt_;
  T& trainer_;
  const TokenDataset& data_;
  const Ranks& ranks_;
  std::int64_t seq_;
  std::uint64_t seed_;
  std::vector<std::int64_t> first_answer_;  // window w's first answer in ref_ (training windows, then validation's)
  std::string bytes_;
  nlohmann::json record_;
  std::vector<double> ref_;
  PreferenceStats train_, val_;
};

}  // namespace megatrain::app
