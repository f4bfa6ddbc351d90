// A Hugging Face tokenizer, read from its `tokenizer.json`, in C++: the same ids as the
// `tokenizers` library for the families megatrain supports, and the text back from them.
//
// Supported (anything else is refused when the file is read, naming what was found):
//   - model: BPE, with merges given as "a b" strings or [a, b] pairs, `ignore_merges`,
//     `byte_fallback`, `unk_token` and `fuse_unk`; no dropout, no subword prefix or suffix;
//   - normalizers: NFC, NFKC, NFD, NFKD (utf8proc), Prepend, Replace (a string pattern),
//     Sequence of those;
//   - pre-tokenizers: Split (a regular expression, behaviour Isolated; PCRE2 with Unicode
//     properties), ByteLevel (GPT-2's byte-to-character map; its own regex when `use_regex`),
//     Metaspace, Sequence of those;
//   - added tokens (special or not; `lstrip`, `rstrip`; matched leftmost-longest before the
//     normalizer for `normalized: false`, after it otherwise);
//   - post-processors: TemplateProcessing (single sequences), ByteLevel, Sequence;
//   - decoders: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence.
// That covers the byte-level BPE of Qwen2 / 2.5 / 3, Llama 3 / 3.1 and GPT-2, and the
// SentencePiece-style BPE of Llama 2 and Mistral (both the Metaspace and the Prepend/Replace
// spelling of it).
//
// Input text is UTF-8; invalid bytes are replaced by U+FFFD as `String::from_utf8_lossy` (and
// WHATWG decoders) do, one replacement per maximal invalid subsequence — what the reference
// sees when it is given the same file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace megatrain::text {

class Tokenizer {
 public:
  /// Reads a `tokenizer.json` (and `tokenizer_config.json` beside it, when present, for the
  /// end-of-sequence token and the chat template). Throws megatrain::Error naming the file and
  /// what it does not support.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  /// The tokenizer of a Hugging Face model folder (its `tokenizer.json`); throws where the folder
  /// has none (a folder with only SentencePiece's `tokenizer.model` is named as such).
  static Tokenizer from_folder(const std::filesystem::path& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// The ids of `text`; with `add_special_tokens` the post-processor's tokens too (e.g. Llama's
  /// BOS), as `tokenizers`' `encode(text, add_special_tokens)`. Thread-safe.
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  /// encode() of every text, in parallel (oneTBB), in order.
  std::vector<std::vector<std::int32_t>> encode_batch(std::span<const std::string_view> texts,
                                                      bool add_special_tokens = false) const;
  /// The text of `ids`; `skip_special_tokens` leaves out special added tokens. Throws for an id
  /// outside the vocabulary.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const;

  /// One more than the largest id (the model's vocabulary and the added tokens).
  std::int64_t vocab_size() const;
  /// The id of a token (vocabulary or added), if there is one.
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  /// The token of an id, if there is one.
  std::optional<std::string> id_to_token(std::int32_t id) const;
  /// Whether `id` is a special added token.
  bool is_special(std::int32_t id) const;

  /// "byte-level BPE" or "SentencePiece BPE" (or "BPE" for another arrangement of the pieces).
  const std::string& family() const;
  /// The file it was read from.
  const std::filesystem::path& path() const;
  /// tokenizer_config.json's `eos_token`, where given and known; otherwise the first special
  /// token among <|endoftext|>, </s>, <|end_of_text|>, <eos>.
  std::optional<std::int32_t> eos_id() const;
  /// tokenizer_config.json's `bos_token`, where given and known.
  std::optional<std::int32_t> bos_id() const;
  /// tokenizer_config.json's `chat_template` (or chat_template.jinja beside it), if any.
  const std::optional<std::string>& chat_template() const;
  /// The ids encode(text, true) puts before and after the text's own (the post-processor's).
  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> special_tokens_around() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// `bytes` as valid UTF-8: every maximal invalid subsequence replaced by U+FFFD.
std::string utf8_lossy(std::string_view bytes);
/// Where the first byte of `bytes` that is not part of a valid UTF-8 sequence is (a sequence cut
/// short by the end included); std::string_view::npos where all of it is valid.
std::size_t first_invalid_utf8(std::string_view bytes);

}  // namespace megatrain::text
