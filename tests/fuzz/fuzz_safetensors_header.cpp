// libFuzzer target: parse_safetensors_header (and parse_safetensors_index) on arbitrary bytes.
//
// The parser must either return a header that satisfies every invariant it promises, or throw
// megatrain::Error. Anything else (a crash, a sanitizer report, another exception escaping, a
// broken invariant) is a finding. Each input is parsed as a whole file, and again as a prefix of
// a longer file (the "only part of the file was given" paths).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <span>
#include <string_view>

#include "megatrain/core/error.hpp"
#include "megatrain/io/safetensors.hpp"

namespace {

void require(bool ok) {
  if (!ok) std::abort();  // an invariant of a successful parse does not hold
}

void check_header(const megatrain::io::SafetensorsHeader& h, std::uint64_t file_size) {
  require(h.data_start >= 10 && h.data_start <= file_size);
  require(h.data_start + h.data_size == file_size);
  std::uint64_t expected = 0;
  std::set<std::string_view> names;
  for (const auto& t : h.tensors) {
    require(names.insert(t.name).second);
    require(t.data_begin == expected && t.data_begin <= t.data_end);
    require(static_cast<std::uint64_t>(t.numel()) * megatrain::io::safetensors_dtype_size(t.dtype) == t.nbytes());
    for (const std::int64_t d : t.shape) require(d >= 0);
    expected = t.data_end;
  }
  require(expected == h.data_size);
  require(!names.contains("__metadata__"));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span<const std::uint8_t>(data, size));
  try {
    check_header(megatrain::io::parse_safetensors_header(bytes, size, "fuzz"), size);
  } catch (const megatrain::Error&) {
  }
  try {
    const std::uint64_t longer = size + 1 + (size > 0 ? data[0] : 0);
    check_header(megatrain::io::parse_safetensors_header(bytes.first(size / 2), longer, "fuzz"), longer);
  } catch (const megatrain::Error&) {
  }
  try {
    (void)megatrain::io::parse_safetensors_index(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const megatrain::Error&) {
  }
  return 0;
}
