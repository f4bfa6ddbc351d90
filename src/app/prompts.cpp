// Prompts and completions' text (see prompts.hpp).
#include "prompts.hpp"

#include <fmt/format.h>

#include <fstream>
#include <optional>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/text/chat.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

/// The chat format of conversations: --chat-format's, or (auto) the one the tokenizer's chat
/// template is, where megatrain renders it.
text::ChatFormat chat_format(const std::string& name, const text::Tokenizer& tok) {
  if (name != "auto") {
    const auto f = text::chat_format_named(name);
    MT_CHECK(f.has_value(), "--chat-format '{}' is none of: auto, {}", name, text::chat_format_names());
    return *f;
  }
  MT_CHECK(tok.chat_template().has_value(), "the prompts hold conversations but the tokenizer has no chat template: "
           "name its format with --chat-format (one of: {})", text::chat_format_names());
  const auto f = text::recognise_chat_template(*tok.chat_template());
  MT_CHECK(f.has_value(), "the tokenizer's chat template is not one megatrain renders (digest {}): name its format with "
           "--chat-format (one of: {}) if one renders it", text::chat_template_digest(*tok.chat_template()),
           text::chat_format_names());
  return *f;
}

}  // namespace

Prompts read_prompts(const std::string& path, const char* option, const text::Tokenizer& tok, const std::string& chat_name) {
  std::ifstream in(path);
  MT_CHECK(in.good(), "{} '{}' cannot be read", option, path);
  std::optional<text::ChatFormat> chat;
  Prompts p;
  auto& out = p.ids;
  std::string line;
  for (std::int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{} '{}' line {}", option, path, n);
    auto r = nlohmann::ordered_json::parse(line, nullptr, false);
    MT_CHECK(!r.is_discarded() && r.is_object(), "{}: not a JSON object", where);
    if (r.contains("prompt")) {
      MT_CHECK(r["prompt"].is_string(), "{}: the field 'prompt' is not a string", where);
      out.push_back(tok.encode(r["prompt"].get<std::string>(), true));
    } else {
      MT_CHECK(r.contains("messages") || r.contains("conversations"), "{}: neither 'prompt' (text) nor 'messages' (a "
               "conversation)", where);
      if (!chat) chat = chat_format(chat_name, tok);
      try {
        const std::string bos = tok.bos_id() ? *tok.id_to_token(*tok.bos_id()) : std::string();
        out.push_back(tok.encode(text::render_prompt(*chat, text::chat_messages(json::parse(r.dump())), bos), false));
      } catch (const Error& e) {
        MT_FAIL("{}: {}", where, e.reason());
      }
    }
    MT_CHECK(!out.back().empty(), "{}: the prompt has no tokens", where);
    p.records.push_back(std::move(r));
  }
  MT_CHECK(!out.empty(), "{} '{}' holds no prompt", option, path);
  return p;
}


json read_generation_config(const fs::path& dir) {
  const fs::path file = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return json::object();
  json g = json::parse(io::detail::read_file(file), nullptr, false);
  MT_CHECK(!g.is_discarded() && g.is_object(), "'{}' is not a JSON object: fix the file or move it away", file.string());
  return g;
}

std::vector<std::int32_t> eos_ids(const fs::path& dir, const text::Tokenizer& tok) {
  const auto ids_of = [](const json& v) {
    std::vector<std::int32_t> out;
    if (v.is_number_integer()) out.push_back(v.get<std::int32_t>());
    if (v.is_array())
      for (const auto& x : v)
        if (x.is_number_integer()) out.push_back(x.get<std::int32_t>());
    return out;
  };
  if (const json g = read_generation_config(dir); g.contains("eos_token_id")) return ids_of(g["eos_token_id"]);
  std::error_code ec;
  if (fs::is_regular_file(dir / "config.json", ec)) {
    const json j = json::parse(io::detail::read_file(dir / "config.json"), nullptr, false);
    if (!j.is_discarded() && j.contains("eos_token_id")) return ids_of(j["eos_token_id"]);
    if (!j.is_discarded() && j.contains("text_config") && j["text_config"].contains("eos_token_id"))
      return ids_of(j["text_config"]["eos_token_id"]);
  }
  if (tok.eos_id()) return {*tok.eos_id()};
  return {};
}


std::optional<std::size_t> first_stop(const std::string& text, const std::vector<std::string>& stops) {
  std::optional<std::size_t> at;
  for (const auto& s : stops)
    if (const auto p = text.find(s); p != std::string::npos && (!at || p < *at)) at = p;
  return at;
}

std::string decode_known(const text::Tokenizer& tok, std::span<const std::int32_t> ids) {
  std::vector<std::int32_t> known;
  for (const std::int32_t id : ids)
    if (tok.id_to_token(id)) known.push_back(id);
  return tok.decode(known, true);
}

std::string completion_text(const generate::Completion& c, const text::Tokenizer& tok, const std::vector<std::string>& stops) {
  std::span<const std::int32_t> all(c.tokens);
  if (c.finish == generate::Finish::eos) all = all.first(all.size() - 1);
  std::string text = decode_known(tok, all);
  if (c.finish == generate::Finish::stop)
    if (const auto at = first_stop(text, stops)) text.resize(*at);
  return text::utf8_lossy(text);
}

}  // namespace megatrain::app
