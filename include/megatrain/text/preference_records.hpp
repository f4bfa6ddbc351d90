// Preference records: a prompt with a preferred ("chosen") and a rejected answer, tokenized as HF
// TRL's DPOTrainer tokenizes them, into the two examples of a pair.
//
// Records (TRL's preference formats), one JSON object each:
//   standard        {"prompt": "...", "chosen": "...", "rejected": "..."}
//   conversational  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
//   implicit prompt {"chosen": [messages], "rejected": [messages]}: the prompt is the leading
//                   messages the two have in common (TRL's extract_prompt)
//
// Text, as TRL's maybe_apply_chat_template writes it for a conversation: the prompt rendered with
// the generation prompt (its last message must be the user's), the prompt and each answer rendered
// together, and each answer the rest of that text after the longest common prefix with the prompt
// (the prompt shrinks to it, first against the chosen text, then against the rejected one).
// A standard record's texts are its strings.
//
// Tokens, as TRL's DPOTrainer.tokenize_row: the prompt and each answer encoded on their own
// (no special tokens added), the end token appended to each answer. An example is the prompt's
// tokens then the answer's; the answer's (and the end token) are trained, the prompt's are not.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "megatrain/text/chat.hpp"
#include "megatrain/text/tokenizer.hpp"

namespace megatrain::text {

/// Whether a record is a preference record (it has "chosen" and "rejected").
bool is_preference_record(const nlohmann::json& record);

/// The texts of a preference record, before tokenization.
struct PreferenceTexts {
  std::string prompt, chosen, rejected;
};

/// The record's texts (see above). `chat` renders conversational records (required for them).
/// Throws megatrain::Error with what is wrong with the record.
PreferenceTexts preference_texts(const nlohmann::json& record, const std::optional<ChatFormat>& chat, std::string_view bos = {});

/// The two examples of a pair, chosen first.
struct PreferencePair {
  EncodedExample chosen, rejected;
};

/// The texts tokenized (see above); `eos`: the end token appended to each answer (none: nothing).
/// Throws megatrain::Error where an answer has no token.
PreferencePair encode_preference(const Tokenizer& tok, const PreferenceTexts& texts, std::optional<std::int32_t> eos);

}  // namespace megatrain::text
