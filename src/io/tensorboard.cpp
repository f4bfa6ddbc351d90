// TensorBoard event files (see include/megatrain/io/tensorboard.hpp).
#include "megatrain/io/tensorboard.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "megatrain/core/error.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;

namespace {

constexpr std::array<std::uint32_t, 256> crc32c_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // (the reflected Castagnoli polynomial)
    t[i] = c;
  }
  return t;
}
constexpr auto kCrcTable = crc32c_table();

void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <class T>
void little_endian(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // (x86-64 and aarch64 are little-endian)
  out.append(b, sizeof(T));
}
/// A length-delimited field.
void bytes_field(std::string& out, int field, std::string_view bytes) {
  varint(out, static_cast<std::uint64_t>(field) << 3 | 2);
  varint(out, bytes.size());
  out.append(bytes);
}
/// Event's wall_time (1) and step (2).
std::string event_head(double wall_time, std::int64_t step) {
  std::string e;
  varint(e, 1 << 3 | 1);
  little_endian(e, wall_time);
  if (step != 0) {
    varint(e, 2 << 3 | 0);
    varint(e, static_cast<std::uint64_t>(step));
  }
  return e;
}
double now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

}  // namespace

std::uint32_t crc32c(std::span<const std::byte> bytes) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const std::byte b : bytes) c = kCrcTable[(c ^ static_cast<std::uint32_t>(b)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(std::span<const std::byte> bytes) {
  const std::uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_scalar_event(double wall_time, std::int64_t step, std::span<const std::pair<std::string, float>> scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    bytes_field(v, 1, tag);
    varint(v, 2 << 3 | 5);
    little_endian(v, value);
    bytes_field(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

std::string encode_text_event(double wall_time, std::int64_t step, std::span<const std::pair<std::string, std::string>> texts) {
  std::string plugin, metadata, tensor, summary;
  bytes_field(plugin, 1, "text");  // PluginData.plugin_name
  bytes_field(metadata, 1, plugin);  // SummaryMetadata.plugin_data
  for (const auto& [tag, text] : texts) {
    tensor.clear();
    varint(tensor, 1 << 3 | 0);  // TensorProto.dtype: DT_STRING
    varint(tensor, 7);
    bytes_field(tensor, 2, "");  // tensor_shape: a scalar
    bytes_field(tensor, 8, text);  // string_val
    std::string v;
    bytes_field(v, 1, tag);
    bytes_field(v, 8, tensor);  // Summary.Value.tensor
    bytes_field(v, 9, metadata);  // Summary.Value.metadata
    bytes_field(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

std::string encode_file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string frame_record(std::string_view data) {
  std::string r;
  const std::uint64_t n = data.size();
  little_endian(r, n);
  little_endian(r, masked_crc32c(std::as_bytes(std::span<const char>(r.data(), 8))));
  r.append(data);
  little_endian(r, masked_crc32c(std::as_bytes(std::span<const char>(data.data(), data.size()))));
  return r;
}

TensorBoardWriter::TensorBoardWriter(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MT_CHECK(!ec, "--tensorboard '{}': cannot create the folder: {}", dir.string(), ec.message());
  char host[256] = "host";
  (void)gethostname(host, sizeof(host) - 1);
  const auto seconds = static_cast<long long>(now());
  path_ = dir / fmt::format("events.out.tfevents.{}.{}.{}.megatrain", seconds, host, static_cast<long long>(getpid()));
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  MT_CHECK(fd_ >= 0, "--tensorboard: cannot create '{}': {}", path_.string(), std::strerror(errno));
  const std::string error = append(frame_record(encode_file_version_event(now())));
  MT_CHECK(error.empty(), "--tensorboard: cannot write '{}': {}", path_.string(), error);
}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) { o.fd_ = -1; }
TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}
TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TensorBoardWriter::scalars(std::int64_t step, std::span<const std::pair<std::string, float>> values) {
  return append(frame_record(encode_scalar_event(now(), step, values)));
}

std::string TensorBoardWriter::texts(std::int64_t step, std::span<const std::pair<std::string, std::string>> values) {
  return append(frame_record(encode_text_event(now(), step, values)));
}

std::string TensorBoardWriter::append(const std::string& record) {
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  const ssize_t n = ::write(fd_, record.data(), record.size());
  if (n == static_cast<ssize_t>(record.size())) return {};
  const std::string why = n < 0 ? std::strerror(errno) : fmt::format("{} of {} bytes written", n, record.size());
  if (before >= 0) (void)::ftruncate(fd_, before);  // (whole records only)
  return why;
}

}  // namespace megatrain::io
