// Train-state checkpoints (see include/megatrain/io/train_checkpoint.hpp).
#include "megatrain/io/train_checkpoint.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <optional>
#include <array>
#include <set>

#include "megatrain/core/finite.hpp"
#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
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

namespace {

// Announces every unit not yet announced, once (on success as on failure: the destructor).
struct Announcer {
  Announcer(std::function<void(std::size_t)> f, std::size_t units) : fn(std::move(f)), done(units, 0) {}
  Announcer(const Announcer&) = delete;
  Announcer& operator=(const Announcer&) = delete;
  void operator()(std::size_t u) {
    {
      std::lock_guard lock(m);
      if (done[u]) return;
      done[u] = 1;
    }
    if (fn) fn(u);
  }
  void all() {
    for (std::size_t u = 0; u < done.size(); ++u) (*this)(u);
  }
  ~Announcer() { all(); }
  std::function<void(std::size_t)> fn;
  std::vector<char> done;
  std::mutex m;
};

/// The caller's unit order, checked (empty: the store's).
std::vector<std::size_t> unit_order(const fs::path& dir, const HostParamStore<float>& store,
                                    const TrainCheckpointWriteOptions& options) {
  MT_CHECK(store.has_optimizer_state(), "writing '{}': the store keeps no optimizer state (StoreOptions::optimizer_state "
           "false), and a checkpoint holds it; export the weights instead", dir.string());
  MT_CHECK(options.state.is_object(), "writing '{}': the train state must be a JSON object", dir.string());
  std::vector<std::size_t> order = options.unit_order;
  if (order.empty())
    for (std::size_t u = 0; u < store.num_units(); ++u) order.push_back(u);
  std::vector<std::size_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  bool each_once = sorted.size() == store.num_units();
  for (std::size_t i = 0; each_once && i < sorted.size(); ++i) each_once = sorted[i] == i;
  MT_CHECK(each_once, "writing '{}': the unit order must name each of the store's {} units once", dir.string(),
           store.num_units());
  return order;
}

/// The tensor files of a checkpoint: for each of `writers` processes in turn (one: the whole
/// state), unit by unit in `order`, each parameter's master, exp_avg and exp_avg_sq over that
/// process's part of the unit: the whole tensor under its name where the part holds all of it, a
/// piece "<name>@<first>" where it holds some. Only process `me`'s values are read (from `store`);
/// its last tensor of a unit announces the unit once copied; units it holds nothing of are
/// announced at once.
struct StateTensors {
  std::vector<TensorToWrite> tensors;
  std::vector<int> writer_of;
};

StateTensors state_tensors(const HostParamStore<float>& store, std::span<const std::size_t> order, int writers, int me,
                           Announcer& announce) {
  StateTensors out;
  std::vector<char> has_mine(store.num_units(), 0);
  for (int w = 0; w < writers; ++w)
    for (const std::size_t u : order) {
      const auto& unit = store.unit(u);
      const auto bounds = HostParamStore<float>::shard_bounds(unit.numel(), writers);
      const std::int64_t lo = bounds[static_cast<std::size_t>(w)], hi = bounds[static_cast<std::size_t>(w) + 1];
      const std::size_t first_of_unit = out.tensors.size();
      for (const auto& param : unit.params()) {
        const std::int64_t a = std::max(lo, param.offset), b = std::min(hi, param.offset + param.numel());
        if (a >= b) continue;
        const bool whole = a == param.offset && b == param.offset + param.numel();
        const std::vector<std::int64_t> shape =
            whole ? std::vector<std::int64_t>(param.spec.shape.dims().begin(), param.spec.shape.dims().end())
                  : std::vector<std::int64_t>{b - a};
        const std::pair<std::string_view, std::span<const float>> kinds[] = {
            {"", unit.master()}, {kExpAvg, unit.adam_m()}, {kExpAvgSq, unit.adam_v()}};
        for (const auto& [kind, slab] : kinds) {
          std::string name = param.spec.name;
          name += kind;
          if (!whole) name += fmt::format("{}{}", kPieceSeparator, a - param.offset);
          if (w != me) {  // (another process writes it: only its name, shape and dtype count here)
            out.tensors.emplace_back(std::move(name), shape, SafetensorsDType::f32, [](std::int64_t, std::span<float>) {
              MT_FAIL("unreachable: another process's tensor");
            });
          } else {
            const std::span<const float> values = slab.subspan(static_cast<std::size_t>(a), static_cast<std::size_t>(b - a));
            out.tensors.emplace_back(std::move(name), shape, SafetensorsDType::f32, [values](std::int64_t f, std::span<float> o) {
              std::copy_n(values.begin() + f, o.size(), o.begin());
            });
          }
          out.writer_of.push_back(w);
        }
      }
      if (w != me || out.tensors.size() == first_of_unit) continue;
      has_mine[u] = 1;
      // (the unit's last tensor announces it once its last chunk is copied)
      auto& last = std::get<TensorProducer>(out.tensors.back().source);
      const auto n = static_cast<std::size_t>(
          std::accumulate(out.tensors.back().shape.begin(), out.tensors.back().shape.end(), std::int64_t{1}, std::multiplies<>()));
      last = [copy = std::move(last), n, u, &announce](std::int64_t f, std::span<float> o) {
        copy(f, o);
        if (static_cast<std::size_t>(f) + o.size() == n) announce(u);
      };
    }
  for (std::size_t u = 0; u < store.num_units(); ++u)
    if (!has_mine[u]) announce(u);
  return out;
}

ShardedWriteOptions set_options(const fs::path& dir, const TrainCheckpointWriteOptions& options) {
  ShardedWriteOptions w;
  w.max_shard_bytes = options.max_shard_bytes;
  w.base_name = std::string(kTrainStateShards);
  w.metadata = {{"format", "megatrain-train-state"}};
  w.carry_other_files = false;
  w.extra_files = options.extra_files;
  MT_CHECK(!w.extra_files.contains(std::string(kTrainStateFile)) && !w.extra_files.contains(std::string(kChecksumsFile)),
           "writing '{}': {} and {} are written by the checkpoint itself", dir.string(), kTrainStateFile, kChecksumsFile);
  w.extra_files.emplace(kTrainStateFile, options.state.dump(2) + "\n");
  w.finalize = [](std::span<const WrittenFile> files) {
    fault::crash_point("checkpoint:checksums");
    return std::map<std::string, std::string>{{std::string(kChecksumsFile), checksums_text(files)}};
  };
  return w;
}

}  // namespace

std::vector<WrittenFile> write_train_checkpoint(const fs::path& dir, const HostParamStore<float>& store,
                                                const TrainCheckpointWriteOptions& options) {
  MT_NVTX_RANGE("io::write_train_checkpoint");
  const auto order = unit_order(dir, store, options);
  // (With unit_done the caller orders the writes with the updates unit by unit: the Checkpointer.)
  if (!options.unit_done) store.check_settled(fmt::format("writing '{}'", dir.string()));
  MT_CHECK(store.state_whole(), "writing '{}': the store keeps part {} of {} of the optimizer state (ZeRO-1): write it "
           "from every process (write_train_checkpoint with the communicator, or the Checkpointer's), or gather it first "
           "(HostParamStore::gather_state on every process) and write on the root", dir.string(),
           store.shard().index, store.shard().count);
  Announcer announce(options.unit_done, store.num_units());
  const StateTensors t = state_tensors(store, order, 1, 0, announce);
  return write_safetensors_sharded(dir, t.tensors, set_options(dir, options));
}

// ---- written by every process ---------------------------------------------------------------------

struct PartedCheckpointWrite::Impl {
  Impl(const fs::path& d, const HostParamStore<float>& s, TrainCheckpointWriteOptions o, dist::HostComm& c)
      : dir(d), comm(c), options(std::move(o)), announce(options.unit_done, s.num_units()) {}
  fs::path dir;
  dist::HostComm& comm;
  TrainCheckpointWriteOptions options;
  Announcer announce;
  StateTensors tensors;
  std::optional<ShardedWrite> set;
  std::vector<WrittenFile> mine;
  std::string error;  // this process's failure in write_part
};

void agree_on(dist::HostComm& comm, bool here, const std::function<void()>& fn,
              const std::function<std::string(const std::vector<int>& failed)>& elsewhere) {
  std::string error;
  if (here) {
    try {
      fn();
    } catch (const Error& e) {
      error = e.reason();
    } catch (const std::exception& e) {  // (every process must reach the collective below)
      error = e.what();
    }
  }
  // (every rank's flag in its slot, summed: which ranks failed, in rank order)
  std::vector<std::int64_t> flags(static_cast<std::size_t>(comm.world()), 0);
  flags[static_cast<std::size_t>(comm.rank())] = error.empty() ? 0 : 1;
  comm.all_reduce_sum(flags);
  std::vector<int> failed;
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r] != 0) failed.push_back(static_cast<int>(r));
  if (failed.empty()) return;
  if (!error.empty()) MT_FAIL("{}", error);
  throw OtherProcessFailed("megatrain", elsewhere(failed), __FILE__, __LINE__);
}

PartedCheckpointWrite::PartedCheckpointWrite(const fs::path& dir, const HostParamStore<float>& store,
                                             TrainCheckpointWriteOptions options, dist::HostComm& comm)
    : impl_(std::make_unique<Impl>(dir, store, std::move(options), comm)) {
  MT_NVTX_RANGE("io::PartedCheckpointWrite");
  Impl& m = *impl_;
  const int world = comm.world(), rank = comm.rank();
  MT_CHECK(store.shard().count == world && store.shard().index == rank,
           "writing '{}': the store is part {} of {}, the communicator's process {} of {}", dir.string(),
           store.shard().index, store.shard().count, rank, world);
  const auto order = unit_order(dir, store, m.options);
  if (!m.options.unit_done) store.check_settled(fmt::format("writing '{}'", dir.string()));
  m.tensors = state_tensors(store, order, world, rank, m.announce);
  m.set.emplace(dir, m.tensors.tensors, set_options(dir, m.options), m.tensors.writer_of);
  // Every process planned the same files (the collectives below and in finish() exchange one slot
  // a file): a digest of the plan, every process's in its slot, compared with the first's.
  {
    Hasher h;
    const auto add = [&](const std::string& text) {  // (with its terminating zero: names stay apart)
      h.update(std::as_bytes(std::span<const char>(text.c_str(), text.size() + 1)));
    };
    for (std::size_t f = 0; f < m.set->num_shards(); ++f) add(fmt::format("{} {}", m.set->shard_name(f), m.set->shard_writer(f)));
    for (const auto& t : m.tensors.tensors) add(t.name);
    std::vector<std::int64_t> plans(2 * static_cast<std::size_t>(world), 0);
    std::memcpy(&plans[2 * static_cast<std::size_t>(rank)], h.digest().bytes.data(), 16);
    comm.all_reduce_sum(plans);
    std::vector<int> other;
    for (int r = 1; r < world; ++r)
      if (plans[2 * static_cast<std::size_t>(r)] != plans[0] || plans[2 * static_cast<std::size_t>(r) + 1] != plans[1])
        other.push_back(r);
    MT_CHECK(other.empty(), "writing '{}': process(es) {} planned other files than process 0 (another model, store or "
             "unit order): every process must save the same run at the same step", dir.string(), fmt::join(other, ", "));
  }
  // The first process stages the folder; the others find it (one file system).
  const std::string label = dir.string();
  std::int64_t key[1] = {0};
  agree_on(comm, rank == 0, [&] {
    m.set->stage();
    key[0] = m.set->staging_key();
  }, [&](const std::vector<int>&) { return fmt::format("writing '{}': process 0 could not prepare the folder (its "
                                                       "message says why)", label); });
  comm.all_reduce_sum(key);
  agree_on(comm, rank != 0, [&] { m.set->attach(static_cast<std::uint32_t>(key[0])); },
           [&](const std::vector<int>& blind) {
             return fmt::format("writing '{}': process(es) {} do not see the folder that process 0 prepared: the "
                                "processes of a run must share one file system for its checkpoints", label,
                                fmt::join(blind, ", "));
           });
}

PartedCheckpointWrite::~PartedCheckpointWrite() = default;

void PartedCheckpointWrite::write_part() noexcept {
  Impl& m = *impl_;
  try {
    m.mine = m.set->write_shards(m.comm.rank());
    fault::crash_point(fmt::format("checkpoint:part:{}", m.comm.rank()));
  } catch (const Error& e) {
    m.error = e.reason();
  } catch (const std::exception& e) {
    m.error = e.what();
  }
  m.announce.all();
}

std::vector<WrittenFile> PartedCheckpointWrite::finish() {
  MT_NVTX_RANGE("io::PartedCheckpointWrite::finish");
  Impl& m = *impl_;
  const int rank = m.comm.rank();
  const std::string label = m.dir.string();
  agree_on(m.comm, !m.error.empty(), [&] { MT_FAIL("{}", m.error); }, [&](const std::vector<int>& failed) {
    return fmt::format("writing '{}': process(es) {} could not write their part (their messages say why)", label,
                       fmt::join(failed, ", "));
  });
  // Every shard's size and digest, from the process that wrote it.
  const std::size_t n = m.set->num_shards();
  std::vector<std::int64_t> listed(3 * n, 0);
  for (std::size_t s = 0, i = 0; s < n; ++s) {
    if (m.set->shard_writer(s) != rank) continue;
    const WrittenFile& f = m.mine.at(i++);
    listed[3 * s] = static_cast<std::int64_t>(f.bytes);
    std::memcpy(&listed[3 * s + 1], f.digest.bytes.data(), 16);
  }
  m.comm.all_reduce_sum(listed);
  std::vector<WrittenFile> files(n);
  for (std::size_t s = 0; s < n; ++s) {
    files[s].name = m.set->shard_name(s);
    files[s].bytes = static_cast<std::uint64_t>(listed[3 * s]);
    std::memcpy(files[s].digest.bytes.data(), &listed[3 * s + 1], 16);
  }
  agree_on(m.comm, rank == 0, [&] { files = m.set->commit(std::move(files)); }, [&](const std::vector<int>&) {
    return fmt::format("writing '{}': process 0 could not complete it (its message says why)", label);
  });
  return files;
}

std::vector<WrittenFile> write_train_checkpoint(const fs::path& dir, const HostParamStore<float>& store,
                                                const TrainCheckpointWriteOptions& options, dist::HostComm& comm) {
  PartedCheckpointWrite w(dir, store, options, comm);
  w.write_part();
  return w.finish();
}

namespace {
fs::path probe_path(const fs::path& root, std::int64_t key) {
  return root / fmt::format("probe.partial-{:08x}", static_cast<std::uint32_t>(key));
}
}  // namespace

std::int64_t shared_folder_probe(const fs::path& root) {
  const std::int64_t key = static_cast<std::int64_t>(std::stoul(detail::random_suffix(), nullptr, 16));
  detail::OutputFile out(probe_path(root, key));
  out.write("megatrain: do the processes of the run see this folder?\n");
  out.finish();
  out.keep();
  detail::fsync_directory(root);
  return key;
}

bool sees_folder_probe(const fs::path& root, std::int64_t key) {
  std::error_code ec;
  return fs::is_regular_file(probe_path(root, key), ec);
}

void remove_folder_probe(const fs::path& root, std::int64_t key) {
  std::error_code ec;
  fs::remove(probe_path(root, key), ec);
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

namespace {

/// The pieces of tensors that processes' parts divided ("<name>@<first element>", written by
/// PartedCheckpointWrite): name -> first element -> the piece.
using PieceNames = std::map<std::string, std::map<std::int64_t, std::string>, std::less<>>;
PieceNames piece_names(const SafetensorsCheckpoint& tensors) {
  PieceNames pieces;
  for (const std::string& name : tensors.names()) {
    const auto at = name.rfind(kPieceSeparator);
    if (at == std::string::npos) continue;
    std::int64_t first = -1;
    const char* const end = name.data() + name.size();
    const auto [ptr, err] = std::from_chars(name.data() + at + 1, end, first);
    if (err != std::errc{} || ptr != end || first < 0 || at + 1 == name.size()) continue;
    pieces[name.substr(0, at)].emplace(first, name);
  }
  return pieces;
}

}  // namespace

void TrainCheckpoint::load_into(HostParamStore<float>& store) const {
  MT_NVTX_RANGE("io::TrainCheckpoint::load_into");
  store.check_settled(fmt::format("loading '{}'", dir_.string()));
  const std::string index = std::string(kTrainStateShards) + ".safetensors.index.json";
  const SafetensorsCheckpoint tensors =
      SafetensorsCheckpoint::open(listed_.contains(index) ? dir_ / index : dir_ / (std::string(kTrainStateShards) + ".safetensors"));
  const std::string label = fmt::format("loading checkpoint '{}'", dir_.string());
  const PieceNames pieces = piece_names(tensors);
  // Everything is checked before anything is written: every parameter's three tensors, whole or
  // in pieces that tile it, F32 and of its shape.
  struct Copy {
    TensorRef ref;
    std::size_t unit;
    int kind;            // 0 master, 1 exp_avg, 2 exp_avg_sq
    std::int64_t first;  // in the unit's elements
    std::int64_t count;
  };
  std::vector<Copy> copies;
  std::size_t expected = 0;
  for (std::size_t u = 0; u < store.num_units(); ++u)
    for (const auto& p : store.unit(u).params()) {
      int k = 0;
      for (const std::string_view kind : {std::string_view{}, kExpAvg, kExpAvgSq}) {
        const std::string name = p.spec.name + std::string(kind);
        const auto checked = [&](const TensorRef& ref, std::span<const std::int64_t> shape, const std::string& what) {
          const TensorInfo& info = *ref.info;
          MT_CHECK(info.dtype == SafetensorsDType::f32, "{}: tensor '{}' is {}, not F32", label, ref.name(),
                   safetensors_dtype_name(info.dtype));
          MT_CHECK(std::equal(info.shape.begin(), info.shape.end(), shape.begin(), shape.end()),
                   "{}: tensor '{}' has shape {} but {}", label, ref.name(), info.shape_str(), what);
          ++expected;
        };
        if (const auto ref = tensors.find(name)) {
          MT_CHECK(!pieces.contains(name), "{}: tensor '{}' is there whole and in pieces", label, name);
          checked(*ref, p.spec.shape.dims(), fmt::format("the model's is {}", p.spec.shape.str()));
          copies.push_back({*ref, u, k, p.offset, p.numel()});
        } else {
          const auto it = pieces.find(name);
          MT_CHECK(it != pieces.end(), "{}: it has no tensor '{}' (it was saved from another model)", label, name);
          std::int64_t next = 0;
          for (const auto& [first, piece] : it->second) {
            const TensorRef part = tensors.tensor(piece);
            const std::int64_t n = part.info->shape.size() == 1 ? part.info->shape[0] : -1;
            MT_CHECK(first == next && n > 0 && first + n <= p.numel(),
                     "{}: the pieces of tensor '{}' do not tile its {} elements (piece '{}' of shape {} where element {} "
                     "comes next)", label, name, p.numel(), piece, part.info->shape_str(), next);
            checked(part, std::array<std::int64_t, 1>{n}, "a piece is 1-D");
            copies.push_back({part, u, k, p.offset + first, n});
            next = first + n;
          }
          MT_CHECK(next == p.numel(), "{}: the pieces of tensor '{}' end at element {} of its {}: the checkpoint misses "
                   "a process's part", label, name, next, p.numel());
        }
        ++k;
      }
    }
  MT_CHECK(tensors.size() == expected, "{}: it holds {} tensors, the model needs {} (it was saved from another model)",
           label, tensors.size(), expected);
  // (a store that is never stepped keeps no moments: the masters alone are read)
  if (!store.has_optimizer_state()) std::erase_if(copies, [](const Copy& c) { return c.kind != 0; });
  // A NaN or an infinity in a weight or a moment (a corrupt file, or a state saved from a run that
  // diverged) is refused before anything is written, naming the tensor.
  std::vector<FiniteScan> bad(copies.size());
  tbb::parallel_for(std::size_t{0}, copies.size(), [&](std::size_t i) { bad[i] = scan_finite(copies[i].ref.bytes().bytes); });
  for (std::size_t i = 0; i < copies.size(); ++i)
    MT_CHECK(bad[i].ok(),
             "{}: tensor '{}' in '{}' holds {} non-finite value(s) (NaN or infinity; the first at element {}): the "
             "checkpoint is corrupt or was saved from a diverged run; resume from an earlier checkpoint",
             label, copies[i].ref.name(), copies[i].ref.file->path().string(), bad[i].count, bad[i].first);
  // Unit by unit: the masters whole (the store refreshes the unit's bf16 copy from them, and a
  // store whose masters are sharded then gives back those outside its parts, so that a process
  // never holds more than one unit's other masters); the moments whole, or (ZeRO-1: the
  // checkpoint may come from any number of processes) of this process's part only.
  const auto copy = [&](std::size_t i) {
    const Copy& c = copies[i];
    const auto& unit = store.unit(c.unit);
    const std::span<float> slab = c.kind == 0 ? unit.master() : c.kind == 1 ? unit.adam_m() : unit.adam_v();
    std::int64_t lo = c.first, hi = c.first + c.count;
    if (c.kind != 0 && store.sharded()) {
      lo = std::max(lo, unit.owned().first);
      hi = std::min(hi, unit.owned().second);
    }
    if (lo >= hi) return;
    const TensorBytes bytes = c.ref.bytes();
    std::memcpy(slab.data() + lo, bytes.bytes.data() + static_cast<std::size_t>(lo - c.first) * sizeof(float),
                static_cast<std::size_t>(hi - lo) * sizeof(float));
  };
  for (std::size_t first = 0; first < copies.size();) {  // (copies are in unit order)
    std::size_t last = first;
    while (last < copies.size() && copies[last].unit == copies[first].unit) ++last;
    tbb::parallel_for(first, last, copy);
    store.sync_compute(store.unit(copies[first].unit));
    first = last;
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
  fault::crash_point("checkpoint:latest");
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
