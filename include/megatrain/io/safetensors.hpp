// Safetensors: the checkpoint format of Hugging Face models, read and written without ever
// holding a second copy of the model.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of JSON describing
// every tensor (dtype, shape, byte range), then the raw little-endian data. Reading maps the
// file read-only and validates the whole header before anything is returned, so a corrupt or
// hostile file is an Error naming the file and the tensor, never a crash or an out-of-bounds
// read; tensors are then converted straight from the mapping into their destination
// (read_into), chunk by chunk. Writing converts chunk by chunk while it writes (no converted
// copy of the model ever exists) and replaces its target atomically: a reader sees the old
// file (or directory of shards) or the new one, never a mix or a half-written one.
//
// Validation is at least as strict as the format's reference implementation (the tensors must
// tile the data section exactly, without holes or trailing bytes; the header starts with '{' and
// is at most 100 MB), and stricter where the format says so but JSON libraries let it pass
// (duplicate keys). Files written here follow the reference writer's layout. See
// docs/safetensors.md.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "megatrain/core/finite.hpp"
#include "megatrain/core/digest.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/tensor.hpp"

namespace megatrain::io {

// ---- element types ----------------------------------------------------------------------------

/// The element types a safetensors header may declare. This is wider than megatrain::DType on
/// purpose: a valid checkpoint may hold tensors megatrain never computes with (a U8 buffer, an
/// FP8 scale), and opening it must not fail because of them; only reading such a tensor into a
/// float destination does. (The format's sub-byte types F4/F6 are not supported: a header that
/// declares one is rejected as an unknown dtype.)
enum class SafetensorsDType : std::uint8_t {
  boolean, u8, i8, f8_e5m2, f8_e4m3, f8_e8m0, i16, u16, f16, bf16, i32, u32, f32, f64, i64, u64, c64
};

/// Bytes per element (1, 2, 4 or 8).
std::size_t safetensors_dtype_size(SafetensorsDType t);
/// The header spelling: "BOOL", "U8", "F8_E4M3", "BF16", "F32", ...
std::string_view safetensors_dtype_name(SafetensorsDType t);
/// The dtype a header spelling names, if any (case-sensitive, as the format is).
std::optional<SafetensorsDType> parse_safetensors_dtype(std::string_view name);
/// The megatrain dtype of the same layout, if megatrain has one.
std::optional<DType> to_dtype(SafetensorsDType t);
/// The safetensors dtype of a megatrain dtype (every DType has one).
SafetensorsDType to_safetensors_dtype(DType t);

// ---- parsing ----------------------------------------------------------------------------------

/// One tensor as the header declares it. Offsets are bytes relative to the data section.
struct TensorInfo {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::f32;
  std::vector<std::int64_t> shape;  ///< any rank (0 is a scalar); every dim >= 0
  std::uint64_t data_begin = 0, data_end = 0;

  std::uint64_t nbytes() const { return data_end - data_begin; }
  /// Product of the dims (validated to fit: numel * element size == nbytes()).
  std::int64_t numel() const;
  /// "[4096, 11008]"
  std::string shape_str() const;
};

/// A validated header.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;              ///< sorted by data_begin (then name)
  std::map<std::string, std::string> metadata;  ///< the optional "__metadata__" object
  std::uint64_t data_start = 0;                 ///< file offset of the data section: 8 + N
  std::uint64_t data_size = 0;                  ///< bytes in the data section (to the end of the file)
};

/// The largest header accepted, as in the reference implementation: anything larger is hostile.
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// Parses and validates the header of a safetensors file. `bytes` is the start of the file (at
/// least the 8-byte length and the header; more is allowed and not read), `file_size` the whole
/// file's size, `file_label` how errors name the file. Checks the length field against the file
/// and the 100 MB limit, JSON syntax (UTF-8, duplicate keys at any level), every entry's fields
/// and their JSON types, dtype spellings, dims (non-negative integers), that each tensor's byte
/// range matches numel * element size, and that the tensors tile the data section exactly
/// (offsets not reversed, no overlap, no hole, nothing past or after the end). Throws
/// megatrain::Error naming `file_label` and the tensor (or metadata key). Never reads outside
/// `bytes`, whatever they hold.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> bytes, std::uint64_t file_size,
                                           std::string_view file_label);

/// Parses and validates `model.safetensors.index.json`: {"metadata": {...}, "weight_map": {name:
/// shard file name}}. Shard names must be plain file names (no directory part). Metadata is
/// informational ("total_size" is not checked against the shards: exporters disagree on it).
/// Returns the weight map. Throws megatrain::Error naming `file_label` and the tensor.
std::map<std::string, std::string> parse_safetensors_index(std::string_view json, std::string_view file_label);

// ---- reading ----------------------------------------------------------------------------------

/// Read-only access to one tensor's bytes inside a mapping (little-endian, possibly unaligned:
/// copy out with memcpy, or use read_into).
struct TensorBytes {
  std::span<const std::byte> bytes;
  SafetensorsDType dtype;
  std::span<const std::int64_t> shape;
};

/// One safetensors file, memory-mapped read-only. The file must not be truncated or rewritten in
/// place while it is open (the mapping would fault); files written by this library are replaced
/// by rename, which leaves an open mapping intact.
class SafetensorsFile {
 public:
  /// Maps `path` and validates its header; throws megatrain::Error naming the file otherwise.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  std::uint64_t file_size() const { return map_size_; }
  /// Every tensor, in data order. References stay valid while this object lives (moves included).
  std::span<const TensorInfo> tensors() const { return header_.tensors; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The tensor called `name`; throws naming the file if there is none.
  const TensorInfo& tensor(std::string_view name) const;
  /// The bytes of `info`, which must be one of tensors() (checked).
  TensorBytes view(const TensorInfo& info) const;
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const SafetensorsHeader& header() const { return header_; }

 private:
  SafetensorsFile() = default;
  void release() noexcept;

  std::filesystem::path path_;
  SafetensorsHeader header_;
  std::vector<std::uint32_t> by_name_;  // indices into header_.tensors, sorted by name
  const std::byte* map_ = nullptr;
  std::size_t map_size_ = 0;
};

/// A tensor inside an open file: what a checkpoint lookup returns and read_into consumes.
/// Valid while the file (or the checkpoint holding it) lives.
struct TensorRef {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;

  TensorRef() = default;
  TensorRef(const SafetensorsFile& f, const TensorInfo& i) : file(&f), info(&i) {}
  const std::string& name() const { return info->name; }
  TensorBytes bytes() const { return file->view(*info); }
};

/// A model's weights: one safetensors file, or a directory of shards with an index.
class SafetensorsCheckpoint {
 public:
  /// `path` is a directory holding `model.safetensors.index.json` (sharded; preferred when both
  /// exist) or `model.safetensors`, an index file itself, or a single .safetensors file. Every
  /// shard the index names is opened and validated, and the index is checked against them: each
  /// tensor it lists must be in the shard it names, each tensor of a shard must be listed and
  /// mapped to that shard, no tensor may be in two shards, every shard must exist. Throws
  /// megatrain::Error naming the file and the tensor otherwise.
  static SafetensorsCheckpoint open(const std::filesystem::path& path);

  /// What was opened: the index file, or the single safetensors file.
  const std::filesystem::path& path() const { return path_; }
  bool sharded() const { return sharded_; }
  std::span<const SafetensorsFile> files() const { return files_; }

  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  std::size_t size() const { return entries_.size(); }
  bool contains(std::string_view name) const { return find(name).has_value(); }
  std::optional<TensorRef> find(std::string_view name) const;
  /// The tensor called `name`; throws naming the checkpoint if there is none.
  TensorRef tensor(std::string_view name) const;

 private:
  struct Entry {
    std::string_view name;  // into files_[file].tensors()[index].name, stable across moves
    std::uint32_t file, index;
  };
  std::filesystem::path path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::vector<Entry> entries_;  // sorted by name
};

/// Copies tensor `src` into `dst`, converting F32, F64, BF16 or F16 to the destination's type
/// (F64 -> float rounds to nearest even; every other conversion is exact). `dst` must be
/// contiguous and have exactly the tensor's shape; otherwise, or for another dtype, throws
/// megatrain::Error naming the file, the tensor and both shapes before writing anything. Streams
/// from the mapping in cache-sized chunks (in parallel for large tensors): no intermediate copy.
void read_into(const TensorRef& src, View<float> dst);
void read_into(const TensorRef& src, View<double> dst);

/// Refuses values read from `ref` that hold NaN or an infinity, naming the tensor, its file, the
/// count and the first: such a checkpoint comes from a run that diverged or from a corrupt file,
/// and a model trained from it is poisoned from the first step.
inline void check_finite(const TensorRef& ref, std::span<const float> v) {
  const FiniteScan s = scan_finite(v);
  MT_CHECK(s.ok(),
           "tensor '{}' in '{}' holds {} non-finite value(s) (NaN or infinity; the first at element {}): the checkpoint "
           "is corrupt or was saved from a diverged run, and training from it would spread them to every weight; "
           "load an earlier checkpoint", ref.name(), ref.file->path().string(), s.count, s.first);
}

// ---- writing ----------------------------------------------------------------------------------

/// Produces elements [first, first + out.size()) of a tensor (row-major) as fp32. Called with
/// increasing `first`, from the writing thread. May throw: the write is then abandoned and its
/// target left untouched.
using TensorProducer = std::function<void(std::int64_t first, std::span<float> out)>;

/// One tensor to write: a name, the dtype it is stored as, its shape and where its values come
/// from. A view source must be contiguous; it is either copied as is (same dtype, any dtype) or
/// converted between f32, f64, bf16 and f16 (rounding to nearest even; f64 -> BF16/F16 is
/// refused because it would round twice). A producer supplies fp32 values. Stored bytes (another
/// file's tensor, TensorRef::bytes) are copied as they are: any dtype, any rank.
struct TensorToWrite {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::f32;
  std::vector<std::int64_t> shape;
  std::variant<AnyView, TensorProducer, std::span<const std::byte>> source;

  TensorToWrite() = default;
  /// Stored as `dtype`; shape from the view.
  TensorToWrite(std::string tensor_name, AnyView view, SafetensorsDType stored_as);
  /// Stored in the view's own dtype.
  TensorToWrite(std::string tensor_name, AnyView view);
  /// Values from `producer` (fp32), stored as `dtype`.
  TensorToWrite(std::string tensor_name, std::vector<std::int64_t> tensor_shape, SafetensorsDType stored_as,
                TensorProducer producer);
  /// Another file's tensor, byte for byte: its dtype and shape (the mapping must outlive the write).
  TensorToWrite(std::string tensor_name, const TensorBytes& stored);
};

/// Writes one safetensors file at `path`, atomically: the data goes to a temporary file beside it
/// (`<name>.partial-<random>`, locked while it is written; temporary files of dead writers of the
/// same target are removed first), which is fsynced, renamed over `path`, and the directory fsynced.
/// Everything that can be checked beforehand is (names non-empty, unique, valid UTF-8 and not
/// "__metadata__"; supported conversions; contiguous sources; sizes), and throws before any file
/// is created. A later failure (an I/O error, a producer that throws) removes the temporary file
/// and leaves an existing `path` untouched. Tensors are laid out by element size, largest first,
/// keeping the given order otherwise, so that with the header padded to a multiple of 8 bytes
/// every tensor is naturally aligned in the file; header entries follow the same order.
void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// One file a writer produced: its name inside the directory, size and XXH3-128 digest.
struct WrittenFile {
  std::string name;
  std::uint64_t bytes = 0;
  Digest128 digest;
};

struct ShardedWriteOptions {
  /// Tensors are packed in the given order into shards of at most this many data bytes; a
  /// tensor larger than this gets a shard of its own. (Hugging Face's default is 5 GB.)
  std::uint64_t max_shard_bytes = 5'000'000'000;
  /// Written as every shard's "__metadata__". Transformers expects {"format": "pt"}.
  std::map<std::string, std::string> metadata;
  /// Small files written into the same set (e.g. "config.json" -> its text): file name -> bytes.
  std::map<std::string, std::string> extra_files;
  /// The shard files' names: `<base_name>.safetensors`, or `<base_name>-00001-of-0000N.safetensors`
  /// with `<base_name>.safetensors.index.json`. Hugging Face's is "model".
  std::string base_name = "model";
  /// Carry the other files of an existing `dir` into the new one (see write_safetensors_sharded).
  bool carry_other_files = true;
  /// Called once every shard, the index and the extra files are written, with each one's name,
  /// size and digest; the small files it returns are written too (e.g. a manifest of checksums).
  std::function<std::map<std::string, std::string>(std::span<const WrittenFile>)> finalize;
};

/// Writes a checkpoint directory: `model-00001-of-0000N.safetensors` ... and
/// `model.safetensors.index.json` ({"metadata": {"total_size": bytes of tensor data},
/// "weight_map": {...}}), or a single `model.safetensors` when everything fits in one shard;
/// plus `options.extra_files`. The set replaces `dir` atomically as a reader sees it:
///
///  0. what dead writers of `dir` left beside it (`<dir>.partial-*`, `<dir>.old-*`, ...) is
///     removed; what a live writer is writing is left alone (detail/atomic_files.hpp);
///  1. all files are written and fsynced in a fresh sibling `<dir>.partial-<random>`, locked;
///  2. if `dir` exists, its files that are not safetensors weights (config.json, tokenizer
///     files, ...) and that the new set does not overwrite are carried over as hard links
///     (copies where the file system refuses links); its old shards and index are not;
///  3. the new directory takes `dir`'s place: with renameat2(RENAME_EXCHANGE) in one atomic
///     step where the file system supports it, else by renaming `dir` to `<dir>.old-<random>`
///     and then the new one to `dir`;
///  4. the old directory is deleted (a failure to delete it is only a warning).
///
/// A crash during 1-2 leaves `dir` untouched and a stray `<dir>.partial-*`, which the next writer
/// of `dir` removes; after the exchange in 3, `dir` is complete and new. Only in the two-rename
/// fallback, a crash between the renames leaves no `dir` at all, with the previous model complete
/// in `<dir>.old-*`, which the next writer puts back; never a half-written model at `dir`.
/// An existing `dir` that holds a subdirectory, or is not a directory, is refused before anything
/// is written (this function never deletes a tree it did not write). Validation as in
/// write_safetensors; any failure before 3 removes `<dir>.partial-*` and leaves `dir` untouched.
/// Returns every file written (not the carried ones), in the order written.
std::vector<WrittenFile> write_safetensors_sharded(const std::filesystem::path& dir, std::span<const TensorToWrite> tensors,
                                                   const ShardedWriteOptions& options = {});

/// write_safetensors_sharded in its phases, for a set that several writers fill together: the
/// processes of a run, each writing the shards of its own tensors into one staging directory that
/// the first creates and, once every shard is written, completes and puts in place (the steps
/// above). Every writer builds the same ShardedWrite from the same names, shapes and dtypes (the
/// values of tensors another writer writes are never read) and the same options.
class ShardedWrite {
 public:
  /// Checks and plans, without I/O (throws as write_safetensors_sharded does). `writer_of[i]`:
  /// which writer writes tensors[i], non-decreasing from 0 (empty: one writer, 0); a shard holds
  /// the tensors of one writer. `tensors` must outlive this object.
  ShardedWrite(const std::filesystem::path& dir, std::span<const TensorToWrite> tensors, ShardedWriteOptions options,
               std::vector<int> writer_of = {});
  ~ShardedWrite();
  ShardedWrite(const ShardedWrite&) = delete;
  ShardedWrite& operator=(const ShardedWrite&) = delete;

  std::size_t num_shards() const;
  /// The writer of shard s, and its file name.
  int shard_writer(std::size_t s) const;
  const std::string& shard_name(std::size_t s) const;
  /// The first writer: removes what dead writers of `dir` left, checks what `dir` holds, creates
  /// the staging directory (locked until this object goes; removed unless commit() put it in place).
  void stage();
  /// The staging directory's key (after stage()): what the other writers attach() with.
  std::uint32_t staging_key() const;
  /// The other writers: the staging directory the first created. Throws naming it where this
  /// process does not see it (another file system).
  void attach(std::uint32_t key);
  /// Writes writer w's shards into the staging directory (stage() or attach() first); returns each
  /// one's name, size and digest, in shard order.
  std::vector<WrittenFile> write_shards(int w) const;
  /// The first writer, once every writer's shards are written (`shards`: all of them, in shard
  /// order): writes the index, the extra files and the finalizer's, carries the old set's other
  /// files, fsyncs and puts the set at `dir`. Returns every file written, shards first.
  std::vector<WrittenFile> commit(std::vector<WrittenFile> shards);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// How write_safetensors_sharded groups tensors (indices into `tensors`, in order) into shards.
std::vector<std::vector<std::size_t>> plan_safetensors_shards(std::span<const TensorToWrite> tensors,
                                                              std::uint64_t max_shard_bytes);

}  // namespace megatrain::io
