// megatrain-train --steps 0: the validation loss of the model as one JSON line on stdout (unless
// --eval-batches 0), then --export if given; nothing else is written.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "megatrain/data/token_dataset.hpp"
#include "train_build.hpp"

namespace megatrain::app {

/// The validation loss over `rows` windows, in batches of `batch` (a short last batch is padded
/// with rows whose labels are ignored): the mean over every labelled token, as transformers' loss
/// with labels = input_ids over the same windows; and that count of tokens.
template <class T>
std::pair<double, std::int64_t> evaluate_all(T& trainer, const TokenDataset& data, std::int64_t rows, std::int64_t batch,
                                             std::int64_t seq) {
  const auto n = static_cast<std::size_t>(batch * seq);
  std::vector<std::int32_t> ids(n), labels(n), positions(data.packed() ? n : 0);
  double total = 0;
  std::int64_t tokens = 0;
  for (std::int64_t first = 0; first < rows; first += batch) {
    const std::int64_t take = std::min(batch, rows - first);
    std::fill(ids.begin(), ids.end(), 0);
    std::fill(labels.begin(), labels.end(), kIgnoreIndex);
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(seq));
    const auto used = static_cast<std::size_t>(take * seq);
    data.val_batch(first, take, std::span(ids).first(used), std::span(labels).first(used),
                   std::span(positions).first(positions.empty() ? 0 : used));
    const auto valid = static_cast<std::int64_t>(std::count_if(labels.begin(), labels.end(),
                                                               [](std::int32_t l) { return l != kIgnoreIndex; }));
    total += trainer.evaluate(ids, labels, batch, positions) * static_cast<double>(valid);
    tokens += valid;
  }
  return {total / static_cast<double>(tokens), tokens};
}

/// --steps 0: evaluates the model loaded into `built` (from step `step`), and exports it.
template <class B>
int evaluate_only(BuiltStep<B>& built, const char* backend_name, const TrainInputs& in, std::int64_t step) {
  constexpr const char* compute_dtype = std::is_same_v<typename B::Weight, float> ? "float32" : "bfloat16";
  FILE* const info = built.info();
  if (in.plan.eval_rows > 0) {
    std::fprintf(info, "megatrain-train: evaluating %s (%s, %lld parameters) on %lld sequences of %lld tokens, backend %s (%s)\n",
                 built.label().c_str(), std::string(in.cfg.architecture_name()).c_str(),
                 static_cast<long long>(in.cfg.param_count()), static_cast<long long>(in.plan.eval_rows),
                 static_cast<long long>(in.s.seq), backend_name, compute_dtype);
    const auto [loss, tokens] = evaluate_all(built.trainer(), *in.data, in.plan.eval_rows, in.topt.batch_rows, in.s.seq);
    const nlohmann::json r{{"val_loss", loss},        {"tokens", tokens},               {"sequences", in.plan.eval_rows},
                           {"seq", in.s.seq},         {"backend", backend_name},        {"compute_dtype", compute_dtype},
                           {"model", built.label()}};
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);
  }
  if (in.plan.export_options) {
    std::fprintf(info, "%s\n", built.export_model(step).c_str());
    std::fflush(info);
  }
  return 0;
}

}  // namespace megatrain::app
