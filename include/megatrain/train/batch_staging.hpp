// A step's batch on its way to the device: the ids and labels (checked), packed rows' positions
// and where their sequences start, a mixture of experts' attention mask (which tokens its
// routing statistics and auxiliary loss count), and an objective's weight per token
// (train/objective.hpp). Host copies are pinned where there is a GPU; each micro-batch's part is
// uploaded by its forward (the weights by its head).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/train/objective.hpp"

namespace megatrain {

template <class B>
class BatchStaging {
  using Exec = typename B::Executor;
  using Acc = typename B::Acc;
  template <class E>
  using Buf = typename B::template Buffer<E>;

 public:
  /// The device's buffers of one micro-batch: ids, labels, packed rows' positions and sequence
  /// starts, the tokens that count (a mixture of experts with padding).
  void allocate_device(B& be, const plan::TrainerBuffers& b) {
    ids_dev = be.template alloc<std::int32_t>(b.micro_tokens);
    labels_dev = be.template alloc<std::int32_t>(b.micro_tokens);
    if (b.packed) {  // a micro-batch's positions, and where its sequences start (at most one per token)
      MT_CHECK(b.batch_tokens < static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
               "packed rows: a batch of {} tokens exceeds the int32 offsets of its sequences", b.batch_tokens);
      positions_dev_ = be.template alloc<std::int32_t>(b.micro_tokens);
      starts_dev_ = be.template alloc<std::int32_t>(b.micro_tokens + 1);
    }
    if (b.token_mask) valid_dev = be.template alloc<std::uint8_t>(b.micro_tokens);
    if (b.token_weights) weights_dev = be.template alloc<Acc>(b.micro_tokens);
  }
  /// The batch's host copies (pinned with a GPU): ids, labels, compact ids and touched rows
  /// (int32), per-token losses; positions and sequence starts; the attention mask.
  void allocate_host(const plan::TrainerBuffers& b, std::int64_t batch_rows) {
    const std::size_t n = b.batch_tokens;
    host_io_ = HostBuffer::allocate(n * (4 * sizeof(std::int32_t) + sizeof(Acc)));
    if (b.packed) {  // positions, then the sequences' starts (pinned: uploaded asynchronously)
      positions_mem_ = HostBuffer::allocate((2 * n + 1) * sizeof(std::int32_t));
      positions_host_ = positions_mem_.template as<std::int32_t>(0, n);
      starts_host_ = positions_mem_.template as<std::int32_t>(n, n + 1);
      row_seq_.assign(static_cast<std::size_t>(batch_rows) + 1, 0);
    }
    ids_host = host_io_.template as<std::int32_t>(0, n);
    labels_host = host_io_.template as<std::int32_t>(n, n);
    compact_ids_host = host_io_.template as<std::int32_t>(2 * n, n);
    touched_host = host_io_.template as<std::int32_t>(3 * n, n);
    loss_host = std::span<Acc>(reinterpret_cast<Acc*>(touched_host.data() + n), n);
    if (b.token_mask) {
      valid_mem_ = HostBuffer::allocate(n);
      valid_host = valid_mem_.template as<std::uint8_t>(0, n);
    }
    if (b.token_weights) {
      weights_mem_ = HostBuffer::allocate(n * sizeof(Acc));
      weights_host = weights_mem_.template as<Acc>(0, n);
    }
  }

  /// The tokens with a label among `rows` sequences; throws before anything is copied where the
  /// batch is malformed (sizes, ids or labels outside the vocabulary).
  static std::int64_t check(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows,
                            std::int64_t seq, std::int64_t vocab) {
    const auto n = static_cast<std::size_t>(rows * seq);
    MT_CHECK(ids.size() == n && labels.size() == n, "batch of {} ids and {} labels; expected {} sequences x {} tokens = {}",
             ids.size(), labels.size(), rows, seq, n);
    std::int64_t valid = 0;
    for (std::size_t i = 0; i < n; ++i) {
      MT_CHECK(ids[i] >= 0 && ids[i] < vocab, "token id {} at position {} is outside the vocabulary [0, {})", ids[i], i, vocab);
      MT_CHECK(labels[i] == kIgnoreIndex || (labels[i] >= 0 && labels[i] < vocab),
               "label {} at position {} is outside the vocabulary [0, {}) and is not {}", labels[i], i, vocab, kIgnoreIndex);
      valid += labels[i] != kIgnoreIndex;
    }
    return valid;
  }
  /// A step's batch, checked (check(), check_positions(), check_attention_mask()), into the host
  /// buffers.
  void stage(const TrainerOptions& opt, std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
             std::span<const std::int32_t> positions, std::span<const std::uint8_t> attention_mask) {
    check_positions(opt, positions, opt.batch_rows);
    check_attention_mask(opt.seq_len, attention_mask, labels, opt.batch_rows);
    std::copy(ids.begin(), ids.end(), ids_host.begin());
    std::copy(labels.begin(), labels.end(), labels_host.begin());
    stage_positions(opt, positions, opt.batch_rows);
    stage_attention_mask(opt, attention_mask);
  }
  /// Positions must come with TrainerOptions::packed, one per token, 0 at each row's start and
  /// wherever a sequence starts, the previous one plus one elsewhere.
  static void check_positions(const TrainerOptions& opt, std::span<const std::int32_t> positions, std::int64_t rows) {
    if (positions.empty()) return;
    MT_CHECK(opt.packed, "positions were given, but the trainer was not made for packed rows (TrainerOptions::packed)");
    const std::int64_t seq = opt.seq_len;
    MT_CHECK(static_cast<std::int64_t>(positions.size()) == rows * seq, "{} positions for {} sequences x {} tokens",
             positions.size(), rows, seq);
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      const std::int32_t p = positions[static_cast<std::size_t>(i)];
      const bool ok = i % seq == 0 ? p == 0 : (p == 0 || p == positions[static_cast<std::size_t>(i - 1)] + 1);
      MT_CHECK(ok, "position {} at token {} (row {}, column {}): a row starts at 0, and each position is 0 (a new "
               "sequence) or the previous one plus 1", p, i, i / seq, i % seq);
    }
  }
  /// An attention mask (Trainer::step): one 0 or 1 a token, each row's zeros after its ones, and
  /// no label on padding.
  static void check_attention_mask(std::int64_t seq, std::span<const std::uint8_t> mask, std::span<const std::int32_t> labels,
                                   std::int64_t rows) {
    if (mask.empty()) return;
    MT_CHECK(static_cast<std::int64_t>(mask.size()) == rows * seq, "an attention mask of {} values for {} sequences x {} tokens",
             mask.size(), rows, seq);
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      const std::uint8_t v = mask[static_cast<std::size_t>(i)];
      MT_CHECK(v <= 1, "attention mask value {} at token {} (row {}, column {}): it is 1 for a token, 0 for padding", v, i,
               i / seq, i % seq);
      MT_CHECK(v == 0 || i % seq == 0 || mask[static_cast<std::size_t>(i - 1)] == 1,
               "the attention mask has a token after padding at token {} (row {}, column {}): padding must come after a "
               "row's tokens (right padding)", i, i / seq, i % seq);
    }
    // (transformers' mask keeps padding from attending to padding and megatrain attends causally:
    // a padded token's logits differ, so no loss may read them)
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      MT_CHECK(mask[static_cast<std::size_t>(i)] == 1 || labels[static_cast<std::size_t>(i)] == kIgnoreIndex,
               "token {} (row {}, column {}) is padding (attention mask 0) but has the label {}: give padding the label {} "
               "(ignored)", i, i / seq, i % seq, labels[static_cast<std::size_t>(i)], kIgnoreIndex);
    }
  }

  /// A mixture of experts' copy of a mask that leaves some padding out (masked), and the tokens
  /// each micro-batch counts; without padding the statistics count every token.
  void stage_attention_mask(const TrainerOptions& opt, std::span<const std::uint8_t> mask) {
    valid_count_.clear();
    masked = !valid_host.empty() && std::find(mask.begin(), mask.end(), std::uint8_t{0}) != mask.end();
    if (!masked) return;
    std::copy(mask.begin(), mask.end(), valid_host.begin());
    const auto per = static_cast<std::size_t>(opt.micro_rows() * opt.seq_len);
    valid_count_.assign(static_cast<std::size_t>(opt.micro_batches), 0);
    for (std::size_t i = 0; i < valid_host.size(); ++i) valid_count_[i / per] += valid_host[i];
  }
  /// The tokens micro-batch m's auxiliary loss counts (all of them without an attention mask).
  std::int64_t counted_tokens(const TrainerOptions& opt, std::int64_t m) const {
    return valid_count_.empty() ? opt.micro_rows() * opt.seq_len : valid_count_[static_cast<std::size_t>(m)];
  }

  /// Host copies of the positions of `rows` rows (empty: each row one sequence) and of where
  /// their sequences start (and each row's first sequence).
  void stage_positions(const TrainerOptions& opt, std::span<const std::int32_t> positions, std::int64_t rows) {
    if (!opt.packed) return;
    const std::int64_t seq = opt.seq_len;
    std::int64_t n = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      row_seq_[static_cast<std::size_t>(r)] = n;
      for (std::int64_t c = 0; c < seq; ++c) {
        const auto i = static_cast<std::size_t>(r * seq + c);
        const std::int32_t p = positions.empty() ? static_cast<std::int32_t>(c) : positions[i];
        positions_host_[i] = p;
        if (p == 0) starts_host_[static_cast<std::size_t>(n++)] = static_cast<std::int32_t>(i);
      }
    }
    row_seq_[static_cast<std::size_t>(rows)] = n;
    starts_host_[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(rows * seq);
  }
  /// Uploads micro-batch m's positions and sequence starts (with its ids, in its forward).
  void upload_positions(B& be, Exec& exec, std::int64_t seq, std::int64_t m, std::int64_t rows) {
    const auto off = static_cast<std::size_t>(m * rows * seq), n = static_cast<std::size_t>(rows * seq);
    be.upload(exec, std::span<const std::int32_t>(positions_host_).subspan(off, n), positions_dev_.span().first(n));
    const auto s0 = static_cast<std::size_t>(row_seq_[static_cast<std::size_t>(m * rows)]);
    const auto s1 = static_cast<std::size_t>(row_seq_[static_cast<std::size_t>((m + 1) * rows)]);
    be.upload(exec, std::span<const std::int32_t>(starts_host_).subspan(s0, s1 - s0 + 1), starts_dev_.span().first(s1 - s0 + 1));
  }
  /// The packing of rows [r0, r0 + n) of micro-batch m (of `rows` rows), or none.
  PackedRows packed_rows(const TrainerOptions& opt, std::int64_t m, std::int64_t rows, std::int64_t r0, std::int64_t n) const {
    if (!opt.packed) return {};
    const std::int64_t seq = opt.seq_len, base = row_seq_[static_cast<std::size_t>(m * rows)];
    const std::int64_t s0 = row_seq_[static_cast<std::size_t>(m * rows + r0)], s1 = row_seq_[static_cast<std::size_t>(m * rows + r0 + n)];
    const auto count = static_cast<std::size_t>(s1 - s0 + 1);
    PackedRows p;
    p.positions = View<const std::int32_t>(
        std::span<const std::int32_t>(positions_dev_.span()).subspan(static_cast<std::size_t>(r0 * seq), static_cast<std::size_t>(n * seq)),
        Shape{n * seq});
    p.starts = View<const std::int32_t>(
        std::span<const std::int32_t>(starts_dev_.span()).subspan(static_cast<std::size_t>(s0 - base), count),
        Shape{static_cast<std::int64_t>(count)});
    p.host_starts = std::span<const std::int32_t>(starts_host_).subspan(static_cast<std::size_t>(s0), count);
    return p;
  }
  /// The sum of the last pass's per-token losses.
  double sum_loss() const {
    double s = 0;
    for (Acc x : loss_host) s += static_cast<double>(x);
    return s;
  }

  /// The last pass's log-probabilities of the labels (minus its losses), token by token.
  std::vector<double> log_probs() const {
    std::vector<double> lp(loss_host.size());
    to_log_probs(loss_host, lp);
    return lp;
  }
  /// Log-probabilities from per-token losses: each loss negated, exactly (a double holds it).
  static void to_log_probs(std::span<const Acc> losses, std::span<double> out) {
    for (std::size_t t = 0; t < losses.size(); ++t) out[t] = -static_cast<double>(losses[t]);
  }

  // ---- an objective's view (train/objective.hpp) -----------------------------------------------
  /// Micro-batch m's rows (of `rows` rows each) as an objective sees them; with log-probabilities
  /// (from the losses of its head, which has run) where `with_log_probs`.
  ObjectiveRows objective_rows(const TrainerOptions& opt, std::int64_t m, std::int64_t rows, std::int64_t batch_labelled,
                               bool with_log_probs) {
    const auto off = static_cast<std::size_t>(m * rows * opt.seq_len), n = static_cast<std::size_t>(rows * opt.seq_len);
    ObjectiveRows r{m * rows, rows, opt.seq_len, std::span<const std::int32_t>(labels_host).subspan(off, n), {}, batch_labelled};
    if (opt.packed) r.positions = std::span<const std::int32_t>(positions_host_).subspan(off, n);
    if (with_log_probs) {
      log_probs_.resize(n);
      to_log_probs(std::span<const Acc>(loss_host).subspan(off, n), log_probs_);
      r.log_probs = log_probs_;
    }
    return r;
  }
  /// Micro-batch m's token weights into the host buffer (its head's losses known where the
  /// objective needs its log-probabilities).
  void stage_weights(const Objective& objective, const TrainerOptions& opt, std::int64_t m, std::int64_t rows,
                     std::int64_t batch_labelled) {
    const auto off = static_cast<std::size_t>(m * rows * opt.seq_len), n = static_cast<std::size_t>(rows * opt.seq_len);
    const ObjectiveRows r = objective_rows(opt, m, rows, batch_labelled, objective.needs_log_probs());
    if constexpr (std::is_same_v<Acc, float>) {
      objective.weights(r, weights_host.subspan(off, n));
    } else {
      std::vector<float> w(n);
      objective.weights(r, w);
      std::copy(w.begin(), w.end(), weights_host.begin() + static_cast<std::ptrdiff_t>(off));
    }
  }
  /// The objective's value over the step's micro-batches (this process's rows), their losses known.
  double objective_value(const Objective& objective, const TrainerOptions& opt, std::int64_t batch_labelled) {
    double v = 0;
    for (std::int64_t m = 0; m < opt.micro_batches; ++m)
      v += objective.value(objective_rows(opt, m, opt.micro_rows(), batch_labelled, true));
    return v;
  }

  Buf<std::int32_t> ids_dev, labels_dev;
  Buf<std::uint8_t> valid_dev;  // a micro-batch's tokens that count (masked)
  Buf<Acc> weights_dev;         // a micro-batch's token weights (an objective's, TrainerOptions::token_weights)
  std::span<std::int32_t> ids_host, labels_host, compact_ids_host, touched_host;
  std::span<Acc> loss_host;
  std::span<std::uint8_t> valid_host;
  std::span<Acc> weights_host;  // the batch's token weights
  bool masked = false;  // this step's mask leaves some padding out (else nothing is masked)

 private:
  Buf<std::int32_t> positions_dev_, starts_dev_;  // packed rows: a micro-batch's positions and sequence starts
  HostBuffer host_io_, positions_mem_, valid_mem_, weights_mem_;
  std::vector<double> log_probs_;  // a micro-batch's, for an objective
  std::span<std::int32_t> positions_host_, starts_host_;  // the batch's (starts: token offsets, then the end)
  std::vector<std::int64_t> row_seq_;                     // each row's first sequence in starts_host_, then the count
  std::vector<std::int64_t> valid_count_;
};

}  // namespace megatrain
