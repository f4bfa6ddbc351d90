#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"

using namespace megatrain;

TEST_CASE("HostBuffer: page-aligned, zeroed, movable, both pinning modes") {
  for (Pinning p : {Pinning::never, Pinning::automatic}) {
    std::vector<std::string> warnings;
    auto old = set_log_sink([&](LogLevel, std::string_view m) { warnings.emplace_back(m); });
    HostBuffer b = HostBuffer::allocate(10000, p);
    set_log_sink(old);
    REQUIRE(b);
    CHECK(b.size() == 10000);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 4096 == 0);
    auto s = b.as<std::uint32_t>(0, 2500);
    for (auto x : s) REQUIRE(x == 0);
    s[2499] = 7;
    // Pinned exactly when a GPU is present (and only asked for automatically); a failure to
    // pin would have warned.
    if (p == Pinning::never) CHECK(!b.pinned());
    else CHECK((b.pinned() || !warnings.empty() || !cuda_device_present()));
    HostBuffer moved = std::move(b);
    CHECK(!b);
    CHECK(moved.as<std::uint32_t>(2499, 1)[0] == 7);
    CHECK_THROWS_AS(moved.as<std::uint32_t>(2499, 2), Error);
  }
  CHECK(!HostBuffer::allocate(0));
}

TEST_CASE("parse_byte_size and format_bytes") {
  CHECK(parse_byte_size("123") == 123);
  CHECK(parse_byte_size("2K") == 2048);
  CHECK(parse_byte_size("1.5G") == 1536ull * 1024 * 1024);
  CHECK(parse_byte_size("64GiB") == 64ull << 30);
  CHECK(parse_byte_size("1T") == 1ull << 40);
  CHECK_THROWS_AS(parse_byte_size("12Q"), Error);
  CHECK_THROWS_AS(parse_byte_size("lots"), Error);
  CHECK_THROWS_AS(parse_byte_size("-1G"), Error);
  CHECK(format_bytes(10) == "10 B");
  CHECK(format_bytes(3ull << 30) == "3.00 GiB");
}

TEST_CASE("available_host_memory: positive, and overridable") {
  CHECK(available_host_memory() > (16u << 20));
  setenv("MEGATRAIN_HOST_MEMORY", "3G", 1);
  CHECK(available_host_memory() == 3ull << 30);
  unsetenv("MEGATRAIN_HOST_MEMORY");
}
