// libFuzzer target: chat templates: where they are read from (tokenizer_config.json's
// chat_template, a string or a list of named templates, or chat_template.jinja beside
// tokenizer.json: Tokenizer::from_file), recognise_chat_template / chat_template_digest, and
// render_chat of messages in the recognised format (or, as --chat-format names one, in a format
// drawn from the input), encoded by encode_pieces.
//
// Input layout: tokenizer_config.json NUL chat_template.jinja NUL messages, where messages are
// separated by 0x1E and each is role 0x1F content [0x1F reasoning]. An empty jinja part writes no
// chat_template.jinja. The tokenizer.json beside is a fixed cut-down real one (Qwen3's or Llama
// 3.1's, tests/fuzz/tokenizers/, cut further to its first 300 tokens). Loading must succeed or
// throw megatrain::Error; a template's digest is 32 hex digits that trailing white space does not
// change; rendering succeeds or refuses a role with megatrain::Error, and gives non-empty pieces
// that alternate between prompt and trained, assistant content trained; their encoding is
// exactly the encoding of their text, with one trained flag per id.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/text/chat.hpp"
#include "megatrain/text/tokenizer.hpp"

using namespace megatrain;
using namespace megatrain::text;
using megatrain::fuzz::Scratch;

namespace {

struct Folders {
  Scratch scratch{"chat_template"};
  std::array<fuzz::fs::path, 2> dirs{scratch / "qwen3", scratch / "llama3_1"};
  Folders() {
    const fuzz::fs::path root = MEGATRAIN_FUZZ_ROOT;
    for (const auto& d : dirs) {
      // Cut further to the byte tokens and the merges among them (the vocabulary does not matter
      // here; a small file keeps the per-input reading fast).
      auto t = nlohmann::json::parse(fuzz::read_file(root / "tests/fuzz/tokenizers" / d.filename() / "tokenizer.json"));
      auto& model = t["model"];
      nlohmann::json vocab = nlohmann::json::object(), merges = nlohmann::json::array();
      for (const auto& [token, id] : model["vocab"].items())
        if (id.get<int>() < 300) vocab[token] = id;
      for (const auto& m : model["merges"]) {
        const std::string a = m.is_string() ? m.get<std::string>().substr(0, m.get<std::string>().find(' ')) : m[0].get<std::string>();
        const std::string b = m.is_string() ? m.get<std::string>().substr(a.size() + 1) : m[1].get<std::string>();
        if (vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) merges.push_back(m);
      }
      model["vocab"] = vocab;
      model["merges"] = merges;
      fuzz::fs::create_directories(d);
      fuzz::write_file(d / "tokenizer.json", t.dump());
    }
  }
};

Folders& folders() {
  static Folders f;
  return f;
}

constexpr std::array<ChatFormat, 7> kChat{ChatFormat::chatml, ChatFormat::qwen2_5,     ChatFormat::qwen3,   ChatFormat::llama3,
                                          ChatFormat::llama3_base, ChatFormat::llama3_1, ChatFormat::gemma3};

std::vector<ChatMessage> messages_of(std::string_view s) {
  std::vector<ChatMessage> out;
  while (!s.empty() && out.size() < 64) {
    const auto end = s.find('\x1e');
    std::string_view m = s.substr(0, end);
    s.remove_prefix(end == std::string_view::npos ? s.size() : end + 1);
    ChatMessage cm;
    const auto [role, rest] = fuzz::split_at(m, '\x1f');
    cm.role = role;
    if (rest) {
      const auto [content, reasoning] = fuzz::split_at(*rest, '\x1f');
      cm.content = content;
      if (reasoning) cm.reasoning = std::string(*reasoning);
    }
    out.push_back(std::move(cm));
  }
  return out;
}

bool hex32(const std::string& d) {
  return d.size() == 32 && std::all_of(d.begin(), d.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

void check_render(const Tokenizer& tok, ChatFormat f, const std::vector<ChatMessage>& ms) {
  const std::string bos = tok.bos_id() ? tok.id_to_token(*tok.bos_id()).value_or("") : "<|begin_of_text|>";
  std::vector<Piece> pieces;
  try {
    pieces = render_chat(f, ms, bos);
  } catch (const Error&) {
    return;
  }
  FUZZ_REQUIRE(!pieces.empty());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    FUZZ_REQUIRE(!pieces[i].text.empty());
    if (i > 0) FUZZ_REQUIRE(pieces[i].trained != pieces[i - 1].trained);
  }
  const bool assistant = std::any_of(ms.begin(), ms.end(), [](const ChatMessage& m) { return m.role == "assistant"; });
  FUZZ_REQUIRE(assistant == std::any_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.trained; }));
  const EncodedExample e = encode_pieces(tok, pieces);
  FUZZ_REQUIRE(e.ids.size() == e.trained.size());
  std::string text;
  for (const auto& p : pieces) text += p.text;
  FUZZ_REQUIRE(e.ids == tok.encode(text));
  (void)tok.decode(e.ids);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)folders();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in = fuzz::as_text(data, size);
  const auto [config, rest] = fuzz::split_at(in, '\0');
  std::string_view jinja, messages;
  if (rest) {
    const auto [j, m] = fuzz::split_at(*rest, '\0');
    jinja = j;
    messages = m.value_or(std::string_view());
  }
  const auto& dir = folders().dirs[size % 2];
  fuzz::write_file(dir / "tokenizer_config.json", config);
  if (!jinja.empty()) fuzz::write_file(dir / "chat_template.jinja", jinja);
  std::optional<Tokenizer> tok;
  try {
    tok.emplace(Tokenizer::from_file(dir / "tokenizer.json"));
  } catch (const Error&) {
  }
  fuzz::remove_file(dir / "chat_template.jinja");
  if (!tok) return 0;
  if (!jinja.empty()) FUZZ_REQUIRE(tok->chat_template() == std::string(jinja));
  for (const auto id : {tok->eos_id(), tok->bos_id()})
    if (id) FUZZ_REQUIRE(tok->id_to_token(*id).has_value());
  std::optional<ChatFormat> format;
  if (tok->chat_template()) {
    const std::string& t = *tok->chat_template();
    const std::string d = chat_template_digest(t);
    FUZZ_REQUIRE(hex32(d));
    FUZZ_REQUIRE(chat_template_digest(t + " \n\t\r\n") == d);
    format = recognise_chat_template(t);
    FUZZ_REQUIRE(recognise_chat_template(t + "\n") == format);
  }
  const auto ms = messages_of(messages);
  check_render(*tok, format.value_or(kChat[(size / 2) % kChat.size()]), ms);
  return 0;
}
