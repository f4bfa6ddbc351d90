// Preference records to the two examples of a pair (see megatrain/text/preference_records.hpp).
#include "megatrain/text/preference_records.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "megatrain/core/error.hpp"

namespace megatrain::text {

using json = nlohmann::json;

namespace {

// The longest common prefix of a and b, in whole code points (Python compares characters).
std::size_t common_prefix(std::string_view a, std::string_view b) {
  std::size_t n = static_cast<std::size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
  if (n == a.size() || n == b.size()) return n;
  // (the strings differ inside a code point: back to its first byte)
  while (n > 0 && (static_cast<unsigned char>(a[n]) & 0xC0) == 0x80) --n;
  return n;
}

std::string concatenated(const std::vector<Piece>& pieces) {
  std::string s;
  for (const Piece& p : pieces) s += p.text;
  return s;
}

void check_answer(const std::vector<ChatMessage>& answer, const char* key) {
  MT_CHECK(!answer.empty(), "the field '{}' has no message after the prompt", key);
  MT_CHECK(answer.front().role == "assistant", "the field '{}' starts with a '{}' message after the prompt: an answer is the "
           "assistant's", key, answer.front().role);
}

}  // namespace

bool is_preference_record(const json& record) {
  return record.is_object() && record.contains("chosen") && record.contains("rejected");
}

PreferenceTexts preference_texts(const json& r, const std::optional<ChatFormat>& chat, std::string_view bos) {
  MT_CHECK(is_preference_record(r), "a preference record has the fields 'chosen' and 'rejected'");
  const json& c = r["chosen"];
  const json& j = r["rejected"];
  if (c.is_string() || j.is_string()) {
    MT_CHECK(c.is_string() && j.is_string(), "'chosen' and 'rejected' must both be strings or both lists of messages");
    MT_CHECK(r.contains("prompt") && r["prompt"].is_string(),
             "a record of string answers needs a 'prompt' string (only conversations can leave the prompt implicit)");
    PreferenceTexts t{r["prompt"].get<std::string>(), c.get<std::string>(), j.get<std::string>()};
    MT_CHECK(!t.chosen.empty() && !t.rejected.empty(), "an answer ('chosen' or 'rejected') is empty");
    return t;
  }
  MT_CHECK(chat.has_value(), "a conversation needs a chat format: the tokenizer has no chat template (give --chat-format)");
  std::vector<ChatMessage> prompt, chosen = chat_message_list(c, "chosen"), rejected = chat_message_list(j, "rejected");
  if (r.contains("prompt")) {
    prompt = chat_message_list(r["prompt"], "prompt");
  } else {
    // The implicit prompt, as TRL's extract_prompt finds it: the messages before the first that
    // differs, less a shared assistant message just before it (which then starts both answers).
    const std::size_t n = std::min(chosen.size(), rejected.size());
    std::size_t k = 0;
    while (k < n && chosen[k] == rejected[k]) ++k;
    MT_CHECK(k > 0, "the record has no 'prompt', and 'chosen' and 'rejected' share no leading message");
    // (TRL stops at the last shared message when one answer's messages begin the other's)
    if (k == n) k = n - 1;
    else if (chosen[k - 1].role == "assistant") --k;
    prompt.assign(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(k));
    chosen.erase(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(k));
    rejected.erase(rejected.begin(), rejected.begin() + static_cast<std::ptrdiff_t>(k));
  }
  MT_CHECK(!prompt.empty(), "the record has no prompt (no 'prompt', and 'chosen' and 'rejected' share no leading message)");
  MT_CHECK(prompt.back().role == "user",
           "the prompt ends with a '{}' message: megatrain renders prompts that end with the user's message (TRL's "
           "continue_final_message is not supported)", prompt.back().role);
  check_answer(chosen, "chosen");
  check_answer(rejected, "rejected");
  const auto whole = [&](const std::vector<ChatMessage>& answer) {
    std::vector<ChatMessage> ms = prompt;
    ms.insert(ms.end(), answer.begin(), answer.end());
    return concatenated(render_chat(*chat, ms, bos));
  };
  std::string p = render_prompt(*chat, prompt, bos);
  const std::string pc = whole(chosen), pr = whole(rejected);
  p.resize(common_prefix(p, pc));
  PreferenceTexts t;
  t.chosen = pc.substr(p.size());
  p.resize(common_prefix(p, pr));
  t.rejected = pr.substr(p.size());
  t.prompt = std::move(p);
  return t;
}

PreferencePair encode_preference(const Tokenizer& tok, const PreferenceTexts& t, std::optional<std::int32_t> eos) {
  const std::vector<std::int32_t> prompt = tok.encode(t.prompt);
  const auto example = [&](const std::string& answer, const char* key) {
    std::vector<std::int32_t> a = tok.encode(answer);
    if (eos) a.push_back(*eos);
    MT_CHECK(!a.empty(), "the '{}' answer has no token", key);
    EncodedExample e;
    e.ids = prompt;
    e.ids.insert(e.ids.end(), a.begin(), a.end());
    e.trained.assign(prompt.size(), 0);
    e.trained.resize(e.ids.size(), 1);
    return e;
  };
  return {example(t.chosen, "chosen"), example(t.rejected, "rejected")};
}

}  // namespace megatrain::text
