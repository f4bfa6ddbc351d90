// libFuzzer target: tokenizer.json (megatrain/text/tokenizer.hpp: Tokenizer::from_folder and
// from_file), then the tokenizer it describes at work.
//
// An input is the text of a tokenizer.json, written into a folder of its own (tmpfs) and read by
// Tokenizer::from_folder; it must load or throw megatrain::Error. A tokenizer that loads encodes
// a fixed sample (scripts, digits, white space runs, special-token look-alikes, invalid UTF-8)
// and the input's own first bytes, with and without the post-processor's tokens: encoding is
// deterministic (again, and in a batch, the same ids: the word cache must not change results),
// every id it gives has a token and decodes, and the ids the post-processor adds are those
// special_tokens_around() names. Real tokenizers promise decode(encode(text)) == text only for
// some shapes (byte-level BPE without a normalizer); with arbitrary ones nothing more is checked.
// Seeds: the cut-down real tokenizers of tests/fuzz/tokenizers/.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/text/tokenizer.hpp"

using namespace megatrain;
using namespace megatrain::text;
using megatrain::fuzz::Scratch;

namespace {

Scratch& scratch() {
  static Scratch s("tokenizer_json");
  return s;
}

const std::string kSample =
    "Hello, world! It's 2024-05-20: 12345678 tokens\tcost $3.50.\n\n  Indented  text   with  runs.\n"
    "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 "
    "\xF0\x9F\xA4\x97 e\xCC\x81 \xEF\xBC\xA1 <|im_start|>user\n<s></s><unk><|endoftext|> <|begin_of_text|>"
    "\xFF\xC3 \xE2\x82 \xE2\x96\x81\xE2\x96\x81x";

void check_encoding(const Tokenizer& t, std::string_view text) {
  const auto ids = t.encode(text);
  FUZZ_REQUIRE(t.encode(text) == ids);
  for (const std::int32_t id : ids) {
    FUZZ_REQUIRE(id >= 0 && id < t.vocab_size());
    FUZZ_REQUIRE(t.id_to_token(id).has_value());
  }
  (void)t.decode(ids);
  (void)t.decode(ids, true);
  const auto with = t.encode(text, true);
  const auto [before, after] = t.special_tokens_around();
  if (before.empty() && after.empty()) {
    FUZZ_REQUIRE(with == ids);
  } else {
    std::vector<std::int32_t> want = before;
    want.insert(want.end(), ids.begin(), ids.end());
    want.insert(want.end(), after.begin(), after.end());
    FUZZ_REQUIRE(with == want);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  fuzz::fs::create_directories(scratch() / "model");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in = fuzz::as_text(data, size);
  const auto dir = scratch() / "model";
  fuzz::write_file(dir / "tokenizer.json", in);
  std::optional<Tokenizer> t;
  try {
    t.emplace(Tokenizer::from_folder(dir));
  } catch (const Error&) {
    return 0;
  }
  FUZZ_REQUIRE(t->vocab_size() >= 0);
  const std::string_view own = in.substr(0, 200);
  check_encoding(*t, kSample);
  check_encoding(*t, own);
  check_encoding(*t, "");
  const std::vector<std::string_view> texts{kSample, own, "", kSample};
  const auto batch = t->encode_batch(texts);
  FUZZ_REQUIRE(batch.size() == texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) FUZZ_REQUIRE(batch[i] == t->encode(texts[i]));
  for (const auto id : {t->eos_id(), t->bos_id()})
    if (id) FUZZ_REQUIRE(t->id_to_token(*id).has_value());
  for (const char* name : {"<|endoftext|>", "</s>", "<s>", "<|im_end|>"})
    if (const auto id = t->token_to_id(name)) FUZZ_REQUIRE(*id >= 0 && *id < t->vocab_size());
  (void)t->family();
  return 0;
}
