// The tokenizer on hand-made tokenizer.json files, with results worked out by hand; agreement
// with Hugging Face tokenizers on real files is tokenizer_agreement's job. Also what the fuzz
// targets (tests/fuzz) found in tokenizer.json, tokenizer_config.json and JSONL records.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../io/io_test_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/text/chat.hpp"
#include "megatrain/text/prepare.hpp"
#include "megatrain/text/tokenizer.hpp"

using namespace megatrain;
using megatrain::text::Tokenizer;
using megatrain::text::first_invalid_utf8;
using megatrain::text::utf8_lossy;
using json = nlohmann::json;

namespace {

// GPT-2's byte-to-character map, written out independently of the library's.
std::string byte_char(int b) {
  int n = 0;
  for (int x = 0; x < 256; ++x) {
    const bool self = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    const int cp = self ? x : 256 + n++;
    if (x == b) {
      std::string s;
      if (cp < 0x80) s += static_cast<char>(cp);
      else s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
      return s;
    }
  }
  return {};
}

// A byte-level BPE: the 256 byte characters (ids 0..255), then the merges' results in order.
json byte_level(const std::vector<std::pair<std::string, std::string>>& merges, json added = json::array()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json m = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    m.push_back(a + " " + b);
  }
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor", {{"type", "ByteLevel"}, {"trim_offsets", false}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"vocab", vocab}, {"merges", m}}}};
}

Tokenizer load(const test::TempDir& dir, const json& j, const std::string& name = "tokenizer.json") {
  test::write_file(dir / name, j.dump());
  return Tokenizer::from_file(dir / name);
}

std::int32_t id(const Tokenizer& t, const std::string& s) {
  const auto i = t.token_to_id(s);
  REQUIRE_MESSAGE(i.has_value(), "no token " << s);
  return *i;
}

}  // namespace

TEST_CASE("invalid UTF-8 becomes U+FFFD, one per maximal invalid subsequence") {
  const std::string r = "\xEF\xBF\xBD";
  CHECK(utf8_lossy("plain ascii") == "plain ascii");
  CHECK(utf8_lossy("caf\xC3\xA9 \xF0\x9F\xA4\x97") == "caf\xC3\xA9 \xF0\x9F\xA4\x97");
  CHECK(utf8_lossy("\x80") == r);
  CHECK(utf8_lossy("a\xC3") == "a" + r);                       // truncated at the end
  CHECK(utf8_lossy("\xE2\x82z") == r + "z");                   // a truncated 3-byte sequence: one replacement
  CHECK(utf8_lossy("\xF0\x9F\x98") == r);                      // a truncated 4-byte sequence: one
  CHECK(utf8_lossy("\xED\xA0\x80") == r + r + r);              // a surrogate: ED's second byte must be below A0
  CHECK(utf8_lossy("\xC0\xAF") == r + r);                      // overlong
  CHECK(utf8_lossy("\xE0\x80\xAF") == r + r + r);              // overlong
  CHECK(utf8_lossy("\xF4\x90\x80\x80") == r + r + r + r);      // above U+10FFFF
  CHECK(utf8_lossy("\xC3(b") == r + "(b");
  CHECK(utf8_lossy("\xFF\xFE") == r + r);
}

TEST_CASE("the first byte that is not valid UTF-8, a sequence cut short by the end included") {
  constexpr auto none = std::string_view::npos;
  CHECK(first_invalid_utf8("") == none);
  CHECK(first_invalid_utf8("caf\xC3\xA9 \xF0\x9F\xA4\x97") == none);
  CHECK(first_invalid_utf8("ab\x80") == 2);
  CHECK(first_invalid_utf8("{\"a\": 1}\n\xEF") == 9);        // a 3-byte sequence's first byte, then the end
  CHECK(first_invalid_utf8("x\xE2\x82") == 1);                 // its first two bytes, then the end
  CHECK(first_invalid_utf8("\xC3\xA9\xED\xA0\x80") == 2);       // a surrogate after a valid sequence
  CHECK(first_invalid_utf8("\xF4\x90\x80\x80") == 0);           // above U+10FFFF
  // agrees with utf8_lossy: the text is valid exactly where it comes back unchanged
  for (const std::string t : {"a\xC3", "\xC0\xAF", "ok", "\xE0\xA0\x80", "\xF0\x90\x80"})
    CHECK((first_invalid_utf8(t) == none) == (utf8_lossy(t) == t));
}

TEST_CASE("byte-level BPE: merges by rank, leftmost first; pre-tokenized words; decode gives the text back") {
  test::TempDir dir("megatrain-text");
  const std::string G = byte_char(' ');  // "Ġ"
  const auto t = load(dir, byte_level({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {G, "w"}, {"a", "a"}}));
  CHECK(t.family() == "byte-level BPE");
  CHECK(t.vocab_size() == 256 + 6);
  // "hello" merges all the way; " world" is one word with its space (GPT-2's pattern): Ġw, o, r, l, d
  CHECK(t.encode("hello world") == std::vector<std::int32_t>{id(t, "hello"), id(t, G + "w"), 'o', 'r', 'l', 'd'});
  // rank 0 of "a a" applies leftmost first: aaa -> aa a
  CHECK(t.encode("aaa") == std::vector<std::int32_t>{id(t, "aa"), 'a'});
  // every byte has its character: control bytes, and UTF-8 of any script
  const std::string text = "x\t\x01 \xC3\xA9\xE4\xB8\xAD \xF0\x9F\xA4\x97!\n";
  const auto ids = t.encode(text);
  CHECK(ids.size() == 16);  // one per byte: no merges apply
  CHECK(t.decode(ids) == text);
  // digits and letters are separate words, contractions are words of their own
  CHECK(t.encode("ab12") == std::vector<std::int32_t>{'a', 'b', '1', '2'});
  CHECK(t.encode("it's").size() == 4);
  // invalid UTF-8 is encoded as its replacement characters
  CHECK(t.decode(t.encode("a\xFF")) == "a\xEF\xBF\xBD");
  CHECK_THROWS_WITH_AS(t.decode(std::vector<std::int32_t>{5, 999}), doctest::Contains("token id 999 is not in the vocabulary"),
                       Error);
}

TEST_CASE("added tokens: matched in the text before the model, longest first; skipped when decoding if special") {
  test::TempDir dir("megatrain-text");
  json added = json::array();
  added.push_back({{"id", 300}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}, {"lstrip", false},
                   {"rstrip", false}, {"single_word", false}});
  added.push_back({{"id", 301}, {"content", "<|end|>x"}, {"special", false}, {"normalized", false}, {"lstrip", false},
                   {"rstrip", false}, {"single_word", false}});
  added.push_back({{"id", 302}, {"content", "[gap]"}, {"special", true}, {"normalized", false}, {"lstrip", true},
                   {"rstrip", true}, {"single_word", false}});
  const auto t = load(dir, byte_level({{"h", "i"}}, added));
  CHECK(t.vocab_size() == 303);
  CHECK(t.encode("hi<|end|>hi") == std::vector<std::int32_t>{id(t, "hi"), 300, id(t, "hi")});
  CHECK(t.encode("<|end|>xhi") == std::vector<std::int32_t>{301, id(t, "hi")});  // the longer one wins
  CHECK(t.encode("hi  [gap]  hi") == std::vector<std::int32_t>{id(t, "hi"), 302, id(t, "hi")});  // lstrip and rstrip take the spaces
  CHECK(t.is_special(300));
  CHECK(!t.is_special(301));
  CHECK(t.decode(std::vector<std::int32_t>{id(t, "hi"), 300, 301}) == "hi<|end|><|end|>x");
  CHECK(t.decode(std::vector<std::int32_t>{id(t, "hi"), 300, 301}, true) == "hi<|end|>x");
  CHECK(!t.eos_id().has_value());  // no tokenizer_config.json, and none of the usual names
}

TEST_CASE("SentencePiece-style BPE: Metaspace, byte fallback, unknown characters fused, BOS from the template") {
  test::TempDir dir("megatrain-text");
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"\u2581", 3}, {"a", 4}, {"b", 5}, {"\u2581a", 6}, {"ab", 7}, {"\u2581ab", 8}};
  int next = 9;
  for (const char* byte : {"<0xC3>", "<0xA9>"}) vocab[byte] = next++;
  json merges = json::array({json::array({"a", "b"}), json::array({"\u2581", "ab"}), json::array({"\u2581", "a"})});
  json added = json::array();
  for (const auto& [content, i] : std::vector<std::pair<std::string, int>>{{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}})
    added.push_back({{"id", i}, {"content", content}, {"special", true}, {"normalized", false}, {"lstrip", false},
                     {"rstrip", false}, {"single_word", false}});
  const json j = {
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", {{"type", "Sequence"},
                   {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                             {{"type", "ByteFallback"}},
                                             {{"type", "Fuse"}},
                                             {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", true}, {"vocab", vocab},
                 {"merges", merges}}}};
  const auto t = load(dir, j);
  CHECK(t.family() == "SentencePiece BPE");
  // "ab a" -> "▁ab▁a": ▁+ab (rank 1) after a+b (rank 0), then ▁+a
  CHECK(t.encode("ab a") == std::vector<std::int32_t>{8, 6});
  CHECK(t.encode("ab a", true) == std::vector<std::int32_t>{1, 8, 6});
  // é is not in the vocabulary: its bytes; 中 has no byte tokens: <unk>, two of them fused
  CHECK(t.encode("a\xC3\xA9") == std::vector<std::int32_t>{6, 9, 10});
  CHECK(t.encode("a\xE4\xB8\xAD\xE4\xB8\xAD") == std::vector<std::int32_t>{6, 0});
  CHECK(t.decode(t.encode("ab a\xC3\xA9")) == "ab a\xC3\xA9");
  CHECK(t.decode(std::vector<std::int32_t>{1, 8, 6}, true) == "ab a");
  CHECK(t.eos_id() == 2);  // </s>
}

TEST_CASE("normalizers: NFC composes, Prepend and Replace spell SentencePiece's spaces") {
  test::TempDir dir("megatrain-text");
  json j = byte_level({});
  j["normalizer"] = {{"type", "NFC"}};
  const auto t = load(dir, j);
  // e + combining acute -> é (U+00E9: two bytes, two byte characters)
  CHECK(t.encode("e\xCC\x81") == std::vector<std::int32_t>{0xC3, 0xA9});
  CHECK(t.decode(t.encode("e\xCC\x81")) == "\xC3\xA9");
}

TEST_CASE("Qwen's split pattern on long runs: a megabyte of letters, of spaces, of digits") {
  test::TempDir dir("megatrain-text");
  json j = byte_level({{"a", "a"}, {"aa", "aa"}});
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  const auto t = load(dir, j);
  const std::size_t n = 1u << 20;
  const std::string text = std::string(n, 'a') + std::string(n, ' ') + "b" + std::string(n / 4, '7') + "\n\n";
  const auto ids = t.encode(text);
  // aaaa tokens for the letters; one token per space, digit and newline
  CHECK(ids.size() == n / 4 + n + 1 + n / 4 + 2);
  CHECK(t.decode(ids) == text);
}

TEST_CASE("encode_batch equals encode, document by document, on random text") {
  test::TempDir dir("megatrain-text");
  const auto t = load(dir, byte_level({{"t", "h"}, {"th", "e"}, {byte_char(' '), "the"}, {"i", "n"}}));
  std::uniform_int_distribution<int> len(0, 300), pick(0, 11);
  const char* parts[] = {"the", " ", "in", "\n", "12", "\xC3\xA9", "x", "  ", "!", "\xF0\x9F\x98\x80", "\xFF", "'s"};
  std::vector<std::string> docs(37);
  for (auto& d : docs)
    for (int k = len(test::rng()); k > 0; --k) d += parts[pick(test::rng())];
  std::vector<std::string_view> views(docs.begin(), docs.end());
  const auto batch = t.encode_batch(views);
  REQUIRE(batch.size() == docs.size());
  for (std::size_t i = 0; i < docs.size(); ++i) {
    CHECK(batch[i] == t.encode(docs[i]));
    CHECK(t.decode(batch[i]) == utf8_lossy(docs[i]));
  }
}

TEST_CASE("what is not supported is refused, naming the file and what was found") {
  test::TempDir dir("megatrain-text");
  const std::string file = (dir / "tokenizer.json").string();
  json j = byte_level({});
  j["model"]["type"] = "WordPiece";
  CHECK_ERROR_MENTIONS(load(dir, j), file, "model type 'WordPiece' is not supported");
  j = byte_level({});
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  CHECK_ERROR_MENTIONS(load(dir, j), "the pre-tokenizer 'Whitespace' is not supported");
  j = byte_level({});
  j["normalizer"] = {{"type", "Lowercase"}};
  CHECK_ERROR_MENTIONS(load(dir, j), "the normalizer 'Lowercase' is not supported");
  j = byte_level({});
  j["model"]["merges"].push_back("q zz");
  CHECK_ERROR_MENTIONS(load(dir, j), "merge 0 ('q' 'zz') names a token that is not in the vocabulary");
  j = byte_level({});
  j["model"]["dropout"] = 0.1;
  CHECK_ERROR_MENTIONS(load(dir, j), "BPE dropout is not supported");
  test::write_file(dir / "tokenizer.json", "{\"model\": ");
  CHECK_ERROR_MENTIONS(Tokenizer::from_file(dir / "tokenizer.json"), file, "malformed JSON");
  test::TempDir sp("megatrain-text");
  test::write_file(sp / "tokenizer.model", "not read");
  CHECK_ERROR_MENTIONS(Tokenizer::from_folder(sp.path()), "has a SentencePiece tokenizer.model but no tokenizer.json");
}

TEST_CASE("tokenizer_config.json: the end-of-sequence and beginning tokens, and the chat template") {
  test::TempDir dir("megatrain-text");
  json added = json::array();
  for (const auto& [content, i] : std::vector<std::pair<std::string, int>>{{"<|endoftext|>", 256}, {"<|im_end|>", 257}})
    added.push_back({{"id", i}, {"content", content}, {"special", true}, {"normalized", false}, {"lstrip", false},
                     {"rstrip", false}, {"single_word", false}});
  test::write_file(dir / "tokenizer_config.json",
                   json{{"eos_token", "<|im_end|>"}, {"bos_token", nullptr}, {"chat_template", "{{ messages }}"}}.dump());
  const auto t = load(dir, byte_level({}, added));
  CHECK(t.eos_id() == 257);
  CHECK(!t.bos_id().has_value());
  REQUIRE(t.chat_template().has_value());
  CHECK(*t.chat_template() == "{{ messages }}");
}

TEST_CASE("ids that are not whole numbers in range, and numbers beyond a double's range, are refused (found by fuzzing)") {
  test::TempDir dir("megatrain-text");
  const std::string file = (dir / "tokenizer.json").string();
  const auto added = [](json id) {
    return json::array({{{"id", id}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}}});
  };
  // (a negative id once sized the id table to nothing and wrote past it; a float one was converted
  // to int out of range; 2^31 - 1 made a table of 2^31 strings)
  CHECK_ERROR_MENTIONS(load(dir, byte_level({}, added(-1))), file, "the added token '<|end|>' has the id -1",
                       "must lie in [0, ");
  CHECK_ERROR_MENTIONS(load(dir, byte_level({}, added(1e10))), "the added token '<|end|>'", "not an integer");
  CHECK_ERROR_MENTIONS(load(dir, byte_level({}, added(2147483647))), "has the id 2147483647", "the file defines 257 tokens");
  CHECK_NOTHROW(load(dir, byte_level({}, added(256 + 1000))));  // (a gap after the vocabulary is fine)
  json j = byte_level({});
  j["model"]["vocab"]["a"] = 1e300;
  CHECK_ERROR_MENTIONS(load(dir, j), "token 'a' has the id", "not an integer");
  j["model"]["vocab"]["a"] = std::int64_t{1} << 30;
  CHECK_ERROR_MENTIONS(load(dir, j), "token 'a' has the id 1073741824");
  j = byte_level({});
  j["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", -1.5}, {"stop", 0}};
  CHECK_ERROR_MENTIONS(load(dir, j), "the Strip decoder's start must be a whole number >= 0, not -1.5");
  j = byte_level({});
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}})},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {7777}}}}}}};
  CHECK_ERROR_MENTIONS(load(dir, j), "the post-processor adds the token id 7777");
  // nlohmann reports a number beyond a double's range as out_of_range, not as a parse error
  std::string text = byte_level({}).dump();
  text.insert(1, "\"x\": 1e400, ");
  test::write_file(dir / "tokenizer.json", text);
  CHECK_ERROR_MENTIONS(Tokenizer::from_file(dir / "tokenizer.json"), file, "malformed JSON", "1e400");
  test::write_file(dir / "tokenizer_config.json", "{\"model_max_length\": 1e400}");
  CHECK_ERROR_MENTIONS(load(dir, byte_level({})), "tokenizer_config.json", "malformed JSON");
}

TEST_CASE("records: a conversation without messages, a number beyond a double's range, an example of no tokens") {
  using namespace megatrain::text;
  test::TempDir dir("megatrain-text");
  // record_pieces as a conversation, of a record that holds none: refused (it once read a missing key)
  RecordOptions ro;
  ro.chat = ChatFormat::chatml;
  CHECK_ERROR_MENTIONS(record_pieces(json{{"prompt", "a"}, {"completion", "b"}}, RecordFormat::messages, ro),
                       "no field 'messages'");
  json added = json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}, {"normalized", false}}});
  const auto t = load(dir, byte_level({}, added));
  test::write_file(dir / "in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\", \"n\": 1e400}\n");
  PrepareOptions o;
  o.input = dir / "in.jsonl";
  o.output = dir / "out.bin";
  CHECK_ERROR_MENTIONS(prepare_token_files(t, o), (dir / "in.jsonl").string() + ":2", "not JSON", "1e400");
  o.skip_bad_lines = true;
  const PrepareResult r = prepare_token_files(t, o);
  CHECK(r.count == 1);
  CHECK(r.bad_lines == 1);
  // A tokenizer without an unknown token drops the characters it lacks: a completion of them alone
  // is an example with no token to train on (it once read before the start of an empty vector)
  test::TempDir small("megatrain-text");
  const auto a_only = load(small, json{{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}, {"merges", json::array()}}}});
  test::write_file(small / "pc.jsonl", "{\"prompt\": \"\", \"completion\": \"zz\"}\n");
  PrepareOptions pc;
  pc.input = small / "pc.jsonl";
  pc.output = small / "pc.bin";
  pc.eos = "none";
  CHECK_ERROR_MENTIONS(prepare_token_files(a_only, pc), "pc.jsonl:1", "no token to train on");
}

TEST_CASE("the gemma3 chat format: Gemma 3's turns, its system prefix, and the alternation its template demands") {
  using namespace megatrain::text;
  REQUIRE(chat_format_named("gemma3") == ChatFormat::gemma3);
  const std::vector<ChatMessage> ms{{"system", "Be brief.", {}}, {"user", "  Hi! ", {}}, {"assistant", "Hello.\n", {}},
                                    {"user", "2+2?", {}}, {"assistant", "4", {}}};
  const auto pieces = render_chat(ChatFormat::gemma3, ms, "<bos>");
  std::string text;
  std::vector<std::string> trained;
  for (const auto& p : pieces) {
    text += p.text;
    if (p.trained) trained.push_back(p.text);
  }
  // (the system message's content and two newlines open the first user turn, untrimmed; every
  // content trimmed; the assistant's turns written "model", trained with their <end_of_turn>)
  CHECK(text ==
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n");
  CHECK(trained == std::vector<std::string>{"Hello.<end_of_turn>", "4<end_of_turn>"});
  // turns that do not alternate are refused, as the template raises
  const std::vector<ChatMessage> twice{{"user", "a", {}}, {"user", "b", {}}, {"assistant", "c", {}}};
  CHECK_THROWS_WITH_AS(render_chat(ChatFormat::gemma3, twice, "<bos>"),
                       doctest::Contains("message 2 is a user message where Gemma 3's chat template expects an assistant message"),
                       megatrain::Error);
  const std::vector<ChatMessage> late{{"user", "a", {}}, {"assistant", "b", {}}, {"system", "note", {}}, {"user", "c", {}},
                                      {"assistant", "d", {}}};
  CHECK_THROWS_WITH_AS(render_chat(ChatFormat::gemma3, late, "<bos>"), doctest::Contains("message 3 is a system message"),
                       megatrain::Error);
  CHECK_THROWS_WITH_AS(render_chat(ChatFormat::gemma3, ms, ""), doctest::Contains("bos_token"), megatrain::Error);
}
