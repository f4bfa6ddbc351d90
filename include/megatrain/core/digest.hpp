// Content digests: XXH3-128 (xxHash), the checksum of every file megatrain's checkpoints write.
//
// XXH3 hashes at memory speed (tens of GB/s per core), so checking a 90 GB train state costs
// what reading it costs. A digest prints as 32 hex digits in xxHash's canonical (big-endian)
// order: the format `xxhsum -H2` writes and checks, so a user can verify a checkpoint's files
// with that tool. Not a cryptographic hash: it detects corruption (a truncated file, a flipped
// bit), not tampering.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace megatrain {

/// A 128-bit digest in canonical byte order.
struct Digest128 {
  std::array<std::uint8_t, 16> bytes{};
  /// 32 lowercase hex digits (xxhsum -H2's spelling).
  std::string hex() const;
  /// Parses 32 hex digits; nullopt for anything else.
  static std::optional<Digest128> from_hex(std::string_view text);
  friend bool operator==(const Digest128&, const Digest128&) = default;
};

/// Incremental XXH3-128 over a stream of bytes.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(Hasher&&) noexcept;
  Hasher& operator=(Hasher&&) noexcept;
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  void update(std::span<const std::byte> bytes);
  /// The digest of everything so far (the hasher may go on).
  Digest128 digest() const;
  /// Bytes hashed so far.
  std::uint64_t size() const { return size_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::uint64_t size_ = 0;
};

/// The digest of `bytes` in one call.
Digest128 digest_of(std::span<const std::byte> bytes);

/// The digest of a whole file, read sequentially in large blocks; `size` (if given) receives its
/// length. Throws megatrain::Error naming the file when it cannot be read.
Digest128 digest_file(const std::filesystem::path& path, std::uint64_t* size = nullptr);

}  // namespace megatrain
