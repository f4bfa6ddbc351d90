// Choosing the next token from a model's logits: greedy, or drawn after the processors of
// transformers' generate, in its order (generation/logits_process.py):
//
//   repetition penalty   each token already in the sequence (prompt and completion), once: a
//                        positive logit divided by the penalty, a negative one multiplied
//   temperature          the logits divided by it (0: greedy, the first largest logit)
//   top-k                the tokens whose logit is at least the k-th largest (ties with it kept)
//   top-p                the smallest set of most likely tokens whose probability reaches p: a
//                        token goes where the probabilities of those less likely than it, and its
//                        own, add up to at most 1 - p (the most likely token always stays)
//   min-p                the tokens whose probability is at least min_p times the largest's
//
// then a draw from the softmax of what is left. Where tokens tie, the lower id counts as the more
// likely (greedy takes the first largest logit, as torch.argmax does; top-p removes a tie's
// higher ids first). The draw is the sequence's own stream (SequenceRng): the same seed gives the
// same tokens on any machine, whatever the batch holds beside it. It is not torch's stream: a
// seeded run repeats itself, not transformers' sampled tokens.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace megatrain::generate {

/// How the next token is chosen (megatrain-generate's --temperature, --top-k, ...).
struct SamplingOptions {
  double temperature = 1.0;         ///< 0: greedy
  std::int64_t top_k = 0;           ///< 0: every token
  double top_p = 1.0;               ///< 1: every token
  double min_p = 0.0;               ///< 0: every token
  double repetition_penalty = 1.0;  ///< 1: none
  std::uint64_t seed = 0;

  bool greedy() const { return temperature == 0; }
  /// Throws megatrain::Error naming the field and its range for a value out of it.
  void check() const;
};

/// A sequence's random stream: 64-bit draws of SplitMix64 from (seed, sequence), so that each
/// sequence of a batch draws the same whatever else the batch holds.
class SequenceRng {
 public:
  SequenceRng(std::uint64_t seed, std::uint64_t sequence);
  std::uint64_t next();
  /// A uniform double in [0, 1), 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }

 private:
  std::uint64_t state_;
};

/// What was chosen, with its log-probability under the model (log_softmax of the raw logits,
/// before any processor: what scoring the completion gives).
struct Choice {
  std::int32_t token = 0;
  double logprob = 0;
};

/// The next token of sequences over a vocabulary of `vocab` ids.
class Sampler {
 public:
  Sampler(const SamplingOptions& options, std::int64_t vocab);

  /// The processed distribution: each token's probability after the processors (0 where one
  /// removed it), summing to 1; greedy: 1 at the chosen token. `seen`: the sequence so far
  /// (for the repetition penalty; ids outside the vocabulary are refused).
  std::vector<double> distribution(std::span<const float> logits, std::span<const std::int32_t> seen) const;
  /// The next token: greedy, or drawn from distribution() with one uniform draw of `rng`.
  Choice choose(std::span<const float> logits, std::span<const std::int32_t> seen, SequenceRng& rng) const;

  const SamplingOptions& options() const { return o_; }

 private:
  /// The logits after the repetition penalty and the temperature.
  std::vector<double> scaled(std::span<const float> logits, std::span<const std::int32_t> seen) const;
  SamplingOptions o_;
  std::int64_t vocab_;
};

}  // namespace megatrain::generate
