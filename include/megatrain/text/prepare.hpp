// Preparing training data: text, documents and fine-tuning records in, token files out, with a
// model's own tokenizer. What megatrain-tokenize does, and megatrain-train when --data is text or
// JSON (it prepares into the run folder, then trains on the files). See docs/data.md.
//
// Inputs: a text file is one document (read whole); a JSONL file holds one JSON object per line
// (streamed, in batches encoded in parallel); a JSON file holds an array of objects. Each object
// is a record (chat.hpp): a document ({"text": ...}), a prompt/completion pair, an alpaca record
// or a conversation; every record of a file has the format of its first.
//
// Outputs, all written to staging files and renamed into place when complete:
//   OUTPUT        raw little-endian token ids, uint16 where every id of the tokenizer and the
//                 model fits (vocabulary up to 65,536), uint32 otherwise;
//   OUTPUT.mask   (fine-tuning records) one byte per token: 1 where the token is trained on (a
//                 completion, an assistant turn), 0 where it is prompt;
//   OUTPUT.idx    (fine-tuning records) little-endian int64 offsets: where each example starts,
//                 and the total at the end (examples + 1 values).
// Documents are joined, each followed by the end-of-text token; examples stay whole, so training
// can keep one example per sequence.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "megatrain/data/token_dataset.hpp"
#include "megatrain/text/chat.hpp"
#include "megatrain/text/tokenizer.hpp"

namespace megatrain::text {

struct PrepareOptions {
  std::filesystem::path input, output;
  std::string format = "auto";       ///< the file: auto (by extension: .jsonl, .json, else text), text, jsonl, json
  std::string records = "auto";      ///< auto (by the first record's fields), text, prompt-completion, alpaca, messages
  std::string field = "text";        ///< the field of a document record
  std::string eos = "auto";          ///< after a document or a completion: auto, none, a token or an id
  std::string width = "auto";        ///< auto, u16, u32
  std::string chat_format = "auto";  ///< auto (the tokenizer's chat template, if megatrain knows it) or a ChatFormat name
  std::int64_t model_vocab = 0;      ///< the model's vocabulary (0: from config.json beside the tokenizer, if any)
  bool skip_bad_lines = false;
  bool overwrite = false;
  /// Called now and then with bytes read and the input's size (a progress bar).
  std::function<void(std::uintmax_t done, std::uintmax_t total)> progress;
  /// Option names in messages (a program may call them otherwise).
  std::string input_option = "--input", output_option = "--output", skip_option = "--skip-bad-lines";
};

struct PrepareResult {
  RecordFormat records = RecordFormat::text;
  bool examples = false;               ///< fine-tuning records: OUTPUT.mask and OUTPUT.idx written
  bool wide = false;                   ///< uint32 ids
  std::int64_t count = 0;              ///< documents or examples
  std::int64_t tokens = 0, trained_tokens = 0;
  std::int64_t bad_lines = 0;
  std::uintmax_t bytes = 0;            ///< input bytes read
  std::optional<ChatFormat> chat;      ///< the chat format used
  std::optional<std::int32_t> eos;     ///< the end token appended
  std::string summary;                 ///< one line for the user
};

/// The model vocabulary in the config.json of `folder` (text_config's for multimodal models), or 0.
std::int64_t config_vocab_size(const std::filesystem::path& folder);

/// A progress callback that draws "tokenizing WHAT: 42% (x of y MB, z MB/s)" on stderr when it is
/// a terminal (nothing otherwise), and clears the line when done reaches total.
std::function<void(std::uintmax_t done, std::uintmax_t total)> terminal_progress(std::string what);

/// Prepares opt.input into opt.output (and its sidecars). Checks the options first; a bad record
/// stops it with "FILE:LINE: what is wrong" unless skip_bad_lines, and nothing is left behind by
/// a run that stops. Throws megatrain::Error.
PrepareResult prepare_token_files(const Tokenizer& tok, const PrepareOptions& opt);

}  // namespace megatrain::text
