// A GRPO batch's rows (train/grpo.hpp): each prompt followed by one of its completions, the
// completion's tokens as labels. Row i holds prompt i's n ids, then completion i's c tokens, then
// padding; the labels at positions n - 1 .. n + c - 2 are the completion's tokens (the prompt and
// the padding carry kIgnoreIndex), so the step scores exactly the sampled tokens. The attention
// mask is 1 over the prompt and completion, 0 over the padding (transformers' mask, which a
// mixture of experts' auxiliary loss reads).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/core/error.hpp"

namespace megatrain::rl {

struct RolloutRows {
  std::vector<std::int32_t> ids, labels;
  std::vector<std::uint8_t> mask;
};

/// The rows of `prompts[i]` + `completions[i]`, `seq` tokens each (padded with `pad`). A prompt and
/// its completion must fit a row: n + c <= seq, with n >= 1.
inline RolloutRows rollout_rows(std::span<const std::vector<std::int32_t>> prompts,
                                std::span<const std::vector<std::int32_t>> completions, std::int64_t seq,
                                std::int32_t pad = 0) {
  MT_CHECK(prompts.size() == completions.size(), "rollout_rows: {} prompts and {} completions", prompts.size(),
           completions.size());
  const auto S = static_cast<std::size_t>(seq);
  RolloutRows r;
  r.ids.assign(prompts.size() * S, pad);
  r.labels.assign(r.ids.size(), kIgnoreIndex);
  r.mask.assign(r.ids.size(), 0);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    const auto& c = completions[i];
    MT_CHECK(!p.empty() && p.size() + c.size() <= S, "rollout_rows: row {} holds a prompt of {} tokens and a completion of {} "
             "in {} tokens", i, p.size(), c.size(), seq);
    const std::size_t at = i * S, n = p.size();
    std::copy(p.begin(), p.end(), r.ids.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(c.begin(), c.end(), r.ids.begin() + static_cast<std::ptrdiff_t>(at + n));
    for (std::size_t t = 0; t < c.size(); ++t) r.labels[at + n - 1 + t] = c[t];
    std::fill_n(r.mask.begin() + static_cast<std::ptrdiff_t>(at), n + c.size(), std::uint8_t{1});
  }
  return r;
}

}  // namespace megatrain::rl
