// TensorBoard event files (io/tensorboard.hpp), read back by an independent decoder written here
// from the format's description: the record framing with bit-by-bit CRC-32C, and protobuf's wire
// format (varints, fixed 32 and 64 bits, length-delimited fields) into Event and Summary fields.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io_test_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/io/tensorboard.hpp"

using namespace megatrain;
using namespace megatrain::io;
namespace fs = std::filesystem;

namespace {

std::uint32_t crc_bitwise(const std::string& s) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
std::uint32_t masked(std::uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

template <class T>
T read_le(const std::string& s, std::size_t at) {
  REQUIRE(at + sizeof(T) <= s.size());
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

/// The records of an events file, their CRCs checked.
std::vector<std::string> records(const std::string& file) {
  std::vector<std::string> out;
  for (std::size_t at = 0; at < file.size();) {
    const auto n = read_le<std::uint64_t>(file, at);
    CHECK(read_le<std::uint32_t>(file, at + 8) == masked(crc_bitwise(file.substr(at, 8))));
    const std::string data = file.substr(at + 12, n);
    CHECK(read_le<std::uint32_t>(file, at + 12 + n) == masked(crc_bitwise(data)));
    out.push_back(data);
    at += 16 + n;
  }
  return out;
}

/// A protobuf message's fields: number -> its values (varints as integers, fixed as raw bytes,
/// length-delimited as bytes).
struct Field {
  int wire = 0;
  std::uint64_t integer = 0;
  std::string bytes;
};
std::multimap<int, Field> fields(const std::string& m) {
  std::multimap<int, Field> out;
  std::size_t at = 0;
  const auto varint = [&] {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      REQUIRE(at < m.size());
      const auto b = static_cast<unsigned char>(m[at++]);
      v |= static_cast<std::uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (at < m.size()) {
    const std::uint64_t key = varint();
    Field f;
    f.wire = static_cast<int>(key & 7);
    switch (f.wire) {
      case 0: f.integer = varint(); break;
      case 1: f.bytes = m.substr(at, 8); at += 8; break;
      case 5: f.bytes = m.substr(at, 4); at += 4; break;
      case 2: {
        const auto n = varint();
        f.bytes = m.substr(at, n);
        at += n;
        break;
      }
      default: FAIL("wire type " << f.wire);
    }
    out.emplace(static_cast<int>(key >> 3), f);
  }
  CHECK(at == m.size());
  return out;
}

}  // namespace

TEST_CASE("CRC-32C: the check value, and the masked form") {
  const std::string nine = "123456789";
  CHECK(crc32c(std::as_bytes(std::span<const char>(nine.data(), nine.size()))) == 0xE3069283u);
  std::mt19937 g(5);
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(g());
    const auto b = std::as_bytes(std::span<const char>(s.data(), s.size()));
    CHECK(crc32c(b) == crc_bitwise(s));
    CHECK(masked_crc32c(b) == masked(crc_bitwise(s)));
  }
}

TEST_CASE("an events file: the file version first, then each step's scalars, as TensorBoard reads them") {
  megatrain::test::TempDir dir("megatrain-tb");
  std::string path;
  {
    TensorBoardWriter w(dir / "tb");
    path = w.path().string();
    CHECK(w.path().filename().string().starts_with("events.out.tfevents."));
    const std::vector<std::pair<std::string, float>> s1{{"train/loss", 5.25f}, {"train/lr", 3e-4f}};
    const std::vector<std::pair<std::string, float>> s2{{"train/loss", 4.75f}, {"val/loss", 4.9f}};
    CHECK(w.scalars(1, s1).empty());
    CHECK(w.scalars(300000, s2).empty());  // (a step past one varint byte)
  }
  const auto recs = records(megatrain::test::read_file(path));
  REQUIRE(recs.size() == 3);
  const auto first = fields(recs[0]);
  REQUIRE(first.count(3) == 1);
  CHECK(first.find(3)->second.bytes == "brain.Event:2");
  CHECK(first.find(1)->second.wire == 1);  // (wall_time: a double)
  const double wall = read_le<double>(first.find(1)->second.bytes, 0);
  CHECK(wall > 1.7e9);
  struct Want {
    std::int64_t step;
    std::vector<std::pair<std::string, float>> values;
  };
  const std::vector<Want> want{{1, {{"train/loss", 5.25f}, {"train/lr", 3e-4f}}}, {300000, {{"train/loss", 4.75f}, {"val/loss", 4.9f}}}};
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    const auto e = fields(recs[i + 1]);
    REQUIRE(e.count(2) == 1);
    CHECK(static_cast<std::int64_t>(e.find(2)->second.integer) == want[i].step);
    REQUIRE(e.count(5) == 1);
    const auto summary = fields(e.find(5)->second.bytes);
    std::vector<std::pair<std::string, float>> got;
    for (auto it = summary.lower_bound(1); it != summary.upper_bound(1); ++it) {
      const auto v = fields(it->second.bytes);
      REQUIRE(v.count(1) == 1);
      REQUIRE(v.count(2) == 1);
      CHECK(v.find(2)->second.wire == 5);
      got.emplace_back(v.find(1)->second.bytes, read_le<float>(v.find(2)->second.bytes, 0));
    }
    CHECK(got == want[i].values);
  }
  // a second writer (a resumed run): a file of its own beside the first
  megatrain::test::TempDir other("megatrain-tb");
  TensorBoardWriter a(other / "tb");
  CHECK(fs::exists(a.path()));
  CHECK_ERROR_MENTIONS(TensorBoardWriter(fs::path("/proc/no/such/place")), "--tensorboard '/proc/no/such/place'");
}

TEST_CASE("texts (the samples): a string tensor for TensorBoard's text plugin, one value a tag") {
  megatrain::test::TempDir dir("megatrain-tb");
  std::string path;
  const std::vector<std::pair<std::string, std::string>> texts{{"samples/0", "**prompt:** 2 + 2\n\n**completion:** 4"},
                                                               {"samples/1", std::string(300, 'x') + " \xc3\xa9"}};
  {
    TensorBoardWriter w(dir / "tb");
    path = w.path().string();
    CHECK(w.texts(7, texts).empty());
  }
  const auto recs = records(megatrain::test::read_file(path));
  REQUIRE(recs.size() == 2);
  const auto e = fields(recs[1]);
  CHECK(static_cast<std::int64_t>(e.find(2)->second.integer) == 7);
  const auto summary = fields(e.find(5)->second.bytes);
  REQUIRE(summary.count(1) == texts.size());
  std::size_t k = 0;
  for (auto it = summary.lower_bound(1); it != summary.upper_bound(1); ++it, ++k) {
    CAPTURE(k);
    const auto v = fields(it->second.bytes);
    CHECK(v.find(1)->second.bytes == texts[k].first);
    CHECK(v.count(2) == 0);  // (no simple_value)
    REQUIRE(v.count(9) == 1);
    const auto plugin = fields(fields(v.find(9)->second.bytes).find(1)->second.bytes);
    CHECK(plugin.find(1)->second.bytes == "text");
    REQUIRE(v.count(8) == 1);
    const auto tensor = fields(v.find(8)->second.bytes);
    CHECK(tensor.find(1)->second.integer == 7);  // DT_STRING
    REQUIRE(tensor.count(2) == 1);
    CHECK(tensor.find(2)->second.bytes.empty());  // a scalar
    REQUIRE(tensor.count(8) == 1);
    CHECK(tensor.find(8)->second.bytes == texts[k].second);
  }
}
