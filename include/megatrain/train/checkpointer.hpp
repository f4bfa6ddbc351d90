// Saving and resuming a run: the train state (io/train_checkpoint.hpp holds the files) written
// while training goes on, and loaded back so that the run continues bit for bit.
//
// A save after step t writes every unit's master weights and Adam moments plus the TrainState
// (step, last gradient norm, options, data position, model config). With overlap (the default),
// save() returns as soon as a writer thread has started, and step t+1 runs meanwhile: the
// writer takes the units in the order step t+1 first changes them (Trainer::update_order), and
// the trainer's optimizer stage waits, unit by unit, until the writer has read a unit before it
// changes it (Trainer::set_update_gate). So the checkpoint holds exactly the state after step t,
// and training stalls only where the disk is slower than the step — and for the write-back of
// the units whose AdamW state lives on the GPU (Trainer::finish_update: their state is copied
// into the store before save() returns, and loaded back by the next step; a few seconds for a
// large model).
//
// A run's checkpoints live in one folder (io::CheckpointFolder: step-00000120/ ..., `latest`);
// each save is complete and in place before `latest` names it and before older ones beyond
// `keep` are removed. A save that fails (a full disk) leaves the previous checkpoint and the
// state in memory as they were; its error comes back from poll() or wait(), and training may go on.
//
// Several processes whose optimizer state is sharded (ZeRO-1; CheckpointerOptions::comm): every
// process has a Checkpointer and writes its part of the state in parallel, as above
// (io::PartedCheckpointWrite); the first process puts the folder in place once every process's
// files are written. Then save(), poll() and wait() are collectives: every process calls them at
// the same steps (poll() after every step), and they report the same results everywhere.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/json_number.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain {

/// A run's state besides its tensors: what train_state.json holds.
struct TrainState {
  std::int64_t step = 0;                 ///< optimizer steps done
  std::optional<double> last_grad_norm;  ///< global gradient norm of step `step` (what stale clipping uses next)
  /// Steps skipped as non-finite (NonFinite::skip): in all (AdamW's count is step - skipped_steps),
  /// and in a row up to `step`.
  std::int64_t skipped_steps = 0, skipped_in_a_row = 0;
  TrainerOptions options;                ///< the trainer's options, resolved
  std::optional<DataPosition> data;      ///< where the data order stands: the next step reads from here
  nlohmann::json model;                  ///< ModelConfig::to_json() of the model
  nlohmann::json user = nlohmann::json::object();  ///< the caller's own fields (kept as they are)
  std::string megatrain_version;         ///< of the program that wrote it
};

inline nlohmann::json to_json(const TrainState& s) {
  nlohmann::json j{{"format", "megatrain-train-state"},
                   {"format_version", 1},
                   {"megatrain_version", s.megatrain_version},
                   {"step", s.step},
                   {"last_grad_norm", s.last_grad_norm ? nlohmann::json(*s.last_grad_norm) : nlohmann::json(nullptr)},
                   {"skipped_steps", s.skipped_steps},
                   {"skipped_in_a_row", s.skipped_in_a_row},
                   {"trainer", to_json(s.options)},
                   {"model", s.model},
                   {"tensors",
                    {{"dtype", "F32"},
                     {"master", "<parameter name>"},
                     {"exp_avg", "<parameter name>.exp_avg"},
                     {"exp_avg_sq", "<parameter name>.exp_avg_sq"}}},
                   {"user", s.user}};
  if (s.data) {
    j["data"] = {{"seed", s.data->seed},
                 {"epoch", s.data->epoch},
                 {"slot", s.data->slot},
                 {"windows_per_epoch", s.data->windows_per_epoch}};
    // The only random stream of a step is the data order: epoch e's permutation is drawn from
    // mt19937_64 seeded with (seed, e), so (seed, epoch, slot) is the whole generator state.
    j["rng"] = {{"data_order", {{"engine", "mt19937_64"}, {"seed", s.data->seed}, {"epoch", s.data->epoch}}}};
  } else {
    j["data"] = nullptr;
  }
  return j;
}

/// Reads what to_json wrote; throws megatrain::Error naming `what` otherwise.
inline TrainState train_state_from_json(const nlohmann::json& j, std::string_view what) {
  TrainState s;
  try {
    MT_CHECK(j.value("format", "") == "megatrain-train-state", "{}: not a megatrain train state (format '{}')", what,
             j.value("format", ""));
    const int version = json_whole<int>(j.at("format_version"), what, "format_version");
    MT_CHECK(version == 1, "{}: train-state format version {} is not supported by megatrain {} (it reads version 1)", what,
             version, megatrain::version());
    s.megatrain_version = j.at("megatrain_version").get<std::string>();
    s.step = json_whole<std::int64_t>(j.at("step"), what, "step");
    MT_CHECK(s.step >= 0, "{}: step {} is negative", what, s.step);
    if (!j.at("last_grad_norm").is_null()) s.last_grad_norm = j.at("last_grad_norm").get<double>();
    // (absent from train states written before skipping existed: none skipped)
    s.skipped_steps = json_whole_or(j, "skipped_steps", std::int64_t{0}, what);
    s.skipped_in_a_row = json_whole_or(j, "skipped_in_a_row", std::int64_t{0}, what);
    MT_CHECK(s.skipped_steps >= 0 && s.skipped_steps <= s.step && s.skipped_in_a_row >= 0 &&
                 s.skipped_in_a_row <= s.skipped_steps,
             "{}: skipped_steps {} and skipped_in_a_row {} do not fit step {} (0 <= in a row <= skipped <= step)", what,
             s.skipped_steps, s.skipped_in_a_row, s.step);
    s.options = trainer_options_from_json(j.at("trainer"), what);
    s.model = j.at("model");
    s.user = j.at("user");
    if (!j.at("data").is_null()) {
      const auto& d = j.at("data");
      s.data = DataPosition{json_whole<std::uint64_t>(d.at("seed"), what, "data.seed"),
                            json_whole<std::int64_t>(d.at("epoch"), what, "data.epoch"),
                            json_whole<std::int64_t>(d.at("slot"), what, "data.slot"),
                            json_whole<std::int64_t>(d.at("windows_per_epoch"), what, "data.windows_per_epoch")};
    }
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("{}: the train state is malformed: {}", what, e.what());
  }
  return s;
}

/// The keys of two model configs (ModelConfig::to_json) whose values differ, as "key: a vs b".
inline std::vector<std::string> model_differences(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> out;
  for (const auto& [k, v] : a.items())
    if (!b.contains(k) || b.at(k) != v) out.push_back(fmt::format("{}: {} vs {}", k, v.dump(), b.contains(k) ? b.at(k).dump() : "absent"));
  for (const auto& [k, v] : b.items())
    if (!a.contains(k)) out.push_back(fmt::format("{}: absent vs {}", k, v.dump()));
  return out;
}

struct CheckpointerOptions {
  std::size_t keep = 2;  ///< checkpoints kept, newest first (0: all)
  /// Write while the next step trains (save() returns at once); false: save() returns once the
  /// checkpoint is complete.
  bool overlap = true;
  std::uint64_t max_shard_bytes = 2'000'000'000;  ///< largest tensor file
  /// Small files copied into every checkpoint (config.json, tokenizer files): name -> contents.
  std::map<std::string, std::string> extra_files;
  /// The processes of a run whose store is sharded (ZeRO-1): each writes its part (see the top of
  /// this file). Null: this process writes the whole state (a store that is not sharded).
  dist::HostComm* comm = nullptr;
};

/// What one save did.
struct SaveResult {
  std::int64_t step = 0;
  std::filesystem::path dir;  ///< the checkpoint folder (complete when ok)
  bool ok = false;
  std::string error;          ///< why it failed (when !ok); the previous checkpoint is intact
  /// Several processes: the failure was another process's (whose own result says why).
  bool failed_elsewhere = false;
  double seconds = 0;         ///< from save() until the folder was in place
  /// How long training waited for this save (overlap): the trainer's optimizer for the writer,
  /// and the next save() for it to finish: what the save added to the steps that ran meanwhile.
  double stall_seconds = 0;
  std::uint64_t bytes = 0;    ///< of all files written
};

/// While a save is written the Checkpointer refers to the trainer and the store it was given:
/// destroy it (or call wait()) before either of them goes.
class Checkpointer {
 public:
  /// Checkpoints go to `folder` (created if needed; what dead writers left there is removed).
  /// With options.comm, a collective: the first process prepares the folder and every other checks
  /// that it sees it (one file system), throwing on every process alike otherwise.
  explicit Checkpointer(std::filesystem::path folder, CheckpointerOptions options = {})
      : folder_(std::move(folder)), options_(std::move(options)) {
    if (!options_.comm) {
      folder_.prepare();
      return;
    }
    dist::HostComm& comm = *options_.comm;
    const std::string root = folder_.root().string();
    std::int64_t key[1] = {0};
    io::agree_on(comm, comm.rank() == 0, [&] {
      folder_.prepare();
      key[0] = io::shared_folder_probe(folder_.root());
    }, [&](const std::vector<int>&) { return fmt::format("process 0 could not prepare the checkpoint folder '{}'", root); });
    comm.all_reduce_sum(key);
    const auto blind = [&](const std::string& who) {
      return fmt::format("{} the checkpoint folder '{}' that process 0 prepared: the processes of a run write its "
                         "checkpoints together into one folder, so it must be on a file system every host mounts (give "
                         "--out such a folder)", who, root);
    };
    try {
      io::agree_on(comm, comm.rank() != 0, [&] {
        MT_CHECK(io::sees_folder_probe(folder_.root(), key[0]), "{}", blind(fmt::format("process {} does not see", comm.rank())));
      }, [&](const std::vector<int>& who) { return blind(fmt::format("process(es) {} do not see", fmt::join(who, ", "))); });
    } catch (...) {
      if (comm.rank() == 0) io::remove_folder_probe(folder_.root(), key[0]);
      throw;
    }
    if (comm.rank() == 0) io::remove_folder_probe(folder_.root(), key[0]);
  }
  ~Checkpointer() { join(); }
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  const io::CheckpointFolder& folder() const { return folder_; }
  const CheckpointerOptions& options() const { return options_; }

  /// Saves the state after the trainer's last step: waits for a save still in flight (its
  /// result is kept for the next poll() or wait()), then writes (see the top of this file).
  /// `data`: where the data order stands for the next step; `user`: the caller's own fields for
  /// train_state.json. Call between steps, from the thread that calls trainer.step(). Errors of
  /// the write itself come back from poll() or wait(); errors in the arguments throw here,
  /// before anything is written.
  template <class T>
  void save(T& trainer, const HostParamStore<float>& store, std::optional<DataPosition> data = std::nullopt,
            nlohmann::json user = nlohmann::json::object()) {
    MT_NVTX_RANGE("Checkpointer::save");
    // Training waits here for the previous save, if it is still being written: that wait is what
    // the previous save cost the steps (its stall), with the optimizer's waits for its writer.
    const auto waited_from = std::chrono::steady_clock::now();
    if (parted_) complete(waited_from);  // (several processes: every one calls save at the same step)
    join(waited_from);
    trainer.finish_update();  // the checkpoint holds the state after the last step, its update applied
    const bool parted = options_.comm != nullptr;
    MT_CHECK(parted || store.state_whole(), "this store keeps part {} of {} of the optimizer state (a run sharded over "
             "processes, ZeRO-1): give the Checkpointer of every process the communicator (CheckpointerOptions::comm)",
             store.shard().index, store.shard().count);
    MT_CHECK(!parted || store.sharded(), "CheckpointerOptions::comm is for a store sharded over the processes (ZeRO-1); "
             "this one holds the whole state: save from one process without it");
    TrainState st;
    st.step = trainer.steps_done();
    st.last_grad_norm = trainer.last_grad_norm();
    st.skipped_steps = trainer.skipped_steps();
    st.skipped_in_a_row = trainer.skipped_in_a_row();
    st.options = trainer.options();
    st.data = data;
    st.model = trainer.model().config().to_json();
    st.user = std::move(user);
    st.megatrain_version = std::string(version());

    auto gate = std::make_shared<Gate>(store.num_units());
    io::TrainCheckpointWriteOptions w;
    w.state = to_json(st);
    w.extra_files = options_.extra_files;
    w.unit_order = trainer.update_order();
    w.unit_done = [gate](std::size_t u) { gate->release(u); };
    w.max_shard_bytes = options_.max_shard_bytes;
    trainer.set_update_gate([gate](std::size_t u) { gate->wait(u); });
    uninstall_ = [&trainer] { trainer.set_update_gate({}); };

    const std::int64_t step = st.step;
    const auto t0 = std::chrono::steady_clock::now();
    auto result = std::make_shared<SaveResult>();
    result->step = step;
    result->dir = folder_.path_for(step);
    if (parted) {
      // (every process: the first stages the folder; each writes its part on its writer thread,
      // and poll() or wait() completes the checkpoint once every process has written its part)
      try {
        parted_ = std::make_unique<io::PartedCheckpointWrite>(result->dir, store, std::move(w), *options_.comm);
      } catch (const Error& e) {  // (thrown on every process alike: the collectives agreed)
        result->failed_elsewhere = dynamic_cast<const io::OtherProcessFailed*>(&e) != nullptr;
        trainer.set_update_gate({});
        uninstall_ = nullptr;
        result->error = e.reason();
        result->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        finished_.push_back(*result);
        return;
      }
      writer_ = std::thread([this, gate] {
        parted_->write_part();
        gate->release_all();
        gate->finished = true;
      });
      result_ = std::move(result);
      gate_ = std::move(gate);
      start_ = t0;
      // The masters that the processes map together (the embedding's, StoreShard::shares_masters_of)
      // of a device unit are written whole by any process whose trainer brings them back from its
      // GPU (finish_update, after the next step): every process has read its part of them before
      // any returns. (A host unit's each process steps in its part only, after its own writer.)
      bool mapped = false;
      for (std::size_t u = 0; u < std::min(store.num_units(), trainer.device_units()); ++u)
        if (store.shard().shares_masters_of(u)) {
          gate_->wait(u);
          mapped = true;
        }
      if (mapped) {
        std::int64_t one[1] = {1};
        options_.comm->all_reduce_sum(one);
      }
      if (!options_.overlap) complete();
      return;
    }
    writer_ = std::thread([this, &store, w = std::move(w), result, gate, t0, step] {
      try {
        for (const auto& f : io::write_train_checkpoint(result->dir, store, w)) result->bytes += f.bytes;
        folder_.commit(step, options_.keep);
        result->ok = true;
      } catch (const Error& e) {
        result->error = e.reason();  // (what went wrong, in the user's terms)
      } catch (const std::exception& e) {
        result->error = e.what();
      }
      gate->release_all();  // (a write that failed early announced nothing)
      result->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gate->finished = true;
    });
    result_ = std::move(result);
    gate_ = std::move(gate);
    if (!options_.overlap) join();
  }

  /// Waits for the save in flight; returns what every save since the last poll() or wait() did,
  /// oldest first (none: empty).
  std::vector<SaveResult> wait() {
    if (parted_) complete();
    join();
    return std::exchange(finished_, {});
  }

  /// Whether a save is still being written (by this process).
  bool in_flight() const { return writer_.joinable() && !gate_->finished; }

  /// Without waiting: what the saves that have finished since the last poll() or wait() did,
  /// oldest first (a save still being written is reported by a later call; with several
  /// processes, one still being written by any of them).
  std::vector<SaveResult> poll() {
    if (parted_) {
      std::int64_t writing[1] = {in_flight() ? 1 : 0};
      options_.comm->all_reduce_sum(writing);
      if (writing[0] == 0) complete();
    }
    if (!in_flight()) join();
    return std::exchange(finished_, {});
  }

 private:
  // With several processes (collective): waits for this process's part, then completes the
  // checkpoint (PartedCheckpointWrite::finish, the first process pointing `latest` at it) and
  // keeps the result, the same on every process.
  void complete(std::optional<std::chrono::steady_clock::time_point> waited_from = std::nullopt) {
    if (writer_.joinable()) writer_.join();
    SaveResult& r = *result_;
    try {
      for (const auto& f : parted_->finish()) r.bytes += f.bytes;
      io::agree_on(*options_.comm, options_.comm->rank() == 0, [&] { folder_.commit(r.step, options_.keep); },
                   [](const std::vector<int>&) {
                     return std::string("process 0 could not point the run's `latest` at it (its message says why)");
                   });
      r.ok = true;
    } catch (const Error& e) {
      r.error = e.reason();
      r.failed_elsewhere = dynamic_cast<const io::OtherProcessFailed*>(&e) != nullptr;
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    parted_.reset();
    if (uninstall_) uninstall_();
    uninstall_ = nullptr;
    {
      std::lock_guard lock(gate_->m);
      r.stall_seconds = gate_->stalled;
    }
    if (waited_from) r.stall_seconds += seconds_since(*waited_from);
    finished_.push_back(std::move(r));
    result_.reset();
    gate_.reset();
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  // Joins the writer thread, if any, and keeps its result in finished_. `waited_from`: training
  // waits for it from then (save() of the next checkpoint), which counts as its stall.
  void join(std::optional<std::chrono::steady_clock::time_point> waited_from = std::nullopt) {
    if (!writer_.joinable()) return;
    writer_.join();
    if (parted_) return;  // (several processes: complete() reports it, with the others)
    if (uninstall_) uninstall_();
    uninstall_ = nullptr;
    SaveResult r = *result_;
    {
      std::lock_guard lock(gate_->m);
      r.stall_seconds = gate_->stalled;
    }
    if (waited_from) r.stall_seconds += seconds_since(*waited_from);
    finished_.push_back(std::move(r));
    result_.reset();
    gate_.reset();
  }

  // Units the writer has read: the optimizer waits here before changing a unit.
  struct Gate {
    explicit Gate(std::size_t units) : done(units, 0) {}
    void wait(std::size_t u) {
      std::unique_lock lock(m);
      if (done[u]) return;
      const auto t0 = std::chrono::steady_clock::now();
      cv.wait(lock, [&] { return done[u] != 0; });
      stalled += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    void release(std::size_t u) {
      {
        std::lock_guard lock(m);
        done[u] = 1;
      }
      cv.notify_all();
    }
    void release_all() {
      {
        std::lock_guard lock(m);
        std::fill(done.begin(), done.end(), 1);
      }
      cv.notify_all();
    }
    std::mutex m;
    std::condition_variable cv;
    std::vector<char> done;
    double stalled = 0;  // seconds the optimizer waited (guarded by m)
    std::atomic<bool> finished{false};  // the writer thread is done
  };

  io::CheckpointFolder folder_;
  CheckpointerOptions options_;
  std::thread writer_;
  std::shared_ptr<SaveResult> result_;
  std::shared_ptr<Gate> gate_;
  std::vector<SaveResult> finished_;  // results not yet returned by poll() or wait()
  std::function<void()> uninstall_;
  std::unique_ptr<io::PartedCheckpointWrite> parted_;  // (several processes: the save in flight)
  std::chrono::steady_clock::time_point start_;
};

/// Opens the checkpoint folder `dir` (every file checked against its checksum), checks that it
/// was saved from this trainer's model and with options that give the same update
/// (update_differences), then loads the tensors into `store` and restores the trainer's step
/// count and last norm. Throws megatrain::Error before changing anything when a check fails.
/// Returns the state, whose `data` says where the data order continues.
template <class T>
TrainState load_train_state(const io::TrainCheckpoint& ckpt, T& trainer, HostParamStore<float>& store) {
  MT_NVTX_RANGE("load_train_state");
  trainer.finish_update();  // (an update in flight would overwrite what is loaded)
  const std::string dir = ckpt.dir().string();
  TrainState st = train_state_from_json(ckpt.state(), (ckpt.dir() / io::kTrainStateFile).string());
  const auto model_diff = model_differences(st.model, trainer.model().config().to_json());
  MT_CHECK(model_diff.empty(), "checkpoint '{}' was saved from another model (checkpoint vs this one: {})", dir,
           fmt::join(model_diff, "; "));
  std::vector<std::string> diff;
  for (const auto& d : update_differences(st.options, trainer.options())) diff.push_back(d.str());
  MT_CHECK(diff.empty(), "checkpoint '{}' was trained with other options (checkpoint vs this trainer: {}); resuming would "
           "change the update", dir, fmt::join(diff, "; "));
  ckpt.load_into(store);
  trainer.restore(st.step, st.last_grad_norm, st.skipped_steps, st.skipped_in_a_row);
  return st;
}

/// The same, opening (and checking) the checkpoint folder `dir` first.
template <class T>
TrainState load_train_state(const std::filesystem::path& dir, T& trainer, HostParamStore<float>& store) {
  return load_train_state(io::TrainCheckpoint::open(dir), trainer, store);
}

}  // namespace megatrain
