// Trainer::evaluate() and Trainer::score() (train/trainer.hpp): the streaming forward of a batch
// with no gradient and no update, a micro-batch at a time. Its items are a step's forward items
// (keeping no checkpoint for a backward) and the head's loss alone (head_eval), so each token's
// loss, and log-probability, has the same bits as a training step's forward.
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
template <class F>
void Trainer<B, Block, U...>::forward_only(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                           std::int64_t rows, std::span<const std::int32_t> positions, F&& each) {
  const auto& opt = ctx_.opt;
  MT_CHECK(rows > 0 && rows % opt.micro_rows() == 0, "evaluation rows {} must be a positive multiple of {}", rows, opt.micro_rows());
  const std::int64_t valid = BatchStaging<B>::check(ids, labels, rows, opt.seq_len, ctx_.vocab());
  MT_CHECK(valid > 0, "the evaluation batch has no token with a label");
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
    std::vector<TrainItem> items;
    for (std::size_t u = 0; u <= ctx_.model.num_blocks(); ++u) items.push_back({Kind::forward, u, 0, 1});  // (1: keeps nothing)
    items.push_back({Kind::head_eval, ctx_.model.head_unit(), 0});
    pipeline_->submit(items);
    pipeline_->drain();
    settle();  // (a pending update went first)
    each(off, std::span<const typename B::Acc>(ctx_.batch.loss_host).first(static_cast<std::size_t>(mt)));
  }
}

}  // namespace megatrain
