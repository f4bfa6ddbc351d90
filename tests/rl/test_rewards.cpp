// Rewards (rl/rewards.hpp): answers extracted by regular expressions (GSM8K's "#### 42", a
// \boxed{...}, numbers read as numbers), whole-completion formats, a user's program through
// /bin/sh (its JSONL input, its numbers, a large batch through the pipes, each way it fails, its
// timeout killing it and its children), and weighted sums.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/rl/rewards.hpp"

using namespace megatrain;
using namespace megatrain::rl;
using nlohmann::json;

namespace {

std::vector<Scored> batch_of(const std::vector<json>& records, const std::vector<std::string>& completions) {
  std::vector<Scored> b;
  for (std::size_t i = 0; i < completions.size(); ++i) b.push_back({&records[i], "Q?", completions[i]});
  return b;
}

}  // namespace

TEST_CASE("the answer reward: the last match's group against the record's answer, numbers as numbers") {
  const std::vector<json> rec = {{{"answer", "42"}}, {{"answer", 42}}, {{"answer", "42"}}, {{"answer", "0.5"}},
                                 {{"answer", "Paris"}}, {{"answer", "Paris"}}, {{"answer", 7}}};
  const std::vector<std::string> done = {
      "Six times seven.\n#### 42",          // the group, GSM8K's form
      "#### 41 then, corrected: #### 42.0",  // the last match; 42.0 reads as the number 42
      "no answer here",                     // no match: 0
      "#### .5",                            // .5 and 0.5: the same number
      "#### Paris  ",                       // white space around it
      "#### paris",                         // text compares exactly
      "#### 7 apples",                      // the group is \S+: "7"
  };
  const AnswerReward r("####\\s*(\\S+)");
  CHECK(r.score(batch_of(rec, done)) == std::vector<double>{1, 1, 0, 1, 1, 0, 1});
  // a pattern without a group: the whole match
  const AnswerReward boxed("(?<=\\\\boxed\\{)[^}]*(?=\\})");
  const std::vector<json> r2 = {{{"answer", "3/4"}}, {{"answer", "3/4"}}};
  CHECK(boxed.score(batch_of(r2, {"so \\boxed{1/2}, no: \\boxed{3/4}", "\\boxed{0.75}"})) == std::vector<double>{1, 0});
  // another field
  const AnswerReward other("=\\s*(\\d+)", "solution");
  const std::vector<json> r3 = {{{"solution", "12"}}};
  CHECK(other.score(batch_of(r3, {"x = 12"})) == std::vector<double>{1});
  // refused: a record without the field, a field of another kind, a pattern that does not compile
  const std::vector<json> bad = {{{"answer", "1"}}, {{"question", "2"}}};
  CHECK_THROWS_WITH_AS(r.score(batch_of(bad, {"#### 1", "#### 2"})),
                       doctest::Contains("the record's 'answer' field, and completion 1's record has none"), Error);
  const std::vector<json> listy = {{{"answer", json::array({1, 2})}}};
  CHECK_THROWS_WITH_AS(r.score(batch_of(listy, {"#### 1"})), doctest::Contains("neither a string nor a number"), Error);
  CHECK_THROWS_WITH_AS(AnswerReward("(unclosed"), doctest::Contains("does not compile"), Error);
}

TEST_CASE("the format reward: the whole completion, across lines") {
  const FormatReward r("<think>[\\s\\S]*?</think>\\s*<answer>[\\s\\S]*?</answer>");
  const std::vector<json> rec(4, json::object());
  CHECK(r.score(batch_of(rec, {"<think>a\nb</think>\n<answer>4</answer>", "<think>a</think><answer>4</answer> extra",
                               "<answer>4</answer>", "<think></think><answer></answer>"})) ==
        std::vector<double>{1, 0, 0, 1});
}

TEST_CASE("the command reward: JSONL in, a number a line out, in order; a batch larger than the pipes") {
  const std::vector<json> rec = {{{"answer", "4"}, {"level", 2}}, {{"answer", "5"}, {"level", 3}}};
  // (the program reads each line's fields: the completion's length times the record's level)
  const CommandReward r(
      "python3 -c \"import sys, json\nfor l in sys.stdin:\n  j = json.loads(l); print(len(j['completion']) * j['level'] "
      "+ (j['prompt'] == 'Q?'))\"");
  CHECK(r.score(batch_of(rec, {"abc", "hello"})) == std::vector<double>{7, 16});
  // 3,000 completions of 200 bytes: 600 KB each way through 64 KB pipes, written while read
  std::vector<json> many(3000, json{{"answer", "1"}, {"level", 1}});
  std::vector<std::string> text;
  for (std::size_t i = 0; i < many.size(); ++i) text.push_back(std::string(200, static_cast<char>('a' + i % 26)));
  const auto scores = r.score(batch_of(many, text));
  REQUIRE(scores.size() == 3000);
  CHECK(std::all_of(scores.begin(), scores.end(), [](double v) { return v == 201; }));
  // a command that ignores its input and prints its numbers
  CHECK(CommandReward("printf '0.5\\n-1e3\\n'").score(batch_of(rec, {"x", "y"})) == std::vector<double>{0.5, -1000});
}

TEST_CASE("the command reward refuses what goes wrong, naming the command and what it did") {
  const std::vector<json> rec = {json::object(), json::object()};
  const auto b = batch_of(rec, {"a", "b"});
  CHECK_THROWS_WITH_AS(CommandReward("echo oops >&2; exit 3").score(b),
                       doctest::Contains("exited with status 3 (its standard error: oops)"), Error);
  CHECK_THROWS_WITH_AS(CommandReward("printf '1\\n'").score(b), doctest::Contains("printed 1 numbers for 2 completions"), Error);
  CHECK_THROWS_WITH_AS(CommandReward("printf '1\\nabc\\n'").score(b),
                       doctest::Contains("line 2 of its output, 'abc', is not a finite number"), Error);
  CHECK_THROWS_WITH_AS(CommandReward("printf '1\\nnan\\n'").score(b), doctest::Contains("'nan', is not a finite number"), Error);
  CHECK_THROWS_WITH_AS(CommandReward("no-such-program-here").score(b), doctest::Contains("exited with status 127"), Error);
  // a timeout stops it and its children, soon after the deadline
  const auto marker = std::filesystem::temp_directory_path() / ("megatrain_reward_" + std::to_string(::getpid()));
  std::filesystem::remove(marker);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(CommandReward("(sleep 2; touch " + marker.string() + ") & sleep 30", 0.5).score(b),
                       doctest::Contains("did not finish within 0.5 s"), Error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  CHECK_FALSE(std::filesystem::exists(marker));  // (the background child was killed with it)
  CHECK_THROWS_WITH_AS(CommandReward("true", 0), doctest::Contains("timeout must be > 0"), Error);
}

TEST_CASE("a reward sum: weighted totals and each reward's own values") {
  const std::vector<json> rec = {{{"answer", "4"}}, {{"answer", "5"}}, {{"answer", "6"}}};
  RewardSum sum;
  sum.add(std::make_unique<AnswerReward>("<answer>(.*?)</answer>"), 1.0);
  sum.add(std::make_unique<FormatReward>("<answer>.*</answer>"), 0.25);
  const auto s = sum.score(batch_of(rec, {"<answer>4</answer>", "x <answer>5</answer>", "<answer>7</answer>"}));
  CHECK(s.total == std::vector<double>{1.25, 1.0, 0.25});
  CHECK(s.each == std::vector<std::vector<double>>{{1, 1, 0}, {1, 0, 1}});
  CHECK(sum.name(1) == "format");
  CHECK_THROWS_WITH_AS(sum.add(std::make_unique<FormatReward>("x"), std::nan("")), doctest::Contains("the weight of 'format'"),
                       Error);
  CHECK_THROWS_WITH_AS(RewardSum().score({}), doctest::Contains("no reward"), Error);
}
