// Sampling a model: completions of prompts, a token at a time, over any source of next-token
// logits (LogitsSource). The Trainer is one (Trainer::next_logits: its streaming forward, so a
// model larger than the GPU samples as it trains, a layer at a time over the whole batch).
//
// The batch is a set of slots, each a row of seq_len tokens: a prompt and its completion so
// far. Each step asks the source for the logits after every slot's last token, chooses each
// slot's next token (Sampler, the slot's own SequenceRng), and appends it. A slot whose
// completion ends (an end-of-sequence id, a stop the caller finds, max_new_tokens, or a full
// row) takes the next waiting prompt, so the batch stays full until the prompts run out.
//
// This path recomputes each row's whole prefix at each step (no KV cache): exact, the same
// forward as training's, and slower as the completions grow (docs/generation.md says how much).
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "megatrain/generate/sampler.hpp"

namespace megatrain::generate {

/// What gives the next token's logits: for `rows` rows of ids (row after row, each of the
/// source's row length), the logits after position at[r] of row r (rows x vocab floats).
template <class M>
concept LogitsSource = requires(M& m, std::span<const std::int32_t> ids, std::int64_t rows, std::span<const std::int64_t> at) {
  { m.next_logits(ids, rows, at) } -> std::same_as<std::vector<float>>;
};

/// Why a completion ended.
enum class Finish : std::uint8_t {
  eos,     ///< it chose an end-of-sequence id (the last token)
  stop,    ///< the caller's stop check ended it (a stop string)
  length,  ///< max_new_tokens made
  row,     ///< the row is full: prompt and completion fill the source's row length
};
/// "eos", "stop", "length", "row".
std::string_view finish_name(Finish f);

struct GenerationOptions {
  std::int64_t max_new_tokens = 128;
  SamplingOptions sampling;
  /// Ids that end a completion when chosen (the model's eos_token_id; kept as its last token).
  std::vector<std::int32_t> eos;
  /// Throws megatrain::Error naming the field for a value out of its range.
  void check(std::int64_t vocab) const;
};

struct Completion {
  std::vector<std::int32_t> tokens;  ///< the completion's tokens (without the prompt)
  std::vector<double> log_probs;     ///< each token's log-probability under the model (Choice::logprob)
  Finish finish = Finish::length;
};

/// After each new token of prompt `index`'s completion: whether it ends here (a stop string in
/// its text, say). May shorten `tokens` to what the completion keeps.
using StopCheck = std::function<bool(std::size_t index, std::vector<std::int32_t>& tokens)>;
/// After each step: the tokens made so far over every prompt, and the completions ended.
using Progress = std::function<void(std::int64_t tokens, std::int64_t ended)>;

/// The shape a source runs: `rows` slots of `seq_len` tokens, over `vocab` ids; `pad` fills a
/// row after its last token (never read: attention is causal).
struct SlotShape {
  std::int64_t rows = 0, seq_len = 0, vocab = 0;
  std::int32_t pad = 0;
};

/// The completions of `prompts` (token ids, each shorter than the row), in their order. Prompt
/// i's draws are SequenceRng(sampling.seed, i): the same seed and prompts give the same tokens.
/// Every prompt is checked before the first step.
std::vector<Completion> generate_with(const SlotShape& shape,
                                      const std::function<std::vector<float>(std::span<const std::int32_t>,
                                                                             std::span<const std::int64_t>)>& logits,
                                      std::span<const std::vector<std::int32_t>> prompts, const GenerationOptions& options,
                                      const StopCheck& stop = {}, const Progress& progress = {});

/// generate_with() over a LogitsSource whose rows are `shape`'s.
template <LogitsSource M>
std::vector<Completion> generate(M& source, const SlotShape& shape, std::span<const std::vector<std::int32_t>> prompts,
                                 const GenerationOptions& options, const StopCheck& stop = {}, const Progress& progress = {}) {
  return generate_with(
      shape,
      [&](std::span<const std::int32_t> ids, std::span<const std::int64_t> at) {
        return source.next_logits(ids, shape.rows, at);
      },
      prompts, options, stop, progress);
}

}  // namespace megatrain::generate
