// Trainer::evaluate(), score() and next_logits() (train/trainer.hpp): the streaming forward of a
// batch with no gradient and no update, a micro-batch at a time. Its items are a step's forward
// items (keeping no checkpoint for a backward) and the head's loss alone (head_eval), so each
// token's loss, and log-probability, has the same bits as a training step's forward; or, for
// next_logits(), the head's logits at one position of each row (StepContext::logits_at).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "megatrain/train/trainer.hpp"

namespace megatrain {

template <class B, class Block, class... U>
double Trainer<B, Block, U...>::evaluate(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                         std::int64_t rows, std::span<const std::int32_t> positions) {
  MT_NVTX_RANGE("Trainer::evaluate");
  double total = 0;
  forward_only(ids, labels, rows, positions, [&](std::size_t, std::span<const typename B::Acc> loss) {
    for (const auto l : loss) total += static_cast<double>(l);
  });
  std::int64_t valid = 0;
  for (const auto y : labels) valid += y != kIgnoreIndex;
  return total / static_cast<double>(valid);
}

template <class B, class Block, class... U>
std::vector<double> Trainer<B, Block, U...>::score(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                                   std::int64_t rows, std::span<const std::int32_t> positions) {
  MT_NVTX_RANGE("Trainer::score");
  std::vector<double> lp(labels.size());
  forward_only(ids, labels, rows, positions, [&](std::size_t first, std::span<const typename B::Acc> loss) {
    BatchStaging<B>::to_log_probs(loss, std::span<double>(lp).subspan(first, loss.size()));
  });
  return lp;
}

template <class B, class Block, class... U>
std::vector<float> Trainer<B, Block, U...>::next_logits(std::span<const std::int32_t> ids, std::int64_t rows,
                                                        std::span<const std::int64_t> at) {
  MT_NVTX_RANGE("Trainer::next_logits");
  const auto& opt = ctx_.opt;
  MT_CHECK(static_cast<std::int64_t>(at.size()) == rows, "next_logits: {} positions for {} rows", at.size(), rows);
  for (const std::int64_t p : at)
    MT_CHECK(p >= 0 && p < opt.seq_len, "next_logits: position {} outside a row of {} tokens", p, opt.seq_len);
  const auto V = static_cast<std::size_t>(ctx_.vocab()), R = static_cast<std::size_t>(opt.micro_rows());
  if (ctx_.logits_dev.size() < V) ctx_.logits_dev = ctx_.be.template alloc<typename B::Act>(V);
  ctx_.logits_host.assign(R * V, typename B::Act{});
  std::vector<float> out(static_cast<std::size_t>(rows) * V);
  const std::vector<std::int32_t> none(ids.size(), kIgnoreIndex);
  std::int64_t first_row = 0;
  forward_only(
      ids, none, rows, {},
      [&](std::size_t, std::span<const typename B::Acc>) {
        for (std::size_t i = 0; i < ctx_.logits_host.size(); ++i)
          out[static_cast<std::size_t>(first_row) * V + i] = static_cast<float>(ctx_.logits_host[i]);
        first_row += opt.micro_rows();
      },
      at);
  return out;
}

template <class B, class Block, class... U>
template <class F>
void Trainer<B, Block, U...>::forward_only(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                           std::int64_t rows, std::span<const std::int32_t> positions, F&& each,
                                           std::span<const std::int64_t> logits_at) {
  const auto& opt = ctx_.opt;
  MT_CHECK(rows > 0 && rows % opt.micro_rows() == 0, "evaluation rows {} must be a positive multiple of {}", rows, opt.micro_rows());
  const std::int64_t valid = BatchStaging<B>::check(ids, labels, rows, opt.seq_len, ctx_.vocab());
  MT_CHECK(valid > 0 || !logits_at.empty(), "the evaluation batch has no token with a label");
  BatchStaging<B>::check_positions(opt, positions, rows);
  const std::int64_t mt = opt.micro_rows() * opt.seq_len;
  load_device_units();
  for (std::int64_t first = 0; first < rows; first += opt.micro_rows()) {
    const auto off = static_cast<std::size_t>(first * opt.seq_len);
    std::copy_n(ids.begin() + off, mt, ctx_.batch.ids_host.begin());
    std::copy_n(labels.begin() + off, mt, ctx_.batch.labels_host.begin());
    ctx_.batch.stage_positions(opt, positions.empty() ? positions : positions.subspan(off, static_cast<std::size_t>(mt)),
                               opt.micro_rows());
    if (!ctx_.devices.holds(0))
      ctx_.touched.find(std::span<const std::int32_t>(ctx_.batch.ids_host).first(static_cast<std::size_t>(mt)),
                        ctx_.model.embedding().op().padding_id());
    ctx_.state.micro_rows = opt.micro_rows();
    // (the head's evaluation item makes these rows' logits instead of its losses where given)
    ctx_.logits_at.clear();
    if (!logits_at.empty()) {
      const auto mine = logits_at.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(opt.micro_rows()));
      ctx_.logits_at.assign(mine.begin(), mine.end());
    }
    std::vector<TrainItem> items;
    for (std::size_t u = 0; u <= ctx_.model.num_blocks(); ++u) items.push_back({Kind::forward, u, 0, 1});  // (1: keeps nothing)
    items.push_back({Kind::head_eval, ctx_.model.head_unit(), 0});
    pipeline_->submit(items);
    pipeline_->drain();
    settle();  // (a pending update went first)
    ctx_.logits_at.clear();
    each(off, std::span<const typename B::Acc>(ctx_.batch.loss_host).first(static_cast<std::size_t>(mt)));
  }
}

}  // namespace megatrain
