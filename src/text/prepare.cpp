// Text, documents and fine-tuning records to token files (see megatrain/text/prepare.hpp).
#include "megatrain/text/prepare.hpp"

#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/text/preference_records.hpp"

namespace megatrain::text {

namespace fs = std::filesystem;
using json = nlohmann::json;
namespace detail = megatrain::io::detail;

namespace {

// A staged output file, renamed into place by commit().
class Staged {
 public:
  explicit Staged(fs::path target) : target_(std::move(target)), file_(detail::OutputFile::partial_for(target_)) {}
  void write(std::span<const std::byte> b) { file_->write(b); }
  void finish() { file_->finish(); }
  void commit() { file_->rename_to(target_); }

 private:
  fs::path target_;
  std::unique_ptr<detail::OutputFile> file_;
};

// The token file and, for examples, its mask and index.
class Writer {
 public:
  Writer(const fs::path& out, bool wide, bool examples, bool pairs) : wide_(wide), ids_(out) {
    if (examples) {
      mask_.emplace(example_mask_path(out));
      index_.emplace(example_index_path(out));
      add_offset();
    }
    if (pairs) pairs_.emplace(example_pairs_path(out));
  }
  void add(const std::vector<std::int32_t>& ids, const std::vector<std::uint8_t>* trained) {
    bytes_.clear();
    for (const std::int32_t id : ids) {
      const auto v = static_cast<std::uint32_t>(id);
      for (int k = 0; k < (wide_ ? 4 : 2); ++k) bytes_.push_back(static_cast<std::byte>(v >> (8 * k)));
    }
    ids_.write(bytes_);
    tokens_ += static_cast<std::int64_t>(ids.size());
    if (mask_) {
      mask_->write(std::as_bytes(std::span(*trained)));
      for (const auto t : *trained) trained_ += t;
      add_offset();
    }
  }
  void commit(const fs::path& out, std::int64_t examples) {
    ids_.finish();
    if (mask_) mask_->finish(), index_->finish();
    if (pairs_) {
      const std::string note = example_pairs_note(examples / 2);
      pairs_->write(std::as_bytes(std::span(note.data(), note.size())));
      pairs_->finish();
    }
    // the sidecars first: a token file in place is always complete with them; none of an earlier
    // preparation may stay beside it (a mask and index would make documents read as examples, a
    // pairs note would make examples read as preference pairs)
    std::vector<fs::path> stale;
    if (mask_) mask_->commit(), index_->commit();
    else stale = {example_mask_path(out), example_index_path(out)};
    if (pairs_) pairs_->commit();
    else stale.push_back(example_pairs_path(out));
    for (const fs::path& p : stale) {
      std::error_code ec;
      fs::remove(p, ec);
      MT_CHECK(!ec, "cannot remove '{}' (an earlier preparation's, which would change how '{}' reads): {}", p.string(),
               out.string(), ec.message());
    }
    ids_.commit();
    detail::fsync_directory(out.parent_path().empty() ? fs::path(".") : out.parent_path());
  }
  std::int64_t tokens() const { return tokens_; }
  std::int64_t trained() const { return trained_; }

 private:
  void add_offset() {
    std::array<std::byte, 8> b;
    for (int k = 0; k < 8; ++k) b[static_cast<std::size_t>(k)] = static_cast<std::byte>(static_cast<std::uint64_t>(tokens_) >> (8 * k));
    index_->write(b);
  }
  bool wide_;
  Staged ids_;
  std::optional<Staged> mask_, index_, pairs_;
  std::vector<std::byte> bytes_;
  std::int64_t tokens_ = 0, trained_ = 0;
};

std::optional<std::int32_t> token_or_id(const Tokenizer& tok, const std::string& s) {
  if (const auto id = tok.token_to_id(s)) return id;
  try {
    std::size_t used = 0;
    const long long v = std::stoll(s, &used);
    if (used == s.size() && v >= 0 && v < tok.vocab_size()) return static_cast<std::int32_t>(v);
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The token after each document ("auto": a document separator, <|endoftext|> or <|end_of_text|>,
// where the tokenizer has one: a chat model's eos_token ends a turn, not a document) or after each
// completion ("auto": the tokenizer's eos_token, what the model emits to stop).
std::optional<std::int32_t> end_token(const Tokenizer& tok, const std::string& eos, bool completion) {
  if (eos == "none") return std::nullopt;
  if (eos == "auto") {
    if (completion && tok.eos_id()) return tok.eos_id();
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>"})
      if (const auto id = tok.token_to_id(name)) return id;
    MT_CHECK(tok.eos_id().has_value(),
             "--eos auto: the tokenizer '{}' names no end-of-text token; give one (--eos TOKEN or ID) or --eos none",
             tok.path().string());
    return tok.eos_id();
  }
  const auto id = token_or_id(tok, eos);
  MT_CHECK(id.has_value(), "--eos '{}' is neither a token of '{}' nor an id below {}", eos, tok.path().string(), tok.vocab_size());
  return id;
}

std::optional<RecordFormat> records_named(const std::string& s) {
  if (s == "text") return RecordFormat::text;
  if (s == "prompt-completion") return RecordFormat::prompt_completion;
  if (s == "alpaca") return RecordFormat::alpaca;
  if (s == "messages") return RecordFormat::messages;
  if (s == "preference") return RecordFormat::preference;
  return std::nullopt;
}

struct Record {
  std::int64_t line = 0;  // line (JSONL) or element (JSON) number
  std::string text;       // the JSON (or a text file's content)
};

// The elements of a JSON array, one at a time, from a file read in blocks: a JSON file of any
// size is read once and never held whole. Each element's text is cut at the commas and the
// closing bracket outside strings and nested values, then parsed on its own (a malformed
// element is a bad record, like a malformed JSONL line).
class JsonArrayReader {
 public:
  JsonArrayReader(const fs::path& path, const std::string& option) : in_(path, std::ios::binary), path_(path), option_(option) {
    MT_CHECK(in_.good(), "{} '{}': cannot open it", option_, path_.string());
    int c = skip_space();
    if (c == 0xEF) {  // a UTF-8 byte order mark
      get(), get();
      c = skip_space();
    }
    MT_CHECK(c == '[', "{} '{}': a JSON input must be an array of records (one per line is JSONL: name it .jsonl)", option_,
             path_.string());
    c = skip_space();
    if (c == ']') finish();
    else if (c >= 0) unget();  // (at the end of the file next() reports the unclosed array)
  }
  /// The next element's text; false after the last.
  bool next(std::string& out) {
    out.clear();
    if (done_) return false;
    int depth = 0;
    bool in_string = false, escaped = false;
    for (;;) {
      const int c = get();
      MT_CHECK(c >= 0, "{} '{}': the file ends before its array closes (a truncated file?)", option_, path_.string());
      if (in_string) {
        if (escaped) escaped = false;
        else if (c == '\\') escaped = true;
        else if (c == '"') in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (depth == 0) {  // (only ']' can close the array; '}' here is a malformed element)
          if (c == ']') {
            finish();
            return trimmed(out);
          }
        } else {
          --depth;
        }
      } else if (c == ',' && depth == 0) {
        return trimmed(out);
      }
      out.push_back(static_cast<char>(c));
    }
  }
  std::uintmax_t bytes() const { return read_; }

 private:
  int get() {
    if (at_ == end_) {
      in_.read(block_.data(), static_cast<std::streamsize>(block_.size()));
      end_ = static_cast<std::size_t>(in_.gcount());
      at_ = 0;
      MT_CHECK(!in_.bad(), "{} '{}': read error", option_, path_.string());
      if (end_ == 0) return -1;
    }
    ++read_;
    return static_cast<unsigned char>(block_[at_++]);
  }
  void unget() {
    --at_;
    --read_;
  }
  int skip_space() {
    int c;
    do c = get();
    while (c == ' ' || c == '\n' || c == '\t' || c == '\r');
    return c;
  }
  void finish() {
    done_ = true;
    const int c = skip_space();
    MT_CHECK(c < 0, "{} '{}': more after the array's closing bracket (one record per line is JSONL: name it .jsonl)",
             option_, path_.string());
  }
  // An element's text without the white space around it; an empty one (as in "[1,,2]" or a
  // comma before "]") is kept as "" and refused as not JSON, except the nothing of "[]".
  static bool trimmed(std::string& s) {
    const auto b = s.find_first_not_of(" \n\t\r");
    s = b == std::string::npos ? std::string() : s.substr(b, s.find_last_not_of(" \n\t\r") - b + 1);
    return true;
  }
  std::ifstream in_;
  fs::path path_;
  std::string option_;
  std::vector<char> block_ = std::vector<char>(1 << 20);
  std::size_t at_ = 0, end_ = 0;
  std::uintmax_t read_ = 0;
  bool done_ = false;
};

// Encodes records and writes them, in order; the first good record fixes the format.
class Encoder {
 public:
  Encoder(const Tokenizer& tok, const PrepareOptions& opt, PrepareResult& r, bool whole_text)
      : tok_(tok), opt_(opt), r_(r), whole_text_(whole_text) {
    if (opt.records != "auto") {
      fixed_ = records_named(opt.records);
      MT_CHECK(fixed_.has_value(), "--records must be auto, text, prompt-completion, alpaca, messages or preference (got '{}')",
               opt.records);
    }
  }

  void add(std::vector<Record>& batch, const std::string& where_kind) {
    const std::size_t n = batch.size();
    std::vector<json> parsed(n);
    std::vector<std::string> error(n);
    std::vector<EncodedExample> enc(n), second(n);  // (second: a preference pair's rejected example)
    if (whole_text_) {
      enc[0].ids = tok_.encode(batch[0].text);
    } else {
      tbb::parallel_for(std::size_t{0}, n, [&](std::size_t i) {
        try {
          parsed[i] = json::parse(batch[i].text);
        } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
          // JSON is UTF-8 (RFC 8259): a record that is not is refused, naming the first bad byte.
          const std::string_view t = batch[i].text;
          const std::size_t at = first_invalid_utf8(t);
          error[i] = at != std::string_view::npos ? fmt::format("not UTF-8 (byte 0x{:02x} at column {}; JSON records are UTF-8: fix the "
                                              "file's encoding)", static_cast<unsigned char>(t[at]), at + 1)
                                : fmt::format("not JSON ({})", e.what());
        }
      });
      // the format: fixed, or that of the first record that has one
      for (std::size_t i = 0; i < n && !format_; ++i)
        if (error[i].empty()) {
          format_ = fixed_ ? fixed_ : detect_record_format(parsed[i], opt_.field);
          if (format_) start(*format_);
        }
      tbb::parallel_for(std::size_t{0}, n, [&](std::size_t i) {
        if (!error[i].empty()) return;
        try {
          const json& rec = parsed[i];
          if (!rec.is_object()) {
            error[i] = "not a JSON object";
            return;
          }
          const auto f = detect_record_format(rec, opt_.field);
          if (!format_ || !f || *f != *format_) {
            error[i] = !format_ || !f ? fmt::format("a record has a '{}' field (documents), 'prompt' and 'completion', "
                                                    "'instruction' and 'output' (alpaca), 'messages' / 'conversations', or "
                                                    "'chosen' and 'rejected' (preference pairs)", opt_.field)
                                      : fmt::format("{} {} record in a file of {} records",
                                                    *f == RecordFormat::alpaca ? "an" : "a", record_format_name(*f),
                                                    record_format_name(*format_));
            return;
          }
          if (*format_ == RecordFormat::text) {
            const auto pieces = record_pieces(rec, *format_, ropt_);  // (checks the field)
            enc[i].ids = tok_.encode(pieces[0].text);
          } else if (*format_ == RecordFormat::preference) {
            const bool conversation = !rec["chosen"].is_string();
            MT_CHECK(!conversation || ropt_.chat || chat_error_.empty(), "{}", chat_error_);
            PreferencePair pair = encode_preference(tok_, preference_texts(rec, ropt_.chat, ropt_.bos), r_.eos);
            if (!has_label(pair.chosen) || !has_label(pair.rejected))
              error[i] = fmt::format("no token to train on in the {} answer", has_label(pair.chosen) ? "rejected" : "chosen");
            enc[i] = std::move(pair.chosen);
            second[i] = std::move(pair.rejected);
          } else {
            const auto pieces = record_pieces(rec, *format_, ropt_);
            enc[i] = encode_pieces(tok_, pieces, *format_ == RecordFormat::prompt_completion);
            if (*format_ == RecordFormat::prompt_completion && r_.eos) {
              enc[i].ids.push_back(*r_.eos);  // (a completion's end token is trained)
              enc[i].trained.push_back(1);
            }
            if (!has_label(enc[i])) error[i] = "no token to train on";
          }
        } catch (const megatrain::Error& e) {
          error[i] = e.reason();
        }
      });
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (!error[i].empty()) {
        MT_CHECK(opt_.skip_bad_lines, "{}:{}{}: {} (fix it, or pass {} to skip such records and count them)",
                 opt_.input.string(), where_kind, batch[i].line, error[i], opt_.skip_option);
        ++r_.bad_lines;
        continue;
      }
      if (!writer_) start(format_.value_or(RecordFormat::text));
      if (r_.examples) {
        writer_->add(enc[i].ids, &enc[i].trained);
        if (*format_ == RecordFormat::preference) writer_->add(second[i].ids, &second[i].trained);
      } else {
        if (r_.eos) enc[i].ids.push_back(*r_.eos);
        writer_->add(enc[i].ids, nullptr);
      }
      ++r_.count;
    }
    batch.clear();
  }

  void commit() {
    MT_CHECK(writer_ && r_.count > 0, "{} '{}' holds no {}", opt_.input_option, opt_.input.string(),
             r_.examples ? "example" : "document");
    r_.tokens = writer_->tokens();
    r_.trained_tokens = r_.examples ? writer_->trained() : r_.tokens;
    writer_->commit(opt_.output, r_.records == RecordFormat::preference ? 2 * r_.count : r_.count);
  }

  bool wide = false;

 private:
  void start(RecordFormat f) {
    if (writer_) return;
    r_.records = f;
    r_.examples = f != RecordFormat::text;
    // (a conversation ends with the chat format's end-of-turn token instead)
    if (f == RecordFormat::text || f == RecordFormat::prompt_completion || f == RecordFormat::preference)
      r_.eos = end_token(tok_, opt_.eos, f != RecordFormat::text);
    ropt_.text_field = opt_.field;
    // (the end token is appended by id after the encoding, not as text: an id that is not an
    // added token would encode as its characters)
    if (tok_.bos_id()) ropt_.bos = *tok_.id_to_token(*tok_.bos_id());
    if (f == RecordFormat::preference) {
      // (conversations need a chat format, string answers do not: the error waits for a conversation)
      try {
        resolve_chat(f);
      } catch (const megatrain::Error& e) {
        chat_error_ = e.reason();
      }
    } else if (f == RecordFormat::alpaca || f == RecordFormat::messages) {
      resolve_chat(f);
    }
    writer_.emplace(opt_.output, wide, r_.examples, f == RecordFormat::preference);
  }

  // The chat format of conversations: --chat-format, or the tokenizer's template recognised.
  void resolve_chat(RecordFormat f) {
    if (opt_.chat_format != "auto") {
      ropt_.chat = chat_format_named(opt_.chat_format);
    } else {
      MT_CHECK(tok_.chat_template().has_value(),
               "{} '{}' holds {} records, and the tokenizer '{}' has no chat template: give --chat-format ({}) to render "
               "them", opt_.input_option, opt_.input.string(), record_format_name(f), tok_.path().string(), chat_format_names());
      ropt_.chat = recognise_chat_template(*tok_.chat_template());
      MT_CHECK(ropt_.chat.has_value(),
               "the chat template of '{}' is not one megatrain renders (digest {}). If it renders conversations as one of "
               "{} does, give --chat-format with that name; otherwise megatrain cannot reproduce it",
               tok_.path().string(), chat_template_digest(*tok_.chat_template()), chat_format_names());
    }
    r_.chat = ropt_.chat;
  }

  // Whether an example has a token to train on (the first token is no label; a tokenizer may
  // also drop every character it lacks).
  static bool has_label(const EncodedExample& e) {
    return e.trained.size() >= 2 && std::any_of(e.trained.begin() + 1, e.trained.end(), [](std::uint8_t t) { return t != 0; });
  }

  const Tokenizer& tok_;
  const PrepareOptions& opt_;
  PrepareResult& r_;
  bool whole_text_;
  std::optional<RecordFormat> fixed_, format_;
  RecordOptions ropt_;
  std::string chat_error_;  // (preference records: why conversations cannot be rendered, if they cannot)
  std::optional<Writer> writer_;
};

}  // namespace

std::function<void(std::uintmax_t, std::uintmax_t)> terminal_progress(std::string what) {
  if (isatty(STDERR_FILENO) == 0) return {};
  struct State {
    std::string what;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), last{};
  };
  auto st = std::make_shared<State>(State{std::move(what)});
  return [st](std::uintmax_t done, std::uintmax_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (done >= total) {
      std::fputs("\r\033[K", stderr);
      return;
    }
    if (now - st->last < std::chrono::milliseconds(300)) return;
    st->last = now;
    const double secs = std::chrono::duration<double>(now - st->start).count();
    std::fprintf(stderr, "\r\033[Ktokenizing %s: %3.0f%% (%.1f of %.1f MB, %.1f MB/s)", st->what.c_str(),
                 total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0, static_cast<double>(done) / 1e6,
                 static_cast<double>(total) / 1e6, secs > 0 ? static_cast<double>(done) / 1e6 / secs : 0.0);
  };
}


std::int64_t config_vocab_size(const fs::path& folder) {
  const fs::path config = folder / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(config, ec)) return 0;
  json c;
  try {
    c = json::parse(detail::read_file(config));
  } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
    MT_FAIL("'{}': malformed JSON: {}", config.string(), e.what());
  }
  const json* t = c.contains("text_config") ? &c["text_config"] : &c;
  return t->contains("vocab_size") && (*t)["vocab_size"].is_number_integer() ? (*t)["vocab_size"].get<std::int64_t>() : 0;
}

PrepareResult prepare_token_files(const Tokenizer& tok, const PrepareOptions& opt) {
  const std::string& in_opt = opt.input_option;
  MT_CHECK(opt.format == "auto" || opt.format == "text" || opt.format == "jsonl" || opt.format == "json",
           "--format must be auto, text, jsonl or json (got '{}')", opt.format);
  MT_CHECK(opt.width == "auto" || opt.width == "u16" || opt.width == "u32", "--width must be auto, u16 or u32 (got '{}')", opt.width);
  MT_CHECK(opt.chat_format == "auto" || chat_format_named(opt.chat_format).has_value(),
           "--chat-format must be auto or one of {} (got '{}')", chat_format_names(), opt.chat_format);
  std::error_code ec;
  MT_CHECK(fs::is_regular_file(opt.input, ec), "{} '{}' is not a file", in_opt, opt.input.string());
  MT_CHECK(opt.overwrite || !fs::exists(opt.output, ec), "{} '{}' exists; pass --overwrite to replace it", opt.output_option,
           opt.output.string());
  for (const fs::path& p : {example_mask_path(opt.output), example_index_path(opt.output), example_pairs_path(opt.output)})
    MT_CHECK(opt.overwrite || !fs::exists(p, ec), "{} '{}': '{}' exists; pass --overwrite to replace it", opt.output_option,
             opt.output.string(), p.string());
  // The model's vocabulary must hold the tokenizer's.
  std::int64_t vocab = tok.vocab_size();
  const std::int64_t model_vocab = opt.model_vocab > 0 ? opt.model_vocab : config_vocab_size(tok.path().parent_path());
  if (model_vocab > 0) {
    MT_CHECK(tok.vocab_size() <= model_vocab,
             "the tokenizer '{}' has {} ids but the model's vocabulary is {} (config.json's vocab_size): they are not one model's",
             tok.path().string(), tok.vocab_size(), model_vocab);
    vocab = std::max(vocab, model_vocab);
  }
  PrepareResult r;
  r.wide = opt.width == "u32" || (opt.width == "auto" && vocab > 65536);
  MT_CHECK(r.wide || tok.vocab_size() <= 65536, "--width u16 cannot hold the ids of '{}' ({} ids); use u32 or auto",
           tok.path().string(), tok.vocab_size());
  std::string format = opt.format;
  if (format == "auto") {
    const std::string ext = opt.input.extension().string();
    format = ext == ".jsonl" ? "jsonl" : ext == ".json" ? "json" : "text";
  }
  const std::uintmax_t total = fs::file_size(opt.input, ec);
  if (format == "text") MT_CHECK(opt.records == "auto" || opt.records == "text", "--records {}: a text input is one document", opt.records);

  Encoder enc(tok, opt, r, format == "text");
  enc.wide = r.wide;
  std::vector<Record> batch;
  if (format == "jsonl") {
    std::ifstream in(opt.input, std::ios::binary);
    MT_CHECK(in.good(), "{} '{}': cannot open it", in_opt, opt.input.string());
    std::string line;
    std::int64_t line_no = 0;
    std::size_t batch_bytes = 0;
    while (std::getline(in, line)) {
      ++line_no;
      r.bytes += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines separate nothing
      batch_bytes += line.size();
      batch.push_back({line_no, std::move(line)});
      if (batch_bytes >= (16u << 20) || batch.size() >= 8192) {
        enc.add(batch, "");
        batch_bytes = 0;
        if (opt.progress) opt.progress(r.bytes, total);
      }
    }
    MT_CHECK(!in.bad(), "{} '{}': read error at line {}", in_opt, opt.input.string(), line_no);
    enc.add(batch, "");
  } else {
    if (format == "text") {
      std::string content = detail::read_file(opt.input);  // (one document: its ids need all of it)
      r.bytes = content.size();
      MT_CHECK(!content.empty(), "{} '{}' is empty", in_opt, opt.input.string());
      batch.push_back({1, std::move(content)});
      enc.add(batch, "");
    } else {
      JsonArrayReader reader(opt.input, in_opt);
      std::string element;
      std::size_t batch_bytes = 0;
      for (std::int64_t i = 0; reader.next(element); ++i) {
        batch_bytes += element.size();
        batch.push_back({i, std::move(element)});
        if (batch_bytes >= (16u << 20) || batch.size() >= 8192) {
          enc.add(batch, " element ");
          batch_bytes = 0;
          if (opt.progress) opt.progress(reader.bytes(), total);
        }
      }
      enc.add(batch, " element ");
      r.bytes = reader.bytes();
    }
  }
  if (opt.progress) opt.progress(r.bytes, total);
  enc.commit();
  std::string what = r.examples ? fmt::format("{} {} ({}{}), {} tokens of which {} trained", r.count,
                                              r.records == RecordFormat::preference ? "preference pairs" : "examples",
                                              record_format_name(r.records),
                                              r.chat ? fmt::format(", chat format {}", chat_format_name(*r.chat)) : "", r.tokens,
                                              r.trained_tokens)
                                : fmt::format("{} documents, {} tokens", r.count, r.tokens);
  r.summary = fmt::format("{}: {} ({}, {}, end token {}) from {:.1f} MB of {}{}", opt.output.string(), what,
                          r.wide ? "uint32" : "uint16", tok.family(), r.eos ? tok.id_to_token(*r.eos).value_or("?") : "none",
                          static_cast<double>(r.bytes) / 1e6, format,
                          r.bad_lines ? fmt::format("; bad lines skipped: {}", r.bad_lines) : "");
  return r;
}

}  // namespace megatrain::text
