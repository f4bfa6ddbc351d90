// Prompts as megatrain-generate and megatrain-train --sample-prompts read them (docs/generation.md):
// JSONL records of text or conversations, encoded by the model's tokenizer; the ids that end a
// completion; and a completion's text.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/generate/generator.hpp"
#include "megatrain/text/tokenizer.hpp"

namespace megatrain::app {

/// A file of prompts: each record (its fields in order) and its ids.
struct Prompts {
  std::vector<nlohmann::ordered_json> records;
  std::vector<std::vector<std::int32_t>> ids;
};

/// The records of `path` (one JSON object a line; blank lines skipped), named `option` in messages:
/// "prompt" text as the tokenizer encodes it (its special tokens added, as transformers'
/// tokenizer(text) does), or "messages" (sharegpt's "conversations") rendered by `chat_format`
/// ("auto": the tokenizer's chat template, where megatrain renders it) with the generation prompt.
/// Throws megatrain::Error naming the file and line of a record that is not one.
Prompts read_prompts(const std::string& path, const char* option, const text::Tokenizer& tok,
                     const std::string& chat_format = "auto");

/// `dir`'s generation_config.json as an object ({} where the folder has none). Throws
/// megatrain::Error naming the file where it is not a JSON object.
nlohmann::json read_generation_config(const std::filesystem::path& dir);

/// The ids that end a completion: generation_config.json's eos_token_id in `dir`, else config.json's
/// (or its text_config's), else the tokenizer's end token. A malformed generation_config.json is
/// refused (read_generation_config).
std::vector<std::int32_t> eos_ids(const std::filesystem::path& dir, const text::Tokenizer& tok);

/// The text of `ids` without special tokens; ids the tokenizer has no token for add nothing.
std::string decode_known(const text::Tokenizer& tok, std::span<const std::int32_t> ids);

/// A completion's text: without special tokens and a final end-of-sequence token, up to the first
/// of `stops` where one ended it. Ids the tokenizer has no token for (a model's vocabulary may be
/// larger than its tokenizer's: Qwen2.5's 152,064 rows, 151,665 tokens) add nothing, as in
/// transformers' decode.
std::string completion_text(const generate::Completion& c, const text::Tokenizer& tok, const std::vector<std::string>& stops);

/// Where a stop string first appears in `text`, if one does.
std::optional<std::size_t> first_stop(const std::string& text, const std::vector<std::string>& stops);

}  // namespace megatrain::app
