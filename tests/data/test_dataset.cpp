// Token datasets: formats, windows, the seeded shuffle, the validation split, and every kind of
// bad data refused with a clear message before training could start.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

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
