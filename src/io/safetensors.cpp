// Safetensors reading and writing (see include/megatrain/io/safetensors.hpp for the contracts).
//
// Reading: the header is untrusted input. It is parsed by nlohmann's DOM parser with a callback
// that rejects duplicate keys (which the DOM would silently collapse) and absurd nesting, then
// every field is type-checked before it is read, and every size is computed with overflow
// checks, so that no input can make us index outside the bytes we were given. Tensor data is
// never touched through a typed pointer into the mapping: it is memcpy'd out in small chunks
// (the data may be unaligned, and no object of the element type lives there), then converted
// into the destination.
//
// Writing: everything that can be validated is validated and the header is built before the
// first file is created. Data is converted in fixed-size chunks on its way to the file. Files
// are created beside their target and renamed into place only once complete and fsynced.
#include "megatrain/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <unordered_map>

#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; megatrain reads it in place on little-endian hosts only");

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// ---- element types ----------------------------------------------------------------------------

namespace {
struct DTypeRow {
  SafetensorsDType type;
  std::string_view name;
  std::size_t size;
};
constexpr std::array<DTypeRow, 17> kDTypes{{
    {SafetensorsDType::boolean, "BOOL", 1},    {SafetensorsDType::u8, "U8", 1},
    {SafetensorsDType::i8, "I8", 1},           {SafetensorsDType::f8_e5m2, "F8_E5M2", 1},
    {SafetensorsDType::f8_e4m3, "F8_E4M3", 1}, {SafetensorsDType::f8_e8m0, "F8_E8M0", 1},
    {SafetensorsDType::i16, "I16", 2},         {SafetensorsDType::u16, "U16", 2},
    {SafetensorsDType::f16, "F16", 2},         {SafetensorsDType::bf16, "BF16", 2},
    {SafetensorsDType::i32, "I32", 4},         {SafetensorsDType::u32, "U32", 4},
    {SafetensorsDType::f32, "F32", 4},         {SafetensorsDType::f64, "F64", 8},
    {SafetensorsDType::i64, "I64", 8},         {SafetensorsDType::u64, "U64", 8},
    {SafetensorsDType::c64, "C64", 8},
}};
const DTypeRow& dtype_row(SafetensorsDType t) {
  const auto i = static_cast<std::size_t>(t);
  MT_CHECK(i < kDTypes.size() && kDTypes[i].type == t, "invalid SafetensorsDType value {}", i);
  return kDTypes[i];
}
}  // namespace

std::size_t safetensors_dtype_size(SafetensorsDType t) { return dtype_row(t).size; }
std::string_view safetensors_dtype_name(SafetensorsDType t) { return dtype_row(t).name; }

std::optional<SafetensorsDType> parse_safetensors_dtype(std::string_view name) {
  for (const auto& row : kDTypes)
    if (row.name == name) return row.type;
  return std::nullopt;
}

std::optional<DType> to_dtype(SafetensorsDType t) {
  switch (t) {
    case SafetensorsDType::f32: return DType::f32;
    case SafetensorsDType::f64: return DType::f64;
    case SafetensorsDType::bf16: return DType::bf16;
    case SafetensorsDType::f16: return DType::f16;
    case SafetensorsDType::i32: return DType::i32;
    case SafetensorsDType::i64: return DType::i64;
    case SafetensorsDType::u16: return DType::u16;
    case SafetensorsDType::u32: return DType::u32;
    default: return std::nullopt;
  }
}

SafetensorsDType to_safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return SafetensorsDType::f32;
    case DType::f64: return SafetensorsDType::f64;
    case DType::bf16: return SafetensorsDType::bf16;
    case DType::f16: return SafetensorsDType::f16;
    case DType::i32: return SafetensorsDType::i32;
    case DType::i64: return SafetensorsDType::i64;
    case DType::u16: return SafetensorsDType::u16;
    case DType::u32: return SafetensorsDType::u32;
  }
  MT_FAIL("invalid DType value {}", static_cast<int>(t));
}

// ---- small helpers ----------------------------------------------------------------------------

namespace {

using detail::errno_text;
using detail::fsync_directory;

std::string shape_string(std::span<const std::int64_t> dims) { return fmt::format("[{}]", fmt::join(dims, ", ")); }

/// Product of `dims` times `elem_size`, or nullopt if it does not fit in an int64 element count
/// or a u64 byte count. Multiplies in order, as the reference implementation does.
struct Sizes {
  std::int64_t numel;
  std::uint64_t nbytes;
};
std::optional<Sizes> checked_sizes(std::span<const std::int64_t> dims, std::size_t elem_size) {
  std::uint64_t n = 1;
  for (const std::int64_t d : dims) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return std::nullopt;
  }
  if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(elem_size), &bytes)) return std::nullopt;
  return Sizes{static_cast<std::int64_t>(n), bytes};
}

// Strict JSON: nlohmann's DOM keeps the last of duplicate keys without a word, and a hostile
// header could nest arrays millions deep. The parser callback sees every key and every opening
// bracket first, and stops the parse by throwing one of these.
constexpr int kMaxJsonDepth = 64;

struct JsonReject {
  bool too_deep = false;
  std::string top_key;  // the top-level key being parsed when it happened ("" at the top level)
  std::string key;      // the duplicated key
  bool at_top = false;  // the duplicate is a top-level key
};

/// Parses `text` as JSON, rejecting duplicate keys and nesting deeper than kMaxJsonDepth.
/// Throws nlohmann::json::exception for syntax errors and JsonReject for the other two.
json parse_strict_json(std::string_view text) {
  std::vector<std::set<std::string, std::less<>>> open_objects;
  int depth = 0;
  std::string top_key;
  const json::parser_callback_t callback = [&](int /*nlohmann_depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (++depth > kMaxJsonDepth) throw JsonReject{true, top_key, {}, false};
        if (event == json::parse_event_t::object_start) open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        --depth;
        if (event == json::parse_event_t::object_end && !open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        if (open_objects.empty() || !parsed.is_string()) break;  // cannot happen; be safe
        const auto& k = parsed.get_ref<const std::string&>();
        const bool top = open_objects.size() == 1;
        if (top) top_key = k;
        if (!open_objects.back().insert(k).second) throw JsonReject{false, top_key, k, top};
        break;
      }
      case json::parse_event_t::value: break;
    }
    return true;
  };
  return json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
}

/// A JSON integer that fits in [0, max], or nullopt (negative, fractional, too large, not a number).
std::optional<std::uint64_t> json_uint(const json& v, std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u <= max) return u;
    return std::nullopt;
  }
  if (v.is_number_integer()) {  // nlohmann keeps only negative literals (and -0) signed
    const auto s = v.get<std::int64_t>();
    if (s >= 0 && static_cast<std::uint64_t>(s) <= max) return static_cast<std::uint64_t>(s);
  }
  return std::nullopt;
}

std::string json_text(const json& v) {
  // For error messages: a short rendition of a (possibly huge or hostile) value.
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

}  // namespace

// ---- parsing ----------------------------------------------------------------------------------

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;  // validated by the parser not to overflow
  return n;
}

std::string TensorInfo::shape_str() const { return shape_string(shape); }

namespace {

TensorInfo parse_tensor_entry(const std::string& name, const json& entry, std::uint64_t data_size,
                              std::string_view label) {
  MT_CHECK(entry.is_object(), "'{}': the header entry of tensor '{}' is a JSON {}, not an object", label, name,
           entry.type_name());
  TensorInfo info;
  info.name = name;

  const auto dtype_it = entry.find("dtype");
  MT_CHECK(dtype_it != entry.end(), "'{}': tensor '{}' has no \"dtype\"", label, name);
  MT_CHECK(dtype_it->is_string(), "'{}': tensor '{}' has a \"dtype\" that is a JSON {}, not a string", label, name,
           dtype_it->type_name());
  const auto& dtype_name = dtype_it->get_ref<const std::string&>();
  const auto dtype = parse_safetensors_dtype(dtype_name);
  MT_CHECK(dtype.has_value(), "'{}': tensor '{}' has unknown dtype {}", label, name, json_text(*dtype_it));
  info.dtype = *dtype;

  const auto shape_it = entry.find("shape");
  MT_CHECK(shape_it != entry.end(), "'{}': tensor '{}' has no \"shape\"", label, name);
  MT_CHECK(shape_it->is_array(), "'{}': tensor '{}' has a \"shape\" that is a JSON {}, not an array", label, name,
           shape_it->type_name());
  info.shape.reserve(shape_it->size());
  for (std::size_t i = 0; i < shape_it->size(); ++i) {
    const json& d = (*shape_it)[i];
    const auto dim = json_uint(d, static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    MT_CHECK(dim.has_value(), "'{}': tensor '{}' has dimension {} = {}, which is not a non-negative integer", label,
             name, i, json_text(d));
    info.shape.push_back(static_cast<std::int64_t>(*dim));
  }

  const auto off_it = entry.find("data_offsets");
  MT_CHECK(off_it != entry.end(), "'{}': tensor '{}' has no \"data_offsets\"", label, name);
  MT_CHECK(off_it->is_array() && off_it->size() == 2,
           "'{}': tensor '{}' has \"data_offsets\" {}, not an array of two integers [begin, end]", label, name,
           json_text(*off_it));
  const auto begin = json_uint((*off_it)[0]), end = json_uint((*off_it)[1]);
  MT_CHECK(begin.has_value() && end.has_value(),
           "'{}': tensor '{}' has \"data_offsets\" {}, which are not non-negative integers", label, name,
           json_text(*off_it));
  MT_CHECK(*begin <= *end, "'{}': tensor '{}' has reversed data_offsets [{}, {}]", label, name, *begin, *end);
  MT_CHECK(*end <= data_size,
           "'{}': tensor '{}' has data_offsets [{}, {}], which run past the end of the data section ({} bytes)", label,
           name, *begin, *end, data_size);
  info.data_begin = *begin;
  info.data_end = *end;

  const std::size_t esize = safetensors_dtype_size(info.dtype);
  const auto sizes = checked_sizes(info.shape, esize);
  MT_CHECK(sizes.has_value(), "'{}': tensor '{}' has shape {} of {}, whose byte size overflows", label, name,
           info.shape_str(), dtype_name);
  MT_CHECK(sizes->nbytes == info.nbytes(),
           "'{}': tensor '{}' has shape {} of {} ({} bytes) but data_offsets [{}, {}] span {} bytes", label, name,
           info.shape_str(), dtype_name, sizes->nbytes, *begin, *end, info.nbytes());
  return info;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> bytes, std::uint64_t file_size,
                                           std::string_view file_label) {
  const std::string_view label = file_label;
  MT_CHECK(bytes.size() <= file_size, "'{}': {} bytes given for a file of {} bytes", label, bytes.size(), file_size);
  MT_CHECK(file_size >= 8,
           "'{}' is {} bytes long, too short for the 8-byte header length of a safetensors file", label, file_size);
  MT_CHECK(bytes.size() >= 8, "'{}': only {} bytes of the file were given; the header length needs 8", label,
           bytes.size());

  std::uint64_t n = 0;
  for (std::size_t i = 8; i-- > 0;) n = (n << 8) | std::to_integer<std::uint64_t>(bytes[i]);
  MT_CHECK(n <= file_size - 8,
           "'{}': the header length field says {} bytes, past the end of the file ({} bytes); not a safetensors file "
           "or truncated",
           label, n, file_size);
  MT_CHECK(n <= kMaxSafetensorsHeaderBytes, "'{}': the header is {} bytes, more than the {} accepted", label, n,
           kMaxSafetensorsHeaderBytes);
  MT_CHECK(n >= 2, "'{}': the header length field says {} bytes, too short for a JSON object", label, n);
  MT_CHECK(bytes.size() - 8 >= n, "'{}': only {} bytes of the file were given; the header needs {}", label,
           bytes.size(), n + 8);

  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  MT_CHECK(text.front() == '{', "'{}': the header does not start with '{{' (it starts with byte 0x{:02x})", label,
           static_cast<unsigned char>(text.front()));

  SafetensorsHeader header;
  header.data_start = 8 + n;
  header.data_size = file_size - header.data_start;

  json root;
  try {
    root = parse_strict_json(text);
  } catch (const JsonReject& r) {
    if (r.too_deep)
      MT_FAIL("'{}': the header nests deeper than {} levels (inside the entry of '{}')", label, kMaxJsonDepth,
              r.top_key);
    if (r.at_top) MT_FAIL("'{}': tensor '{}' appears twice in the header", label, r.key);
    MT_FAIL("'{}': the header entry of '{}' has the key '{}' twice", label, r.top_key, r.key);
  } catch (const json::exception& e) {
    MT_FAIL("'{}': the header is not valid JSON: {}", label, e.what());
  }
  MT_CHECK(root.is_object(), "'{}': the header is a JSON {}, not an object", label, root.type_name());

  header.tensors.reserve(root.size());
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // the reference implementation reads null as no metadata
      MT_CHECK(value.is_object(), "'{}': \"__metadata__\" is a JSON {}, not an object of strings", label,
               value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        MT_CHECK(mv.is_string(), "'{}': metadata key '{}' has the value {}, which is not a string", label, mk,
                 json_text(mv));
        header.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    header.tensors.push_back(parse_tensor_entry(key, value, header.data_size, label));
  }

  // The tensors must tile the data section: sorted by offset, each starts where the previous one
  // ended, and the last ends at the end of the file. (Empty tensors occupy [k, k).)
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.data_begin != b.data_begin) return a.data_begin < b.data_begin;
    if (a.data_end != b.data_end) return a.data_end < b.data_end;
    return a.name < b.name;
  });
  std::uint64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : header.tensors) {
    if (t.data_begin < expected) {
      // previous != nullptr: expected > 0 only after a tensor.
      MT_FAIL("'{}': tensor '{}' (data bytes [{}, {})) overlaps tensor '{}' (data bytes [{}, {}))", label, t.name,
              t.data_begin, t.data_end, previous->name, previous->data_begin, previous->data_end);
    }
    MT_CHECK(t.data_begin == expected,
             "'{}': data bytes [{}, {}) belong to no tensor (a hole before tensor '{}'); the format forbids holes",
             label, expected, t.data_begin, t.name);
    expected = t.data_end;
    previous = &t;
  }
  if (expected != header.data_size) {
    if (previous == nullptr)
      MT_FAIL("'{}': the header declares no tensors, but {} bytes of data follow it", label, header.data_size);
    MT_FAIL("'{}': {} bytes of data follow the last tensor '{}' (which ends at data byte {} of {})", label,
            header.data_size - expected, previous->name, expected, header.data_size);
  }
  return header;
}

std::map<std::string, std::string> parse_safetensors_index(std::string_view text, std::string_view file_label) {
  const std::string_view label = file_label;
  json root;
  try {
    root = parse_strict_json(text);
  } catch (const JsonReject& r) {
    if (r.too_deep) MT_FAIL("'{}': the index nests deeper than {} levels", label, kMaxJsonDepth);
    if (r.top_key == "weight_map" && !r.at_top) MT_FAIL("'{}': weight_map lists tensor '{}' twice", label, r.key);
    MT_FAIL("'{}': the key '{}' appears twice in the index", label, r.key);
  } catch (const json::exception& e) {
    MT_FAIL("'{}': the index is not valid JSON: {}", label, e.what());
  }
  MT_CHECK(root.is_object(), "'{}': the index is a JSON {}, not an object", label, root.type_name());
  if (const auto meta = root.find("metadata"); meta != root.end())
    MT_CHECK(meta->is_object() || meta->is_null(), "'{}': \"metadata\" is a JSON {}, not an object", label,
             meta->type_name());
  const auto wm = root.find("weight_map");
  MT_CHECK(wm != root.end(), "'{}': the index has no \"weight_map\"", label);
  MT_CHECK(wm->is_object(), "'{}': \"weight_map\" is a JSON {}, not an object", label, wm->type_name());
  std::map<std::string, std::string> map;
  for (const auto& [name, shard] : wm->items()) {
    MT_CHECK(shard.is_string(), "'{}': weight_map maps tensor '{}' to {}, not to a file name", label, name,
             json_text(shard));
    const auto& file = shard.get_ref<const std::string&>();
    MT_CHECK(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos &&
                 file.find('\\') == std::string::npos && file.find('\0') == std::string::npos,
             "'{}': weight_map maps tensor '{}' to {}, which is not a plain file name in the index's directory", label,
             name, json_text(shard));
    map.emplace(name, file);
  }
  return map;
}

// ---- SafetensorsFile --------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)), header_(std::move(other.header_)), by_name_(std::move(other.by_name_)),
      map_(std::exchange(other.map_, nullptr)), map_size_(std::exchange(other.map_size_, 0)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    header_ = std::move(other.header_);
    by_name_ = std::move(other.by_name_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  MT_NVTX_RANGE("io::SafetensorsFile::open");
  const std::string label = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "cannot open '{}': {}", label, errno_text(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  MT_CHECK(::fstat(fd, &st) == 0, "cannot stat '{}': {}", label, errno_text(errno));
  MT_CHECK(S_ISREG(st.st_mode), "'{}' is not a regular file", label);
  const auto size = static_cast<std::uint64_t>(st.st_size);

  SafetensorsFile file;
  file.path_ = path;
  if (size < 8) {
    parse_safetensors_header({}, size, label);  // throws the standard "too short" error
  }
  MT_CHECK(size <= std::numeric_limits<std::size_t>::max(), "'{}' is too large to map", label);
  void* p = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  MT_CHECK(p != MAP_FAILED, "cannot map '{}' ({} bytes): {}", label, size, errno_text(errno));
  file.map_ = static_cast<const std::byte*>(p);
  file.map_size_ = static_cast<std::size_t>(size);
  file.header_ = parse_safetensors_header({file.map_, file.map_size_}, size, label);

  const auto& ts = file.header_.tensors;
  MT_CHECK(ts.size() <= std::numeric_limits<std::uint32_t>::max(), "'{}' declares too many tensors", label);
  file.by_name_.resize(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i) file.by_name_[i] = static_cast<std::uint32_t>(i);
  std::sort(file.by_name_.begin(), file.by_name_.end(),
            [&](std::uint32_t a, std::uint32_t b) { return ts[a].name < ts[b].name; });
  return file;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto& ts = header_.tensors;
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [&](std::uint32_t i, std::string_view n) { return ts[i].name < n; });
  if (it == by_name_.end() || ts[*it].name != name) return nullptr;
  return &ts[*it];
}

const TensorInfo& SafetensorsFile::tensor(std::string_view name) const {
  const TensorInfo* t = find(name);
  MT_CHECK(t != nullptr, "'{}' has no tensor '{}'", path_.string(), name);
  return *t;
}

TensorBytes SafetensorsFile::view(const TensorInfo& info) const {
  const auto& ts = header_.tensors;
  const std::less<const TensorInfo*> before;
  MT_CHECK(!ts.empty() && !before(&info, ts.data()) && before(&info, ts.data() + ts.size()),
           "tensor '{}' does not belong to '{}'", info.name, path_.string());
  const auto offset = static_cast<std::size_t>(header_.data_start + info.data_begin);
  return {std::span<const std::byte>(map_ + offset, static_cast<std::size_t>(info.nbytes())), info.dtype, info.shape};
}

// ---- SafetensorsCheckpoint --------------------------------------------------------------------

namespace {
constexpr std::string_view kIndexName = "model.safetensors.index.json";  // Hugging Face's names
constexpr std::string_view kSingleName = "model.safetensors";

std::string read_small_file(const fs::path& path, std::uint64_t max_bytes) {
  const std::string label = path.string();
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "cannot open '{}': {}", label, errno_text(errno));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::streamoff>(in.tellg());
  MT_CHECK(size >= 0, "cannot read '{}'", label);
  MT_CHECK(static_cast<std::uint64_t>(size) <= max_bytes, "'{}' is {} bytes, more than the {} accepted", label, size,
           max_bytes);
  std::string text(static_cast<std::size_t>(size), '\0');
  in.seekg(0);
  in.read(text.data(), size);
  MT_CHECK(in.good() || (in.eof() && in.gcount() == size), "cannot read '{}'", label);
  return text;
}
}  // namespace

SafetensorsCheckpoint SafetensorsCheckpoint::open(const fs::path& path) {
  MT_NVTX_RANGE("io::SafetensorsCheckpoint::open");
  std::error_code ec;
  const auto status = fs::status(path, ec);
  MT_CHECK(!ec && fs::exists(status), "checkpoint '{}' does not exist", path.string());

  fs::path index_path;
  SafetensorsCheckpoint ckpt;
  if (fs::is_directory(status)) {
    if (fs::exists(path / kIndexName, ec)) {
      index_path = path / kIndexName;
    } else {
      MT_CHECK(fs::exists(path / kSingleName, ec), "'{}' holds neither {} nor {}", path.string(), kIndexName,
               kSingleName);
      ckpt.path_ = path / kSingleName;
    }
  } else if (path.filename().string().ends_with(".index.json")) {
    index_path = path;
  } else {
    ckpt.path_ = path;
  }

  if (index_path.empty()) {
    ckpt.files_.push_back(SafetensorsFile::open(ckpt.path_));
  } else {
    ckpt.path_ = index_path;
    ckpt.sharded_ = true;
    const std::string index_label = index_path.string();
    const auto weight_map = parse_safetensors_index(read_small_file(index_path, kMaxSafetensorsHeaderBytes), index_label);
    // Shard name -> the tensors the index puts there.
    std::map<std::string, std::vector<const std::string*>> shards;
    for (const auto& [name, shard] : weight_map) shards[shard].push_back(&name);
    const fs::path dir = index_path.parent_path();
    for (const auto& [shard, names] : shards) {
      const fs::path shard_path = dir / shard;
      MT_CHECK(fs::exists(shard_path, ec), "'{}': shard '{}' (listed for tensor '{}'{}) does not exist", index_label,
               shard, *names.front(),
               names.size() > 1 ? fmt::format(" and {} others", names.size() - 1) : std::string());
      ckpt.files_.push_back(SafetensorsFile::open(shard_path));
    }
    // Cross-check the shards against each other and against the index.
    std::unordered_map<std::string_view, std::size_t> holder;  // tensor -> file
    for (std::size_t f = 0; f < ckpt.files_.size(); ++f) {
      const SafetensorsFile& file = ckpt.files_[f];
      const std::string shard_name = file.path().filename().string();
      for (const TensorInfo& t : file.tensors()) {
        const auto [it, fresh] = holder.emplace(t.name, f);
        MT_CHECK(fresh, "tensor '{}' is in two shards, '{}' and '{}' (index '{}')", t.name,
                 ckpt.files_[it->second].path().string(), file.path().string(), index_label);
        const auto mapped = weight_map.find(t.name);
        MT_CHECK(mapped != weight_map.end(), "'{}' holds tensor '{}', which the index '{}' does not list",
                 file.path().string(), t.name, index_label);
        MT_CHECK(mapped->second == shard_name, "'{}' holds tensor '{}', but the index '{}' maps it to '{}'",
                 file.path().string(), t.name, index_label, mapped->second);
      }
    }
    for (const auto& [name, shard] : weight_map) {
      const auto it = holder.find(name);
      MT_CHECK(it != holder.end(), "the index '{}' maps tensor '{}' to '{}', which has no such tensor", index_label,
               name, (dir / shard).string());
    }
  }

  for (std::size_t f = 0; f < ckpt.files_.size(); ++f) {
    const auto ts = ckpt.files_[f].tensors();
    for (std::size_t i = 0; i < ts.size(); ++i)
      ckpt.entries_.push_back({ts[i].name, static_cast<std::uint32_t>(f), static_cast<std::uint32_t>(i)});
  }
  std::sort(ckpt.entries_.begin(), ckpt.entries_.end(), [](const Entry& a, const Entry& b) { return a.name < b.name; });
  return ckpt;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.emplace_back(e.name);
  return out;
}

std::optional<TensorRef> SafetensorsCheckpoint::find(std::string_view name) const {
  const auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                                   [](const Entry& e, std::string_view n) { return e.name < n; });
  if (it == entries_.end() || it->name != name) return std::nullopt;
  const SafetensorsFile& f = files_[it->file];
  return TensorRef(f, f.tensors()[it->index]);
}

TensorRef SafetensorsCheckpoint::tensor(std::string_view name) const {
  const auto ref = find(name);
  MT_CHECK(ref.has_value(), "checkpoint '{}' has no tensor '{}'", path_.string(), name);
  return *ref;
}

// ---- read_into --------------------------------------------------------------------------------

namespace {

constexpr std::size_t kReadChunk = 4096;             // elements converted per step (fits in L1/L2)
constexpr std::size_t kParallelGrain = 1u << 18;      // elements per parallel task
constexpr std::uint64_t kParallelMinBytes = 1u << 22;  // smaller tensors are read on one thread

/// Decodes `count` elements of `dtype` from unaligned little-endian bytes into floats.
void decode_to_float(SafetensorsDType dtype, const std::byte* src, std::size_t count, float* out) {
  switch (dtype) {
    case SafetensorsDType::f32: std::memcpy(out, src, count * sizeof(float)); return;
    case SafetensorsDType::bf16: {
      std::array<bf16, kReadChunk> buf;
      std::memcpy(buf.data(), src, count * sizeof(bf16));
      convert(std::span<const bf16>(buf.data(), count), std::span<float>(out, count));
      return;
    }
    case SafetensorsDType::f16: {
      std::array<f16, kReadChunk> buf;
      std::memcpy(buf.data(), src, count * sizeof(f16));
      convert(std::span<const f16>(buf.data(), count), std::span<float>(out, count));
      return;
    }
    case SafetensorsDType::f64: {
      std::array<double, kReadChunk> buf;
      std::memcpy(buf.data(), src, count * sizeof(double));
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(buf[i]);
      return;
    }
    default: MT_FAIL("unreachable: dtype {}", safetensors_dtype_name(dtype));
  }
}

void decode_chunk(SafetensorsDType dtype, const std::byte* src, std::size_t count, float* out) {
  decode_to_float(dtype, src, count, out);
}
void decode_chunk(SafetensorsDType dtype, const std::byte* src, std::size_t count, double* out) {
  if (dtype == SafetensorsDType::f64) {
    std::memcpy(out, src, count * sizeof(double));
    return;
  }
  std::array<float, kReadChunk> buf;
  decode_to_float(dtype, src, count, buf.data());
  for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<double>(buf[i]);
}

template <class D>
void read_into_impl(const TensorRef& src, View<D> dst) {
  MT_NVTX_RANGE("io::read_into");
  MT_CHECK(src.file != nullptr && src.info != nullptr, "read_into from an empty TensorRef");
  const TensorInfo& info = *src.info;
  const auto dims = dst.shape().dims();
  MT_CHECK(std::equal(dims.begin(), dims.end(), info.shape.begin(), info.shape.end()),
           "tensor '{}' in '{}' has shape {} but the destination has shape {}", info.name, src.file->path().string(),
           info.shape_str(), dst.shape().str());
  const SafetensorsDType dtype = info.dtype;
  MT_CHECK(dtype == SafetensorsDType::f32 || dtype == SafetensorsDType::bf16 || dtype == SafetensorsDType::f16 ||
               dtype == SafetensorsDType::f64,
           "tensor '{}' in '{}' holds {} elements, which cannot be read as {} (only F32, F64, BF16 and F16 can)",
           info.name, src.file->path().string(), safetensors_dtype_name(dtype), dtype_name(dtype_of<D>));
  MT_CHECK(dst.is_contiguous(), "reading tensor '{}' of '{}': the destination view is not contiguous", info.name,
           src.file->path().string());
  const TensorBytes bytes = src.file->view(info);
  const std::size_t n = static_cast<std::size_t>(info.numel());
  if (n == 0) return;
  D* const out = dst.data();
  const std::size_t esize = safetensors_dtype_size(dtype);
  const std::byte* const in = bytes.bytes.data();

  // Ask the kernel to start reading the whole range now (a hint; failures do not matter).
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<std::uintptr_t>(in) & ~(page - 1);
  ::madvise(reinterpret_cast<void*>(first), reinterpret_cast<std::uintptr_t>(in) + bytes.bytes.size() - first,
            MADV_WILLNEED);

  const auto convert_range = [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; i += kReadChunk) {
      const std::size_t count = std::min(kReadChunk, end - i);
      decode_chunk(dtype, in + i * esize, count, out + i);
    }
  };
  if (bytes.bytes.size() < kParallelMinBytes) {
    convert_range(0, n);
  } else {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, kParallelGrain),
                      [&](const tbb::blocked_range<std::size_t>& r) { convert_range(r.begin(), r.end()); });
  }
}

}  // namespace

void read_into(const TensorRef& src, View<float> dst) { read_into_impl(src, dst); }
void read_into(const TensorRef& src, View<double> dst) { read_into_impl(src, dst); }

// ---- writing: tensors and layout --------------------------------------------------------------

TensorToWrite::TensorToWrite(std::string tensor_name, AnyView view, SafetensorsDType stored_as)
    : name(std::move(tensor_name)), dtype(stored_as),
      shape(view.shape().dims().begin(), view.shape().dims().end()), source(view) {}

TensorToWrite::TensorToWrite(std::string tensor_name, AnyView view)
    : TensorToWrite(std::move(tensor_name), view, to_safetensors_dtype(view.dtype())) {}

TensorToWrite::TensorToWrite(std::string tensor_name, std::vector<std::int64_t> tensor_shape,
                             SafetensorsDType stored_as, TensorProducer producer)
    : name(std::move(tensor_name)), dtype(stored_as), shape(std::move(tensor_shape)), source(std::move(producer)) {}

TensorToWrite::TensorToWrite(std::string tensor_name, const TensorBytes& stored)
    : name(std::move(tensor_name)), dtype(stored.dtype), shape(stored.shape.begin(), stored.shape.end()),
      source(stored.bytes) {}

namespace {

bool is_float_file_dtype(SafetensorsDType t) {
  return t == SafetensorsDType::f32 || t == SafetensorsDType::f64 || t == SafetensorsDType::bf16 ||
         t == SafetensorsDType::f16;
}

bool valid_utf8_json_string(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::exception&) {
    return false;
  }
}

/// Checks one tensor and returns its byte size. Throws naming `label` and the tensor.
std::uint64_t check_tensor_for_write(const TensorToWrite& t, std::string_view label) {
  MT_CHECK(!t.name.empty(), "cannot write '{}': a tensor has an empty name", label);
  MT_CHECK(t.name != "__metadata__", "cannot write '{}': \"__metadata__\" is reserved and cannot name a tensor", label);
  MT_CHECK(valid_utf8_json_string(t.name), "cannot write '{}': tensor name '{}' is not valid UTF-8", label, t.name);
  const std::size_t esize = safetensors_dtype_size(t.dtype);
  for (const std::int64_t d : t.shape)
    MT_CHECK(d >= 0, "cannot write '{}': tensor '{}' has a negative dimension in shape {}", label, t.name,
             shape_string(t.shape));
  const auto sizes = checked_sizes(t.shape, esize);
  MT_CHECK(sizes.has_value(), "cannot write '{}': tensor '{}' of shape {} is too large", label, t.name,
           shape_string(t.shape));

  if (const auto* view = std::get_if<AnyView>(&t.source)) {
    const auto vdims = view->shape().dims();
    MT_CHECK(std::equal(vdims.begin(), vdims.end(), t.shape.begin(), t.shape.end()),
             "cannot write '{}': tensor '{}' declares shape {} but its source view has shape {}", label, t.name,
             shape_string(t.shape), view->shape().str());
    MT_CHECK(view->numel() == 0 || view->data() != nullptr, "cannot write '{}': tensor '{}' has a null source view",
             label, t.name);
    MT_CHECK(view->numel() == 0 || view->strides() == contiguous_strides(view->shape()),
             "cannot write '{}': the source view of tensor '{}' is not contiguous", label, t.name);
    const SafetensorsDType from = to_safetensors_dtype(view->dtype());
    if (from != t.dtype) {
      MT_CHECK(is_float_file_dtype(from) && is_float_file_dtype(t.dtype),
               "cannot write '{}': tensor '{}' cannot be converted from {} to {} (only f32, f64, bf16 and f16 "
               "convert; other dtypes are written as they are)",
               label, t.name, dtype_name(view->dtype()), safetensors_dtype_name(t.dtype));
      MT_CHECK(!(from == SafetensorsDType::f64 &&
                 (t.dtype == SafetensorsDType::bf16 || t.dtype == SafetensorsDType::f16)),
               "cannot write '{}': tensor '{}' would be rounded twice from F64 to {}; convert it to f32 first", label,
               t.name, safetensors_dtype_name(t.dtype));
    }
  } else if (const auto* stored = std::get_if<std::span<const std::byte>>(&t.source)) {
    MT_CHECK(stored->size() == sizes->nbytes, "cannot write '{}': tensor '{}' of shape {} as {} needs {} bytes, not the {} "
             "given", label, t.name, shape_string(t.shape), safetensors_dtype_name(t.dtype), sizes->nbytes, stored->size());
  } else {
    const auto& producer = std::get<TensorProducer>(t.source);
    MT_CHECK(static_cast<bool>(producer), "cannot write '{}': tensor '{}' has an empty producer", label, t.name);
    MT_CHECK(is_float_file_dtype(t.dtype),
             "cannot write '{}': tensor '{}' comes from an fp32 producer and cannot be stored as {}", label, t.name,
             safetensors_dtype_name(t.dtype));
  }
  return sizes->nbytes;
}

/// Checks all tensors (including name uniqueness) and the metadata; returns each tensor's bytes.
std::vector<std::uint64_t> check_all_for_write(std::span<const TensorToWrite> tensors,
                                               const std::map<std::string, std::string>& metadata,
                                               std::string_view label) {
  std::vector<std::uint64_t> nbytes;
  nbytes.reserve(tensors.size());
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    nbytes.push_back(check_tensor_for_write(t, label));
    MT_CHECK(names.insert(t.name).second, "cannot write '{}': tensor '{}' is given twice", label, t.name);
  }
  for (const auto& [k, v] : metadata) {
    MT_CHECK(valid_utf8_json_string(k), "cannot write '{}': metadata key '{}' is not valid UTF-8", label, k);
    MT_CHECK(valid_utf8_json_string(v), "cannot write '{}': the value of metadata key '{}' is not valid UTF-8", label,
             k);
  }
  return nbytes;
}

/// One file's layout: which tensors in which order, and the padded header bytes.
struct FileLayout {
  std::vector<std::size_t> order;  // indices into the caller's tensors, in data order
  std::string header;              // 8-byte length + JSON + padding: the data section follows
  std::uint64_t data_bytes = 0;
};

FileLayout layout_file(std::span<const TensorToWrite> tensors, std::span<const std::uint64_t> nbytes,
                       std::span<const std::size_t> members, const std::map<std::string, std::string>& metadata) {
  FileLayout layout;
  layout.order.assign(members.begin(), members.end());
  // Largest elements first: every tensor then starts at a multiple of its element size.
  std::stable_sort(layout.order.begin(), layout.order.end(), [&](std::size_t a, std::size_t b) {
    return safetensors_dtype_size(tensors[a].dtype) > safetensors_dtype_size(tensors[b].dtype);
  });
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const std::size_t i : layout.order) {
    const auto& t = tensors[i];
    header[t.name] = {{"dtype", std::string(safetensors_dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes[i]}}};
    offset += nbytes[i];
  }
  layout.data_bytes = offset;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data section 8-byte aligned, as the reference pads
  layout.header.resize(8);
  const auto n = static_cast<std::uint64_t>(text.size());
  for (std::size_t i = 0; i < 8; ++i) layout.header[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  layout.header += text;
  return layout;
}

// ---- writing: files ---------------------------------------------------------------------------

using detail::OutputFile;

/// Converts and writes tensors chunk by chunk; the scratch buffers are reused across tensors.
class TensorStreamer {
 public:
  void write(OutputFile& out, const TensorToWrite& t) {
    const auto numel = static_cast<std::size_t>(checked_sizes(t.shape, 1)->numel);  // checked before
    if (const auto* view = std::get_if<AnyView>(&t.source)) {
      const SafetensorsDType from = to_safetensors_dtype(view->dtype());
      const std::size_t in_size = safetensors_dtype_size(from);
      const auto* base = static_cast<const std::byte*>(view->data());
      if (from == t.dtype) {  // stored as it is: straight from the source, no copy
        if (numel > 0) out.write(std::span<const std::byte>(base, numel * in_size));
        return;
      }
      for (std::size_t i = 0; i < numel; i += kChunk) {
        const std::size_t count = std::min(kChunk, numel - i);
        const std::byte* src = base + i * in_size;
        if (t.dtype == SafetensorsDType::f64) {  // widening from f32/bf16/f16: exact
          decode_to_float(from, src, count, floats_.data());
          for (std::size_t k = 0; k < count; ++k) doubles_[k] = static_cast<double>(floats_[k]);
          out.write(std::as_bytes(std::span<const double>(doubles_.data(), count)));
          continue;
        }
        decode_to_float(from, src, count, floats_.data());  // f64 -> f32 rounds once, here
        encode(out, t.dtype, count);
      }
      return;
    }
    if (const auto* stored = std::get_if<std::span<const std::byte>>(&t.source)) {  // (checked: the tensor's bytes)
      if (!stored->empty()) out.write(*stored);
      return;
    }
    const auto& producer = std::get<TensorProducer>(t.source);
    for (std::size_t i = 0; i < numel; i += kChunk) {
      const std::size_t count = std::min(kChunk, numel - i);
      producer(static_cast<std::int64_t>(i), std::span<float>(floats_.data(), count));
      if (t.dtype == SafetensorsDType::f64) {
        for (std::size_t k = 0; k < count; ++k) doubles_[k] = static_cast<double>(floats_[k]);
        out.write(std::as_bytes(std::span<const double>(doubles_.data(), count)));
      } else {
        encode(out, t.dtype, count);
      }
    }
  }

 private:
  static constexpr std::size_t kChunk = kReadChunk;

  /// Writes floats_[0, count) as `to` (F32, BF16 or F16).
  void encode(OutputFile& out, SafetensorsDType to, std::size_t count) {
    const std::span<const float> in(floats_.data(), count);
    switch (to) {
      case SafetensorsDType::f32: out.write(std::as_bytes(in)); return;
      case SafetensorsDType::bf16:
        convert(in, std::span<bf16>(halves_bf16_.data(), count));
        out.write(std::as_bytes(std::span<const bf16>(halves_bf16_.data(), count)));
        return;
      case SafetensorsDType::f16:
        convert(in, std::span<f16>(halves_f16_.data(), count));
        out.write(std::as_bytes(std::span<const f16>(halves_f16_.data(), count)));
        return;
      default: MT_FAIL("unreachable: dtype {}", safetensors_dtype_name(to));
    }
  }

  std::vector<float> floats_ = std::vector<float>(kChunk);
  std::vector<double> doubles_ = std::vector<double>(kChunk);
  std::vector<bf16> halves_bf16_ = std::vector<bf16>(kChunk);
  std::vector<f16> halves_f16_ = std::vector<f16>(kChunk);
};

/// Writes one complete safetensors file into `out` and fsyncs it.
void write_file(OutputFile& out, std::span<const TensorToWrite> tensors, const FileLayout& layout) {
  out.write(layout.header);
  TensorStreamer streamer;
  for (const std::size_t i : layout.order) {
    fault::crash_point("write:tensor");
    fault::delay_point("write:tensor");
    streamer.write(out, tensors[i]);
  }
  out.finish();
}

fs::path normalized_target(const fs::path& p) {
  fs::path abs = fs::absolute(p).lexically_normal();
  if (abs.filename().empty()) abs = abs.parent_path();  // "dir/" -> "dir"
  return abs;
}

bool plain_file_name(std::string_view n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string_view::npos &&
         n.find('\0') == std::string_view::npos;
}

}  // namespace

void write_safetensors(const fs::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
  MT_NVTX_RANGE("io::write_safetensors");
  const fs::path target = normalized_target(path);
  const std::string label = target.string();
  const auto nbytes = check_all_for_write(tensors, metadata, label);
  std::vector<std::size_t> all(tensors.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  const FileLayout layout = layout_file(tensors, nbytes, all, metadata);

  const fs::path dir = target.parent_path();
  std::error_code ec;
  MT_CHECK(fs::is_directory(dir, ec), "cannot write '{}': directory '{}' does not exist", label, dir.string());
  MT_CHECK(!fs::is_directory(target, ec), "cannot write '{}': it is a directory", label);

  // A fresh, locked temporary file beside the target, once dead writers' ones are gone.
  detail::remove_debris(target);
  const auto out = OutputFile::partial_for(target);
  write_file(*out, tensors, layout);
  MT_CHECK(::rename(out->path().c_str(), target.c_str()) == 0, "cannot rename '{}' to '{}': {}", out->path().string(),
           label, errno_text(errno));
  out->keep();
  fsync_directory(dir);
}

std::vector<std::vector<std::size_t>> plan_safetensors_shards(std::span<const TensorToWrite> tensors,
                                                              std::uint64_t max_shard_bytes) {
  MT_CHECK(max_shard_bytes > 0, "the maximum shard size must be positive");
  std::vector<std::vector<std::size_t>> shards(1);
  std::uint64_t current = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto sizes = checked_sizes(tensors[i].shape, safetensors_dtype_size(tensors[i].dtype));
    MT_CHECK(sizes.has_value(), "tensor '{}' of shape {} is too large", tensors[i].name,
             shape_string(tensors[i].shape));
    if (!shards.back().empty() && (current + sizes->nbytes > max_shard_bytes || current + sizes->nbytes < current)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += sizes->nbytes;
  }
  return shards;
}

// ---- writing: directories ---------------------------------------------------------------------

namespace {

bool is_weight_file(std::string_view name) {
  return name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
}

/// Files of an existing checkpoint directory to keep in the new one: (name, is symlink).
std::vector<std::pair<std::string, bool>> files_to_carry(const fs::path& target, const std::set<std::string>& written,
                                                         std::string_view label) {
  std::vector<std::pair<std::string, bool>> carry;
  std::error_code ec;
  const auto st = fs::symlink_status(target, ec);
  if (ec || !fs::exists(st)) return carry;
  MT_CHECK(!fs::is_symlink(st), "cannot write '{}': it is a symbolic link; give the directory it points to", label);
  MT_CHECK(fs::is_directory(st), "cannot write '{}': it exists and is not a directory", label);
  for (fs::directory_iterator it(target, ec), end; it != end; it.increment(ec)) {
    MT_CHECK(!ec, "cannot list '{}': {}", label, ec.message());
    const std::string name = it->path().filename().string();
    const auto est = it->symlink_status(ec);
    MT_CHECK(!ec, "cannot stat '{}': {}", it->path().string(), ec.message());
    MT_CHECK(fs::is_regular_file(est) || fs::is_symlink(est),
             "cannot replace '{}': it holds '{}', which is not a regular file; this writer replaces directories of "
             "files only (move it away or write elsewhere)",
             label, name);
    if (is_weight_file(name) || written.contains(name)) continue;
    carry.emplace_back(name, fs::is_symlink(est));
  }
  MT_CHECK(!ec, "cannot list '{}': {}", label, ec.message());
  return carry;
}

/// Puts `name` of `from` into `to`: a hard link, a copy where links are refused, or a new
/// symlink with the same target.
void carry_file(const fs::path& from, const fs::path& to, bool symlink) {
  std::error_code ec;
  if (symlink) {
    const fs::path target = fs::read_symlink(from, ec);
    MT_CHECK(!ec, "cannot read symbolic link '{}': {}", from.string(), ec.message());
    fs::create_symlink(target, to, ec);
    MT_CHECK(!ec, "cannot create symbolic link '{}': {}", to.string(), ec.message());
    return;
  }
  if (::link(from.c_str(), to.c_str()) == 0) return;
  fs::copy_file(from, to, fs::copy_options::none, ec);
  MT_CHECK(!ec, "cannot carry '{}' into the new checkpoint: {}", from.string(), ec.message());
  const int fd = ::open(to.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0 && ::fsync(fd) == 0, "cannot sync '{}': {}", to.string(), errno_text(errno));
  ::close(fd);
}

}  // namespace

struct ShardedWrite::Impl {
  fs::path target;
  std::string label;
  std::span<const TensorToWrite> tensors;
  ShardedWriteOptions options;
  std::vector<std::uint64_t> nbytes;
  std::vector<std::vector<std::size_t>> plan;  // per shard: indices into tensors
  std::vector<int> writer;                     // per shard
  std::vector<std::string> shard_names;
  std::vector<FileLayout> layouts;
  std::string index_name, index_text;
  std::set<std::string> written;               // every name the new set holds
  std::vector<std::pair<std::string, bool>> carry;
  std::optional<detail::StagingDirectory> staging;  // (the first writer's)
  fs::path staging_path;
};

ShardedWrite::ShardedWrite(const fs::path& dir, std::span<const TensorToWrite> tensors, ShardedWriteOptions options,
                           std::vector<int> writer_of)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.target = normalized_target(dir);
  m.label = m.target.string();
  m.tensors = tensors;
  m.options = std::move(options);
  // Everything that can fail without I/O, first.
  MT_CHECK(plain_file_name(m.options.base_name) && !is_weight_file(m.options.base_name),
           "cannot write '{}': shard base name '{}' is not a plain file name", m.label, m.options.base_name);
  if (writer_of.empty()) writer_of.assign(tensors.size(), 0);
  MT_CHECK(writer_of.size() == tensors.size() && (tensors.empty() || writer_of.front() >= 0) &&
               std::is_sorted(writer_of.begin(), writer_of.end()),
           "cannot write '{}': {} writers named for {} tensors (want one per tensor, non-decreasing from 0)", m.label,
           writer_of.size(), tensors.size());
  m.nbytes = check_all_for_write(tensors, m.options.metadata, m.label);
  // Each writer's tensors packed into shards of their own, writer by writer.
  for (std::size_t first = 0; first < tensors.size();) {
    std::size_t last = first;
    while (last < tensors.size() && writer_of[last] == writer_of[first]) ++last;
    for (auto& members : plan_safetensors_shards(tensors.subspan(first, last - first), m.options.max_shard_bytes)) {
      for (auto& i : members) i += first;
      m.plan.push_back(std::move(members));
      m.writer.push_back(writer_of[first]);
    }
    first = last;
  }
  if (m.plan.empty()) {  // (no tensor at all: one empty file, as before)
    m.plan.emplace_back();
    m.writer.push_back(0);
  }
  const std::size_t n = m.plan.size();
  m.index_name = m.options.base_name + ".safetensors.index.json";
  if (n == 1) {
    m.shard_names.push_back(m.options.base_name + ".safetensors");
  } else {
    for (std::size_t s = 0; s < n; ++s)
      m.shard_names.push_back(fmt::format("{}-{:05d}-of-{:05d}.safetensors", m.options.base_name, s + 1, n));
  }
  m.layouts.reserve(n);
  for (const auto& members : m.plan) m.layouts.push_back(layout_file(tensors, m.nbytes, members, m.options.metadata));

  m.written.insert(m.shard_names.begin(), m.shard_names.end());
  if (n > 1) {
    m.written.emplace(m.index_name);
    json weight_map = json::object();
    std::uint64_t total = 0;
    for (std::size_t s = 0; s < n; ++s)
      for (const std::size_t i : m.plan[s]) {
        weight_map[tensors[i].name] = m.shard_names[s];
        total += m.nbytes[i];
      }
    m.index_text = json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n";
  }
  for (const auto& [name, contents] : m.options.extra_files) {
    MT_CHECK(plain_file_name(name), "cannot write '{}': extra file name '{}' is not a plain file name", m.label, name);
    MT_CHECK(!m.written.contains(name) && !is_weight_file(name),
             "cannot write '{}': extra file '{}' would clash with the safetensors files", m.label, name);
    m.written.insert(name);
  }
}

ShardedWrite::~ShardedWrite() = default;

std::size_t ShardedWrite::num_shards() const { return impl_->plan.size(); }
int ShardedWrite::shard_writer(std::size_t s) const { return impl_->writer.at(s); }
const std::string& ShardedWrite::shard_name(std::size_t s) const { return impl_->shard_names.at(s); }

void ShardedWrite::stage() {
  Impl& m = *impl_;
  const fs::path parent = m.target.parent_path();
  std::error_code ec;
  MT_CHECK(fs::is_directory(parent, ec), "cannot write '{}': directory '{}' does not exist", m.label, parent.string());
  // Dead writers' leftovers go first: a crash between the two renames of a replace leaves the
  // previous folder as `.old-*`, restored here, and its other files must still be carried.
  detail::remove_debris(m.target);
  m.carry = m.options.carry_other_files ? files_to_carry(m.target, m.written, m.label)
                                        : std::vector<std::pair<std::string, bool>>{};
  if (!m.options.carry_other_files) (void)files_to_carry(m.target, {}, m.label);  // (the same checks of what is there)
  m.staging.emplace(m.target);
  m.staging_path = m.staging->path();
}

std::uint32_t ShardedWrite::staging_key() const {
  const std::string name = impl_->staging_path.filename().string();
  const auto dash = name.rfind('-');
  MT_CHECK(impl_->staging && dash != std::string::npos, "writing '{}': the set is not staged", impl_->label);
  return static_cast<std::uint32_t>(std::stoul(name.substr(dash + 1), nullptr, 16));
}

void ShardedWrite::attach(std::uint32_t key) {
  Impl& m = *impl_;
  fs::path p = m.target;
  p += fmt::format(".partial-{:08x}", key);
  std::error_code ec;
  MT_CHECK(fs::is_directory(p, ec), "cannot write into '{}', which the first writer of '{}' created: this process does "
           "not see it (the writers must share one file system)", p.string(), m.label);
  m.staging_path = std::move(p);
}

std::vector<WrittenFile> ShardedWrite::write_shards(int w) const {
  const Impl& m = *impl_;
  MT_CHECK(!m.staging_path.empty(), "writing '{}': the set is not staged", m.label);
  std::vector<WrittenFile> files;
  for (std::size_t s = 0; s < m.plan.size(); ++s) {
    if (m.writer[s] != w) continue;
    Hasher h;
    OutputFile out(m.staging_path / m.shard_names[s], &h);
    write_file(out, m.tensors, m.layouts[s]);
    out.keep();
    files.push_back({m.shard_names[s], h.size(), h.digest()});
  }
  return files;
}

std::vector<WrittenFile> ShardedWrite::commit(std::vector<WrittenFile> files) {
  Impl& m = *impl_;
  MT_CHECK(m.staging.has_value(), "writing '{}': only the writer that staged the set commits it", m.label);
  MT_CHECK(files.size() == m.plan.size(), "writing '{}': {} shards written of {}", m.label, files.size(), m.plan.size());
  for (std::size_t s = 0; s < files.size(); ++s)
    MT_CHECK(files[s].name == m.shard_names[s], "writing '{}': shard {} is '{}', not '{}'", m.label, s, files[s].name,
             m.shard_names[s]);
  const fs::path& staged = m.staging->path();
  fault::crash_point("write:files");
  const auto write_text = [&](const std::string& name, std::string_view text) {
    Hasher h;
    OutputFile out(staged / name, &h);
    out.write(text);
    out.finish();
    out.keep();
    files.push_back({name, h.size(), h.digest()});
  };
  if (m.plan.size() > 1) write_text(m.index_name, m.index_text);
  for (const auto& [name, contents] : m.options.extra_files) write_text(name, contents);
  if (m.options.finalize) {
    for (const auto& [name, contents] : m.options.finalize(files)) {
      MT_CHECK(plain_file_name(name) && !m.written.contains(name) && !is_weight_file(name),
               "cannot write '{}': final file '{}' is not a plain file name or clashes with another file", m.label, name);
      m.written.insert(name);
      write_text(name, contents);
    }
  }
  for (const auto& [name, symlink] : m.carry) carry_file(m.target / name, staged / name, symlink);
  fsync_directory(staged);

  fault::crash_point("write:before-rename");
  const fs::path old = detail::replace_directory(staged, m.target, /*allow_exchange=*/true);
  m.staging->release();
  fault::crash_point("write:after-rename");
  if (!old.empty()) detail::remove_flat_directory(old);
  return files;
}

std::vector<WrittenFile> write_safetensors_sharded(const fs::path& dir, std::span<const TensorToWrite> tensors,
                                                   const ShardedWriteOptions& options) {
  MT_NVTX_RANGE("io::write_safetensors_sharded");
  ShardedWrite w(dir, tensors, options);
  w.stage();
  return w.commit(w.write_shards(0));
}

}  // namespace megatrain::io
