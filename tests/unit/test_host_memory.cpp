#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/store/host_param_store.hpp"

#if MEGATRAIN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace megatrain;

namespace {
// Sets (or, with nullptr, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Collects the warnings sent through log_warning for one scope.
struct WarningLog {
  std::vector<std::string> warnings;
  LogSink old;
  WarningLog()
      : old(set_log_sink([this](LogLevel l, std::string_view m) {
          if (l == LogLevel::warning) warnings.emplace_back(m);
        })) {}
  ~WarningLog() { set_log_sink(old); }
};

// Writes a pattern over every byte of the buffer and reads it back.
bool fully_usable(const HostBuffer& b) {
  auto* p = static_cast<unsigned char*>(b.data());
  for (std::size_t i = 0; i < b.size(); ++i) p[i] = static_cast<unsigned char>(i * 31 + 7);
  for (std::size_t i = 0; i < b.size(); ++i)
    if (p[i] != static_cast<unsigned char>(i * 31 + 7)) return false;
  return true;
}

std::size_t host_pages_of(std::size_t bytes) { return (bytes + host_page_size() - 1) / host_page_size() * host_page_size(); }

std::vector<UnitSpec> small_units() {
  return {{"a", {ParamSpec::matrix("a.w", Shape{37, 29}), ParamSpec::norm("a.norm", 29)}},
          {"b", {ParamSpec::matrix("b.w", Shape{101, 13})}}};
}
}  // namespace

TEST_CASE("HostBuffer: page-aligned, zeroed, movable, both pinning modes") {
  for (Pinning p : {Pinning::never, Pinning::automatic}) {
    WarningLog log;
    HostBuffer b = HostBuffer::allocate(10000, p);
    REQUIRE(b);
    CHECK(b.size() == 10000);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 4096 == 0);
    auto s = b.as<std::uint32_t>(0, 2500);
    for (auto x : s) REQUIRE(x == 0);
    s[2499] = 7;
    if (p == Pinning::never) {
      CHECK(!b.pinned());
      CHECK(log.warnings.empty());
    }
    const bool was_pinned = b.pinned();
    HostBuffer moved = std::move(b);
    CHECK(!b);
    CHECK(!b.pinned());
    CHECK(moved.pinned() == was_pinned);
    CHECK(moved.as<std::uint32_t>(2499, 1)[0] == 7);
    CHECK_THROWS_AS(moved.as<std::uint32_t>(2499, 2), Error);
  }
  CHECK(!HostBuffer::allocate(0));
}

TEST_CASE("HostBuffer::allocate_shared: one memory for every opener, counted in shares, and only the creator's file opens") {
  const std::size_t before = host_buffer_bytes();
  {
    HostBuffer made = HostBuffer::allocate_shared(10000, 3, nullptr, Pinning::never);
    REQUIRE(made);
    const SharedHostHandle h = made.shared_handle();
    HostBuffer opened = HostBuffer::allocate_shared(10000, 3, &h, Pinning::never);  // (as another process would)
    REQUIRE(opened);
    CHECK(opened.data() != made.data());  // (two mappings of the same pages)
    CHECK_THROWS_AS((void)opened.shared_handle(), Error);  // (the creator alone hands it on)
    auto a = made.as<std::uint32_t>(0, 2500), b = opened.as<std::uint32_t>(0, 2500);
    for (auto x : b) REQUIRE(x == 0);
    a[17] = 0xdeadbeef;
    b[2499] = 42;
    CHECK(b[17] == 0xdeadbeef);
    CHECK(a[2499] == 42);
    // Each counts a third of the whole pages: 12288 bytes mapped, 4096 each.
    CHECK(host_buffer_bytes() - before == 2 * ((host_pages_of(10000) + 2) / 3));
    // A handle whose file is not the creator's (another pid namespace's process at that pid, say)
    // is refused, as is one whose file is shorter than asked.
    SharedHostHandle other = h;
    other.ino += 1;
    try {
      (void)HostBuffer::allocate_shared(10000, 3, &other, Pinning::never);
      FAIL("a handle naming another file was accepted");
    } catch (const Error& e) {
      CHECK_MESSAGE(e.reason().find("is not the host memory that process") != std::string::npos, e.reason());
    }
    CHECK_THROWS_AS((void)HostBuffer::allocate_shared(10 * 4096, 3, &h, Pinning::never), Error);
  }
  CHECK(host_buffer_bytes() == before);  // (released: mappings, shares and descriptors)
}

TEST_CASE("HostBuffer: a failed pin falls back to a working pageable buffer with one warning") {
  // MEGATRAIN_FAULTS=fail@pin makes the pinning attempt fail as cudaHostRegister does under a low
  // locked-memory limit, in every build.
  ScopedEnv force("MEGATRAIN_FAULTS", "fail@pin");
  WarningLog log;
  const std::size_t bytes = (3u << 20) + 12345;  // several pages, not a whole number of them
  HostBuffer b = HostBuffer::allocate(bytes, Pinning::automatic);
  REQUIRE(b);
  CHECK(!b.pinned());
  CHECK(b.size() == bytes);
  CHECK(fully_usable(b));
  REQUIRE(log.warnings.size() == 1);
  CHECK(log.warnings[0].find("pinning 3.0 MiB of host memory failed") != std::string::npos);
  CHECK(log.warnings[0].find("pageable") != std::string::npos);
  // Pinning::never does not try, so it does not warn.
  HostBuffer n = HostBuffer::allocate(bytes, Pinning::never);
  CHECK(!n.pinned());
  CHECK(log.warnings.size() == 1);

  // A HostParamStore built meanwhile is pageable, works, and says so.
  StoreOptions o;
  o.resident_gradients = true;  // three buffers it pins by default: bf16 copy, gradients, ring (at its first use)
  HostParamStore<float> s(small_units(), o);
  CHECK(!s.pinned());
  CHECK(log.warnings.size() == 1 + 2);  // one per buffer that failed to pin
  (void)s.grad_slot(0);
  CHECK(log.warnings.size() == 1 + 3);
  const auto& u = s.unit(1);
  for (std::size_t i = 0; i < u.master().size(); ++i) REQUIRE(u.compute()[i] == bf16(u.master()[i]));
  auto slot = s.grad_slot(1);
  for (auto& x : slot) x = 2.0f;
  CHECK(s.grad_slot(1).back() == 2.0f);
}

TEST_CASE("HostBuffer: Pinning::automatic pins where a GPU is present") {
  ScopedEnv no_force("MEGATRAIN_FAULTS", nullptr);
  WarningLog log;
  HostBuffer b = HostBuffer::allocate((1u << 20) + 1, Pinning::automatic);
  REQUIRE(b);
  CHECK(fully_usable(b));
  // Either way, no warning: no GPU is not a failure.
  CHECK(log.warnings.empty());
  if (!cuda_device_present()) {
    MESSAGE("no usable GPU (or a CPU-only build): the pinned path is not checked here, only that the buffer is "
            "pageable without a warning");
    CHECK(!b.pinned());
    return;
  }
  // A GPU is present: the buffer must be pinned (no fallback accepted), and CUDA must agree.
  CHECK(b.pinned());
#if MEGATRAIN_HAS_CUDA
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, b.data()) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeHost);
#endif
  HostParamStore<float> s(small_units(), StoreOptions{});
  (void)s.grad_slot(0);  // (the gradient ring is allocated at its first use)
  CHECK(s.pinned());
  CHECK(log.warnings.empty());
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
  // beyond 2^63 bytes: refused (the conversion to a size would be undefined)
  for (const char* big : {"1e300", "20000000000T", "9223372036854775808"}) {
    CAPTURE(big);
    std::string e;
    try {
      (void)parse_byte_size(big);
    } catch (const Error& err) {
      e = err.what();
    }
    CHECK(e.find(big) != std::string::npos);
    CHECK(e.find("beyond any machine") != std::string::npos);
  }
  CHECK(parse_byte_size("8388607T") == (8388607ull << 40));
  CHECK(format_bytes(10) == "10 B");
  CHECK(format_bytes(3ull << 30) == "3.00 GiB");
}

TEST_CASE("available_host_memory: positive, and overridable") {
  CHECK(available_host_memory() > (16u << 20));
  setenv("MEGATRAIN_HOST_MEMORY", "3G", 1);
  CHECK(available_host_memory() == 3ull << 30);
  unsetenv("MEGATRAIN_HOST_MEMORY");
}
