// Fine-tuning examples as token ids and a loss mask: conversations rendered the way a model's
// chat template renders them, prompt/completion pairs, alpaca records.
//
// megatrain does not run Jinja. It recognises the chat templates it renders natively (by the
// digest of the template text) and refuses any other, unless the user names a format
// (--chat-format) and so vouches that it renders their template:
//   chatml       <|im_start|>ROLE\nCONTENT<|im_end|>\n per message (Qwen2, many fine-tunes)
//   qwen2.5      chatml with Qwen2.5's default system message when the first message is not one
//   qwen3        chatml with Qwen3's <think> block on the assistant turns after the last user
//                turn (an empty one where the message has no reasoning)
//   llama3       <|begin_of_text|> then <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>
//                (content trimmed) per message (Llama 3 Instruct)
//   llama3-base  llama3, with the assistant header the Llama 3 base tokenizer's template always
//                appends at the end
//   llama3.1     llama3 with the system header of Llama 3.1 / 3.2 / 3.3 Instruct (knowledge
//                cut-off and the template's own fixed date, 26 Jul 2024: transformers would
//                write the day the data is prepared, which would make a data set's tokens depend
//                on the day)
//   gemma3       <bos> then <start_of_turn>ROLE\nCONTENT<end_of_turn>\n per message (content
//                trimmed, the assistant's role written model), a first system message's content
//                and two newlines before the first user turn's; the turns after it must alternate
//                user, assistant (Gemma 3 it)
// Rendering is that of apply_chat_template(messages, add_generation_prompt=False), and with True
// (render_prompt), checked against the templates themselves rendered by Hugging Face's Jinja
// (tests/text/chat_*).
//
// The trained part of an assistant turn is its content (with qwen3's think block) and the token
// that ends the turn (<|im_end|>, <|eot_id|>, <end_of_turn>), so the model learns to stop; the role headers and
// every other message are prompt.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/text/tokenizer.hpp"

namespace megatrain::text {

enum class ChatFormat { chatml, qwen2_5, qwen3, llama3, llama3_base, llama3_1, gemma3 };

/// "chatml", "qwen2.5", "qwen3", "llama3", "llama3-base", "llama3.1", "gemma3".
std::string_view chat_format_name(ChatFormat f);
/// The format of a name above, if it is one.
std::optional<ChatFormat> chat_format_named(std::string_view name);
/// The names, comma-separated (for messages).
std::string chat_format_names();
/// The format whose rendering `chat_template` is (a template megatrain knows, compared by a digest
/// of its text without trailing white space), if any.
std::optional<ChatFormat> recognise_chat_template(std::string_view chat_template);
/// The digest recognise_chat_template() compares (32 hex digits), for messages.
std::string chat_template_digest(std::string_view chat_template);

struct ChatMessage {
  std::string role;     ///< system, user or assistant
  std::string content;
  std::optional<std::string> reasoning;  ///< reasoning_content (qwen3)
  friend bool operator==(const ChatMessage&, const ChatMessage&) = default;
};

/// A run of rendered text, trained on or not.
struct Piece {
  std::string text;
  bool trained = false;
};

/// `messages` rendered as `format` renders them, in pieces (assistant turns trained). `bos` is the
/// tokenizer's beginning-of-text token text (the llama3 formats need it). Throws megatrain::Error
/// for a role other than system, user and assistant.
std::vector<Piece> render_chat(ChatFormat format, std::span<const ChatMessage> messages, std::string_view bos = {});

/// The messages of a conversation record ({"messages": [{"role", "content"}, ...]}, or sharegpt's
/// {"conversations": [{"from", "value"}]}). Throws megatrain::Error with what is wrong with it.
std::vector<ChatMessage> chat_messages(const nlohmann::json& record);

/// The messages of a JSON array (the value of the field `key`, named in messages):
/// {"role", "content", "reasoning_content"?} objects, or sharegpt's {"from", "value"}. Throws
/// megatrain::Error with what is wrong with it.
std::vector<ChatMessage> chat_message_list(const nlohmann::json& list, std::string_view key, bool sharegpt = false);

/// What apply_chat_template(add_generation_prompt=True) writes after the conversation: the
/// header of the assistant turn the model writes next ("" for llama3-base, whose rendering
/// always ends with it).
std::string_view generation_prompt(ChatFormat format);
/// `messages` rendered, then the generation prompt: the text a model completes (sampling).
std::string render_prompt(ChatFormat format, std::span<const ChatMessage> messages, std::string_view bos = {});

/// Token ids with, per token, whether it is trained on (1) or prompt (0).
struct EncodedExample {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> trained;
};

/// The ids of the pieces' concatenated text, exactly as tok.encode(text) gives them, and which of
/// them come from trained pieces. Where the pre-tokenizer does not split at a boundary (rare: a
/// prompt ending in white space, say), the tokens from the first one in which the whole text's
/// encoding and the encoding of the text up to the boundary differ belong to the later piece: a
/// token spanning the start of a trained piece is trained, and so, at times, is the prompt
/// token before it. With `add_special_tokens` the post-processor's
/// tokens (e.g. Llama's <s>) come first, as prompt.
EncodedExample encode_pieces(const Tokenizer& tok, std::span<const Piece> pieces, bool add_special_tokens = false);

/// The record formats of fine-tuning and pre-training data, one JSON object per record.
enum class RecordFormat {
  text,               ///< {"text": ...}: a document, every token trained
  prompt_completion,  ///< {"prompt": ..., "completion": ...}: completion (and end token) trained
  alpaca,             ///< {"instruction": ..., "input": ..., "output": ...}: a user turn and its answer
  messages,           ///< {"messages": [{"role", "content"}, ...]} or sharegpt's {"conversations": [{"from", "value"}]}
  preference,         ///< {"prompt"?, "chosen", "rejected"}: a pair of examples (text/preference_records.hpp)
};
std::string_view record_format_name(RecordFormat f);
/// The format a record's fields say it is in (`text_field` names the documents' field); nullopt
/// if none.
std::optional<RecordFormat> detect_record_format(const nlohmann::json& record, std::string_view text_field = "text");

/// How records become pieces.
struct RecordOptions {
  std::string text_field = "text";
  std::optional<ChatFormat> chat;     ///< for alpaca and messages records
  std::string bos;                    ///< beginning-of-text token text (llama3 formats)
  std::string eos;                    ///< ends a document or a completion ("" for none)
};

/// The pieces of one record (documents: one trained piece and the end token; prompt/completion:
/// the prompt untrained, the completion and end token trained; alpaca and messages: rendered by
/// the chat format). Throws megatrain::Error with what is wrong with the record (a missing or
/// non-string field, an empty completion, no assistant turn, an unknown role, tool calls), for
/// the caller to prefix with the file and line.
std::vector<Piece> record_pieces(const nlohmann::json& record, RecordFormat format, const RecordOptions& opt);

}  // namespace megatrain::text
