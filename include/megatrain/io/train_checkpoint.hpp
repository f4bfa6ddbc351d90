// Train-state checkpoints on disk: everything a run needs to continue exactly where it stopped.
//
// A checkpoint is a folder of files, each listed with its XXH3-128 digest in checksums.xxh128:
//
//   train-state-00001-of-0000N.safetensors ...   fp32 tensors: for every parameter of the store,
//   train-state.safetensors.index.json           its master weights under its own (Hugging Face)
//                                                name, Adam's first moment as "<name>.exp_avg"
//                                                and the second as "<name>.exp_avg_sq" (PyTorch's
//                                                names); one train-state.safetensors when small;
//                                                written by several processes (ZeRO-1), a tensor
//                                                their parts divide in pieces "<name>@<first>"
//   train_state.json                             the rest of the state (step, schedule, data
//                                                position, options, model config, version; see
//                                                docs/checkpointing.md), written by the caller
//   config.json, ... (optional)                  small files the caller adds
//   checksums.xxh128                             "<32 hex digits>  <file name>" per file, written
//                                                last; `xxhsum -H2 -c checksums.xxh128` checks it
//
// The bf16 compute copies are not stored: they are the masters rounded to nearest even, and
// are recomputed on load. The tensors stream from the store unit by unit while the files are
// written (no second copy of the model in memory), in an order the caller chooses, and the
// caller hears when each unit has been read, so training may go on updating the units already
// written while the rest are (train/checkpointer.hpp does this).
//
// The folder is written as write_safetensors_sharded writes one: staged beside its target,
// fsynced, renamed into place; a crash at any moment leaves the previous contents or the new
// ones. CheckpointFolder keeps a run's checkpoints (step-00000120/ ...) with an atomically
// replaced `latest` pointer and removes the oldest beyond a count once a new one is complete.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/io/safetensors.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain::io {

inline constexpr std::string_view kTrainStateFile = "train_state.json";
inline constexpr std::string_view kChecksumsFile = "checksums.xxh128";
inline constexpr std::string_view kTrainStateShards = "train-state";  ///< shard base name

struct TrainCheckpointWriteOptions {
  /// The contents of train_state.json (a JSON object).
  nlohmann::json state = nlohmann::json::object();
  /// More small files for the folder (e.g. "config.json"): name -> contents.
  std::map<std::string, std::string> extra_files;
  /// The store's units in the order their tensors are written, each once (empty: store order).
  std::vector<std::size_t> unit_order;
  /// Called from the writing thread once every tensor of `unit` has been read from the store
  /// (the unit may change from then on), and for every unit not yet announced if the write
  /// fails (the caller must not wait on it forever). May be empty: then the store must be
  /// settled (no trainer update in flight, HostParamStore::check_settled); with it, the caller
  /// orders its updates after the announcements (as the Checkpointer does).
  std::function<void(std::size_t unit)> unit_done;
  /// Largest shard, in bytes of tensor data.
  std::uint64_t max_shard_bytes = 2'000'000'000;
};

/// Writes the train state of `store` plus `options.state` as a checkpoint folder at `dir`
/// (replaced atomically; its parent must exist). Throws megatrain::Error naming the file for any
/// failure (a full disk, say), leaving `dir` as it was and no temporary files behind. Returns the
/// files written with their digests.
std::vector<WrittenFile> write_train_checkpoint(const std::filesystem::path& dir, const HostParamStore<float>& store,
                                                const TrainCheckpointWriteOptions& options);

/// A checkpoint that every process of a run whose optimizer state is sharded (ZeRO-1,
/// StoreShard) writes together into one folder, each process the masters and moments of its part
/// of every unit (HostParamStore::shard_bounds), in parallel and without gathering anything: a
/// tensor that two parts divide is stored as pieces, `<name>@<first element>` (1-D, fp32, its
/// elements from that one on in row-major order), which TrainCheckpoint::load_into joins. The
/// first process stages the folder; the others write their files into it; the first lists every
/// file in checksums.xxh128 and puts the folder in place only once every process has written its
/// files, so that a checkpoint missing a process's part is never taken as complete.
///
/// Every process builds one with the same arguments at the same step (the constructor and
/// finish() are collectives of `comm`); write_part() may run on another thread, as the
/// Checkpointer's writer, while no collective of `comm` runs on it.
class PartedCheckpointWrite {
 public:
  /// Plans the files; the first process stages the folder, the others find it. Throws on every
  /// process alike where that fails (e.g. a process that does not see the folder).
  PartedCheckpointWrite(const std::filesystem::path& dir, const HostParamStore<float>& store,
                        TrainCheckpointWriteOptions options, dist::HostComm& comm);
  ~PartedCheckpointWrite();
  PartedCheckpointWrite(const PartedCheckpointWrite&) = delete;
  PartedCheckpointWrite& operator=(const PartedCheckpointWrite&) = delete;
  /// Writes this process's files (announcing each unit through options.unit_done once its part is
  /// read, and every unit at the end, also on failure). Never throws: finish() reports.
  void write_part() noexcept;
  /// Collective, after write_part(): the first process lists every file and puts the folder in
  /// place. Returns every file of the checkpoint; throws on every process alike where any process
  /// failed (naming it and, on that process, what happened), leaving the folder as it was.
  std::vector<WrittenFile> finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// What PartedCheckpointWrite (and a Checkpointer of several processes) throws on a process that did
/// not fail itself: another process did, and its own message says why.
class OtherProcessFailed : public Error {
 public:
  using Error::Error;
};

/// A step the processes of `comm` take together (a collective): each runs `fn` where `here`, and
/// then every process learns which failed and throws alike: its own message where `fn` threw,
/// OtherProcessFailed with `elsewhere(the ranks that failed)` on the others. Returns everywhere
/// when none failed.
void agree_on(dist::HostComm& comm, bool here, const std::function<void()>& fn,
              const std::function<std::string(const std::vector<int>& failed)>& elsewhere);

/// Every process's part at once (PartedCheckpointWrite, collective): the checkpoint of a sharded
/// store without gathering it.
std::vector<WrittenFile> write_train_checkpoint(const std::filesystem::path& dir, const HostParamStore<float>& store,
                                                const TrainCheckpointWriteOptions& options, dist::HostComm& comm);

/// Whether a run's processes see one folder (one file system): the first creates a probe file in
/// `root` and passes the key it returns to the others, which look for it; the first removes it
/// after (a crash leaves it for CheckpointFolder::prepare to remove).
std::int64_t shared_folder_probe(const std::filesystem::path& root);
bool sees_folder_probe(const std::filesystem::path& root, std::int64_t key);
void remove_folder_probe(const std::filesystem::path& root, std::int64_t key);

/// The separator of a piece's name from its first element ("<name>@<first element>").
inline constexpr char kPieceSeparator = '@';

/// A train-state checkpoint folder, opened and checked.
class TrainCheckpoint {
 public:
  /// Opens `dir`: reads checksums.xxh128, checks every file it lists against its size and digest
  /// (in parallel) and that every file the checkpoint needs is listed, and parses
  /// train_state.json. Throws megatrain::Error naming the folder and the file otherwise (a
  /// truncated or altered file, a missing one). Nothing is loaded. `verify` false skips the
  /// digests (the listing and JSON are still checked): for tools that only read the metadata.
  static TrainCheckpoint open(const std::filesystem::path& dir, bool verify = true);

  const std::filesystem::path& dir() const { return dir_; }
  /// train_state.json.
  const nlohmann::json& state() const { return state_; }
  /// The contents of a small file of the folder (config.json, ...), if the checksums list it.
  std::optional<std::string> file(std::string_view name) const;
  /// Bytes of tensor data (master, exp_avg and exp_avg_sq of every parameter).
  std::uint64_t tensor_bytes() const { return tensor_bytes_; }

  /// Checks that `store` holds exactly the checkpoint's parameters (names, shapes, fp32, all three
  /// kinds present) before writing anything, then reads the masters and both moments into it and
  /// refreshes every unit's bf16 copy (a store without the optimizer state: the masters alone).
  /// Throws naming the tensor otherwise.
  void load_into(HostParamStore<float>& store) const;

 private:
  std::filesystem::path dir_;
  nlohmann::json state_;
  std::map<std::string, std::uint64_t, std::less<>> listed_;  // file -> size
  std::uint64_t tensor_bytes_ = 0;
};

/// A run's checkpoints: `<root>/step-00000120/` folders and a `latest` file naming the newest.
class CheckpointFolder {
 public:
  explicit CheckpointFolder(std::filesystem::path root) : root_(std::move(root)) {}
  const std::filesystem::path& root() const { return root_; }

  /// "step-00000120"
  static std::string name_for(std::int64_t step);
  std::filesystem::path path_for(std::int64_t step) const { return root_ / name_for(step); }

  /// Checkpoint folders present, by step (folders appear under their name only once complete).
  std::vector<std::pair<std::int64_t, std::filesystem::path>> list() const;
  /// The checkpoint `latest` names; without that file, the one of the highest step; nullopt when
  /// there is none. Throws if `latest` names a folder that is not there.
  std::optional<std::filesystem::path> latest() const;

  /// Creates the root if needed and removes what dead writers left in it.
  void prepare() const;
  /// After the folder of `step` is complete: points `latest` at it (atomically), then removes
  /// the checkpoints of lower steps beyond the `keep` newest (0: keep all), each renamed away
  /// before it is deleted. Checkpoints of higher steps (left by a run that went further before
  /// this one resumed from an earlier step) are left alone.
  void commit(std::int64_t step, std::size_t keep) const;

 private:
  std::filesystem::path root_;
};

}  // namespace megatrain::io
