// Train-state checkpoints (see include/megatrain/io/train_checkpoint.hpp).
#include "megatrain/io/train_checkpoint.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "megatrain/core/finite.hpp"
#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::string_view kExpAvg = ".exp_avg", kExpAvgSq = ".exp_avg_sq";

/// "<32 hex>  <name>" lines.
std::string checksums_text(std::span<const WrittenFile> files) {
  std::string out;
  for (const auto& f : files) out += fmt::format("{}  {}\n", f.digest.hex(), f.name);
  return out;
}

struct Listed {
  std::string name;
  Digest128 digest;
};

std::vector<Listed> parse_checksums(std::string_view text, const std::string& label) {
  std::vector<Listed> out;
  std::set<std::string, std::less<>> seen;
  std::size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const auto nl = text.find('\n');
    MT_CHECK(nl != std::string_view::npos, "'{}' line {}: the line has no end (the file is truncated)", label, line_no);
    const std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    const auto digest = line.size() > 34 ? Digest128::from_hex(line.substr(0, 32)) : std::nullopt;
    MT_CHECK(digest && line.substr(32, 2) == "  ", "'{}' line {} is not \"<32 hex digits>  <file name>\"", label, line_no);
    const std::string name(line.substr(34));
    MT_CHECK(name.find('/') == std::string::npos && name != "." && name != ".." && name != kChecksumsFile,
             "'{}' line {} names '{}', which is not a file of the checkpoint", label, line_no, name);
    MT_CHECK(seen.insert(name).second, "'{}' lists '{}' twice", label, name);
    out.push_back({name, *digest});
  }
  MT_CHECK(!out.empty(), "'{}' is empty", label);
  return out;
}

}  // namespace

// ---- writing ------------------------------------------------------------------------------------

std::vector<WrittenFile> write_train_checkpoint(const fs::path& dir, const HostParamStore<float>& store,
                                                const TrainCheckpointWriteOptions& options) {
  MT_NVTX_RANGE("io::write_train_checkpoint");
  MT_CHECK(options.state.is_object(), "writing '{}': the train state must be a JSON object", dir.string());
  // (With unit_done the caller orders the writes with the updates unit by unit: the Checkpointer.)
  if (!options.unit_done) store.check_settled(fmt::format("writing '{}'", dir.string()));
  MT_CHECK(store.state_whole(), "writing '{}': the store keeps part {} of {} of the optimizer state (ZeRO-1): gather it "
           "first (HostParamStore::gather_state on every process) and write on the root", dir.string(),
           store.shard().index, store.shard().count);
  std::vector<std::size_t> order = options.unit_order;
  if (order.empty())
    for (std::size_t u = 0; u < store.num_units(); ++u) order.push_back(u);
  {
    std::vector<std::size_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    bool each_once = sorted.size() == store.num_units();
    for (std::size_t i = 0; each_once && i < sorted.size(); ++i) each_once = sorted[i] == i;
    MT_CHECK(each_once, "writing '{}': the unit order must name each of the store's {} units once", dir.string(),
             store.num_units());
  }

  // Announces every unit not yet announced, once (on success as on failure).
  struct Announcer {
    const std::function<void(std::size_t)>& fn;
    std::vector<char> done;
    std::mutex m;
    void operator()(std::size_t u) {
      {
        std::lock_guard lock(m);
        if (done[u]) return;
        done[u] = 1;
      }
      if (fn) fn(u);
    }
    ~Announcer() {
      for (std::size_t u = 0; u < done.size(); ++u) (*this)(u);
    }
  } announce{options.unit_done, std::vector<char>(store.num_units(), 0), {}};

  // Unit by unit in the given order: each parameter's master, exp_avg, exp_avg_sq. The last
  // tensor's producer announces the unit once it has copied its last chunk.
  std::vector<TensorToWrite> tensors;
  for (const std::size_t u : order) {
    const auto& unit = store.unit(u);
    const auto params = unit.params();
    for (std::size_t p = 0; p < params.size(); ++p) {
      const auto& param = params[p];
      const std::vector<std::int64_t> shape(param.spec.shape.dims().begin(), param.spec.shape.dims().end());
      const auto offset = static_cast<std::size_t>(param.offset), n = static_cast<std::size_t>(param.numel());
      const std::pair<std::string, std::span<const float>> kinds[] = {
          {param.spec.name, std::span<const float>(unit.master()).subspan(offset, n)},
          {param.spec.name + std::string(kExpAvg), std::span<const float>(unit.adam_m()).subspan(offset, n)},
          {param.spec.name + std::string(kExpAvgSq), std::span<const float>(unit.adam_v()).subspan(offset, n)}};
      for (std::size_t k = 0; k < 3; ++k) {
        const bool last = p + 1 == params.size() && k == 2;
        const std::span<const float> values = kinds[k].second;
        tensors.emplace_back(kinds[k].first, shape, SafetensorsDType::f32,
                             [values, last, u, &announce](std::int64_t first, std::span<float> out) {
                               std::copy_n(values.begin() + first, out.size(), out.begin());
                               if (last && static_cast<std::size_t>(first) + out.size() == values.size()) announce(u);
                             });
      }
    }
  }

  json state = options.state;
  ShardedWriteOptions w;
  w.max_shard_bytes = options.max_shard_bytes;
  w.base_name = std::string(kTrainStateShards);
  w.metadata = {{"format", "megatrain-train-state"}};
  w.carry_other_files = false;
  w.extra_files = options.extra_files;
  MT_CHECK(!w.extra_files.contains(std::string(kTrainStateFile)) && !w.extra_files.contains(std::string(kChecksumsFile)),
           "writing '{}': {} and {} are written by the checkpoint itself", dir.string(), kTrainStateFile, kChecksumsFile);
  w.extra_files.emplace(kTrainStateFile, state.dump(2) + "\n");
  w.finalize = [](std::span<const WrittenFile> files) {
    detail::crash_point("checkpoint:checksums");
    return std::map<std::string, std::string>{{std::string(kChecksumsFile), checksums_text(files)}};
  };
  return write_safetensors_sharded(dir, tensors, w);
}

// ---- reading ------------------------------------------------------------------------------------

TrainCheckpoint TrainCheckpoint::open(const fs::path& dir, bool verify) {
  MT_NVTX_RANGE("io::TrainCheckpoint::open");
  std::error_code ec;
  MT_CHECK(fs::is_directory(dir, ec), "checkpoint '{}' does not exist or is not a folder", dir.string());
  const fs::path sums = dir / kChecksumsFile;
  MT_CHECK(fs::is_regular_file(sums, ec),
           "checkpoint '{}' has no {}: it is not a megatrain train-state checkpoint, or it is incomplete", dir.string(),
           kChecksumsFile);
  const std::vector<Listed> listed = parse_checksums(detail::read_file(sums), sums.string());

  TrainCheckpoint c;
  c.dir_ = dir;
  for (const auto& f : listed) {
    const fs::path p = dir / f.name;
    const auto size = fs::file_size(p, ec);
    MT_CHECK(!ec, "checkpoint '{}': '{}' is listed in {} but cannot be read: {}", dir.string(), f.name, kChecksumsFile,
             ec.message());
    c.listed_.emplace(f.name, size);
  }
  if (verify) {
    std::vector<std::string> bad(listed.size());
    tbb::parallel_for(std::size_t{0}, listed.size(), [&](std::size_t i) {
      try {
        const Digest128 d = digest_file(dir / listed[i].name);
        if (d != listed[i].digest)
          bad[i] = fmt::format("'{}' does not match its checksum in {} (the file is truncated or altered: {} expected, "
                               "{} found)",
                               (dir / listed[i].name).string(), kChecksumsFile, listed[i].digest.hex(), d.hex());
      } catch (const Error& e) {
        bad[i] = e.reason();
      }
    });
    for (const auto& b : bad)
      MT_CHECK(b.empty(), "checkpoint '{}' is damaged: {}; resume from another checkpoint", dir.string(), b);
  }
  MT_CHECK(c.listed_.contains(kTrainStateFile), "checkpoint '{}': {} does not list {}", dir.string(), kChecksumsFile,
           kTrainStateFile);
  try {
    c.state_ = json::parse(detail::read_file(dir / kTrainStateFile));
  } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
    MT_FAIL("checkpoint '{}': {} is malformed JSON: {}", dir.string(), kTrainStateFile, e.what());
  }
  MT_CHECK(c.state_.is_object(), "checkpoint '{}': {} is not a JSON object", dir.string(), kTrainStateFile);
  // The tensor files: every one the index names must be listed (and so checked).
  const std::string single = std::string(kTrainStateShards) + ".safetensors";
  const std::string index = std::string(kTrainStateShards) + ".safetensors.index.json";
  std::vector<std::string> shards;
  if (c.listed_.contains(index)) {
    for (const auto& [tensor, shard] : parse_safetensors_index(detail::read_file(dir / index), (dir / index).string()))
      if (std::find(shards.begin(), shards.end(), shard) == shards.end()) shards.push_back(shard);
  } else {
    MT_CHECK(c.listed_.contains(single), "checkpoint '{}': {} lists neither {} nor {}", dir.string(), kChecksumsFile,
             index, single);
    shards.push_back(single);
  }
  for (const auto& s : shards) {
    MT_CHECK(c.listed_.contains(s), "checkpoint '{}': shard '{}' is not listed in {}", dir.string(), s, kChecksumsFile);
    c.tensor_bytes_ += c.listed_.find(s)->second;
  }
  return c;
}

std::optional<std::string> TrainCheckpoint::file(std::string_view name) const {
  if (!listed_.contains(name)) return std::nullopt;
  return detail::read_file(dir_ / name);
}

void TrainCheckpoint::load_into(HostParamStore<float>& store) const {
  MT_NVTX_RANGE("io::TrainCheckpoint::load_into");
  store.check_settled(fmt::format("loading '{}'", dir_.string()));
  const std::string index = std::string(kTrainStateShards) + ".safetensors.index.json";
  const SafetensorsCheckpoint tensors =
      SafetensorsCheckpoint::open(listed_.contains(index) ? dir_ / index : dir_ / (std::string(kTrainStateShards) + ".safetensors"));
  const std::string label = fmt::format("loading checkpoint '{}'", dir_.string());
  // Everything is checked before anything is written.
  std::size_t expected = 0;
  std::vector<TensorRef> refs;
  for (const auto& unit : store.units())
    for (const auto& p : unit.params()) {
      for (const std::string_view kind : {std::string_view{}, kExpAvg, kExpAvgSq}) {
        const std::string name = p.spec.name + std::string(kind);
        const auto ref = tensors.find(name);
        MT_CHECK(ref.has_value(), "{}: it has no tensor '{}' (it was saved from another model)", label, name);
        const TensorInfo& info = *ref->info;
        MT_CHECK(info.dtype == SafetensorsDType::f32, "{}: tensor '{}' is {}, not F32", label, name,
                 safetensors_dtype_name(info.dtype));
        MT_CHECK(std::equal(info.shape.begin(), info.shape.end(), p.spec.shape.dims().begin(), p.spec.shape.dims().end()),
                 "{}: tensor '{}' has shape {} but the model's is {}", label, name, info.shape_str(), p.spec.shape.str());
        refs.push_back(*ref);
        ++expected;
      }
    }
  MT_CHECK(tensors.size() == expected, "{}: it holds {} tensors, the model needs {} (it was saved from another model)",
           label, tensors.size(), expected);
  // A NaN or an infinity in a weight or a moment (a corrupt file, or a state saved from a run that
  // diverged) is refused before anything is written, naming the tensor.
  std::vector<FiniteScan> bad(refs.size());
  tbb::parallel_for(std::size_t{0}, refs.size(), [&](std::size_t i) { bad[i] = scan_finite(refs[i].bytes().bytes); });
  for (std::size_t i = 0; i < refs.size(); ++i)
    MT_CHECK(bad[i].ok(),
             "{}: tensor '{}' in '{}' holds {} non-finite value(s) (NaN or infinity; the first at element {}): the "
             "checkpoint is corrupt or was saved from a diverged run; resume from an earlier checkpoint",
             label, refs[i].name(), refs[i].file->path().string(), bad[i].count, bad[i].first);
  for (auto& unit : store.units()) {
    const auto [lo, hi] = unit.owned();
    for (const auto& p : unit.params()) {
      read_into(tensors.tensor(p.spec.name), store.master(p.spec.name));
      if (!store.sharded()) {
        read_into(tensors.tensor(p.spec.name + std::string(kExpAvg)), store.adam_m(p.spec.name));
        read_into(tensors.tensor(p.spec.name + std::string(kExpAvgSq)), store.adam_v(p.spec.name));
        continue;
      }
      // A sharded store (ZeRO-1): the moments of its part only (the checkpoint may come from any
      // number of processes: it holds them whole). F32, checked above.
      const std::int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel());
      if (a >= b) continue;
      for (const auto& [kind, slab] : {std::pair{kExpAvg, unit.adam_m()}, std::pair{kExpAvgSq, unit.adam_v()}}) {
        const TensorBytes bytes = tensors.tensor(p.spec.name + std::string(kind)).bytes();
        std::memcpy(slab.data() + a, bytes.bytes.data() + static_cast<std::size_t>(a - p.offset) * sizeof(float),
                    static_cast<std::size_t>(b - a) * sizeof(float));
      }
    }
    store.sync_compute(unit);
  }
}

// ---- a run's folder -----------------------------------------------------------------------------

namespace {
constexpr std::string_view kLatest = "latest";
constexpr std::string_view kStepPrefix = "step-";

std::optional<std::int64_t> parse_step_name(std::string_view name) {
  if (!name.starts_with(kStepPrefix) || name.size() < kStepPrefix.size() + 8) return std::nullopt;
  const std::string_view digits = name.substr(kStepPrefix.size());
  std::int64_t step = -1;
  const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (err != std::errc{} || end != digits.data() + digits.size() || step < 0) return std::nullopt;
  return step;
}
}  // namespace

std::string CheckpointFolder::name_for(std::int64_t step) {
  MT_CHECK(step >= 0, "a checkpoint's step must be >= 0 (got {})", step);
  return fmt::format("{}{:08d}", kStepPrefix, step);
}

std::vector<std::pair<std::int64_t, fs::path>> CheckpointFolder::list() const {
  std::vector<std::pair<std::int64_t, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
    const auto step = parse_step_name(it->path().filename().string());
    if (step && it->is_directory(ec)) out.emplace_back(*step, it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<fs::path> CheckpointFolder::latest() const {
  std::error_code ec;
  const fs::path pointer = root_ / kLatest;
  if (fs::is_regular_file(pointer, ec)) {
    std::string name = detail::read_file(pointer);
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
    MT_CHECK(parse_step_name(name).has_value(), "'{}' should name a checkpoint folder (step-NNNNNNNN) but holds '{}'",
             pointer.string(), name);
    MT_CHECK(fs::is_directory(root_ / name, ec), "'{}' names '{}', which is not there; resume from one of the checkpoint "
             "folders in '{}' by its path", pointer.string(), name, root_.string());
    return root_ / name;
  }
  const auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

void CheckpointFolder::prepare() const {
  std::error_code ec;
  fs::create_directories(root_, ec);
  MT_CHECK(!ec, "cannot create the checkpoint folder '{}': {}", root_.string(), ec.message());
  detail::remove_debris_in(root_);
}

void CheckpointFolder::commit(std::int64_t step, std::size_t keep) const {
  MT_NVTX_RANGE("io::CheckpointFolder::commit");
  const std::string name = name_for(step);
  std::error_code ec;
  MT_CHECK(fs::is_directory(root_ / name, ec), "cannot point '{}' at '{}': it is not there", (root_ / kLatest).string(), name);
  detail::write_file_atomically(root_ / kLatest, name + "\n");
  detail::crash_point("checkpoint:latest");
  if (keep == 0) return;
  std::vector<std::pair<std::int64_t, fs::path>> older;
  for (auto& [s, p] : list())
    if (s <= step) older.emplace_back(s, std::move(p));
  while (older.size() > keep) {  // oldest first; `step` itself is the newest and always kept
    detail::retire_directory(older.front().second);
    older.erase(older.begin());
  }
}

}  // namespace megatrain::io
