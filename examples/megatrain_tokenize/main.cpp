// megatrain-tokenize: text, JSONL or JSON documents in, a token file out, with a model's own
// tokenizer (its tokenizer.json); megatrain-train then trains on the file (--data).
//
//   megatrain-tokenize --tokenizer models/qwen2.5-0.5b --input corpus.jsonl --output train.bin
//
// Documents: a text file is one document (read whole); a JSONL file holds one JSON object per
// line, its `--field` (default "text") a document (streamed, never read whole); a JSON file holds
// an array of such objects. Each document is followed by the end-of-text token (--eos). The
// output is raw little-endian token ids, uint16 where every id of the tokenizer and the model
// fits (vocabulary up to 65,536), uint32 otherwise — what megatrain-train's --data-format auto
// reads for that model. It is written to a staging file and renamed into place when complete.
// See docs/data.md.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/text/tokenizer.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using megatrain::text::Tokenizer;

namespace {

struct Options {
  std::string tokenizer, input, output, format = "auto", field = "text", eos = "auto", width = "auto";
  bool skip_bad_lines = false, overwrite = false;
};

// Writes token ids as uint16 or uint32, little-endian (the machines megatrain runs on are).
class TokenWriter {
 public:
  TokenWriter(const fs::path& target, bool wide) : file_(megatrain::io::detail::OutputFile::partial_for(target)), wide_(wide) {}
  void write(const std::vector<std::int32_t>& ids) {
    bytes_.clear();
    for (const std::int32_t id : ids) {
      const auto v = static_cast<std::uint32_t>(id);
      for (int k = 0; k < (wide_ ? 4 : 2); ++k) bytes_.push_back(static_cast<std::byte>(v >> (8 * k)));
    }
    file_->write(bytes_);
    count_ += static_cast<std::int64_t>(ids.size());
  }
  void commit(const fs::path& target) {
    file_->finish();
    MT_CHECK(::rename(file_->path().c_str(), target.c_str()) == 0, "cannot rename '{}' to '{}': {}", file_->path().string(),
             target.string(), megatrain::io::detail::errno_text(errno));
    file_->keep();
    megatrain::io::detail::fsync_directory(target.parent_path().empty() ? fs::path(".") : target.parent_path());
  }
  std::int64_t count() const { return count_; }

 private:
  std::unique_ptr<megatrain::io::detail::OutputFile> file_;
  bool wide_;
  std::vector<std::byte> bytes_;
  std::int64_t count_ = 0;
};

// Progress on stderr, when it is a terminal.
class Progress {
 public:
  Progress(std::string what, std::uintmax_t total) : what_(std::move(what)), total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void update(std::uintmax_t done, bool force = false) {
    const auto now = std::chrono::steady_clock::now();
    if (!tty_ || (!force && now - last_ < std::chrono::milliseconds(300))) return;
    last_ = now;
    const double secs = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "\r\033[Ktokenizing %s: %3.0f%% (%.1f of %.1f MB, %.1f MB/s)", what_.c_str(),
                 total_ ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100.0, static_cast<double>(done) / 1e6,
                 static_cast<double>(total_) / 1e6, secs > 0 ? static_cast<double>(done) / 1e6 / secs : 0.0);
  }
  ~Progress() { done(); }
  void done() {
    if (tty_) std::fputs("\r\033[K", stderr);
    tty_ = false;
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::string what_;
  std::uintmax_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

// The end-of-text token appended to each document: "auto" (the tokenizer's), "none", or a token
// or id.
std::optional<std::int32_t> end_of_text(const Tokenizer& tok, const std::string& eos) {
  if (eos == "none") return std::nullopt;
  if (eos == "auto") {
    // a document separator: <|endoftext|> (Qwen, GPT-2) or <|end_of_text|> (Llama 3) where the
    // tokenizer has one (a chat model's eos_token ends a turn, not a document), else its eos
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>"})
      if (const auto id = tok.token_to_id(name)) return id;
    MT_CHECK(tok.eos_id().has_value(),
             "--eos auto: the tokenizer '{}' names no end-of-text token; give one (--eos TOKEN or ID) or --eos none",
             tok.path().string());
    return tok.eos_id();
  }
  if (const auto id = tok.token_to_id(eos)) return id;
  try {
    std::size_t used = 0;
    const long long v = std::stoll(eos, &used);
    if (used == eos.size() && v >= 0 && v < tok.vocab_size()) return static_cast<std::int32_t>(v);
  } catch (const std::exception&) {
  }
  MT_FAIL("--eos '{}' is neither a token of '{}' nor an id below {}", eos, tok.path().string(), tok.vocab_size());
}

struct Counts {
  std::int64_t documents = 0, bad_lines = 0;
  std::uintmax_t bytes = 0;
};

// The JSONL documents of `path`, in batches, each document's line number kept for messages.
void tokenize_jsonl(const Options& o, const Tokenizer& tok, std::optional<std::int32_t> eos, TokenWriter& out, Counts& n) {
  std::ifstream in(o.input, std::ios::binary);
  MT_CHECK(in.good(), "--input '{}': cannot open it", o.input);
  std::error_code ec;
  Progress progress(o.input, fs::file_size(o.input, ec));
  std::vector<std::string> docs;
  std::string line;
  std::int64_t line_no = 0;
  std::size_t batch_bytes = 0;
  const auto flush = [&] {
    std::vector<std::string_view> views(docs.begin(), docs.end());
    for (auto& ids : tok.encode_batch(views)) {
      if (eos) ids.push_back(*eos);
      out.write(ids);
    }
    n.documents += static_cast<std::int64_t>(docs.size());
    docs.clear();
    batch_bytes = 0;
    progress.update(n.bytes);
  };
  const auto bad = [&](const std::string& why) {
    MT_CHECK(o.skip_bad_lines, "{}:{}: {} (fix the line, or pass --skip-bad-lines to skip such lines and count them)", o.input,
             line_no, why);
    ++n.bad_lines;
  };
  while (std::getline(in, line)) {
    ++line_no;
    n.bytes += line.size() + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines separate nothing
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      bad(fmt::format("not JSON ({})", e.what()));
      continue;
    }
    if (!j.is_object() || !j.contains(o.field) || !j[o.field].is_string()) {
      bad(fmt::format("no string field '{}'{}", o.field, j.is_object() ? "" : " (the line is not a JSON object)"));
      continue;
    }
    std::string text = j[o.field].get<std::string>();
    if (text.empty()) {
      bad(fmt::format("the field '{}' is empty", o.field));
      continue;
    }
    batch_bytes += text.size();
    docs.push_back(std::move(text));
    if (batch_bytes >= (16u << 20) || docs.size() >= 8192) flush();
  }
  MT_CHECK(!in.bad(), "--input '{}': read error at line {}", o.input, line_no);
  flush();
  progress.done();
}

// A whole-file input: one text document, or a JSON array of objects.
void tokenize_whole(const Options& o, const Tokenizer& tok, std::optional<std::int32_t> eos, TokenWriter& out, Counts& n,
                    bool as_json) {
  const std::string content = megatrain::io::detail::read_file(o.input);
  n.bytes = content.size();
  std::vector<std::string> docs;
  if (!as_json) {
    MT_CHECK(!content.empty(), "--input '{}' is empty", o.input);
    docs.push_back(content);
  } else {
    json j;
    try {
      j = json::parse(content);
    } catch (const json::parse_error& e) {
      MT_FAIL("--input '{}': malformed JSON ({}); a JSON input is an array of objects (one per line is JSONL: name it .jsonl)",
              o.input, e.what());
    }
    MT_CHECK(j.is_array(), "--input '{}': a JSON input must be an array of objects, each with a string field '{}'", o.input,
             o.field);
    for (std::size_t i = 0; i < j.size(); ++i) {
      const json& d = j[i];
      if (!d.is_object() || !d.contains(o.field) || !d[o.field].is_string() || d[o.field].get<std::string>().empty()) {
        MT_CHECK(o.skip_bad_lines, "--input '{}': element {} has no non-empty string field '{}' (pass --skip-bad-lines to skip such "
                 "elements and count them)", o.input, i, o.field);
        ++n.bad_lines;
        continue;
      }
      docs.push_back(d[o.field].get<std::string>());
    }
  }
  std::vector<std::string_view> views(docs.begin(), docs.end());
  for (auto& ids : tok.encode_batch(views)) {
    if (eos) ids.push_back(*eos);
    out.write(ids);
  }
  n.documents = static_cast<std::int64_t>(docs.size());
}

int run(const Options& o) {
  MT_CHECK(o.format == "auto" || o.format == "text" || o.format == "jsonl" || o.format == "json",
           "--format must be auto, text, jsonl or json (got '{}')", o.format);
  MT_CHECK(o.width == "auto" || o.width == "u16" || o.width == "u32", "--width must be auto, u16 or u32 (got '{}')", o.width);
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(o.input, ec), "--input '{}' is not a file", o.input);
  MT_CHECK(o.overwrite || !fs::exists(o.output, ec), "--output '{}' exists; pass --overwrite to replace it", o.output);
  const fs::path tp(o.tokenizer);
  const Tokenizer tok = fs::is_directory(tp, ec) ? Tokenizer::from_folder(tp) : Tokenizer::from_file(tp);
  // The model beside the tokenizer (a Hugging Face folder): its vocabulary must hold the tokenizer's.
  std::int64_t vocab = tok.vocab_size();
  const fs::path config = tok.path().parent_path() / "config.json";
  if (fs::is_regular_file(config, ec)) {
    json c;
    try {
      c = json::parse(megatrain::io::detail::read_file(config));
    } catch (const json::parse_error& e) {
      MT_FAIL("'{}': malformed JSON: {}", config.string(), e.what());
    }
    const json* text_config = c.contains("text_config") ? &c["text_config"] : &c;
    if (text_config->contains("vocab_size") && (*text_config)["vocab_size"].is_number_integer()) {
      const auto model_vocab = (*text_config)["vocab_size"].get<std::int64_t>();
      MT_CHECK(tok.vocab_size() <= model_vocab,
               "the tokenizer '{}' has {} ids but the model's config.json says vocab_size {}: they are not one model's",
               tok.path().string(), tok.vocab_size(), model_vocab);
      vocab = std::max(vocab, model_vocab);
    }
  }
  const bool wide = o.width == "u32" || (o.width == "auto" && vocab > 65536);
  MT_CHECK(wide || tok.vocab_size() <= 65536, "--width u16 cannot hold the ids of '{}' ({} ids); use u32 or auto",
           tok.path().string(), tok.vocab_size());
  const std::optional<std::int32_t> eos = end_of_text(tok, o.eos);
  std::string format = o.format;
  if (format == "auto") {
    const std::string ext = fs::path(o.input).extension().string();
    format = ext == ".jsonl" ? "jsonl" : ext == ".json" ? "json" : "text";
  }

  TokenWriter out(o.output, wide);
  Counts n;
  if (format == "jsonl") tokenize_jsonl(o, tok, eos, out, n);
  else tokenize_whole(o, tok, eos, out, n, format == "json");
  MT_CHECK(out.count() > 0, "--input '{}' holds no document", o.input);
  out.commit(o.output);
  std::printf("%s: %lld documents, %lld tokens (%s, %s, end-of-text %s) from %.1f MB of %s%s\n", o.output.c_str(),
              static_cast<long long>(n.documents), static_cast<long long>(out.count()), wide ? "uint32" : "uint16",
              tok.family().c_str(), eos ? tok.id_to_token(*eos).value_or("?").c_str() : "none", static_cast<double>(n.bytes) / 1e6,
              format.c_str(),
              n.bad_lines ? fmt::format("; bad lines skipped: {}", n.bad_lines).c_str() : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"megatrain-tokenize: documents in (text, JSONL, JSON), token ids out, with a model's tokenizer"};
  app.add_option("--tokenizer", o.tokenizer, "A Hugging Face model folder (its tokenizer.json) or a tokenizer.json")->required();
  app.add_option("--input", o.input, "Text (one document), JSONL (one object per line) or JSON (an array of objects)")->required();
  app.add_option("--output", o.output, "The token file to write (raw little-endian ids)")->required();
  app.add_option("--format", o.format, "auto (by extension: .jsonl, .json, else text), text, jsonl or json")->capture_default_str();
  app.add_option("--field", o.field, "The field of each JSON object that holds a document")->capture_default_str();
  app.add_option("--eos", o.eos,
                 "Appended after each document: auto (<|endoftext|> or <|end_of_text|>, else the tokenizer's eos_token), none, "
                 "or a token or id")
      ->capture_default_str();
  app.add_option("--width", o.width, "auto (uint32 where the vocabulary exceeds 65,536), u16 or u32")->capture_default_str();
  app.add_flag("--skip-bad-lines", o.skip_bad_lines, "Skip (and count) lines that are not JSON objects with a non-empty field");
  app.add_flag("--overwrite", o.overwrite, "Replace --output if it exists");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(o);
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-tokenize: error: %s\n", e.reason().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-tokenize: error: %s\n", e.what());
    return 1;
  }
}
