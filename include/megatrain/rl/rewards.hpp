// Rewards for reinforcement learning on verifiable answers (GRPO: train/grpo.hpp). A reward
// scores a batch of completions, one number each:
//
//   AnswerReward   1 where the answer a regular expression extracts from the completion equals
//                  the record's `answer` field, else 0 (GSM8K's "#### 42", a \boxed{...})
//   FormatReward   1 where the whole completion matches a regular expression, else 0
//   CommandReward  a user's program: the batch as JSONL on its standard input, one number a line
//                  on its standard output
//   RewardSum      several of them, weighted and summed
//
// Regular expressions are PCRE2's (Perl's and Python's syntax: groups, lookarounds, \d, \s),
// over UTF-8 with Unicode properties. Any failure (a record without its answer, a program that
// fails, hangs or prints a malformed line) throws megatrain::Error saying which and why; nothing
// is scored in part. docs/rl.md.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace megatrain::rl {

namespace detail {
class Pattern;  // a compiled regular expression (src/rl/rewards.cpp)
}

/// One completion as a reward sees it: the prompt's record (its JSON object, as the data gives
/// it), the prompt's text and the completion's text.
struct Scored {
  const nlohmann::json* record = nullptr;
  std::string_view prompt, completion;
};

class Reward {
 public:
  virtual ~Reward() = default;
  /// A name for messages and metrics ("answer", "format", "command").
  virtual std::string name() const = 0;
  /// One reward a completion, in the batch's order.
  virtual std::vector<double> score(std::span<const Scored> batch) const = 0;
};

/// 1 where the completion's answer equals the record's `field`, else 0. The answer is the last
/// match of `pattern` in the completion: its first capture group where the pattern has one, else
/// the whole match; no match scores 0. Both are compared without their leading and trailing
/// white space: as numbers where both read as numbers in full (so "42.0" equals 42), else as text.
/// A record without the field, or whose field is neither a string nor a number, is refused.
class AnswerReward final : public Reward {
 public:
  explicit AnswerReward(const std::string& pattern, std::string field = "answer");
  ~AnswerReward() override;
  std::string name() const override { return "answer"; }
  std::vector<double> score(std::span<const Scored> batch) const override;

 private:
  std::unique_ptr<detail::Pattern> re_;
  std::string field_;
};

/// 1 where the whole completion matches `pattern`, else 0.
class FormatReward final : public Reward {
 public:
  explicit FormatReward(const std::string& pattern);
  ~FormatReward() override;
  std::string name() const override { return "format"; }
  std::vector<double> score(std::span<const Scored> batch) const override;

 private:
  std::unique_ptr<detail::Pattern> re_;
};

/// A user's program, run once a batch by /bin/sh -c `command`: each completion a JSON line on its
/// standard input (the record's fields, then "completion": its text, and "prompt": the prompt's
/// text where the record has no "prompt"), one number a line on its standard output, in order.
/// Refused, naming the command and what it did: an exit status other than 0, a run longer than
/// `timeout_s` (it is killed, with its children), fewer or more lines than completions, or a line
/// that is not a finite number. Its standard error is quoted in the message (its last 2,000 bytes).
class CommandReward final : public Reward {
 public:
  explicit CommandReward(std::string command, double timeout_s = 300);
  std::string name() const override { return "command"; }
  std::vector<double> score(std::span<const Scored> batch) const override;

 private:
  std::string command_;
  double timeout_s_;
};

/// Several rewards, each with its weight: a completion's total is the weighted sum.
class RewardSum {
 public:
  void add(std::unique_ptr<Reward> reward, double weight);
  std::size_t size() const { return parts_.size(); }
  struct Scores {
    std::vector<double> total;               ///< one a completion
    std::vector<std::vector<double>> each;   ///< each reward's, unweighted, in the order added
  };
  Scores score(std::span<const Scored> batch) const;
  std::string name(std::size_t i) const { return parts_[i].first->name(); }

 private:
  std::vector<std::pair<std::unique_ptr<Reward>, double>> parts_;
};

}  // namespace megatrain::rl
