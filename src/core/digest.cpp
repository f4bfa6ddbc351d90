// XXH3-128 through xxHash's header (inlined: no run-time library to ship).
#include "megatrain/core/digest.hpp"

#include <fcntl.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "megatrain/core/error.hpp"

namespace megatrain {

namespace {
Digest128 canonical(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  Digest128 d;
  std::memcpy(d.bytes.data(), c.digest, 16);
  return d;
}
}  // namespace

std::string Digest128::hex() const {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(32, '0');
  for (std::size_t i = 0; i < 16; ++i) {
    s[2 * i] = kHex[bytes[i] >> 4];
    s[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return s;
}

std::optional<Digest128> Digest128::from_hex(std::string_view text) {
  if (text.size() != 32) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Digest128 d;
  for (std::size_t i = 0; i < 16; ++i) {
    const int hi = nibble(text[2 * i]), lo = nibble(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    d.bytes[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return d;
}

struct Hasher::State {
  XXH3_state_t s;
};

Hasher::Hasher() : state_(std::make_unique<State>()) { XXH3_128bits_reset(&state_->s); }
Hasher::~Hasher() = default;
Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;

void Hasher::update(std::span<const std::byte> bytes) {
  if (bytes.empty()) return;
  XXH3_128bits_update(&state_->s, bytes.data(), bytes.size());
  size_ += bytes.size();
}

Digest128 Hasher::digest() const { return canonical(XXH3_128bits_digest(&state_->s)); }

Digest128 digest_of(std::span<const std::byte> bytes) { return canonical(XXH3_128bits(bytes.data(), bytes.size())); }

Digest128 digest_file(const std::filesystem::path& path, std::uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "cannot open '{}': {}", path.string(), std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  Hasher h;
  std::vector<std::byte> buf(std::size_t{8} << 20);
  for (;;) {
    const ::ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      MT_FAIL("cannot read '{}': {}", path.string(), std::strerror(err));
    }
    if (n == 0) break;
    h.update(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(n)));
  }
  ::close(fd);
  if (size) *size = h.size();
  return h.digest();
}

}  // namespace megatrain
