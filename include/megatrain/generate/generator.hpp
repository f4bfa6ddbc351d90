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
// A source that decodes with a cache (DecodeSource: the Trainer, where decodes()) reads one token a
// row a step instead: a new prompt token by token, then each chosen token, its layers keeping
// what the later tokens read (attention's keys and values, linear attention's state). Else, or
// with GenerationOptions::cache off, each step recomputes every row's whole prefix: the same
// forward as training's, slower as the completions grow. Both give the same logits to rounding.
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
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

/// ... that also decodes with a cache: the logits after one token a row (ids[r] at positions[r] of
/// row r's sequence; position 0 starts a new one), the rows' earlier tokens kept for rows of up to
/// `capacity` tokens; decodes(): whether it can.
template <class M>
concept DecodeSource = LogitsSource<M> && requires(M& m, std::span<const std::int32_t> ids, std::int64_t capacity) {
  { m.decode_logits(ids, ids, capacity) } -> std::same_as<std::vector<float>>;
  { m.decodes() } -> std::convertible_to<bool>;
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
  /// Decode with the source's cache where it has one (DecodeSource); false: recompute each prefix.
  bool cache = true;
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

/// One token a row's logits (rows x vocab) after ids[r] at positions[r], from a cache.
using DecodeLogits =
    std::function<std::vector<float>(std::span<const std::int32_t> ids, std::span<const std::int32_t> positions)>;

/// generate_with()'s completions, each step one token a row through `decode` (the rows' caches
/// hold seq_len tokens): a prompt's tokens one by one, then its completion's.
std::vector<Completion> generate_cached_with(const SlotShape& shape, const DecodeLogits& decode,
                                             std::span<const std::vector<std::int32_t>> prompts,
                                             const GenerationOptions& options, const StopCheck& stop = {},
                                             const Progress& progress = {});

/// generate_with() over a LogitsSource whose rows are `shape`'s; generate_cached_with() over a
/// DecodeSource that decodes, unless options.cache is off.
template <LogitsSource M>
std::vector<Completion> generate(M& source, const SlotShape& shape, std::span<const std::vector<std::int32_t>> prompts,
                                 const GenerationOptions& options, const StopCheck& stop = {}, const Progress& progress = {}) {
  if constexpr (DecodeSource<M>) {
    if (options.cache && source.decodes()) {
      struct Done {  // (the caches freed at the end; not where a step threw: the source may still use them)
        M& m;
        int unwinding = std::uncaught_exceptions();
        ~Done() {
          if constexpr (requires { m.end_decoding(); })
            if (std::uncaught_exceptions() == unwinding) m.end_decoding();
        }
      } done{source};
      return generate_cached_with(
          shape,
          [&](std::span<const std::int32_t> ids, std::span<const std::int32_t> positions) {
            return source.decode_logits(ids, positions, shape.seq_len);
          },
          prompts, options, stop, progress);
    }
  }
  return generate_with(
      shape,
      [&](std::span<const std::int32_t> ids, std::span<const std::int64_t> at) {
        return source.next_logits(ids, shape.rows, at);
      },
      prompts, options, stop, progress);
}

}  // namespace megatrain::generate
