// megatrain-tokenize (programs.hpp): text, documents and fine-tuning records (prompt/completion, alpaca,
// conversations, preference pairs) in, token files out, with a model's own tokenizer (its tokenizer.json);
// megatrain-train then trains on them (--data). What is read and written: megatrain/text/prepare.hpp
// and docs/data.md.
//
//   megatrain-tokenize --tokenizer models/qwen2.5-0.5b --input chat.jsonl --output train.bin
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "megatrain/core/error.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/text/prepare.hpp"
#include "programs.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;
using text::Tokenizer;

int tokenize_main(int argc, char** argv) {
  megatrain::text::PrepareOptions o;
  std::string input, output;
  std::string tokenizer;
  CLI::App app{"megatrain-tokenize: documents and fine-tuning records in (text, JSONL, JSON), token files out, with a model's "
               "tokenizer", "megatrain-tokenize"};
  app.set_version_flag("--version", "megatrain-tokenize " + std::string(megatrain::version()), "Print the version and exit");
  app.add_option("--tokenizer", tokenizer, "A Hugging Face model folder (its tokenizer.json) or a tokenizer.json")->required();
  app.add_option("--input", input, "Text (one document), JSONL (one record per line) or JSON (an array of records)")->required();
  app.add_option("--output", output,
                 "The token file to write (raw little-endian ids); for fine-tuning records also OUTPUT.mask and OUTPUT.idx, "
                 "for preference records OUTPUT.pairs too")
      ->required();
  app.add_option("--format", o.format, "auto (by extension: .jsonl, .json, else text), text, jsonl or json")->capture_default_str();
  app.add_option("--records", o.records,
                 "auto (by the first record's fields), text (documents), prompt-completion, alpaca, messages or preference "
                 "(prompt, chosen and rejected: pairs for --objective dpo)")
      ->capture_default_str();
  app.add_option("--field", o.field, "The field of a JSON object that holds a document")->capture_default_str();
  app.add_option("--chat-format", o.chat_format,
                 fmt::format("auto (the tokenizer's chat template, where megatrain renders it) or one of: {}",
                             megatrain::text::chat_format_names()))
      ->capture_default_str();
  app.add_option("--eos", o.eos,
                 "After each document: auto (<|endoftext|> or <|end_of_text|>, else the tokenizer's eos_token); after each "
                 "completion: auto (the eos_token); or none, or a token or id")
      ->capture_default_str();
  app.add_option("--width", o.width, "auto (uint32 where the vocabulary exceeds 65,536), u16 or u32")->capture_default_str();
  app.add_flag("--skip-bad-lines", o.skip_bad_lines,
               "Skip (and count) records that are not JSON, lack their fields, are empty or have nothing to train on");
  app.add_flag("--overwrite", o.overwrite, "Replace --output if it exists");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    o.input = input;
    o.output = output;
    std::error_code ec;
    const fs::path tp(tokenizer);
    const Tokenizer tok = fs::is_directory(tp, ec) ? Tokenizer::from_folder(tp) : Tokenizer::from_file(tp);
    o.progress = megatrain::text::terminal_progress(input);
    const auto r = megatrain::text::prepare_token_files(tok, o);
    std::printf("%s\n", r.summary.c_str());
    return 0;
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-tokenize: error: %s\n", e.reason().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-tokenize: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace megatrain::app
