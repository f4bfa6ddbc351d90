// Helpers shared by the io tests: a temporary directory removed at scope exit, whole-file read
// and write, a randomly seeded generator (its seed printed), and CHECK_ERROR_MENTIONS.
#pragma once

#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

// Every listed fragment must appear in the megatrain::Error that `expr` throws.
// (The fragments are copied first: callers pass temporaries such as path.string().c_str().)
#define CHECK_ERROR_MENTIONS(expr, ...)                                                    \
  do {                                                                                     \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__})       \
      CHECK_THROWS_WITH_AS(expr, doctest::Contains(part_.c_str()), megatrain::Error);       \
  } while (0)

namespace megatrain::test {

/// One generator per test program, seeded at random; the seed is printed so a failure can be
/// replayed: MEGATRAIN_TEST_SEED=<the seed> runs the program on it again.
inline std::mt19937_64& rng() {
  static std::mt19937_64 gen = [] {
    const char* given = std::getenv("MEGATRAIN_TEST_SEED");
    const std::uint64_t seed = given != nullptr && *given != '\0'
                                   ? std::stoull(given)
                                   : (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    MESSAGE("io test seed: " << seed);
    return std::mt19937_64(seed);
  }();
  return gen;
}

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "megatrain-io") {
    std::string templ = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file(const std::filesystem::path& p, std::string_view s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
  REQUIRE(out.good());
}

}  // namespace megatrain::test
