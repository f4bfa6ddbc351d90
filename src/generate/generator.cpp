// Completions a token at a time over slots (see include/megatrain/generate/generator.hpp).
#include "megatrain/generate/generator.hpp"

#include <algorithm>
#include <cstddef>
#include <optional>

#include "megatrain/core/error.hpp"

namespace megatrain::generate {

std::string_view finish_name(Finish f) {
  switch (f) {
    case Finish::eos: return "eos";
    case Finish::stop: return "stop";
    case Finish::length: return "length";
    case Finish::row: return "row";
  }
  return "?";
}

void GenerationOptions::check(std::int64_t vocab) const {
  MT_CHECK(max_new_tokens >= 1, "max_new_tokens must be at least 1 (it is {})", max_new_tokens);
  sampling.check();
  for (const std::int32_t id : eos)
    MT_CHECK(id >= 0 && id < vocab, "the end-of-sequence id {} is outside the model's vocabulary of {} ids", id, vocab);
}

namespace {

/// One row of the batch: which prompt it completes (none: idle), its tokens so far, and how many
/// of them the source has read (decoding with a cache).
struct Slot {
  std::optional<std::size_t> prompt;
  std::vector<std::int32_t> seen;  // prompt and completion
  std::optional<SequenceRng> rng;
  std::int64_t fed = 0;
};

/// One step's logits for every slot (rows x vocab), and which slots choose a token from theirs.
using StepLogits = std::function<std::vector<float>(std::vector<Slot>& slots, std::vector<char>& due)>;

void check_prompts(const SlotShape& shape, std::span<const std::vector<std::int32_t>> prompts, const GenerationOptions& options) {
  MT_CHECK(shape.rows >= 1 && shape.seq_len >= 2 && shape.vocab >= 1, "generation slots: {} rows of {} tokens over {} ids",
           shape.rows, shape.seq_len, shape.vocab);
  options.check(shape.vocab);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    MT_CHECK(!p.empty(), "prompt {} is empty: a completion starts after at least one token", i);
    MT_CHECK(static_cast<std::int64_t>(p.size()) < shape.seq_len,
             "prompt {} has {} tokens: a row holds {}, and its completion needs at least one more (raise the row length, "
             "or shorten the prompt)", i, p.size(), shape.seq_len);
    for (const std::int32_t id : p)
      MT_CHECK(id >= 0 && id < shape.vocab, "prompt {} holds the id {}, outside the model's vocabulary of {} ids", i, id,
               shape.vocab);
  }
}

/// The slots' loop: each step's logits from `step`, a token chosen for each slot due, a slot whose
/// completion ends given the next waiting prompt.
std::vector<Completion> run_slots(const SlotShape& shape, std::span<const std::vector<std::int32_t>> prompts,
                                  const GenerationOptions& options, const StopCheck& stop, const Progress& progress,
                                  const StepLogits& step) {
  check_prompts(shape, prompts, options);
  const Sampler sampler(options.sampling, shape.vocab);
  std::vector<Completion> out(prompts.size());
  std::vector<Slot> slots(static_cast<std::size_t>(shape.rows));
  std::vector<char> due(slots.size());
  std::size_t next = 0;
  std::int64_t made = 0, ended = 0;
  const auto fill = [&](Slot& s) {
    s.prompt.reset();
    s.fed = 0;
    if (next == prompts.size()) return;
    s.prompt = next;
    s.seen = prompts[next];
    s.rng.emplace(options.sampling.seed, static_cast<std::uint64_t>(next));
    ++next;
  };
  for (Slot& s : slots) fill(s);
  const auto S = static_cast<std::size_t>(shape.seq_len), V = static_cast<std::size_t>(shape.vocab);
  while (std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.prompt.has_value(); })) {
    std::fill(due.begin(), due.end(), 0);
    const std::vector<float> z = step(slots, due);
    MT_CHECK(z.size() == slots.size() * V, "the logits source gave {} values for {} rows of {} ids", z.size(), slots.size(), V);
    for (std::size_t r = 0; r < slots.size(); ++r) {
      Slot& s = slots[r];
      if (!s.prompt || !due[r]) continue;
      Completion& c = out[*s.prompt];
      const Choice pick = sampler.choose(std::span<const float>(z).subspan(r * V, V), s.seen, *s.rng);
      c.tokens.push_back(pick.token);
      c.log_probs.push_back(pick.logprob);
      s.seen.push_back(pick.token);
      ++made;
      std::optional<Finish> end;
      if (std::find(options.eos.begin(), options.eos.end(), pick.token) != options.eos.end()) end = Finish::eos;
      else if (stop && stop(*s.prompt, c.tokens)) end = Finish::stop;
      else if (static_cast<std::int64_t>(c.tokens.size()) >= options.max_new_tokens) end = Finish::length;
      else if (s.seen.size() >= S) end = Finish::row;
      if (!end) continue;
      c.finish = *end;
      c.log_probs.resize(c.tokens.size());  // (a stop check may have shortened the tokens)
      ++ended;
      fill(s);
    }
    if (progress) progress(made, ended);
  }
  return out;
}

}  // namespace

std::vector<Completion> generate_with(const SlotShape& shape,
                                      const std::function<std::vector<float>(std::span<const std::int32_t>,
                                                                             std::span<const std::int64_t>)>& logits,
                                      std::span<const std::vector<std::int32_t>> prompts, const GenerationOptions& options,
                                      const StopCheck& stop, const Progress& progress) {
  const auto S = static_cast<std::size_t>(shape.seq_len);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(std::max<std::int64_t>(shape.rows, 0)) * S);
  std::vector<std::int64_t> at(static_cast<std::size_t>(std::max<std::int64_t>(shape.rows, 0)));
  return run_slots(shape, prompts, options, stop, progress, [&](std::vector<Slot>& slots, std::vector<char>& due) {
    std::fill(ids.begin(), ids.end(), shape.pad);  // (each row's whole prefix again)
    for (std::size_t r = 0; r < slots.size(); ++r) {
      std::copy(slots[r].seen.begin(), slots[r].seen.end(), ids.begin() + static_cast<std::ptrdiff_t>(r * S));
      at[r] = slots[r].prompt ? static_cast<std::int64_t>(slots[r].seen.size()) - 1 : 0;
      due[r] = slots[r].prompt.has_value();
    }
    return logits(ids, at);
  });
}

std::vector<Completion> generate_cached_with(const SlotShape& shape, const DecodeLogits& decode,
                                             std::span<const std::vector<std::int32_t>> prompts,
                                             const GenerationOptions& options, const StopCheck& stop,
                                             const Progress& progress) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(std::max<std::int64_t>(shape.rows, 0)));
  std::vector<std::int32_t> positions(ids.size());
  return run_slots(shape, prompts, options, stop, progress, [&](std::vector<Slot>& slots, std::vector<char>& due) {
    for (std::size_t r = 0; r < slots.size(); ++r) {  // (each row's next unread token; an idle row restarts)
      Slot& s = slots[r];
      ids[r] = s.prompt ? s.seen[static_cast<std::size_t>(s.fed)] : shape.pad;
      positions[r] = s.prompt ? static_cast<std::int32_t>(s.fed) : 0;
      due[r] = s.prompt && s.fed + 1 == static_cast<std::int64_t>(s.seen.size());  // (its last: a token follows)
      if (s.prompt) ++s.fed;
    }
    return decode(ids, positions);
  });
}

}  // namespace megatrain::generate
