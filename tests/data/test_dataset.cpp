// Token datasets: formats, windows, the seeded shuffle, the validation split, and every kind of
// bad data refused with a clear message before training could start.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/core/error.hpp"
#include "megatrain/data/token_dataset.hpp"

using namespace megatrain;
namespace fs = std::filesystem;

namespace {
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("megatrain-data-" + std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

template <class T>
fs::path write_tokens(const fs::path& p, const std::vector<T>& v, const void* header = nullptr, std::size_t header_bytes = 0) {
  std::ofstream f(p, std::ios::binary);
  if (header) f.write(static_cast<const char*>(header), static_cast<std::streamsize>(header_bytes));
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return p;
}

std::vector<std::uint16_t> random_u16(std::size_t n, std::uint16_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = static_cast<std::uint16_t>(rng() % vocab);
  return v;
}
}  // namespace

TEST_CASE("uint16, uint32, llm.c and text sources read back the ids") {
  TempDir dir;
  const auto u16 = random_u16(1001, 50000, 1);
  auto s16 = TokenSource::open(write_tokens(dir.path / "a.bin", u16), TokenFormat::u16);
  CHECK(s16.size() == 1001);
  CHECK(s16.format() == TokenFormat::u16);
  for (std::size_t i = 0; i < u16.size(); ++i) REQUIRE(s16.at(static_cast<std::int64_t>(i)) == u16[i]);
  CHECK(s16.max_id() == *std::max_element(u16.begin(), u16.end()));

  std::vector<std::uint32_t> u32(777);
  std::mt19937 rng(2);
  for (auto& x : u32) x = static_cast<std::uint32_t>(rng() % 150000);
  auto s32 = TokenSource::open(write_tokens(dir.path / "b.bin", u32), TokenFormat::u32);
  CHECK(s32.size() == 777);
  std::vector<std::int32_t> got(10);
  s32.read(100, got);
  for (int i = 0; i < 10; ++i) CHECK(got[static_cast<std::size_t>(i)] == static_cast<std::int32_t>(u32[100 + static_cast<std::size_t>(i)]));

  std::int32_t header[256] = {20240520, 1, 1001};
  auto sl = TokenSource::open(write_tokens(dir.path / "c.bin", u16, header, sizeof header), TokenFormat::u32);
  CHECK(sl.format() == TokenFormat::u16);  // recognised by its magic whatever was asked
  CHECK(sl.size() == 1001);
  CHECK(sl.at(1000) == u16[1000]);

  { std::ofstream(dir.path / "t.txt") << "h\xc3\xa9llo"; }
  auto st = TokenSource::open(dir.path / "t.txt");
  CHECK(st.format() == TokenFormat::text);
  CHECK(st.size() == 6);
  CHECK(st.at(1) == 0xc3);
  CHECK(st.at(5) == 'o');
}

TEST_CASE("windows: inputs and next-token labels, seeded shuffle, validation split") {
  // Random bytes: every 31-byte window occurs once, so a window can be located in the text.
  std::string text(20000, '\0');
  std::mt19937 trng(3);
  for (auto& ch : text) ch = static_cast<char>(trng() % 256);
  DatasetOptions o;
  o.vocab_size = 256;
  o.seq_len = 31;
  o.val_fraction = 0.1;
  o.seed = 11;
  TokenDataset ds(TokenSource::from_text(text, "t"), o);
  CHECK(ds.val_tokens() == 2000);
  CHECK(ds.train_tokens() == 18000);
  CHECK(ds.train_windows() == (18000 - 1) / 31);
  const std::int64_t rows = 5;
  std::vector<std::int32_t> ids(rows * 31), labels(ids.size());
  std::set<std::string> seen;
  // A whole epoch visits every window exactly once.
  for (std::int64_t w = 0; w < ds.train_windows(); ++w) {
    ds.train_batch(w, 1, std::span(ids).first(31), std::span(labels).first(31));
    for (int t = 0; t < 30; ++t) CHECK(labels[static_cast<std::size_t>(t)] == ids[static_cast<std::size_t>(t) + 1]);
    std::string s(ids.begin(), ids.begin() + 31);
    const auto pos = text.find(s);
    REQUIRE(pos != std::string::npos);
    CHECK(pos % 31 == 0);
    CHECK(static_cast<std::int64_t>(pos) < ds.train_tokens());
    CHECK(static_cast<unsigned char>(text[pos + 31]) == labels[30]);
    seen.insert(s);
  }
  CHECK(static_cast<std::int64_t>(seen.size()) == ds.train_windows());
  // Same seed, same order; another seed, another order; epochs differ.
  TokenDataset same(TokenSource::from_text(text, "t"), o);
  o.seed = 12;
  TokenDataset other(TokenSource::from_text(text, "t"), o);
  std::vector<std::int32_t> a(ids.size()), b(ids.size()), c(ids.size()), l(ids.size());
  ds.train_batch(7, rows, a, l);
  same.train_batch(7, rows, b, l);
  other.train_batch(7, rows, c, l);
  CHECK(a == b);
  CHECK(a != c);
  ds.train_batch(7 + ds.train_windows(), rows, c, l);
  CHECK(a != c);
  // Validation windows come from the held-out tail, in order.
  ds.val_batch(0, 1, std::span(ids).first(31), std::span(labels).first(31));
  CHECK(std::string(ids.begin(), ids.begin() + 31) == text.substr(18000, 31));
}

TEST_CASE("the built-in text is deterministic arithmetic") {
  const std::string a = builtin_text(5000, 1);
  CHECK(a == builtin_text(5000, 1));
  CHECK(a != builtin_text(5000, 2));
  CHECK(a.size() >= 5000);
  CHECK(a.find(" plus ") != std::string::npos);
  CHECK(a.back() == '\n');
}

TEST_CASE("bad data is refused with a clear message") {
  TempDir dir;
  { std::ofstream(dir.path / "empty.bin"); }
  CHECK_THROWS_WITH_AS(TokenSource::open(dir.path / "empty.bin"), doctest::Contains("is empty"), Error);
  {
    std::ofstream f(dir.path / "odd.bin", std::ios::binary);
    f << "abc";
  }
  CHECK_THROWS_WITH_AS(TokenSource::open(dir.path / "odd.bin", TokenFormat::u16),
                       doctest::Contains("size 3 bytes is not a multiple of the token width 2"), Error);
  CHECK_THROWS_WITH_AS(TokenSource::open(dir.path / "missing.bin"), doctest::Contains("cannot open dataset"), Error);
  std::int32_t header[256] = {20240520, 1, 999};
  write_tokens(dir.path / "llmc.bin", random_u16(1000, 100, 3), header, sizeof header);
  CHECK_THROWS_WITH_AS(TokenSource::open(dir.path / "llmc.bin"), doctest::Contains("header says 999 tokens but the file holds 1000"),
                       Error);

  auto big = random_u16(5000, 300, 4);
  big[4321] = 4000;
  DatasetOptions o;
  o.vocab_size = 1000;
  o.seq_len = 16;
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(write_tokens(dir.path / "v.bin", big)), o),
                       doctest::Contains("token 4321 has id 4000, outside the model's vocabulary [0, 1000)"), Error);
  std::vector<std::uint32_t> huge{1, 2, 0x80000000u, 3};
  o.seq_len = 1;
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(write_tokens(dir.path / "h.bin", huge), TokenFormat::u32), o),
                       doctest::Contains("above 2^31"), Error);

  o.seq_len = 600;
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(write_tokens(dir.path / "s.bin", random_u16(1000, 100, 5))), o),
                       doctest::Contains("too few for one training and one validation sequence of 600 + 1"), Error);
  o.seq_len = 100;
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(write_tokens(dir.path / "t.bin", random_u16(1000, 100, 5))), o,
                                    TokenSource::open(write_tokens(dir.path / "val.bin", random_u16(50, 100, 6)))),
                       doctest::Contains("validation set"), Error);
  CHECK_THROWS_AS(TokenSource::from_text("", "x"), Error);
}

TEST_CASE("a token file read at the wrong width is refused, naming the right one") {
  TempDir dir;
  std::mt19937 rng(7);
  // uint32 ids of a 16-bit vocabulary and of a 152k one, read as uint16.
  for (const std::uint32_t vocab : {50000u, 152000u}) {
    CAPTURE(vocab);
    std::vector<std::uint32_t> ids(4096);
    for (auto& x : ids) x = static_cast<std::uint32_t>(rng() % vocab);
    const auto path = write_tokens(dir.path / ("u32-" + std::to_string(vocab) + ".bin"), ids);
    CHECK_THROWS_WITH_AS(TokenSource::open(path, TokenFormat::u16),
                         doctest::Contains("looks like uint32 token ids read as uint16 (in the first 4096 pairs of uint16 "
                                           "every second one is at most"), Error);
    CHECK_THROWS_WITH_AS(TokenSource::open(path, TokenFormat::u16), doctest::Contains("pass --data-format u32"), Error);
    CHECK(TokenSource::open(path, TokenFormat::u32).size() == 4096);
  }
  // uint16 ids read as uint32 pair up beyond the vocabulary: the message says which width fits.
  DatasetOptions o;
  o.vocab_size = 50000;
  o.seq_len = 16;
  const auto u16 = random_u16(4096, 50000, 8);
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(write_tokens(dir.path / "u16.bin", u16), TokenFormat::u32), o),
                       doctest::Contains("looks like uint16 token ids: pass --data-format u16"), Error);
  // Genuine uint16 data is not mistaken for uint32, also with small ids.
  CHECK(TokenSource::open(write_tokens(dir.path / "small.bin", random_u16(4096, 40, 9)), TokenFormat::u16).size() == 4096);
}

// ---------------------------------------------------------------------------------------------
// Examples (fine-tuning data): a token file with FILE.mask and FILE.idx beside it, one example per
// window, labels only on trained tokens.

namespace {
// One example: its ids and, per token, whether it is trained on.
struct Example {
  std::vector<std::uint16_t> ids;
  std::vector<std::uint8_t> mask;
};

// Example e of `len` tokens: ids 100 + 20 * e + t (unique across examples: a row's first id names
// its example), trained where `trained(t)`.
template <class F>
Example make_example(int e, int len, F trained) {
  Example x;
  for (int t = 0; t < len; ++t) {
    x.ids.push_back(static_cast<std::uint16_t>(100 + 20 * e + t));
    x.mask.push_back(trained(t) ? 1 : 0);
  }
  return x;
}

void write_bytes(const fs::path& p, const void* data, std::size_t n) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

void write_index(const fs::path& tokens, const std::vector<std::int64_t>& index) {
  write_bytes(example_index_path(tokens), index.data(), index.size() * sizeof(std::int64_t));
}

// Writes the examples as `path` (uint16, or uint32 when `wide`) with its .mask and .idx.
fs::path write_examples(const fs::path& path, const std::vector<Example>& xs, bool wide = false) {
  std::vector<std::uint16_t> ids;
  std::vector<std::uint8_t> mask;
  std::vector<std::int64_t> index{0};
  for (const auto& x : xs) {
    ids.insert(ids.end(), x.ids.begin(), x.ids.end());
    mask.insert(mask.end(), x.mask.begin(), x.mask.end());
    index.push_back(static_cast<std::int64_t>(ids.size()));
  }
  if (wide) write_tokens(path, std::vector<std::uint32_t>(ids.begin(), ids.end()));
  else write_tokens(path, ids);
  write_bytes(example_mask_path(path), mask.data(), mask.size());
  write_index(path, index);
  return path;
}

// Training data of awkward lengths, for seq = 8 (windows of 9 tokens):
//   0: 6 tokens, 3 prompt then 3 trained                       kept, 3 labels
//   1: 12 tokens, trained at 2, 3 and 9-11                     truncated, kept with 2 labels
//   2: 14 tokens, trained only at 10-13 (beyond the window)    truncated and dropped
//   3: 5 tokens, no prompt (all trained)                       kept, 4 labels (the first token is no label)
//   4: 9 tokens (exactly seq + 1), only the last trained       kept, 1 label at the row's last position
//   5: 10 tokens, only the last (10th) trained                 truncated and dropped
//   6: 2 tokens, the second trained                            kept, 1 label
//   7: 1 token, trained                                        dropped: no next token to be a label
//   8: 4 tokens, trained at 2, 3                               (validation: 2 labels)
//   9: 7 tokens, trained at 1-5, the last (a "\n") not         (validation: 5 labels)
std::vector<Example> awkward_examples() {
  return {
      make_example(0, 6, [](int t) { return t >= 3; }),
      make_example(1, 12, [](int t) { return t == 2 || t == 3 || t >= 9; }),
      make_example(2, 14, [](int t) { return t >= 10; }),
      make_example(3, 5, [](int) { return true; }),
      make_example(4, 9, [](int t) { return t == 8; }),
      make_example(5, 10, [](int t) { return t == 9; }),
      make_example(6, 2, [](int t) { return t == 1; }),
      make_example(7, 1, [](int) { return true; }),
      make_example(8, 4, [](int t) { return t >= 2; }),
      make_example(9, 7, [](int t) { return t >= 1 && t <= 5; }),
  };
}

// The example whose first id a row starts with.
int example_of_row(std::span<const std::int32_t> ids) { return (ids[0] - 100) / 20; }

// Checks one row against the example it holds: its first seq ids, then padding (an id within the
// vocabulary, not the next example's tokens); a label is the next token where that one is trained
// (any next token within the example with `all`), kIgnoreIndex elsewhere.
void check_row(const Example& x, std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t seq,
               std::int64_t vocab, bool all) {
  const std::int64_t len = std::min<std::int64_t>(static_cast<std::int64_t>(x.ids.size()), seq + 1);
  for (std::int64_t t = 0; t < seq; ++t) {
    CAPTURE(t);
    const auto k = static_cast<std::size_t>(t);
    if (t < len) {
      CHECK(ids[k] == x.ids[k]);
    } else {
      CHECK(ids[k] >= 0);
      CHECK(ids[k] < vocab);
      CHECK(ids[k] < 100);  // not a token of any example (they are 100 and above)
    }
    const bool labelled = t + 1 < len && (all || x.mask[k + 1] != 0);
    CHECK(labels[k] == (labelled ? x.ids[k + 1] : kIgnoreIndex));
  }
}

DatasetOptions example_options(bool all = false) {
  DatasetOptions o;
  o.vocab_size = 1000;
  o.seq_len = 8;
  o.val_fraction = 0.2;  // 2 of 10 examples
  o.seed = 5;
  o.train_on_prompt = all;
  return o;
}

// The examples of the windows of a whole epoch, in order.
std::vector<int> epoch_examples(const TokenDataset& ds, std::int64_t epoch) {
  const std::int64_t seq = ds.seq_len(), w = ds.train_windows();
  std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size());
  ds.train_batch(epoch * w, w, ids, labels);
  std::vector<int> out;
  for (std::int64_t r = 0; r < w; ++r) out.push_back(example_of_row(std::span(ids).subspan(static_cast<std::size_t>(r * seq))));
  return out;
}
}  // namespace

TEST_CASE("examples: the source reads the mask and the index beside the token file") {
  TempDir dir;
  const auto xs = awkward_examples();
  const auto path = write_examples(dir.path / "sft.bin", xs);
  CHECK(example_mask_path(path) == dir.path / "sft.bin.mask");
  CHECK(example_index_path(path) == dir.path / "sft.bin.idx");
  const auto src = TokenSource::open(path);
  REQUIRE(src.has_examples());
  CHECK(src.examples() == 10);
  CHECK(src.size() == 70);  // 6 + 12 + 14 + 5 + 9 + 10 + 2 + 1 + 4 + 7
  std::int64_t at = 0;
  for (int e = 0; e < 10; ++e) {
    CAPTURE(e);
    const auto& x = xs[static_cast<std::size_t>(e)];
    CHECK(src.example_begin(e) == at);
    CHECK(src.example_end(e) == at + static_cast<std::int64_t>(x.ids.size()));
    for (std::size_t t = 0; t < x.ids.size(); ++t) {
      CHECK(src.at(at + static_cast<std::int64_t>(t)) == x.ids[t]);
      CHECK(src.trained(at + static_cast<std::int64_t>(t)) == (x.mask[t] != 0));
    }
    at += static_cast<std::int64_t>(x.ids.size());
  }
  // A plain token file is no examples.
  const auto plain = TokenSource::open(write_tokens(dir.path / "plain.bin", random_u16(100, 50, 1)));
  CHECK_FALSE(plain.has_examples());
  CHECK(plain.examples() == 0);
  // uint32 ids with a mask and an index.
  const auto wide = TokenSource::open(write_examples(dir.path / "wide.bin", xs, true), TokenFormat::u32);
  REQUIRE(wide.has_examples());
  CHECK(wide.examples() == 10);
  CHECK(wide.size() == 70);
  CHECK(wide.at(src.example_begin(9) + 6) == xs[9].ids[6]);
  CHECK_FALSE(wide.trained(src.example_begin(9) + 6));
  CHECK(wide.trained(src.example_begin(9) + 5));
}

TEST_CASE("examples: one example per window, padded, labels only on trained tokens") {
  TempDir dir;
  const auto xs = awkward_examples();
  const auto o = example_options();
  TokenDataset ds(TokenSource::open(write_examples(dir.path / "sft.bin", xs)), o);
  REQUIRE(ds.examples());
  // Examples 8 and 9 are held out; of 0-7, 2, 5 and 7 have no label within their windows.
  CHECK(ds.train_windows() == 5);
  CHECK(ds.val_windows() == 2);
  const ExampleStats& t = ds.train_examples();
  CHECK(t.examples == 8);
  CHECK(t.truncated == 1);  // 1, 2 and 5 are longer than seq + 1 = 9; 2 and 5 are dropped, so not counted as cut
  CHECK(t.dropped == 3);
  CHECK(t.labels == 3 + 2 + 4 + 1 + 1);
  CHECK(t.tokens == 6 + 9 + 5 + 9 + 2);
  const ExampleStats& v = ds.val_examples();
  CHECK(v.examples == 2);
  CHECK(v.truncated == 0);
  CHECK(v.dropped == 0);
  CHECK(v.labels == 2 + 5);
  CHECK(v.tokens == 4 + 7);
  CHECK(ds.train_tokens() == 59);  // the tokens of examples 0-7
  CHECK(ds.val_tokens() == 11);

  const std::int64_t seq = 8, w = ds.train_windows();
  std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size());
  ds.train_batch(0, w, ids, labels);
  std::set<int> seen;
  for (std::int64_t r = 0; r < w; ++r) {
    const auto row = static_cast<std::size_t>(r * seq);
    const int e = example_of_row(std::span(ids).subspan(row));
    CAPTURE(e);
    REQUIRE(e >= 0);
    REQUIRE(e < 10);
    seen.insert(e);
    check_row(xs[static_cast<std::size_t>(e)], std::span(ids).subspan(row, 8), std::span(labels).subspan(row, 8), seq,
              o.vocab_size, false);
    // By hand, for a few of them.
    const auto L = [&](int k) { return labels[row + static_cast<std::size_t>(k)]; };
    if (e == 0) {
      CHECK(L(0) == kIgnoreIndex);
      CHECK(L(1) == kIgnoreIndex);
      CHECK(L(2) == 103);  // the first trained token, as the label of the last prompt token
      CHECK(L(4) == 105);
      CHECK(L(5) == kIgnoreIndex);  // padding
    }
    if (e == 1) {
      CHECK(ids[row + 7] == 127);  // truncated: tokens 0-7 as inputs, 8 as the last label
      CHECK(L(1) == 122);
      CHECK(L(2) == 123);
      CHECK(L(7) == kIgnoreIndex);  // token 8 is not trained (9-11 are, but lie beyond the window)
    }
    if (e == 4) {
      CHECK(L(7) == 188);  // the last token of a seq + 1 example, trained
      CHECK(std::count(labels.begin() + static_cast<std::ptrdiff_t>(row), labels.begin() + static_cast<std::ptrdiff_t>(row) + 8,
                       kIgnoreIndex) == 7);
    }
    if (e == 6) {
      CHECK(ids[row] == 220);
      CHECK(L(0) == 221);
      for (int k = 1; k < 8; ++k) CHECK(L(k) == kIgnoreIndex);
    }
  }
  CHECK(seen == std::set<int>{0, 1, 3, 4, 6});

  // Validation: the last examples (8 and 9), in order, wrapping around.
  std::vector<std::int32_t> vids(3 * 8), vlabels(vids.size());
  ds.val_batch(0, 3, vids, vlabels);
  CHECK(example_of_row(std::span(vids).subspan(0)) == 8);
  CHECK(example_of_row(std::span(vids).subspan(8)) == 9);
  CHECK(example_of_row(std::span(vids).subspan(16)) == 8);
  check_row(xs[8], std::span(vids).subspan(0, 8), std::span(vlabels).subspan(0, 8), seq, o.vocab_size, false);
  check_row(xs[9], std::span(vids).subspan(8, 8), std::span(vlabels).subspan(8, 8), seq, o.vocab_size, false);
  CHECK(vlabels[8 + 5] == kIgnoreIndex);  // example 9's last token (not trained)
  CHECK(vlabels[8 + 4] == 285);

  // A larger val_fraction holds out more of the last examples.
  auto o3 = o;
  o3.val_fraction = 0.3;  // examples 7-9: 7 is dropped from validation now
  TokenDataset ds3(TokenSource::open(dir.path / "sft.bin"), o3);
  CHECK(ds3.train_examples().examples == 7);
  CHECK(ds3.train_windows() == 5);
  CHECK(ds3.val_examples().examples == 3);
  CHECK(ds3.val_examples().dropped == 1);
  CHECK(ds3.val_windows() == 2);
  ds3.val_batch(0, 1, std::span(vids).first(8), std::span(vlabels).first(8));
  CHECK(example_of_row(vids) == 8);
}

TEST_CASE("examples: train_on_prompt labels every next token of the example") {
  TempDir dir;
  const auto xs = awkward_examples();
  const auto o = example_options(true);
  TokenDataset ds(TokenSource::open(write_examples(dir.path / "sft.bin", xs)), o);
  // Only example 7 (one token) has no label now.
  CHECK(ds.train_windows() == 7);
  const ExampleStats& t = ds.train_examples();
  CHECK(t.examples == 8);
  CHECK(t.truncated == 3);
  CHECK(t.dropped == 1);
  CHECK(t.labels == 5 + 8 + 8 + 4 + 8 + 8 + 1);
  CHECK(t.tokens == 6 + 9 + 9 + 5 + 9 + 9 + 2);
  CHECK(ds.val_examples().labels == 3 + 6);
  const std::int64_t seq = 8, w = ds.train_windows();
  std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size());
  ds.train_batch(0, w, ids, labels);
  std::set<int> seen;
  for (std::int64_t r = 0; r < w; ++r) {
    const auto row = static_cast<std::size_t>(r * seq);
    const int e = example_of_row(std::span(ids).subspan(row));
    CAPTURE(e);
    seen.insert(e);
    check_row(xs[static_cast<std::size_t>(e)], std::span(ids).subspan(row, 8), std::span(labels).subspan(row, 8), seq,
              o.vocab_size, true);
    if (e == 0) {
      CHECK(labels[row] == 101);
      CHECK(labels[row + 4] == 105);
      CHECK(labels[row + 5] == kIgnoreIndex);  // no label across into padding or the next example
    }
    if (e == 2) CHECK(labels[row + 7] == 148);
  }
  CHECK(seen == std::set<int>{0, 1, 2, 3, 4, 5, 6});
}

TEST_CASE("examples: the shuffled order visits every kept example once per epoch") {
  TempDir dir;
  // 40 examples of 3 to 11 tokens, every third with nothing trained (dropped).
  std::vector<Example> xs;
  std::set<int> kept_train;
  for (int e = 0; e < 40; ++e) {
    const bool none = e % 3 == 2;
    xs.push_back(make_example(e, 3 + e % 9, [&](int t) { return !none && t > 0 && t % 2 == 0; }));
  }
  const auto o = [] {
    auto x = example_options();
    x.seq_len = 12;
    x.val_fraction = 0.1;  // the last 4
    return x;
  }();
  for (int e = 0; e < 36; ++e)
    if (e % 3 != 2) kept_train.insert(e);
  TokenDataset ds(TokenSource::open(write_examples(dir.path / "sft.bin", xs)), o);
  CHECK(ds.train_windows() == static_cast<std::int64_t>(kept_train.size()));
  CHECK(ds.train_examples().dropped == 12);
  CHECK(ds.val_windows() == 3);  // 36-39: 38 is dropped
  std::vector<std::vector<int>> orders;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    CAPTURE(epoch);
    const auto order = epoch_examples(ds, epoch);
    CHECK(std::set<int>(order.begin(), order.end()) == kept_train);
    CHECK(order.size() == kept_train.size());
    orders.push_back(order);
  }
  CHECK(orders[0] != orders[1]);  // a permutation per epoch
  CHECK(orders[1] != orders[2]);
  std::vector<int> sorted(kept_train.begin(), kept_train.end());
  CHECK(orders[0] != sorted);  // shuffled, not in file order
  // Reproducible from the seed; another seed, another order.
  TokenDataset same(TokenSource::open(dir.path / "sft.bin"), o);
  CHECK(epoch_examples(same, 1) == orders[1]);
  auto o2 = o;
  o2.seed = 6;
  TokenDataset other(TokenSource::open(dir.path / "sft.bin"), o2);
  CHECK(epoch_examples(other, 0) != orders[0]);
  // A batch that runs across the end of an epoch continues with the next epoch's order.
  const std::int64_t w = ds.train_windows(), seq = 12;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(4 * seq)), labels(ids.size());
  ds.train_batch(w - 2, 4, ids, labels);
  CHECK(example_of_row(std::span(ids).subspan(0)) == orders[0][static_cast<std::size_t>(w - 2)]);
  CHECK(example_of_row(std::span(ids).subspan(static_cast<std::size_t>(seq))) == orders[0][static_cast<std::size_t>(w - 1)]);
  CHECK(example_of_row(std::span(ids).subspan(static_cast<std::size_t>(2 * seq))) == orders[1][0]);
  CHECK(example_of_row(std::span(ids).subspan(static_cast<std::size_t>(3 * seq))) == orders[1][1]);
  const auto pos = ds.position(w + 3);
  CHECK(pos.windows_per_epoch == w);
  CHECK(pos.epoch == 1);
  CHECK(pos.slot == 3);
}

TEST_CASE("examples: a separate validation file of examples; plain and example files do not mix") {
  TempDir dir;
  const auto xs = awkward_examples();
  const auto train = write_examples(dir.path / "train.bin", xs);
  const std::vector<Example> vxs{make_example(20, 3, [](int t) { return t == 2; }),
                                 make_example(21, 11, [](int t) { return t >= 9; }),  // dropped at seq 8
                                 make_example(22, 6, [](int t) { return t >= 1; })};
  const auto val = write_examples(dir.path / "val.bin", vxs);
  const auto o = example_options();
  TokenDataset ds(TokenSource::open(train), o, TokenSource::open(val));
  // Every example of the training file trains now: 0, 1, 3, 4, 6, 8, 9.
  CHECK(ds.train_examples().examples == 10);
  CHECK(ds.train_windows() == 7);
  CHECK(ds.train_tokens() == 70);
  CHECK(ds.val_examples().examples == 3);
  CHECK(ds.val_examples().dropped == 1);
  CHECK(ds.val_examples().truncated == 0);  // (the long one is dropped: not counted as cut)
  CHECK(ds.val_examples().labels == 1 + 5);
  CHECK(ds.val_windows() == 2);
  CHECK(ds.val_tokens() == 20);
  std::vector<std::int32_t> ids(2 * 8), labels(ids.size());
  ds.val_batch(0, 2, ids, labels);
  CHECK(example_of_row(std::span(ids).subspan(0)) == 20);
  CHECK(example_of_row(std::span(ids).subspan(8)) == 22);
  check_row(vxs[0], std::span(ids).subspan(0, 8), std::span(labels).subspan(0, 8), 8, o.vocab_size, false);
  check_row(vxs[2], std::span(ids).subspan(8, 8), std::span(labels).subspan(8, 8), 8, o.vocab_size, false);
  CHECK(labels[1] == 502);
  CHECK(labels[0] == kIgnoreIndex);
  std::set<int> seen;
  for (const int e : epoch_examples(ds, 0)) seen.insert(e);
  CHECK(seen == std::set<int>{0, 1, 3, 4, 6, 8, 9});

  // Examples with a plain validation file, and a plain file with examples for validation: refused.
  const auto plain = write_tokens(dir.path / "plain.bin", random_u16(500, 90, 2));
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(train), o, TokenSource::open(plain)),
                       doctest::Contains("is not examples like"), Error);
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(train), o, TokenSource::open(plain)),
                       doctest::Contains("plain.bin.idx"), Error);
  DatasetOptions po;
  po.vocab_size = 1000;
  po.seq_len = 8;
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(plain), po, TokenSource::open(val)),
                       doctest::Contains("is examples but"), Error);
  // A validation file none of whose examples has a label within the window.
  const auto none = write_examples(dir.path / "none.bin", {make_example(30, 12, [](int t) { return t == 11; })});
  CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(train), o, TokenSource::open(none)),
                       doctest::Contains("none of its 1 examples has a trained token within the first 8 + 1 tokens"), Error);
}

TEST_CASE("examples: inconsistent sidecars are refused with a clear message") {
  TempDir dir;
  const auto xs = awkward_examples();
  const auto good = write_examples(dir.path / "good.bin", xs);
  std::vector<std::uint16_t> ids;
  std::vector<std::uint8_t> mask;
  for (const auto& x : xs) {
    ids.insert(ids.end(), x.ids.begin(), x.ids.end());
    mask.insert(mask.end(), x.mask.begin(), x.mask.end());
  }
  REQUIRE(ids.size() == 70);
  const auto fresh = [&](const std::string& name) {
    const auto p = write_tokens(dir.path / name, ids);
    write_bytes(example_mask_path(p), mask.data(), mask.size());
    write_index(p, {0, 6, 18, 70});
    CHECK(TokenSource::open(p).examples() == 3);  // consistent as written
    return p;
  };

  // A mask without an index, and an index without a mask.
  {
    const auto p = fresh("no-idx.bin");
    fs::remove(example_index_path(p));
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("no-idx.bin.mask' is there but not"), Error);
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("no-idx.bin.idx"), Error);
  }
  {
    const auto p = fresh("no-mask.bin");
    fs::remove(example_mask_path(p));
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("no-mask.bin.idx' is there but not"), Error);
  }
  // A mask of another size than the tokens.
  {
    const auto p = fresh("short-mask.bin");
    write_bytes(example_mask_path(p), mask.data(), mask.size() - 1);
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("has 69 bytes for 70 tokens"), Error);
    write_bytes(example_mask_path(p), std::vector<std::uint8_t>(71, 1).data(), 71);
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("has 71 bytes for 70 tokens"), Error);
  }
  // uint32 tokens: the mask counts tokens, not bytes.
  {
    const auto p = write_tokens(dir.path / "wide-mask.bin", std::vector<std::uint32_t>(ids.begin(), ids.end()));
    write_bytes(example_mask_path(p), std::vector<std::uint8_t>(140, 1).data(), 140);  // one per byte of uint16
    write_index(p, {0, 70});
    CHECK_THROWS_WITH_AS(TokenSource::open(p, TokenFormat::u32), doctest::Contains("has 140 bytes for 70 tokens"), Error);
  }
  // Indexes that do not divide the tokens into examples.
  const std::vector<std::pair<std::vector<std::int64_t>, std::string>> bad_indexes{
      {{3, 18, 70}, "entry 0 is 3"},       // not starting at 0
      {{0, 18, 69}, "entry 2 is 69"},      // not ending at the token count
      {{0, 18, 71}, "entry 2 is 71"},      // beyond it
      {{0, 30, 18, 70}, "entry 2 is 18"},  // decreasing
      {{0, 18, 18, 70}, "entry 2 is 18"},  // an empty example
      {{0}, "is not a list of int64 offsets"},
  };
  for (const auto& [index, what] : bad_indexes) {
    CAPTURE(what);
    const auto p = fresh("bad-index.bin");
    write_index(p, index);
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains(what.c_str()), Error);
    if (index.size() > 1) CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("does not divide its 70 tokens into examples"), Error);
  }
  {
    const auto p = fresh("ragged-index.bin");
    const std::int64_t v[2] = {0, 70};
    write_bytes(example_index_path(p), v, 12);  // not a whole number of int64
    CHECK_THROWS_WITH_AS(TokenSource::open(p), doctest::Contains("is not a list of int64 offsets"), Error);
  }
  // Examples that all lose their labels to the window, and too few examples to hold one out.
  {
    const auto p = write_examples(dir.path / "late.bin", {make_example(0, 12, [](int t) { return t == 11; }),
                                                          make_example(1, 12, [](int t) { return t == 10; }),
                                                          make_example(2, 4, [](int t) { return t == 3; })});
    CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(p), example_options()),
                         doctest::Contains("none of its 2 training examples has a trained token within the first 8 + 1 tokens"),
                         Error);
    const auto one = write_examples(dir.path / "one.bin", {xs[0]});
    CHECK_THROWS_WITH_AS(TokenDataset(TokenSource::open(one), example_options()),
                         doctest::Contains("has 1 example: too few for one training and one validation example"), Error);
  }
  // The good file still opens.
  CHECK(TokenSource::open(good).examples() == 10);
}

TEST_CASE("examples: the digest covers the mask and the index") {
  TempDir dir;
  auto xs = awkward_examples();
  const auto a = TokenSource::open(write_examples(dir.path / "a.bin", xs)).digest();
  CHECK(a.size() == 32);
  CHECK(TokenSource::open(write_examples(dir.path / "a2.bin", xs)).digest() == a);  // the same data, the same digest
  // Only the mask changes.
  xs[3].mask[2] = 0;
  const auto b = TokenSource::open(write_examples(dir.path / "b.bin", xs)).digest();
  CHECK(b != a);
  // Only the index changes (the same tokens and mask, examples 0 and 1 joined).
  const auto c_path = write_examples(dir.path / "c.bin", awkward_examples());
  std::vector<std::int64_t> index{0};
  for (std::size_t e = 0; e < xs.size(); ++e)
    if (e != 0) index.push_back(index.back() + static_cast<std::int64_t>(xs[e].ids.size()) + (e == 1 ? 6 : 0));
  REQUIRE(index.back() == 70);
  write_index(c_path, index);
  const auto c = TokenSource::open(c_path);
  CHECK(c.examples() == 9);
  CHECK(c.digest() != a);
  CHECK(c.digest() != b);
  // The tokens alone, without sidecars, differ from the examples.
  fs::remove(example_mask_path(c_path));
  fs::remove(example_index_path(c_path));
  CHECK(TokenSource::open(c_path).digest() != a);
}

TEST_CASE("examples packed: each kept example once per epoch, positions restarting, its labels as in its own window") {
  TempDir dir;
  std::mt19937 rng(11);
  std::vector<Example> xs;
  for (int e = 0; e < 44; ++e) {  // 1..19 tokens; a few with no trained token (dropped)
    const int len = 1 + static_cast<int>(rng() % 19);
    const auto salt = static_cast<int>(rng() % 3);
    xs.push_back(make_example(e, len, [&](int t) { return e % 9 != 4 && (t + salt) % 3 != 0; }));
  }
  for (const std::int64_t seq : {8, 16, 23}) {
    CAPTURE(seq);
    auto o = example_options();
    o.seq_len = seq;
    o.pack = true;
    const auto path = write_examples(dir.path / "pack.bin", xs);
    TokenDataset ds(TokenSource::open(path), o);
    auto u = o;
    u.pack = false;
    TokenDataset one(TokenSource::open(path), u);  // the same examples, one to a window
    REQUIRE(ds.packed());
    CHECK(ds.train_examples().rows == ds.train_windows());
    CHECK(ds.train_windows() < one.train_windows());
    CHECK(one.train_examples().rows == one.train_windows());
    const ExampleStats &p = ds.train_examples(), &q = one.train_examples();
    CHECK(p.labels == q.labels);
    CHECK(p.tokens == q.tokens);
    CHECK(p.dropped == q.dropped);
    // (best fit leaves little room: the rows hold at least the tokens the examples take)
    CHECK(p.rows * seq >= p.tokens - (p.examples - p.dropped));
    CHECK(p.rows * seq < p.tokens - (p.examples - p.dropped) + seq * 3);

    const auto epoch = [&](const TokenDataset& d, std::int64_t which, bool val) {
      const std::int64_t w = val ? d.val_windows() : d.train_windows();
      std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size()), pos(ids.size());
      if (val) d.val_batch(0, w, ids, labels, pos);
      else d.train_batch(which * w, w, ids, labels, pos);
      // every sequence: an example (its first n = min(len, seq + 1) - 1 tokens, the labels of its
      // own window) or the padding of a row's tail
      std::map<int, int> seen;
      std::vector<int> rows_first;
      for (std::int64_t i = 0; i < w * seq;) {
        CAPTURE(i);
        REQUIRE(pos[static_cast<std::size_t>(i)] == 0);
        std::int64_t n = 1;
        while (i + n < w * seq && (i + n) % seq != 0 && pos[static_cast<std::size_t>(i + n)] != 0) {
          REQUIRE(pos[static_cast<std::size_t>(i + n)] == n);
          ++n;
        }
        REQUIRE(((i + n) % seq == 0 || pos[static_cast<std::size_t>(i + n)] == 0));
        if (i % seq == 0) rows_first.push_back(ids[static_cast<std::size_t>(i)]);
        const auto id0 = ids[static_cast<std::size_t>(i)];
        if (id0 < 100) {  // padding: to the end of the row, nothing labelled
          CHECK((i + n) % seq == 0);
          for (std::int64_t t = i; t < i + n; ++t) CHECK(labels[static_cast<std::size_t>(t)] == kIgnoreIndex);
        } else {
          const int e = (id0 - 100) / 20;
          const Example& x = xs[static_cast<std::size_t>(e)];
          const auto len = std::min<std::int64_t>(static_cast<std::int64_t>(x.ids.size()), seq + 1);
          CHECK(n == len - 1);
          for (std::int64_t t = 0; t < n; ++t) {
            const auto k = static_cast<std::size_t>(t);
            CHECK(ids[static_cast<std::size_t>(i + t)] == x.ids[k]);
            CHECK(labels[static_cast<std::size_t>(i + t)] == (x.mask[k + 1] ? x.ids[k + 1] : kIgnoreIndex));
          }
          ++seen[e];
        }
        i += n;
      }
      return std::pair{seen, rows_first};
    };
    const auto [seen0, rows0] = epoch(ds, 0, false);
    const auto [seen1, rows1] = epoch(ds, 1, false);
    CHECK(static_cast<std::int64_t>(seen0.size()) == p.examples - p.dropped);
    for (const auto& [e, k] : seen0) CHECK(k == 1);
    CHECK(seen1 == seen0);    // the same rows every epoch ...
    CHECK(rows1 != rows0);    // ... in another order
    const auto [vseen, vrows] = epoch(ds, 0, true);
    CHECK(static_cast<std::int64_t>(vseen.size()) == ds.val_examples().examples - ds.val_examples().dropped);
    // reproducible: the same seed packs the same rows
    TokenDataset again(TokenSource::open(path), o);
    CHECK(epoch(again, 0, false).second == rows0);
  }
  // Packed batches need a positions buffer.
  auto o = example_options();
  o.pack = true;
  TokenDataset ds(TokenSource::open(write_examples(dir.path / "p2.bin", xs)), o);
  std::vector<std::int32_t> ids(8), labels(8);
  CHECK_THROWS_WITH_AS(ds.train_batch(0, 1, ids, labels), doctest::Contains("needs a buffer for the positions"), Error);
}

// Preference pairs: FILE.pairs beside examples (megatrain-tokenize writes it); examples 2i and
// 2i + 1 are a pair, kept or dropped whole, shuffled whole, split between pairs.
TEST_CASE("pairs: kept and dropped whole, shuffled whole, split between pairs, refused where not pairs") {
  TempDir dir;
  // 12 pairs for seq = 8; pair 3's rejected answer lies beyond the window (pair 3 is dropped),
  // pair 5's chosen has no trained token at all (dropped); the others kept.
  std::vector<Example> xs;
  for (int p = 0; p < 12; ++p)
    for (int k = 0; k < 2; ++k) {
      const int e = 2 * p + k, len = 3 + (e * 5) % 7;
      if (p == 3 && k == 1) xs.push_back(make_example(e, 14, [](int t) { return t >= 11; }));
      else if (p == 5 && k == 0) xs.push_back(make_example(e, len, [](int) { return false; }));
      else xs.push_back(make_example(e, len, [](int t) { return t >= 2; }));
    }
  const auto path = write_examples(dir.path / "pairs.bin", xs);
  // (read as plain examples first: then the digest differs from the pairs')
  const std::string plain_digest = TokenSource::open(path).digest();
  write_bytes(example_pairs_path(path), example_pairs_note(12).data(), example_pairs_note(12).size());
  const TokenSource src = TokenSource::open(path);
  REQUIRE(src.has_pairs());
  CHECK(src.digest() != plain_digest);

  DatasetOptions o = example_options();
  o.val_fraction = 0.25;  // 3 of 12 pairs: the split falls between examples 17 and 18
  const TokenDataset ds(src, o);
  REQUIRE(ds.pairs());
  CHECK(ds.train_examples().examples == 18);
  CHECK(ds.train_examples().dropped == 4);  // pairs 3 and 5, whole
  CHECK(ds.train_windows() == 14);
  CHECK(ds.val_windows() == 6);
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    const std::vector<int> order = epoch_examples(ds, epoch);
    std::set<int> seen;
    for (std::size_t r = 0; r < order.size(); r += 2) {
      CAPTURE(epoch);
      CAPTURE(r);
      CHECK(order[r] % 2 == 0);           // a chosen answer first
      CHECK(order[r + 1] == order[r] + 1);  // then its own rejected one
      CHECK(order[r] / 2 != 3);
      CHECK(order[r] / 2 != 5);
      seen.insert(order[r]);
    }
    CHECK(seen.size() == 7);
    // train_window(k) names the window that slot k reads; train_rows reads windows in file order
    const std::int64_t seq = ds.seq_len(), w = ds.train_windows();
    std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size());
    ds.train_rows(0, w, ids, labels);
    for (std::int64_t k = 0; k < w; ++k) {
      const std::int64_t win = ds.train_window(epoch * w + k);
      CHECK(example_of_row(std::span(ids).subspan(static_cast<std::size_t>(win * seq))) == order[static_cast<std::size_t>(k)]);
    }
  }
  // a different order each epoch (pairs still whole)
  CHECK(epoch_examples(ds, 0) != epoch_examples(ds, 1));

  // validation must be pairs too; a note that does not match is refused
  const auto plain = write_examples(dir.path / "plain.bin", xs);
  CHECK_THROWS_WITH_AS(TokenDataset(src, o, TokenSource::open(plain)), doctest::Contains("does not hold preference pairs"), Error);
  write_bytes(example_pairs_path(plain), example_pairs_note(11).data(), example_pairs_note(11).size());
  CHECK_THROWS_WITH_AS(TokenSource::open(plain), doctest::Contains("says 11 pairs, but the file holds 24 examples"), Error);
  write_bytes(example_pairs_path(plain), "{}", 2);
  CHECK_THROWS_WITH_AS(TokenSource::open(plain), doctest::Contains("is not megatrain-tokenize's note of preference pairs"), Error);
}

TEST_CASE("pairs packed: whole pairs a row, chosen then rejected; pairs too long for a row left out and counted") {
  TempDir dir;
  std::mt19937 rng(23);
  std::vector<Example> xs;  // 30 pairs of 2..17-token answers, a prompt of 1..3 tokens untrained
  std::vector<int> prompts;
  for (int e = 0; e < 60; ++e) {
    const int len = 2 + static_cast<int>(rng() % 16), prompt = 1 + static_cast<int>(rng() % 3);
    xs.push_back(make_example(e, len, [&](int t) { return t >= prompt; }));
    prompts.push_back(prompt);
  }
  const auto path = write_examples(dir.path / "pairs.bin", xs);
  write_bytes(example_pairs_path(path), example_pairs_note(30).data(), example_pairs_note(30).size());
  for (const std::int64_t seq : {16, 29}) {
    CAPTURE(seq);
    DatasetOptions o = example_options();
    o.seq_len = seq;
    o.pack = true;
    o.vocab_size = 2000;   // (ids up to 100 + 20 x 59 + 17)
    o.val_fraction = 0.2;  // (6 pairs)
    const TokenDataset ds(TokenSource::open(path), o);
    REQUIRE(ds.packed());
    REQUIRE(ds.pairs());
    // which training pairs are kept (both answers with a trained label in their windows) and fit
    // one row together (each answer takes min(len, seq + 1) - 1 tokens)
    std::int64_t fits = 0, apart = 0, unlabelled = 0;
    const auto takes = [&](int e) { return std::min<std::int64_t>(static_cast<std::int64_t>(xs[static_cast<std::size_t>(e)].ids.size()), seq + 1) - 1; };
    const auto labelled = [&](int e) { return prompts[static_cast<std::size_t>(e)] <= takes(e); };
    for (int p = 0; p < 24; ++p) {
      if (!labelled(2 * p) || !labelled(2 * p + 1)) ++unlabelled;
      else (takes(2 * p) + takes(2 * p + 1) <= seq ? fits : apart) += 1;
    }
    CHECK(ds.train_examples().split == apart);
    CHECK(ds.train_examples().dropped == 2 * (apart + unlabelled));
    CHECK(apart > 0);
    CHECK(unlabelled > 0);
    // every row: whole pairs, each chosen then its own rejected, then padding; each fitting pair
    // once an epoch; train_rows (file order) gives the windows train_window() names
    const std::int64_t w = ds.train_windows();
    for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(w * seq)), labels(ids.size()), pos(ids.size());
      ds.train_batch(epoch * w, w, ids, labels, pos);
      std::vector<std::int32_t> fids(ids.size()), flabels(ids.size()), fpos(ids.size());
      ds.train_rows(0, w, fids, flabels, fpos);
      std::set<int> seen;
      for (std::int64_t r = 0; r < w; ++r) {
        CAPTURE(r);
        std::vector<int> answers;
        for (std::int64_t t = r * seq; t < (r + 1) * seq; ++t)
          if (pos[static_cast<std::size_t>(t)] == 0 && ids[static_cast<std::size_t>(t)] >= 100)
            answers.push_back((ids[static_cast<std::size_t>(t)] - 100) / 20);
        REQUIRE(answers.size() % 2 == 0);
        CHECK(static_cast<std::int64_t>(answers.size()) == ds.window_examples(ds.train_window(epoch * w + r)));
        for (std::size_t k = 0; k < answers.size(); k += 2) {
          CHECK(answers[k] % 2 == 0);
          CHECK(answers[k + 1] == answers[k] + 1);
          CHECK(takes(answers[k]) + takes(answers[k + 1]) <= seq);
          CHECK(seen.insert(answers[k]).second);
        }
        const auto row = static_cast<std::size_t>(ds.train_window(epoch * w + r) * seq);
        CHECK(std::equal(ids.begin() + static_cast<std::ptrdiff_t>(r * seq), ids.begin() + static_cast<std::ptrdiff_t>((r + 1) * seq),
                         fids.begin() + static_cast<std::ptrdiff_t>(row)));
      }
      CHECK(static_cast<std::int64_t>(seen.size()) == fits);
    }
    std::int64_t val_answers = 0;
    for (std::int64_t v = 0; v < ds.val_windows(); ++v) val_answers += ds.window_examples(v, true);
    CHECK(val_answers == ds.val_examples().examples - ds.val_examples().dropped);
    CHECK(val_answers % 2 == 0);
  }
}
