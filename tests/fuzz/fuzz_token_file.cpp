// libFuzzer target: token files (TokenSource::open: raw uint16 / uint32 ids, the llm.c header,
// text, and the .mask / .idx files of examples beside a .bin), and a TokenDataset over them.
//
// Input layout (see make_fuzz_seeds.cpp, which writes valid ones of every kind):
//   byte 0   flags: 1 uint32 ids (else uint16) | 2 named .txt (else .bin) | 4 with .mask and .idx |
//            8 the sidecars raw from the input (else derived from the tokens, consistent) |
//            16 pack | 32 train on the prompt | 64 the file also as the validation source |
//            128 vocabulary = largest id + 1 (else 200)
//   byte 1   sequence length - 1 (low 6 bits); validation fraction x 10 (high 2 bits)
//   rest     raw sidecars: [mask length, 2 bytes LE][index length, 2 bytes LE][mask][index][file];
//            otherwise the file
// A source that opens must hold what it says: every id readable and below 2^31 (or -1 for a
// uint32 id above it), read() equal to at(), max_id() the largest, examples tiling the tokens.
// A dataset built on it must give windows whose ids and labels are in the vocabulary (labels may
// be kIgnoreIndex), positions within the sequence, and a trained label in every window of
// examples.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/core/error.hpp"
#include "megatrain/data/token_dataset.hpp"

using namespace megatrain;
using megatrain::fuzz::Scratch;

namespace {

Scratch& scratch() {
  static Scratch s("token_file");
  return s;
}

std::uint16_t le16(std::string_view s, std::size_t at) {
  return static_cast<std::uint16_t>(static_cast<unsigned char>(s[at]) | (static_cast<unsigned char>(s[at + 1]) << 8));
}

/// The token count TokenSource::open will find in `file` if it opens it as a .bin.
std::size_t expected_count(std::string_view file, bool u32) {
  std::int32_t head[3] = {0, 0, 0};
  if (file.size() >= 1024) std::memcpy(head, file.data(), sizeof head);
  if (file.size() >= 1024 && head[0] == 20240520) return (file.size() - 1024) / 2;
  return file.size() / (u32 ? 4 : 2);
}

/// A mask and an index consistent with `count` tokens, their values drawn from `file`.
void derive_sidecars(std::string_view file, std::size_t count, std::string& mask, std::string& index) {
  const auto byte = [&](std::size_t i) { return file.empty() ? 0u : static_cast<unsigned char>(file[i % file.size()]); };
  mask.assign(count, '\0');
  for (std::size_t i = 0; i < count; ++i) mask[i] = static_cast<char>((byte(3 * i + 1) >> 2) & 1);
  std::vector<std::int64_t> at{0};
  for (std::size_t i = 1; i < count; ++i)
    if (byte(5 * i) % 7 == 0) at.push_back(static_cast<std::int64_t>(i));
  at.push_back(static_cast<std::int64_t>(count));
  index.assign(at.size() * 8, '\0');
  std::memcpy(index.data(), at.data(), index.size());
}

void check_source(const TokenSource& s) {
  FUZZ_REQUIRE(s.size() > 0);
  std::vector<std::int32_t> all(static_cast<std::size_t>(s.size()));
  s.read(0, all);
  std::int32_t max_id = -1;
  for (std::int64_t i = 0; i < s.size(); ++i) {
    const std::int32_t v = s.at(i);
    FUZZ_REQUIRE(v == all[static_cast<std::size_t>(i)]);
    FUZZ_REQUIRE(v >= 0 || (v == -1 && s.format() == TokenFormat::u32));
    FUZZ_REQUIRE(s.format() != TokenFormat::u16 || v < 65536);
    FUZZ_REQUIRE(s.format() != TokenFormat::text || v < 256);
    if (v >= 0) max_id = std::max(max_id, v);
  }
  if (std::none_of(all.begin(), all.end(), [](std::int32_t v) { return v < 0; })) FUZZ_REQUIRE(s.max_id() == max_id);
  FUZZ_REQUIRE(s.digest().size() == 32);
  (void)s.holds_u16_pairs(1000);
  if (s.has_examples()) {
    FUZZ_REQUIRE(s.format() != TokenFormat::text);
    FUZZ_REQUIRE(s.example_begin(0) == 0 && s.example_end(s.examples() - 1) == s.size());
    for (std::int64_t e = 0; e < s.examples(); ++e) FUZZ_REQUIRE(s.example_begin(e) < s.example_end(e));
    for (std::int64_t i = 0; i < s.size(); ++i) (void)s.trained(i);
  }
}

void check_rows(const TokenDataset& d, bool train, std::int64_t first, std::int64_t rows, std::int64_t vocab) {
  if (rows <= 0) return;
  const auto n = static_cast<std::size_t>(rows * d.seq_len());
  std::vector<std::int32_t> ids(n), labels(n), positions(n);
  if (train) d.train_batch(first, rows, ids, labels, positions);
  else d.val_batch(first, rows, ids, labels, positions);
  for (std::int64_t r = 0; r < rows; ++r) {
    bool labelled = false;
    for (std::int64_t t = 0; t < d.seq_len(); ++t) {
      const auto i = static_cast<std::size_t>(r * d.seq_len() + t);
      FUZZ_REQUIRE(ids[i] >= 0 && ids[i] < vocab);
      FUZZ_REQUIRE(labels[i] == kIgnoreIndex || (labels[i] >= 0 && labels[i] < vocab));
      FUZZ_REQUIRE(positions[i] >= 0 && positions[i] < d.seq_len());
      labelled = labelled || labels[i] != kIgnoreIndex;
    }
    if (d.examples()) FUZZ_REQUIRE(labelled);
  }
}

void check_dataset(const TokenDataset& d, std::int64_t vocab) {
  FUZZ_REQUIRE(d.train_windows() > 0 && d.val_windows() > 0);
  if (d.examples()) {
    for (const ExampleStats* st : {&d.train_examples(), &d.val_examples()}) {
      FUZZ_REQUIRE(st->dropped >= 0 && st->dropped <= st->examples && st->truncated <= st->examples - st->dropped);
      FUZZ_REQUIRE(st->labels > 0 && st->labels <= st->tokens);
      FUZZ_REQUIRE(st->rows > 0 && st->rows <= st->examples - st->dropped);
      if (!d.packed()) FUZZ_REQUIRE(st->rows == st->examples - st->dropped);
    }
    FUZZ_REQUIRE(d.train_windows() == d.train_examples().rows && d.val_windows() == d.val_examples().rows);
  }
  constexpr std::int64_t kMaxRows = 512;
  check_rows(d, true, 0, std::min(d.train_windows(), kMaxRows), vocab);
  check_rows(d, true, d.train_windows() - 1, 2, vocab);  // across the end of an epoch
  check_rows(d, false, 0, std::min(d.val_windows(), kMaxRows), vocab);
  const DataPosition p = d.position(d.train_windows() + 1);
  FUZZ_REQUIRE(p.slot >= 0 && p.slot < d.train_windows() && p.windows_consumed() == d.train_windows() + 1);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)scratch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::string_view in = fuzz::as_text(data, size);
  const unsigned flags = data[0];
  const bool u32 = flags & 1, txt = flags & 2, sidecars = flags & 4, raw = flags & 8;
  std::string_view body = in.substr(2);
  std::string mask, index;
  if (sidecars && raw) {
    if (body.size() < 4) return 0;
    const std::size_t m = std::min<std::size_t>(le16(body, 0), body.size() - 4);
    const std::size_t x = std::min<std::size_t>(le16(body, 2), body.size() - 4 - m);
    mask = body.substr(4, m);
    index = body.substr(4 + m, x);
    body.remove_prefix(4 + m + x);
  } else if (sidecars) {
    derive_sidecars(body, expected_count(body, u32), mask, index);
  }
  const fuzz::fs::path file = scratch() / (txt ? "tokens.txt" : "tokens.bin");
  fuzz::write_file(file, body);
  const auto mask_path = example_mask_path(file), index_path = example_index_path(file);
  if (sidecars) {
    fuzz::write_file(mask_path, mask);
    fuzz::write_file(index_path, index);
  }
  std::optional<TokenSource> src, val;
  try {
    src = TokenSource::open(file, u32 ? TokenFormat::u32 : TokenFormat::u16);
    if (flags & 64) val = TokenSource::open(file, u32 ? TokenFormat::u32 : TokenFormat::u16);
  } catch (const Error&) {
  }
  if (src) {
    check_source(*src);
    DatasetOptions o;
    const std::int32_t max_id = src->max_id();
    o.vocab_size = (flags & 128) ? std::max<std::int64_t>(max_id, 0) + 1 : 200;
    o.seq_len = (data[1] & 63) + 1;
    o.val_fraction = static_cast<double>(data[1] >> 6) / 10.0;
    o.seed = size;
    o.pack = flags & 16;
    o.train_on_prompt = flags & 32;
    std::optional<TokenDataset> d;
    try {
      d.emplace(*src, o, val);
    } catch (const Error&) {
    }
    if (d) check_dataset(*d, o.vocab_size);
  }
  fuzz::remove_file(file);
  fuzz::remove_file(mask_path);
  fuzz::remove_file(index_path);
  return 0;
}
