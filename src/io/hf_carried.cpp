// Carried tensors (see include/megatrain/io/hf_carried.hpp).
#include "megatrain/io/hf_carried.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

/// The digest of `names` in `weights`: each name, dtype and shape, then its bytes.
Digest128 digest_tensors(const SafetensorsCheckpoint& weights, const std::vector<std::string>& names,
                         std::uint64_t* bytes) {
  Hasher h;
  std::uint64_t total = 0;
  const auto text = [&h](std::string_view s) {
    const std::uint64_t n = s.size();
    h.update(std::as_bytes(std::span<const std::uint64_t>(&n, 1)));
    h.update(std::as_bytes(std::span<const char>(s.data(), s.size())));
  };
  for (const auto& name : names) {
    const TensorBytes t = weights.tensor(name).bytes();
    text(name);
    text(safetensors_dtype_name(t.dtype));
    const std::uint64_t rank = t.shape.size();
    h.update(std::as_bytes(std::span<const std::uint64_t>(&rank, 1)));
    h.update(std::as_bytes(t.shape));
    h.update(t.bytes);
    total += t.bytes.size();
  }
  if (bytes != nullptr) *bytes = total;
  return h.digest();
}

}  // namespace

json CarriedTensors::to_json() const {
  return {{"dir", dir.string()}, {"tensors", names}, {"bytes", bytes}, {"digest", digest.hex()}};
}

CarriedTensors CarriedTensors::from_json(const json& j, std::string_view source) {
  CarriedTensors c;
  try {
    c.dir = j.at("dir").get<std::string>();
    c.names = j.at("tensors").get<std::vector<std::string>>();
    c.bytes = j.at("bytes").get<std::uint64_t>();
    const auto d = Digest128::from_hex(j.at("digest").get<std::string>());
    MT_CHECK(d.has_value(), "{}: the carried tensors' digest is not 32 hex digits", source);
    c.digest = *d;
  } catch (const json::exception& e) {
    MT_FAIL("{}: the record of the carried tensors is malformed: {}", source, e.what());
  }
  MT_CHECK(std::ranges::is_sorted(c.names) && !c.names.empty(), "{}: the carried tensors' names must be sorted and "
           "not empty", source);
  return c;
}

CarriedTensors carried_tensors(const fs::path& dir, const SafetensorsCheckpoint& weights, std::vector<std::string> names) {
  MT_NVTX_RANGE("io::carried_tensors");
  std::ranges::sort(names);
  CarriedTensors c;
  c.dir = fs::absolute(dir).lexically_normal();
  c.names = std::move(names);
  c.digest = digest_tensors(weights, c.names, &c.bytes);
  return c;
}

SafetensorsCheckpoint open_carried(const CarriedTensors& carried) {
  MT_NVTX_RANGE("io::open_carried");
  const std::string what = fmt::format(
      "the model folder '{}' holds {} tensors beside its language model (the vision tower, the multi-token "
      "prediction) that an export of the whole model writes back unchanged", carried.dir.string(), carried.names.size());
  const std::string fix = "give the folder the model was read from, as it was, or export the language model alone "
                          "(megatrain-train: --export-language-model)";
  std::error_code ec;
  MT_CHECK(fs::is_directory(carried.dir, ec), "{}; it is gone: {}", what, fix);
  SafetensorsCheckpoint weights = SafetensorsCheckpoint::open(carried.dir);
  for (const auto& name : carried.names)
    MT_CHECK(weights.contains(name), "{}; it no longer has '{}': {}", what, name, fix);
  std::uint64_t bytes = 0;
  MT_CHECK(digest_tensors(weights, carried.names, &bytes) == carried.digest && bytes == carried.bytes,
           "{}; they changed since the run read them (their digest differs): {}", what, fix);
  return weights;
}

}  // namespace megatrain::io
